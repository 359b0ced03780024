"""`fedtier agent|edge|coordinator install-service`: a systemd unit that restarts the node on failure."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedtier.cli import cli
from fedtier.runtime.service_unit import install, unit


def _settings(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_a_unit_restarts_on_failure_but_not_on_refused_credentials_and_owns_its_state_dir(tmp_path: Path) -> None:
    service = unit(role="edge", node="cell a", args=["edge", "run", "--config", "/etc/fedtier/edge a.toml"],
                   state_dir="fedtier-edge", user="fedtier")
    s = _settings(service.text)
    assert s["Restart"] == "on-failure" and s["RestartPreventExitStatus"] == "77"
    assert s["StateDirectory"] == "fedtier-edge" and s["User"] == "fedtier" and s["KillSignal"] == "SIGTERM"
    assert shlex.split(s["ExecStart"])[-4:] == ["edge", "run", "--config", "/etc/fedtier/edge a.toml"]
    assert service.name == "fedtier-edge-cell a.service"
    path = install(service, tmp_path / "units")
    assert path.read_text() == service.text


@pytest.mark.parametrize("args, expected", [
    (["agent", "install-service", "--config", "{cfg}"], ["agent", "run", "--config", "{cfg}"]),
    (["edge", "install-service", "--config", "{cfg}"], ["edge", "run", "--config", "{cfg}"]),
    (["coordinator", "install-service", "--state-dir", "{dir}"], ["coordinator", "serve", "--state-dir", "{dir}"]),
])
def test_install_service_prints_or_writes_the_unit_of_each_role(tmp_path: Path, args: list[str],
                                                                 expected: list[str]) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text("")
    fill = {"cfg": str(cfg), "dir": str(tmp_path / "state")}
    args = [a.format(**fill) for a in args]
    printed = CliRunner().invoke(cli, [*args, "--print"])
    assert printed.exit_code == 0, printed.output
    assert shlex.split(_settings(printed.output)["ExecStart"])[-4:] == [a.format(**fill) for a in expected]
    written = CliRunner().invoke(cli, [*args, "--unit-dir", str(tmp_path / "units")])
    assert written.exit_code == 0, written.output
    (unit_file,) = (tmp_path / "units").iterdir()
    assert unit_file.read_text() == printed.output and "systemctl enable --now" in written.output


def _systemd_analyze() -> str:
    import shutil

    from conftest import require

    found = shutil.which("systemd-analyze")
    require(found is not None, "systemd-analyze (Debian's systemd package; install.sh)")
    assert found is not None
    return found


@pytest.mark.parametrize("role, args", [
    ("agent", ["agent", "install-service", "--config", "{cfg}"]),
    ("edge", ["edge", "install-service", "--config", "{cfg}"]),
    ("coordinator", ["coordinator", "install-service"]),
    ("coordinator", ["coordinator", "install-service", "--state-dir", "{dir}", "--user", "root"]),
])
def test_each_generated_unit_is_sandboxed_to_an_exposure_of_at_most_4(tmp_path: Path, role: str,
                                                                        args: list[str]) -> None:
    """``systemd-analyze security --offline=yes`` of the unit ``install-service`` writes (was 9.6 "UNSAFE":
    root, no sandbox), and ``systemd-analyze verify`` accepts it."""
    import re
    import subprocess

    from fedtier.runtime.service_unit import MAX_EXPOSURE

    analyze = _systemd_analyze()
    cfg = tmp_path / "node.toml"
    cfg.write_text("")
    args = [a.format(cfg=cfg, dir=tmp_path / "state") for a in args]
    written = CliRunner().invoke(cli, [*args, "--unit-dir", str(tmp_path / "units")])
    assert written.exit_code == 0, written.output
    (path,) = (tmp_path / "units").iterdir()
    s = _settings(path.read_text())

    done = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(path)], capture_output=True,
                          text=True, timeout=60)
    verified = subprocess.run([analyze, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60)

    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert found, done.stdout + done.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE, done.stdout
    assert verified.returncode == 0 and verified.stdout.strip() == "", verified.stdout + verified.stderr
    assert s["NoNewPrivileges"] == "yes" and s["ProtectSystem"] == "strict" and s["PrivateTmp"] == "yes"
    assert s["PrivateDevices"] == "yes" and s["RestrictAddressFamilies"] == "AF_UNIX AF_INET AF_INET6"
    if "--user" in args:
        assert "User" not in s and "DynamicUser" not in s
        assert s["ReadWritePaths"] == str(tmp_path / "state")  # a store beyond the unit's state directory
    else:
        assert s["User"] == "fedtier" and s["DynamicUser"] == "yes" and "useradd" in written.output
    print(f"{role}: {found.group(0)}")

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

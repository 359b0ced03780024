"""``fedtier demo``'s options before anything starts: the privacy config it writes, the plan it
prints, the combinations it refuses; and its reaper, which stops the children of a killed demo."""

from __future__ import annotations

import re
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fedtier.rollout.config import RolloutConfig
from local_fleet.demo import CollectingView, Demo, DemoOptions, PrivacyDemo, plan_lines
from cloud_coordinator.privacy.plan_view import plan_document
from local_fleet.reaper import read_groups
from fedtier.cli import cli



def plan_of(tmp_path: Path, **options: Any) -> tuple[Demo, dict[str, Any]]:
    demo = Demo(DemoOptions(workdir=tmp_path, **options), CollectingView())
    cfg = RolloutConfig.from_mapping({**demo.rollout_config(), "broker": {"host": "127.0.0.1", "port": 1883}})
    return demo, plan_document(cfg, tmp_path / "coordinator.toml")


def test_privacy_defaults_trust_the_first_cell_and_show_each_label_and_tier(tmp_path: Path) -> None:
    demo, plan = plan_of(tmp_path, privacy=PrivacyDemo(), broker="embedded")
    config = demo.rollout_config()
    assert config["topology"]["trusted"] == {"cell-a": True}
    assert config["privacy"] == {"epsilon": 8.0, "delta": 1e-5, "clip": 1.0, "require_tls": False}
    lines = plan_lines(plan, demo.members())
    text = "\n".join(lines)
    assert re.search(r"epsilon 8 per device at delta 1e-05 over 30 rounds", lines[0])
    assert re.search(r"cell-a\s+trusted\s+its 6 devices send clear updates WITHOUT TLS", text)
    assert re.search(r"cell-b\s+untrusted\s+each of its 6 devices adds noise", text)
    assert re.search(r"cloud\s+untrusted\s+adds no noise", text)
    z_device, z_edge = plan["tiers"]["device"]["z"], plan["tiers"]["edge"]["z"]
    assert f"device tier z {z_device:.3g}" in text and f"edge tier z {z_edge:.3g}" in text
    assert "WARNING: require_tls = false" in text  # the plan's own warning, passed through


def test_trusted_cells_can_be_chosen_or_none(tmp_path: Path) -> None:
    demo, plan = plan_of(tmp_path, cells=3, devices=6, privacy=PrivacyDemo(trusted=("cell-a", "cell-c")),
                         broker="embedded")
    assert demo.rollout_config()["topology"]["trusted"] == {"cell-a": True, "cell-c": True}
    text = "\n".join(plan_lines(plan, demo.members()))
    assert re.search(r"cell-b\s+untrusted", text) and re.search(r"cell-c\s+trusted", text)
    demo, plan = plan_of(tmp_path, privacy=PrivacyDemo(trusted=()), broker="embedded")
    assert "trusted" not in demo.rollout_config()["topology"]
    assert not plan["tiers"]["edge"]["injectors"]
    assert "edge tier" not in plan_lines(plan, demo.members())[-1]


def test_a_trusted_cell_turns_tls_on_when_mosquitto_is_there(tmp_path: Path) -> None:
    from local_fleet.demo import mosquitto_path

    demo = Demo(DemoOptions(workdir=tmp_path, privacy=PrivacyDemo()), CollectingView())
    assert demo.secure == (mosquitto_path() is not None)
    assert demo.rollout_config()["privacy"]["require_tls"] == demo.secure
    untrusted = Demo(DemoOptions(workdir=tmp_path, privacy=PrivacyDemo(trusted=())), CollectingView())
    assert not untrusted.secure  # nothing travels clear: no reason to provision


@pytest.mark.parametrize(("args", "message"), [
    (["--privacy", "--algorithm", "qhetfed"], "qhetfed's in-cell gradient exchange is not covered"),
    (["--privacy", "--algorithm", "fedxl"], "fedxl shares every device's scores, data-dependent releases"),
    (["--epsilon", "4"], "--epsilon only make sense with --privacy"),
    (["--compare", "--trusted", "cell-a"], "--trusted, --compare only make sense with --privacy"),
    (["--privacy", "--trusted", "cell-a,cell-z"], "--trusted names cell-z, but the demo's cells are cell-a, cell-b"),
    (["--secure-aggregation", "--algorithm", "hier_qsgd"], "--secure-aggregation runs with fedavg"),
    (["--processes"], "--processes only makes sense with --privacy"),
    (["--sample-rate", "0.5"], "--sample-rate only makes sense with --privacy"),
    (["--privacy", "--secure-aggregation", "--sample-rate", "0.5"], "--sample-rate is the private fleet's"),
    (["--privacy", "--processes", "--devices", "600"], "at most 500 with one process each"),
])
def test_refused_combinations_are_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["demo", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_help_shows_the_privacy_options_and_an_example() -> None:
    result = CliRunner().invoke(cli, ["demo", "--help"])
    assert result.exit_code == 0
    for option in ("--privacy", "--epsilon", "--delta", "--trusted", "--compare", "--clip"):
        assert option in result.output
    assert "fedtier demo --privacy --compare" in result.output


# --- the reaper -----------------------------------------------------------------------------------


def test_the_reaper_keeps_only_groups_not_yet_stopped() -> None:
    import io

    assert read_groups(io.StringIO("+10\n+11\n-10\ngarbage\n+\n-x\n+12\n")) == {11, 12}


def test_the_reaper_stops_the_groups_left_when_its_pipe_closes() -> None:
    """As when the demo is SIGKILLed: the kernel closes the pipe, the reaper stops what is left."""
    left = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stopped = subprocess.Popen(["sleep", "60"], start_new_session=True)
    # Reap ``left`` as soon as it dies, as init does for the orphans of a killed demo (a zombie
    # still counts as a member of its group).
    waiter = ThreadPoolExecutor(1).submit(left.wait)
    reaper = subprocess.Popen([sys.executable, "-m", "local_fleet.reaper"], stdin=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert reaper.stdin is not None
        reaper.stdin.write(f"+{left.pid}\n+{stopped.pid}\n-{stopped.pid}\n")
        reaper.stdin.close()
        assert reaper.wait(timeout=30) == 0
        assert waiter.result(timeout=30) == -signal.SIGTERM
        assert stopped.poll() is None  # taken off the list: left alone (the reaper has exited)
    finally:
        for p in (left, stopped, reaper):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_fedxl_demo_trains_a_scorer_on_one_class_devices(tmp_path: Path) -> None:
    demo = Demo(DemoOptions(workdir=tmp_path, algorithm="fedxl"), CollectingView())
    config = demo.rollout_config()
    assert config["data"]["dataset"] == "rare_event" and config["data"]["partition"] == "one_class"
    assert config["model"] == {"kind": "mlp", "hidden": []}
    assert config["fedxl"]["objective"] == "pauc" and config["fedxl"]["batch_size"] == 8
    assert "rare-event task" in demo.task_description()
    RolloutConfig.from_mapping({**config, "state_dir": str(tmp_path / "c")})  # a valid rollout



def test_secure_aggregation_demo_prints_the_distributed_plan_privacy_plan_prints(tmp_path: Path) -> None:
    """`demo --secure-aggregation --privacy`: every cell's devices share its noise and no edge sees a clear update
    or adds noise, as `fedtier privacy plan` says of the same config (issue 33): the cell lines are its own."""
    from cloud_coordinator.privacy.plan_view import cell_lines, render_plan

    demo, plan = plan_of(tmp_path, privacy=PrivacyDemo(), secure_aggregation=True, broker="embedded")
    text = "\n".join(plan_lines(plan, demo.members()))
    assert "clear updates" not in text and "0 releases" not in text and "device tier z" not in text
    for cell in ("cell-a", "cell-b"):
        assert re.search(rf"{cell}\s+(un)?trusted\s+secure aggregation: each of its 6 devices adds a share of the "
                         r"cell's noise .* the edge sees only the sum and adds nothing; one release a round", text)
    assert "distributed DP: secure aggregation in every cell" in text
    assert set(cell_lines(plan)) <= set(render_plan(plan).splitlines())  # the very lines `privacy plan` prints
    assert set(cell_lines(plan)) <= set(text.splitlines())

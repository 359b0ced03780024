"""The coordinator's command: everything checked before state exists, a finished rollout stays
finished (and leaves nothing retained), round numbers a person reads."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from cloud_coordinator.node import CloudNode
from cloud_coordinator.report import round_line, rounds_table, summary
from cloud_coordinator.rollout import prepare
from local_fleet.simulate import simulate
from cloud_coordinator.store import CoordinatorStore
from fedtier.cli import cli
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker


def test_a_missing_signing_key_is_reported_before_any_state_or_artifact_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rollout.toml").write_text('rollout = "r"\nsigning_key = "fleet/signing.key"\n'
                                           '[broker]\nport = 1\n')
    result = CliRunner().invoke(cli, ["coordinator", "run", "--config", "rollout.toml"])
    assert result.exit_code == 2
    assert "[signing_key]" in result.output and "signing.key" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout.toml"]  # no ./fedtier-state, no artifacts


def test_a_finished_rollout_restarted_reopens_nothing_and_clears_its_retained_manifest(
        small_rollout, tmp_path: Path) -> None:
    cfg = small_rollout(rounds=1)
    simulate(cfg, workdir=tmp_path / "w")  # the rollout ran to its end in this state
    broker = MemoryBroker()
    leftover = broker.connect("someone")
    leftover.publish(topics.manifest(cfg.rollout), b"a manifest left behind", retain=True)
    sent: list = []
    edge = broker.connect("edge", sent.append)
    edge.subscribe(topics.cloud_down_filter(next(iter(cfg.topology.layout()))))
    store = CoordinatorStore(tmp_path / "w" / "coordinator.db")
    node = CloudNode(prepared=prepare(cfg), transport=broker.connect("cloud"), store=store, evaluator=None)
    node.start(broker.now)
    broker.run_until_idle()
    assert node.finished and node.cleared and node.done and len(node.history) == 1
    assert sent == []  # no task: nothing reopened
    late: list = []
    broker.connect("late", late.append).subscribe(topics.ALL_MANIFESTS)
    broker.run_until_idle()
    assert late == []  # no retained manifest of the rollout is left
    store.close()


def test_round_numbers_are_the_same_in_lines_tables_and_metrics() -> None:
    row = {"round": 29, "accuracy": 0.95, "loss": 0.2, "devices_reported": 12, "bytes": {}, "round_s": 0.1}
    assert round_line(row, 30).startswith("round  29 (30/30)")
    console = Console(file=io.StringIO(), width=200)
    console.print(rounds_table([row]))
    table = console.file.getvalue()
    assert re.search(r"^\s+29\s+0\.9500", table, re.M), table
    console = Console(file=io.StringIO(), width=200)
    console.print(summary([row], 1.0, "t"))
    assert "after 1 rounds (round 29)" in console.file.getvalue()

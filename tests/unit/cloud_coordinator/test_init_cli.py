"""`fedtier init DIR`: the starter rollout runs with `fedtier simulate` as written."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from cloud_coordinator.config import RolloutConfig
from fedtier.cli import cli
from fedtier.runtime.config import load


def test_the_starter_rollout_runs_as_written(tmp_path: Path) -> None:
    # Prepare
    runner = CliRunner()
    created = runner.invoke(cli, ["init", str(tmp_path / "starter")])
    assert created.exit_code == 0, created.output
    config = tmp_path / "starter" / "rollout.toml"
    cfg = load(RolloutConfig, config)
    # The newcomer's path: their own torch model and their own (split) data, federated evaluation on.
    assert cfg.model.kind == "torch" and cfg.data.dataset == "files"
    # Execute: the command the file's first lines name, at a tiny size (2 of its 10 rounds).
    result = runner.invoke(cli, ["simulate", "--config", str(config), "--rounds", "2"])
    # Assert: both rounds closed with every device, evaluated centrally and by the devices.
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "starter" / "state" / "metrics.json").read_text())
    assert doc["finished"] and [r["round"] for r in doc["rounds"]] == [0, 1]
    for row in doc["rounds"]:
        assert row["devices_reported"] == 6 and row["accuracy"] is not None
        assert row["federated"]["devices"] == 6 and row["federated"]["examples"] > 0
    assert "federated accuracy" in result.output


def test_init_refuses_a_directory_with_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    result = CliRunner().invoke(cli, ["init", str(tmp_path)])
    assert result.exit_code == 2 and "--force" in result.output
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "rollout.toml").exists()

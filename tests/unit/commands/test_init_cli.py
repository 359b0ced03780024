"""`fedtier init DIR`: the starter rollout runs with `fedtier simulate` as written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fedtier.rollout.config import RolloutConfig
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


@pytest.mark.slow
def test_the_starter_rollout_ends_the_same_with_devices_on_the_portable_backend(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """All 10 rounds of the starter as written (a CNN with MaxPool), once with onnxruntime-training on the
    devices and once with the portable graph (`--trainer portable`): the same rounds, to float rounding."""
    # Prepare
    from device_agent.trainers.portable import PortableTrainer

    portable_runs: list[int] = []
    real_train_steps = PortableTrainer.train_steps

    def counted(self: PortableTrainer, batches: Any, lr: float) -> Any:
        portable_runs.append(1)
        return real_train_steps(self, batches, lr)

    monkeypatch.setattr(PortableTrainer, "train_steps", counted)
    runner = CliRunner()
    assert runner.invoke(cli, ["init", str(tmp_path / "starter")]).exit_code == 0
    config = str(tmp_path / "starter" / "rollout.toml")
    # Execute
    runs = {}
    for trainer in ("ort", "portable"):
        result = runner.invoke(cli, ["simulate", "--config", config, "--json", "--trainer", trainer])
        assert result.exit_code == 0, result.output
        runs[trainer] = json.loads(result.output)["rounds"]
        assert len(portable_runs) == (60 if trainer == "portable" else 0)  # 6 devices x 10 rounds
    # Assert: every round's central and federated evaluation agree, and the model learnt.
    ort, portable = runs["ort"], runs["portable"]
    assert len(ort) == len(portable) == 10
    for ours, theirs in zip(portable, ort, strict=True):
        assert ours["devices_reported"] == theirs["devices_reported"] == 6
        assert abs(ours["accuracy"] - theirs["accuracy"]) <= 1e-4
        assert abs(ours["loss"] - theirs["loss"]) <= 1e-5 * theirs["loss"]
        assert abs(ours["federated"]["accuracy"] - theirs["federated"]["accuracy"]) <= 1e-4
        assert abs(ours["federated"]["loss"] - theirs["federated"]["loss"]) <= 1e-5 * theirs["federated"]["loss"]
    assert ort[-1]["accuracy"] > 0.9


def test_init_refuses_a_directory_with_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    result = CliRunner().invoke(cli, ["init", str(tmp_path)])
    assert result.exit_code == 2 and "--force" in result.output
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "rollout.toml").exists()

"""A user's torch model on data split by `fedtier data split`, through a real Mosquitto, with
federated evaluation reported; the same rollout simulated in memory gives the same model."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from fleet_threads import ThreadFleet

from fedtier.rollout.config import RolloutConfig
from local_fleet.simulate import simulate
from cloud_coordinator.store import CoordinatorStore
from fedtier.cli import cli
from fedtier.runtime.config import load
from fedtier.runtime.node_base import REJECTED

pytestmark = pytest.mark.broker

MODEL_PY = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, kernel_size=3, padding=1)
            self.head = nn.Linear(4 * 8 * 8, 10)

        def forward(self, x):
            return self.head(torch.relu(self.conv(x)).flatten(1))

    def make():
        return Net(), torch.zeros(1, 1, 8, 8)
""")


def test_a_factory_model_on_split_data_trains_over_mosquitto_with_federated_evaluation(
        mosquitto, tmp_path: Path, artifact_store: Path) -> None:
    from local_fleet.configs import write_fleet

    # Prepare: the user's model in a file, their CSV split into 4 shards with held-out rows.
    (tmp_path / "model.py").write_text(MODEL_PY)
    runner = CliRunner()
    for args in (["data", "example", "--out", str(tmp_path / "digits.csv")],
                 ["data", "split", "--input", str(tmp_path / "digits.csv"), "--label-column", "label", "--devices", "4",
                  "--partition", "dirichlet", "--holdout", "0.2", "--test-fraction", "0.2", "--out",
                  str(tmp_path / "shards")]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 0, result.output
    split = json.loads((tmp_path / "shards" / "split.json").read_text())
    rollout = {
        "rollout": "own", "rounds": 2, "seed": 5, "artifact_store": str(artifact_store),
        "state_dir": str(tmp_path / "fleet" / "coordinator"),
        "model": {"kind": "torch", "factory": str(tmp_path / "model.py") + ":make"},
        "data": {"dataset": "files", "dir": str(tmp_path / "shards"), "eval_file": str(tmp_path / "shards/test.npz")},
        "topology": {"cells": 2, "devices_per_cell": 2},
        "fedavg": {"local_steps": 10, "lr": 0.1, "batch_size": 16},
    }
    paths = write_fleet(rollout, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    fleet = ThreadFleet(paths)
    # Execute
    try:
        fleet.start_all()
        cloud = fleet.wait_finished(timeout=120)
    finally:
        fleet.stop()
    # Assert: the agents read their shards (train.npz and eval/) and every device reported both rounds.
    for name, running in fleet.nodes.items():
        assert running.node.metrics.total(REJECTED) == 0, (name, running.node.metrics.snapshot())
    for device, entry in split["devices"].items():
        node = fleet.nodes[device].node
        assert (len(node.data), len(node.eval_data)) == (entry["train"], entry["eval"])
    history = cloud.history
    assert [r["round"] for r in history] == [0, 1]
    held_out = sum(entry["eval"] for entry in split["devices"].values())
    for row in history:
        assert row["devices_reported"] == 4 and row["accuracy"] is not None
        federated = row["federated"]
        assert (federated["devices"], federated["examples"], federated["model_version"]) == (4, held_out,
                                                                                            row["round"])
        assert 0 <= federated["accuracy"] <= 1 and federated["loss"] > 0
        # each device's own, through the edges' cell updates (stats.evaluations): its rows, its accuracy
        assert {d: own["examples"] for d, own in federated["per_device"].items()} == {
            d: entry["eval"] for d, entry in split["devices"].items()}
        assert federated["accuracy"] == pytest.approx(sum(own["accuracy"] * own["examples"] for own in
                                                          federated["per_device"].values()) / held_out, abs=1e-9)
    assert history[1]["federated"]["accuracy"] > history[0]["federated"]["accuracy"]
    assert cloud.metrics.get("fedtier_federated_accuracy_min") == min(
        own["accuracy"] for own in history[-1]["federated"]["per_device"].values())

    # The committed model and every reported number equal the in-memory simulation's.
    cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    over_mqtt = store.latest_model(cfg.rollout)
    store.close()
    simulated = simulate(RolloutConfig.from_mapping({**rollout, "state_dir": str(tmp_path / "sim")}))
    assert over_mqtt is not None and over_mqtt.round == 1
    for name, value in simulated.params.items():
        np.testing.assert_allclose(over_mqtt.params[name], value, rtol=0, atol=1e-5)
    for sim_row, row in zip(simulated.rounds, history, strict=True):
        assert sim_row["federated"]["accuracy"] == pytest.approx(row["federated"]["accuracy"], abs=1e-9)
        assert sim_row["federated"]["loss"] == pytest.approx(row["federated"]["loss"], abs=1e-5)
        for device, own in row["federated"]["per_device"].items():
            sim_own = sim_row["federated"]["per_device"][device]
            assert sim_own["examples"] == own["examples"]
            assert sim_own["accuracy"] == pytest.approx(own["accuracy"], abs=1e-9)
            assert sim_own["loss"] == pytest.approx(own["loss"], abs=1e-5)

"""An HSGD rollout as an operator deploys it: `fedtier coordinator run`, `fedtier edge run` and `fedtier agent run`
processes (hosts with role = "host") through a real Mosquitto, the split bundle in a signed manifest that every
agent verifies, and the final model equal to the in-memory simulator's for the same seeds."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fleet_helpers import Procs

from fedtier.rollout.config import RolloutConfig
from local_fleet.configs import write_fleet
from local_fleet.simulate import simulate
from cloud_coordinator.store import CoordinatorStore
from fedtier.runtime.config import load

pytestmark = pytest.mark.broker
FEDTIER = [sys.executable, "-m", "fedtier"]


def keys(directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True)
    key = Ed25519PrivateKey.generate()
    private, public = directory / "signing.pem", directory / "signing.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def test_hsgd_rollout_of_real_processes_equals_the_simulator(mosquitto, artifact_store: Path, tmp_path: Path) -> None:
    # Prepare: 2 cells of 3 one-sample devices and a host each; P = 4, Q = 2; a signed manifest.
    private, public = keys(tmp_path / "keys")
    rollout = {"rollout": "hsgd-procs", "algorithm": "hsgd", "rounds": 3, "seed": 5,
               "artifact_store": str(artifact_store), "signing_key": str(private),
               "data": {"dataset": "breast_cancer", "partition": "iid", "standardize": True, "seed": 2},
               "topology": {"cells": 2, "devices_per_cell": 3},
               "hsgd": {"global_interval": 4, "local_interval": 2, "alpha": 0.7, "lr": 0.2, "deadline_s": 30.0}}
    paths = write_fleet(rollout, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port},
                        device_settings={"trusted_keys": [str(public)]})
    hosts = {"cell-a-host", "cell-b-host"}
    assert hosts <= set(paths.devices)
    assert 'role = "host"' in paths.devices["cell-a-host"].read_text()
    procs = Procs(tmp_path / "fleet")
    try:
        # Execute: every node its own process, as an operator starts them.
        for node, config in paths.devices.items():
            procs.start(f"agent-{node}", [*FEDTIER, "agent", "run", "--config", str(config)])
        for cell, config in paths.edges.items():
            procs.start(f"edge-{cell}", [*FEDTIER, "edge", "run", "--config", str(config)])
        coordinator = procs.start("coordinator", [*FEDTIER, "coordinator", "run", "--config", str(paths.coordinator)])
        deadline = time.monotonic() + 150
        while coordinator.popen.poll() is None and time.monotonic() < deadline:
            procs.check_alive()
            time.sleep(0.2)
        assert coordinator.popen.poll() == 0, coordinator.text()[-3000:]
        logs = {p.name: p.text() for p in procs.started}
    finally:
        procs.close()

    # Assert: the hosts ran as hosts, verified the signed manifest and installed the split bundle; nothing refused.
    for host in hosts:
        assert f"host {host} of cell" in logs[f"agent-{host}"]
        assert "manifest v1 of rollout hsgd-procs installed" in logs[f"agent-{host}"], logs[f"agent-{host}"][-2000:]
    assert "signed by key" in logs["coordinator"]
    for name, text in logs.items():
        assert "rejected" not in text and "refused" not in text, (name, text[-2000:])
    cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    over_mqtt = store.latest_model(cfg.rollout)
    rounds = store.rounds(cfg.rollout)
    store.close()
    assert over_mqtt is not None and over_mqtt.round == 2
    # every round: each cell's host and the devices that trained (alpha = 0.7 of 3: 2 per interval)
    assert all(r["devices_reported"] >= 2 * 3 for r in rounds)
    assert all(r["bytes"]["embedding_up"] > 0 and r["bytes"]["embedding_down"] > 0 for r in rounds)

    # The same rollout in memory (same seeds, ORT on both sides) gives the same model.
    simulated = simulate(RolloutConfig.from_mapping({**rollout, "signing_key": None,
                                                     "state_dir": str(tmp_path / "sim")}))
    assert set(simulated.params) == set(over_mqtt.params) == {"theta0/w", "theta0/b", "theta1/w", "theta1/b",
                                                              "theta2/w", "theta2/b"}
    for name, value in simulated.params.items():
        np.testing.assert_allclose(over_mqtt.params[name], value, rtol=0, atol=1e-5)
    assert [r["auroc"] for r in simulated.rounds] == pytest.approx([r["auroc"] for r in rounds], abs=1e-6)

"""A robust edge rule, a server optimizer, FedProx with partial work and an attacking device, through a real
Mosquitto: the same model as the in-memory simulator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fleet_threads import ThreadFleet

from local_fleet.simulate import simulate
from cloud_coordinator.store import CoordinatorStore
from fedtier.runtime.config import load, read_toml

pytestmark = pytest.mark.broker


def test_strategies_over_mosquitto_match_the_simulator(mosquitto, small_rollout, tmp_path: Path) -> None:
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.configs import write_fleet

    # Prepare: 2 cells x 3 devices; the edges take the median, the cloud steps with adam; devices train
    # FedProx with partial work; one device in six sends -10x its update.
    cfg = small_rollout(rounds=3, topology={"cells": 2, "devices_per_cell": 3},
                        fedavg={"local_steps": 10, "lr": 0.2, "proximal_mu": 0.05, "partial_work": True},
                        aggregation={"edge": "median"}, server_optimizer={"kind": "adam", "lr": 0.02},
                        attack={"kind": "sign_flip", "fraction": 1 / 6})
    plain = cfg.to_dict()
    plain.pop("broker", None)
    plain["state_dir"] = str(tmp_path / "fleet" / "coordinator")
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    attackers = cfg.attackers()
    assert len(attackers) == 1
    assert read_toml(paths.devices[attackers[0]])["attack"]["kind"] == "sign_flip"
    assert sum("attack" in read_toml(p) for p in paths.devices.values()) == 1

    # Execute
    fleet = ThreadFleet(paths)
    try:
        fleet.start_all()
        cloud = fleet.wait_finished(timeout=120)
    finally:
        fleet.stop()

    # Assert: the committed model equals the simulation's, and the run says it was an attack run.
    fleet_cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(fleet_cfg.state_dir / "coordinator.db")
    over_mqtt = store.latest_model(fleet_cfg.rollout)
    store.close()
    simulated = simulate(RolloutConfig.from_mapping({**plain, "state_dir": str(tmp_path / "sim")}))
    assert over_mqtt is not None and over_mqtt.round == 2
    for name, value in simulated.params.items():
        np.testing.assert_allclose(over_mqtt.params[name], value, rtol=0, atol=1e-5)
    assert all(r["attack"]["devices"] == attackers for r in cloud.history)

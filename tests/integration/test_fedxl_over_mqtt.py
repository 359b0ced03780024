"""FeDXL through a real Mosquitto: one class per device, AUROC per round, the same model as the simulator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fleet_threads import ThreadFleet

from local_fleet.simulate import simulate
from cloud_coordinator.store import CoordinatorStore
from fedtier.runtime.config import load
from fedtier.runtime.node_base import DROPPED, REJECTED

pytestmark = pytest.mark.broker


def test_fedxl_over_mosquitto_matches_the_simulator(mosquitto, small_rollout, tmp_path: Path) -> None:
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.configs import write_fleet

    # Prepare: 2 cells x 2 devices, each device holding one class of a rare-event task (FeDXL2).
    cfg = small_rollout(rounds=4, algorithm="fedxl", model={"hidden": [8]},
                        data={"dataset": "rare_event", "partition": "one_class", "samples": 800},
                        fedxl={"objective": "pauc", "local_steps": 8, "batch_size": 4, "batch_neg": 16, "lr": 0.5})
    plain = cfg.to_dict()
    plain.pop("broker", None)
    plain["state_dir"] = str(tmp_path / "fleet" / "coordinator")
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    fleet = ThreadFleet(paths)
    # Execute
    try:
        fleet.start_all()
        cloud = fleet.wait_finished(timeout=120)
    finally:
        fleet.stop()
    # Assert: every round closed with all four devices, nothing was rejected or dropped, and the ranking learned.
    for name, running in fleet.nodes.items():
        assert running.node.metrics.total(REJECTED) == 0, (name, running.node.metrics.snapshot())
        # (a duplicate — a QoS 1 redelivery, or a task resent when a device came online — is expected)
        drops = running.node.metrics.snapshot().get(DROPPED, {})
        assert set(drops) <= {"reason=duplicate"}, (name, drops)
    history = cloud.history
    assert [r["round"] for r in history] == [0, 1, 2, 3]
    assert all(r["devices_reported"] == 4 and r["missing"] == [] for r in history)
    assert history[-1]["auroc"] > 0.85 and history[-1]["auroc"] > history[0]["auroc"]
    assert all(0.5 <= r["pauc_0.3"] <= 1 and 0.5 <= r["pauc_0.5"] <= 1 for r in history[1:])

    # The final model, as committed by the coordinator, equals the in-memory simulation's.
    cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    over_mqtt = store.latest_model(cfg.rollout)
    store.close()
    simulated = simulate(RolloutConfig.from_mapping({**plain, "state_dir": str(tmp_path / "sim")}))
    assert over_mqtt is not None and over_mqtt.round == 3
    for name, value in simulated.params.items():
        np.testing.assert_allclose(over_mqtt.params[name], value, rtol=0, atol=1e-5)
    assert [r["auroc"] for r in simulated.rounds] == pytest.approx([r["auroc"] for r in history], abs=1e-6)

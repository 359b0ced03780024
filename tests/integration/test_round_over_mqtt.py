"""Full rounds through a real Mosquitto; the same rollout simulated in memory gives the same model."""

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


def _rollout(small_rollout, tmp_path: Path, **overrides: object):
    cfg = small_rollout(**overrides)
    plain = cfg.to_dict()
    plain.pop("broker", None)
    plain["state_dir"] = str(tmp_path / "fleet" / "coordinator")
    return cfg, plain


ALGORITHMS = {
    "fedavg": {"fedavg": {"local_steps": 20, "lr": 0.2}},
    "hier_qsgd": {"hier_qsgd": {"edge_rounds": 2, "local_steps": 10, "lr": 0.2, "bits_device": 4, "bits_edge": 6}},
    "qhetfed": {"qhetfed": {"tau": 3, "gamma": 8, "lr": 0.2, "bits_device": 4, "bits_edge": 6}},
    "hist": {"hist": {"local_steps": 10, "edge_rounds": 2, "lr": 0.2}, "model": {"hidden": [32]}},
}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_rounds_over_mosquitto_match_the_simulator(mosquitto, small_rollout, tmp_path: Path, algorithm: str) -> None:
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.configs import write_fleet

    # Prepare: a 2x2 fleet on disk (configs + device data), nodes as threads over Mosquitto.
    _, plain = _rollout(small_rollout, tmp_path, rounds=3, algorithm=algorithm, **ALGORITHMS[algorithm])
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    fleet = ThreadFleet(paths)
    # Execute
    try:
        fleet.start_all()
        cloud = fleet.wait_finished(timeout=90)
    finally:
        fleet.stop()
    # Every device stayed on its cell's set model: nothing was rejected (no desync) or dropped.
    for name, running in fleet.nodes.items():
        assert running.node.metrics.total(REJECTED) == 0, (name, running.node.metrics.snapshot())
        assert running.node.metrics.get(DROPPED, reason="desync") == 0, name
    # Assert: every round closed with all four devices, and accuracy is far above chance (0.1).
    history = cloud.history
    assert [r["round"] for r in history] == [0, 1, 2]
    assert all(r["devices_reported"] == 4 and r["missing"] == [] for r in history)
    assert history[-1]["accuracy"] > 0.6 and history[-1]["accuracy"] > history[0]["accuracy"]
    assert all(r["bytes"]["device_up"] > 0 and r["bytes"]["edge_up"] > 0 for r in history)
    if algorithm in ("hier_qsgd", "qhetfed"):  # quantized uplinks: 4 bits per coordinate instead of 32
        assert all(r["bytes"]["device_up"] < 0.3 * r["bytes"]["device_up_f32"] for r in history)
        assert all(r["q1"] > 0 and r["q2"] > 0 for r in history)

    # The final model, as committed by the coordinator, equals the in-memory simulation's.
    cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    over_mqtt = store.latest_model(cfg.rollout)
    store.close()
    sim_cfg = RolloutConfig.from_mapping({**plain, "state_dir": str(tmp_path / "sim")})
    simulated = simulate(sim_cfg)
    assert over_mqtt is not None and over_mqtt.round == 2
    for name, value in simulated.params.items():
        np.testing.assert_allclose(over_mqtt.params[name], value, rtol=0, atol=1e-5)
    assert [r["accuracy"] for r in simulated.rounds] == pytest.approx([r["accuracy"] for r in history], abs=1e-6)

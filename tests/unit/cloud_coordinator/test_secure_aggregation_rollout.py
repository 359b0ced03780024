"""[fedavg] secure_aggregation = true: validated config, and in the simulator the same model as plain
aggregation up to the ring encoding's rounding."""

from __future__ import annotations

import numpy as np
import pytest

from local_fleet.simulate import simulate
from fedtier.algorithms.secure_fedavg import SecureFedAvgConfig, edge_sees_individual_updates
from fedtier.errors import ConfigError


def test_secure_model_equals_plain_model_up_to_ring_rounding(small_rollout) -> None:
    plain = simulate(small_rollout(rounds=3, topology={"cells": 2, "devices_per_cell": 3}))
    secure_cfg = small_rollout(rounds=3, topology={"cells": 2, "devices_per_cell": 3},
                               fedavg={"secure_aggregation": True, "secagg_min_survivors": 3, "secagg_bits": 48,
                                       "secagg_clip": 100.0})
    assert isinstance(secure_cfg.algorithm_config(), SecureFedAvgConfig)
    secure = simulate(secure_cfg)
    scale = secure_cfg.algorithm_config().params(3).codec.scale
    worst = max(float(np.max(np.abs(plain.params[n] - secure.params[n]))) for n in plain.params)
    # 3 rounds; each cell mean carries at most 1/scale of rounding (mean of 3 errors < 1/scale each), and
    # float32 arithmetic adds ~1e-7 relative; the models differ by this, not more.
    assert worst < 3 / scale + 1e-5
    assert [r["devices_reported"] for r in secure.rounds] == [6, 6, 6]
    assert secure.rounds[-1]["accuracy"] == pytest.approx(plain.rounds[-1]["accuracy"], abs=0.01)


def test_config_names_bad_keys(small_rollout) -> None:
    with pytest.raises(ConfigError, match="edge_rounds"):
        small_rollout(fedavg={"secure_aggregation": True, "edge_rounds": 2})
    with pytest.raises(ConfigError, match="weighting"):
        small_rollout(fedavg={"secure_aggregation": True, "weighting": "samples"})
    with pytest.raises(ConfigError, match="secagg_min_survivors"):
        small_rollout(fedavg={"secure_aggregation": True, "secagg_min_survivors": 3})  # cells of 2
    with pytest.raises(ConfigError, match="secagg_threshold"):
        small_rollout(fedavg={"secure_aggregation": True, "secagg_threshold": 0.5})
    with pytest.raises(ConfigError, match="secagg_phases"):  # no time left to carry the update to the cloud
        small_rollout(fedavg={"secure_aggregation": True, "secagg_phases": [0.7, 0.1, 0.1, 0.1]})
    with pytest.raises(ConfigError, match="secagg_phases"):
        small_rollout(fedavg={"secure_aggregation": True, "secagg_phases": [0.6, 0.1, 0.1]})
    assert small_rollout(fedavg={"secure_aggregation": True, "secagg_phases": [0.5, 0.2, 0.1, 0.1]}) \
        .algorithm_config().secagg_phases == (0.5, 0.2, 0.1, 0.1)
    with pytest.raises(ConfigError, match="aggregation.edge"):
        small_rollout(fedavg={"secure_aggregation": True}, aggregation={"edge": "median"})
    with pytest.raises(ConfigError, match="privacy.device_sampling"):  # distributed DP: devices sample themselves
        small_rollout(fedavg={"secure_aggregation": True}, privacy={"epsilon": 8.0, "clip": 1.0,
                                                                   "device_sampling": "fixed", "sample_rate": 0.5})
    assert not edge_sees_individual_updates(small_rollout(fedavg={"secure_aggregation": True}).algorithm_config())
    assert edge_sees_individual_updates(small_rollout().algorithm_config())
    secure = small_rollout(fedavg={"secure_aggregation": True})
    assert not edge_sees_individual_updates(secure) and not edge_sees_individual_updates(secure.fedavg)
    assert edge_sees_individual_updates(small_rollout())


def test_a_cell_of_six_with_one_silent_device_delivers_every_round(small_rollout, monkeypatch) -> None:
    """Issue 31, in the simulator (the real nodes over the memory broker, virtual time): 2 cells of 6, s_min 4,
    cell quorum 0.5, and dev-00 of cell-a takes its tasks but never answers. Its cell's keys phase closes at its
    own deadline (0.6 deadline_s), so cell-a's update reaches the cloud in time every round: 11 devices in each of
    4 rounds (with the keys phase waiting out deadline_s, as before, cell-a missed all 4). Its edge says whom the
    keys phase waited for, in the round's cell row and its metrics."""
    from device_agent.node import DeviceNode
    from edge_broker.service import SECAGG_ABORTS, SECAGG_WAITED, EdgeNode

    run_task = DeviceNode._run_task
    monkeypatch.setattr(DeviceNode, "_run_task",
                        lambda self, task, now: None if self.device_id == "dev-00" else run_task(self, task, now))
    edges: list[EdgeNode] = []
    start = EdgeNode.start
    monkeypatch.setattr(EdgeNode, "start", lambda self, now: (edges.append(self), start(self, now))[1])
    cfg = small_rollout(rounds=4, topology={"cells": 2, "devices_per_cell": 6},
                        fedavg={"secure_aggregation": True, "secagg_min_survivors": 4, "quorum": 0.5,
                                "secagg_clip": 100.0})
    assert cfg.topology.layout()["cell-a"][0] == "dev-00"
    result = simulate(cfg)
    assert [r["devices_reported"] for r in result.rounds] == [11, 11, 11, 11]
    assert all(r["missing"] == ["dev-00"] and len(r["cells"]["cell-a"]["reported"]) == 5 for r in result.rounds)
    assert all(r["cells"]["cell-a"]["secagg"] == {"waited": {"keys": ["dev-00"]}} for r in result.rounds)
    assert all("secagg" not in r["cells"]["cell-b"] for r in result.rounds)
    [edge_a] = [e for e in edges if e.cell == "cell-a"]
    assert edge_a.metrics.get(SECAGG_WAITED, phase="keys") == 4
    assert edge_a.metrics.total(SECAGG_ABORTS) == 0

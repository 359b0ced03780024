"""Adaptive clipping in rollouts (`[privacy] adaptive_clip`): the cloud moves C every round from noised counts that
trusted edges and devices under untrusted edges release, the update and its count cost exactly the planned z (so the
ledger charges what it charges without adaptive clipping), the audit refuses a release without its count, and C
survives a coordinator restart."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedtier.rollout.config import RolloutConfig
from fedtier.algorithms.fedavg import FedAvgConfig
from fedtier.errors import ConfigError, MissingReleaseError
from fedtier.privacy import audit
from fedtier.privacy.plan import DEVICE_COUNT_SENSITIVITY, EDGE_COUNT_SENSITIVITY, CellPlan, NoisePlan


def private(small_rollout: Any, *, adaptive: bool, clip: float, trusted: dict[str, bool], rounds: int = 4,
            devices_per_cell: int = 4, **privacy: Any) -> RolloutConfig:
    return small_rollout(rounds=rounds, topology={"cells": 2, "devices_per_cell": devices_per_cell,
                                                  "trusted": trusted},
                         fedavg={"local_steps": 3, "edge_rounds": 1},
                         privacy={"epsilon": 8.0, "clip": clip, "require_tls": False, "noise_seed": 5,
                                  "device_sampling": "poisson", "sample_rate": 0.5, "adaptive_clip": adaptive,
                                  **privacy})


def plan(**adaptive: float) -> NoisePlan:
    return NoisePlan(mode="rdp", epsilon=8.0, delta=1e-5, budget_epsilon=8.0, clip=1.0, edge_rounds=1, rounds=5,
                     require_tls=False, cells={"a": CellPlan(trusted=True, members=4, device_z=0.0, edge_z=1.3),
                                               "b": CellPlan(trusted=False, members=4, device_z=2.0, edge_z=0.0)},
                     sampling="poisson", sample_rate=0.5,
                     adaptive={"quantile": 0.5, "lr": 0.2, "count_share": 0.1, **adaptive})


def test_the_update_and_its_count_compose_to_exactly_the_planned_multiplier() -> None:
    p = plan()
    for z, sensitivity in ((2.0, DEVICE_COUNT_SENSITIVITY), (1.3, EDGE_COUNT_SENSITIVITY)):
        update, count = p.update_z(z), p.count_stddev(z, sensitivity) / sensitivity
        assert update > z and (update ** -2 + count ** -2) ** -0.5 == pytest.approx(z, rel=1e-12)
    assert p.device_sigma("b") == pytest.approx(p.update_z(2.0) * 2.0)  # 2C at C = 1
    assert p.at_clip(3.0).device_sigma("b") == pytest.approx(3 * p.device_sigma("b"))
    assert NoisePlan.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="Poisson"):
        dataclasses.replace(p, sampling="fixed")


def test_config_refuses_adaptive_clipping_without_poisson_sampling_or_with_other_algorithms(small_rollout) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as info:
        small_rollout(privacy={"epsilon": 8.0, "clip": 1.0, "adaptive_clip": True})
    assert info.value.key == "privacy.adaptive_clip" and "poisson" in str(info.value)
    with pytest.raises(ConfigError) as info:
        small_rollout(algorithm="hier_qsgd", hier_qsgd={"edge_rounds": 1, "bits_device": 0},
                      fedavg={"secure_aggregation": False}, privacy={
                          "epsilon": 8.0, "clip": 1.0, "device_sampling": "poisson", "sample_rate": 0.5,
                          "adaptive_clip": True, "clip_count_share": 1.5})
    assert info.value.key == "privacy.clip_count_share"
    with pytest.raises(ConfigError) as info:
        small_rollout(fedavg={"edge_rounds": 1, "secure_aggregation": True}, privacy={
            "epsilon": 8.0, "clip": 1.0, "device_sampling": "poisson", "sample_rate": 0.5, "adaptive_clip": True})
    assert info.value.key == "privacy.adaptive_clip" and "secure aggregation" in str(info.value)


def test_a_device_release_carries_its_noised_count_and_the_audit_requires_it() -> None:
    from fedtier.algorithms.base import LocalResult, LocalTrain, SendToParent
    from fedtier.algorithms.hier_qsgd import Device
    from fedtier.privacy.mechanism import NoiseSource
    from fedtier.wire.messages import DeviceTask, decode_message

    p = plan()
    config = FedAvgConfig(local_steps=1, privacy=p.to_dict(), dp_clip=0.5)
    params = {"w": np.zeros(4, np.float32)}
    device = Device(device_id="d1", cell="b", rollout="r", noise=NoiseSource(3))
    [train] = device.receive(DeviceTask(rollout="r", round=0, sender="b", params=params,
                                        config=config.to_dict(), members=("d1",)), 0.0)
    assert isinstance(train, LocalTrain)
    [send] = device.trained(0, LocalResult(delta={"w": np.full(4, 0.1, np.float32)}, num_samples=10,
                                           mean_loss=1.0, steps=1))
    assert isinstance(send, SendToParent)
    update = decode_message(send.message.encode())
    record = update.release
    assert record is not None and update.unclipped is None  # the bit travels noised, never clear
    at_round = p.at_clip(0.5)
    assert record["sigma"] == pytest.approx(at_round.device_sigma("b"))  # 2 x 0.5 x update_z(2)
    assert record["z"] == 2.0 and record["count_stddev"] == pytest.approx(p.count_stddev(2.0, 1.0))
    audit.check_device_release(at_round, "b", "d1", 0, 0, record)
    stripped = {k: v for k, v in record.items() if k not in ("count", "count_stddev")}
    with pytest.raises(MissingReleaseError, match="no valid count"):
        audit.check_device_release(at_round, "b", "d1", 0, 0, stripped)
    weak = {**record, "count_stddev": record["count_stddev"] / 2}
    with pytest.raises(MissingReleaseError, match="below the planned"):
        audit.check_device_release(at_round, "b", "d1", 0, 0, weak)


@pytest.mark.parametrize(("clip", "direction"), [(0.02, "up"), (50.0, "down")])
def test_the_rollout_moves_the_clip_towards_the_update_norms(small_rollout, tmp_path: Path, clip: float,
                                                             direction: str) -> None:  # type: ignore[no-untyped-def]
    from local_fleet.simulate import simulate

    cfg = private(small_rollout, adaptive=True, clip=clip, trusted={"cell-a": True, "cell-b": True},
                  devices_per_cell=10, clip_count_share=0.5)
    result = simulate(cfg, workdir=tmp_path / "adaptive")
    clips = [r["config"]["dp_clip"] for r in result.rounds]
    moves = [r["privacy"]["adaptive_clip"] for r in result.rounds]
    assert clips[0] == clip and all(m["clip"] == c for m, c in zip(moves, clips, strict=True))
    assert all(m["next_clip"] == c for m, c in zip(moves, clips[1:], strict=False))
    # far from the norms (0.02 clips every update; 50 clips none), C moves the same way every round
    after = [m["next_clip"] for m in moves]
    if direction == "up":
        assert all(b > a for a, b in zip(clips, after, strict=True))
        assert all(m["unclipped_share"] < 0.5 for m in moves)
    else:
        assert all(b < a for a, b in zip(clips, after, strict=True))
        assert all(m["unclipped_share"] > 0.5 for m in moves)


def test_the_count_is_paid_inside_each_release_so_the_ledger_is_unchanged(small_rollout, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from local_fleet.simulate import simulate
    from cloud_coordinator.store import CoordinatorStore

    trusted = {"cell-a": True}  # a trusted edge and a cell of local-DP devices
    adaptive = simulate(private(small_rollout, adaptive=True, clip=1.0, trusted=trusted), workdir=tmp_path / "a")
    fixed = simulate(private(small_rollout, adaptive=False, clip=1.0, trusted=trusted), workdir=tmp_path / "f")
    assert [r["privacy"]["epsilon_max"] for r in adaptive.rounds] == pytest.approx(
        [r["privacy"]["epsilon_max"] for r in fixed.rounds], rel=1e-9)
    assert adaptive.rounds[-1]["privacy"]["epsilon_max"] <= 8.0 * (1 + 1e-9)
    store = CoordinatorStore(tmp_path / "a" / "coordinator.db")
    rows = store.privacy_releases("t")
    store.close()
    # every release on the ledger, device and edge, carried its noised count (the cloud's audit checks its noise)
    assert {r["event"] for r in rows} == {"device", "edge"}
    assert all(r["inputs"]["count_stddev"] > 0 for r in rows), rows[0]
    assert all(np.isfinite(r["privacy"]["adaptive_clip"]["unclipped_share"]) for r in adaptive.rounds)


def test_the_clip_bound_survives_a_restart_of_the_cloud() -> None:
    from fedtier.algorithms.cloud import Cloud

    p = plan()
    config = FedAvgConfig(local_steps=1, privacy=p.to_dict())
    cloud = Cloud(rollout="r", cells={"a": ("d1",), "b": ("d2",)}, initial_params={"w": np.zeros(2, np.float32)},
                  config=config, rounds=3)
    assert cloud.config.dp_clip == 1.0 and cloud.clip_bound is not None
    cloud.clip_bound.clip = 2.5
    state = cloud.strategy_state()
    assert state is not None
    restarted = Cloud(rollout="r", cells={"a": ("d1",), "b": ("d2",)}, initial_params={"w": np.zeros(2, np.float32)},
                      config=config, rounds=3, start_round=1)
    restarted.load_strategy_state(state)
    assert restarted.config.dp_clip == 2.5
    [task, _] = [a for a in restarted.start(0.0)]
    assert task.message.config["dp_clip"] == 2.5

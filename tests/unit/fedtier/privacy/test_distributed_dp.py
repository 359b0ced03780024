"""Distributed DP: secure aggregation under [privacy]. Devices add shares of their cell's noise so that
every sum the edge can unmask carries at least the noise a trusted edge would add; the cell's release
is planned, audited and charged like a trusted edge's (fedtier.privacy.plan, docs/privacy.md)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np
import pytest

from cloud_coordinator.privacy import calibrate
from fedtier.algorithms.base import Broadcast, LocalResult, LocalTrain, Note, SendToChild, SendToParent
from fedtier.algorithms.secure_fedavg import Device, Edge, SecureFedAvgConfig
from fedtier.errors import MissingReleaseError, UnexpectedMessageError
from fedtier.privacy import audit
from fedtier.privacy.mechanism import NoiseSource
from fedtier.privacy.plan import CellPlan, NoisePlan
from fedtier.wire.messages import CellTask, decode_message

ROLLOUT, CELL = "ro", "e0"
PARAMS = {"w": np.zeros((4, 5), np.float32), "b": np.zeros(5, np.float32)}
CLIP = 1.0


def _plan(members: int, s_min: int, *, edge_z: float = 1.5, sampling: str = "none", rate: float = 1.0) -> NoisePlan:
    base = NoisePlan(mode="rdp", epsilon=4.0, delta=1e-5, budget_epsilon=4.0, clip=CLIP, edge_rounds=1, rounds=10,
                     require_tls=False, sampling=sampling, sample_rate=rate,
                     cells={CELL: CellPlan(trusted=False, members=members, device_z=1.0, edge_z=edge_z,
                                           min_survivors=s_min)})
    device_z = base.distributed_device_z(CELL, edge_z, s_min)
    return NoisePlan(mode="rdp", epsilon=4.0, delta=1e-5, budget_epsilon=4.0, clip=CLIP, edge_rounds=1, rounds=10,
                     require_tls=False, sampling=sampling, sample_rate=rate,
                     cells={CELL: CellPlan(trusted=False, members=members, device_z=device_z, edge_z=edge_z,
                                           min_survivors=s_min)})


def test_each_device_adds_one_s_min_th_of_the_trusted_sum_variance() -> None:
    plain = _plan(8, 5)
    poisson = _plan(8, 5, sampling="poisson", rate=0.5)

    # Unsampled: the sum's sensitivity is 2C (replace-one), so sigma_sum = z 2C; Poisson: C (add/remove).
    assert plain.device_sigma(CELL) ** 2 * 5 == pytest.approx((1.5 * 2 * CLIP) ** 2, rel=1e-12)
    assert poisson.device_sigma(CELL) ** 2 * 5 == pytest.approx((1.5 * CLIP) ** 2, rel=1e-12)
    # With s_min survivors the release is charged exactly the planned z; more survivors carry more noise.
    assert plain.distributed_release(CELL, 5, 5)[2] == pytest.approx(1.5, rel=1e-12)
    assert plain.distributed_release(CELL, 8, 8)[2] == pytest.approx(1.5 * math.sqrt(8 / 5), rel=1e-12)
    assert poisson.distributed_release(CELL, 5, 5)[2] == pytest.approx(1.5, rel=1e-12)
    assert NoisePlan.from_dict(plain.to_dict()) == plain


def test_make_plan_turns_every_cell_distributed_and_the_ledger_tier_is_the_edge(small_rollout) -> None:
    cfg = small_rollout(topology={"cells": 2, "devices_per_cell": 3, "trusted": {"cell-a": True}},
                        privacy={"epsilon": 4.0, "clip": 1.0, "require_tls": False},
                        fedavg={"weighting": "uniform", "secure_aggregation": True, "secagg_min_survivors": 2})
    trusted = small_rollout(topology={"cells": 2, "devices_per_cell": 3, "trusted": {"cell-a": True, "cell-b": True}},
                            privacy={"epsilon": 4.0, "clip": 1.0, "require_tls": False})

    plan = calibrate.make_plan(cfg, {})
    reference = calibrate.make_plan(trusted, {})

    assert all(p.distributed and p.min_survivors == 2 for p in plan.cells.values())
    # The same multiplier as trusted edges at the same epsilon: the release is the same Gaussian mechanism.
    assert {c: p.edge_z for c, p in plan.cells.items()} == {c: p.edge_z for c, p in reference.cells.items()}
    assert plan.details["epsilon_device_tier"] == 0.0
    assert plan.details["epsilon_edge_tier"] == pytest.approx(reference.details["epsilon_edge_tier"])
    rows = {r.node: r for r in calibrate.plan_rows(cfg, {})}
    assert rows["cell-b"].injects and rows["cell-b"].distributed and rows["cell-b"].z == pytest.approx(
        plan.cells["cell-b"].edge_z)
    device = next(r for r in rows.values() if r.kind == "device")
    assert not device.injects and device.releases == 0 and device.sigma == pytest.approx(plan.device_sigma("cell-a"))


class _Cell:
    """An edge and its devices under a distributed-DP plan, every message through the wire codec."""

    def __init__(self, n: int, plan: NoisePlan, seed: int) -> None:
        self.ids = [f"d{i:02d}" for i in range(n)]
        self.config = SecureFedAvgConfig(local_steps=1, lr=0.1, batch_size=8, weighting="uniform",
                                         secagg_min_survivors=plan.cells[CELL].min_survivors,
                                         privacy=plan.to_dict())
        self.edge = Edge(cell=CELL, rollout=ROLLOUT, noise=NoiseSource(seed))
        self.devices = {d: Device(device_id=d, cell=CELL, rollout=ROLLOUT, noise=NoiseSource(seed * 1000 + i))
                        for i, d in enumerate(self.ids)}

    def round(self, r: int, deltas: dict[str, dict[str, np.ndarray]]) -> Any:
        task = CellTask(rollout=ROLLOUT, round=r, sender="cloud", params=PARAMS, members=tuple(self.ids),
                        config=self.config.to_dict())
        queue: deque[tuple[str, Any]] = deque(("edge", a) for a in self.edge.receive(_wire(task), 0.0))
        up = []
        while queue:
            origin, action = queue.popleft()
            if isinstance(action, Note):
                continue
            if origin == "edge" and isinstance(action, SendToParent):
                up.append(_wire(action.message))
            elif origin == "edge" and isinstance(action, (Broadcast, SendToChild)):
                for d in ([action.child] if isinstance(action, SendToChild) else self.ids):
                    queue.extend((d, a) for a in self.devices[d].receive(_wire(action.message), 0.0))
            elif isinstance(action, LocalTrain):
                result = LocalResult(delta=deltas[origin], num_samples=10, mean_loss=0.1, steps=1)
                queue.extend((origin, a) for a in self.devices[origin].trained(action.round, result))
            elif isinstance(action, SendToParent):
                queue.extend(("edge", a) for a in self.edge.receive(_wire(action.message), 0.0))
        (update,) = up
        return update


def _wire(msg: Any) -> Any:
    return decode_message(msg.encode())


def test_the_unmasked_mean_carries_at_least_the_planned_noise() -> None:
    """Zero updates in, many rounds: the variance of the mean the edge forwards is the planned sum's over
    the survivors (here all n >= s_min), and the cell's release record passes the cloud's audit."""
    n, s_min = 6, 4
    plan = _plan(n, s_min)
    zero = {d: {k: np.zeros_like(v) for k, v in PARAMS.items()} for d in (f"d{i:02d}" for i in range(n))}
    means = []
    for seed in range(1, 13):
        cell = _Cell(n, plan, seed)
        update = cell.round(0, zero)
        audit.check_cell_update(plan, CELL, 0, update.privacy, update.reported)
        means.append(np.concatenate([np.asarray(update.delta[k], np.float64).ravel() for k in sorted(PARAMS)]))
    values = np.concatenate(means)  # 12 rounds x 25 coordinates
    planned = n * plan.device_sigma(CELL) ** 2 / n ** 2  # the survivors' shares over the mean's denominator
    trusted = (1.5 * 2 * CLIP / n) ** 2  # what a trusted edge adds to a mean of n at z = 1.5
    observed = float(values.var())
    # chi-square with 300 degrees of freedom: within +-25 % at far beyond 3 sigma
    assert 0.75 * planned < observed < 1.25 * planned, (observed, planned)
    assert planned >= trusted * (1 - 1e-12)
    record = update.privacy["releases"][0]
    assert record["z"] == pytest.approx(1.5 * math.sqrt(n / s_min)) and record["inputs"]["survivors"] == n


def test_a_clipped_update_goes_through_within_the_noise() -> None:
    """A large update is clipped to C before the noise: the mean moves by at most C plus the noise."""
    n = 5
    plan = _plan(n, 5, edge_z=1e-3)  # almost no noise: the clip shows
    big = {d: {k: np.full_like(v, 10.0) for k, v in PARAMS.items()} for d in (f"d{i:02d}" for i in range(n))}
    update = _Cell(n, plan, 3).round(0, big)
    flat = np.concatenate([np.asarray(update.delta[k], np.float64).ravel() for k in sorted(PARAMS)])
    assert float(np.linalg.norm(flat)) == pytest.approx(CLIP, rel=1e-2)


def test_the_audit_refuses_a_sum_of_too_few_shares_or_without_the_distributed_flag() -> None:
    n = 6
    plan = _plan(n, 4)
    update = _Cell(n, plan, 5).round(0, {d: {k: np.zeros_like(v) for k, v in PARAMS.items()}
                                         for d in (f"d{i:02d}" for i in range(n))})
    report = dict(update.privacy)
    with pytest.raises(MissingReleaseError, match="does not say so"):
        audit.check_cell_update(plan, CELL, 0, {**report, "distributed": False}, update.reported)
    few = {**report, "steps": [report["steps"][0][:3]]}
    with pytest.raises(MissingReleaseError, match="fewer than s_min"):
        audit.check_cell_update(plan, CELL, 0, few, few["steps"][0])
    weak = dict(report["releases"][0], z=1.0, sigma=1.0 * report["releases"][0]["sensitivity"])
    with pytest.raises(MissingReleaseError, match="below the planned"):
        audit.check_cell_update(plan, CELL, 0, {**report, "releases": [weak]}, update.reported)


def test_roles_refuse_a_plan_whose_s_min_is_not_the_protocols() -> None:
    plan = _plan(6, 4)
    config = SecureFedAvgConfig(local_steps=1, lr=0.1, batch_size=8, weighting="uniform", secagg_min_survivors=3,
                                privacy=plan.to_dict())
    edge = Edge(cell=CELL, rollout=ROLLOUT)
    members = tuple(f"d{i:02d}" for i in range(6))
    task = CellTask(rollout=ROLLOUT, round=0, sender="cloud", params=PARAMS, members=members, config=config.to_dict())
    with pytest.raises(UnexpectedMessageError, match="s_min"):
        edge.receive(_wire(task), 0.0)


def test_under_sampling_every_member_takes_part_and_the_unsampled_add_noise_only() -> None:
    """Poisson sampling decided by each device in secret: all members run the protocol, the release divides by
    the public q n, and a device that was not sampled never trains."""
    n = 8
    plan = _plan(n, 6, sampling="poisson", rate=0.5, edge_z=1e-3)
    cell = _Cell(n, plan, 11)
    ones = {d: {k: np.full_like(v, 0.01) for k, v in PARAMS.items()} for d in cell.ids}
    trained: list[str] = []
    original = Device.trained

    def spy(self: Device, round: int, result: LocalResult) -> Any:
        if result.num_samples:
            trained.append(self.device_id)
        return original(self, round, result)

    Device.trained = spy  # type: ignore[method-assign]
    try:
        update = cell.round(0, ones)
    finally:
        Device.trained = original  # type: ignore[method-assign]
    assert sorted(update.reported) == cell.ids  # every member is in the sum; who was sampled is not said
    assert 0 < len(trained) < n
    flat = np.concatenate([np.asarray(update.delta[k], np.float64).ravel() for k in sorted(PARAMS)])
    expected = len(trained) * 0.01 / (0.5 * n)  # the sampled devices' sum over q n
    assert np.allclose(flat, expected, atol=1e-3)

"""QHetFed roles: the contract, eqs. (5)-(10) against a reference, gamma = 1 structure, sync, catch-up."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hierarchy import Hierarchy
from numpy_model import NumpyCompute, init_params, make_data
from role_contract import RoleContract

from fedtier.algorithms import qhetfed
from fedtier.algorithms.common import digest, quantize
from fedtier.errors import LocalProtocolError
from fedtier.wire.messages import DeviceGradient, Message

CELLS = {"cell-a": ("dev-0", "dev-1", "dev-2"), "cell-b": ("dev-3", "dev-4")}
DEVICES = [d for ds in CELLS.values() for d in ds]


def make(rounds: int = 2, cells: dict | None = None, **cfg: object) -> Hierarchy:
    cells = cells or dict(CELLS)
    devices = [d for ds in cells.values() for d in ds]
    config = qhetfed.QHetFedConfig(**{"tau": 3, "gamma": 2, "batch_size": 8, "lr": 0.3, "seed": 5,
                                      **cfg})  # type: ignore[arg-type]
    return Hierarchy(algo=qhetfed, cells=cells, params=init_params(), config=config, rounds=rounds,
                     compute=NumpyCompute(make_data(devices)))


class TestQHetFedContract(RoleContract):
    def hierarchy(self, **kwargs: object) -> Hierarchy:
        return make(**kwargs)  # type: ignore[arg-type]

    def device_update(self, h: Hierarchy, device: str, round: int, scale: float = 1.0,
                      tensors: dict | None = None) -> Message:
        # QHetFed's first upload of a round: the gradient at the set model (= the global model).
        return DeviceGradient(rollout="r", round=round, sender=device, step=0,
                              grad=tensors or {n: np.full_like(p, scale) for n, p in h.params.items()},
                              model_sha=digest(h.params), loss=0.5, num_samples=10)


# --- a slow, obvious reference of Algorithm 1 ------------------------------------------------


def reference_round(h: Hierarchy, cells: dict, *, gamma_as_gradient_steps: bool = False) -> dict[str, np.ndarray]:
    """One global round of Algorithm 1 in plain numpy, with the roles' batch and quantizer streams.

    With ``gamma_as_gradient_steps`` (gamma must be 1) the local phase is replaced by one more
    gradient-aggregation step — Corollary 2's "tau+1 intra-set iterations".
    """
    c, compute, w_t = h.config, h.compute, {n: p.copy() for n, p in h.params.items()}
    n_total = sum(len(m) for m in cells.values())
    new = {n: w_t[n].astype(np.float64) for n in w_t}
    for cell, members in cells.items():
        w = {n: p.copy() for n, p in w_t.items()}
        steps = c.tau + 1 if gamma_as_gradient_steps else c.tau
        for i in range(steps):
            grads = []
            for d in members:
                g, _ = compute.grad(w, d, c.batch_size, (c.seed, "batches", "r", d, 0, i))
                grads.append(quantize(g, c.bits_device, c.seed, "q1", "r", d, 0, i)[0])     # Q1
            mean = {n: np.mean([g[n] for g in grads], axis=0) for n in w}                   # (5)
            w = {n: (w[n] - np.float32(c.lr) * mean[n]).astype(np.float32) for n in w}     # (6)
        if not gamma_as_gradient_steps:
            changes = []
            for d in members:  # (7)-(8): gamma SGD steps, one batch stream per step (tau + j)
                local, total = dict(w), {n: np.zeros(p.shape) for n, p in w.items()}
                for j in range(c.gamma):
                    g, _ = compute.grad(local, d, c.batch_size, (c.seed, "batches", "r", d, 0, c.tau + j))
                    local = {n: (local[n] - np.float32(c.lr) * g[n]).astype(np.float32) for n in local}
                    total = {n: total[n] + g[n] for n in total}
                delta = {n: (-c.lr * total[n]).astype(np.float32) for n in total}
                changes.append(quantize(delta, c.bits_device, c.seed, "q1", "r", d, 0, c.tau)[0])
            w = {n: w[n] + np.mean([x[n] for x in changes], axis=0) for n in w}             # (9)
        change = quantize({n: w[n] - w_t[n] for n in w}, c.bits_edge, c.seed, "q2", "r", cell, 0)[0]  # Q2
        for n in w:
            new[n] += len(members) / n_total * change[n].astype(np.float64)                 # (10)
    return new


def test_one_round_follows_equations_5_to_10() -> None:
    h = make(rounds=1)
    expected = reference_round(h, CELLS)
    h.run()
    for n, value in expected.items():
        np.testing.assert_allclose(h.closed[0].params[n], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", [(0, 0), (4, 5)], ids=["float32", "qsgd-4-5"])
def test_gamma_1_is_tau_plus_1_gradient_aggregation_steps(bits: tuple[int, int]) -> None:
    # Corollary 2: with gamma = 1 the local step is one more aggregated gradient step (Q(-mu g) = -mu Q(g)).
    h = make(rounds=1, gamma=1, bits_device=bits[0], bits_edge=bits[1])
    expected = reference_round(h, CELLS, gamma_as_gradient_steps=True)
    h.run()
    for n, value in expected.items():
        np.testing.assert_allclose(h.closed[0].params[n], value, rtol=0, atol=1e-6)


def test_all_devices_of_a_set_hold_bit_identical_models_after_every_intra_set_iteration() -> None:
    h = make(rounds=2, bits_device=3, bits_edge=4)
    steps = []

    def at_broadcast(cell: str, step) -> None:
        assert step.model_sha == digest(h.edges[cell]._params)
        steps.append((cell, step))

    h.on_step = at_broadcast
    h.run()
    assert len(steps) == 2 * 2 * 3  # rounds x cells x tau
    for cell, step in steps:
        assert {h.device_digests[(d, step.round, step.step)] for d in CELLS[cell]} == {step.model_sha}
    assert not [d for d in h.dropped if d.reason == "desync"]


def test_single_cell_with_exact_edge_upload_runs() -> None:
    # Corollary 3: C = 1, Q2 = identity: the global model is the set model.
    cells = {"cell-a": ("dev-0", "dev-1", "dev-2")}
    h = make(rounds=3, cells=cells, bits_device=4, bits_edge=0)
    h.run()
    assert h.finished and [c.round for c in h.closed] == [0, 1, 2]
    assert h.closed[-1].metrics["q2"] == 0 and h.closed[-1].metrics["q1"] > 0


def test_training_reduces_the_loss() -> None:
    from numpy_model import loss

    h = make(rounds=5, bits_device=4, bits_edge=6)
    before = loss(h.params, h.compute.data)
    h.run()
    assert loss(h.closed[-1].params, h.compute.data) < 0.7 * before


def test_a_gradient_at_another_model_is_rejected_as_desync() -> None:
    h = make(rounds=1)
    h.offline = set(DEVICES)
    h.start()
    grad = {n: np.ones_like(p) for n, p in h.params.items()}
    stale = DeviceGradient(rollout="r", round=0, sender="dev-0", step=0, grad=grad, model_sha="0" * 64,
                           loss=0.1, num_samples=1)
    with pytest.raises(qhetfed.DesyncError):
        h.edges["cell-a"].receive(stale, 0.0)
    assert qhetfed.DesyncError.reason == "desync"


def test_a_device_that_comes_back_mid_round_catches_up_at_the_current_step() -> None:
    # Prepare: dev-2 is away. Quorum 0.6: a step of cell-a may close with 2 of its 3 devices after
    # the deadline, while the cloud still needs both cells.
    h = make(rounds=1, quorum=0.6, deadline_s=10)
    h.offline = {"dev-2"}
    h.start()
    h.tick(11.0)  # step 0 of cell-a closes with a quorum; its broadcast does not reach dev-2
    assert h.edges["cell-a"].step == 1
    # Execute: dev-2 comes online and gets the set model at step 1.
    h.reconnect("dev-2")
    for k in range(2, 20):
        h.tick(11.0 * k)
        if h.closed:
            break
    # Assert: it took part from step 1 on, in sync, and the round closed.
    assert h.closed and "dev-2" in h.closed[0].reported["cell-a"]
    assert h.device_digests[("dev-2", 0, 1)] == h.device_digests[("dev-0", 0, 1)]


def test_the_cloud_replans_each_round_from_the_measured_q1() -> None:
    seen: list[float | None] = []

    def replan(q1: float | None) -> qhetfed.QHetFedConfig:
        seen.append(q1)
        base = qhetfed.QHetFedConfig(tau=3, gamma=2, batch_size=8, lr=0.3, seed=5, bits_device=3)
        return base if q1 is None else dataclasses.replace(base, tau=1, gamma=4)

    h = make(rounds=3, bits_device=3)
    h.replan = replan
    h.__post_init__()
    h.run()
    assert seen[0] is None and all(q is not None and q > 0 for q in seen[1:])
    assert [c.metrics["config"]["tau"] for c in h.closed] == [3, 1, 1]


@pytest.mark.parametrize("field,value", [("tau", -1), ("gamma", 0), ("bits_device", 1), ("lr", float("inf"))])
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(LocalProtocolError, match=field):
        qhetfed.QHetFedConfig(**{field: value})  # type: ignore[arg-type]

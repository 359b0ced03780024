"""Hier-Local-QSGD: several edge rounds per global round, quantized deltas, set models in sync."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hierarchy import Hierarchy
from numpy_model import NumpyCompute, init_params, make_data
from role_contract import RoleContract

from fedtier.algorithms import hier_qsgd
from fedtier.algorithms.common import digest
from fedtier.errors import LocalProtocolError

CELLS = {"cell-a": ("dev-0", "dev-1", "dev-2"), "cell-b": ("dev-3", "dev-4")}
DEVICES = [d for ds in CELLS.values() for d in ds]


def make(rounds: int = 2, compute: bool = True, features: int = 6, classes: int = 3, **cfg: object) -> Hierarchy:
    config = hier_qsgd.HierConfig(**{"local_steps": 3, "edge_rounds": 2, "batch_size": 8, "lr": 0.3, "seed": 5,
                                     **cfg})  # type: ignore[arg-type]
    return Hierarchy(algo=hier_qsgd, cells=dict(CELLS), params=init_params(features, classes), config=config,
                     rounds=rounds,
                     compute=NumpyCompute(make_data(DEVICES, features, classes)) if compute else None)


class TestHierQsgdContract(RoleContract):
    def hierarchy(self, **kwargs: object) -> Hierarchy:
        return make(compute=False, **kwargs)  # type: ignore[arg-type]


def test_devices_hold_the_edges_set_model_after_every_edge_round() -> None:
    h = make(bits_device=3, bits_edge=4)
    steps = []

    def at_broadcast(cell: str, step) -> None:
        assert step.model_sha == digest(h.edges[cell]._params)  # the edge's own set model
        steps.append((cell, step))

    h.on_step = at_broadcast
    h.run()
    assert h.finished and len(steps) == 2 * 2  # 2 cells x 2 rounds x (tau - 1 = 1) broadcast steps
    for cell, step in steps:  # every device of the cell holds exactly that model
        assert {h.device_digests[(d, step.round, step.step)] for d in CELLS[cell]} == {step.model_sha}
    assert not [d for d in h.dropped if d.reason == "desync"]


def test_one_round_equals_the_reference_computation_without_quantization() -> None:
    # Prepare: an obvious re-implementation of Algorithm 2 (tau=2) with the same batch streams.
    h = make(rounds=1)
    c = h.config
    compute = h.compute
    w_t = {n: p.copy() for n, p in h.params.items()}
    new_global = {n: np.zeros_like(p, dtype=np.float64) for n, p in w_t.items()}
    for members in CELLS.values():
        w = {n: p.copy() for n, p in w_t.items()}
        for i in range(c.edge_rounds):
            deltas = [compute.local_sgd(w, d, c.local_steps, c.batch_size, c.lr, (c.seed, "batches", "r", d, 0, i))[0]
                      for d in members]
            w = {n: w[n] + np.mean([dl[n] for dl in deltas], axis=0) for n in w}
        for n in w:
            new_global[n] += len(members) / len(DEVICES) * (w[n].astype(np.float64) - w_t[n])
    # Execute
    h.run()
    # Assert
    for n in w_t:
        np.testing.assert_allclose(h.closed[0].params[n], w_t[n] + new_global[n], rtol=0, atol=1e-6)


def test_quantized_uploads_travel_as_qsgd_and_report_their_variance() -> None:
    # 40 x 10 weights: large enough that the tensor bytes, not the header, dominate a message.
    plain = make(rounds=1, features=40, classes=10)
    quantized = make(rounds=1, features=40, classes=10, bits_device=3, bits_edge=5)
    plain.run()
    quantized.run()
    assert quantized.wire_bytes["device_update"] < 0.4 * plain.wire_bytes["device_update"]
    assert quantized.closed[0].metrics["q1"] > 0 and quantized.closed[0].metrics["q2"] > 0
    assert plain.closed[0].metrics["q1"] == 0


@pytest.mark.parametrize("field,value", [("edge_rounds", 0), ("bits_device", 1), ("bits_edge", 9),
                                         ("bits_device", True)])
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(LocalProtocolError, match=field):
        hier_qsgd.HierConfig(**{field: value})  # type: ignore[arg-type]


def test_a_device_whose_step_average_was_lost_takes_the_next_steps_task() -> None:
    # Prepare: dev-1 uploads step 0, then misses the cell's average of it (lost with a restarted broker):
    # it waits at step 0 while the edge, which has its upload, goes on to step 1 and waits for it there.
    h = make(rounds=1)
    lost = "dev-1"

    def lose_step_0(cell: str, msg: Any) -> None:
        if msg.step == 0 and lost in CELLS[cell]:
            h.offline.add(lost)

    h.on_step = lose_step_0
    h.start()
    cell = next(c for c, ds in CELLS.items() if lost in ds)
    assert h.edges[cell].step == 1 and not h.closed
    # Execute: it reconnects; the edge sends it the task at step 1 with the set model.
    h.on_step = None
    h.reconnect(lost)
    # Assert: it took that task (not dropped as a duplicate of its round), trained step 1, and the round closed.
    assert h.closed and lost in h.closed[0].reported[cell]
    assert not [d for d in h.dropped if d.reason == "duplicate"]

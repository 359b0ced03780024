"""HSGD (seed 000): the digest's acceptance checks A1-A8 on its synthetic fixture, and the roles' edge cases.

The roles run in ``local_fleet.hsgd_loop`` (every message through the wire codec);
``local_fleet.hsgd_reference`` is Algorithm 1 written as a plain loop on arrays.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest

from local_fleet import hsgd_loop
from local_fleet import hsgd_reference as ref
from fedtier.algorithms import hsgd, hsgd_plan, load
from fedtier.algorithms.base import Broadcast, SendToParent
from fedtier.errors import (
    EmbeddingEncodingError,
    EmbeddingNonFiniteError,
    EmbeddingWidthError,
    LocalProtocolError,
    StaleIntervalError,
    UnexpectedMessageError,
    UnselectedDeviceError,
)
from fedtier.privacy.plan import CellPlan, NoisePlan
from fedtier.training import split
from fedtier.wire.messages import CellTask, DeviceTask, DeviceUpdate, Embeddings, PartnerEmbeddings, decode_message

ARCH = split.SplitArch(x1=12, x2=8, d1=8, d2=8, classes=3)


@pytest.fixture(scope="module")
def data() -> tuple[list[ref.Group], ref.Group]:
    return ref.fixture(0)


def setup(groups: list[ref.Group], **kw: Any) -> tuple[dict[str, hsgd_loop.HybridCell], hsgd.HsgdConfig]:
    cells = hsgd_loop.make_cells(groups)
    config = hsgd.HsgdConfig(hosts={c: d.host for c, d in cells.items()}, **kw)
    return cells, config


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert set(a) == set(b)
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


def test_registered_and_config_rules() -> None:
    assert load("hsgd") is hsgd
    with pytest.raises(LocalProtocolError, match="P mod Q"):
        hsgd.HsgdConfig(global_interval=6, local_interval=4)
    with pytest.raises(LocalProtocolError, match="alpha"):
        hsgd.HsgdConfig(alpha=0.0)
    with pytest.raises(LocalProtocolError, match="bits_embedding"):
        hsgd.HsgdConfig(bits_embedding=16)
    config = hsgd.HsgdConfig(global_interval=6, local_interval=3, alpha=0.5, hosts={"c": "h"}, bits_embedding=7)
    assert config.intervals == 2
    assert hsgd.HsgdConfig.from_dict(config.to_dict()) == config


# --- A1 / A2: aggregation weights ---------------------------------------------------------------------


def drive_to_train_phase(edge: hsgd.Edge, params: dict[str, np.ndarray], devices: tuple[str, ...],
                         config: hsgd.HsgdConfig) -> tuple[str, ...]:
    """CellTask, every selected device's embedding, the host's rows: the edge now waits for theta2."""
    task = CellTask(rollout="r", round=0, sender="cloud", params=params, members=(*devices, "h"),
                    config=config.to_dict())
    edge.receive(task, 0.0)
    for d in edge.selected:
        edge.receive(Embeddings(rollout="r", round=0, sender=d, zeta=np.ones((1, ARCH.d2), np.float32), rows=(d,)),
                     0.0)
    rows = edge.selected
    edge.receive(Embeddings(rollout="r", round=0, sender="h", zeta=np.ones((len(rows), ARCH.d1), np.float32),
                            rows=rows, params=split.block(params, "theta0")), 0.0)
    return rows


def test_a1_edge_takes_the_unweighted_mean_of_the_selected_devices_only() -> None:
    params = split.init_params(ARCH, 1)
    devices = tuple(f"d{i}" for i in range(10))
    config = hsgd.HsgdConfig(global_interval=2, local_interval=1, alpha=0.4, hosts={"c": "h"})
    edge = hsgd.Edge(cell="c", rollout="r")
    rows = drive_to_train_phase(edge, params, devices, config)
    assert len(rows) == 4
    rng = np.random.default_rng(0)
    theta2 = split.block(params, "theta2")
    deltas = {d: {k: rng.normal(size=v.shape).astype(np.float32) for k, v in theta2.items()} for d in rows}
    outsider = next(d for d in devices if d not in rows)
    with pytest.raises(UnselectedDeviceError):
        edge.receive(DeviceUpdate(rollout="r", round=0, sender=outsider, delta=deltas[rows[0]], num_samples=1), 0.0)
    actions = []
    for d in rows:
        actions = edge.receive(DeviceUpdate(rollout="r", round=0, sender=d, delta=deltas[d], num_samples=1), 0.0)
    expected = {k: np.mean([theta2[k] + deltas[d][k] for d in rows], axis=0) for k in theta2}
    assert max_diff(edge.theta2, expected) < 1e-6
    assert edge.rejected["unselected_device"] == 1
    # line 18: the next interval's task goes to every device (a broadcast) with that mean
    (task,) = [a for a in actions if isinstance(a, Broadcast)]
    assert task.message.step == 1 and max_diff(dict(task.message.params), expected) < 1e-6


def test_a1_every_device_holds_the_cell_model_after_line_18(data: Any) -> None:
    groups, _ = data
    cells, config = setup(groups[:1], global_interval=2, local_interval=1, alpha=0.2, lr=0.05)
    res = hsgd_loop.run(cells, split.init_params(ARCH, 0), config, rounds=1, keep_trace=True)
    broadcasts = Counter(r for s, r, k, _, st in res.trace if k == "device_task" and st == 1)
    assert set(broadcasts) == set(cells["cell0"].devices)
    # devices not selected in the last interval hold exactly the theta2 the edge broadcast
    last = res.edges["cell0"].history[-1]
    idle = [d for d in cells["cell0"].devices if d not in last["selected"]]
    held = [res.devices[d].theta2 for d in idle]
    assert all(max_diff(h, held[0]) == 0 for h in held)


def test_a2_cloud_weights_cells_by_their_device_count(data: Any) -> None:
    groups, _ = data
    cells, config = setup(groups, global_interval=2, local_interval=1, alpha=0.2, lr=0.05)
    init = split.init_params(ARCH, 0)
    res = hsgd_loop.run(cells, init, config, rounds=1)
    for c, edge in res.edges.items():
        assert edge.devices == cells[c].devices
    # rebuild each cell's model from the edges' state: theta2_m and the hosts' final params
    local = {c: {**res.hosts[cells[c].host].params, **res.edges[c].theta2} for c in cells}
    sizes = {c: len(cells[c].devices) for c in cells}
    assert sorted(sizes.values()) == [60, 90, 150]
    expected = {k: sum(sizes[c] * local[c][k].astype(np.float64) for c in cells) / 300 for k in init}
    assert max_diff(res.params, expected) < 1e-6
    uniform = {k: sum(local[c][k].astype(np.float64) for c in cells) / 3 for k in init}
    assert max_diff(res.params, uniform) > 1e-4  # not uniform weights


# --- A3: schedule and message counts --------------------------------------------------------------------


def test_a3_schedule_and_message_counts(data: Any) -> None:
    groups, _ = data
    P, Q, rounds, alpha = 4, 2, 3, 0.1
    cells, config = setup(groups, global_interval=P, local_interval=Q, alpha=alpha, lr=0.05)
    res = hsgd_loop.run(cells, split.init_params(ARCH, 0), config, rounds=rounds, keep_trace=True)
    T = rounds * P
    assert len(res.rounds) == math.ceil(T / P)
    for c, d in cells.items():
        k = int(math.floor(alpha * len(d.devices) + 0.5))
        exchanges = [(r, st) for s, rcv, kind, r, st in res.trace if kind == "hsgd_partner" and rcv == d.host]
        assert len(exchanges) == math.ceil(T / Q) == len(res.edges[c].history)
        for h in res.edges[c].history:
            ups = [s for s, rcv, kind, r, st in res.trace
                   if kind == "hsgd_embeddings" and rcv == c and (r, st) == (h["round"], h["step"]) and s != d.host]
            assert sorted(ups) == sorted(h["selected"]) and len(ups) == k
            sent = {s for s, rcv, kind, r, st in res.trace if rcv == c and (r, st) == (h["round"], h["step"])}
            assert sent - {d.host, "cloud"} == set(h["selected"])  # zero messages from unselected devices


# --- A4: reduction to centralized SGD -------------------------------------------------------------------


@pytest.mark.parametrize("groups_used", [1, 3])
def test_a4_p_q_1_alpha_1_is_centralized_sgd(data: Any, groups_used: int) -> None:
    groups, _ = data
    groups = groups[:groups_used]
    cells, config = setup(groups, global_interval=1, local_interval=1, alpha=1.0, lr=0.1)
    init = split.init_params(ARCH, 0)
    res = hsgd_loop.run(cells, init, config, rounds=3)
    central = ref.centralized(groups, init, lr=0.1, steps=3)
    assert max_diff(res.params, central) < 1e-5
    assert max_diff(res.params, init) > 1e-3  # it moved


def test_roles_equal_algorithm_1_with_stale_partners(data: Any) -> None:
    groups, _ = data
    cells, config = setup(groups, global_interval=8, local_interval=4, alpha=0.2, lr=0.05, seed=5)
    init = split.init_params(ARCH, 2)
    res = hsgd_loop.run(cells, init, config, rounds=2)
    expected = ref.reference(groups, init, P=8, Q=4, alpha=0.2, lr=0.05, rounds=2, seed=5)
    assert max_diff(res.params, expected) < 1e-5


# --- A5: staleness and reuse ----------------------------------------------------------------------------


class Recording(split.SplitTrainer):
    def __init__(self, inner: split.SplitTrainer, log: list[tuple[str, Any]], node: str) -> None:
        self.inner, self.log, self.node = inner, log, node

    def embed(self, block_name: str, params: Any, rows: tuple[str, ...]) -> np.ndarray:
        return self.inner.embed(block_name, params, rows)

    def train(self, side: str, params: Any, frozen: Any, partner: np.ndarray, rows: tuple[str, ...], steps: int,
              lr: float) -> Any:
        self.log.append((self.node, side, partner.copy(), rows, steps))
        return self.inner.train(side, params, frozen, partner, rows, steps, lr)


def test_a5_one_exchange_per_interval_and_the_partner_values_are_those_of_its_start(data: Any) -> None:
    groups, _ = data
    Q = 4
    cells, config = setup(groups[:1], global_interval=2 * Q, local_interval=Q, alpha=0.1, lr=0.05)
    init = split.init_params(ARCH, 0)
    host = cells["cell0"].host
    log: list[tuple[str, Any]] = []
    orig = split.SplitTrainer

    def factory(x: Any, y: Any) -> Recording:
        return Recording(orig(x, y), log, next(iter(x)) if len(x) == 1 else host)

    hsgd_loop.SplitTrainer = factory  # type: ignore[misc,assignment]
    try:
        res = hsgd_loop.run(cells, init, config, rounds=1, keep_trace=True)
    finally:
        hsgd_loop.SplitTrainer = orig  # type: ignore[misc]
    assert not {k for *_, k, _, _ in [(s, r, kind, rr, st) for s, r, kind, rr, st in res.trace] if "gradient" in k}
    hist = res.edges["cell0"].history
    # one exchange per interval: Z2 reaches the host once, and one SplitTrain of Q steps uses it
    assert [(r, st) for s, rcv, k, r, st in res.trace if k == "hsgd_partner" and rcv == host] == [(0, 0), (0, 1)]
    host_calls = [e for e in log if e[1] == "host"]
    assert [e[4] for e in host_calls] == [Q, Q]
    assert [e[3] for e in host_calls] == [h["rows"] for h in hist] == [b[2] for b in res.hosts[host].batches]
    dev_calls = [e for e in log if e[1] == "device"]
    assert len(dev_calls) == sum(len(h["rows"]) for h in hist) and all(e[4] == Q for e in dev_calls)
    # the exchanged zeta2 of interval 1 is h2(theta2_m after eq. (1) of interval 0): what a device that was
    # not selected in interval 1 holds from the broadcast
    x2 = {d: groups[0][1][i] for i, d in enumerate(cells["cell0"].devices)}
    idle = next(d for d in cells["cell0"].devices if d not in hist[1]["selected"])
    expected = split.embed(res.devices[idle].theta2, "theta2", np.stack([x2[d] for d in hist[1]["rows"]]))
    assert np.array_equal(host_calls[1][2], expected)
    assert not np.array_equal(res.devices[idle].theta2["theta2/w"], init["theta2/w"])


# --- A6: the paper's communication meter ----------------------------------------------------------------


def test_a6_worked_example() -> None:
    """The digest's illustrative sizes (made up for it, not the paper's)."""
    s = hsgd_plan.Sizes(theta0=1000, theta1=5000, theta2=2000, selected=10, d1=16, d2=16)
    assert hsgd_plan.cost_round(s, 10, 5) == 47_640
    assert hsgd_plan.bytes_round(s, 10, 5) == 190_560
    assert hsgd_plan.cost_total(s, 10, 5, M=3, T=100) == pytest.approx(47_640 * 3 * 10)
    c = hsgd_plan.bytes_round(s, 10, 5, bits_embedding=7)
    # theta0 as one row (a scale and 1000 7-bit codes), Z1 and Z2 as 10 rows of 16 (10 scales, 160 codes)
    assert c == 4 * (5000 + 2 * 10 * 2000) + 2 * ((4 + 875) + 2 * (40 + 140))
    k = hsgd_plan.bytes_round(s, 10, 5, bits_embedding=7, compressor="topk")
    # top-k keeps ceil(7/32 of a row): 219 of theta0's 1000, 4 of each 16-wide row; 2-byte index + 4-byte value
    assert k == 4 * (5000 + 2 * 10 * 2000) + 2 * 6 * (219 + 2 * 10 * 4)
    with pytest.raises(LocalProtocolError):
        hsgd_plan.cost_round(s, 10, 4)


def test_a6_the_edges_meter_equals_eq_19(data: Any) -> None:
    groups, _ = data
    P, Q, rounds, alpha = 6, 2, 2, 0.1
    cells, config = setup(groups, global_interval=P, local_interval=Q, alpha=alpha, lr=0.05)
    res = hsgd_loop.run(cells, split.init_params(ARCH, 0), config, rounds=rounds)
    total = 0.0
    for c, d in cells.items():
        k = int(math.floor(alpha * len(d.devices) + 0.5))
        s = hsgd_plan.Sizes(ARCH.block_size("theta0"), ARCH.block_size("theta1"), ARCH.block_size("theta2"), k,
                            ARCH.d1, ARCH.d2)
        assert res.edges[c].paper_values == hsgd_plan.cost_round(s, P, Q)  # the last round's meter
        total += hsgd_plan.cost_total(s, P, Q, M=1, T=rounds * P)
    assert sum(r["paper_values"] for r in res.rounds) == total


# --- A7: strategy formulas ------------------------------------------------------------------------------


def test_a7_strategy_values() -> None:
    paper = hsgd_plan.strategy2(F0=2.3, rho=1, eta=0.01, delta=0.5, T=1000)
    derived = hsgd_plan.strategy2(F0=2.3, rho=1, eta=0.01, delta=0.5, T=1000, mode="derived")
    assert paper[0] == pytest.approx(1.958, abs=1e-3) and paper[1] == 2
    assert derived[0] == pytest.approx(19.58, abs=1e-2) and derived[1] == 20
    table = {(5, 5): 0.0061004, (10, 10): 0.0030502, (10, 5): 0.0037457, (20, 10): 0.0018729,
             (40, 20): 0.00093644, (20, 5): 0.0020220}
    for (P, Q), eta in table.items():
        eta2, star = hsgd_plan.strategy3(P=P, Q=Q, rho=1, delta=1, grad_sq=1)
        assert eta2 == pytest.approx(eta, rel=1e-4)
        assert star == min(eta2, 1 / (8 * P))
    assert hsgd_plan.strategy3(P=20, Q=5, rho=1, delta=1, grad_sq=1)[0] < hsgd_plan.strategy3(P=10, Q=5, rho=1,
                                                                                              delta=1, grad_sq=1)[0]
    assert hsgd_plan.lambda_bound(P=1, rho=1, eta=0.001, delta=0.1, xi=1.0, dF=0.1, T=10_000) < 1
    assert hsgd_plan.lambda_bound(P=1, rho=1, eta=0.001, delta=0.1, xi=0.001, dF=0.1, T=10_000) == math.inf


# --- A8: convergence sanity -----------------------------------------------------------------------------


def minibatch_sgd(groups: list[ref.Group], init: dict[str, np.ndarray], *, batch: int, steps: int, lr: float,
                  seed: int) -> dict[str, np.ndarray]:
    x1 = np.concatenate([g[0] for g in groups])
    x2 = np.concatenate([g[1] for g in groups])
    y = np.concatenate([g[2] for g in groups])
    rng = np.random.default_rng(seed)
    p = {k: v.astype(np.float64) for k, v in init.items()}
    for _ in range(steps):
        idx = rng.choice(len(y), batch, replace=False)
        _, g = split.full_loss_grad(p, x1[idx], x2[idx], y[idx])
        p = {k: p[k] - lr * g[k] for k in p}
    return p


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a8_converges(seed: int) -> None:
    groups, test = ref.fixture(seed)
    P = Q = 5
    rounds = 40
    cells, config = setup(groups, global_interval=P, local_interval=Q, alpha=0.2, lr=0.05, seed=seed)
    init = split.init_params(ARCH, seed)
    res = hsgd_loop.run(cells, init, config, rounds=rounds)
    losses = [r["train_loss"] for r in res.rounds]  # one per P = 5 iterations: 10 rounds = 50 iterations
    assert np.mean(losses[-10:]) <= 0.5 * np.mean(losses[:10])
    _, acc = ref.loss_and_accuracy(res.params, test)
    central = minibatch_sgd(groups, init, batch=60, steps=rounds * P, lr=0.05, seed=seed)
    _, acc_c = ref.loss_and_accuracy(central, test)
    assert acc >= 0.9 * acc_c, (acc, acc_c)


# --- bad embeddings, stragglers, privacy ----------------------------------------------------------------


def test_bad_embeddings_are_refused_with_typed_reasons_and_counted() -> None:
    params = split.init_params(ARCH, 1)
    devices = tuple(f"d{i}" for i in range(10))
    config = hsgd.HsgdConfig(global_interval=2, local_interval=1, alpha=0.3, hosts={"c": "h"})
    edge = hsgd.Edge(cell="c", rollout="r")
    edge.receive(CellTask(rollout="r", round=0, sender="cloud", params=params, members=(*devices, "h"),
                          config=config.to_dict()), 0.0)
    chosen = edge.selected
    other = next(d for d in devices if d not in chosen)

    def emb(sender: str, zeta: np.ndarray, step: int = 0, rnd: int = 0) -> Embeddings:
        return Embeddings(rollout="r", round=rnd, sender=sender, step=step, zeta=zeta, rows=(sender,))

    good = np.ones((1, ARCH.d2), np.float32)
    cases = [(emb(chosen[0], np.ones((1, ARCH.d2 + 1), np.float32)), EmbeddingWidthError),
             (emb(chosen[0], np.full((1, ARCH.d2), np.nan, np.float32)), EmbeddingNonFiniteError),
             (emb(other, good), UnselectedDeviceError)]
    for message, error in cases:
        with pytest.raises(error):
            edge.receive(message, 0.0)
    for d in chosen:
        edge.receive(emb(d, good), 0.0)
    late = emb(chosen[0], good).__class__(rollout="r", round=0, sender=other, step=0, zeta=good, rows=(other,))
    edge.receive(CellTask(rollout="r", round=1, sender="cloud", params=params, members=(*devices, "h"),
                          config=config.to_dict()), 1.0)
    with pytest.raises(StaleIntervalError):  # an embedding of round 0 reaches the edge in round 1
        edge.receive(late, 1.0)
    assert edge.rejected == Counter({"embedding_width": 1, "embedding_non_finite": 1, "unselected_device": 1,
                                     "stale_interval": 1})


def test_a_silent_device_and_a_corrupt_one_do_not_stall_the_interval(data: Any) -> None:
    groups, _ = data
    cells, config = setup(groups[:1], global_interval=2, local_interval=1, alpha=0.2, lr=0.05)
    init = split.init_params(ARCH, 0)
    first = hsgd.select(cells["cell0"].devices, 0.2, 0, "hsgd", "cell0", 0, 0)
    silent, corrupt = first[0], first[1]

    def inject(node: str, message: Any) -> Any:
        if node == corrupt and isinstance(message, Embeddings):
            return Embeddings(rollout=message.rollout, round=message.round, sender=node, step=message.step,
                              zeta=np.ones((1, 3), np.float32), rows=message.rows)
        return message

    res = hsgd_loop.run(cells, init, config, rounds=2, silent=[silent], inject=inject)
    assert len(res.rounds) == 2
    first_interval = res.edges["cell0"].history[0]
    assert silent not in first_interval["rows"] and corrupt not in first_interval["rows"]
    assert len(first_interval["rows"]) == len(first) - 2
    assert res.rejected["embedding_width"] >= 1
    assert any(n.event == "hsgd_embeddings_missing" for n in res.notes)


def test_embedding_messages_round_trip_and_validate() -> None:
    m = PartnerEmbeddings(rollout="r", round=2, sender="c", step=1, zeta=np.ones((2, 3), np.float32), rows=("a", "b"),
                          params={"theta0/w": np.zeros((3, 4), np.float32)})
    back = decode_message(m.encode())
    assert isinstance(back, PartnerEmbeddings) and back.rows == ("a", "b") and set(back.params) == {"theta0/w"}
    assert np.array_equal(back.zeta, m.zeta)
    bad = Embeddings(rollout="r", round=0, sender="d", zeta=np.ones((2, 3), np.float32), rows=("d",))
    with pytest.raises(Exception, match="rows"):
        decode_message(bad.encode())


VERTICAL_HOPS = {("hsgd_embeddings", "device", "edge"), ("hsgd_partner", "edge", "host"),
                 ("hsgd_embeddings", "host", "edge"), ("hsgd_partner", "edge", "device")}


@pytest.mark.parametrize(("bits", "compressor"), [(32, "qsgd"), (7, "qsgd"), (3, "qsgd"), (7, "topk")])
def test_every_vertical_hop_is_compressed_and_the_meters_equal_the_wire(data: Any, bits: int,
                                                                        compressor: str) -> None:
    """bits_embedding applies to every hop, the edge's relays included: the tensor bytes each hop carried equal
    ``vertical_hop_bytes``, and the paper's items as they crossed the wire (theta1, the devices' theta2, Z2 to the
    host, Z1 and theta0 from it) equal the edge's ``paper_bytes`` and ``bytes_round``."""
    groups, _ = data
    P, Q, rounds, alpha = 4, 2, 2, 0.1
    cells, config = setup(groups, global_interval=P, local_interval=Q, alpha=alpha, lr=0.05, bits_embedding=bits,
                          compressor=compressor)
    res = hsgd_loop.run(cells, split.init_params(ARCH, 0), config, rounds=rounds)

    expected_hops, expected_paper = 0, 0
    for d in cells.values():
        k = int(math.floor(alpha * len(d.devices) + 0.5))
        s = hsgd_plan.Sizes(ARCH.block_size("theta0"), ARCH.block_size("theta1"), ARCH.block_size("theta2"), k,
                            ARCH.d1, ARCH.d2, classes=ARCH.classes)
        expected_hops += rounds * (P // Q) * hsgd_plan.vertical_hop_bytes(s, bits, compressor)
        expected_paper += rounds * hsgd_plan.bytes_round(s, P, Q, bits, compressor)
    measured_hops = sum(v for key, v in res.tensors.items() if key in VERTICAL_HOPS)
    assert measured_hops == expected_hops == sum(r["vertical_bytes"] for r in res.rounds)
    theta1 = 4 * ARCH.block_size("theta1") * rounds * len(cells)
    measured_paper = (res.tensors[("hsgd_partner", "edge", "host")] + res.tensors[("hsgd_embeddings", "host", "edge")]
                      + res.tensors[("device_update", "device", "edge")] + theta1)
    assert measured_paper == expected_paper == sum(r["paper_bytes"] for r in res.rounds)


def test_relays_are_compressed_too_and_top_k_is_a_second_compressor(data: Any) -> None:
    groups, _ = data
    init = split.init_params(ARCH, 0)
    runs = {}
    for bits, compressor in ((32, "qsgd"), (7, "qsgd"), (7, "topk")):
        cells, config = setup(groups[:1], global_interval=2, local_interval=1, alpha=0.2, lr=0.05,
                              bits_embedding=bits, compressor=compressor)
        runs[(bits, compressor)] = hsgd_loop.run(cells, init, config, rounds=2, keep_trace=True)
    f32, q7, k7 = runs[(32, "qsgd")], runs[(7, "qsgd")], runs[(7, "topk")]
    for hop in VERTICAL_HOPS:  # every hop shrinks, the edge's relays to the host and the devices included
        assert q7.tensors[hop] < 0.4 * f32.tensors[hop], hop
        assert k7.tensors[hop] < 0.6 * f32.tensors[hop], hop
    assert q7.bytes["edge_up"] == f32.bytes["edge_up"]  # the models to the cloud stay float32
    assert f32.trace == q7.trace == k7.trace  # the same messages, smaller
    assert max_diff(q7.params, f32.params) > 0 and max_diff(k7.params, f32.params) > 0


def test_the_edge_refuses_embeddings_and_heads_not_in_the_compressed_form() -> None:
    params = split.init_params(ARCH, 1)
    devices = tuple(f"d{i}" for i in range(10))
    for compressor in ("qsgd", "topk"):
        config = hsgd.HsgdConfig(global_interval=1, local_interval=1, alpha=0.3, hosts={"c": "h"},
                                 bits_embedding=7, compressor=compressor)
        edge = hsgd.Edge(cell="c", rollout="r")
        edge.receive(CellTask(rollout="r", round=0, sender="cloud", params=params, members=(*devices, "h"),
                              config=config.to_dict()), 0.0)
        raw = (np.arange(1, ARCH.d2 + 1, dtype=np.float32) / 7.3)[None, :] ** 2  # float32: off the grid, dense
        with pytest.raises(EmbeddingEncodingError):
            edge.receive(Embeddings(rollout="r", round=0, sender=edge.selected[0], zeta=raw,
                                    rows=(edge.selected[0],)), 0.0)
        rng = np.random.default_rng(0)
        for d in edge.selected:
            zeta = (hsgd.quant.qrows(raw, 7, rng) if compressor == "qsgd"
                    else hsgd.quant.topk_rows(raw, hsgd.quant.topk_count(ARCH.d2, 7)))
            edge.receive(Embeddings(rollout="r", round=0, sender=d, zeta=zeta, rows=(d,)), 0.0)
        rows = edge.selected
        with pytest.raises(EmbeddingEncodingError):  # Z1 compressed, the head in float32
            z1 = np.ones((len(rows), ARCH.d1), np.float32) if compressor == "qsgd" else np.zeros((len(rows), ARCH.d1),
                                                                                               np.float32)
            edge.receive(Embeddings(rollout="r", round=0, sender="h", zeta=z1, rows=rows,
                                    params=split.block(params, "theta0")), 0.0)
        assert edge.rejected == Counter({"embedding_encoding": 2})


def test_compressor_and_lr_schedule_settings() -> None:
    with pytest.raises(LocalProtocolError, match="compressor"):
        hsgd.HsgdConfig(compressor="zip")
    with pytest.raises(LocalProtocolError, match="lr_decay_every"):
        hsgd.HsgdConfig(lr_schedule="step")
    with pytest.raises(LocalProtocolError, match="multiple of local_interval"):
        hsgd.HsgdConfig(global_interval=4, local_interval=2, lr_schedule="step", lr_decay_every=3)
    with pytest.raises(LocalProtocolError, match="lr_decay_factor"):
        hsgd.HsgdConfig(lr_schedule="step", lr_decay_every=2, lr_decay_factor=1.5)
    plain = hsgd.HsgdConfig(hosts={"c": "h"})
    assert not {"compressor", "lr_schedule", "lr_decay_every", "lr_decay_factor"} & set(plain.to_dict())
    config = hsgd.HsgdConfig(global_interval=4, local_interval=2, hosts={"c": "h"}, compressor="topk",
                             bits_embedding=7, lr=0.2, lr_schedule="step", lr_decay_every=6)
    assert hsgd.HsgdConfig.from_dict(config.to_dict()) == config
    assert [config.lr_at(r, s) for r in range(3) for s in range(2)] == [0.2, 0.2, 0.2, 0.1, 0.1, 0.1]
    assert config.lr_at(3, 0) == 0.05  # iteration 12


def test_the_lr_of_every_interval_is_the_schedules(data: Any) -> None:
    """Hosts and devices train every interval at the rate the schedule gives its first iteration ``r P + s Q``."""
    groups, _ = data
    P, Q, every = 4, 2, 6
    cells, config = setup(groups[:2], global_interval=P, local_interval=Q, alpha=0.1, lr=0.08, lr_schedule="step",
                          lr_decay_every=every, lr_decay_factor=0.5)
    used: dict[tuple[str, int, int], set[float]] = {}

    class Recording(split.SplitTrainer):
        def train(self, side: str, params: Any, frozen: Any, partner: Any, rows: Any, steps: int,
                  lr: float) -> Any:
            used.setdefault((side, current[0], current[1]), set()).add(lr)
            return super().train(side, params, frozen, partner, rows, steps, lr)

    current = [0, 0]
    trace: list[Any] = []

    def hook(node: str, message: Any) -> Any:
        current[:] = [message.round, message.step]
        trace.append(message)
        return message

    res = hsgd_loop.run(cells, split.init_params(ARCH, 0), config, rounds=4, inject=hook,
                        make_trainer=lambda side, x, y: Recording(x, y))
    assert len(res.rounds) == 4
    assert {(side, r, s) for side, r, s in used} >= {(side, r, s) for side in ("host", "device") for r in range(4)
                                                     for s in range(P // Q)}
    for (side, r, s), lrs in used.items():
        assert lrs == {0.08 * 0.5 ** ((r * P + s * Q) // every)}, (side, r, s)


def test_privacy_is_refused() -> None:
    plan = NoisePlan(mode="paper", epsilon=1.0, delta=1e-5, budget_epsilon=math.inf, clip=1.0, edge_rounds=1,
                     rounds=10, require_tls=False,
                     cells={"c": CellPlan(trusted=False, members=3, device_z=1.0, edge_z=0.0)}).to_dict()
    with pytest.raises(LocalProtocolError, match="does not run under"):
        hsgd.HsgdConfig(hosts={"c": "h"}, privacy=plan)
    config = hsgd.HsgdConfig(hosts={"c": "h"}).to_dict()
    config["privacy"] = plan
    edge = hsgd.Edge(cell="c", rollout="r")
    with pytest.raises(UnexpectedMessageError, match="noise plan"):
        edge.receive(CellTask(rollout="r", round=0, sender="cloud", params=split.init_params(ARCH, 0),
                              members=("d", "h"), config=config), 0.0)


def test_host_and_device_refuse_misuse_and_duplicates() -> None:
    config = hsgd.HsgdConfig(global_interval=1, local_interval=1, alpha=1.0, hosts={"c": "h"})
    params = split.init_params(ARCH, 0)
    dev = hsgd.Device(device_id="d", cell="c", rollout="r")
    task = DeviceTask(rollout="r", round=0, sender="c", params=split.block(params, "theta2"),
                      config=config.to_dict(), members=("d",))
    (embed,) = dev.receive(task, 0.0)
    assert isinstance(embed, hsgd.Embed) and embed.block == "theta2"
    assert dev.receive(task, 0.0)[0].reason == "duplicate"  # type: ignore[union-attr]
    (send,) = dev.embedded(0, 0, np.ones((1, ARCH.d2), np.float32))
    assert isinstance(send, SendToParent) and isinstance(send.message, Embeddings)
    with pytest.raises(LocalProtocolError):
        dev.embedded(0, 0, np.ones((1, ARCH.d2), np.float32))
    host = hsgd.Host(host_id="h", cell="c", rollout="r")
    assert host.receive(task, 0.0)[0].reason == "not_for_host"  # type: ignore[union-attr]


def test_edge_drops_duplicates_and_refuses_other_rounds_and_strangers() -> None:
    from fedtier.errors import LateMessageError, UnknownSenderError, WrongRoundError

    params = split.init_params(ARCH, 1)
    devices = tuple(f"d{i}" for i in range(6))
    config = hsgd.HsgdConfig(global_interval=2, local_interval=1, alpha=0.5, hosts={"c": "h"})
    edge = hsgd.Edge(cell="c", rollout="r")
    task = CellTask(rollout="r", round=1, sender="cloud", params=params, members=(*devices, "h"),
                    config=config.to_dict())
    first = edge.receive(task, 0.0)
    assert len(first) == 2  # the host's task and the broadcast
    assert [a.reason for a in edge.receive(task, 0.0)] == ["duplicate"]  # type: ignore[union-attr]
    with pytest.raises(LateMessageError):
        edge.receive(CellTask(rollout="r", round=0, sender="cloud", params=params, members=(*devices, "h"),
                              config=config.to_dict()), 0.0)
    zeta = np.ones((1, ARCH.d2), np.float32)
    with pytest.raises(WrongRoundError):
        edge.receive(Embeddings(rollout="r", round=2, sender=edge.selected[0], zeta=zeta,
                                rows=(edge.selected[0],)), 0.0)
    with pytest.raises(UnknownSenderError):
        edge.receive(Embeddings(rollout="r", round=1, sender="stranger", zeta=zeta, rows=("stranger",)), 0.0)
    with pytest.raises(UnknownSenderError):
        edge.receive(CellTask(rollout="r", round=2, sender="impostor", params=params, members=devices), 0.0)
    assert edge.rejected["wrong_round"] == 1 and edge.rejected["unknown_sender"] == 1


def test_a_misused_role_stays_in_error() -> None:
    dev = hsgd.Device(device_id="d", cell="c", rollout="r")
    with pytest.raises(LocalProtocolError):
        dev.split_trained(0, 0, {}, 0.0)
    config = hsgd.HsgdConfig(hosts={"c": "h"})
    task = DeviceTask(rollout="r", round=0, sender="c", params=split.block(split.init_params(ARCH, 0), "theta2"),
                      config=config.to_dict(), members=("d",))
    with pytest.raises(LocalProtocolError, match="ERROR"):
        dev.receive(task, 0.0)


def test_resend_gives_a_returning_child_what_the_interval_still_expects_of_it() -> None:
    from fedtier.algorithms.base import SendToChild

    params = split.init_params(ARCH, 1)
    devices = tuple(f"d{i}" for i in range(6))
    config = hsgd.HsgdConfig(global_interval=2, local_interval=1, alpha=0.5, hosts={"c": "h"})
    edge = hsgd.Edge(cell="c", rollout="r")
    edge.receive(CellTask(rollout="r", round=0, sender="cloud", params=params, members=(*devices, "h"),
                          config=config.to_dict()), 0.0)
    chosen, other = edge.selected, next(d for d in devices if d not in edge.selected)
    assert edge.members == (*devices, "h")
    [again] = edge.resend(chosen[0], 0.0)
    assert isinstance(again, SendToChild) and isinstance(again.message, DeviceTask) and again.message.step == 0
    assert edge.resend(other, 0.0) == []
    assert [type(a.message).__name__ for a in edge.resend("h", 0.0)] == ["DeviceTask"]  # type: ignore[union-attr]
    for d in chosen:
        edge.receive(Embeddings(rollout="r", round=0, sender=d, zeta=np.ones((1, ARCH.d2), np.float32), rows=(d,)), 0.0)
    assert edge.resend(chosen[0], 0.0) == []  # it answered
    [rows] = edge.resend("h", 0.0)
    assert isinstance(rows.message, PartnerEmbeddings) and rows.message.rows == chosen  # type: ignore[union-attr]

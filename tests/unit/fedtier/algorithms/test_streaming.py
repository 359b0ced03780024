"""Streaming aggregation at the edge: updates folded as they arrive equal the stored aggregation.

What "bit-identical" means here: the float32 result of a step (and the quantized cell update made from it)
is bit for bit the stored rule's when the updates are folded in the order the stored rule adds them; in
any other arrival order the float64 running sum differs by rounding alone, so the float32 mean is within
1e-7 (and one unit in the last place) of the stored one. Rules that need every update see exactly the
updates they would have, in sender order, so they are bit-identical whatever the arrival order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedtier.algorithms import aggregate, hier_qsgd, qhetfed, strategies
from fedtier.algorithms.hier_qsgd import HierConfig
from fedtier.algorithms.base import SendToParent
from fedtier.algorithms.common import quantize
from fedtier import wire
from fedtier.errors import LocalProtocolError
from fedtier.wire import messages
from fedtier.wire.messages import CellTask, CellUpdate, DeviceUpdate

SHAPES = {"w": (5, 7), "b": (7,), "s": ()}


def updates_and_weights(seed: int, n: int, zero_share: float = 0.0) -> tuple[list[dict[str, np.ndarray]], list[float]]:
    gen = np.random.default_rng(seed)
    scales = 10.0 ** gen.uniform(-4, 2, size=n)  # magnitudes spread over six decades
    ups = [{k: (gen.normal(size=s) * scales[i]).astype(np.float32) for k, s in SHAPES.items()} for i in range(n)]
    weights = gen.integers(1, 500, size=n).astype(float)
    weights[gen.random(n) < zero_share] = 0.0
    return ups, weights.tolist()


def assert_close_to_1e7(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == np.float32 and got[k].shape == want[k].shape
        np.testing.assert_allclose(got[k], want[k], rtol=1e-7, atol=1e-7)
        # float64 rounding moves the float32 result by at most one unit in the last place
        assert np.all(np.abs(got[k] - want[k]) <= np.spacing(np.maximum(np.abs(got[k]), np.abs(want[k]))))


def assert_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k


# --- the accumulators ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_folding_in_the_stored_order_is_weighted_mean_bit_for_bit(seed: int) -> None:
    ups, weights = updates_and_weights(seed, n=9)
    mean = aggregate.RunningMean()
    for u, w in zip(ups, weights, strict=True):
        mean.fold(u, w)

    assert_identical(mean.mean(), aggregate.weighted_mean(list(zip(ups, weights, strict=True))))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 40), zero_share=st.sampled_from([0.0, 0.3]),
       uniform=st.booleans())
def test_folding_in_any_arrival_order_equals_the_stored_mean_to_1e7(seed: int, n: int, zero_share: float,
                                                                   uniform: bool) -> None:
    ups, weights = updates_and_weights(seed, n, zero_share)
    if uniform:
        weights = [1.0] * n
    if sum(weights) == 0:
        weights[0] = 3.0
    order = np.random.default_rng(seed + 1).permutation(n)
    mean = aggregate.RunningMean()
    for i in order:
        mean.fold(ups[i], weights[i])

    assert_close_to_1e7(mean.mean(), aggregate.weighted_mean(list(zip(ups, weights, strict=True))))


def test_all_zero_weights_give_the_plain_mean_as_device_weights_does() -> None:
    ups, _ = updates_and_weights(3, n=5)
    mean = aggregate.RunningMean()
    for u in ups:
        mean.fold(u, 0.0)

    assert_identical(mean.mean(), aggregate.weighted_mean([(u, 1.0) for u in ups]))


def test_a_positive_weight_after_zeros_drops_the_plain_mean() -> None:
    ups, _ = updates_and_weights(4, n=4)
    mean = aggregate.RunningMean()
    for u, w in zip(ups, [0.0, 0.0, 2.0, 0.0], strict=True):
        mean.fold(u, w)

    assert_identical(mean.mean(), aggregate.weighted_mean(list(zip(ups, [0.0, 0.0, 2.0, 0.0], strict=True))))
    assert mean.count == 4


def test_the_accumulator_refuses_what_weighted_mean_refuses() -> None:
    ups, _ = updates_and_weights(5, n=2)
    total = aggregate.WeightedSum()
    with pytest.raises(LocalProtocolError, match="nothing"):
        total.mean()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(LocalProtocolError, match="invalid weight"):
            total.fold(ups[0], bad)
    total.fold(ups[0], 1.0)
    with pytest.raises(LocalProtocolError, match="names differ"):
        total.fold({"w": ups[1]["w"]}, 1.0)
    with pytest.raises(LocalProtocolError, match="shape"):
        total.fold({**ups[1], "b": np.zeros(3, np.float32)}, 1.0)
    assert total.count == 1  # a refused update changed nothing


def test_the_block_keeps_float32_rows_as_read_only_views() -> None:
    ups, _ = updates_and_weights(6, n=3)
    block = aggregate.UpdateBlock(ups[0], rows=3)
    for i, u in enumerate(ups):
        block.add(f"d{i}", u)

    kept = block.updates(["d2", "d0"])
    assert_identical(kept[0], ups[2]) and assert_identical(kept[1], ups[0])
    assert all(not v.flags.writeable and v.dtype == np.float32 for u in kept for v in u.values())
    with pytest.raises(LocalProtocolError, match="already"):
        block.add("d1", ups[1])
    with pytest.raises(LocalProtocolError, match="holds 3"):
        block.add("d3", ups[1])


# --- the collector, rule by rule ---------------------------------------------------------------

RULES: list[dict[str, Any]] = [{"rule": "mean"}, {"rule": "norm_bounded_mean", "max_norm": 3.0},
                               {"rule": "median"}, {"rule": "trimmed_mean", "trim": 0.2},
                               {"rule": "krum", "byzantine": 1}, {"rule": "multi_krum", "byzantine": 1, "select": 3}]


def collect(spec: dict[str, Any], ups: list[dict[str, np.ndarray]], weights: list[float], order: Any
            ) -> tuple[dict[str, np.ndarray], strategies.Aggregator, strategies.Collector]:
    rule = strategies.build(strategies.AggregatorSpec(**spec))
    collector = strategies.Collector(rule, ups[0], rows=len(ups))
    for i in order:
        collector.add(f"d{i:02d}", ups[i], weights[i])
    return collector.combine([f"d{i:02d}" for i in range(len(ups))], weights), rule, collector


@pytest.mark.parametrize("spec", RULES, ids=[r["rule"] for r in RULES])
def test_each_rule_collected_in_sender_order_is_the_stored_rule_bit_for_bit(spec: dict[str, Any]) -> None:
    ups, weights = updates_and_weights(7, n=8)
    stored_rule = strategies.build(strategies.AggregatorSpec(**spec))
    want = strategies.run(stored_rule, ups, weights)

    got, rule, collector = collect(spec, ups, weights, range(8))

    assert_identical(got, want)
    assert collector.folds == (spec["rule"] in ("mean", "norm_bounded_mean"))
    if spec["rule"] == "norm_bounded_mean":
        assert rule.clipped == stored_rule.clipped > 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec", RULES, ids=[r["rule"] for r in RULES])
@pytest.mark.parametrize("seed", range(4))
def test_each_rule_collected_in_any_order_equals_the_stored_rule(spec: dict[str, Any], seed: int) -> None:
    ups, weights = updates_and_weights(100 + seed, n=8)
    want = strategies.run(strategies.build(strategies.AggregatorSpec(**spec)), ups, weights)

    got, _, collector = collect(spec, ups, weights, np.random.default_rng(seed).permutation(8))

    if collector.folds:
        assert_close_to_1e7(got, want)
    else:  # the rules that keep every update see them in sender order, whatever the arrival order
        assert_identical(got, want)


# --- inside the edge role ----------------------------------------------------------------------

MEMBERS = tuple(f"dev-{i:02d}" for i in range(12))
PARAMS = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


class StoredEdge(hier_qsgd.Edge):
    """The edge as it was: every upload kept whole until the step closes."""

    STREAMS = False


def cell_update(edge_cls: type, order: Any, config: HierConfig, seed: int = 11) -> tuple[CellUpdate, Any]:
    ups, _ = updates_and_weights(seed, n=len(MEMBERS))
    samples = np.random.default_rng(seed).integers(0, 50, size=len(MEMBERS))
    edge = edge_cls(cell="cell-a", rollout="r")
    task = CellTask(rollout="r", round=0, sender="cloud", params=PARAMS, members=MEMBERS, config=config.to_dict())
    edge.receive(messages.decode_message(task.encode()), 0.0)
    out: list = []
    for i in order:
        delta, encodings, _ = quantize(ups[i], config.bits_device, 0, "q1", MEMBERS[i])
        upd = DeviceUpdate(rollout="r", round=0, sender=MEMBERS[i], delta=delta, num_samples=int(samples[i]),
                           train_loss=float(i), steps=1)
        out = edge.receive(messages.decode_message(upd.encode(encodings)), 0.0)
    [sent] = [a for a in out if isinstance(a, SendToParent)]
    assert isinstance(sent.message, CellUpdate)
    back = messages.decode_message(sent.message.encode(sent.encodings))  # the bytes the cloud gets
    assert isinstance(back, CellUpdate)
    return back, edge


CONFIGS = {"float32 up": HierConfig(), "samples, 5-bit Q2 up": HierConfig(weighting="samples", bits_edge=5),
           "4-bit QSGD uploads, samples": HierConfig(weighting="samples", bits_device=4),
           "8-bit QSGD uploads": HierConfig(bits_device=8), "2-bit QSGD uploads, 3-bit Q2": HierConfig(bits_device=2,
                                                                                                  bits_edge=3),
           "median": HierConfig(strategy={"edge": {"rule": "median"}}),
           "norm bounded": HierConfig(strategy={"edge": {"rule": "norm_bounded_mean", "max_norm": 5.0}}),
           "norm bounded, 4-bit uploads, samples": HierConfig(bits_device=4, weighting="samples", strategy={
               "edge": {"rule": "norm_bounded_mean", "max_norm": 5.0}})}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_cell_update_is_bit_identical_to_the_stored_edges_in_sender_order(name: str) -> None:
    sender_order = range(len(MEMBERS))
    want, _ = cell_update(StoredEdge, sender_order, CONFIGS[name])
    got, edge = cell_update(hier_qsgd.Edge, sender_order, CONFIGS[name])

    assert_identical(dict(got.delta), dict(want.delta))
    assert (got.weight, got.reported, got.mean_loss, got.q) == (want.weight, want.reported, want.mean_loss, want.q)
    assert all(dict(u.delta) == {} for u in edge._updates.values())  # no upload is kept whole


@pytest.mark.parametrize("seed", range(5))
def test_in_a_shuffled_arrival_order_the_cell_update_stays_within_1e7(seed: int) -> None:
    order = np.random.default_rng(seed).permutation(len(MEMBERS))
    for config in (HierConfig(weighting="samples"), HierConfig(weighting="samples", bits_device=4)):
        want, _ = cell_update(StoredEdge, order, config)
        got, _ = cell_update(hier_qsgd.Edge, order, config)

        assert_close_to_1e7(dict(got.delta), dict(want.delta))
    median = HierConfig(strategy={"edge": {"rule": "median"}})
    assert_identical(dict(cell_update(hier_qsgd.Edge, order, median)[0].delta),
                     dict(cell_update(StoredEdge, range(len(MEMBERS)), median)[0].delta))


def test_a_rule_that_needs_every_update_keeps_them_in_one_float32_block() -> None:
    edge = hier_qsgd.Edge(cell="cell-a", rollout="r")
    config = HierConfig(strategy={"edge": {"rule": "trimmed_mean", "trim": 0.25}})
    task = CellTask(rollout="r", round=0, sender="cloud", params=PARAMS, members=MEMBERS, config=config.to_dict())
    edge.receive(task, 0.0)
    ups, _ = updates_and_weights(12, n=3)
    for i in range(3):
        edge.receive(DeviceUpdate(rollout="r", round=0, sender=MEMBERS[i], delta=ups[i], num_samples=1), 0.0)

    collector = edge._inputs
    assert collector is not None and not collector.folds
    block = collector._block._block  # type: ignore[union-attr]
    assert block.dtype == np.float32 and block.shape == (len(MEMBERS), sum(int(np.prod(s)) for s in SHAPES.values()))
    assert all(dict(u.delta) == {} for u in edge._updates.values())


def test_which_edges_stream() -> None:
    assert qhetfed.Edge.STREAMS and hier_qsgd.Edge.STREAMS  # fedavg and hist run hier_qsgd's edge
    from fedtier.algorithms import fedxl

    assert not fedxl.Edge.STREAMS  # it reads each upload's momentum and scores at the end


# --- QSGD uploads are folded from their codes ------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_qsgd_codes_are_folded_without_making_the_values_bit_for_bit(bits: int) -> None:
    ups, weights = updates_and_weights(21, n=5)
    payloads = []
    for i, u in enumerate(ups):
        delta, encodings, _ = quantize(u, bits, 0, "q1", f"d{i}")
        update = DeviceUpdate(rollout="r", round=0, sender=f"d{i}", delta=delta, num_samples=1)
        payloads.append(update.encode(encodings))
    decoded = [messages.decode_message(p) for p in payloads]
    folded, stored = aggregate.RunningMean(), []
    bounded = strategies.NormBoundedMean(2.0)

    for msg, w in zip(decoded, weights, strict=True):
        assert isinstance(msg, DeviceUpdate) and isinstance(msg.delta, wire.DecodedTensors)
        folded.fold(msg.delta, w, 0.5)
        assert msg.delta._arrays == {}  # nothing was made: the codes went into the sum  # type: ignore[attr-defined]
        stored.append(messages.decode_message(payloads[len(stored)]).delta)  # a fresh decoding, read as arrays

    want = aggregate.weighted_mean([({n: np.asarray(t, np.float64) * 0.5 for n, t in u.items()}, w)
                                    for u, w in zip(stored, weights, strict=True)])
    assert_identical(folded.mean(), want)
    assert_identical(strategies.run(bounded, stored, weights), collect(
        {"rule": "norm_bounded_mean", "max_norm": 2.0}, [dict(u) for u in stored], weights, range(5))[0])


def test_decoded_qsgd_tensors_read_like_arrays_and_pickle_as_a_dict() -> None:
    import pickle

    values = {"w": np.linspace(-1, 1, 9, dtype=np.float32).reshape(3, 3), "b": np.ones(2, np.float32)}
    delta, encodings, _ = quantize(values, 4, 0, "q1", "d")
    msg = messages.decode_message(DeviceUpdate(rollout="r", round=0, sender="d", delta=delta).encode(encodings))
    tensors = msg.delta  # type: ignore[attr-defined]

    assert isinstance(tensors, wire.DecodedTensors) and list(tensors) == list(delta) and len(tensors) == 2
    assert "w" in tensors and "x" not in tensors and tensors.get("x") is None
    assert tensors.shape_of("w") == (3, 3) and tensors._arrays == {}  # type: ignore[attr-defined]
    assert all(np.array_equal(tensors[n], delta[n]) and not tensors[n].flags.writeable for n in delta)
    again = pickle.loads(pickle.dumps(tensors))
    assert type(again) is dict and all(np.array_equal(again[n], delta[n]) for n in delta)

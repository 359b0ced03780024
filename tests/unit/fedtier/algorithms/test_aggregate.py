"""fedtier.algorithms.aggregate: weighted means and tensor arithmetic (pure functions)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedtier.algorithms import aggregate
from fedtier.algorithms.aggregate import add, global_norm, subtract, weighted_mean
from fedtier.errors import LocalProtocolError

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def t(**arrays: list) -> dict[str, np.ndarray]:
    return {k: np.array(v, dtype=np.float32) for k, v in arrays.items()}


# --- weighted_mean: hand-checkable values --------------------------------------------------------


def test_weighted_mean_by_hand() -> None:
    # Prepare: (1*[1, 2] + 3*[3, 6]) / 4 = [2.5, 5.0]; (1*[[0]] + 3*[[4]]) / 4 = [[3]]
    items = [(t(a=[1.0, 2.0], b=[[0.0]]), 1.0), (t(a=[3.0, 6.0], b=[[4.0]]), 3.0)]

    # Execute
    out = weighted_mean(items)

    # Assert
    assert set(out) == {"a", "b"}
    np.testing.assert_allclose(out["a"], [2.5, 5.0], rtol=0, atol=1e-7)
    np.testing.assert_allclose(out["b"], [[3.0]], rtol=0, atol=1e-7)
    assert out["b"].shape == (1, 1)


def test_a_zero_weight_contributes_nothing() -> None:
    out = weighted_mean([(t(a=[1.0]), 2.0), (t(a=[1000.0]), 0.0)])

    np.testing.assert_allclose(out["a"], [1.0], rtol=0, atol=0)


def test_single_item_is_itself() -> None:
    out = weighted_mean([(t(a=[1.5, -2.0]), 7.0)])

    np.testing.assert_array_equal(out["a"], [1.5, -2.0])


def test_result_is_float32_for_any_input_dtype() -> None:
    items = [({"a": np.array([1, 2], np.int64)}, 1), ({"a": np.array([2.0, 4.0], np.float64)}, 1),
             ({"a": np.array([3.0, 6.0], np.float16)}, 2)]

    out = weighted_mean(items)

    assert out["a"].dtype == np.float32
    np.testing.assert_allclose(out["a"], [2.25, 4.5], rtol=0, atol=1e-6)


def test_sums_in_float64_before_rounding() -> None:
    """1e8 + 1 - 1e8 loses the 1 in float32 but not in float64 (module docstring)."""
    items = [(t(a=[1e8]), 1.0), (t(a=[1.0]), 1.0), (t(a=[-1e8]), 1.0)]

    out = weighted_mean(items)

    np.testing.assert_allclose(out["a"], [1.0 / 3.0], rtol=1e-6, atol=0)


# --- weighted_mean: properties ----------------------------------------------------------------


_shapes = hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3)
_values = st.floats(-1e3, 1e3, width=32)


@st.composite
def contributions(draw: st.DrawFn, min_size: int = 1) -> list[tuple[dict[str, np.ndarray], float]]:
    shapes = draw(st.dictionaries(st.sampled_from(["w", "b", "c"]), _shapes, min_size=1, max_size=3))
    n = draw(st.integers(min_size, 5))
    items = []
    for _ in range(n):
        tensors = {k: draw(hnp.arrays(np.float32, s, elements=_values)) for k, s in shapes.items()}
        items.append((tensors, draw(st.floats(0.01, 100.0))))
    return items


@SETTINGS
@given(contributions())
def test_equal_weights_give_the_plain_mean(items: list[tuple[dict[str, np.ndarray], float]]) -> None:
    equal = [(tensors, 2.5) for tensors, _ in items]

    out = weighted_mean(equal)

    for name in items[0][0]:
        expected = np.mean([tensors[name].astype(np.float64) for tensors, _ in items], axis=0)
        np.testing.assert_allclose(out[name], expected, rtol=1e-6, atol=1e-4)


@SETTINGS
@given(contributions(), st.floats(1e-3, 1e3))
def test_invariant_to_scaling_all_weights(items: list[tuple[dict[str, np.ndarray], float]], scale: float) -> None:
    scaled = [(tensors, w * scale) for tensors, w in items]

    a, b = weighted_mean(items), weighted_mean(scaled)

    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-4)


@SETTINGS
@given(contributions())
def test_matches_a_slow_reference(items: list[tuple[dict[str, np.ndarray], float]]) -> None:
    out = weighted_mean(items)

    total = sum(w for _, w in items)
    for name in items[0][0]:
        ref = sum(w * tensors[name].astype(np.float64) for tensors, w in items) / total
        np.testing.assert_allclose(out[name], ref, rtol=1e-6, atol=1e-4)
        assert out[name].dtype == np.float32
        assert out[name].shape == items[0][0][name].shape


@SETTINGS
@given(contributions(min_size=2), st.randoms(use_true_random=False))
def test_order_changes_at_most_rounding(items: list[tuple[dict[str, np.ndarray], float]], rnd) -> None:  # noqa: ANN001
    """The sum runs in the order given: another order may differ in the last bits, which is
    why the roles sum contributions in sender order for bit-identical results (``test_fedavg.py``
    checks that the aggregate does not depend on the arrival order)."""
    shuffled = list(items)
    rnd.shuffle(shuffled)

    a, b = weighted_mean(items), weighted_mean(shuffled)

    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-4)


@SETTINGS
@given(contributions())
def test_inputs_are_not_mutated(items: list[tuple[dict[str, np.ndarray], float]]) -> None:
    before = copy.deepcopy(items)

    out = weighted_mean(items)
    for arr in out.values():
        arr += 1.0  # the result is a new array, not a view of an input

    for (tensors, w), (old, old_w) in zip(items, before, strict=True):
        assert w == old_w
        for name in tensors:
            np.testing.assert_array_equal(tensors[name], old[name])


def test_tensor_names_may_come_in_any_order() -> None:
    out = weighted_mean([(t(a=[1.0], b=[2.0]), 1.0), ({"b": np.array([4.0]), "a": np.array([3.0])}, 1.0)])

    np.testing.assert_allclose(out["a"], [2.0], rtol=0, atol=1e-7)
    np.testing.assert_allclose(out["b"], [3.0], rtol=0, atol=1e-7)


# --- weighted_mean: errors ----------------------------------------------------------------------


@pytest.mark.parametrize("weights", [[1.0, -1.0], [float("nan"), 1.0], [float("inf"), 1.0], [0.0, 0.0],
                                     [-0.0, 0.0], [2.0, -2.0]])
def test_invalid_weights(weights: list[float]) -> None:
    items = [(t(a=[1.0]), w) for w in weights]

    with pytest.raises(LocalProtocolError, match="weights"):
        weighted_mean(items)


def test_empty_input() -> None:
    with pytest.raises(LocalProtocolError):
        weighted_mean([])


@pytest.mark.parametrize("second", [t(b=[1.0]), t(a=[1.0], b=[1.0]), {}])
def test_mismatched_names(second: dict[str, np.ndarray]) -> None:
    with pytest.raises(LocalProtocolError, match="names"):
        weighted_mean([(t(a=[1.0]), 1.0), (second, 1.0)])


def test_missing_name_in_the_first_item_is_also_caught() -> None:
    with pytest.raises(LocalProtocolError):
        weighted_mean([(t(a=[1.0]), 1.0), (t(a=[1.0], b=[1.0]), 1.0)])


@pytest.mark.parametrize("second", [[1.0, 2.0], [[1.0]], 1.0])
def test_mismatched_shapes_are_not_broadcast(second: object) -> None:
    with pytest.raises(LocalProtocolError, match="shape"):
        weighted_mean([(t(a=[1.0]), 1.0), ({"a": np.array(second, np.float32)}, 1.0)])


# --- add / subtract / norms ---------------------------------------------------------------------


def test_add_and_subtract_by_hand() -> None:
    base, delta = t(w=[1.0, 2.0]), t(w=[0.5, -1.0])

    np.testing.assert_allclose(add(base, delta)["w"], [1.5, 1.0], rtol=0, atol=0)
    np.testing.assert_allclose(add(base, delta, scale=-2.0)["w"], [0.0, 4.0], rtol=0, atol=0)
    np.testing.assert_allclose(subtract(base, delta)["w"], [0.5, 3.0], rtol=0, atol=0)
    assert add(base, delta)["w"].dtype == np.float32
    assert subtract(base, delta)["w"].dtype == np.float32


@SETTINGS
@given(hnp.arrays(np.float32, _shapes, elements=_values), hnp.arrays(np.float32, _shapes, elements=_values))
def test_add_undoes_subtract(a: np.ndarray, b: np.ndarray) -> None:
    if a.shape != b.shape:
        b = np.resize(b, a.shape)
    before_a, before_b = a.copy(), b.copy()

    back = add({"x": b}, subtract({"x": a}, {"x": b}))

    np.testing.assert_allclose(back["x"], a, rtol=1e-6, atol=1e-4)
    np.testing.assert_array_equal(a, before_a)
    np.testing.assert_array_equal(b, before_b)


def test_add_and_subtract_refuse_different_names() -> None:
    with pytest.raises(LocalProtocolError):
        add(t(a=[1.0]), t(b=[1.0]))
    with pytest.raises(LocalProtocolError):
        subtract(t(a=[1.0]), t(a=[1.0], b=[1.0]))


def test_global_norm_by_hand() -> None:
    assert global_norm(t(a=[3.0, 4.0])) == pytest.approx(5.0, abs=1e-12)
    assert global_norm(t(a=[3.0], b=[[4.0]])) == pytest.approx(5.0, abs=1e-12)
    assert global_norm({}) == 0.0


def test_copy_tensors_is_independent_float32() -> None:
    src = {"a": np.array([1.0, 2.0], np.float64)}

    out = aggregate.copy_tensors(src)
    out["a"][0] = 9.0

    assert out["a"].dtype == np.float32
    assert src["a"][0] == 1.0

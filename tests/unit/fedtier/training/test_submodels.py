"""Hidden-neuron partitions: valid, reproducible, exactly invertible; the functional identity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedtier.errors import LocalProtocolError
from fedtier.rng import stream
from fedtier.training.layout import ArchSpec
from fedtier.training.submodels import draw, extract, fixed_sizes, forward, plan_for, reassemble

MLP = ArchSpec("mlp", {"sizes": [64, 300, 10]})


def params_of(sizes: list[int], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(len(sizes) - 1):
        out[f"fc{i}.weight"] = rng.normal(size=(sizes[i + 1], sizes[i])).astype(np.float32)
        out[f"fc{i}.bias"] = rng.normal(size=sizes[i + 1]).astype(np.float32)
    return out


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(hidden=st.integers(5, 400), cells=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_partitions_are_disjoint_covering_and_balanced(hidden: int, cells: int, seed: int) -> None:
    plan = plan_for(ArchSpec("mlp", {"sizes": [8, hidden, 3]}), cells)
    part = draw(plan, cells, stream(seed, "hist-partition", "r", 0))
    parts = part.parts[1]
    together = np.concatenate(parts)
    assert sorted(together.tolist()) == list(range(hidden))  # covering, and disjoint (no repeats)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(np.all(np.diff(p) > 0) for p in parts)  # each set sorted
    assert [part.sizes(j)[1] for j in range(cells)] == [s[1] for s in fixed_sizes(plan, cells)]


def test_redrawn_each_round_and_reproducible_from_the_seed() -> None:
    plan = plan_for(MLP, 3)
    r0 = draw(plan, 3, stream(7, "hist-partition", "r", 0)).parts[1]
    r0_again = draw(plan, 3, stream(7, "hist-partition", "r", 0)).parts[1]
    r1 = draw(plan, 3, stream(7, "hist-partition", "r", 1)).parts[1]
    assert all(np.array_equal(a, b) for a, b in zip(r0, r0_again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(r0, r1, strict=True))


def test_submodels_of_64_300_10_for_3_cells_carry_a_third_of_the_hidden_parameters() -> None:
    plan = plan_for(MLP, 3)
    params = params_of([64, 300, 10])
    part = draw(plan, 3, stream(0, "p"))
    counts = [sum(t.size for t in extract(part, j, params).values()) for j in range(3)]
    assert counts == [64 * 100 + 100 + 10 * 100 + 10] * 3  # 7,510 each
    full = sum(t.size for t in params.values())
    assert sum(counts) == full + 2 * 10  # about one full model; the shared output bias 3 times


@pytest.mark.parametrize("sizes,cells", [([64, 300, 10], 3), ([20, 9, 7, 4], 4), ([12, 10, 8, 6, 3], 2)])
def test_reassembling_unchanged_submodels_rebuilds_the_model_bit_for_bit(sizes: list[int], cells: int) -> None:
    plan = plan_for(ArchSpec("mlp", {"sizes": sizes}), cells)
    params = params_of(sizes)
    part = draw(plan, cells, stream(1, "p"))
    rebuilt = reassemble(part, params, {j: extract(part, j, params) for j in range(cells)})
    assert all(np.array_equal(rebuilt[n], params[n]) for n in params)


def test_a_cells_slices_are_copied_not_averaged() -> None:
    plan = plan_for(MLP, 2)
    params = params_of([64, 300, 10])
    part = draw(plan, 2, stream(2, "p"))
    subs = {j: {n: t + (j + 1) for n, t in extract(part, j, params).items()} for j in range(2)}
    rebuilt = reassemble(part, params, subs)
    for j in range(2):
        rows = part.parts[1][j]
        assert np.array_equal(rebuilt["fc0.weight"][rows], subs[j]["fc0.weight"])
        assert np.array_equal(rebuilt["fc1.weight"][:, rows], subs[j]["fc1.weight"])
        assert np.array_equal(rebuilt["fc0.bias"][rows], subs[j]["fc0.bias"])
    np.testing.assert_allclose(rebuilt["fc1.bias"], params["fc1.bias"] + 1.5, rtol=0, atol=1e-6)  # shared: mean


def test_full_model_is_the_sum_of_the_submodels_minus_the_extra_output_biases() -> None:
    # full(x) = sum_j sub_j(x) - (N - 1) b_out, for a one-hidden-layer ReLU net (digest §3.5).
    cells = 3
    plan = plan_for(MLP, cells)
    params = params_of([64, 300, 10])
    part = draw(plan, cells, stream(3, "p"))
    x = np.random.default_rng(4).normal(size=(16, 64))
    subs = sum(forward(extract(part, j, params), x, 2) for j in range(cells))
    np.testing.assert_allclose(forward(params, x, 2), subs - (cells - 1) * params["fc1.bias"], rtol=0, atol=1e-9)


def test_deeper_nets_partition_alternate_layers_only() -> None:
    plan = plan_for(ArchSpec("mlp", {"sizes": [10, 8, 6, 4, 2]}), 2)
    assert plan.partitioned == (1, 3)
    assert [plan.weight_split(i) for i in range(4)] == ["rows", "cols", "rows", "cols"]
    assert plan.shared_names() == ("fc1.bias", "fc3.bias")


@pytest.mark.parametrize("arch", [ArchSpec("mlp", {"sizes": [4, 2]}), ArchSpec("mlp", {"sizes": [4, 2, 3]}),
                                  ArchSpec("cnn1d", {"channels": 1, "length": 8, "classes": 2})])
def test_unpartitionable_models_are_refused(arch: ArchSpec) -> None:
    with pytest.raises(LocalProtocolError):
        plan_for(arch, 3)

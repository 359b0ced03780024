"""Federated splits: complete, disjoint, deterministic, and as non-iid as configured."""

from __future__ import annotations

import numpy as np
import pytest

from fedtier.rollout.config import DataConfig
from fleet_data.datasets import load_dataset, make_federated, partition, train_test_split

DEVICES = [f"dev-{i:02d}" for i in range(12)]


@pytest.mark.parametrize("scheme", ["iid", "shards", "dirichlet"])
def test_partition_is_disjoint_and_complete(scheme: str) -> None:
    y = np.repeat(np.arange(10), 50)
    parts = partition(y, DEVICES, DataConfig(partition=scheme, classes_per_device=2, alpha=0.3))
    together = np.concatenate(list(parts.values()))
    assert sorted(together.tolist()) == list(range(len(y)))
    assert all(len(p) > 0 for p in parts.values())


def test_iid_shares_differ_by_at_most_one() -> None:
    parts = partition(np.zeros(100, np.int64), DEVICES, DataConfig(partition="iid"))
    sizes = [len(p) for p in parts.values()]
    assert max(sizes) - min(sizes) <= 1


def test_shards_give_each_device_few_classes() -> None:
    y = np.repeat(np.arange(10), 60)
    parts = partition(y, DEVICES, DataConfig(partition="shards", classes_per_device=2))
    # A shard can straddle a class boundary, so at most classes_per_device + 1 per shard... x2 shards.
    assert all(len(np.unique(y[p])) <= 4 for p in parts.values())
    assert np.mean([len(np.unique(y[p])) for p in parts.values()]) <= 3


def test_smaller_alpha_is_more_skewed() -> None:
    y = np.repeat(np.arange(10), 100)

    def skew(alpha: float) -> float:
        parts = partition(y, DEVICES, DataConfig(partition="dirichlet", alpha=alpha, seed=1))
        return float(np.mean([np.bincount(y[p], minlength=10).max() / len(p) for p in parts.values()]))

    assert skew(0.1) > skew(1.0) > skew(100.0)


def test_split_is_stratified_and_deterministic() -> None:
    x, y = load_dataset(DataConfig(dataset="digits"))
    (xtr, ytr), (xte, yte) = train_test_split(x, y, 0.2, seed=5)
    assert len(ytr) + len(yte) == len(y) == 1797
    for c in range(10):
        assert abs(np.mean(yte == c) - np.mean(y == c)) < 0.01
    (_, ytr2), _ = train_test_split(x, y, 0.2, seed=5)
    assert np.array_equal(ytr, ytr2)


def test_federated_digits_shapes() -> None:
    data = make_federated(DataConfig(dataset="digits", partition="dirichlet"), DEVICES)
    assert data.num_features == 64 and data.num_classes == 10
    assert sum(len(y) for _, y in data.train.values()) + len(data.test[1]) == 1797
    assert all(x.dtype == np.float32 and y.dtype == np.int64 for x, y in data.train.values())
    assert 0.0 <= min(float(x.min()) for x, _ in data.train.values()) and max(
        float(x.max()) for x, _ in data.train.values()) <= 1.0


def test_synthetic_mixture_is_learnable_and_sized() -> None:
    x, y = load_dataset(DataConfig(dataset="synthetic", samples=300, features=7, classes=3, separation=6.0))
    assert x.shape == (300, 7) and set(np.unique(y)) == {0, 1, 2}
    # Nearest class mean classifies well when classes are separated.
    means = np.stack([x[y == c].mean(axis=0) for c in range(3)])
    pred = np.argmin(((x[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert np.mean(pred == y) > 0.9


def test_cell_shards_are_iid_across_cells_and_sharded_within() -> None:
    # 3 cells x 10 devices, 2 shards each: 20 shards of 50 in a cell holding ~100 per class.
    devices = [f"dev-{i:02d}" for i in range(30)]
    cells = {f"cell-{c}": devices[c * 10:(c + 1) * 10] for c in range(3)}
    y = np.repeat(np.arange(10), 300)
    parts = partition(y, devices, DataConfig(partition="cell_shards", classes_per_device=2), cells)
    assert sorted(np.concatenate(list(parts.values())).tolist()) == list(range(len(y)))
    for members in cells.values():
        cell_labels = np.concatenate([y[parts[d]] for d in members])
        assert len(np.unique(cell_labels)) >= 8  # a random third of the data: nearly every class
        assert np.mean([len(np.unique(y[parts[d]])) for d in members]) <= 3  # devices: few classes
    with pytest.raises(ValueError, match="topology"):
        partition(y, devices, DataConfig(partition="cell_shards"))


def test_synthetic_mixture_modes_and_standardization() -> None:
    cfg = DataConfig(dataset="synthetic", samples=3000, features=16, classes=4, modes=3, noise=3.0, mean_std=1.2,
                     standardize=True, partition="iid")
    data = make_federated(cfg, DEVICES)
    x = np.concatenate([x for x, _ in data.train.values()])
    np.testing.assert_allclose(x.mean(axis=0), 0, atol=1e-5)
    np.testing.assert_allclose(x.std(axis=0), 1, atol=1e-3)

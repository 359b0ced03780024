"""The digest's synthetic hybrid fixture and a plain-numpy Algorithm 1 (seed 000 §2, §8).

``reference`` is Algorithm 1 written as the paper's loop over iterations ``t`` on arrays, with no
roles and no messages: what ``fedtier.algorithms.hsgd``'s roles (run by ``hsgd_loop``) must equal.
``centralized`` is full-model SGD of the split model on ``sum_m (K_m/K) mean_{n in xi_m} f`` (A4).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from fedtier.algorithms.hsgd import select
from fedtier.rng import stream
from fedtier.training import split

Group = tuple[np.ndarray, np.ndarray, np.ndarray]


def fixture(seed: int = 0, sizes: Sequence[int] = (60, 90, 150), x1: int = 12, x2: int = 8, classes: int = 3,
            skew: float = 0.8, test: int = 300, spread: float = 1.0) -> tuple[list[Group], Group]:
    """Digest §8: ``M = len(sizes)`` groups of one-sample devices, ``X1`` of ``x1`` and ``X2`` of ``x2``
    features, ``classes`` Gaussian classes; a share ``skew`` of group ``m``'s samples has one of its two
    labels ``m, m+1`` (mod classes), the rest any label. Returns (groups, iid test set)."""
    rng = stream(seed, "hsgd-fixture")
    means = rng.normal(0.0, spread, size=(classes, x1 + x2))

    def draw(labels: np.ndarray) -> Group:
        x = means[labels] + rng.normal(0.0, 1.0, size=(len(labels), x1 + x2))
        return x[:, :x1].astype(np.float32), x[:, x1:].astype(np.float32), labels.astype(np.int64)

    groups = []
    for m, k in enumerate(sizes):
        main = np.array([m % classes, (m + 1) % classes])
        labels = np.where(rng.random(k) < skew, main[rng.integers(0, 2, k)], rng.integers(0, classes, k))
        groups.append(draw(labels))
    return groups, draw(rng.integers(0, classes, test))


def reference(groups: Sequence[Group], params: Mapping[str, np.ndarray], *, P: int, Q: int, alpha: float, lr: float,
              rounds: int, seed: int = 0, rollout: str = "hsgd", cells: Sequence[str] | None = None,
              devices: Sequence[Sequence[str]] | None = None) -> dict[str, np.ndarray]:
    """Algorithm 1 for ``T = rounds * P`` iterations; the selection stream is the roles' (``select``)."""
    if P % Q:
        raise ValueError("P mod Q must be 0")
    cells = list(cells or [f"cell{m}" for m in range(len(groups))])
    devices = [list(d) for d in devices] if devices is not None else [
        [f"{c}-d{n:04d}" for n in range(len(g[2]))] for c, g in zip(cells, groups, strict=True)]
    sizes = np.array([len(g[2]) for g in groups], np.float64)
    glob = {k: np.asarray(v, np.float64) for k, v in params.items()}
    for r in range(rounds):
        local = []
        for m, (x1, x2, y) in enumerate(groups):
            hosts = {k: v.copy() for k, v in glob.items() if not k.startswith("theta2/")}  # lines 5-9
            theta2_m = split.block(glob, "theta2")
            for lam in range(P // Q):
                chosen = select(tuple(devices[m]), alpha, seed, rollout, cells[m], r, lam)  # line 16
                idx = np.array([devices[m].index(d) for d in chosen])
                z2 = split.embed(theta2_m, "theta2", x2[idx])  # line 20, with the aggregated theta2_m
                z1 = split.embed(hosts, "theta1", x1[idx])  # line 22
                theta0 = split.block(hosts, "theta0")
                dev = [{k: v.astype(np.float64) for k, v in theta2_m.items()} for _ in idx]  # line 18
                for _ in range(Q):  # lines 29-33: Q steps on the stale partner values, same mini-batch
                    _, g = split.host_grad(hosts, x1[idx], z2, y[idx])
                    hosts = {k: hosts[k] - lr * g[k] for k in hosts}
                    for i, n in enumerate(idx):
                        _, gd = split.device_grad(dev[i], theta0, z1[i:i + 1], x2[n:n + 1], y[n:n + 1])
                        dev[i] = {k: dev[i][k] - lr * gd[k] for k in dev[i]}
                theta2_m = {k: np.mean([d[k] for d in dev], axis=0) for k in dev[0]}  # eq. (1)
            local.append({**hosts, **theta2_m})
        glob = {k: sum(sizes[m] * local[m][k] for m in range(len(groups))) / sizes.sum() for k in glob}  # eq. (2)
    return {k: v.astype(np.float32) for k, v in glob.items()}


def centralized(groups: Sequence[Group], params: Mapping[str, np.ndarray], *, lr: float,
                steps: int) -> dict[str, np.ndarray]:
    """Full-batch SGD of the whole split model on ``sum_m (K_m / K) mean_n f`` (every sample weighs 1/K)."""
    x1 = np.concatenate([g[0] for g in groups])
    x2 = np.concatenate([g[1] for g in groups])
    y = np.concatenate([g[2] for g in groups])
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    for _ in range(steps):
        _, g = split.full_loss_grad(p, x1, x2, y)
        p = {k: p[k] - lr * g[k] for k in p}
    return {k: v.astype(np.float32) for k, v in p.items()}


def loss_and_accuracy(params: Mapping[str, np.ndarray], data: Group) -> tuple[float, float]:
    x1, x2, y = data
    prob = split.probabilities(params, x1, x2)
    loss = float(-np.log(np.maximum(prob[np.arange(len(y)), y], 1e-300)).mean())
    return loss, float((prob.argmax(1) == y).mean())


HOST_COLUMNS = tuple(range(0, 20))
"""breast_cancer's "mean" and "se" blocks: the host's features."""
DEVICE_COLUMNS = tuple(range(20, 30))
"""breast_cancer's "worst" block: each device's features of its one sample."""


def breast_cancer(seed: int, *, groups: int = 4, skew: float = 0.8, test_fraction: float = 0.25,
                  limit: int | None = None) -> tuple[list[Group], Group]:
    """scikit-learn's breast_cancer split vertically (host: features 0-19, devices: 20-29) and horizontally
    into ``groups`` with a label skew (a share ``skew`` of group ``m``'s samples has its favoured label:
    0 in odd groups, 1 in even ones); standardized on the training rows; an iid test set. ``limit`` keeps
    that many training samples (the first of a seeded permutation) for small fleets."""
    from sklearn.datasets import load_breast_cancer

    d = load_breast_cancer()
    x, y = d.data, d.target
    rng = stream(seed, "hsgd-breast-cancer")
    perm = rng.permutation(len(y))
    n_test = int(test_fraction * len(y))
    test, train = perm[:n_test], perm[n_test:]
    if limit is not None:
        train = train[:limit]
    x = (x - x[train].mean(0)) / x[train].std(0)
    members: list[list[int]] = [[] for _ in range(groups)]
    for i in train:
        favoured = [m for m in range(groups) if m % 2 == 1 - y[i]]
        pool = favoured if rng.random() < skew else [m for m in range(groups) if m not in favoured] or favoured
        members[pool[int(rng.integers(len(pool)))]].append(int(i))

    def part(idx: np.ndarray) -> Group:
        return (x[idx][:, list(HOST_COLUMNS)].astype(np.float32), x[idx][:, list(DEVICE_COLUMNS)].astype(np.float32),
                y[idx])

    return [part(np.array(m)) for m in members], part(test)

"""Pure aggregation maths shared by every algorithm (Flower's ``aggregate.py`` in spirit).

Functions take ``(tensors, weight)`` pairs, never mutate their inputs, and are
deterministic: contributions are summed in float64 in the order given, so callers that
sort by sender get bit-identical results however messages happened to arrive.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from fedtier.errors import LocalProtocolError
from fedtier.wire.messages import EvalStats

Tensors = Mapping[str, np.ndarray]


def weighted_mean(items: Sequence[tuple[Tensors, float]]) -> dict[str, np.ndarray]:
    """``sum_i w_i x_i / sum_i w_i`` per tensor name, as float32.

    Args:
        items: ``(tensors, weight)`` pairs; every ``tensors`` has the same names and shapes;
            weights are finite and non-negative with a positive sum.

    Returns:
        A new dict of float32 arrays.

    Raises:
        LocalProtocolError: no items, mismatched names/shapes, or invalid weights.
    """
    if not items:
        raise LocalProtocolError("weighted_mean of nothing")
    weights = np.array([float(w) for _, w in items], dtype=np.float64)
    if not np.isfinite(weights).all() or (weights < 0).any() or weights.sum() <= 0:
        raise LocalProtocolError(f"invalid weights {weights.tolist()}")
    names = list(items[0][0])
    for tensors, _ in items:
        if list(tensors) != names and set(tensors) != set(names):
            raise LocalProtocolError("tensor names differ between contributions")
    total = weights.sum()
    out: dict[str, np.ndarray] = {}
    for name in names:
        acc = np.zeros(np.shape(items[0][0][name]), dtype=np.float64)
        scaled = np.empty_like(acc)  # one reused buffer: no temporary arrays per contribution
        for (tensors, _), w in zip(items, weights, strict=True):
            arr = tensors[name]
            if np.shape(arr) != acc.shape:
                raise LocalProtocolError(f"{name}: shape {np.shape(arr)} != {acc.shape}")
            if w == 1.0:
                np.add(acc, arr, out=acc)  # cast to float64 chunk by chunk inside the ufunc
            else:
                np.multiply(arr, w, out=scaled)  # the same float64 product as w * float64(arr)
                np.add(acc, scaled, out=acc)
        out[name] = (acc / total).astype(np.float32)
    return out


def add(base: Tensors, delta: Tensors, scale: float = 1.0) -> dict[str, np.ndarray]:
    """``base + scale * delta`` per name (float32); both must have the same names."""
    if set(base) != set(delta):
        raise LocalProtocolError("add: tensor names differ")
    return {n: (base[n].astype(np.float32) + np.float32(scale) * delta[n].astype(np.float32))
            for n in base}


def subtract(a: Tensors, b: Tensors) -> dict[str, np.ndarray]:
    """``a - b`` per name (float32)."""
    if set(a) != set(b):
        raise LocalProtocolError("subtract: tensor names differ")
    return {n: (a[n].astype(np.float32) - b[n].astype(np.float32)) for n in a}


def global_norm(tensors: Tensors) -> float:
    """The L2 norm of all tensors taken as one vector."""
    return float(np.sqrt(sum(float(np.sum(np.square(t, dtype=np.float64))) for t in tensors.values())))


def copy_tensors(tensors: Tensors) -> dict[str, np.ndarray]:
    return {n: np.array(t, dtype=np.float32, copy=True) for n, t in tensors.items()}



def combine_evaluations(items: Sequence[EvalStats | None]) -> EvalStats | None:
    """Federated evaluations of one model, combined as Flower's ``weighted_loss_avg`` does.

    The loss is the mean of the parts' losses weighted by their held-out row counts (in
    float64, in the order given); counts, correct predictions and devices add up. Missing
    parts (``None``: a device without held-out rows) are skipped; the accuracy is kept only
    if every part has one; a device's AUROC is not (it is no mean of per-row values: each device's
    own travels beside the combination, ``CellUpdate.device_evaluations``).

    Returns:
        The combined evaluation, or ``None`` when no part has one.
    """
    parts = [e for e in items if e is not None]
    if not parts:
        return None
    count = sum(e.count for e in parts)
    loss = float(sum(np.float64(e.loss) * e.count for e in parts) / count)
    correct = None if any(e.correct is None for e in parts) else float(sum(float(e.correct or 0) for e in parts))
    return EvalStats(loss=loss, count=count, correct=correct, devices=sum(e.devices for e in parts))

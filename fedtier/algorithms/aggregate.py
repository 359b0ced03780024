"""Pure aggregation maths shared by every algorithm (Flower's ``aggregate.py`` in spirit).

Functions take ``(tensors, weight)`` pairs, never mutate their inputs, and are
deterministic: contributions are summed in float64 in the order given, so callers that
sort by sender get bit-identical results however messages happened to arrive.

Accumulators, for a node that combines updates as they arrive instead of keeping them:
``WeightedSum`` / ``RunningMean`` fold each update into a float64 running sum with the operations
``weighted_mean`` applies to it (so folding in an order is bit for bit ``weighted_mean`` in that
order; another order changes the float64 sum by rounding alone, about 1e-16 of it per update), and
``UpdateBlock`` keeps updates for rules that need every one as float32 rows of one preallocated block.
"""

from __future__ import annotations

import math
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


class WeightedSum:
    """``sum_i w_i s_i x_i`` over updates folded one at a time, in float64; no update is kept.

    One fold is what ``weighted_mean`` does with one contribution (``s_i``, a scale, is what
    ``strategies.NormBoundedMean`` multiplies an update by first): the same float64 operations on the
    same values, in place, through one reused buffer.
    """

    def __init__(self) -> None:
        self._acc: dict[str, np.ndarray] = {}
        self._scratch = np.empty(0, dtype=np.float64)
        self.weights: list[float] = []
        """The weights folded, in order."""

    def fold(self, tensors: Tensors, weight: float = 1.0, scale: float = 1.0) -> None:
        """Add ``weight * scale * tensors`` (``scale`` and ``weight`` applied one after the other).

        Raises:
            LocalProtocolError: an invalid weight, or other names or shapes than the first update's.
        """
        w = np.float64(weight)  # a float64 scalar, as weighted_mean's: numpy then multiplies in float64
        if not math.isfinite(w) or w < 0:
            raise LocalProtocolError(f"invalid weight {weight!r}")
        shape_of = getattr(tensors, "shape_of", None)  # wire.DecodedTensors: shapes without making values
        deferred = getattr(tensors, "deferred", None)
        shapes = ({n: tuple(shape_of(n)) for n in tensors} if shape_of is not None
                  else {n: np.shape(t) for n, t in tensors.items()})
        if not self._acc:
            self._acc = {n: np.zeros(shape, dtype=np.float64) for n, shape in shapes.items()}
            self._scratch = np.empty(max((a.size for a in self._acc.values()), default=0), dtype=np.float64)
        elif set(shapes) != set(self._acc):
            raise LocalProtocolError("tensor names differ between contributions")
        for name, acc in self._acc.items():
            if tuple(shapes[name]) != acc.shape:
                raise LocalProtocolError(f"{name}: shape {shapes[name]} != {acc.shape}")
        for name, acc in self._acc.items():
            codes = deferred(name) if deferred is not None else None
            if codes is not None:  # QSGD codes as received: added through a table, the values never made
                codes.add_to(acc, tuple(f for f in (scale, w) if f != 1.0))
                continue
            arr = tensors[name]
            scaled = self._scratch[:acc.size].reshape(acc.shape)
            if scale != 1.0:
                np.multiply(arr, np.float64(scale), out=scaled)  # float64(x) * s, as NormBoundedMean's
                arr = scaled
            if w == 1.0:
                np.add(acc, arr, out=acc)  # float32 input cast to float64 chunk by chunk inside the ufunc
            else:
                np.multiply(arr, w, out=scaled)
                np.add(acc, scaled, out=acc)
        self.weights.append(float(w))

    @property
    def count(self) -> int:
        return len(self.weights)

    def total(self) -> np.float64:
        """The sum of the weights, as ``weighted_mean`` takes it (numpy's sum, in fold order)."""
        return np.array(self.weights, dtype=np.float64).sum()

    def sums(self) -> dict[str, np.ndarray]:
        """The float64 running sums (the accumulator's own arrays: read, do not keep)."""
        return self._acc

    def mean(self) -> dict[str, np.ndarray]:
        """``sum / total`` per tensor as float32, as ``weighted_mean`` returns it."""
        if not self._acc:
            raise LocalProtocolError("weighted_mean of nothing")
        total = self.total()
        if total <= 0:
            raise LocalProtocolError(f"invalid weights {self.weights}")
        out = {}
        for name, acc in self._acc.items():
            quotient = self._scratch[:acc.size].reshape(acc.shape)  # no float64 temporary the model's size
            np.divide(acc, total, out=quotient)
            out[name] = quotient.astype(np.float32)
        return out


class RunningMean:
    """The weighted mean of updates folded one at a time; the plain mean if every weight is zero
    (``common.device_weights``' fallback for sample counts that are all zero).

    While no positive weight has arrived, updates are also folded with weight 1 into a second sum;
    the first positive weight drops it. A zero weight adds exactly nothing to the weighted sum (its
    products are zeros), so it is not folded there.
    """

    def __init__(self) -> None:
        self._weighted = WeightedSum()
        self._uniform: WeightedSum | None = WeightedSum()
        self._zeros = 0

    def fold(self, tensors: Tensors, weight: float, scale: float = 1.0) -> None:
        if weight != 0:
            self._weighted.fold(tensors, weight, scale)
            self._uniform = None
        else:
            self._zeros += 1
            if self._uniform is not None:
                self._uniform.fold(tensors, 1.0, scale)

    @property
    def count(self) -> int:
        return self._weighted.count + self._zeros

    def sums(self) -> dict[str, np.ndarray]:
        """The float64 sums: of the weighted updates, or of all of them if every weight was zero."""
        return self._weighted.sums() if self._uniform is None else self._uniform.sums()

    def mean(self) -> dict[str, np.ndarray]:
        return self._weighted.mean() if self._uniform is None else self._uniform.mean()


class UpdateBlock:
    """Updates kept whole, for a rule that needs every one: float32 rows of one block allocated at the first
    update (``rows`` of them; pages of rows never written are never touched), read back as read-only views."""

    def __init__(self, like: Tensors, rows: int) -> None:
        self._layout: list[tuple[str, tuple[int, ...], int, int]] = []
        offset = 0
        for name, t in like.items():
            size = int(np.prod(np.shape(t), dtype=np.int64))
            self._layout.append((name, tuple(np.shape(t)), offset, offset + size))
            offset += size
        self._width = offset
        self._capacity = rows
        self._block: np.ndarray | None = None
        self._rows: dict[str, int] = {}

    def add(self, key: str, tensors: Tensors) -> None:
        """Copy ``tensors`` (the layout's names and shapes) into the next row, under ``key``."""
        if key in self._rows:
            raise LocalProtocolError(f"update {key!r} is already kept")
        if len(self._rows) >= self._capacity:
            raise LocalProtocolError(f"the block holds {self._capacity} updates")
        if self._block is None:
            self._block = np.empty((self._capacity, self._width), dtype=np.float32)
        row = self._block[len(self._rows)]
        for name, shape, start, end in self._layout:
            if np.shape(tensors[name]) != shape:
                raise LocalProtocolError(f"{name}: shape {np.shape(tensors[name])} != {shape}")
            row[start:end] = np.asarray(tensors[name]).reshape(-1)
        self._rows[key] = len(self._rows)

    def updates(self, keys: Sequence[str]) -> list[dict[str, np.ndarray]]:
        """The updates kept under ``keys``, in that order, as read-only float32 views of the block."""
        out = []
        for key in keys:
            assert self._block is not None
            row = self._block[self._rows[key]]
            update = {}
            for name, shape, start, end in self._layout:
                view = row[start:end].reshape(shape)
                view.flags.writeable = False
                update[name] = view
            out.append(update)
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

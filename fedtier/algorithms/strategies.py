"""Aggregation rules by name: how an edge combines its devices' updates, and the cloud its cells'.

Every hierarchical algorithm that sends model changes (fedavg, hier_qsgd, qhetfed's model
phase, hist on each submodel) ends a step the same way: a tier holds one update per child
(tensors keyed by name, all of one layout) and a weight per child, and reduces them to one
update. Today's rule is the weighted mean; this module names the others, so that one broken or
compromised board (a stuck sensor, a flipped sign, a replayed model) cannot drag a cell
anywhere. It is pure: no I/O, no clock, no randomness, inputs never mutated.

Rules (``rule`` in a tier's spec), over updates ``x_1..x_n`` (each flattened to one vector
across its tensors, in the tier's sender order) with weights ``a_i``:

* ``mean`` — ``sum_i a_i x_i / sum_i a_i``: exactly ``aggregate.weighted_mean`` (the default;
  bit for bit what every tier computed before rules existed). Needs only the sum.
* ``median`` — coordinate-wise weighted median: per coordinate, the smallest value whose
  cumulative weight (values sorted) reaches half the total; when it reaches exactly half, the
  midpoint of that value and the next. With equal weights this is ``numpy.median``.
* ``trimmed_mean`` — per coordinate, drop the ``k = floor(trim * n)`` smallest and ``k``
  largest values, and take the weighted mean of the rest (each kept value with its own
  update's weight). Trimming counts updates, not weight: a heavy update is trimmed like any.
* ``krum`` / ``multi_krum`` — Blanchard et al., "Machine Learning with Adversaries: Byzantine
  Tolerant Gradient Descent" (NeurIPS 2017). With ``f = byzantine``, each update's score is
  the sum of its squared distances to its ``n - f - 2`` nearest other updates; ``krum`` returns
  the update with the lowest score (ties: the first in sender order), ``multi_krum`` the
  weighted mean of the ``m = select`` lowest-scored. The guarantee needs ``n > 2f + 2``;
  a step that closes with fewer updates (a quorum) uses ``max(1, n - f - 2)`` neighbours and
  ``min(m, n)`` updates. Weights do not enter the scores (the paper's rule has none).
* ``norm_bounded_mean`` — each update scaled to L2 norm at most ``max_norm`` (all its
  tensors as one vector), then the weighted mean.

Your own rule: ``rule = "package.module:Class"`` imports ``Class`` on the node that
aggregates (never on devices) and constructs it with ``options`` as keyword arguments; it
implements ``Aggregator`` (docs/strategies.md has an example). Importing a module named in a
task runs its code: use rules only from packages installed on your edges on purpose.

Visibility: every rule but ``mean`` reads the individual updates. A tier that sees only their
sum (an edge behind secure aggregation) cannot run them; ``check_visibility`` refuses such a
configuration with a message, for any caller that knows what a tier sees.

Collecting: a node that receives updates one by one gathers them in a ``Collector``. For ``mean``
and ``norm_bounded_mean``, weighted means of (scaled) updates, it folds each into a float64 running
sum as it arrives and keeps no copy (``aggregate.RunningMean``); for every other rule it keeps them,
float32, in one block with a row per child (``aggregate.UpdateBlock``), and runs the rule at the end.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from fedtier.algorithms import aggregate
from fedtier.errors import LocalProtocolError

Tensors = Mapping[str, np.ndarray]

RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "norm_bounded_mean")
"""The built-in rules; anything else must be a ``package.module:Class`` spec."""

TIERS = ("edge", "cloud")
SPEC_KEYS = ("rule", "trim", "byzantine", "select", "max_norm", "options")


class StrategyError(LocalProtocolError):
    """A strategy spec is invalid, or cannot run where it is configured (the message says why)."""


@runtime_checkable
class Aggregator(Protocol):
    """What a tier calls to combine its children's updates.

    Attributes:
        individual: the rule reads individual updates (True for every rule but a plain mean);
            a tier that sees only sums refuses it (``check_visibility``). Assumed True if absent.

    Optional methods, for a rule that keeps state across rounds (only the cloud's state is
    persisted — in the coordinator's store, restored after a restart):
        ``state() -> dict[str, numpy.ndarray]`` and ``load_state(state) -> None``.
    """

    def aggregate(self, updates: Sequence[Tensors], weights: Sequence[float]) -> dict[str, np.ndarray]:
        """Combine ``updates`` (same tensor names and shapes; in sender order) with ``weights``
        (finite, >= 0, positive sum) into one update of the same layout, float32. Must not
        mutate its inputs; should be deterministic."""
        ...


# --- specs --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AggregatorSpec:
    """One tier's rule and its parameters (what a task carries, as ``to_dict``)."""

    rule: str = "mean"
    trim: float = 0.1
    byzantine: int = 1
    select: int = 1
    max_norm: float = 1.0
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.rule, str) or not (self.rule in RULES or is_custom(self.rule)):
            raise StrategyError(f"unknown aggregation rule {self.rule!r}: one of {', '.join(RULES)}, or "
                                "'package.module:Class'")
        if not (isinstance(self.trim, (int, float)) and 0 <= self.trim < 0.5):
            raise StrategyError(f"trim must be in [0, 0.5), got {self.trim!r}")
        for name, low in (("byzantine", 0), ("select", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise StrategyError(f"{name} must be an int >= {low}, got {value!r}")
        if not (isinstance(self.max_norm, (int, float)) and math.isfinite(self.max_norm) and self.max_norm > 0):
            raise StrategyError(f"max_norm must be finite and > 0, got {self.max_norm!r}")
        if not isinstance(self.options, Mapping):
            raise StrategyError(f"options must be a table, got {self.options!r}")
        if self.options and not is_custom(self.rule):
            raise StrategyError(f"options are for your own rule ('package.module:Class'); {self.rule} takes "
                                "trim, byzantine, select or max_norm")

    @property
    def individual(self) -> bool:
        """Whether the rule reads individual updates (custom rules are assumed to)."""
        return self.rule != "mean"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule, "trim": float(self.trim), "byzantine": self.byzantine,
                               "select": self.select, "max_norm": float(self.max_norm)}
        if self.options:
            out["options"] = dict(self.options)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AggregatorSpec":
        if not isinstance(data, Mapping):
            raise StrategyError(f"an aggregator spec is a table, got {data!r}")
        unknown = set(data) - set(SPEC_KEYS)
        if unknown:
            raise StrategyError(f"unknown aggregator keys {sorted(unknown)}; known: {', '.join(SPEC_KEYS)}")
        return cls(**dict(data))

    def check_fits(self, n: int, tier: str) -> None:
        """Refuse parameters that cannot work with ``n`` children (Krum's ``n > 2f + 2``)."""
        have = f"the smallest cell has n = {n} devices" if tier == "edge" else f"the cloud has n = {n} cells"
        if self.rule in ("krum", "multi_krum") and n <= 2 * self.byzantine + 2:
            raise StrategyError(f"{self.rule} at the {tier} tolerates byzantine = f faulty of n children only when "
                                f"n > 2f + 2; {have} and f = {self.byzantine}")
        if self.rule == "multi_krum" and self.select > n:
            raise StrategyError(f"multi_krum at the {tier} averages select = {self.select} updates, but {have}")


def is_custom(rule: str) -> bool:
    """``package.module:Class`` (your own rule)."""
    target, sep, name = rule.rpartition(":")
    return bool(sep and target and name.isidentifier()
                and all(part.isidentifier() for part in target.split(".")))


def parse_strategy(strategy: Mapping[str, Any] | None) -> dict[str, AggregatorSpec]:
    """The per-tier specs of a task's ``strategy`` map (missing tiers: ``mean``).

    ``strategy`` may carry other keys (``server_optimizer``); only ``edge`` and ``cloud`` are
    read here. Raises ``StrategyError`` naming the bad part.
    """
    out = {tier: AggregatorSpec() for tier in TIERS}
    if strategy is None:
        return out
    if not isinstance(strategy, Mapping):
        raise StrategyError(f"strategy must be a table, got {strategy!r}")
    for tier in TIERS:
        if tier in strategy:
            try:
                out[tier] = AggregatorSpec.from_dict(strategy[tier])
            except (StrategyError, TypeError) as exc:
                raise StrategyError(f"{tier} aggregator: {exc}") from None
    return out


def check_visibility(spec: AggregatorSpec | Aggregator, tier: str, *, individual: bool) -> None:
    """Refuse a rule that needs individual updates at a tier that sees only their sum.

    Args:
        spec: the tier's spec, or a built aggregator (its ``individual`` attribute; True if absent).
        tier: "edge" or "cloud", for the message.
        individual: whether the tier sees its children's updates one by one (False behind
            secure aggregation, where it receives only their sum).

    Raises:
        StrategyError: the rule needs what the tier cannot see.
    """
    needs = spec.individual if isinstance(spec, AggregatorSpec) else bool(getattr(spec, "individual", True))
    if needs and not individual:
        name = spec.rule if isinstance(spec, AggregatorSpec) else type(spec).__name__
        raise StrategyError(f"the {tier} aggregator {name!r} reads each child's update, but the {tier} sees only "
                            "their sum (secure aggregation); use 'mean' there")


# --- built-in rules -----------------------------------------------------------------------------


def _check(updates: Sequence[Tensors], weights: Sequence[float]) -> np.ndarray:
    if not updates:
        raise LocalProtocolError("aggregate of nothing")
    if len(updates) != len(weights):
        raise LocalProtocolError(f"{len(updates)} updates but {len(weights)} weights")
    w = np.array([float(x) for x in weights], dtype=np.float64)
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise LocalProtocolError(f"invalid weights {w.tolist()}")
    names = set(updates[0])
    for u in updates:
        if set(u) != names:
            raise LocalProtocolError("tensor names differ between updates")
        for n in names:
            if np.shape(u[n]) != np.shape(updates[0][n]):
                raise LocalProtocolError(f"{n}: shapes differ between updates")
    return w


def _stack(updates: Sequence[Tensors], name: str) -> np.ndarray:
    """``(n, *shape)`` float64 stack of one tensor across updates."""
    return np.stack([np.asarray(u[name], dtype=np.float64) for u in updates])


def _flat(update: Tensors, names: Sequence[str]) -> np.ndarray:
    return np.concatenate([np.asarray(update[n], dtype=np.float64).ravel() for n in names])


class Mean:
    """``sum_i a_i x_i / sum_i a_i`` — exactly ``aggregate.weighted_mean``."""

    individual = False

    def aggregate(self, updates: Sequence[Tensors], weights: Sequence[float]) -> dict[str, np.ndarray]:
        return aggregate.weighted_mean(list(zip(updates, weights, strict=True)))


def weighted_median(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted median along axis 0 (see the module docstring); ``values`` is ``(n, ...)``."""
    order = np.argsort(values, axis=0, kind="stable")
    v = np.take_along_axis(values, order, axis=0)
    wb = np.broadcast_to(weights.reshape((-1,) + (1,) * (values.ndim - 1)), values.shape)
    w = np.take_along_axis(wb, order, axis=0)
    cum = np.cumsum(w, axis=0)
    half = cum[-1] / 2.0
    tol = 1e-12 * cum[-1]
    k = np.argmax(cum >= half - tol, axis=0)  # first index reaching half
    at = np.take_along_axis(v, k[None, ...], axis=0)[0]
    exact = np.abs(np.take_along_axis(cum, k[None, ...], axis=0)[0] - half) <= tol
    nxt = np.take_along_axis(v, np.minimum(k + 1, len(v) - 1)[None, ...], axis=0)[0]
    return np.where(exact, (at + nxt) / 2.0, at)


class Median:
    """Coordinate-wise weighted median (equal weights: ``numpy.median``)."""

    individual = True

    def aggregate(self, updates: Sequence[Tensors], weights: Sequence[float]) -> dict[str, np.ndarray]:
        w = _check(updates, weights)
        return {n: weighted_median(_stack(updates, n), w).astype(np.float32) for n in updates[0]}


class TrimmedMean:
    """Per coordinate: drop ``floor(trim * n)`` values at each end, weighted mean of the rest."""

    individual = True

    def __init__(self, trim: float) -> None:
        self.trim = trim

    def aggregate(self, updates: Sequence[Tensors], weights: Sequence[float]) -> dict[str, np.ndarray]:
        w = _check(updates, weights)
        n = len(updates)
        k = int(math.floor(self.trim * n))
        out: dict[str, np.ndarray] = {}
        for name in updates[0]:
            values = _stack(updates, name)
            order = np.argsort(values, axis=0, kind="stable")[k:n - k]
            kept = np.take_along_axis(values, order, axis=0)
            kw = w[order]
            total = kw.sum(axis=0)
            # All kept weights zero at a coordinate (zero-weight updates): fall back to their plain mean.
            mean = np.where(total > 0, (kept * kw).sum(axis=0) / np.where(total > 0, total, 1.0), kept.mean(axis=0))
            out[name] = mean.astype(np.float32)
        return out


def krum_scores(updates: Sequence[Tensors], byzantine: int) -> np.ndarray:
    """Each update's Krum score: the sum of squared distances to its ``max(1, n - f - 2)`` nearest others."""
    n = len(updates)
    if n == 1:
        return np.zeros(1)
    names = sorted(updates[0])
    x = np.stack([_flat(u, names) for u in updates])
    # Pairwise squared distances, each as a sum of squared differences (the Gram-matrix
    # shortcut loses precision for close vectors, and Krum compares close vectors).
    d = np.stack([((x - x[i]) ** 2).sum(axis=1) for i in range(n)])
    neighbours = max(1, n - byzantine - 2)
    scores = np.empty(n)
    for i in range(n):
        others = np.delete(d[i], i)
        scores[i] = np.sort(others)[:neighbours].sum()
    return scores


class MultiKrum:
    """Weighted mean of the ``select`` updates with the lowest Krum scores (``krum``: ``select = 1``)."""

    individual = True

    def __init__(self, byzantine: int, select: int = 1) -> None:
        self.byzantine = byzantine
        self.select = select
        self.chosen: tuple[int, ...] = ()
        """Indices (in the order given) chosen by the last call."""

    def aggregate(self, updates: Sequence[Tensors], weights: Sequence[float]) -> dict[str, np.ndarray]:
        w = _check(updates, weights)
        scores = krum_scores(updates, self.byzantine)
        m = min(self.select, len(updates))
        chosen = sorted(np.argsort(scores, kind="stable")[:m].tolist())
        self.chosen = tuple(chosen)
        if m == 1:
            return aggregate.copy_tensors(updates[chosen[0]])
        picked_w = [float(w[i]) for i in chosen]
        if sum(picked_w) <= 0:
            picked_w = [1.0] * len(chosen)
        return aggregate.weighted_mean([(updates[i], wi) for i, wi in zip(chosen, picked_w, strict=True)])


class NormBoundedMean:
    """Each update scaled to L2 norm <= ``max_norm`` (all tensors as one vector), then the weighted mean."""

    individual = True

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm
        self.clipped = 0
        """How many updates the last call (or the last ``Collector``) scaled down."""

    def scale(self, update: Tensors) -> float:
        """The factor ``aggregate`` multiplies ``update`` by (counted in ``clipped`` when below 1)."""
        norm = aggregate.global_norm(update)
        factor = min(1.0, self.max_norm / norm) if norm > 0 else 1.0
        self.clipped += factor < 1.0
        return factor

    def aggregate(self, updates: Sequence[Tensors], weights: Sequence[float]) -> dict[str, np.ndarray]:
        w = _check(updates, weights)
        bounded = []
        self.clipped = 0
        for u in updates:
            scale = self.scale(u)
            bounded.append({n: np.asarray(t, dtype=np.float64) * scale for n, t in u.items()})
        return aggregate.weighted_mean(list(zip(bounded, w.tolist(), strict=True)))


# --- collecting ---------------------------------------------------------------------------------


class Collector:
    """One step's updates for ``aggregator``, gathered as they arrive (the module docstring).

    Folding changes only the order of the float64 additions: in arrival order, not the sender order
    ``aggregator.aggregate`` is given; the float32 result equals the stored rule's to float64 rounding
    (identical for the same order). The kept rules see exactly the updates they would have.
    """

    def __init__(self, aggregator: Aggregator, like: Tensors, rows: int) -> None:
        """
        Args:
            aggregator: the step's rule.
            like: the updates' layout (names and shapes).
            rows: the most updates the step can take (its members).
        """
        self.aggregator = aggregator
        self._scale: Any = None
        if type(aggregator) is Mean:
            self._scale = lambda update: 1.0
        elif type(aggregator) is NormBoundedMean:
            aggregator.clipped = 0
            self._scale = aggregator.scale
        self._mean = aggregate.RunningMean() if self._scale is not None else None
        self._block = aggregate.UpdateBlock(like, rows) if self._mean is None else None

    @property
    def folds(self) -> bool:
        """True: updates are folded as they arrive, none is kept."""
        return self._mean is not None

    def add(self, key: str, update: Tensors, weight: float) -> None:
        """Take ``update`` of child ``key`` with its ``weight`` (``common.device_weights``' value)."""
        if self._mean is not None:
            self._mean.fold(update, weight, self._scale(update))
        else:
            assert self._block is not None
            self._block.add(key, update)

    def sums(self) -> dict[str, np.ndarray]:
        """The float64 weighted sums folded so far (folding rules only)."""
        assert self._mean is not None, "only a folding rule has running sums"
        return self._mean.sums()

    def combine(self, keys: Sequence[str], weights: Sequence[float]) -> dict[str, np.ndarray]:
        """The step's result: the running mean, or the rule run on the kept updates of ``keys`` (in that
        order) with ``weights``. Raises ``StrategyError`` for a custom rule's bad result (``run``)."""
        if self._mean is not None:
            return self._mean.mean()
        assert self._block is not None
        return run(self.aggregator, self._block.updates(keys), weights)


# --- building -----------------------------------------------------------------------------------


def run(aggregator: Aggregator, updates: Sequence[Tensors], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """Call ``aggregator`` and check what it returns has the updates' layout (float32 out).

    Raises:
        StrategyError: a (custom) rule returned other names, other shapes or non-finite values.
    """
    if type(aggregator) is Mean:
        return aggregator.aggregate(updates, weights)  # today's mean, untouched
    out = aggregator.aggregate(updates, weights)
    ref = updates[0]
    if not isinstance(out, Mapping) or set(out) != set(ref):
        got = sorted(out) if isinstance(out, Mapping) else type(out).__name__
        raise StrategyError(f"{type(aggregator).__name__} returned {got}, expected tensors {sorted(ref)}")
    checked: dict[str, np.ndarray] = {}
    for name, t in out.items():
        arr = np.asarray(t, dtype=np.float32)
        if arr.shape != np.shape(ref[name]):
            raise StrategyError(f"{type(aggregator).__name__} returned {name} of shape {arr.shape}, expected "
                                f"{np.shape(ref[name])}")
        if not np.isfinite(arr).all():
            raise StrategyError(f"{type(aggregator).__name__} returned non-finite values in {name}")
        checked[name] = arr
    return checked


def load_class(spec: str) -> type:
    """Import ``package.module:Class``. Raises ``StrategyError`` naming what failed."""
    module_name, _, attr = spec.rpartition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise StrategyError(f"cannot import {module_name!r} for aggregation rule {spec!r}: {exc}") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise StrategyError(f"{module_name!r} has no class {attr!r} (aggregation rule {spec!r})")
    return cls


def build(spec: AggregatorSpec) -> Aggregator:
    """The aggregator a spec names (importing a custom class here, and only here)."""
    if spec.rule == "mean":
        return Mean()
    if spec.rule == "median":
        return Median()
    if spec.rule == "trimmed_mean":
        return TrimmedMean(spec.trim)
    if spec.rule == "krum":
        return MultiKrum(spec.byzantine, 1)
    if spec.rule == "multi_krum":
        return MultiKrum(spec.byzantine, spec.select)
    if spec.rule == "norm_bounded_mean":
        return NormBoundedMean(spec.max_norm)
    cls = load_class(spec.rule)
    try:
        obj = cls(**dict(spec.options))
    except TypeError as exc:
        raise StrategyError(f"{spec.rule}({', '.join(spec.options)}) failed: {exc}") from None
    if not callable(getattr(obj, "aggregate", None)):
        raise StrategyError(f"{spec.rule} has no aggregate(updates, weights) method (see Aggregator)")
    return obj

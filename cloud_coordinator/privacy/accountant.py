"""Privacy accounting for the M2FDP differential-privacy layer (seed 004, digest §3.1, §3.5, §8 check 7).

Every noise injection in the hierarchy is one Gaussian mechanism ("release") with noise multiplier
``z = sigma / sensitivity``. A device's privacy loss is the composition of every release that protects one of its
records. The paper calibrates noise with a closed form (eq. 11) whose constants are unspecified, so it is not a
verifiable guarantee (digest §3.5). This module therefore *reports* epsilon from an RDP accountant (Google
``dp_accounting``), and keeps the paper's closed form only as a reproduction aid.

Two accountants, both dp-accounting's, never hand-rolled: ``rdp`` (its RDP accountant, default orders) and ``pld``
(its privacy-loss-distribution accountant, default discretization), which is tighter — 5-15 % smaller epsilon for
the same releases in the runs measured (docs/privacy.md) — and is what ``[privacy] accountant = "pld"``
calibrates and reports with.

A release is ``(z, count)`` — ``count`` Gaussian mechanisms with multiplier ``z`` — or, with sampling,
``(z, count, q)``: each one a ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` (add/remove adjacency), or
``(z, count, q, n)``: each one a ``SampledWithoutReplacementDpEvent(n, round(q n), GaussianDpEvent(z))`` (a fixed-size
sample of ``round(q n)`` out of ``n``; dp-accounting's RDP supports it under replace-one adjacency only, and its PLD
accountant not at all). Amplification is only sound where the adversary does not learn who was sampled: the
calibration (``calibrate.py``) claims it for trusted edges, which sample in secret, never for device releases.

Two closed forms live here on purpose, and neither is used to report epsilon:

* :func:`classical_gaussian_multiplier` is eq. (2) of the paper, valid only for epsilon < 1.
* :func:`exact_gaussian_epsilon` is the tight analytic Gaussian mechanism. It exists so tests (and reviewers) can
  check that the RDP epsilon is never *below* the exact one, i.e. that the reported number is sound.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import numbers
from collections import Counter
from collections.abc import Iterable
from typing import Any

import dp_accounting
from dp_accounting import pld, rdp
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, special

__all__ = [
    "ACCOUNTANTS",
    "ORDERS",
    "AccountingError",
    "Accountant",
    "classical_gaussian_multiplier",
    "convergence_note",
    "epsilon",
    "exact_gaussian_epsilon",
    "noise_multiplier_for",
    "paper_noise_multiplier",
]

# RDP orders: dp-accounting's own default grid (1.1..10.9 by 0.1, 11..63, 128, 256, 512, 1024), so every epsilon
# here is exactly what ``RdpAccountant()`` reports. Epsilon depends on the grid (a coarser one gives a larger, still
# sound, epsilon): fractional orders matter for large epsilon, the large ones (up to 1024) for small epsilon.
ORDERS: tuple[float, ...] = tuple(float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS)

ACCOUNTANTS: tuple[str, ...] = ("rdp", "pld")
"""The accountants :func:`epsilon` and :func:`noise_multiplier_for` can use (both dp-accounting's)."""


class _ConvergenceWarnings(logging.Filter):
    """Counts, and keeps off the log, dp-accounting's "failed to converge" warnings (absl's logger).

    With sampling, dp-accounting's RDP of a subsampled Gaussian sums a series per fractional order; at small z it
    does not converge within its 1,000 terms for some orders, logs one warning per order and evaluation, and leaves
    that order out. Epsilon is the minimum over the remaining orders, so it stays a sound upper bound (at worst a
    little looser). A plan calibrates by bisection and logs a hundred of these; ``convergence_note`` says it once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if "failed to converge" not in str(record.msg):
            return True
        with self.lock:
            self.count += 1
        return False

    def take(self) -> int:
        with self.lock:
            count, self.count = self.count, 0
        return count


_CONVERGENCE = _ConvergenceWarnings()
logging.getLogger("absl").addFilter(_CONVERGENCE)  # absl.logging is imported (by dp_accounting) above


def convergence_note() -> str | None:
    """One line about the "failed to converge" warnings dp-accounting raised since the last call (then forgets
    them), or ``None`` if there were none."""
    count = _CONVERGENCE.take()
    if not count:
        return None
    return (f"note: dp-accounting's RDP series did not converge {count} time(s) for some fractional orders "
            "(sampled releases at small noise); it left those orders out, so each epsilon is the minimum over "
            "the others: still a valid upper bound, at most slightly looser")


# Bisection bracket and precision of noise_multiplier_for (relative, on z).
_Z_MIN = 1e-4
_Z_MAX = 1e6
_Z_REL_TOL = 1e-6
# PLD evaluations cost ~0.5 s each (FFT composition), so its bisection stops at 1e-3 relative: still always on the
# side of more noise, and far inside the 1 % the tests hold the inverse to.
_Z_REL_TOL_PLD = 1e-3


class AccountingError(ValueError):
    """Invalid accounting input. A ``ValueError`` so callers that validate configs generically still catch it;
    a subclass so privacy misconfiguration can be told apart from other bad values."""


# --------------------------------------------------------------------------------------------------------------
# validation: reject bad inputs loudly, because a silently wrong epsilon is a privacy bug, not a crash.
# --------------------------------------------------------------------------------------------------------------


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_delta(delta: float) -> None:
    if not _is_real(delta) or not 0.0 < delta < 1.0:  # NaN fails the comparison too
        raise AccountingError(f"delta must be in (0, 1), got {delta!r}")


def _check_sampling_rate(sampling_rate: float) -> None:
    if not _is_real(sampling_rate) or not 0.0 < sampling_rate <= 1.0:
        raise AccountingError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")


def _check_positive(value: float, name: str) -> None:
    if not _is_real(value) or not value > 0.0:
        raise AccountingError(f"{name} must be > 0, got {value!r}")


def _check_z(z: float) -> None:
    # math.inf is allowed: it means "no noise needed" (e.g. a release of nothing) and contributes no loss.
    if not _is_real(z) or not z >= 0.0:
        raise AccountingError(f"noise multiplier z must be >= 0 (math.inf allowed), got {z!r}")


def _check_count(count: int, name: str = "count") -> int:
    if not isinstance(count, numbers.Integral) or isinstance(count, bool):
        raise AccountingError(f"{name} must be an integer, got {count!r}")
    if count < 0:
        raise AccountingError(f"{name} must be >= 0, got {count!r}")
    return int(count)


Key = tuple[float, float, int]
PLD_INTERVAL = 1e-4
"""dp-accounting's default PLD discretization: what every reported (and checked) epsilon uses."""
PLD_SEARCH_INTERVAL = 1e-3
"""The coarser discretization ``noise_multiplier_for`` bisects with under PLD (then checked at ``PLD_INTERVAL``)."""


"""An accounting event: (z, q, n) — q = 1: a plain Gaussian; n = 0: Poisson sampling at q; n > 0: a fixed-size
sample of round(q n) out of n."""


def _check_accounting(accounting: str) -> None:
    if accounting not in ACCOUNTANTS:
        raise AccountingError(f"accounting must be one of {ACCOUNTANTS}, got {accounting!r}")


def _key(item: object) -> tuple[Key, int]:
    """Validate one release tuple and return its event key and count."""
    if not isinstance(item, (tuple, list)) or not 2 <= len(item) <= 4:
        raise AccountingError(f"releases must be (z, count[, q[, n]]) tuples, got {item!r}")
    z, count = item[0], item[1]
    _check_z(z)
    n_rel = _check_count(count)
    q = item[2] if len(item) > 2 else 1.0
    _check_sampling_rate(q)
    population = _check_count(item[3], "population") if len(item) > 3 else 0
    if population:
        size = round(float(q) * population)
        if not 1 <= size <= population:
            raise AccountingError(f"a fixed-size sample of round({q!r} x {population}) = {size} is not in "
                                  f"[1, {population}]")
        if size == population:
            q, population = 1.0, 0  # sampling everyone is no sampling
    return (float(z), float(q), population), n_rel


def _dp_event(key: Key) -> dp_accounting.DpEvent:
    z, q, population = key
    event: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(z)
    if population:
        return dp_accounting.SampledWithoutReplacementDpEvent(population, round(q * population), event)
    if q < 1.0:
        return dp_accounting.PoissonSampledDpEvent(q, event)
    return event


def _relation(keys: Iterable[Key], accounting: str) -> dp_accounting.NeighboringRelation:
    """Add/remove adjacency (dp-accounting's default) unless a fixed-size sample needs replace-one."""
    fixed = {k[2] > 0 for k in keys if k[1] < 1.0}
    if fixed == {True, False}:
        raise AccountingError("cannot compose Poisson and fixed-size sampled releases for one device: they are "
                              "accounted under different adjacency relations (add/remove vs replace-one)")
    if True in fixed:
        if accounting == "pld":
            raise AccountingError("dp-accounting's PLD accountant does not support fixed-size sampling "
                                  "(SampledWithoutReplacementDpEvent): use accounting 'rdp' or Poisson sampling")
        return dp_accounting.NeighboringRelation.REPLACE_ONE
    return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


# --------------------------------------------------------------------------------------------------------------
# RDP epsilon (the number we report)
# --------------------------------------------------------------------------------------------------------------


def epsilon(releases: Iterable[Any], delta: float, sampling_rate: float = 1.0, accounting: str = "rdp",
            pld_interval: float = PLD_INTERVAL) -> float:
    """Epsilon at ``delta`` of the composition of Gaussian releases, from dp-accounting (``rdp`` or ``pld``).

    Why dp-accounting and not a formula: the paper's eq. (11) has unspecified constants (digest §3.5), and a
    maintained accountant is the reference reviewers check against (digest §8 check 7). A fresh accountant (RDP with
    its default orders, :data:`ORDERS`; PLD with its default discretization) is built per call, so the result depends
    only on the arguments.

    * ``releases``: ``(z, count)``, ``(z, count, q)`` (Poisson-sampled) or ``(z, count, q, n)`` (fixed-size sample
      of ``round(q n)`` out of ``n``) tuples; see the module docstring.
    * ``z = math.inf`` (no noise needed, e.g. a release of nothing) contributes nothing. It is skipped *before*
      dp_accounting sees it, because dp_accounting's subsampled-Gaussian code does not converge at sigma = inf.
    * ``z == 0`` with ``count > 0`` is an un-noised release: epsilon is ``math.inf``.
    * ``count == 0`` contributes nothing (dp_accounting itself rejects count 0). Empty input gives ``0.0``.
    * ``sampling_rate < 1``: the Poisson rate of every ``(z, count)`` release without its own. This amplification
      is only valid if the adversary does not learn who was sampled; the default 1.0 claims none.

    Equal events are merged into one composed event (identical result, one evaluation per distinct event).
    """
    _check_delta(delta)
    _check_sampling_rate(sampling_rate)
    _check_accounting(accounting)
    merged: Counter[Key] = Counter()
    for item in releases:
        if sampling_rate < 1.0 and isinstance(item, (tuple, list)) and len(item) == 2:
            item = (*item, sampling_rate)
        key, count = _key(item)
        if count == 0 or math.isinf(key[0]):
            continue
        if key[0] == 0.0:
            return math.inf
        merged[key] += count
    if not merged:
        return 0.0
    return _composed_epsilon(tuple(sorted(merged.items())), float(delta), accounting, float(pld_interval))


@functools.lru_cache(maxsize=4096)
def _composed_epsilon(events: tuple[tuple[Key, int], ...], delta: float, accounting: str,
                      pld_interval: float = PLD_INTERVAL) -> float:
    """Epsilon of merged, sorted events from a fresh accountant. Cached: a pure function of its arguments, and a
    subsampled release's RDP takes a fraction of a second, while a ledger asks it for every device of a cell
    (identical histories) every round."""
    merged = Counter(dict(events))
    relation = _relation(merged, accounting)
    acc: dp_accounting.PrivacyAccountant
    if accounting == "pld":
        acc = pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=pld_interval)
    else:
        acc = rdp.RdpAccountant(list(ORDERS), neighboring_relation=relation)
    for key, count in events:
        acc.compose(_dp_event(key), count)
    # dp_accounting may return the int 0 (or a numpy float); callers expect a plain float.
    return float(acc.get_epsilon(delta))


@functools.lru_cache(maxsize=512)
def noise_multiplier_for(target_epsilon: float, delta: float, releases: int, sampling_rate: float = 1.0,
                         accounting: str = "rdp", population: int = 0) -> float:
    """Smallest noise multiplier z (to relative 1e-6) such that ``releases`` Gaussian releases at z stay within
    ``target_epsilon`` at ``delta`` (RDP, as :func:`epsilon`).

    The returned z is always one whose epsilon was *evaluated* and found ``<= target_epsilon``: this calibrates real
    noise, so rounding must err towards more noise, never less. The search is a bisection in log space within
    [1e-4, 1e6] (useful z span orders of magnitude), after bracketing outwards from z = 1; it assumes epsilon is
    non-increasing in z, which holds for the Gaussian and the subsampled Gaussian. If even z = 1e-4 fits, 1e-4 is
    returned. Raises :class:`AccountingError` if even z = 1e6 is not enough, and for
    ``releases < 1`` (calibrating noise for zero releases is meaningless; returning "no noise" would be a trap).
    ``accounting`` picks the accountant (``rdp`` or ``pld``); ``population > 0`` makes each release a fixed-size
    sample of ``round(sampling_rate * population)`` out of ``population`` instead of a Poisson sample.

    Results are cached: a pure function of its arguments, and a PLD bisection takes seconds, while one process
    often solves the same one again (an experiment's seeds at the same epsilon, a plan and its comparisons).

    Note: dp_accounting's epsilon is not continuous in z at the low end. With finite orders (max 1024) it floors at
    about 0.0035 (delta 1e-5) until the RDP becomes tiny enough for its KL-divergence shortcut to return 0, so a
    target below that floor yields a very large z.
    """
    _check_positive(target_epsilon, "target_epsilon")
    _check_delta(delta)
    _check_sampling_rate(sampling_rate)
    _check_accounting(accounting)
    pop = _check_count(population, "population")
    n = _check_count(releases, "releases")
    if n < 1:
        raise AccountingError(f"releases must be >= 1 to calibrate noise, got {releases!r}")

    def fits(z: float, interval: float = PLD_SEARCH_INTERVAL) -> bool:
        release = (z, n, sampling_rate, pop) if pop else (z, n, sampling_rate)
        return epsilon([release], delta, accounting=accounting, pld_interval=interval) <= target_epsilon

    # Bracket first, from z = 1 outwards by factors of 2, then bisect in log space. Probing the extremes of
    # [1e-4, 1e6] is wasted work and, with subsampling, makes dp_accounting's fractional-order series fail to
    # converge (it logs a warning per order) at small z.
    z_fail: float | None = None  # largest z evaluated that does not fit
    z_fit: float | None = None  # smallest z evaluated that fits: what we return
    z = 1.0
    if fits(z):
        z_fit = z
        while z_fit > _Z_MIN:
            z = max(z_fit / 2.0, _Z_MIN)
            if not fits(z):
                z_fail = z
                break
            z_fit = z
        if z_fail is None:
            return z_fit  # even the bracket floor fits
    else:
        z_fail = z
        while z_fail < _Z_MAX:
            z = min(z_fail * 2.0, _Z_MAX)
            if fits(z):
                z_fit = z
                break
            z_fail = z
        if z_fit is None:
            raise AccountingError(
                f"target_epsilon={target_epsilon!r} unreachable for releases={n} at delta={delta!r}, "
                f"sampling_rate={sampling_rate!r} even with z={_Z_MAX:g}"
            )
    tol = _Z_REL_TOL_PLD if accounting == "pld" else _Z_REL_TOL
    while z_fit / z_fail > 1.0 + tol:
        z = math.exp(0.5 * (math.log(z_fail) + math.log(z_fit)))
        if fits(z):
            z_fit = z
        else:
            z_fail = z
    # PLD searched with a coarser discretization (10x faster, within 1e-5 relative here); the answer must fit at
    # the accountant's own: step up until it does (it almost always already does: coarser is more pessimistic).
    while accounting == "pld" and not fits(z_fit, PLD_INTERVAL) and z_fit < _Z_MAX:
        z_fit = min(z_fit * (1.0 + tol), _Z_MAX)
    return z_fit


# --------------------------------------------------------------------------------------------------------------
# closed forms: reference/paper only, never used to report epsilon
# --------------------------------------------------------------------------------------------------------------


def classical_gaussian_multiplier(delta: float) -> float:
    """Eq. (2) of the paper: z = sqrt(2 ln(1.25/delta)) gives (1, delta)-DP per release (Dwork-Roth).

    Kept because the paper states it and reviewers check it (4.844805 at delta 1e-5). It is valid only for
    epsilon < 1 and does not compose tightly, which is why M2FDP (and we) do not calibrate with it.
    """
    _check_delta(delta)
    return math.sqrt(2.0 * math.log(1.25 / delta))


def _gaussian_delta(eps: float, mu: float) -> float:
    """Privacy profile of a mu-GDP mechanism: delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2).
    The second term is computed in log space so e^eps cannot overflow for large eps."""
    first = math.exp(float(special.log_ndtr(-eps / mu + mu / 2.0)))
    second = math.exp(eps + float(special.log_ndtr(-eps / mu - mu / 2.0)))
    return first - second


def exact_gaussian_epsilon(z: float, count: int, delta: float) -> float:
    """Tight epsilon at ``delta`` of ``count`` Gaussian releases with multiplier ``z`` (analytic Gaussian mechanism).

    ``count`` releases at z are exactly one Gaussian mechanism with mu = sqrt(count)/z (Gaussian DP composes
    exactly), whose privacy profile delta(eps) is decreasing in eps; we solve delta(eps) = delta with scipy's
    brentq. This is the ground truth for *pure* Gaussian composition: an RDP epsilon below it would be unsound, so
    tests compare :func:`epsilon` against it. Not used for reporting because it does not cover subsampling.
    """
    _check_delta(delta)
    _check_z(z)
    n = _check_count(count)
    if n == 0 or math.isinf(z):
        return 0.0
    if z == 0.0:
        return math.inf
    mu = math.sqrt(n) / z
    if _gaussian_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while _gaussian_delta(hi, mu) > delta:
        hi *= 2.0
        if math.isinf(hi):  # pragma: no cover - mu would have to be astronomically large
            return math.inf

    def objective(eps: float) -> float:
        return _gaussian_delta(eps, mu) - delta

    root = optimize.brentq(objective, 0.0, hi, xtol=1e-12, rtol=1e-12)
    return float(root)


def paper_noise_multiplier(
    *, alpha: float, sampling_rate: float, steps_per_round: int, rounds: int, epsilon: float, delta: float
) -> float:
    """The paper's closed form, eq. (11) divided by the sensitivity: alpha * q * sqrt(K * T * ln(1/delta)) / epsilon.

    K = ``steps_per_round`` (K^max), T = ``rounds``, q = ``sampling_rate``. This is a heuristic (alpha is an
    unspecified constant, the release count and amplification are misapplied; digest §3.5): it exists only to
    reproduce the paper ("paper mode"). Whatever z it yields, report epsilon with :func:`epsilon`.
    """
    _check_positive(alpha, "alpha")
    _check_sampling_rate(sampling_rate)
    k = _check_count(steps_per_round, "steps_per_round")
    t = _check_count(rounds, "rounds")
    if k < 1:
        raise AccountingError(f"steps_per_round must be >= 1, got {steps_per_round!r}")
    if t < 1:
        raise AccountingError(f"rounds must be >= 1, got {rounds!r}")
    _check_positive(epsilon, "epsilon")
    _check_delta(delta)
    return alpha * sampling_rate * math.sqrt(k * t * math.log(1.0 / delta)) / epsilon


# --------------------------------------------------------------------------------------------------------------
# per-device running accountant
# --------------------------------------------------------------------------------------------------------------


class Accountant:
    """Per-device running privacy loss at one ``delta``: which releases protect each device.

    Why per device: in M2FDP different devices are protected by different injections (their own noise under an
    untrusted edge, their trusted edge's noise otherwise), so each has its own composition. Why a ``Counter`` of
    events rather than a live dp-accounting accountant: the state stays tiny, serialisable and inspectable
    (:meth:`releases`), and "what if" queries (:meth:`epsilon_with`) need no copying; each query builds a fresh
    accountant, which is cheap because equal events are composed as one.

    ``accounting`` is ``rdp`` (default) or ``pld``; ``sampling_rate`` is the Poisson rate claimed for every release
    added without its own (1.0: none). A release's own rate and population (fixed-size sampling) go to :meth:`add`.
    """

    def __init__(self, delta: float, sampling_rate: float = 1.0, accounting: str = "rdp") -> None:
        _check_delta(delta)
        _check_sampling_rate(sampling_rate)
        _check_accounting(accounting)
        self._delta = float(delta)
        self._sampling_rate = float(sampling_rate)
        self._accounting = accounting
        self._by_device: dict[str, Counter[Key]] = {}

    @property
    def delta(self) -> float:
        """The delta every epsilon of this accountant is reported at."""
        return self._delta

    @property
    def sampling_rate(self) -> float:
        """The Poisson sampling rate claimed for every release added without its own (1.0 = no amplification)."""
        return self._sampling_rate

    @property
    def accounting(self) -> str:
        """``rdp`` or ``pld``."""
        return self._accounting

    def add(self, devices: Iterable[str], z: float, count: int = 1, sampling_rate: float | None = None,
            population: int = 0) -> None:
        """Record one release (``count`` times) with multiplier ``z`` protecting each of ``devices``.

        ``sampling_rate`` (default: the accountant's) and ``population`` describe how the release sampled the
        devices it covers (see the module docstring). Inputs are validated before any state changes, so a rejected
        call leaves the accountant untouched. A bare ``str`` is rejected (it would be iterated as single-character
        device ids). A device listed twice is counted once: a release protects a device or it does not.
        ``count == 0`` still registers the devices, so they appear in :meth:`epsilons` with 0.0.
        """
        if isinstance(devices, str):
            raise AccountingError(f"devices must be an iterable of device ids, not a single str ({devices!r})")
        q = self._sampling_rate if sampling_rate is None else sampling_rate
        key, n = _key((z, count, q, population))
        ids = list(dict.fromkeys(devices))
        for device in ids:
            if not isinstance(device, str):
                raise AccountingError(f"devices must contain str device ids, got {device!r}")
        for device in ids:
            per_device = self._by_device.setdefault(device, Counter())
            if n > 0:
                per_device[key] += n

    def releases(self, device: str) -> list[tuple[Any, ...]]:
        """The releases protecting ``device`` as sorted ``(z, count)`` pairs — ``(z, count, q)`` for a
        Poisson-sampled one, ``(z, count, q, n)`` for a fixed-size one — (empty for an unknown device)."""
        out: list[tuple[Any, ...]] = []
        for (z, q, population), count in sorted(self._by_device.get(device, Counter()).items()):
            if population:
                out.append((z, count, q, population))
            elif q < 1.0:
                out.append((z, count, q))
            else:
                out.append((z, count))
        return out

    def epsilon(self, device: str) -> float:
        """Current epsilon of ``device`` at :attr:`delta`; 0.0 for a device never seen (nothing released)."""
        return epsilon(self.releases(device), self._delta, accounting=self._accounting)

    def epsilon_with(self, device: str, extra: Iterable[Any]) -> float:
        """Epsilon ``device`` would have if ``extra`` releases were added; does not change the accountant.

        ``(z, count)`` pairs in ``extra`` take the accountant's sampling rate. Used to stop *before* a release that
        would exceed the budget (digest §8 check 8).
        """
        more = [(*r, self._sampling_rate) if len(r) == 2 and self._sampling_rate < 1.0 else r for r in extra]
        return epsilon([*self.releases(device), *more], self._delta, accounting=self._accounting)

    def epsilons(self) -> dict[str, float]:
        """Epsilon of every device seen. Devices with identical release histories (the common case: all devices
        under one edge) share one computation."""
        cache: dict[tuple[tuple[Any, ...], ...], float] = {}
        out: dict[str, float] = {}
        for device in self._by_device:
            key = tuple(self.releases(device))
            if key not in cache:
                cache[key] = epsilon(key, self._delta, accounting=self._accounting)
            out[device] = cache[key]
        return out

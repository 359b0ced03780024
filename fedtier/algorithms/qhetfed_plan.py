"""Deadline planner for QHetFed: choose (τ, γ) per global round from a time budget.

Source: seed paper 003, "A Hierarchical Federated Learning Approach for the Internet of
Things" (Azimi-Abarghouyi, Fodor), Sec. IV, eqs. (41)–(49); read through the digest
``/work/shared/papers/seed_003_qhetfed.md`` §4 and its errata §10.

Theory of operation
-------------------
One QHetFed global round runs τ intra-set iterations of gradient aggregation (a gradient
step and an upload each) and then γ plain local SGD steps, and ends with one edge→cloud
upload. Its wall time is eq. (42)::

    T_di(τ, γ) = (τ + γ)·t_CP + τ·t_DE + t_EC

Algorithm 1 actually has τ + 1 device→edge uploads (τ gradients plus the final γ-step
delta; digest §4.1), so ``uploads="tau+1"`` charges (τ + 1)·t_DE instead. The paper picks
(τ, γ) to minimise the stationary-error bracket of Lemma 2, eq. (43)::

    J(τ, γ) = a·τ·(1 + (γ − 1)/(τ + γ)) + γ(γ − 1)/(τ + γ),    a = (C/N)(1 + q1)

subject to the per-round budget (41). With r = t_DE/t_CP and K = budget/t_CP − t_EC/t_CP
(the compute-step slots left once the cloud upload is paid for; minus r more for τ + 1
uploads), spending the budget exactly gives γ = K − (1 + r)τ (44) and J becomes a function
of τ alone (45); the paper's closed form takes the best of τ = 1 and the real roots of the
quadratic (46)–(49).

What the digest found (§4.4, proven there and checked numerically), and why ``robust`` is
the default:

* Along the budget line J is convex in τ when a ≤ 1 and concave when a > 1, so in the
  continuous relaxation the feasible optimum always lies on the boundary, τ = 1 or γ = 1.
  A stationary root of (46) inside [1, τ_max] is a local *maximum*, and the roots usually
  lie beyond τ_max, where γ < 1. The paper's candidate set {1} ∪ roots omits the γ = 1
  endpoint and missed the feasible minimum in 79 % of random instances.
* ``mode="robust"`` therefore brute-forces the integers τ = 1..τ_max with the largest γ
  that fits, which covers both boundaries and the integer rounding. For a ≤ 1
  (q1 ≤ N/C − 1, Corollary 1's threshold) it returns the largest feasible τ.
* The budget must be used fully (equality in (41)): J grows with both τ and γ, so under
  "≤" the minimiser degenerates to τ = γ = 1 and leaves the budget idle.
* ``mode="paper"`` reproduces the closed form exactly (real τ, γ, not rounded) and flags
  the result as infeasible when γ < 1, τ < 1 or the roots are complex.

This module is pure: numpy and the standard library, no I/O.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np

from fedtier.errors import ConfigError

UPLOADS = ("tau", "tau+1")
MODES = ("robust", "paper")

# A budget holding more compute slots than this is refused: the robust search is O(τ_max)
# and, near 1e16 slots, one more step would no longer change the float round time.
MAX_SLOTS = 1e8

# Objective values this close (relative) to the minimum count as ties in robust mode; the
# objective is a handful of positive-term float operations, so rounding error is ~1e-15.
_TIE_RTOL = 1e-13
_CHUNK = 1 << 20

_Num = TypeVar("_Num", float, np.ndarray)


class InfeasiblePlanError(ValueError):
    """The round budget cannot fit one gradient step, one local step and the uploads.

    Attributes:
        min_budget_s: the smallest budget with a feasible plan, T_di(1, 1) from eq. (42).
    """

    def __init__(self, message: str, *, min_budget_s: float) -> None:
        super().__init__(message)
        self.min_budget_s = min_budget_s


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """The instance of the deadline problem (41)–(42). Times are seconds.

    Attributes:
        C: number of edge servers (= device sets), C ≥ 1.
        N: total number of devices over all sets, N ≥ C.
        q1: variance factor of the device→edge quantizer Q1 (eq. (12)), q1 ≥ 0.
        t_cp: t_CP, time of one gradient (compute) step on a device, > 0.
        t_de: t_DE, time of one device→edge upload, > 0.
        t_ec: t_EC, time of the edge→cloud exchange that ends a round, > 0.
        round_budget_s: T_d/T, the wall-time budget of one global round, > 0.
        uploads: ``"tau"`` charges τ uploads per round as in (42); ``"tau+1"`` charges the
            τ + 1 uploads Algorithm 1 actually makes (digest §4.1).

    Raises:
        ConfigError: a field is out of range; ``key`` names the field.
    """

    C: int
    N: int
    q1: float
    t_cp: float
    t_de: float
    t_ec: float
    round_budget_s: float
    uploads: str = "tau"

    def __post_init__(self) -> None:
        if not _is_int(self.C) or self.C < 1:
            raise ConfigError(f"C (number of edge servers) must be an integer >= 1, got {self.C!r}", key="C")
        if not _is_int(self.N) or self.N < self.C:
            raise ConfigError(
                f"N (total number of devices) must be an integer >= C = {self.C}, got {self.N!r}", key="N")
        if not _is_real(self.q1) or not math.isfinite(self.q1) or self.q1 < 0:
            raise ConfigError(f"q1 (quantizer variance factor) must be finite and >= 0, got {self.q1!r}", key="q1")
        for key, what in (("t_cp", "t_CP, one gradient step"), ("t_de", "t_DE, one device->edge upload"),
                          ("t_ec", "t_EC, the edge->cloud exchange"),
                          ("round_budget_s", "the round budget")):
            value = getattr(self, key)
            if not _is_real(value) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{key} ({what}, seconds) must be finite and > 0, got {value!r}", key=key)
        if self.uploads not in UPLOADS:
            raise ConfigError(f"uploads must be one of {', '.join(UPLOADS)}, got {self.uploads!r}", key="uploads")
        if self.round_budget_s / self.t_cp > MAX_SLOTS:
            raise ConfigError(
                f"round_budget_s / t_cp = {self.round_budget_s / self.t_cp:.3g} gradient steps per round exceeds "
                f"{MAX_SLOTS:.0e}; the planner enumerates tau, so use coarser time units for such budgets",
                key="round_budget_s")

    @property
    def a(self) -> float:
        """a = (C/N)(1 + q1), the weight of τ in (43) (digest §4.3)."""
        return (self.C / self.N) * (1.0 + self.q1)

    @property
    def r(self) -> float:
        """r = t_DE / t_CP, an upload measured in gradient steps."""
        return self.t_de / self.t_cp

    @property
    def K(self) -> float:
        """K = budget/t_CP − t_EC/t_CP (− r for τ + 1 uploads): compute slots per round."""
        k = self.round_budget_s / self.t_cp - self.t_ec / self.t_cp
        # τ + 1 uploads = (42) with τ·t_DE → (τ + 1)·t_DE, i.e. K shifted by −r (digest §4.1).
        return k - self.r if self.uploads == "tau+1" else k


@dataclass(frozen=True, slots=True)
class Plan:
    """The chosen (τ, γ) and the quantities it came from.

    Attributes:
        tau: intra-set gradient-aggregation iterations per global round (int in robust mode;
            the paper's real-valued τ_opt in paper mode).
        gamma: local SGD steps per global round (int in robust mode; real, possibly < 1, in
            paper mode).
        objective: J, eq. (43) (robust) or (45) (paper; equal to (43) on the budget line).
        round_time_s: T_di(τ, γ), eq. (42), or its τ + 1 uploads variant.
        mode: ``"robust"`` or ``"paper"``.
        feasible: whether (τ, γ) is a usable plan: τ ≥ 1, γ ≥ 1 and (paper mode) real roots.
        notes: human-readable remarks (roots, infeasibility, the a ≤ 1 regime).
        a, r, K: see :class:`PlanInputs`.
        tau_max: largest τ with γ = 1 within the budget, ⌊(K − 1)/(1 + r)⌋.
        roots: the real roots of (46) (paper mode; empty in robust mode).
    """

    tau: int | float
    gamma: int | float
    objective: float
    round_time_s: float
    mode: str
    feasible: bool
    notes: tuple[str, ...]
    a: float
    r: float
    K: float
    tau_max: int
    roots: tuple[float, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-ready dict of every field (notes and roots as lists)."""
        out = asdict(self)
        out["notes"] = list(self.notes)
        out["roots"] = list(self.roots)
        return out


def objective(a: float, tau: float, gamma: float) -> float:
    """Eq. (43): J = a·τ·(1 + (γ − 1)/(τ + γ)) + γ(γ − 1)/(τ + γ).

    Args:
        a: (C/N)(1 + q1).
        tau: intra-set iterations τ.
        gamma: local steps γ.

    Returns:
        J(τ, γ), the stationary-error bracket of Lemma 2 (40).

    Raises:
        ValueError: τ + γ <= 0 (J is undefined there).
    """
    if not tau + gamma > 0:
        raise ValueError(f"objective (43) needs tau + gamma > 0, got tau={tau!r}, gamma={gamma!r}")
    return float(_objective(a, tau, gamma))


def _objective(a: float, tau: _Num, gamma: _Num) -> _Num:
    # Eq. (43). Shared by the scalar API and the vectorised search so both round identically.
    s = tau + gamma
    return a * tau * (1.0 + (gamma - 1.0) / s) + gamma * (gamma - 1.0) / s


def objective_on_budget(a: float, r: float, K: float, tau: float) -> float:
    """Eq. (45): J on the budget line γ = K − (1 + r)τ (44), as a function of τ alone.

    J(τ) = (1 − (1 + τ)/(K − rτ))·(mτ + K) + aτ with m = a − 1 − r.

    Args:
        a: (C/N)(1 + q1).
        r: t_DE / t_CP.
        K: compute slots per round.
        tau: intra-set iterations τ (real).

    Returns:
        J(τ), equal to :func:`objective` at γ = K − (1 + r)τ.

    Raises:
        ValueError: K − rτ <= 0, i.e. τ + γ <= 0 (J is undefined there).
    """
    slots = K - r * tau  # = τ + γ on the budget line (44)
    if not slots > 0:
        raise ValueError(f"objective (45) needs K - r*tau > 0, got K={K!r}, r={r!r}, tau={tau!r}")
    m = a - 1.0 - r
    return (1.0 - (1.0 + tau) / slots) * (m * tau + K) + a * tau


def closed_form_coefficients(a: float, r: float, K: float) -> tuple[float, float, float]:
    """Eqs. (47)–(49): coefficients of the stationarity quadratic a0·τ² + b0·τ + c0 = 0 (46).

    Args:
        a: (C/N)(1 + q1).
        r: t_DE / t_CP.
        K: compute slots per round.

    Returns:
        (a0, b0, c0).
    """
    m = a - 1.0 - r
    a0 = m * (r * r + r) + a * r * r  # (47)
    b0 = -2.0 * K * (1.0 + r) * m - 2.0 * a * K * r  # (48)
    c0 = m * (K * K - K) - K * (K + r) + a * K * K  # (49)
    return a0, b0, c0


def _real_roots(a0: float, b0: float, c0: float) -> tuple[tuple[float, ...], str]:
    """Real roots of a0·x² + b0·x + c0, ascending, and "real" | "complex" | "none"."""
    if a0 == 0.0:
        if b0 == 0.0:
            return (), "none"
        return (-c0 / b0,), "real"
    disc = b0 * b0 - 4.0 * a0 * c0
    if disc < 0.0:
        return (), "complex"
    # Cancellation-free form: q = −(b0 + sign(b0)·√disc)/2, roots q/a0 and c0/q.
    q = -0.5 * (b0 + math.copysign(math.sqrt(disc), b0))
    if q == 0.0:  # b0 = c0 = 0: double root at 0
        return (0.0,), "real"
    return tuple(sorted({q / a0, c0 / q})), "real"


def round_time(inputs: PlanInputs, tau: float, gamma: float) -> float:
    """Eq. (42): wall time of one global round, (τ + γ)·t_CP + τ·t_DE + t_EC.

    With ``inputs.uploads == "tau+1"`` the uploads cost (τ + 1)·t_DE (digest §4.1 caveat).

    Args:
        inputs: the instance.
        tau: intra-set iterations τ.
        gamma: local steps γ.

    Returns:
        T_di(τ, γ) in seconds.
    """
    return float(_round_time(inputs, tau, gamma))


def _round_time(inputs: PlanInputs, tau: _Num, gamma: _Num) -> _Num:
    # Shared by the scalar API and the vectorised search, so that "fits the budget" is the
    # same float comparison everywhere.
    uploads = tau + 1.0 if inputs.uploads == "tau+1" else tau
    return (tau + gamma) * inputs.t_cp + uploads * inputs.t_de + inputs.t_ec


def min_round_budget(inputs: PlanInputs) -> float:
    """The smallest budget with a feasible plan: T_di(1, 1), eq. (42).

    Args:
        inputs: the instance (its budget is ignored).

    Returns:
        2·t_CP + t_DE + t_EC (+ t_DE more for τ + 1 uploads), in seconds.
    """
    return round_time(inputs, 1, 1)


def _fits(inputs: PlanInputs, tau: _Num, gamma: _Num) -> Any:
    return _round_time(inputs, tau, gamma) <= inputs.round_budget_s


def _tau_max(inputs: PlanInputs) -> int:
    """⌊(K − 1)/(1 + r)⌋, corrected so that it is exactly the largest τ with T_di(τ, 1) <= budget.

    K is a float, so the formula can be off by one at an exact boundary; the round-time test
    is the definition of "fits" everywhere in this module (T_di is monotone in τ and γ even
    in floating point, because rounding is monotone).
    """
    tau = max(math.floor((inputs.K - 1.0) / (1.0 + inputs.r)), 0)
    while tau >= 1 and not _fits(inputs, float(tau), 1.0):
        tau -= 1
    while _fits(inputs, float(tau + 1), 1.0):
        tau += 1
    return tau


def _max_gamma(inputs: PlanInputs, tau: np.ndarray) -> np.ndarray:
    """The largest γ with T_di(τ, γ) <= budget, per τ: ⌊K − (1 + r)τ⌋ from (44), corrected."""
    gamma = np.floor(inputs.K - (1.0 + inputs.r) * tau)
    for _ in range(8):  # float K is off by at most a step or two; MAX_SLOTS keeps t_CP above the ulp
        over = ~_fits(inputs, tau, gamma)
        if not over.any():
            break
        gamma = gamma - over
    for _ in range(8):
        under = _fits(inputs, tau, gamma + 1.0)
        if not under.any():
            break
        gamma = gamma + under
    return gamma


def _robust_candidates(inputs: PlanInputs, tau_max: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    for start in range(1, tau_max + 1, _CHUNK):
        tau = np.arange(start, min(start + _CHUNK, tau_max + 1), dtype=np.float64)
        gamma = _max_gamma(inputs, tau)
        yield tau, gamma, _objective(inputs.a, tau, gamma)


def _robust(inputs: PlanInputs, tau_max: int) -> tuple[int, int]:
    """Integer brute force: τ = 1..τ_max, γ maximal for τ, argmin of (43).

    Ties (within a relative 1e-13) go to the larger τ + γ, then to the larger τ.
    """
    j_min = min(float(j.min()) for _, _, j in _robust_candidates(inputs, tau_max))
    tol = _TIE_RTOL * max(1.0, abs(j_min))
    best: tuple[float, float] | None = None  # (τ + γ, τ)
    for tau, gamma, j in _robust_candidates(inputs, tau_max):
        tied = j <= j_min + tol
        if not tied.any():
            continue
        s = tau[tied] + gamma[tied]
        i = int(np.lexsort((tau[tied], s))[-1])  # max by τ + γ, then by τ
        key = (float(s[i]), float(tau[tied][i]))
        if best is None or key > best:
            best = key
    assert best is not None  # tau_max >= 1, so there is at least one candidate
    s_best, tau_best = best
    return int(tau_best), int(s_best - tau_best)


def plan(inputs: PlanInputs, mode: str = "robust") -> Plan:
    """Choose (τ, γ) for one QHetFed global round within ``inputs.round_budget_s``.

    Args:
        inputs: the instance.
        mode: ``"robust"`` (default): integer brute force over τ = 1..τ_max with γ the
            largest integer that fits, minimising (43); ties go to the larger τ + γ, then
            the larger τ. Always feasible: integers >= 1 and T_di <= budget.
            ``"paper"``: the closed form of Sec. IV as printed: τ_opt = argmin of (45) over
            {1} ∪ real roots of (46)–(49), γ_opt = K − (1 + r)τ_opt, neither rounded;
            ``feasible`` is False (with a note) if γ_opt < 1, τ_opt < 1 or the roots are
            complex.

    Returns:
        The :class:`Plan`.

    Raises:
        InfeasiblePlanError: the budget cannot fit τ = γ = 1 (in either mode).
        ConfigError: unknown ``mode`` (key ``"mode"``).
    """
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}", key="mode")
    tau_max = _tau_max(inputs)
    if tau_max < 1:
        need = min_round_budget(inputs)
        uploads = "2 uploads" if inputs.uploads == "tau+1" else "1 upload"
        raise InfeasiblePlanError(
            f"a round budget of {inputs.round_budget_s:g} s cannot fit one gradient step plus one local step, "
            f"{uploads} to the edge and the edge->cloud exchange; the minimum budget is {need:.6g} s "
            f"(2*t_cp + {'2*' if inputs.uploads == 'tau+1' else ''}t_de + t_ec)",
            min_budget_s=need)
    a, r, K = inputs.a, inputs.r, inputs.K
    notes: list[str] = []
    if inputs.uploads == "tau+1":
        notes.append("time model charges tau+1 device->edge uploads per round (Algorithm 1), not tau as in (42)")
    if mode == "robust":
        tau, gamma = _robust(inputs, tau_max)
        if a <= 1.0:
            notes.append(f"a = {a:.6g} <= 1 (q1 <= N/C - 1): J decreases along the budget line, so the plan "
                         "spends the budget on intra-set rounds (largest feasible tau)")
        return Plan(tau=tau, gamma=gamma, objective=objective(a, tau, gamma),
                    round_time_s=round_time(inputs, tau, gamma), mode=mode, feasible=True,
                    notes=tuple(notes), a=a, r=r, K=K, tau_max=tau_max)
    return _paper(inputs, tau_max, notes)


def _paper(inputs: PlanInputs, tau_max: int, notes: list[str]) -> Plan:
    a, r, K = inputs.a, inputs.r, inputs.K
    a0, b0, c0 = closed_form_coefficients(a, r, K)
    roots, kind = _real_roots(a0, b0, c0)
    feasible = True
    if kind == "complex":
        feasible = False
        notes.append(f"the quadratic (46) has complex roots (b0^2 - 4 a0 c0 = {b0 * b0 - 4 * a0 * c0:.6g} < 0): "
                     "the closed form is undefined; only the candidate tau = 1 remains")
    elif kind == "none":
        feasible = False
        notes.append("the quadratic (46) is degenerate (a0 = b0 = 0) and has no roots; only tau = 1 remains")
    else:
        listed = ", ".join(f"{x:.6g} (gamma = {K - (1.0 + r) * x:.6g})" for x in roots)
        notes.append(f"roots of (46): {listed}")
    # τ_opt = argmin of (45) over {1} ∪ real roots; (45) is undefined where K − rτ <= 0 (τ + γ <= 0).
    scored: list[tuple[float, float]] = []
    for cand in (1.0, *roots):
        if K - r * cand > 0:
            scored.append((objective_on_budget(a, r, K, cand), cand))
        else:
            notes.append(f"candidate tau = {cand:.6g} skipped: K - r*tau <= 0, (45) is undefined there")
    j_opt, tau_opt = min(scored, key=lambda jt: jt[0])  # tau = 1 is always scored: K - r > 1 as tau_max >= 1
    gamma_opt = K - (1.0 + r) * tau_opt  # (44), not rounded
    if tau_opt < 1.0:
        feasible = False
        notes.append(f"INFEASIBLE: tau_opt = {tau_opt:.6g} < 1")
    if gamma_opt < 1.0:
        feasible = False
        notes.append(f"INFEASIBLE: gamma_opt = K - (1+r)*tau_opt = {gamma_opt:.6g} < 1 (the root lies beyond "
                     f"tau_max = {tau_max}); the closed form omits the gamma = 1 boundary, use mode=robust")
    if not (float(tau_opt).is_integer() and float(gamma_opt).is_integer()):
        notes.append("tau_opt and gamma_opt are real-valued as in the paper, not rounded")
    return Plan(tau=tau_opt, gamma=gamma_opt, objective=j_opt, round_time_s=round_time(inputs, tau_opt, gamma_opt),
                mode="paper", feasible=feasible, notes=tuple(notes), a=a, r=r, K=K, tau_max=tau_max,
                roots=roots)


def max_learning_rate(tau: int, gamma: int, q1: float, q2: float, set_sizes: Sequence[int], L: float) -> float:
    """Largest μ satisfying Theorem 1's conditions (20) and (21) (digest §4.5).

    Each condition reads 1 − A·L²μ² − B′·Lμ >= 0, which holds exactly for
    μ <= (−B′ + √(B′² + 4A)) / (2A·L) (μ <= 1/(L·B′) when A = 0). With M = max_l N_l:

    * (20): A = τγ + τ(τ − 1)/2 + q1(τ + γ)·max_l(1/N_l), B′ = τ + q1/N + q2·q1/N + τ·q2·M/N;
    * (21): A = γ(γ − 1)/2, B′ = γ·(1 + (1 + q2)·q1/N + q2·M/N).

    L is known only for synthetic problems (quadratics); use this in tests and simulations.

    Args:
        tau: intra-set iterations τ >= 1.
        gamma: local steps γ >= 1.
        q1: device→edge quantizer variance factor, >= 0.
        q2: edge→cloud quantizer variance factor, >= 0.
        set_sizes: N_l for every set (each >= 1).
        L: smoothness constant, > 0.

    Returns:
        μ_max = min of the two bounds.

    Raises:
        ValueError: an argument is out of range.
    """
    if tau < 1 or gamma < 1:
        raise ValueError(f"tau and gamma must be >= 1, got tau={tau!r}, gamma={gamma!r}")
    if not (q1 >= 0 and q2 >= 0):
        raise ValueError(f"q1 and q2 must be >= 0, got q1={q1!r}, q2={q2!r}")
    if not set_sizes or min(set_sizes) < 1:
        raise ValueError(f"set_sizes must be non-empty with every N_l >= 1, got {list(set_sizes)!r}")
    if not L > 0:
        raise ValueError(f"L must be > 0, got {L!r}")
    n = float(sum(set_sizes))
    n_max = float(max(set_sizes))
    inv_min = 1.0 / float(min(set_sizes))  # max_l 1/N_l
    a20 = tau * gamma + tau * (tau - 1) / 2.0 + q1 * (tau + gamma) * inv_min
    b20 = tau + q1 / n + q2 * q1 / n + tau * q2 * n_max / n
    a21 = gamma * (gamma - 1) / 2.0
    b21 = gamma * (1.0 + (1.0 + q2) * q1 / n + q2 * n_max / n)
    return min(_quadratic_mu(a20, b20, L), _quadratic_mu(a21, b21, L))


def _quadratic_mu(A: float, B: float, L: float) -> float:
    # Positive root of A·L²μ² + B·Lμ − 1 = 0, written as 2/(B + √(B² + 4A)) / L: identical to
    # (−B + √(B² + 4A))/(2A·L) but without cancellation, and equal to 1/(L·B) at A = 0.
    return 2.0 / (B + math.sqrt(B * B + 4.0 * A)) / L

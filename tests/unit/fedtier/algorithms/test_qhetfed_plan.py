"""fedtier.algorithms.qhetfed_plan: QHetFed's deadline planner, seed paper 003 Sec. IV, eqs. (41)–(49).

The checks are digest §9 check 10 (a)–(f) plus Corollary 1's direction, each against an
independent, slow or hand-written reference rather than the planner's own helpers.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fedtier.algorithms import qhetfed_plan
from fedtier.algorithms.qhetfed_plan import (
    UPLOADS,
    InfeasiblePlanError,
    Plan,
    PlanInputs,
    closed_form_coefficients,
    max_learning_rate,
    min_round_budget,
    objective,
    objective_on_budget,
    plan,
    round_time,
)
from fedtier.errors import ConfigError

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

# --- the §4.4 worked example, computed from Table III exactly ---------------------------------

T_CP = 20 * (100 * 3072 * 8) / 1e9  # c·D/f: 20 cycles/bit, 100 images × 3072 B × 8 bit, 1 GHz
T_DE = 591274 * 32 / (1e6 * math.log2(1 + 1e-8 * 0.5 / 1e-10))  # d_b / (B·log2(1 + h·p/N0))
T_EC = 10 * T_DE
EXAMPLE = PlanInputs(C=3, N=60, q1=11.9, t_cp=T_CP, t_de=T_DE, t_ec=T_EC, round_budget_s=156.0)


# --- independent references -------------------------------------------------------------------


def t_di(inputs: PlanInputs, tau: Any, gamma: Any) -> Any:
    """Eq. (42) written out by hand (the τ + 1 variant charges one more upload); scalars or arrays.

    Same operation order as the planner, so that "fits the budget" is the same float test.
    """
    uploads = tau + 1.0 if inputs.uploads == "tau+1" else tau
    return (tau + gamma) * inputs.t_cp + uploads * inputs.t_de + inputs.t_ec


def j43(a: float, tau: Any, gamma: Any) -> Any:
    """Eq. (43) written out by hand; scalars or arrays."""
    return a * tau * (1 + (gamma - 1) / (tau + gamma)) + gamma * (gamma - 1) / (tau + gamma)


def j45(a: float, r: float, K: float, tau: float) -> float:
    """Eq. (45) written out by hand, m = a − 1 − r."""
    m = a - 1 - r
    return (1 - (1 + tau) / (K - r * tau)) * (m * tau + K) + a * tau


def scan_reference(inputs: PlanInputs) -> tuple[float, int, int]:
    """Slow reference: every τ that fits with γ = 1, and for it the γ that uses the budget fully.

    "Fully" = γ is maximal for its τ: one more local step would exceed the budget. Pairs with
    a smaller γ are excluded on purpose (digest §4.4): J grows with both τ and γ, so over
    all pairs that merely fit, the minimiser is always (1, 1), which leaves the budget idle
    (see ``test_without_maximal_gamma_the_objective_degenerates_to_one_one``).

    Returns:
        (min J, τ, γ) of the first minimiser found.
    """
    a = inputs.C / inputs.N * (1 + inputs.q1)
    best: tuple[float, int, int] | None = None
    tau = 1
    while t_di(inputs, tau, 1) <= inputs.round_budget_s:
        gamma = 1
        while t_di(inputs, tau, gamma + 1) <= inputs.round_budget_s:
            gamma += 1
        j = j43(a, tau, gamma)
        if best is None or j < best[0]:
            best = (j, tau, gamma)
        tau += 1
    assert best is not None
    return best


def grid_reference(inputs: PlanInputs) -> tuple[float, float, int, int]:
    """Dense brute force over ALL integer pairs (τ, γ) in a box that contains every fitting pair.

    Returns:
        (min J over pairs that fit and use the budget fully, min J over all fitting pairs,
        number of fitting pairs, number of fitting pairs with maximal γ).
    """
    a = inputs.C / inputs.N * (1 + inputs.q1)
    # The box: γ <= K and (1 + r)τ <= K − 1 (44), plus a margin; checked below to hold no fitting pair
    # on its far edges, so that it really contains every pair that fits.
    slots = (inputs.round_budget_s - inputs.t_ec) / inputs.t_cp
    tau_side = int(slots / (1 + inputs.t_de / inputs.t_cp)) + 3
    gamma_side = int(slots) + 3
    tau, gamma = np.meshgrid(np.arange(1, tau_side + 1), np.arange(1, gamma_side + 1), indexing="ij")
    fits = t_di(inputs, tau, gamma) <= inputs.round_budget_s
    assert not fits[-1, :].any() and not fits[:, -1].any()
    full = fits & ~(t_di(inputs, tau, gamma + 1) <= inputs.round_budget_s)
    j = j43(a, tau.astype(float), gamma.astype(float))
    return float(j[full].min()), float(j[fits].min()), int(fits.sum()), int(full.sum())


@st.composite
def instances(draw: st.DrawFn, max_extra_slots: float = 3000.0) -> PlanInputs:
    """Feasible random instances: budget = T_di(1, 1) + (0..max_extra_slots)·t_CP."""
    c = draw(st.integers(1, 10))
    n = draw(st.integers(c, 400))
    base = PlanInputs(C=c, N=n, q1=draw(st.floats(0.0, 40.0)), t_cp=draw(st.floats(1e-3, 1.0)),
                      t_de=draw(st.floats(1e-3, 20.0)), t_ec=draw(st.floats(1e-3, 200.0)), round_budget_s=1.0,
                      uploads=draw(st.sampled_from(UPLOADS)))
    extra = draw(st.floats(0.0, max_extra_slots)) * base.t_cp
    return replace(base, round_budget_s=min_round_budget(base) + extra)


# --- (a) (45) equals (43) on the budget line ---------------------------------------------------


@SETTINGS
@given(a=st.floats(1e-3, 50.0), r=st.floats(1e-3, 1e3), tau_hi=st.floats(1.0, 1e3), frac=st.floats(0.0, 1.0))
def test_eq45_equals_eq43_on_the_budget_line(a: float, r: float, tau_hi: float, frac: float) -> None:
    # Prepare: K such that τ_max = tau_hi; any real τ in [1, τ_max] (so γ >= 1).
    K = (1 + r) * tau_hi + 1
    tau = 1 + frac * (tau_hi - 1)
    gamma = K - (1 + r) * tau  # (44)

    # Execute
    along = objective_on_budget(a, r, K, tau)
    direct = objective(a, tau, gamma)

    # Assert: both against each other and against the digest's simplified form (§4.4).
    assert along == pytest.approx(direct, rel=1e-9, abs=0)
    simplified = K - 1 + (2 * a - 2 - r) * tau + (1 - a) * tau * (1 + tau) / (K - r * tau)
    assert along == pytest.approx(simplified, rel=1e-9, abs=1e-9 * K)
    assert direct == pytest.approx(j43(a, tau, gamma), rel=1e-12)


def test_objective_and_eq45_are_undefined_where_tau_plus_gamma_is_not_positive() -> None:
    with pytest.raises(ValueError, match="tau \\+ gamma > 0"):
        objective(0.5, 2.0, -2.0)
    with pytest.raises(ValueError, match="K - r\\*tau > 0"):
        objective_on_budget(0.5, 10.0, 20.0, 2.0)


def test_round_time_is_eq42_and_the_tau_plus_one_variant() -> None:
    assert round_time(EXAMPLE, 36, 16) == pytest.approx(52 * T_CP + 36 * T_DE + T_EC, rel=1e-15)
    plus = replace(EXAMPLE, uploads="tau+1")
    assert round_time(plus, 36, 16) == pytest.approx(52 * T_CP + 37 * T_DE + T_EC, rel=1e-15)
    assert min_round_budget(EXAMPLE) == pytest.approx(2 * T_CP + T_DE + T_EC, rel=1e-15)
    assert min_round_budget(plus) == pytest.approx(2 * T_CP + 2 * T_DE + T_EC, rel=1e-15)


def test_derived_quantities_follow_section_4_3() -> None:
    assert EXAMPLE.a == pytest.approx(3 / 60 * 12.9)
    assert EXAMPLE.r == pytest.approx(T_DE / T_CP)
    assert EXAMPLE.K == pytest.approx(156 / T_CP - T_EC / T_CP)
    # τ + 1 uploads = K shifted by −r (digest §4.1).
    assert replace(EXAMPLE, uploads="tau+1").K == pytest.approx(EXAMPLE.K - EXAMPLE.r)


# --- (b) robust plans are integers >= 1 within the budget -------------------------------------


@SETTINGS
@given(inputs=instances())
def test_robust_returns_integers_within_the_budget(inputs: PlanInputs) -> None:
    p = plan(inputs)

    assert isinstance(p.tau, int) and isinstance(p.gamma, int)
    assert p.tau >= 1 and p.gamma >= 1 and p.feasible and p.mode == "robust"
    assert p.round_time_s == t_di(inputs, p.tau, p.gamma)
    assert p.round_time_s <= inputs.round_budget_s + 1e-9
    assert 1 <= p.tau <= p.tau_max
    # τ_max = ⌊(K − 1)/(1 + r)⌋ up to float rounding of K, and it is the last τ that fits.
    assert abs(p.tau_max - math.floor((inputs.K - 1) / (1 + inputs.r))) <= 1
    assert t_di(inputs, p.tau_max, 1) <= inputs.round_budget_s < t_di(inputs, p.tau_max + 1, 1)
    assert p.objective == j43(inputs.a, p.tau, p.gamma)


def test_budget_exactly_at_the_minimum_gives_one_one() -> None:
    for uploads in UPLOADS:
        inputs = replace(EXAMPLE, uploads=uploads)
        p = plan(replace(inputs, round_budget_s=min_round_budget(inputs)))
        assert (p.tau, p.gamma, p.tau_max) == (1, 1, 1)


# --- (c) robust is never worse than brute force ----------------------------------------------


def _assert_not_worse(p: Plan, inputs: PlanInputs, reference_j: float) -> None:
    assert p.objective <= reference_j + 1e-12 * max(1.0, abs(reference_j))
    assert t_di(inputs, p.tau, p.gamma) <= inputs.round_budget_s
    assert not t_di(inputs, p.tau, p.gamma + 1) <= inputs.round_budget_s  # uses the budget fully


@SETTINGS
@given(inputs=instances(max_extra_slots=250.0))
def test_robust_matches_the_slow_scan_reference(inputs: PlanInputs) -> None:
    p = plan(inputs)
    ref_j, _, _ = scan_reference(inputs)
    _assert_not_worse(p, inputs, ref_j)
    assert p.objective == pytest.approx(ref_j, rel=1e-12, abs=1e-12)


@SETTINGS
@given(inputs=instances(max_extra_slots=250.0))
def test_robust_matches_a_dense_grid_over_all_pairs_restricted_to_maximal_gamma(inputs: PlanInputs) -> None:
    p = plan(inputs)
    full_min, _, n_fit, n_full = grid_reference(inputs)
    _assert_not_worse(p, inputs, full_min)
    assert n_full == p.tau_max  # one maximal γ per feasible τ
    assert n_fit >= n_full


def test_without_maximal_gamma_the_objective_degenerates_to_one_one() -> None:
    # Why the references only use pairs with maximal γ (digest §4.4): J grows with τ and with
    # γ, so over every pair that merely fits, (1, 1) wins and most of the budget is idle.
    small = replace(EXAMPLE, t_cp=1.0, t_de=2.0, t_ec=5.0, round_budget_s=60.0)
    _, fit_min, _, _ = grid_reference(small)
    assert fit_min == j43(small.a, 1, 1)
    assert plan(small).objective > fit_min
    # The digest's numbers: J(36, 1) = 23.2 < J(36, 16) = 34.5, but (36, 1) leaves 16 steps unused.
    assert objective(EXAMPLE.a, 36, 1) == pytest.approx(23.22)
    assert objective(EXAMPLE.a, 36, 16) == pytest.approx(34.533, abs=1e-3)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(inputs=instances(), chunk=st.integers(1, 9))
def test_the_search_gives_the_same_plan_when_split_in_chunks(inputs: PlanInputs, chunk: int) -> None:
    whole = plan(inputs)
    with mock.patch.object(qhetfed_plan, "_CHUNK", chunk):
        assert plan(inputs) == whole


def test_a_large_search_spanning_several_chunks() -> None:
    inputs = PlanInputs(C=2, N=100, q1=3.0, t_cp=1e-3, t_de=1e-3, t_ec=1.0, round_budget_s=5001.0)
    p = plan(inputs)
    assert p.tau_max > 2 * qhetfed_plan._CHUNK
    assert p.tau == p.tau_max and p.gamma >= 1  # a = 0.08 <= 1
    assert p.round_time_s <= inputs.round_budget_s


# --- (d) a <= 1: the largest feasible τ --------------------------------------------------------


@SETTINGS
@given(inputs=instances(), frac=st.floats(0.0, 1.0))
def test_a_at_most_one_gives_the_largest_feasible_tau(inputs: PlanInputs, frac: float) -> None:
    # q1 <= N/C − 1  <=>  a = (C/N)(1 + q1) <= 1 (Corollary 1's threshold).
    inputs = replace(inputs, q1=frac * (inputs.N / inputs.C - 1))
    assume(inputs.a <= 1)

    p = plan(inputs)

    assert p.tau == p.tau_max
    assert any("largest feasible tau" in note for note in p.notes)


@pytest.mark.parametrize("uploads", UPLOADS)
def test_a_exactly_one_has_ties_and_still_picks_the_largest_tau(uploads: str) -> None:
    # At a = 1, J = τ + γ − 1 exactly: pairs with equal τ + γ tie, and the larger τ wins.
    inputs = PlanInputs(C=3, N=60, q1=19.0, t_cp=1.0, t_de=0.01, t_ec=1.0, round_budget_s=11.5, uploads=uploads)
    p = plan(inputs)
    assert p.tau == p.tau_max
    assert p.objective == pytest.approx(p.tau + p.gamma - 1, rel=1e-12)


# --- (e) the §4.4 worked example ---------------------------------------------------------------


def test_worked_example_robust_gives_36_16() -> None:
    p = plan(EXAMPLE)

    assert (p.tau, p.gamma) == (36, 16)
    assert p.round_time_s <= 156.0
    assert p.round_time_s == pytest.approx(155.99, abs=0.005)
    assert p.objective == pytest.approx(34.5, abs=0.05)
    assert (p.a, p.tau_max) == (pytest.approx(0.645), 36)
    assert p.r == pytest.approx(67.86, abs=0.005)
    assert p.K == pytest.approx(2495.2, abs=0.05)
    # τ = 1 would give γ = 2426 and J ≈ 2425 (digest §4.4).
    assert objective(p.a, 1, math.floor(p.K - (1 + p.r))) == pytest.approx(2425, abs=1)


def test_worked_example_paper_mode_reports_the_infeasible_roots() -> None:
    p = plan(EXAMPLE, mode="paper")

    assert p.roots == (pytest.approx(36.44, abs=0.01), pytest.approx(37.09, abs=0.01))
    assert "36.44" in p.notes[0] and "37.09" in p.notes[0]
    assert p.feasible is False
    assert p.gamma < 1
    assert any("INFEASIBLE" in note and "gamma_opt" in note and "< 1" in note for note in p.notes)
    # γ at the roots: −14.4 and −59.2; 37.09 has τ + γ < 0, where (45) is undefined, so 36.44 is chosen.
    assert p.tau == pytest.approx(36.44, abs=0.01)
    assert p.gamma == pytest.approx(-14.4, abs=0.05)
    assert p.round_time_s == pytest.approx(156.0, rel=1e-12)  # the real-valued plan spends the budget exactly


# --- (f) paper mode is the closed form --------------------------------------------------------


@SETTINGS
@given(inputs=instances())
def test_paper_mode_is_the_argmin_over_one_and_the_real_roots(inputs: PlanInputs) -> None:
    # Prepare: (47)–(49) and the roots, recomputed here with numpy.roots.
    a, r, K = inputs.a, inputs.r, inputs.K
    m = a - 1 - r
    coeffs = (m * (r**2 + r) + a * r**2, -2 * K * (1 + r) * m - 2 * a * K * r, m * (K**2 - K) - K * (K + r) + a * K**2)
    disc = coeffs[1] ** 2 - 4 * coeffs[0] * coeffs[2]
    assume(abs(disc) > 1e-9 * coeffs[1] ** 2)  # a double root's real/complex verdict is rounding noise
    raw = np.roots(coeffs)
    real = sorted(float(x.real) for x in np.atleast_1d(raw) if abs(x.imag) <= 1e-9 * max(1.0, abs(x)))
    candidates = [t for t in [1.0, *real] if K - r * t > 0]
    j_best = min(j45(a, r, K, t) for t in candidates)

    # Execute
    p = plan(inputs, mode="paper")

    # Assert
    assert closed_form_coefficients(a, r, K) == pytest.approx(coeffs, rel=1e-12)
    assert p.roots == pytest.approx(real, rel=1e-6, abs=1e-9)
    assert any(p.tau == pytest.approx(t, rel=1e-6, abs=1e-9) for t in candidates)
    assert j45(a, r, K, p.tau) == pytest.approx(j_best, rel=1e-9, abs=1e-9)
    assert p.objective == pytest.approx(j_best, rel=1e-9, abs=1e-9)
    assert p.gamma == pytest.approx(K - (1 + r) * p.tau, rel=1e-12, abs=1e-9)  # (44), not rounded
    assert p.feasible == (bool(real) and p.tau >= 1 and p.gamma >= 1)
    if not real:
        assert any("complex" in note for note in p.notes)
    if p.gamma < 1:
        assert any("INFEASIBLE" in note for note in p.notes)


def test_paper_mode_with_complex_roots_falls_back_to_tau_one_and_is_flagged() -> None:
    p = plan(replace(EXAMPLE, N=6), mode="paper")  # a = 6.45
    assert p.roots == ()
    assert p.tau == 1.0 and p.feasible is False
    assert any("complex roots" in note for note in p.notes)


# --- (g) Corollary 1: the direction at fixed τ + γ ---------------------------------------------


@SETTINGS
@given(c=st.integers(1, 10), n_extra=st.integers(1, 300), q1=st.floats(0.0, 60.0), s=st.integers(3, 500),
       frac=st.floats(0.0, 1.0))
def test_corollary_1_direction_at_fixed_tau_plus_gamma(c: int, n_extra: int, q1: float, s: int, frac: float) -> None:
    n = c + n_extra
    threshold = n / c - 1
    assume(abs(q1 - threshold) > 1e-4 * max(1.0, threshold))
    a = c / n * (1 + q1)
    tau = 1 + int(frac * (s - 3))  # τ and τ + 1 both leave γ >= 1 at τ + γ = s

    here, shifted = objective(a, tau, s - tau), objective(a, tau + 1, s - tau - 1)

    if q1 < threshold:
        assert shifted < here  # larger τ preferred
    else:
        assert shifted > here  # smaller τ preferred
    # Exact step from errata §10: J(τ+1) − J(τ) = 2(a − 1)(s − τ − 1)/s.
    assert shifted - here == pytest.approx(2 * (a - 1) * (s - tau - 1) / s, rel=1e-6, abs=1e-9)


# --- validation and infeasible budgets --------------------------------------------------------

GOOD: dict[str, Any] = {"C": 3, "N": 60, "q1": 11.9, "t_cp": 0.05, "t_de": 3.3, "t_ec": 33.0, "round_budget_s": 156.0}


@pytest.mark.parametrize(("field", "value"), [
    ("C", 0), ("C", 1.5), ("C", True), ("N", 2), ("N", 3.0), ("q1", -0.1), ("q1", math.nan),
    ("t_cp", 0.0), ("t_cp", -1.0), ("t_de", 0.0), ("t_de", math.nan), ("t_ec", -2.0), ("t_ec", math.inf),
    ("round_budget_s", 0.0), ("round_budget_s", math.inf), ("uploads", "tau+2"),
])
def test_invalid_inputs_raise_config_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        PlanInputs(**{**GOOD, field: value})
    assert info.value.key == field
    assert field in str(info.value)


def test_a_budget_with_too_many_slots_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        PlanInputs(**{**GOOD, "t_cp": 1e-7})
    assert info.value.key == "round_budget_s"


def test_unknown_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        plan(EXAMPLE, mode="fast")
    assert info.value.key == "mode"


@pytest.mark.parametrize("mode", ["robust", "paper"])
@pytest.mark.parametrize("uploads", UPLOADS)
def test_a_budget_below_one_step_raises_with_the_minimum_budget(mode: str, uploads: str) -> None:
    inputs = replace(EXAMPLE, uploads=uploads)
    need = min_round_budget(inputs)
    with pytest.raises(InfeasiblePlanError) as info:
        plan(replace(inputs, round_budget_s=need * (1 - 1e-9)), mode=mode)
    assert info.value.min_budget_s == need
    assert f"{need:.6g}" in str(info.value)
    assert "minimum budget" in str(info.value) and "gradient step" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_to_json_is_plain_data() -> None:
    doc = plan(EXAMPLE, mode="paper").to_json()
    assert doc["mode"] == "paper" and doc["feasible"] is False
    assert isinstance(doc["notes"], list) and isinstance(doc["roots"], list)
    assert set(doc) == {"tau", "gamma", "objective", "round_time_s", "mode", "feasible", "notes", "a", "r", "K",
                        "tau_max", "roots"}


# --- §4.5 learning-rate helper -----------------------------------------------------------------


@SETTINGS
@given(tau=st.integers(1, 40), gamma=st.integers(1, 40), q1=st.floats(0.0, 20.0), q2=st.floats(0.0, 5.0),
       sizes=st.lists(st.integers(1, 50), min_size=1, max_size=6), L=st.floats(0.01, 100.0))
def test_max_learning_rate_is_the_smaller_root_of_conditions_20_and_21(
        tau: int, gamma: int, q1: float, q2: float, sizes: list[int], L: float) -> None:
    n, n_max, inv_min = sum(sizes), max(sizes), max(1 / x for x in sizes)
    conds = [
        (tau * gamma + tau * (tau - 1) / 2 + q1 * (tau + gamma) * inv_min,  # (20)
         tau + q1 / n + q2 * q1 / n + tau * q2 * n_max / n),
        (gamma * (gamma - 1) / 2, gamma * (1 + (1 + q2) * q1 / n + q2 * n_max / n)),  # (21)
    ]
    # The formula as written in digest §4.5.
    bounds = [(-B + math.sqrt(B * B + 4 * A)) / (2 * A * L) if A > 0 else 1 / (L * B) for A, B in conds]

    mu = max_learning_rate(tau, gamma, q1, q2, sizes, L)

    assert mu == pytest.approx(min(bounds), rel=1e-6)
    for A, B in conds:  # both conditions hold at μ_max, the binding one with equality
        assert 1 - A * L**2 * mu**2 - B * L * mu >= -1e-9
    assert min(1 - A * L**2 * mu**2 - B * L * mu for A, B in conds) == pytest.approx(0.0, abs=1e-9)


def test_max_learning_rate_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        max_learning_rate(0, 1, 0.0, 0.0, [5], 1.0)
    with pytest.raises(ValueError):
        max_learning_rate(1, 1, 0.0, 0.0, [], 1.0)
    with pytest.raises(ValueError):
        max_learning_rate(1, 1, 0.0, 0.0, [5], 0.0)

"""Tests of the M2FDP privacy accountant against the digest's reference values (seed 004, §3.4, §3.5, §8 check 7).

References were computed with Google dp_accounting 0.6.0 (RDP) and the analytic Gaussian mechanism (exact).
Tolerances are the digest's: 1% relative on every reference, and the RDP epsilon must never be below the exact one.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from cloud_coordinator.privacy.accountant import (
    ORDERS,
    Accountant,
    AccountingError,
    classical_gaussian_multiplier,
    epsilon,
    exact_gaussian_epsilon,
    noise_multiplier_for,
    paper_noise_multiplier,
)

DELTA = 1e-5
REL = 0.01  # digest §8 check 7: "within 1%"

# (z, n, delta, RDP reference, exact reference)
GAUSSIAN_REFS = [
    (1.0, 1, 1e-5, 4.7285, 4.3772),
    (5.0, 1, 1e-5, 0.7945, 0.7255),
    (10.0, 100, 1e-5, 4.7285, 4.3772),
    (50.0, 200, 1e-5, 1.1582, 1.0608),
    (20.0, 50, 1e-5, 1.4781, 1.3565),
    (2.0, 10, 1e-6, 8.8469, 8.3062),
]

# (q, z, n, RDP reference, PLD reference): subsampled Gaussian, delta 1e-5
POISSON_REFS = [
    (256 / 60000, 1.1, 14062, 2.5966, 2.3817),
    (0.01, 1.0, 10000, 6.7128, 6.1877),
    (0.05, 2.0, 1000, 4.0244, 3.6997),
    (0.1, 4.0, 200, 1.5568, 1.4217),
]

# digest §3.5 table: z* for (target epsilon, releases), no subsampling, delta 1e-5
INVERSE_REFS = [
    (1.0, 1, 4.0454),
    (1.0, 40, 25.5853),
    (1.0, 200, 57.2104),
    (4.0, 1, 1.1576),
    (4.0, 40, 7.3211),
    (4.0, 200, 16.3705),
]


def _gaussian_delta(eps: float, mu: float) -> float:
    """The privacy profile written independently of the module (plain erfc), to check its root."""

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2.0))

    return phi(-eps / mu + mu / 2.0) - math.exp(eps) * phi(-eps / mu - mu / 2.0)


# ---------------------------------------------------------------------------------------------------- ORDERS


def test_orders_are_dp_accountings_defaults() -> None:
    # Issue 17 A5: the grid is the library's own default (1.1..10.9, 11..63, 128..1024), not a hand-written
    # copy that had dropped 11 and 1024 (a missing order can only raise epsilon, never make it unsound).
    from dp_accounting.rdp import rdp_privacy_accountant

    assert ORDERS == tuple(float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
    assert 11.0 in ORDERS and ORDERS[-1] == 1024.0
    assert list(ORDERS) == sorted(set(ORDERS))
    assert all(isinstance(a, float) for a in ORDERS)


def test_epsilon_is_the_default_accountants() -> None:
    # Same composition through dp-accounting's RdpAccountant with no orders given: bit for bit.
    import dp_accounting
    from dp_accounting import rdp

    # z = 2.4: order 11 is the best one; z = 400: order 1024 is (the old grid gave 0.03 % resp. 49 % more).
    for z, n, delta in ((1.0, 1, 1e-5), (0.6, 1000, 1e-6), (2.4, 1, 1e-5), (400.0, 1, 1e-5)):
        reference = rdp.RdpAccountant()
        reference.compose(dp_accounting.GaussianDpEvent(z), n)
        assert epsilon([(z, n)], delta) == float(reference.get_epsilon(delta))


# ---------------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize(("z", "n", "delta", "rdp_ref", "exact_ref"), GAUSSIAN_REFS)
def test_gaussian_epsilon_matches_reference_and_is_sound(
    z: float, n: int, delta: float, rdp_ref: float, exact_ref: float
) -> None:
    rdp_eps = epsilon([(z, n)], delta)
    exact = exact_gaussian_epsilon(z, n, delta)
    assert rdp_eps == pytest.approx(rdp_ref, rel=REL)
    assert exact == pytest.approx(exact_ref, rel=REL)
    assert rdp_eps >= exact  # soundness: RDP may be loose, never optimistic
    assert isinstance(rdp_eps, float)


@pytest.mark.parametrize(("z", "n", "delta", "rdp_ref", "exact_ref"), GAUSSIAN_REFS)
def test_exact_epsilon_solves_the_privacy_profile(
    z: float, n: int, delta: float, rdp_ref: float, exact_ref: float
) -> None:
    eps = exact_gaussian_epsilon(z, n, delta)
    mu = math.sqrt(n) / z
    assert _gaussian_delta(eps, mu) == pytest.approx(delta, rel=1e-6)
    # and it is the smallest such eps: the profile is strictly above delta just below it
    assert _gaussian_delta(eps * (1 - 1e-4), mu) > delta


@pytest.mark.parametrize(("q", "z", "n", "rdp_ref", "pld_ref"), POISSON_REFS)
def test_poisson_subsampled_epsilon_matches_reference(
    q: float, z: float, n: int, rdp_ref: float, pld_ref: float
) -> None:
    eps = epsilon([(z, n)], DELTA, sampling_rate=q)
    assert eps == pytest.approx(rdp_ref, rel=REL)
    assert eps >= pld_ref  # never below the tight (PLD) accounting of the same mechanism
    assert eps < epsilon([(z, n)], DELTA)  # amplification helps; never hurts


def test_sampling_rate_one_is_plain_gaussian() -> None:
    assert epsilon([(3.0, 7)], DELTA, sampling_rate=1.0) == epsilon([(3.0, 7)], DELTA)


@pytest.mark.parametrize(("z", "n"), [(10.0, 100), (50.0, 200), (20.0, 50), (3.0, 7)])
def test_n_fold_composition_equals_single_release_with_scaled_z(z: float, n: int) -> None:
    assert epsilon([(z, n)], DELTA) == pytest.approx(epsilon([(z / math.sqrt(n), 1)], DELTA), rel=1e-9)
    assert exact_gaussian_epsilon(z, n, DELTA) == pytest.approx(exact_gaussian_epsilon(z / math.sqrt(n), 1, DELTA),
                                                                rel=1e-9)


def test_mixed_z_compose_like_one_gaussian() -> None:
    # Gaussian RDP adds a/(2 z^2) per release, so z1 and z2 together equal one release at 1/sqrt(1/z1^2 + 1/z2^2).
    z1, z2 = 3.0, 4.0
    both = epsilon([(z1, 1), (z2, 1)], DELTA)
    assert both == pytest.approx(epsilon([(1 / math.sqrt(z1**-2 + z2**-2), 1)], DELTA), rel=1e-9)
    assert both > epsilon([(z1, 1)], DELTA)
    assert both > epsilon([(z2, 1)], DELTA)


def test_release_grouping_and_order_do_not_matter() -> None:
    ref = epsilon([(7.0, 3), (2.5, 2)], DELTA)
    assert epsilon([(2.5, 1), (7.0, 1), (2.5, 1), (7.0, 2)], DELTA) == pytest.approx(ref, rel=1e-12)
    assert epsilon(iter([(2.5, 2), (7.0, 3)]), DELTA) == pytest.approx(ref, rel=1e-12)  # any iterable


def test_epsilon_grows_with_releases_and_shrinks_with_z() -> None:
    assert epsilon([(10.0, 10)], DELTA) < epsilon([(10.0, 20)], DELTA)
    assert epsilon([(10.0, 10)], DELTA) > epsilon([(20.0, 10)], DELTA)
    assert epsilon([(10.0, 10)], 1e-3) < epsilon([(10.0, 10)], 1e-7)


def test_degenerate_releases() -> None:
    assert epsilon([], DELTA) == 0.0
    assert isinstance(epsilon([], DELTA), float)
    assert epsilon([(1.0, 0)], DELTA) == 0.0
    assert epsilon([(0.0, 0)], DELTA) == 0.0  # an un-noised release that never happened costs nothing
    assert epsilon([(math.inf, 5)], DELTA) == 0.0
    assert epsilon([(math.inf, 5)], DELTA, sampling_rate=0.1) == 0.0
    assert epsilon([(math.inf, 5), (2.0, 3), (4.0, 0)], DELTA) == epsilon([(2.0, 3)], DELTA)
    assert epsilon([(0.0, 1)], DELTA) == math.inf
    assert epsilon([(0.0, 1), (5.0, 3)], DELTA, sampling_rate=0.5) == math.inf
    assert exact_gaussian_epsilon(math.inf, 3, DELTA) == 0.0
    assert exact_gaussian_epsilon(1.0, 0, DELTA) == 0.0
    assert exact_gaussian_epsilon(0.0, 1, DELTA) == math.inf


# ---------------------------------------------------------------------------------------------------- inverse


@pytest.mark.parametrize(("target", "n", "z_ref"), INVERSE_REFS)
def test_noise_multiplier_for_matches_table_and_never_overshoots(target: float, n: int, z_ref: float) -> None:
    z = noise_multiplier_for(target, DELTA, n)
    assert z == pytest.approx(z_ref, rel=REL)
    assert epsilon([(z, n)], DELTA) <= target  # calibrated noise must meet the budget
    # and it is the smallest such z to relative 1e-6: slightly less noise already exceeds the target
    assert epsilon([(z / (1 + 2e-6), n)], DELTA) > target


def test_noise_multiplier_for_with_subsampling_inverts_forward() -> None:
    q, z_ref, n, eps_ref = 0.05, 2.0, 1000, 4.0244
    z = noise_multiplier_for(eps_ref, DELTA, n, sampling_rate=q)
    assert z == pytest.approx(z_ref, rel=REL)
    assert epsilon([(z, n)], DELTA, sampling_rate=q) <= eps_ref
    assert z < noise_multiplier_for(eps_ref, DELTA, n)  # amplification means less noise is needed


def test_noise_multiplier_for_bracket_floor() -> None:
    # A huge budget is met by any z in the bracket: the floor 1e-4 comes back, and it does fit.
    z = noise_multiplier_for(1e9, DELTA, 1)
    assert z == pytest.approx(1e-4)
    assert epsilon([(z, 1)], DELTA) <= 1e9


def test_noise_multiplier_for_unreachable() -> None:
    # 1e15 releases: even z = 1e6 leaves mu = sqrt(1e15)/1e6 ~ 32, far above epsilon 1
    with pytest.raises(AccountingError, match="unreachable"):
        noise_multiplier_for(1.0, DELTA, 10**15)


# ---------------------------------------------------------------------------------------------------- closed forms


def test_classical_gaussian_multiplier() -> None:
    assert classical_gaussian_multiplier(1e-5) == pytest.approx(4.844805, abs=1e-6)
    assert classical_gaussian_multiplier(1e-5) == math.sqrt(2 * math.log(1.25e5))
    # at epsilon = 1 (its validity edge) the classical z is conservative against the exact mechanism
    assert exact_gaussian_epsilon(classical_gaussian_multiplier(1e-5), 1, 1e-5) < 1.0


def test_paper_noise_multiplier_worked_example() -> None:
    # digest §3.4: alpha 1, q 0.05, K 20, T 100, eps 1, delta 1e-5, Delta_2 = 2*eta*K*G = 0.4 -> sigma_2 = 3.034854
    z = paper_noise_multiplier(alpha=1.0, sampling_rate=0.05, steps_per_round=20, rounds=100, epsilon=1.0, delta=1e-5)
    assert z * 0.4 == pytest.approx(3.034854, abs=1e-6)
    assert z == pytest.approx(0.05 * 151.742713 / 1.0, rel=1e-8)
    # scaling laws of eq. (11): linear in alpha and q, 1/epsilon, sqrt(K*T)
    base: dict[str, Any] = dict(alpha=1.0, sampling_rate=0.05, steps_per_round=20, rounds=100, epsilon=1.0, delta=1e-5)
    assert paper_noise_multiplier(**{**base, "alpha": 2.0}) == pytest.approx(2 * z)
    assert paper_noise_multiplier(**{**base, "epsilon": 4.0}) == pytest.approx(z / 4)
    assert paper_noise_multiplier(**{**base, "rounds": 400}) == pytest.approx(2 * z)


# ---------------------------------------------------------------------------------------------------- Accountant


def test_accountant_agrees_with_epsilon() -> None:
    acc = Accountant(DELTA)
    acc.add(["a", "b"], 10.0, 100)
    acc.add(["a"], 5.0)
    acc.add(["a"], 10.0, 20)
    assert acc.releases("a") == [(5.0, 1), (10.0, 120)]
    assert acc.releases("b") == [(10.0, 100)]
    assert acc.epsilon("a") == epsilon([(5.0, 1), (10.0, 120)], DELTA)
    assert acc.epsilon("b") == pytest.approx(4.7285, rel=REL)  # the (10, 100) reference
    assert acc.epsilons() == {"a": acc.epsilon("a"), "b": acc.epsilon("b")}
    assert acc.delta == DELTA
    assert acc.sampling_rate == 1.0


def test_accountant_unknown_device() -> None:
    acc = Accountant(DELTA)
    assert acc.epsilon("nobody") == 0.0
    assert acc.releases("nobody") == []
    assert acc.epsilons() == {}
    assert acc.epsilon_with("nobody", [(5.0, 1)]) == epsilon([(5.0, 1)], DELTA)
    assert acc.epsilons() == {}  # a what-if query does not register the device


def test_accountant_devices_are_independent() -> None:
    acc = Accountant(DELTA)
    acc.add(["a"], 5.0, 3)
    before = acc.epsilon("a")
    acc.add(["b", "c"], 1.0, 10)
    assert acc.epsilon("a") == before
    assert acc.releases("a") == [(5.0, 3)]
    assert acc.epsilon("b") == acc.epsilon("c") == epsilon([(1.0, 10)], DELTA)


def test_accountant_mixing_z_composes() -> None:
    acc = Accountant(DELTA)
    acc.add(["d"], 4.0, 10)
    acc.add(["d"], 8.0, 30)
    both = acc.epsilon("d")
    assert both == epsilon([(4.0, 10), (8.0, 30)], DELTA)
    assert both > epsilon([(4.0, 10)], DELTA)
    assert both > epsilon([(8.0, 30)], DELTA)


def test_accountant_epsilon_with_does_not_mutate() -> None:
    acc = Accountant(DELTA)
    acc.add(["a"], 10.0, 50)
    before_eps, before_rel = acc.epsilon("a"), acc.releases("a")
    what_if = acc.epsilon_with("a", [(10.0, 50), (3.0, 1)])
    assert what_if == pytest.approx(epsilon([(10.0, 100), (3.0, 1)], DELTA), rel=1e-12)
    assert what_if > before_eps
    assert acc.epsilon("a") == before_eps
    assert acc.releases("a") == before_rel
    assert acc.epsilon_with("a", []) == before_eps


def test_accountant_edge_cases_of_add() -> None:
    acc = Accountant(DELTA)
    acc.add(["a", "a"], 5.0)  # listed twice, protected once
    assert acc.releases("a") == [(5.0, 1)]
    acc.add(["z"], 5.0, 0)  # seen, but nothing released
    assert acc.releases("z") == []
    assert acc.epsilons()["z"] == 0.0
    acc.add(["n"], math.inf, 4)  # a release of nothing: recorded, costs nothing
    assert acc.releases("n") == [(math.inf, 4)]
    assert acc.epsilon("n") == 0.0
    acc.add(iter(("g1", "g2")), 2.0)  # any iterable of ids
    assert acc.releases("g2") == [(2.0, 1)]


def test_accountant_with_subsampling() -> None:
    acc = Accountant(DELTA, sampling_rate=0.05)
    acc.add(["d1", "d2"], 2.0, 1000)
    assert acc.epsilon("d1") == pytest.approx(4.0244, rel=REL)
    assert acc.epsilons() == {"d1": acc.epsilon("d1"), "d2": acc.epsilon("d1")}


# ---------------------------------------------------------------------------------------------------- errors


def test_accounting_error_is_value_error() -> None:
    assert issubclass(AccountingError, ValueError)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 1.5, math.nan])
def test_bad_delta(delta: float) -> None:
    for call in (
        lambda: epsilon([(1.0, 1)], delta),
        lambda: noise_multiplier_for(1.0, delta, 1),
        lambda: classical_gaussian_multiplier(delta),
        lambda: exact_gaussian_epsilon(1.0, 1, delta),
        lambda: paper_noise_multiplier(alpha=1, sampling_rate=0.1, steps_per_round=1, rounds=1, epsilon=1, delta=delta),
        lambda: Accountant(delta),
    ):
        with pytest.raises(AccountingError, match="delta"):
            call()


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, math.nan])
def test_bad_sampling_rate(q: float) -> None:
    for call in (
        lambda: epsilon([(1.0, 1)], DELTA, q),
        lambda: noise_multiplier_for(1.0, DELTA, 1, q),
        lambda: paper_noise_multiplier(alpha=1, sampling_rate=q, steps_per_round=1, rounds=1, epsilon=1, delta=DELTA),
        lambda: Accountant(DELTA, q),
    ):
        with pytest.raises(AccountingError, match="sampling_rate"):
            call()


@pytest.mark.parametrize("z", [-1.0, -math.inf, math.nan])
def test_bad_z(z: float) -> None:
    acc = Accountant(DELTA)
    for call in (
        lambda: epsilon([(2.0, 1), (z, 1)], DELTA),
        lambda: exact_gaussian_epsilon(z, 1, DELTA),
        lambda: acc.add(["a"], z),
        lambda: acc.epsilon_with("a", [(z, 1)]),
    ):
        with pytest.raises(AccountingError, match="z must be"):
            call()
    assert acc.epsilons() == {}  # a rejected add leaves no trace


@pytest.mark.parametrize("count", [-1, 1.5])
def test_bad_count(count: int) -> None:
    acc = Accountant(DELTA)
    for call in (
        lambda: epsilon([(2.0, count)], DELTA),
        lambda: exact_gaussian_epsilon(2.0, count, DELTA),
        lambda: acc.add(["a"], 2.0, count),
    ):
        with pytest.raises(AccountingError, match="count"):
            call()
    assert acc.epsilons() == {}


@pytest.mark.parametrize("target", [0.0, -1.0, math.nan])
def test_bad_target_epsilon(target: float) -> None:
    with pytest.raises(AccountingError, match="target_epsilon"):
        noise_multiplier_for(target, DELTA, 10)


@pytest.mark.parametrize("eps", [0.0, -1.0, math.nan])
def test_bad_paper_epsilon(eps: float) -> None:
    with pytest.raises(AccountingError, match="epsilon"):
        paper_noise_multiplier(alpha=1, sampling_rate=0.1, steps_per_round=1, rounds=1, epsilon=eps, delta=DELTA)


def test_bad_release_counts_and_paper_arguments() -> None:
    for releases in (0, -3):
        with pytest.raises(AccountingError, match="releases"):
            noise_multiplier_for(1.0, DELTA, releases)
    base: dict[str, Any] = dict(alpha=1.0, sampling_rate=0.1, steps_per_round=20, rounds=100, epsilon=1.0, delta=DELTA)
    for name, bad in (("alpha", 0.0), ("alpha", -1.0), ("steps_per_round", 0), ("rounds", 0), ("rounds", -1)):
        with pytest.raises(AccountingError, match=name):
            paper_noise_multiplier(**{**base, name: bad})


def test_bad_release_shape_and_devices() -> None:
    with pytest.raises(AccountingError, match="releases"):
        epsilon([(1.0,)], DELTA)  # type: ignore[list-item]
    acc = Accountant(DELTA)
    with pytest.raises(AccountingError, match="devices"):
        acc.add("dev-1", 1.0)  # a bare str would be iterated as 'd', 'e', 'v', ...
    with pytest.raises(AccountingError, match="devices"):
        acc.add(["ok", 7], 1.0)  # type: ignore[list-item]
    assert acc.epsilons() == {}

"""Privacy amplification by sampling in the accountant: RDP and PLD against dp-accounting itself.

Acceptance of issue 17 Part B: on random (z, n, q, delta) vectors the accountant's epsilon is within 1 % of
dp-accounting's RDP and PLD accountants composed by hand, and the inverse (noise for a target epsilon) returns z
within 1 %.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp

from cloud_coordinator.privacy.accountant import (
    Accountant,
    AccountingError,
    epsilon,
    noise_multiplier_for,
)


def _vectors(count: int, seed: int) -> list[tuple[float, int, float, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        z = float(rng.uniform(0.6, 4.0))
        n = int(rng.integers(5, 300))
        q = float(rng.choice([0.01, 0.05, 0.1, 0.3, 0.7]) * rng.uniform(0.8, 1.2))
        delta = float(10 ** rng.uniform(-8, -4))
        out.append((z, n, q, delta))
    return out


def _reference(z: float, n: int, q: float, delta: float, kind: str) -> float:
    acc = pld.PLDAccountant() if kind == "pld" else rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), n)
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize("kind,count", [("rdp", 12), ("pld", 6)])
def test_sampled_epsilon_matches_dp_accounting(kind: str, count: int) -> None:
    for z, n, q, delta in _vectors(count, seed=17 if kind == "rdp" else 18):
        ref = _reference(z, n, q, delta, kind)
        got = epsilon([(z, n, q)], delta, accounting=kind)
        assert got == pytest.approx(ref, rel=0.01), (z, n, q, delta)
        # the accountant-wide rate is the same thing
        assert epsilon([(z, n)], delta, sampling_rate=q, accounting=kind) == pytest.approx(ref, rel=0.01)


@pytest.mark.parametrize("kind,count", [("rdp", 6), ("pld", 2)])
def test_inverse_recovers_the_noise_within_one_percent(kind: str, count: int) -> None:
    for z, n, q, delta in _vectors(count, seed=27 if kind == "rdp" else 28):
        target = _reference(z, n, q, delta, kind)
        found = noise_multiplier_for(target, delta, n, sampling_rate=q, accounting=kind)
        assert found == pytest.approx(z, rel=0.01), (z, n, q, delta)
        # never less noise than the target allows
        assert epsilon([(found, n, q)], delta, accounting=kind) <= target * (1 + 1e-12)


def test_pld_is_tighter_than_rdp_and_sampling_amplifies() -> None:
    z, n, delta = 1.0, 100, 1e-6
    full_rdp = epsilon([(z, n)], delta)
    sampled_rdp = epsilon([(z, n, 0.1)], delta)
    sampled_pld = epsilon([(z, n, 0.1)], delta, accounting="pld")
    assert sampled_rdp < full_rdp / 3  # amplification: far less than 10x fewer releases would give
    assert sampled_pld < sampled_rdp


def test_fixed_size_sampling_is_rdp_replace_one() -> None:
    z, n, delta = 1.2, 50, 1e-6
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(100, 10, dp_accounting.GaussianDpEvent(z)), n)
    assert epsilon([(z, n, 0.1, 100)], delta) == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    z_back = noise_multiplier_for(float(acc.get_epsilon(delta)), delta, n, sampling_rate=0.1, population=100)
    assert z_back == pytest.approx(z, rel=0.01)
    # sampling everyone is no sampling
    assert epsilon([(z, n, 1.0, 100)], delta) == epsilon([(z, n)], delta)
    with pytest.raises(AccountingError, match="PLD"):
        epsilon([(z, n, 0.1, 100)], delta, accounting="pld")
    with pytest.raises(AccountingError, match="Poisson and fixed-size"):
        epsilon([(z, n, 0.1, 100), (z, n, 0.1)], delta)
    with pytest.raises(AccountingError, match="fixed-size sample"):
        epsilon([(z, n, 0.001, 100)], delta)


def test_accountant_keeps_per_release_sampling() -> None:
    acc = Accountant(1e-6, accounting="pld")
    acc.add(["a", "b"], 1.0, 20, sampling_rate=0.1)
    acc.add(["b"], 3.0, 2)
    assert acc.releases("a") == [(1.0, 20, 0.1)]
    assert acc.releases("b") == [(1.0, 20, 0.1), (3.0, 2)]
    assert acc.epsilon("a") == pytest.approx(epsilon([(1.0, 20, 0.1)], 1e-6, accounting="pld"))
    assert acc.epsilons()["b"] > acc.epsilons()["a"]
    assert acc.epsilon_with("a", [(1.0, 20, 0.1)]) == pytest.approx(
        epsilon([(1.0, 40, 0.1)], 1e-6, accounting="pld"))
    with pytest.raises(AccountingError, match="accounting"):
        Accountant(1e-6, accounting="gdp")
    with pytest.raises(AccountingError, match="sampling_rate"):
        acc.add(["a"], 1.0, 1, sampling_rate=0.0)
    assert math.isinf(epsilon([(0.0, 1, 0.5)], 1e-6))

"""Adaptive clipping (Andrew et al. 2021): C tracks the target quantile, and its privacy cost composes exactly."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_coordinator.privacy.accountant import epsilon
from fedtier.privacy.adaptive_clip import (
    GeometricClip,
    combined_multiplier,
    noised_centred_count,
    unclipped_bits,
    update_multiplier,
)


def _fixture(rng: np.random.Generator, n: int) -> np.ndarray:
    """Update norms of a fleet: lognormal, median 3.0 — far from the starting C of 0.1."""
    return np.exp(rng.normal(np.log(3.0), 0.5, size=n))


@pytest.mark.parametrize("gamma", [0.5, 0.8])
def test_clip_tracks_the_target_quantile(gamma: float) -> None:
    rng = np.random.default_rng(11)
    fleet = _fixture(rng, 10_000)
    q, expected = 0.05, 0.05 * 10_000
    state = GeometricClip(clip=0.1, target_quantile=gamma, learning_rate=0.2)
    history = []
    for _ in range(300):
        sampled = fleet[rng.random(fleet.size) < q]
        total = noised_centred_count(unclipped_bits(sampled, state.clip), expected / 20, rng)
        history.append(state.update(total, expected))
    settled = float(np.median(history[-100:]))
    truth = float(np.quantile(fleet, gamma))
    assert settled == pytest.approx(truth, rel=0.08), (settled, truth)
    assert float(np.mean(fleet <= settled)) == pytest.approx(gamma, abs=0.04)
    assert history[0] < 0.2 * truth  # it did have to travel


def test_split_multiplier_costs_exactly_the_plans_z() -> None:
    z, sigma_b = 1.1, 5.0
    z_delta = update_multiplier(z, sigma_b)
    assert z_delta > z
    assert combined_multiplier(z_delta, sigma_b) == pytest.approx(z, rel=1e-12)
    # RDP is linear in 1/z^2 for Gaussians: the pair composes to exactly one release at z
    pair = epsilon([(z_delta, 50), (2 * sigma_b, 50)], 1e-6)
    assert pair == pytest.approx(epsilon([(z, 50)], 1e-6), rel=1e-6)
    with pytest.raises(ValueError, match="clip_count_stddev"):
        update_multiplier(2.0, 0.9)


def test_bad_arguments() -> None:
    for kwargs in ({"clip": 0.0}, {"clip": 1.0, "target_quantile": 1.0}, {"clip": 1.0, "learning_rate": 0.0}):
        with pytest.raises(ValueError):
            GeometricClip(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        GeometricClip(clip=1.0).update(0.0, 0.0)

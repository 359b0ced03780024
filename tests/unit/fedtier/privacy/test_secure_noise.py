"""Hardened noise (``[privacy] secure_noise``): CSPRNG stream, sum of four Gaussians, same guarantees."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from fedtier.errors import PrivacyViolationError
from fedtier.privacy.mechanism import NoiseSource


def test_secure_draw_is_standard_normal() -> None:
    x = NoiseSource(seed=5).secure_normal((100_000,), "a")
    assert abs(float(x.mean())) < 0.02
    assert float(x.std()) == pytest.approx(1.0, abs=0.02)
    assert stats.kstest(x, "norm").pvalue > 1e-3
    assert abs(float(stats.kurtosis(x))) < 0.1  # Gaussian tails, not a sum of uniforms


def test_secure_add_has_sigma_and_is_keyed_by_labels() -> None:
    t = {"w": np.zeros((300, 100), dtype=np.float32)}
    a = NoiseSource(seed=1).add(t, 2.5, "r", 0, secure=True)["w"]
    b = NoiseSource(seed=1).add(t, 2.5, "r", 0, secure=True)["w"]
    c = NoiseSource(seed=1).add(t, 2.5, "r", 1, secure=True)["w"]
    d = NoiseSource(seed=2).add(t, 2.5, "r", 0, secure=True)["w"]
    plain = NoiseSource(seed=1).add(t, 2.5, "r", 0)["w"]
    assert a.dtype == np.float32 and a.shape == (300, 100)
    assert float(a.std()) == pytest.approx(2.5, rel=0.03)
    np.testing.assert_array_equal(a, b)  # a seeded simulation reproduces
    assert abs(float(np.corrcoef(a.ravel(), c.ravel())[0, 1])) < 0.02  # another release: independent noise
    assert abs(float(np.corrcoef(a.ravel(), d.ravel())[0, 1])) < 0.02  # another secret: independent noise
    assert not np.array_equal(a, plain)  # not the PCG64 stream


def test_secure_stream_is_still_drawn_once() -> None:
    source = NoiseSource()
    t = {"w": np.ones(4, dtype=np.float32)}
    source.add(t, 1.0, "x", secure=True)
    with pytest.raises(PrivacyViolationError):
        source.add(t, 1.0, "x", secure=True)

"""Adaptive clipping: the geometric quantile method of Andrew, Thakkar, McMahan and Ramaswamy
("Differentially Private Learning with Adaptive Clipping", NeurIPS 2021), so operators need
not guess the clip bound C.

Each round every sampled device also reports one bit, ``b_i = 1[||delta_i|| <= C_t]``: is its
update inside the current clip? The bits are summed (centred, ``b_i - 1/2``) and noised with
``N(0, sigma_b^2)`` where they first leave a trusted subtree — by the trusted edge over its
sampled devices, or by each device under an untrusted edge — and the cloud moves C
geometrically towards the target quantile ``gamma``:

    b~ = (sum (b_i - 1/2) + noise) / expected_count + 1/2
    C_{t+1} = C_t * exp(-eta_C (b~ - gamma))

So C settles where a share ``gamma`` of the updates is unclipped.

**Its privacy cost is accounted, not ignored.** The centred count has sensitivity 1/2 under
add/remove of one device, so it is a Gaussian mechanism with multiplier ``2 sigma_b``, released
on the same sample as the model update (multiplier ``z_delta``). Two Gaussian mechanisms on one
sample compose exactly into one with ``z^-2 = z_delta^-2 + (2 sigma_b)^-2`` (Gaussian DP; the
RDP of a Gaussian is linear in ``1/z^2``, subsampled or not, because both queries see the same
sample: it is one subsampled Gaussian on the concatenated vector). The calibration solves the
plan's ``z`` as without adaptive clipping and then gives the model update the larger
:func:`update_multiplier` — the ledger charges ``z``, the total of both releases.

numpy only: runs on devices and edges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def update_multiplier(z: float, count_stddev: float) -> float:
    """The model update's multiplier ``z_delta`` so that it and the clipped-count release (std
    ``count_stddev`` on a count of sensitivity 1/2) together cost exactly one Gaussian with ``z``.

    Raises:
        ValueError: ``2 count_stddev <= z`` (the count alone would already spend the whole budget).
    """
    if not (z > 0 and count_stddev > 0):
        raise ValueError(f"z and count_stddev must be > 0, got {z!r}, {count_stddev!r}")
    rest = z ** -2 - (2.0 * count_stddev) ** -2
    if rest <= 0:
        raise ValueError(f"the clipped-count noise (std {count_stddev:g}, multiplier {2 * count_stddev:g}) must "
                         f"exceed z/2 = {z / 2:g}: raise clip_count_stddev or the noise")
    return rest ** -0.5


def combined_multiplier(update_z: float, count_stddev: float) -> float:
    """The one Gaussian the pair costs: ``(z_delta^-2 + (2 sigma_b)^-2)^-1/2`` (inverse of
    :func:`update_multiplier`)."""
    return (update_z ** -2 + (2.0 * count_stddev) ** -2) ** -0.5


def unclipped_bits(norms: np.ndarray, clip: float) -> np.ndarray:
    """``1[||delta_i|| <= C]`` per device, as float64."""
    return (np.asarray(norms, dtype=np.float64) <= clip).astype(np.float64)


def noised_centred_count(bits: np.ndarray, count_stddev: float, rng: np.random.Generator) -> float:
    """``sum (b_i - 1/2) + N(0, sigma_b^2)``: what a trusted edge releases for its sampled devices
    (or a device for itself, with one bit). Sensitivity 1/2 under add/remove of one device."""
    b = np.asarray(bits, dtype=np.float64)
    return float(np.sum(b - 0.5) + rng.normal(0.0, count_stddev))


@dataclass
class GeometricClip:
    """The cloud's clip bound, moved towards the ``target_quantile`` of update norms.

    Attributes:
        clip: C_t, the bound devices clip to in the open round.
        target_quantile: gamma, the share of updates meant to be unclipped (0.5: the median).
        learning_rate: eta_C of the geometric update (Andrew et al. use 0.2).
    """

    clip: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be finite and > 0, got {self.clip!r}")
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")

    def update(self, noised_centred_sum: float, expected_count: float) -> float:
        """Move C from the round's noised centred count over a fixed, public ``expected_count``
        (``q N``: the sample size must not show); returns the new C."""
        if not expected_count > 0:
            raise ValueError(f"expected_count must be > 0, got {expected_count!r}")
        fraction = noised_centred_sum / expected_count + 0.5
        self.clip = self.clip * math.exp(-self.learning_rate * (fraction - self.target_quantile))
        return self.clip

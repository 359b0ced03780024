"""Real vectors in and out of the modular ring Z_{2^bits} that masks live in.

A device clips its update to L2 norm ``clip`` (so every coordinate is in [-clip, clip]),
multiplies by ``scale`` and rounds stochastically (unbiased: ``floor(v + u)``, ``u ~ U[0, 1)``),
then takes the result modulo 2^bits (negative values wrap, two's complement). ``scale`` is
the largest that keeps the sum of ``max_inputs`` such integers inside (-2^(bits-1), 2^(bits-1)),
so the modular sum of the cell's inputs decodes to the true integer sum, without overflow:

    max_inputs * (clip * scale + 1) <= 2^(bits-1) - 1

The decoding error of a sum of ``n`` inputs is the sum of ``n`` independent rounding errors,
each in (-1, 1) / scale with mean 0: at most ``n / scale`` per coordinate, typically
``sqrt(n / 4) / scale``. With bits = 48, clip = 10 and 1,000 inputs, ``1 / scale`` is 7e-11.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from fedtier.errors import LocalProtocolError

MIN_BITS, MAX_BITS = 16, 62


@dataclass(frozen=True, slots=True)
class RingCodec:
    """Encoding parameters every member of a cell shares (they come in the task's config)."""

    bits: int
    clip: float
    max_inputs: int

    def __post_init__(self) -> None:
        if not (isinstance(self.bits, int) and MIN_BITS <= self.bits <= MAX_BITS):
            raise LocalProtocolError(f"secagg ring bits must be in {MIN_BITS}..{MAX_BITS}, got {self.bits!r}")
        if not (isinstance(self.clip, (int, float)) and math.isfinite(self.clip) and self.clip > 0):
            raise LocalProtocolError(f"secagg clip must be finite and > 0, got {self.clip!r}")
        if not (isinstance(self.max_inputs, int) and self.max_inputs >= 1):
            raise LocalProtocolError(f"secagg max_inputs must be an int >= 1, got {self.max_inputs!r}")
        if self.scale <= 0:
            raise LocalProtocolError(f"a {self.bits}-bit ring cannot hold the sum of {self.max_inputs} inputs")

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    @property
    def mask(self) -> np.uint64:
        return np.uint64(self.modulus - 1)

    @property
    def scale(self) -> float:
        return ((2 ** (self.bits - 1) - 1) / self.max_inputs - 1) / self.clip

    def encode(self, vector: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Clip (L2), scale, stochastically round, wrap into the ring (uint64)."""
        v = np.asarray(vector, dtype=np.float64)
        norm = float(np.linalg.norm(v))
        if norm > self.clip:
            v = v * (self.clip / norm)
        scaled = v * self.scale
        ints = np.floor(scaled + rng.random(scaled.shape)).astype(np.int64)
        return ints.astype(np.uint64) & self.mask

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a + b) & self.mask  # uint64 wraps modulo 2^64, a multiple of the ring's modulus

    def sub(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a - b) & self.mask

    def decode_sum(self, total: np.ndarray) -> np.ndarray:
        """The real-valued sum of the encoded inputs a ring element stands for."""
        t = np.asarray(total, dtype=np.uint64) & self.mask
        signed = t.astype(np.int64)
        signed = np.where(t >= np.uint64(self.modulus >> 1), signed - np.int64(self.modulus), signed)
        return signed.astype(np.float64) / self.scale


def flatten(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """The tensors' values in name order, as one float64 vector."""
    return np.concatenate([np.asarray(tensors[n], dtype=np.float64).ravel() for n in sorted(tensors)]) \
        if tensors else np.zeros(0)


def unflatten(vector: np.ndarray, like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Split ``vector`` back into tensors shaped like ``like`` (float32)."""
    out: dict[str, np.ndarray] = {}
    offset = 0
    for name in sorted(like):
        size = int(np.prod(like[name].shape))
        out[name] = vector[offset:offset + size].reshape(like[name].shape).astype(np.float32)
        offset += size
    return out

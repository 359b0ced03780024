"""Deterministic, independent random streams named by what they are for.

Every random draw in fedtier (minibatch order, quantizer rounding, partition masks) comes
from ``stream(seed, *labels)``: a numpy ``Generator`` seeded from a SHA-256 of the labels.
Two devices never share a stream (their ids are labels), the same labels always give the
same stream in the simulator and over MQTT, and Python's randomized ``hash()`` is never used.

DP noise must *not* come from here: it needs the OS's CSPRNG (see the privacy layer).
"""

from __future__ import annotations

import hashlib

import numpy as np


def seed_words(seed: int, *labels: str | int) -> list[int]:
    """32-bit words for ``np.random.SeedSequence`` derived from ``seed`` and ``labels``."""
    h = hashlib.sha256()
    h.update(str(int(seed)).encode())
    for label in labels:
        h.update(b"\x1f")
        h.update(str(label).encode())
    digest = h.digest()
    return [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 32, 4)]


def stream(seed: int, *labels: str | int) -> np.random.Generator:
    """A fresh generator for the stream named ``labels`` under ``seed``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed_words(seed, *labels))))

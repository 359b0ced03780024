"""Minibatch sampling shared by every backend: the same stream gives the same batches.

Batches are drawn epoch by epoch without replacement (a fresh permutation per epoch), the
usual way SGD is run. Every batch has the same size; an epoch's tail shorter than a batch is
skipped (like ``drop_last=True``), and the next epoch reshuffles everything. The generator
comes from ``fedtier.rng.stream`` so the simulator
and a real device draw identical batches for the same (seed, device, round).
"""

from __future__ import annotations

import numpy as np


def minibatch_indices(n: int, batch_size: int, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``steps`` index arrays of ``min(batch_size, n)`` samples each, epoch-wise shuffled.

    Raises:
        ValueError: ``n`` is 0 (nothing to train on) or sizes are not positive.
    """
    if n <= 0:
        raise ValueError("no local samples to draw batches from")
    if batch_size <= 0 or steps < 0:
        raise ValueError(f"invalid batch_size={batch_size} steps={steps}")
    b = min(batch_size, n)
    out: list[np.ndarray] = []
    perm = rng.permutation(n)
    pos = 0
    for _ in range(steps):
        if pos + b > n:
            perm = rng.permutation(n)
            pos = 0
        out.append(perm[pos:pos + b])
        pos += b
    return out

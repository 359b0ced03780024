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


def class_rows(labels: np.ndarray, per_class: dict[int, int], rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Row indices drawn by class: ``per_class[label]`` rows whose label is ``label``, uniformly with
    replacement, classes in ascending label order from the one generator (so every shell draws the
    same rows for the same stream). A label the data does not hold gives an empty array.

    X-risk steps draw ``B1`` positives and ``B2`` negatives this way (FeDXL's mini-batch form); with
    replacement, a device holding fewer rows of a class than a batch still gives unbiased batches.

    Raises:
        ValueError: A negative count, or labels that are not one-dimensional.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"class labels must be one-dimensional, got shape {labels.shape}")
    out: dict[int, np.ndarray] = {}
    for label in sorted(per_class):
        count = int(per_class[label])
        if count < 0:
            raise ValueError(f"cannot draw {count} rows of class {label}")
        members = np.flatnonzero(labels == label)
        if len(members) == 0 or count == 0:
            out[label] = np.zeros(0, dtype=np.int64)
            continue
        out[label] = members[rng.integers(0, len(members), size=count)].astype(np.int64)
    return out

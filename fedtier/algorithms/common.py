"""Pieces every hierarchical algorithm uses: quantizing an upload, checking tensors, quorum.

Quantization is part of the algorithm's mathematics (QHetFed's ``Q1``/``Q2``), so roles apply
it themselves — with the sender's own named RNG stream — and hand the wire values that are
already on the QSGD grid together with ``qsgd`` encodings that carry them losslessly.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Mapping

import numpy as np

from fedtier import quant
from fedtier.errors import LayoutMismatchError
from fedtier.rng import stream
from fedtier.wire import TensorEncoding

Tensors = Mapping[str, np.ndarray]


def quantize(tensors: Tensors, bits: int, seed: int, *labels: Any
             ) -> tuple[dict[str, np.ndarray], dict[str, TensorEncoding], float]:
    """QSGD-quantize each tensor with its own stream ``(seed, *labels, name)``.

    Args:
        tensors: what to upload.
        bits: 2..8, or 0 for no quantization (float32 on the wire).
        seed, labels: name the sender's stream, e.g. ``(seed, "q1", rollout, device, round, step)``.

    Returns:
        ``(values, encodings, q)``: the quantized tensors, their wire encodings, and the
        measured relative variance of the whole upload (0 when ``bits == 0``).
    """
    if bits == 0:
        return {n: np.asarray(t, dtype=np.float32) for n, t in tensors.items()}, {}, 0.0
    values: dict[str, np.ndarray] = {}
    encodings: dict[str, TensorEncoding] = {}
    parts = []
    for name in sorted(tensors):
        qz = quant.qsgd(tensors[name], bits, stream(seed, *labels, name))
        values[name] = qz.values
        encodings[name] = TensorEncoding("qsgd", {"bits": bits, "norm": qz.norm})
        parts.append(qz)
    return values, encodings, quant.combined_q(parts)


def digest(tensors: Tensors) -> str:
    """sha256 of the tensors' names and float32 bytes, in name order: the set-model check value.

    Devices and their edge compute it over the model they hold after each intra-round step;
    equal digests mean bit-identical models.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(b"\0")
        h.update(np.ascontiguousarray(tensors[name], dtype=np.float32).tobytes())
    return h.hexdigest()


def check_like(reference: Tensors, tensors: Tensors, what: str) -> None:
    """Raise ``LayoutMismatchError`` unless ``tensors`` has ``reference``'s names and shapes."""
    if set(reference) != set(tensors):
        raise LayoutMismatchError(f"{what}: tensor names {sorted(tensors)} differ from the model's")
    for name, ref in reference.items():
        if tensors[name].shape != ref.shape:
            raise LayoutMismatchError(f"{what}: {name} has shape {tensors[name].shape}, model {ref.shape}")


def quorum_count(quorum: float, members: int) -> int:
    """How many of ``members`` must report once the deadline has passed (at least 1)."""
    return max(1, math.ceil(quorum * members - 1e-9))


def device_weights(weighting: str, samples: Mapping[str, int], ids: list[str]) -> list[float]:
    """Per-device weights for an edge average: 1 each (``uniform``) or sample counts.

    All-zero sample counts fall back to uniform weights rather than dividing by zero.
    """
    if weighting == "uniform":
        return [1.0] * len(ids)
    weights = [float(samples[d]) for d in ids]
    return weights if sum(weights) > 0 else [1.0] * len(ids)

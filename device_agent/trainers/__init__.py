"""Local training backends implementing ``fedtier.training.trainer.Trainer``.

* ``"ort"`` — :class:`device_agent.trainers.ort.OrtTrainer`, onnxruntime-training on the
  bundle's artifacts (default; torch-free).
* ``"torch"`` — :class:`device_agent.trainers.torch_backend.TorchTrainer`, plain torch SGD on
  the zoo model (boards with torch but without an ORT training wheel).

Backends are imported lazily by :func:`make_trainer`, so importing this package pulls in
neither onnxruntime nor torch. The input/parameter validation both backends share lives
here too, so they reject exactly the same things with the same ``LocalProtocolError``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping

import numpy as np

from fedtier.errors import LocalProtocolError
from fedtier.training.layout import ArchSpec, Layout

if TYPE_CHECKING:  # pragma: no cover - typing only
    from fedtier.artifacts.bundle import ArtifactBundle
    from fedtier.training.trainer import Trainer

TRAINER_KINDS = ("ort", "torch")

EVAL_CHUNK = 1024
"""Rows per forward pass in ``evaluate``/``predict`` (bounds memory on small devices)."""


def make_trainer(kind: str, bundle: "ArtifactBundle", *, threads: int = 1) -> "Trainer":
    """Create the local training backend ``kind`` for ``bundle``.

    Args:
        kind: ``"ort"`` or ``"torch"``.
        bundle: The artifact bundle of the rollout (the torch backend uses only its
            ``arch`` and ``seed``).
        threads: Intra-op threads; keep 1 where runs must be bit-reproducible.

    Returns:
        A fresh trainer holding the bundle's initial parameters.

    Raises:
        ValueError: Unknown ``kind``.
        ImportError: The backend's runtime (onnxruntime-training or torch) is missing.
    """
    if kind == "ort":
        from device_agent.trainers.ort import OrtTrainer

        return OrtTrainer(bundle, threads=threads)
    if kind == "torch":
        from device_agent.trainers.torch_backend import TorchTrainer

        return TorchTrainer(bundle.arch, seed=bundle.seed, threads=threads)
    raise ValueError(f"unknown trainer kind {kind!r}; choose one of {', '.join(TRAINER_KINDS)}")


# --- validation shared by the backends -------------------------------------------------------


def check_threads(threads: int) -> int:
    """Validate a thread count. Raises ``LocalProtocolError`` unless it is an int >= 1."""
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise LocalProtocolError(f"threads must be an int >= 1, got {threads!r}")
    return int(threads)


def check_lr(lr: float) -> float:
    """Validate a learning rate. Raises ``LocalProtocolError`` unless it is a finite number."""
    try:
        value = float(lr)
    except (TypeError, ValueError) as exc:
        raise LocalProtocolError(f"learning rate must be a number, got {lr!r}") from exc
    if not math.isfinite(value):
        raise LocalProtocolError(f"learning rate must be finite, got {lr!r}")
    return value


def check_inputs(arch: ArchSpec, x: np.ndarray, *, allow_empty: bool = False) -> np.ndarray:
    """Return ``x`` as float32 C-contiguous after checking its shape against ``arch``.

    Raises:
        LocalProtocolError: Wrong rank/shape, non-numeric dtype, or an empty batch when
            ``allow_empty`` is false.
    """
    arr = np.asarray(x)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise LocalProtocolError(f"inputs must be numeric, got dtype {arr.dtype}")
    if arr.ndim != 1 + len(arch.input_shape) or tuple(arr.shape[1:]) != arch.input_shape:
        raise LocalProtocolError(
            f"inputs must have shape (batch, {', '.join(map(str, arch.input_shape))}), "
            f"got {arr.shape}")
    if arr.shape[0] == 0 and not allow_empty:
        raise LocalProtocolError("empty batch")
    return np.ascontiguousarray(arr, dtype=np.float32)


def check_batch(arch: ArchSpec, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(x float32, y int64)`` C-contiguous after checking shapes and label range.

    Raises:
        LocalProtocolError: Shape mismatch, empty batch, non-integer labels, or labels
            outside ``[0, num_classes)``.
    """
    xs = check_inputs(arch, x)
    ys = np.asarray(y)
    if not np.issubdtype(ys.dtype, np.integer):
        raise LocalProtocolError(f"labels must be integers, got dtype {ys.dtype}")
    if ys.shape != (xs.shape[0],):
        raise LocalProtocolError(f"labels must have shape ({xs.shape[0]},), got {ys.shape}")
    lo, hi = int(ys.min()), int(ys.max())
    if lo < 0 or hi >= arch.num_classes:
        raise LocalProtocolError(
            f"labels must be in [0, {arch.num_classes}), got range [{lo}, {hi}]")
    return xs, np.ascontiguousarray(ys, dtype=np.int64)


def check_tensors(layout: Layout, tensors: Mapping[str, np.ndarray], what: str
                  ) -> dict[str, np.ndarray]:
    """Validate a (possibly partial) name -> tensor map against ``layout``.

    Args:
        layout: The model's layout.
        tensors: Parameters or step directions by name; a subset of the layout is allowed.
        what: Word used in error messages ("parameter", "direction").

    Returns:
        float32 C-contiguous copies, keyed by name, in the order of ``tensors``.

    Raises:
        LocalProtocolError: Unknown name, wrong shape or non-floating dtype. Nothing is
            returned (so nothing is applied) if any entry is invalid.
    """
    known = set(layout.names)
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if name not in known:
            raise LocalProtocolError(f"unknown {what} name {name!r}; layout has {list(layout.names)}")
        arr = np.asarray(value)
        expected = layout.spec(name).shape
        if tuple(arr.shape) != expected:
            raise LocalProtocolError(f"{what} {name!r}: shape {tuple(arr.shape)} != layout {expected}")
        if not np.issubdtype(arr.dtype, np.floating):
            raise LocalProtocolError(f"{what} {name!r}: dtype {arr.dtype} is not floating point")
        out[name] = np.array(arr, dtype=np.float32, order="C", copy=True)
    return out


__all__ = [
    "EVAL_CHUNK",
    "TRAINER_KINDS",
    "check_batch",
    "check_inputs",
    "check_lr",
    "check_tensors",
    "check_threads",
    "make_trainer",
]

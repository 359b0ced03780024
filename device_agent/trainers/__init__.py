"""Local training backends implementing ``fedtier.training.trainer.Trainer``.

* ``"ort"`` — :class:`device_agent.trainers.ort.OrtTrainer`, onnxruntime-training on the
  bundle's artifacts (default; torch-free).
* ``"torch"`` — :class:`device_agent.trainers.torch_backend.TorchTrainer`, plain torch SGD on
  the zoo model (boards with torch but without an ORT training wheel). It rebuilds the model
  from ``(arch, seed)``, so it trains the built-in models only, not a user's model.

Backends are imported lazily by :func:`make_trainer`, so importing this package pulls in
neither onnxruntime nor torch. The input/parameter validation both backends share lives
here too, so they reject exactly the same things with the same ``LocalProtocolError``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping

import numpy as np

from fedtier.errors import ArtifactError, LocalProtocolError
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
        ArtifactError: ``torch`` for a user's model (kind ``onnx``), which it cannot rebuild.
        ImportError: The backend's runtime (onnxruntime-training or torch) is missing.
    """
    if kind == "ort":
        from device_agent.trainers.ort import OrtTrainer

        return OrtTrainer(bundle, threads=threads)
    if kind == "torch":
        if not bundle.arch.builtin:
            raise ArtifactError("the torch trainer rebuilds the built-in models (mlp, cnn1d) only; this rollout "
                                'trains a user model: set trainer = "ort" in device.toml')
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
    """Return ``(x float32, y)`` C-contiguous after checking shapes and labels against the loss.

    ``cross_entropy``: ``y`` int64 class labels ``(b,)`` in ``[0, num_classes)``. ``bce``/``mse``:
    ``y`` float32 targets ``(b, outputs)`` (``(b,)`` is accepted for one output); ``bce`` targets
    lie in ``[0, 1]``.

    Raises:
        LocalProtocolError: Shape mismatch, empty batch, non-integer labels, labels outside
            ``[0, num_classes)``, or targets that do not fit the loss.
    """
    xs = check_inputs(arch, x)
    ys = np.asarray(y)
    if arch.loss != "cross_entropy":
        return xs, _check_targets(arch, xs.shape[0], ys)
    if not np.issubdtype(ys.dtype, np.integer):
        raise LocalProtocolError(f"labels must be integers, got dtype {ys.dtype}")
    if ys.shape != (xs.shape[0],):
        raise LocalProtocolError(f"labels must have shape ({xs.shape[0]},), got {ys.shape}")
    lo, hi = int(ys.min()), int(ys.max())
    if lo < 0 or hi >= arch.num_classes:
        raise LocalProtocolError(
            f"labels must be in [0, {arch.num_classes}), got range [{lo}, {hi}]")
    return xs, np.ascontiguousarray(ys, dtype=np.int64)


def _check_targets(arch: ArchSpec, batch: int, ys: np.ndarray) -> np.ndarray:
    """float32 ``(b, outputs)`` targets of a ``bce`` or ``mse`` model."""
    if not (np.issubdtype(ys.dtype, np.floating) or np.issubdtype(ys.dtype, np.integer)):
        raise LocalProtocolError(f"targets must be numeric, got dtype {ys.dtype}")
    outputs = arch.num_classes
    if ys.shape == (batch,) and outputs == 1:
        ys = ys.reshape(batch, 1)
    if ys.shape != (batch, outputs):
        raise LocalProtocolError(f"targets must have shape ({batch}, {outputs}), got {ys.shape}")
    targets = np.ascontiguousarray(ys, dtype=np.float32)
    if not np.all(np.isfinite(targets)):
        raise LocalProtocolError("targets contain NaN or infinity")
    if arch.loss == "bce" and (targets.min() < 0 or targets.max() > 1):
        raise LocalProtocolError(f"bce targets must lie in [0, 1], got [{targets.min()}, {targets.max()}]")
    return targets


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


def correct_predictions(loss: str, logits: np.ndarray, y: np.ndarray) -> float:
    """How many rows of a batch the model got right: the argmax (cross-entropy), or the sign of
    each output averaged over outputs (bce); 0 for mse, which has no accuracy."""
    if loss == "cross_entropy":
        return float(np.count_nonzero(np.argmax(logits, axis=1) == y))
    if loss == "bce":
        return float(np.mean((np.asarray(logits) > 0) == (np.asarray(y) > 0.5), axis=1).sum())
    return 0.0


__all__ = [
    "EVAL_CHUNK",
    "TRAINER_KINDS",
    "check_batch",
    "check_inputs",
    "check_lr",
    "check_tensors",
    "check_threads",
    "correct_predictions",
    "make_trainer",
]

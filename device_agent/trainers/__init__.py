"""Local training backends implementing ``fedtier.training.trainer.Trainer``.

* ``"ort"`` — :class:`device_agent.trainers.ort.OrtTrainer`, onnxruntime-training on the
  bundle's artifacts (torch-free).
* ``"portable"`` — :class:`device_agent.trainers.portable.PortableTrainer`, stock onnxruntime
  on the bundle's portable training graph (standard ONNX ops) with SGD in numpy: boards
  without an onnxruntime-training wheel (Linux aarch64, Python 3.13+). Torch-free.
* ``"torch"`` — :class:`device_agent.trainers.torch_backend.TorchTrainer`, plain torch SGD on
  the zoo model (only where configured: torch is hundreds of MB). It rebuilds the model
  from ``(arch, seed)``, so it trains the built-in models only, not a user's model.
* ``"auto"`` (the default) — ``"ort"`` where onnxruntime-training is installed, otherwise
  ``"portable"`` where the stock onnxruntime is (:func:`resolve_kind`).

All give the same weights for the same inputs (to float rounding). Backends are imported
lazily by :func:`make_trainer`, so importing this package pulls in neither onnxruntime nor
torch. The input/parameter validation the backends share lives here too, so they reject
exactly the same things with the same ``LocalProtocolError``.
"""

from __future__ import annotations

import importlib.metadata
import math
from typing import TYPE_CHECKING, Mapping

import numpy as np

from fedtier.errors import ArtifactError, ConfigError, LocalProtocolError
from fedtier.training.layout import PROX_UNSUPPORTED, SCORE_LOSSES, ArchSpec, Layout

if TYPE_CHECKING:  # pragma: no cover - typing only
    from fedtier.artifacts.bundle import ArtifactBundle
    from fedtier.training.trainer import Trainer

TRAINER_KINDS = ("auto", "ort", "portable", "torch")
"""What ``trainer`` in device.toml may say."""

BACKENDS = ("ort", "portable", "torch")
"""The backends ``auto`` resolves to (one of the first two)."""

_DISTRIBUTIONS = {
    "ort": ("onnxruntime-training-cpu", "onnxruntime-training"),
    "portable": ("onnxruntime", "onnxruntime-training-cpu", "onnxruntime-training"),
    "torch": ("torch",),
}

EVAL_CHUNK = 1024
"""Rows per forward pass in ``evaluate``/``predict`` (bounds memory on small devices)."""


def resolve_kind(kind: str) -> str:
    """The backend ``kind`` stands for: ``auto`` becomes what is installed; others stay.

    Checks what is installed without importing it (cheap, and no torch).

    Args:
        kind: One of :data:`TRAINER_KINDS`.

    Returns:
        One of :data:`BACKENDS`.

    Raises:
        ValueError: Unknown ``kind``.
        ConfigError: ``auto`` and no onnxruntime of either build is installed.
    """
    from device_agent.trainers.ort_runtime import installed_build

    if kind not in TRAINER_KINDS:
        raise ValueError(f"unknown trainer kind {kind!r}; choose one of {', '.join(TRAINER_KINDS)}")
    if kind != "auto":
        return kind
    build = installed_build()
    if build == "training":
        return "ort"
    if build == "stock":
        return "portable"
    raise ConfigError("trainer = 'auto' found no onnxruntime: install fedtier[agent] (it brings "
                      "onnxruntime-training or the stock onnxruntime, whichever has a wheel here), or set "
                      "trainer = 'torch' where torch is installed", key="trainer")


def describe_backend(kind: str) -> str:
    """One line saying which backend ``kind`` runs on, with the runtime and its version.

    For logs, ``fedtier agent --version`` and presence. Does not import the runtime.

    Args:
        kind: One of :data:`TRAINER_KINDS`.

    Returns:
        E.g. ``"auto -> portable (onnxruntime 1.32.0; standard ONNX ops + numpy SGD)"``, or a line
        saying nothing usable is installed.
    """
    try:
        backend = resolve_kind(kind)
    except ConfigError:
        return "none (no onnxruntime installed; trainer = 'torch' needs torch)"
    runtime = "not installed"
    for dist in _DISTRIBUTIONS[backend]:
        try:
            runtime = f"{dist} {importlib.metadata.version(dist)}"
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    what = {"ort": "onnxruntime-training artifacts", "portable": "standard ONNX ops + numpy SGD",
            "torch": "torch eager"}[backend]
    chosen = "auto -> " if kind == "auto" else ""
    return f"{chosen}{backend} ({runtime}; {what})"


def make_trainer(kind: str, bundle: "ArtifactBundle", *, threads: int = 1) -> "Trainer":
    """Create the local training backend ``kind`` for ``bundle``.

    Args:
        kind: One of :data:`TRAINER_KINDS` (``auto`` is resolved with :func:`resolve_kind`).
        bundle: The artifact bundle of the rollout (the torch backend uses only its
            ``arch`` and ``seed``; the portable one needs its portable graph).
        threads: Intra-op threads; keep 1 where runs must be bit-reproducible.

    Returns:
        A fresh trainer holding the bundle's initial parameters.

    Raises:
        ValueError: Unknown ``kind``.
        ConfigError: ``auto`` and no onnxruntime is installed.
        ArtifactError: The backend cannot train this bundle: ``torch`` for a user's model (kind
            ``onnx``), which it cannot rebuild; ``portable`` and a bundle whose training graph holds
            an op without lowering (the message names it).
        ImportError: The backend's runtime (onnxruntime(-training) or torch) is missing.
    """
    kind = resolve_kind(kind)
    if kind != "ort" and bundle.portable is not None and PROX_UNSUPPORTED in bundle.portable.unsupported_ops:
        raise ArtifactError(f"bundle {bundle.bundle_id[:12]} trains FedProx (proximal_mu > 0): only the ort backend "
                            f"(onnxruntime-training) feeds its anchor weights; the {kind} backend would train "
                            "without the proximal term")
    if kind == "ort":
        from device_agent.trainers.ort import OrtTrainer

        return OrtTrainer(bundle, threads=threads)
    if kind == "portable":
        from device_agent.trainers.portable import PortableTrainer

        return PortableTrainer(bundle, threads=threads)
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
    if arr.dtype.kind not in "fiu":  # floating or integer (np.issubdtype, at a tenth of its cost per step)
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
    if arch.loss in SCORE_LOSSES:
        return xs, _check_classes(xs.shape[0], ys, 2)  # a scorer's rows are negatives (0) and positives (1)
    if arch.loss != "cross_entropy":
        return xs, _check_targets(arch, xs.shape[0], ys)
    return xs, _check_classes(xs.shape[0], ys, arch.num_classes)


def _check_classes(batch: int, ys: np.ndarray, num_classes: int) -> np.ndarray:
    """int64 class labels ``(b,)`` in ``[0, num_classes)``."""
    if ys.dtype.kind not in "iu":
        raise LocalProtocolError(f"labels must be integers, got dtype {ys.dtype}")
    if ys.shape != (batch,):
        raise LocalProtocolError(f"labels must have shape ({batch},), got {ys.shape}")
    lo, hi = int(ys.min()), int(ys.max())
    if lo < 0 or hi >= num_classes:
        raise LocalProtocolError(
            f"labels must be in [0, {num_classes}), got range [{lo}, {hi}]")
    return np.ascontiguousarray(ys, dtype=np.int64)


def check_score_model(arch: ArchSpec) -> None:
    """Raise ``LocalProtocolError`` unless the bundle trains a scorer through weighted scores."""
    if arch.loss not in SCORE_LOSSES:
        raise LocalProtocolError(f"score_gradient needs a bundle built with loss weighted_score (X-risk "
                                 f"algorithms such as fedxl); this one trains with {arch.loss}")


def check_weights(batch: int, weights: np.ndarray) -> np.ndarray:
    """The coefficients of a weighted-score step as the graph takes them: float32 ``(b, 1)``, finite.

    Raises:
        LocalProtocolError: Wrong length or non-finite values.
    """
    w = np.asarray(weights)
    if w.shape not in ((batch,), (batch, 1)) or not np.issubdtype(w.dtype, np.floating):
        raise LocalProtocolError(f"weights must be {batch} floats, got shape {w.shape} dtype {w.dtype}")
    if not np.all(np.isfinite(w)):
        raise LocalProtocolError("weights contain NaN or infinity")
    return np.ascontiguousarray(w.reshape(batch, 1), dtype=np.float32)


def score_loss(outputs: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of a scorer's outputs (logits) against 0/1 labels: what ``evaluate``
    reports for a ``weighted_score`` model, whose training loss is pairwise and has no per-row value."""
    z = np.asarray(outputs, np.float64).reshape(len(labels), -1)[:, 0]
    y = np.asarray(labels) == 1
    return float(np.mean(np.where(y, np.logaddexp(0.0, -z), np.logaddexp(0.0, z)))) if len(z) else float("nan")


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
    if loss in SCORE_LOSSES:
        return float(np.count_nonzero((np.asarray(logits)[:, 0] > 0) == (np.asarray(y) == 1)))
    return 0.0


__all__ = [
    "BACKENDS",
    "EVAL_CHUNK",
    "TRAINER_KINDS",
    "check_batch",
    "check_inputs",
    "check_lr",
    "check_score_model",
    "check_tensors",
    "check_weights",
    "check_threads",
    "correct_predictions",
    "describe_backend",
    "make_trainer",
    "resolve_kind",
    "score_loss",
]

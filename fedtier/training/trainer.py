"""The ``Trainer`` contract: what a device role may ask of the local training backend.

Backends live in ``device_agent.trainers`` (onnxruntime-training by default, torch for
boards without an ORT training wheel). Algorithms never see a backend directly: a device
role returns a *request* ("run these k SGD steps") and the shell executes it with the
trainer, so the same role runs over ORT, torch, or one shared ORT session in simulation.

All parameter dictionaries are keyed by the names of the model's ``Layout`` and hold
float32 arrays. Returned arrays are copies the caller may keep or modify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, runtime_checkable

import numpy as np

from fedtier.training.layout import Layout

Batch = tuple[np.ndarray, np.ndarray]
"""``(x, y)``: ``x`` float32 of shape ``(b, *input_shape)``; ``y`` int64 class labels ``(b,)``
(``cross_entropy``), or float32 targets ``(b, outputs)`` (``bce``, ``mse``; see ``ArchSpec.loss``)."""


@dataclass(frozen=True, slots=True)
class TrainStats:
    """What a run of local SGD steps reports back."""

    steps: int
    samples: int
    mean_loss: float


@dataclass(frozen=True, slots=True)
class EvalResult:
    """Mean loss and accuracy of the current parameters on a labelled set.

    ``accuracy`` is ``None`` for a loss without one (``mse``).
    """

    loss: float
    accuracy: float | None
    samples: int


@runtime_checkable
class Trainer(Protocol):
    """Local training backend. The model's mean loss (``ArchSpec.loss``), plain SGD (``w <- w - lr * grad``)."""

    @property
    def layout(self) -> Layout:
        """Names and shapes of the trainable parameters, in training-graph order."""
        ...

    def get_parameters(self) -> dict[str, np.ndarray]:
        """A float32 copy of every trainable parameter."""
        ...

    def set_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters by name. Names must be in the layout; shapes must match."""
        ...

    def train_steps(self, batches: Iterable[Batch], lr: float) -> TrainStats:
        """Run one SGD step per batch, in order, with learning rate ``lr``."""
        ...

    def compute_gradient(self, x: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """Gradient of the mean loss on ``(x, y)`` at the current parameters, and the loss.

        The parameters are left unchanged (QHetFed's intra-set phase needs this).
        """
        ...

    def score_gradient(self, x: np.ndarray, weights: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """Gradient of ``sum_n weights[n] * output(x[n])`` at the current parameters, and that sum.

        Only for a scorer built with loss ``weighted_score`` (X-risk algorithms: FeDXL); parameters
        unchanged. Others raise ``LocalProtocolError``.
        """
        ...

    def apply_step(self, direction: Mapping[str, np.ndarray], lr: float) -> None:
        """Apply an externally computed step: ``w[name] <- w[name] - lr * direction[name]``."""
        ...

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> EvalResult:
        """Mean loss and accuracy on ``(x, y)``; parameters unchanged."""
        ...

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits ``(b, classes)`` for ``x`` (float32)."""
        ...

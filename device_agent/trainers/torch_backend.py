"""``TorchTrainer``: the ``Trainer`` protocol on plain torch, for boards without ORT training.

onnxruntime-training has no aarch64/cp313 wheels (field notes §0.2); a board that has torch
can train the same zoo model with this backend instead. It matches ``OrtTrainer`` step for
step: same initial weights (``models.zoo.build_model``), mean cross-entropy, plain SGD
``w <- w - lr * grad`` (what ``torch.optim.SGD`` without momentum/decay does), the same
input validation and the same ``apply_step`` arithmetic (numpy float32).

torch and ``models`` are imported inside ``__init__`` only, so ``import device_agent``
never imports torch (dependency rule). ``threads`` sets torch's *process-wide* intra-op
thread count (``torch.set_num_threads``).

Not thread-safe: one call at a time per instance.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import numpy as np

from device_agent.trainers import (
    EVAL_CHUNK,
    check_batch,
    check_inputs,
    check_lr,
    check_tensors,
    check_threads,
)
from fedtier.errors import LocalProtocolError
from fedtier.training.layout import ArchSpec, Layout
from fedtier.training.trainer import Batch, EvalResult, TrainStats

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

logger = logging.getLogger(__name__)


class TorchTrainer:
    """Train and evaluate a zoo model with torch on the CPU.

    Args:
        arch: The architecture (from the rollout's bundle).
        seed: Seed of the initial weights (the bundle's seed gives the bundle's weights).
        threads: torch intra-op threads (process-wide).

    Raises:
        LocalProtocolError: Invalid architecture, seed or ``threads``.
        ImportError: torch is not installed.
    """

    def __init__(self, arch: ArchSpec, *, seed: int = 0, threads: int = 1) -> None:
        self._threads = check_threads(threads)
        import torch
        import torch.nn.functional as functional

        from models.zoo import build_model, layout_of

        self._torch = torch
        self._cross_entropy = functional.cross_entropy
        torch.set_num_threads(self._threads)
        self._arch = arch
        self._layout = layout_of(arch)
        self._model = build_model(arch, seed)
        self._params: dict[str, torch.nn.Parameter] = dict(self._model.named_parameters())
        if list(self._params) != list(self._layout.names):
            raise AssertionError(f"zoo model parameters {list(self._params)} != layout "
                                 f"{list(self._layout.names)}")
        self._model.train()
        logger.debug("TorchTrainer %s (seed %d, %d parameters, %d thread(s))", arch.kind, seed,
                     self._layout.num_parameters, self._threads)

    # --- Trainer protocol --------------------------------------------------------------------

    @property
    def layout(self) -> Layout:
        """Names and shapes of the trainable parameters, in training-graph order."""
        return self._layout

    def get_parameters(self) -> dict[str, np.ndarray]:
        """A float32 copy of every trainable parameter, in layout order."""
        return {name: p.detach().numpy().copy() for name, p in self._params.items()}

    def set_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters by name (a subset of the layout is allowed).

        Raises:
            LocalProtocolError: Unknown name, wrong shape or dtype; nothing is changed then.
        """
        checked = check_tensors(self._layout, params, "parameter")
        with self._torch.no_grad():
            for name, arr in checked.items():
                self._params[name].copy_(self._torch.from_numpy(arr))

    def train_steps(self, batches: Iterable[Batch], lr: float) -> TrainStats:
        """Run one SGD step per batch, in order, with learning rate ``lr``.

        Returns:
            Steps, samples and the sample-weighted mean of the per-step (pre-update) losses;
            ``mean_loss`` is NaN when ``batches`` is empty.

        Raises:
            LocalProtocolError: Invalid ``lr`` or batch. Steps before the bad batch stay applied.
        """
        step = check_lr(lr)
        steps = samples = 0
        loss_sum = 0.0
        for x, y in batches:
            xs, ys = check_batch(self._arch, x, y)
            loss = self._backward(xs, ys)
            with self._torch.no_grad():
                for p in self._params.values():
                    assert p.grad is not None  # every parameter is in the loss graph
                    p.add_(p.grad, alpha=-step)
            self._model.zero_grad(set_to_none=True)
            steps += 1
            samples += xs.shape[0]
            loss_sum += loss * xs.shape[0]
        mean_loss = loss_sum / samples if samples else float("nan")
        return TrainStats(steps=steps, samples=samples, mean_loss=mean_loss)

    def compute_gradient(self, x: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """Gradient of the mean cross-entropy on ``(x, y)``; parameters unchanged.

        Raises:
            LocalProtocolError: Invalid batch.
        """
        xs, ys = check_batch(self._arch, x, y)
        try:
            loss = self._backward(xs, ys)
            grads = {name: _grad_of(p) for name, p in self._params.items()}
        finally:
            self._model.zero_grad(set_to_none=True)
        return grads, loss

    def score_gradient(self, x: np.ndarray, weights: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """Not available: this backend rebuilds the built-in classifiers only, and a ``weighted_score``
        model (an X-risk scorer) is resolved as a user model (``models.source``).

        Raises:
            LocalProtocolError: always.
        """
        raise LocalProtocolError("the torch trainer trains the built-in classifiers only; X-risk scorers "
                                 '(fedxl) train with trainer = "ort" or "portable"')

    def apply_step(self, direction: Mapping[str, np.ndarray], lr: float) -> None:
        """Apply ``w[name] <- w[name] - lr * direction[name]`` in float32 for each given name.

        Raises:
            LocalProtocolError: Invalid ``lr``, unknown name or wrong shape; nothing changes.
        """
        step = np.float32(check_lr(lr))
        checked = check_tensors(self._layout, direction, "direction")
        with self._torch.no_grad():
            for name, d in checked.items():
                p = self._params[name]
                new = np.ascontiguousarray(p.detach().numpy() - step * d, dtype=np.float32)
                p.copy_(self._torch.from_numpy(new))

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> EvalResult:
        """Mean loss and accuracy on ``(x, y)``, in chunks.

        Raises:
            LocalProtocolError: Invalid or empty data.
        """
        xs, ys = check_batch(self._arch, x, y)
        n = xs.shape[0]
        loss_sum = 0.0
        correct = 0
        with self._torch.no_grad():
            for start in range(0, n, EVAL_CHUNK):
                xc = self._torch.from_numpy(xs[start:start + EVAL_CHUNK])
                yc = self._torch.from_numpy(ys[start:start + EVAL_CHUNK])
                logits = self._model(xc)
                loss_sum += float(self._cross_entropy(logits, yc)) * xc.shape[0]
                correct += int((logits.argmax(dim=1) == yc).sum())
        return EvalResult(loss=loss_sum / n, accuracy=correct / n, samples=n)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits ``(b, classes)`` for ``x`` (``b`` may be 0).

        Raises:
            LocalProtocolError: Wrong input shape.
        """
        xs = check_inputs(self._arch, x, allow_empty=True)
        if xs.shape[0] == 0:
            return np.zeros((0, self._arch.num_classes), dtype=np.float32)
        with self._torch.no_grad():
            chunks = [self._model(self._torch.from_numpy(xs[s:s + EVAL_CHUNK])).numpy()
                      for s in range(0, xs.shape[0], EVAL_CHUNK)]
        return np.ascontiguousarray(np.concatenate(chunks, axis=0), dtype=np.float32)

    # --- internals ----------------------------------------------------------------------------

    def _backward(self, xs: np.ndarray, ys: np.ndarray) -> float:
        """Forward + backward from a zero gradient; returns the loss."""
        torch: Any = self._torch
        self._model.zero_grad(set_to_none=True)
        loss = self._cross_entropy(self._model(torch.from_numpy(xs)), torch.from_numpy(ys))
        loss.backward()
        return float(loss.detach())


def _grad_of(param: "torch.nn.Parameter") -> np.ndarray:
    """A float32 copy of a parameter's gradient (every zoo parameter reaches the loss)."""
    assert param.grad is not None
    return param.grad.detach().numpy().copy()

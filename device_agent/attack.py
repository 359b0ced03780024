"""Attacks, for testing robustness: a device that lies about its update. Never active unless configured.

A rollout's ``[attack]`` (``fedtier simulate``, ``fedtier demo``) makes a seeded ``fraction`` of
the devices misbehave; an agent does only when its own ``device.toml`` has an ``[attack]``
section, and then says so in a warning at start-up and in its presence document. Kinds:

* ``sign_flip`` — sends ``-scale`` times its honest update (default scale 10);
* ``gaussian`` — sends Gaussian noise of standard deviation ``scale`` instead of its update;
* ``label_flip`` — trains honestly on labels ``y -> classes - 1 - y``;
* ``stale_replay`` — sends its first round's update again in every later round (a replayed model).

The first three model a compromised board, the last a stuck or replaying one. The honest work is
done in every case (same minibatches, same time), only the upload changes: gradient requests
(QHetFed) are attacked like local changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from fedtier.errors import LocalProtocolError
from fedtier.rng import stream
from fedtier.training.trainer import Batch, Trainer, TrainStats

log = logging.getLogger("fedtier.attack")

KINDS = ("sign_flip", "gaussian", "label_flip", "stale_replay")
DEFAULT_SCALE = 10.0


@dataclass(frozen=True)
class AttackSpec:
    """What one attacking device does. ``classes``: label_flip's number of classes."""

    kind: str
    scale: float = DEFAULT_SCALE
    seed: int = 0
    classes: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LocalProtocolError(f"attack kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not (np.isfinite(self.scale) and self.scale > 0):
            raise LocalProtocolError(f"attack scale must be finite and > 0, got {self.scale!r}")
        if self.kind == "label_flip" and (self.classes is None or self.classes < 2):
            raise LocalProtocolError("label_flip needs the number of classes (>= 2)")

    def describe(self) -> str:
        return self.kind if self.kind in ("label_flip", "stale_replay") else f"{self.kind} (scale {self.scale:g})"


def flip_labels(y: np.ndarray, classes: int) -> np.ndarray:
    """``classes - 1 - y`` for integer class labels (label_flip)."""
    y = np.asarray(y)
    return (classes - 1 - y).astype(y.dtype)


class AttackingTrainer:
    """A ``Trainer`` whose results lie: wraps the honest one, changes only what leaves the device.

    ``get_parameters`` after ``train_steps`` returns ``w0 + attack(w - w0)`` (``w0`` what the last
    ``set_parameters`` set); ``compute_gradient`` returns ``attack(g)``. Everything else passes
    through. (label_flip lies in the data, not here: ``flip_labels``.)
    """

    def __init__(self, inner: Trainer, spec: AttackSpec, device: str) -> None:
        self.inner = inner
        self.spec = spec
        self.device = device
        self._start: dict[str, np.ndarray] | None = None
        self._trained = False
        self._first: dict[str, dict[str, np.ndarray]] = {}
        self._calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def layout(self) -> Any:
        return self.inner.layout

    def set_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        self.inner.set_parameters(params)
        self._start = {k: np.array(v, dtype=np.float32) for k, v in params.items()}
        self._trained = False

    def train_steps(self, batches: Iterable[Batch], lr: float) -> TrainStats:
        stats = self.inner.train_steps(batches, lr)
        self._trained = True
        return stats

    def get_parameters(self) -> dict[str, np.ndarray]:
        params = self.inner.get_parameters()
        if not self._trained or self._start is None or self.spec.kind == "label_flip":
            return params
        start = self._start
        honest = {k: params[k].astype(np.float64) - start[k].astype(np.float64) for k in params}
        lie = self._lie(honest, "delta")
        return {k: (start[k].astype(np.float64) + lie[k]).astype(np.float32) for k in params}

    def compute_gradient(self, x: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        grad, loss = self.inner.compute_gradient(x, y)
        if self.spec.kind == "label_flip":
            return grad, loss
        lie = self._lie({k: np.asarray(v, np.float64) for k, v in grad.items()}, "grad")
        return {k: v.astype(np.float32) for k, v in lie.items()}, loss

    def _lie(self, honest: dict[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
        self._calls += 1
        s = self.spec
        if s.kind == "sign_flip":
            return {k: -s.scale * v for k, v in honest.items()}
        if s.kind == "gaussian":
            gen = stream(s.seed, "attack-noise", self.device, self._calls)
            return {k: gen.normal(0.0, s.scale, size=v.shape) for k, v in sorted(honest.items())}
        first = self._first.setdefault(what, {k: v.copy() for k, v in honest.items()})  # stale_replay
        return {k: first[k].copy() for k in honest}


def attacking_provider(provider: Any, spec: AttackSpec, device: str) -> Any:
    """Wrap a ``trainer_provider`` (bundle -> Trainer) so that its trainers attack."""
    def make(bundle: Any) -> Trainer:
        return AttackingTrainer(provider(bundle), spec, device)

    return make

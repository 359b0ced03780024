"""FeDXL test support: a queued hierarchy, device work as the agent's shell does it on real ORT, data.

``QueuedHierarchy`` is ``hierarchy.Hierarchy`` with a FIFO between roles instead of nested calls, so a
rollout of hundreds of rounds does not stack Python frames. ``ShellCompute`` runs ``ScoreRows`` and
``ScoreGradient`` with ``device_agent.node.DeviceNode``'s own methods on one onnxruntime-training
trainer (the ``weighted_score`` bundle of ``models.artifacts``), as the simulator shares one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import numpy as np
from hierarchy import Hierarchy

from cloud_coordinator.metrics_eval import ranking_metrics
from device_agent.data import LocalData
from device_agent.node import DeviceNode
from fedtier.algorithms import fedxl
from fedtier.algorithms.base import GradientResult, RowScores, ScoreGradient, ScoreRows
from fedtier.algorithms.xrisk import sigmoid
from fedtier.rng import stream
from fedtier.wire import messages

Data = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass
class QueuedHierarchy(Hierarchy):
    """Messages between roles go through one FIFO, drained at the top level."""

    _queue: deque[tuple[str, str, messages.Message]] = field(default_factory=deque)
    _pumping: bool = False

    def deliver_to_edge(self, cell: str, msg: messages.Message) -> None:
        self._queue.append(("edge", cell, msg))
        self._pump()

    def deliver_to_device(self, device: str, msg: messages.Message) -> None:
        self._queue.append(("device", device, msg))
        self._pump()

    def deliver_to_cloud(self, msg: messages.Message) -> None:
        self._queue.append(("cloud", "cloud", msg))
        self._pump()

    def _pump(self) -> None:
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._queue:
                where, to, msg = self._queue.popleft()
                if where == "edge":
                    Hierarchy.deliver_to_edge(self, to, msg)
                elif where == "device":
                    Hierarchy.deliver_to_device(self, to, msg)
                else:
                    Hierarchy.deliver_to_cloud(self, msg)
        finally:
            self._pumping = False


class ShellCompute:
    """A device shell's X-risk work: ``DeviceNode.score_rows`` / ``score_gradient`` on a shared trainer."""

    def __init__(self, trainer: Any, data: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.trainer = trainer
        self.shells = {d: SimpleNamespace(data=LocalData(x=np.asarray(x, np.float32), y=np.asarray(y, np.int64)))
                       for d, (x, y) in data.items()}
        self.gradients: list[tuple[str, int, int, dict[str, np.ndarray]]] = []
        self.record = False
        self.scored_at: list[tuple[str, int, int, dict[str, np.ndarray]]] = []
        """(device, round, step, params) of every ScoreRows, when ``record`` is set."""

    def score_rows(self, device: str, action: ScoreRows) -> RowScores:
        if self.record:
            self.scored_at.append((device, action.round, action.step, {k: np.array(v) for k, v in
                                                                       action.params.items()}))
        return DeviceNode.score_rows(self.shells[device], self.trainer, action)  # type: ignore[arg-type]

    def score_gradient(self, device: str, action: ScoreGradient) -> GradientResult:
        result = DeviceNode.score_gradient(self.shells[device], self.trainer, action)  # type: ignore[arg-type]
        if self.record:
            self.gradients.append((device, action.round, action.step, result.grad))
        return result


def scorer_bundle(store: Path, features: int, hidden: tuple[int, ...] = (), seed: int = 0) -> Any:
    """The ``weighted_score`` bundle of an MLP scorer ``[features, *hidden, 1]`` (built once per store)."""
    from fedtier.training.layout import ArchSpec
    from models.artifacts import build_artifacts
    from models.source import model_source

    source = model_source(arch=ArchSpec("mlp", {"sizes": [features, *hidden, 1]}), loss="weighted_score", seed=seed)
    return build_artifacts(source, store)


def shared_trainer(store: Path, features: int, hidden: tuple[int, ...] = ()) -> Any:
    from device_agent.trainers import make_trainer

    return make_trainer("ort", scorer_bundle(store, features, hidden))


def gaussian_devices(sizes: list[int], pos_fracs: list[float], *, features: int = 20, separation: float = 2.0,
                     shifts: list[float] | None = None, seed: int = 0) -> Data:
    """Device ``dev-i``: ``sizes[i]`` rows, a share ``pos_fracs[i]`` positives ``N(delta, I)`` (``|delta|`` =
    ``separation`` on the first 5 coordinates), the rest negatives ``N(0, I)``; plus ``shifts[i]`` on
    coordinates 5..9 (the digest's per-device nuisance shift)."""
    gen = stream(seed, "xrisk-test-data")
    out: Data = {}
    for i, (n, frac) in enumerate(zip(sizes, pos_fracs, strict=True)):
        y = np.zeros(n, np.int64)
        y[: int(round(frac * n))] = 1
        y = gen.permutation(y)
        x = gen.normal(size=(n, features))
        x[y == 1, :5] += separation / np.sqrt(5)
        if shifts is not None:
            x[:, 5:10] += shifts[i]
        out[f"dev-{i:02d}"] = (x.astype(np.float32), y)
    return out


def flip(data: Data, share: float, seed: int = 0) -> Data:
    """``share`` of each class's labels flipped on every device (the paper's corrupted labels)."""
    gen = stream(seed, "xrisk-test-flips")
    out: Data = {}
    for d, (x, y) in sorted(data.items()):
        y = y.copy()
        for c in (0, 1):
            idx = np.flatnonzero(data[d][1] == c)
            y[gen.choice(idx, size=int(round(share * len(idx))), replace=False)] = 1 - c
        out[d] = (x, y)
    return out


def held_out_set(n: int, *, pos_frac: float = 1 / 6, features: int = 20, shifts: list[float] | None = None,
             seed: int = 99) -> tuple[np.ndarray, np.ndarray]:
    """Clean held-out rows from the same classes, each with a random device's shift (if any)."""
    (x, y), = gaussian_devices([n], [pos_frac], features=features, seed=seed).values()
    if shifts:
        x = x.copy()
        x[:, 5:10] += np.asarray(shifts, np.float32)[stream(seed, "xrisk-test-shift").integers(0, len(shifts), n)][:,
                                                                                                                 None]
    return x, y


def pooled(data: Data) -> Data:
    """Every device's rows on one device: the centralized baseline."""
    return {"dev-00": (np.concatenate([x for x, _ in data.values()]), np.concatenate([y for _, y in data.values()]))}


def one_class_devices(n_devices: int, positives: int, negatives: int, *, features: int = 20, seed: int = 0) -> Data:
    """Digest check 3's setting: devices 1, 3, ... hold only positives (``positives`` rows each), 0, 2, ... only
    negatives (``negatives`` rows each)."""
    sizes = [positives if i % 2 else negatives for i in range(n_devices)]
    fracs = [1.0 if i % 2 else 0.0 for i in range(n_devices)]
    return gaussian_devices(sizes, fracs, features=features, seed=seed)


def cells_of(devices: list[str], cells: int = 2) -> dict[str, tuple[str, ...]]:
    """Devices split into ``cells`` consecutive blocks ``cell-a``, ``cell-b``, ..."""
    parts = np.array_split(np.asarray(devices), cells)
    return {f"cell-{chr(ord('a') + i)}": tuple(p.tolist()) for i, p in enumerate(parts) if len(p)}


def auroc(trainer: Any, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    trainer.set_parameters(params)
    metrics = ranking_metrics(y, trainer.predict(x)[:, 0])
    assert metrics is not None
    return metrics["auroc"]


def run(data: Data, config: fedxl.FedXLConfig, rounds: int, trainer: Any, *, params: Mapping[str, np.ndarray],
        cells: int = 2, record: bool = False, **kwargs: Any) -> tuple[QueuedHierarchy, ShellCompute]:
    """A FeDXL rollout of ``rounds`` rounds over ``data`` in the queued hierarchy; returns it and its compute."""
    compute = ShellCompute(trainer, data)
    compute.record = record
    h = QueuedHierarchy(algo=fedxl, cells=cells_of(sorted(data), cells), params=dict(params), config=config,
                        rounds=rounds, compute=compute, **kwargs)
    h.run()
    assert h.finished, f"{len(h.closed)} of {rounds} rounds closed"
    return h, compute


def zeros_like(params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.zeros_like(v) for k, v in params.items()}


def linear_scores(params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """``h = sigmoid(x w + b)`` of the one-layer scorer ``[features, 1]`` (fc0)."""
    w = np.asarray(params["fc0.weight"], np.float64)[0]
    b = float(np.asarray(params["fc0.bias"], np.float64)[0])
    return sigmoid(np.asarray(x, np.float64) @ w + b)

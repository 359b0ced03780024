"""Softmax regression in numpy: a tiny, exact local-compute backend for algorithm tests.

Batches are drawn exactly as the device shell draws them (``minibatch_indices`` over the named
stream), so the roles' stream names are exercised, and gradients are exact (float64 maths,
float32 results like a trainer's).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from fedtier.rng import stream
from fedtier.training.batching import minibatch_indices


def make_data(devices: list[str], features: int = 6, classes: int = 3, per_device: int = 40,
              seed: int = 0, skew: bool = True) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Gaussian classes; with ``skew`` each device mostly sees one class (non-iid)."""
    rng = np.random.default_rng(seed)
    means = rng.normal(scale=1.5, size=(classes, features))
    data = {}
    for i, d in enumerate(devices):
        if skew:
            y = np.where(rng.random(per_device) < 0.8, i % classes, rng.integers(0, classes, per_device))
        else:
            y = rng.integers(0, classes, per_device)
        x = means[y] + rng.normal(size=(per_device, features))
        data[d] = (x.astype(np.float32), y.astype(np.int64))
    return data


def init_params(features: int = 6, classes: int = 3, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"W": (0.1 * rng.normal(size=(features, classes))).astype(np.float32),
            "b": np.zeros(classes, np.float32)}


def gradient(params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
    W, b = params["W"].astype(np.float64), params["b"].astype(np.float64)
    logits = x.astype(np.float64) @ W + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.mean(np.log(p[np.arange(len(y)), y] + 1e-300)))
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return {"W": (x.T.astype(np.float64) @ p).astype(np.float32), "b": p.sum(axis=0).astype(np.float32)}, loss


def loss(params: Mapping[str, np.ndarray], data: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> float:
    """The device-uniform objective (1/N) sum_n F_n(w)."""
    return float(np.mean([gradient(params, x, y)[1] for x, y in data.values()]))


class NumpyCompute:
    """What a device shell does for ``LocalTrain`` and ``ComputeGradient``, in numpy."""

    def __init__(self, data: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.data = data

    def batch(self, device: str, batch_size: int, labels: tuple[Any, ...]) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.data[device]
        idx = minibatch_indices(len(y), batch_size, 1, stream(*labels))[0]
        return x[idx], y[idx]

    def grad(self, params: Mapping[str, np.ndarray], device: str, batch_size: int,
             labels: tuple[Any, ...]) -> tuple[dict[str, np.ndarray], float]:
        return gradient(params, *self.batch(device, batch_size, labels))

    def local_sgd(self, params: Mapping[str, np.ndarray], device: str, steps: int, batch_size: int, lr: float,
                  labels: tuple[Any, ...]) -> tuple[dict[str, np.ndarray], float]:
        x, y = self.data[device]
        w = {n: p.astype(np.float32).copy() for n, p in params.items()}
        losses = []
        for idx in minibatch_indices(len(y), batch_size, steps, stream(*labels)):
            g, batch_loss = gradient(w, x[idx], y[idx])
            w = {n: (w[n] - np.float32(lr) * g[n]).astype(np.float32) for n in w}
            losses.append(batch_loss)
        return {n: w[n] - params[n] for n in w}, float(np.mean(losses))

"""HSGD's split model in numpy: two encoders and a combined head (seed 000 §1, §8's fixture).

Why numpy: HSGD's two sides train different blocks of one model against *stale partner inputs*
(the host on the devices' embeddings ``Z2``, a device on the host's ``zeta1`` and a frozen head
``theta0``). These few dense layers are the reference every backend is checked against (the
digest's A4: one HSGD iteration at ``P = Q = 1, alpha = 1`` is one step of centralized SGD), and
they are the trainer a torch-free, onnxruntime-free node runs.

The model (tensor names are the wire names; blocks are named by their prefix):

* ``theta1`` — host encoder ``zeta1 = relu(X1 @ theta1/w.T + theta1/b)``, width ``d1``;
* ``theta2`` — device encoder ``zeta2 = relu(X2 @ theta2/w.T + theta2/b)``, width ``d2``;
* ``theta0`` — head ``logits = [zeta1, zeta2] @ theta0/w.T + theta0/b`` with softmax
  cross-entropy over ``classes`` (the loss ``f(theta0, zeta1, zeta2; y)``).

Arithmetic is float64 inside; parameters go in and come out float32 (the wire's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from fedtier.errors import LocalProtocolError
from fedtier.rng import stream

Tensors = Mapping[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class SplitArch:
    """Sizes of the split model: feature blocks ``x1``/``x2``, embedding widths ``d1``/``d2``."""

    x1: int
    x2: int
    d1: int
    d2: int
    classes: int

    def __post_init__(self) -> None:
        for name in ("x1", "x2", "d1", "d2"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise LocalProtocolError(f"split arch {name} must be an int >= 1, got {getattr(self, name)!r}")
        if not (isinstance(self.classes, int) and self.classes >= 2):
            raise LocalProtocolError(f"split arch classes must be an int >= 2, got {self.classes!r}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {"theta0/w": (self.classes, self.d1 + self.d2), "theta0/b": (self.classes,),
                "theta1/w": (self.d1, self.x1), "theta1/b": (self.d1,),
                "theta2/w": (self.d2, self.x2), "theta2/b": (self.d2,)}

    def block_size(self, block: str) -> int:
        return sum(int(np.prod(s)) for n, s in self.shapes().items() if n.startswith(f"{block}/"))


def block(params: Tensors, name: str) -> dict[str, np.ndarray]:
    """The tensors of block ``name`` (``theta0``/``theta1``/``theta2``) of ``params``."""
    return {k: v for k, v in params.items() if k.startswith(f"{name}/")}


def init_params(arch: SplitArch, seed: int) -> dict[str, np.ndarray]:
    """PyTorch-style uniform(+-1/sqrt(fan_in)) initialisation from stream ``(seed, "split-init")``."""
    rng = stream(seed, "split-init")
    out = {}
    for name, shape in arch.shapes().items():
        fan_in = arch.shapes()[name.replace("/b", "/w")][1]
        bound = 1.0 / np.sqrt(fan_in)
        out[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return out


def _f64(params: Tensors) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}


def _f32(params: Tensors) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}


def embed(params: Tensors, which: str, x: np.ndarray) -> np.ndarray:
    """``relu(x @ w.T + b)`` of encoder ``which`` (``theta1`` or ``theta2``), float32 ``(n, d)``."""
    p = _f64(params)
    pre = np.asarray(x, np.float64) @ p[f"{which}/w"].T + p[f"{which}/b"]
    return np.maximum(pre, 0.0).astype(np.float32)


def _softmax_ce(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy and its gradient w.r.t. the logits."""
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    p = e / e.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(np.maximum(p[np.arange(n), y], 1e-300)).mean())
    g = p.copy()
    g[np.arange(n), y] -= 1.0
    return loss, g / n


def probabilities(params: Tensors, x1: np.ndarray, x2: np.ndarray) -> np.ndarray:
    """Softmax outputs of the whole model on rows ``(x1, x2)``."""
    p = _f64(params)
    h = np.concatenate([embed(params, "theta1", x1).astype(np.float64),
                        embed(params, "theta2", x2).astype(np.float64)], 1)
    logits = h @ p["theta0/w"].T + p["theta0/b"]
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def full_loss_grad(params: Tensors, x1: np.ndarray, x2: np.ndarray, y: np.ndarray,
                   weights: np.ndarray | None = None) -> tuple[float, dict[str, np.ndarray]]:
    """Loss ``sum_i w_i f_i`` (mean when ``weights`` is None) and its gradient for all three blocks (float64).

    The centralized split-model objective the digest's A4 compares against."""
    p = _f64(params)
    x1 = np.asarray(x1, np.float64)
    x2 = np.asarray(x2, np.float64)
    y = np.asarray(y, np.int64)
    n = len(y)
    w = np.full(n, 1.0 / n) if weights is None else np.asarray(weights, np.float64)
    pre1 = x1 @ p["theta1/w"].T + p["theta1/b"]
    pre2 = x2 @ p["theta2/w"].T + p["theta2/b"]
    h = np.concatenate([np.maximum(pre1, 0), np.maximum(pre2, 0)], 1)
    logits = h @ p["theta0/w"].T + p["theta0/b"]
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    prob = e / e.sum(axis=1, keepdims=True)
    losses = -np.log(np.maximum(prob[np.arange(n), y], 1e-300))
    g = prob.copy()
    g[np.arange(n), y] -= 1.0
    g *= w[:, None]
    d1 = p["theta1/w"].shape[0]
    dh = g @ p["theta0/w"]
    dpre1 = dh[:, :d1] * (pre1 > 0)
    dpre2 = dh[:, d1:] * (pre2 > 0)
    grads = {"theta0/w": g.T @ h, "theta0/b": g.sum(0), "theta1/w": dpre1.T @ x1, "theta1/b": dpre1.sum(0),
             "theta2/w": dpre2.T @ x2, "theta2/b": dpre2.sum(0)}
    return float((w * losses).sum()), grads


def host_grad(params: Tensors, x1: np.ndarray, z2: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """The host's loss and gradient w.r.t. ``theta0`` and ``theta1`` on its batch, the devices'
    embeddings ``z2`` held fixed (eqs. (5)-(6): no gradient flows back to a device)."""
    p = _f64(params)
    x1 = np.asarray(x1, np.float64)
    pre1 = x1 @ p["theta1/w"].T + p["theta1/b"]
    h = np.concatenate([np.maximum(pre1, 0), np.asarray(z2, np.float64)], 1)
    loss, g = _softmax_ce(h @ p["theta0/w"].T + p["theta0/b"], np.asarray(y, np.int64))
    d1 = p["theta1/w"].shape[0]
    dpre1 = (g @ p["theta0/w"])[:, :d1] * (pre1 > 0)
    return loss, {"theta0/w": g.T @ h, "theta0/b": g.sum(0), "theta1/w": dpre1.T @ x1, "theta1/b": dpre1.sum(0)}


def device_grad(theta2: Tensors, theta0: Tensors, zeta1: np.ndarray, x2: np.ndarray,
                y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """A device's loss and gradient w.r.t. ``theta2`` only, with the head ``theta0`` frozen and the
    host's embedding ``zeta1`` held fixed (eq. (7))."""
    p = _f64({**theta2, **theta0})
    x2 = np.asarray(x2, np.float64)
    pre2 = x2 @ p["theta2/w"].T + p["theta2/b"]
    h = np.concatenate([np.asarray(zeta1, np.float64), np.maximum(pre2, 0)], 1)
    loss, g = _softmax_ce(h @ p["theta0/w"].T + p["theta0/b"], np.asarray(y, np.int64))
    d1 = np.shape(zeta1)[1]
    dpre2 = (g @ p["theta0/w"])[:, d1:] * (pre2 > 0)
    return loss, {"theta2/w": dpre2.T @ x2, "theta2/b": dpre2.sum(0)}


def host_train(params: Tensors, x1: np.ndarray, z2: np.ndarray, y: np.ndarray, steps: int,
               lr: float) -> tuple[dict[str, np.ndarray], float]:
    """``steps`` SGD steps of the host on one batch (the same rows and the same stale ``z2`` every
    step; ``zeta1`` recomputed with the current ``theta1``). Returns (params, mean loss)."""
    p = _f64(params)
    losses = []
    for _ in range(steps):
        loss, g = host_grad(p, x1, z2, y)
        losses.append(loss)
        p = {k: p[k] - lr * g[k] if k in g else p[k] for k in p}
    return _f32(p), float(np.mean(losses)) if losses else 0.0


def device_train(theta2: Tensors, theta0: Tensors, zeta1: np.ndarray, x2: np.ndarray, y: np.ndarray, steps: int,
                 lr: float) -> tuple[dict[str, np.ndarray], float]:
    """``steps`` SGD steps of a device on its rows with frozen ``theta0`` and stale ``zeta1``."""
    p = _f64(theta2)
    losses = []
    for _ in range(steps):
        loss, g = device_grad(p, theta0, zeta1, x2, y)
        losses.append(loss)
        p = {k: p[k] - lr * g[k] for k in p}
    return _f32(p), float(np.mean(losses)) if losses else 0.0


class SplitTrainer:
    """A node's local side of the split model: its feature rows by sample id and their labels.

    The host holds ``X1`` rows of every sample of its cell; a device its one ``X2`` row. The shell
    hands HSGD's ``Embed`` and ``SplitTrain`` actions to ``embed`` and ``train``."""

    def __init__(self, x: Mapping[str, np.ndarray], y: Mapping[str, int]) -> None:
        if set(x) != set(y):
            raise LocalProtocolError("split trainer: every row needs a label")
        self.x = {k: np.asarray(v, np.float64).reshape(-1) for k, v in x.items()}
        self.y = {k: int(v) for k, v in y.items()}

    def _rows(self, rows: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        unknown = [r for r in rows if r not in self.x]
        if unknown:
            raise LocalProtocolError(f"split trainer holds no rows {unknown[:5]}")
        if not rows:
            return np.zeros((0, 0)), np.zeros(0, np.int64)
        return np.stack([self.x[r] for r in rows]), np.array([self.y[r] for r in rows], np.int64)

    def embed(self, block_name: str, params: Tensors, rows: tuple[str, ...]) -> np.ndarray:
        x, _ = self._rows(rows)
        if not rows:
            return np.zeros((0, np.shape(params[f"{block_name}/w"])[0]), np.float32)
        return embed(params, block_name, x)

    def train(self, side: str, params: Tensors, frozen: Tensors, partner: np.ndarray, rows: tuple[str, ...],
              steps: int, lr: float) -> tuple[dict[str, np.ndarray], float]:
        if not rows or steps == 0:
            return {k: np.asarray(v, np.float32) for k, v in params.items()}, 0.0
        x, y = self._rows(rows)
        if side == "host":
            return host_train(params, x, partner, y, steps, lr)
        if side == "device":
            return device_train(params, frozen, partner, x, y, steps, lr)
        raise LocalProtocolError(f"unknown split side {side!r}")

"""Pairwise X-risk losses and the active/passive decomposition of their gradient (pure numpy).

"FeDXL: Provable Federated Learning for Deep X-Risk Optimization" (Guo, Jin, Luo, Yang, ICML
2023) minimises risks that couple a positive ``z`` with a negative ``z'`` through their scores
``a = h(w, z)``, ``b = h(w, z')`` (Eq. 1):

    F(w) = E_{z in S1} f( g(w, z) ),     g(w, z) = E_{z' in S2} l(h(w, z), h(w, z'))

Two objectives are implemented:

* ``auroc`` (FeDXL1, linear ``f(x) = x``): the pairwise squared hinge
  ``l(a, b) = (m - a + b)_+^2`` (the corrected Eq. 14 hinge, the paper's AUROC surrogate family);
* ``psm`` (FeDXL1, linear ``f``): the pairwise sigmoid loss ``l(a, b) = (1 + exp(a - b))^-1 = sigmoid(b - a)``,
  symmetric (``l(a, b) + l(b, a) = 1``) and so robust to corrupted labels — the loss of the paper's Table 3
  (20 % corrupted labels);
* ``pauc`` (FeDXL2, nonlinear ``f``): KL-OPAUC, one-way partial AUROC through KL-DRO,
  ``l(a, b) = exp((m - a + b)_+^2 / lambda)`` and ``f(x) = lambda log x`` (Eq. 14 and App. B Eq. 17,
  with the sign corrected: negatives scored near or above positives are penalised).

The scores are ``h = sigmoid(model output)``, as in the authors' code.

The decomposition (Eq. 4-6, 10, 12-13; the mini-batch form every device runs): per step a device
draws ``B1`` local positives (scores ``s_pos``) and ``B2`` local negatives (``s_neg``) — the
*active* part, scored with its current model — and ``B2`` passive negative scores ``q_neg`` and
``B1`` passive positive scores ``q_pos`` with their inner-function estimates ``u_passive`` from the
pool of the previous round (other devices' data, never moved). Then

    coef_pos[a] = (1/B1) w_a     mean_c d1 l(s_pos[a], q_neg[c])          (multiplies grad h(x_a))
    coef_neg[b] = (1/B2) mean_e  wbar_e d2 l(q_pos[e], s_neg[b])         (multiplies grad h(x_b))

with ``w_a = f'(u[a])`` (``u`` the device's own moving average of ``g`` for its positives, Eq. 11)
and ``wbar_e = f'(u_passive[e])``; for linear ``f`` both are 1. The step's gradient is
``grad_w sum_n coef_n h(w, x_n)`` with the coefficients held constant — the gradient of a weighted
sum of scores, which is what the device's training graph computes (``models.artifacts``: loss
``weighted_score``). Every function here is pure: no I/O, no randomness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedtier.errors import LocalProtocolError

OBJECTIVES = ("auroc", "pauc", "psm")
"""``auroc``: FeDXL1 with the squared hinge; ``pauc``: FeDXL2 with KL-OPAUC; ``psm``: FeDXL1 with the
pairwise sigmoid loss."""


def sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))`` in float64 without overflow warnings for large ``|z|``."""
    z = np.asarray(z, dtype=np.float64)
    out = np.empty_like(z)
    pos = z >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-z[pos]))
    e = np.exp(z[~pos])
    out[~pos] = e / (1.0 + e)
    return out


@dataclass(frozen=True, slots=True)
class Objective:
    """A pairwise loss ``l(a, b)`` on (positive score, negative score) and its outer function ``f``.

    Attributes:
        name: ``auroc`` or ``pauc``.
        margin: ``m`` of the hinge ``(m - a + b)_+`` (1 in the paper).
        lam: ``lambda`` of KL-OPAUC (the FPR tolerance knob; tuned in [1, 5] in the paper).
    """

    name: str
    margin: float = 1.0
    lam: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise LocalProtocolError(f"unknown X-risk objective {self.name!r}; one of {OBJECTIVES}")
        if not (math.isfinite(self.margin) and self.margin > 0):
            raise LocalProtocolError(f"margin must be finite and > 0, got {self.margin!r}")
        if not (math.isfinite(self.lam) and self.lam > 0):
            raise LocalProtocolError(f"lam must be finite and > 0, got {self.lam!r}")

    @property
    def compositional(self) -> bool:
        """Nonlinear ``f`` (FeDXL2): devices track ``u`` and the passive pool carries it."""
        return self.name == "pauc"

    def _hinge(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.maximum(self.margin - np.asarray(a, np.float64) + np.asarray(b, np.float64), 0.0)

    def pair(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``l(a, b)`` elementwise (broadcasting)."""
        if self.name == "psm":
            return sigmoid(np.asarray(b, np.float64) - np.asarray(a, np.float64))
        t = self._hinge(a, b)
        return t * t if self.name == "auroc" else np.exp(t * t / self.lam)

    def pair_grads(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(d l / d a, d l / d b)`` elementwise: ``-/+ 2t`` (squared hinge), ``-/+ 2t/lambda exp(t^2/lambda)``
        (KL-OPAUC), ``-/+ sigmoid(b - a) (1 - sigmoid(b - a))`` (PSM). The positive's score is pushed up, the
        negative's down."""
        if self.name == "psm":
            p = sigmoid(np.asarray(b, np.float64) - np.asarray(a, np.float64))
            d = p * (1.0 - p)
            return -d, d
        t = self._hinge(a, b)
        if self.name == "auroc":
            db = 2.0 * t
        else:
            db = (2.0 * t / self.lam) * np.exp(t * t / self.lam)
        return -db, db

    def outer(self, x: np.ndarray) -> np.ndarray:
        """``f(x)``: ``x`` (linear) or ``lambda log x``."""
        x = np.asarray(x, np.float64)
        return self.lam * np.log(x) if self.compositional else x

    def outer_grad(self, u: np.ndarray) -> np.ndarray:
        """``f'(u)``: 1 (linear) or ``lambda / u``. ``u`` of KL-OPAUC is at least 1 in exact arithmetic
        (``l >= 1``, ``u`` starts at 1); it is floored there so a rounding error cannot blow up a weight."""
        u = np.asarray(u, np.float64)
        if not self.compositional:
            return np.ones_like(u)
        return self.lam / np.maximum(u, 1.0)

    @property
    def u_init(self) -> float:
        """Initial ``u`` of every local positive: 1, the smallest value of KL-OPAUC's ``l`` (the authors' code;
        the paper's Algorithm 2 writes 0, which ``f'(u) = lambda / u`` cannot take: the first positive's weight
        would be infinite). docs/fedxl.md says so too."""
        return 1.0


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """One step's active/passive terms.

    Attributes:
        coef_pos: ``(B1,)`` coefficients of the active positives' scores.
        coef_neg: ``(B2,)`` coefficients of the active negatives' scores.
        pairs: how many (active, passive) pairs the step formed.
        value: mean pairwise loss over those pairs (for the training-loss report; 0 without pairs).
    """

    coef_pos: np.ndarray
    coef_neg: np.ndarray
    pairs: int
    value: float


def inner_estimates(objective: Objective, s_pos: np.ndarray, q_neg: np.ndarray) -> np.ndarray:
    """``g_a = mean_c l(s_pos[a], q_neg[c])`` for each active positive: the mini-batch estimate of the
    inner function with passive negatives (all devices' negatives), which ``u`` tracks (Eq. 11).

    Returns:
        ``(B1,)`` float64; empty when there are no passive negatives (nothing to estimate with).
    """
    s_pos, q_neg = np.asarray(s_pos, np.float64), np.asarray(q_neg, np.float64)
    if s_pos.size == 0 or q_neg.size == 0:
        return np.zeros(0)
    return np.asarray(objective.pair(s_pos[:, None], q_neg[None, :]).mean(axis=1))


def update_u(u: dict[int, float], rows: np.ndarray, g: np.ndarray, gamma: float, init: float) -> np.ndarray:
    """Eq. 11 (as Eq. 30 writes it): ``u(z) <- (1 - gamma) u(z) + gamma g_z`` for each sampled positive,
    in order (a row drawn twice is updated twice); returns the updated ``u`` of each draw.

    ``u`` is the device's persistent table (row index -> value), changed in place: it is the device's
    own state, like its data.
    """
    out = np.empty(len(rows), np.float64)
    for i, (row, value) in enumerate(zip(rows.tolist(), g.tolist(), strict=True)):
        current = u.get(int(row), init)
        current = (1.0 - gamma) * current + gamma * value
        u[int(row)] = current
        out[i] = current
    return out


def step_coefficients(objective: Objective, *, s_pos: np.ndarray, s_neg: np.ndarray, q_neg: np.ndarray,
                      q_pos: np.ndarray, weight_pos: np.ndarray, weight_passive: np.ndarray) -> StepCoefficients:
    """The coefficients of one step (module docstring; Eq. 5-6 for FeDXL1, 12-13 for FeDXL2).

    Args:
        objective: the loss.
        s_pos: ``(B1,)`` active positive scores (current local model).
        s_neg: ``(B2,)`` active negative scores.
        q_neg: passive negative scores (the previous round's pool, any count).
        q_pos: passive positive scores.
        weight_pos: ``f'(u)`` of each active positive (ones for linear ``f``).
        weight_passive: ``f'(u)`` of each passive positive, aligned with ``q_pos``.

    Returns:
        The coefficients; a side without partners (no passive scores of the other class, or no
        active scores) gets zero coefficients: with no pair there is no gradient.
    """
    s_pos, s_neg = np.asarray(s_pos, np.float64), np.asarray(s_neg, np.float64)
    q_neg, q_pos = np.asarray(q_neg, np.float64), np.asarray(q_pos, np.float64)
    if len(q_pos) != len(weight_passive) or len(s_pos) != len(weight_pos):
        raise LocalProtocolError("passive positives and their weights differ in length")
    coef_pos = np.zeros(len(s_pos))
    coef_neg = np.zeros(len(s_neg))
    pairs, total = 0, 0.0
    if len(s_pos) and len(q_neg):
        da, _ = objective.pair_grads(s_pos[:, None], q_neg[None, :])
        coef_pos = np.asarray(weight_pos, np.float64) * da.mean(axis=1) / len(s_pos)
        pairs += da.size
        total += float(objective.pair(s_pos[:, None], q_neg[None, :]).sum())
    if len(s_neg) and len(q_pos):
        _, db = objective.pair_grads(q_pos[:, None], s_neg[None, :])
        coef_neg = (np.asarray(weight_passive, np.float64)[:, None] * db).mean(axis=0) / len(s_neg)
        pairs += db.size
        total += float(objective.pair(q_pos[:, None], s_neg[None, :]).sum())
    return StepCoefficients(coef_pos=coef_pos, coef_neg=coef_neg, pairs=pairs, value=total / pairs if pairs else 0.0)


def score_weights(coef: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """The training graph's weights for coefficients on ``h = sigmoid(output)``: ``coef * h (1 - h)``
    (the chain rule through the sigmoid, done here so the graph's loss is ``sum weights * output``)."""
    s = np.asarray(scores, np.float64)
    return np.asarray(coef, np.float64) * s * (1.0 - s)


__all__ = [
    "OBJECTIVES",
    "Objective",
    "StepCoefficients",
    "inner_estimates",
    "score_weights",
    "sigmoid",
    "step_coefficients",
    "update_u",
]

"""Ranking metrics of a binary task: AUROC and partial AUROC, for every algorithm's evaluation.

Accuracy says little on imbalanced data (a model that calls everything negative is 0.83 accurate
at 1:5); what X-risk training (FeDXL, "FeDXL: Provable Federated Learning for Deep X-Risk
Optimization") optimizes, and what its paper reports, is AUROC and the one-way partial AUROC at a
false-positive rate of at most 0.3 and 0.5. They are computed here, on the coordinator's test set, with
scikit-learn's ``roc_auc_score`` (devices stay free of scikit-learn: each ranks its own held-out rows with
numpy, ``fedtier.training.ranking``): with ``max_fpr`` it returns the
McClish-standardized partial AUC, ``(1 + (pAUC - min) / (max - min)) / 2`` with ``min = max_fpr^2 / 2``
and ``max = max_fpr`` — 0.5 for a random ranking, 1 for a perfect one, the scale of the paper's Table 2.

Any model of a binary task has a score: the logit of a one-output model (``bce``, or an X-risk
scorer's ``weighted_score``), and ``logit_1 - logit_0`` of a two-class classifier (monotone in its
softmax probability of class 1), so FedAvg with cross-entropy is ranked the same way
(``binary_scores``, from ``fedtier.training.ranking``, which devices use to rank their held-out rows).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedtier.training.ranking import binary_scores

PAUC_FPRS = (0.3, 0.5)
"""The false-positive rates the paper's partial AUROC is reported at."""

KEYS = ("auroc", *(f"pauc_{fpr}" for fpr in PAUC_FPRS))
"""Metric names in a round's row: ``auroc``, ``pauc_0.3``, ``pauc_0.5``."""

__all__ = ["KEYS", "PAUC_FPRS", "binary_scores", "is_binary", "ranking_metrics"]


def ranking_metrics(labels: Any, scores: Any) -> dict[str, float] | None:
    """AUROC and McClish-standardized partial AUROC (``max_fpr`` 0.3 and 0.5) of ``scores`` for 0/1 ``labels``.

    Returns:
        ``{"auroc": .., "pauc_0.3": .., "pauc_0.5": ..}``, or ``None`` when the labels are not binary
        or hold one class only (no ranking to measure).
    """
    from sklearn.metrics import roc_auc_score

    y = np.asarray(labels)
    s = np.asarray(scores, np.float64)
    if y.ndim != 1 or len(y) != len(s) or not np.isin(y, (0, 1)).all() or len(np.unique(y)) != 2:
        return None
    out = {"auroc": float(roc_auc_score(y, s))}
    for fpr in PAUC_FPRS:
        out[f"pauc_{fpr}"] = float(roc_auc_score(y, s, max_fpr=fpr))
    return out


def is_binary(labels: Any) -> bool:
    """Whether ``labels`` are 0/1 class labels with both classes present (a task these metrics fit)."""
    y = np.asarray(labels)
    return bool(y.ndim == 1 and len(y) > 0 and np.isin(y, (0, 1)).all() and len(np.unique(y)) == 2)

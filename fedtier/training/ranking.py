"""AUROC in numpy alone, for a device's held-out rows (devices stay free of scikit-learn).

A device with held-out rows of a binary task reports, with its federated evaluation, how well the global
model ranks them (``device_agent.node.DeviceNode.evaluate``). The coordinator ranks its central test set
with scikit-learn (``cloud_coordinator.metrics_eval``); this is the same number computed as the
Mann-Whitney U statistic: with the scores ranked from 1 (lowest) to ``n``, tied scores sharing the mean of
their ranks,

    AUROC = (sum of the positives' ranks - n1 (n1 + 1) / 2) / (n1 n0)

— the share of (positive, negative) pairs the model orders right, a tie counting one half, which is what
``sklearn.metrics.roc_auc_score`` integrates (``tests/unit/fedtier/training/test_ranking.py`` checks the two
agree to 1e-12 on random data with ties).

A model's score of a row is its output for a one-output model (``bce``, an X-risk scorer's
``weighted_score``) and ``logit_1 - logit_0`` for a two-class classifier (monotone in its softmax
probability of class 1), as the coordinator scores its test set.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def binary_scores(logits: Any) -> np.ndarray | None:
    """The positive-class score of each row: the logit of a one-output model, ``logit_1 - logit_0`` of a
    two-class classifier; ``None`` for more classes (not a binary task)."""
    out = np.asarray(logits, np.float64)
    if out.ndim != 2:
        return None
    if out.shape[1] == 1:
        return out[:, 0]
    if out.shape[1] == 2:
        return out[:, 1] - out[:, 0]
    return None


def binary_labels(labels: Any) -> np.ndarray | None:
    """``labels`` as a vector of 0/1 class labels holding both classes (a column of targets ``(n, 1)`` is
    taken as its vector); ``None`` when they are not: other classes, fractional targets, several outputs, or
    one class only (nothing to rank)."""
    y = np.asarray(labels)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or len(y) == 0 or not np.isin(y, (0, 1)).all():
        return None
    y = y.astype(np.int64)
    return y if 0 < int(y.sum()) < len(y) else None


def auroc(labels: Any, scores: Any) -> float | None:
    """The area under the ROC curve of ``scores`` for 0/1 ``labels`` (Mann-Whitney U with mid-ranks for ties).

    Returns:
        The AUROC in ``[0, 1]``, or ``None`` when the labels are not 0/1 with both classes present, the
        lengths differ, or a score is not finite.
    """
    y = binary_labels(labels)
    s = np.asarray(scores, np.float64)
    if y is None or s.ndim != 1 or len(s) != len(y) or not np.isfinite(s).all():
        return None
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts, dtype=np.float64)
    ranks = (ends - (counts - 1) / 2.0)[inverse]  # 1-based; a run of tied scores shares its mean rank
    positive = y == 1
    n1 = int(positive.sum())
    n0 = len(y) - n1
    u = float(ranks[positive].sum()) - n1 * (n1 + 1) / 2.0
    return u / (n1 * n0)

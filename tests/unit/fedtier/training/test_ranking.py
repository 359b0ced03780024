"""The devices' AUROC (numpy, Mann-Whitney U with mid-ranks) is scikit-learn's ``roc_auc_score``."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from fedtier.training import ranking


@pytest.mark.parametrize("seed", range(20))
def test_auroc_equals_sklearns_on_random_data_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 400))
    labels = rng.integers(0, 2, n)
    labels[:2] = [0, 1]  # both classes
    # continuous scores, or a few levels (many ties), or scores that separate the classes perfectly
    kind = seed % 3
    if kind == 0:
        scores = rng.standard_normal(n) + 0.7 * labels
    elif kind == 1:
        scores = rng.integers(0, 4, n).astype(np.float64) + labels * rng.integers(0, 2, n)
    else:
        scores = labels * 2.0 + rng.random(n)
    order = rng.permutation(n)
    labels, scores = labels[order], scores[order]

    ours = ranking.auroc(labels, scores)

    assert ours is not None
    assert abs(ours - roc_auc_score(labels, scores)) <= 1e-12


def test_auroc_of_perfect_reversed_and_constant_rankings() -> None:
    y = np.array([0, 0, 1, 1])
    assert ranking.auroc(y, [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert ranking.auroc(y, [0.4, 0.3, 0.2, 0.1]) == 0.0
    assert ranking.auroc(y, [5.0, 5.0, 5.0, 5.0]) == 0.5  # every pair a tie: one half each
    assert ranking.auroc(np.array([[1.0], [0.0]]), [2.0, 1.0]) == 1.0  # bce targets (n, 1)


def test_no_auroc_without_two_classes_or_with_bad_input() -> None:
    assert ranking.auroc([1, 1, 1], [0.1, 0.2, 0.3]) is None  # one class: nothing to rank
    assert ranking.auroc([0, 1, 2], [0.1, 0.2, 0.3]) is None  # not a binary task
    assert ranking.auroc([0.0, 0.5, 1.0], [0.1, 0.2, 0.3]) is None  # soft targets
    assert ranking.auroc([0, 1], [0.1, np.nan]) is None
    assert ranking.auroc([0, 1], [0.1, 0.2, 0.3]) is None
    assert ranking.auroc(np.zeros((2, 2)), [0.1, 0.2]) is None  # several outputs


def test_binary_scores_rank_by_the_positive_class() -> None:
    np.testing.assert_array_equal(ranking.binary_scores(np.array([[0.3], [-1.0]])), [0.3, -1.0])
    np.testing.assert_array_equal(ranking.binary_scores(np.array([[1.0, 3.0], [0.5, -1.0]])), [2.0, -1.5])
    assert ranking.binary_scores(np.zeros((2, 3))) is None and ranking.binary_scores(np.zeros(3)) is None

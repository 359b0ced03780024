"""cloud_coordinator.metrics_eval: AUROC and McClish-standardized partial AUROC of binary tasks, for every
algorithm (the digest's check 10, first part)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cloud_coordinator import metrics_eval


def reference_pauc(labels: np.ndarray, scores: np.ndarray, max_fpr: float) -> float:
    """Partial AUROC up to ``max_fpr``, McClish-standardized, written out: the ROC curve over distinct
    thresholds (ties move together), trapezoids up to ``max_fpr`` (interpolated there), then
    ``(1 + (A - min) / (max - min)) / 2`` with ``min = max_fpr^2 / 2``, ``max = max_fpr``."""
    order = np.argsort(-scores, kind="stable")
    s, y = scores[order], labels[order]
    distinct = np.flatnonzero(np.diff(s)) if len(s) > 1 else np.zeros(0, int)
    ends = np.concatenate([distinct, [len(s) - 1]])
    tps = np.cumsum(y)[ends]
    fps = (ends + 1) - tps
    tpr = np.concatenate([[0.0], tps / y.sum()])
    fpr = np.concatenate([[0.0], fps / (len(y) - y.sum())])
    area = 0.0
    for i in range(1, len(fpr)):
        lo, hi = fpr[i - 1], min(fpr[i], max_fpr)
        if hi <= lo:
            if fpr[i - 1] >= max_fpr:
                break
            continue
        slope = (tpr[i] - tpr[i - 1]) / (fpr[i] - fpr[i - 1])
        t_hi = tpr[i - 1] + slope * (hi - lo)
        area += (hi - lo) * (tpr[i - 1] + t_hi) / 2
        if fpr[i] >= max_fpr:
            break
    lo_area, hi_area = max_fpr * max_fpr / 2, max_fpr
    return 0.5 * (1 + (area - lo_area) / (hi_area - lo_area))


def reference_auroc(labels: np.ndarray, scores: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties counting one half."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
                 / (len(pos) * len(neg)))


def ranked_case(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random binary labels (both classes present) and scores that separate them partly; odd seeds round the
    scores, so that ties occur."""
    gen = np.random.default_rng(seed)
    n = int(gen.integers(20, 400))
    labels = (gen.random(n) < gen.uniform(0.1, 0.5)).astype(np.int64)
    labels[:2] = (0, 1)
    scores = gen.normal(size=n) + labels * gen.uniform(0, 2)
    return labels, np.round(scores, 1) if seed % 2 else scores


@pytest.mark.parametrize("seed", range(6))
def test_ranking_metrics_equal_the_written_out_definitions(seed: int) -> None:
    labels, scores = ranked_case(seed)
    metrics = metrics_eval.ranking_metrics(labels, scores)
    assert metrics is not None and set(metrics) == set(metrics_eval.KEYS)
    assert metrics["auroc"] == pytest.approx(reference_auroc(labels, scores), abs=1e-9)
    for fpr in metrics_eval.PAUC_FPRS:
        assert metrics[f"pauc_{fpr}"] == pytest.approx(reference_pauc(labels, scores, fpr), abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_ranking_metrics_equal_scikit_learns(seed: int) -> None:
    from sklearn.metrics import roc_auc_score

    labels, scores = ranked_case(100 + seed)
    metrics = metrics_eval.ranking_metrics(labels, scores)
    assert metrics is not None
    assert metrics["auroc"] == pytest.approx(roc_auc_score(labels, scores), abs=1e-9)
    for fpr in metrics_eval.PAUC_FPRS:  # scikit-learn's max_fpr is McClish-standardized too
        assert metrics[f"pauc_{fpr}"] == pytest.approx(roc_auc_score(labels, scores, max_fpr=fpr), abs=1e-9)


def test_perfect_random_and_reversed_rankings() -> None:
    labels = np.array([0, 0, 0, 1, 1, 1])
    perfect = metrics_eval.ranking_metrics(labels, np.arange(6.0))
    reversed_ = metrics_eval.ranking_metrics(labels, -np.arange(6.0))
    tied = metrics_eval.ranking_metrics(labels, np.zeros(6))
    assert perfect == {"auroc": 1.0, "pauc_0.3": 1.0, "pauc_0.5": 1.0}
    assert reversed_ is not None and reversed_["auroc"] == 0.0
    assert tied == {"auroc": 0.5, "pauc_0.3": 0.5, "pauc_0.5": 0.5}


def test_scores_of_every_kind_of_binary_model() -> None:
    one_output = np.array([[0.3], [-1.0]])
    two_classes = np.array([[1.0, 3.0], [2.0, 0.5]])
    np.testing.assert_array_equal(metrics_eval.binary_scores(one_output), [0.3, -1.0])
    np.testing.assert_array_equal(metrics_eval.binary_scores(two_classes), [2.0, -1.5])
    assert metrics_eval.binary_scores(np.zeros((2, 3))) is None


def test_no_ranking_for_a_task_that_is_not_binary() -> None:
    assert metrics_eval.ranking_metrics(np.array([0, 1, 2]), np.zeros(3)) is None
    assert metrics_eval.ranking_metrics(np.array([1, 1, 1]), np.zeros(3)) is None
    assert not metrics_eval.is_binary(np.array([0, 2])) and metrics_eval.is_binary(np.array([1, 0]))


def test_every_algorithm_reports_auroc_on_a_binary_task(small_rollout, tmp_path: Path) -> None:
    """FedAvg with cross-entropy (a two-class classifier) and FeDXL (a scorer) both rank the test set every round;
    digits (ten classes) does not."""
    from local_fleet.simulate import simulate

    data = {"dataset": "rare_event", "partition": "iid", "samples": 600, "features": 10}
    fedavg = simulate(small_rollout(rounds=3, data=data, model={"hidden": []}, fedavg={"lr": 0.3}))
    fedxl = simulate(small_rollout(rounds=3, algorithm="fedxl", data=data, model={"hidden": []},
                                   fedxl={"local_steps": 8, "batch_size": 4, "batch_neg": 8, "lr": 0.5}))
    digits = simulate(small_rollout(rounds=1))
    for result in (fedavg, fedxl):
        for row in result.rounds:
            assert set(metrics_eval.KEYS) <= set(row) and 0 <= row["auroc"] <= 1
    assert fedavg.rounds[-1]["auroc"] > 0.75 and fedxl.rounds[-1]["auroc"] > 0.75
    assert "auroc" not in digits.rounds[0]

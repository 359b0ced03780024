"""fedtier.algorithms.xrisk: the pairwise losses, their gradients, and the active/passive coefficients."""

from __future__ import annotations

import numpy as np
import pytest

from fedtier.algorithms import xrisk
from fedtier.errors import LocalProtocolError

AUROC = xrisk.Objective("auroc", margin=1.0)
PAUC = xrisk.Objective("pauc", margin=1.0, lam=2.0)


def test_the_losses_are_the_corrected_eq14_forms() -> None:
    # Prepare: a positive scored below, equal to and above a negative.
    a = np.array([0.2, 0.5, 0.9])
    b = np.array([0.6, 0.5, 0.1])
    t = np.maximum(1.0 - a + b, 0.0)
    # Assert: (m - a + b)_+^2 and exp((m - a + b)_+^2 / lambda): a negative near or above a positive costs more.
    np.testing.assert_allclose(AUROC.pair(a, b), t * t, rtol=0, atol=1e-15)
    np.testing.assert_allclose(PAUC.pair(a, b), np.exp(t * t / 2.0), rtol=1e-15)
    assert PAUC.pair(0.2, 0.6) > PAUC.pair(0.5, 0.5) > PAUC.pair(0.9, 0.1) >= 1.0
    np.testing.assert_allclose(PAUC.outer(np.array([1.0, np.e])), [0.0, 2.0])
    np.testing.assert_allclose(PAUC.outer_grad(np.array([1.0, 4.0])), [2.0, 0.5])
    np.testing.assert_allclose(AUROC.outer_grad(np.array([1.0, 4.0])), [1.0, 1.0])


@pytest.mark.parametrize("objective", [AUROC, PAUC], ids=["auroc", "pauc"])
def test_pair_gradients_match_finite_differences_and_push_positives_up(objective: xrisk.Objective) -> None:
    gen = np.random.default_rng(0)
    a, b = gen.uniform(0, 1, 50), gen.uniform(0, 1, 50)
    da, db = objective.pair_grads(a, b)
    eps = 1e-6
    np.testing.assert_allclose(da, (objective.pair(a + eps, b) - objective.pair(a - eps, b)) / (2 * eps),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(db, (objective.pair(a, b + eps) - objective.pair(a, b - eps)) / (2 * eps),
                               rtol=1e-5, atol=1e-7)
    # Descent on the loss raises the positive's score and lowers the negative's (margin 1 > any score gap).
    assert (da < 0).all() and (db > 0).all()


def test_step_coefficients_equal_a_double_loop_over_pairs() -> None:
    # Prepare: a step with 3 active positives, 2 active negatives, 4 passive negatives, 5 passive positives.
    gen = np.random.default_rng(1)
    s_pos, s_neg = gen.uniform(0, 1, 3), gen.uniform(0, 1, 2)
    q_neg, q_pos = gen.uniform(0, 1, 4), gen.uniform(0, 1, 5)
    w_pos, w_passive = gen.uniform(0.5, 2, 3), gen.uniform(0.5, 2, 5)
    # Execute
    c = xrisk.step_coefficients(PAUC, s_pos=s_pos, s_neg=s_neg, q_neg=q_neg, q_pos=q_pos, weight_pos=w_pos,
                                weight_passive=w_passive)
    # Assert: Eq. 12 / 13 written as loops, scaled 1/B1 and 1/B2.
    for i in range(3):
        expected = w_pos[i] * np.mean([PAUC.pair_grads(s_pos[i], q)[0] for q in q_neg]) / 3
        assert c.coef_pos[i] == pytest.approx(expected, rel=1e-12)
    for j in range(2):
        expected = np.mean([w * PAUC.pair_grads(q, s_neg[j])[1] for q, w in zip(q_pos, w_passive, strict=True)]) / 2
        assert c.coef_neg[j] == pytest.approx(expected, rel=1e-12)
    assert c.pairs == 3 * 4 + 5 * 2


def test_a_side_without_partners_gets_zero_coefficients() -> None:
    c = xrisk.step_coefficients(AUROC, s_pos=np.array([0.3, 0.4]), s_neg=np.zeros(0), q_neg=np.zeros(0),
                                q_pos=np.array([0.5]), weight_pos=np.ones(2), weight_passive=np.ones(1))
    assert c.coef_pos.tolist() == [0.0, 0.0] and c.coef_neg.size == 0 and c.pairs == 0 and c.value == 0.0


def test_u_is_a_sequential_moving_average_of_the_inner_estimates() -> None:
    # Prepare: row 7 drawn twice in one step, row 3 once; u starts at 1.
    table: dict[int, float] = {}
    rows = np.array([7, 3, 7])
    g = np.array([3.0, 2.0, 5.0])
    # Execute
    out = xrisk.update_u(table, rows, g, gamma=0.5, init=1.0)
    # Assert: Eq. 11 applied in order, the second draw of row 7 sees the first update.
    assert out.tolist() == [2.0, 1.5, 3.5]
    assert table == {7: 3.5, 3: 1.5}


def test_inner_estimates_are_the_mean_loss_against_the_passive_negatives() -> None:
    s_pos, q_neg = np.array([0.9, 0.1]), np.array([0.2, 0.4, 0.8])
    np.testing.assert_allclose(xrisk.inner_estimates(PAUC, s_pos, q_neg),
                               [np.mean(PAUC.pair(s, q_neg)) for s in s_pos], rtol=1e-15)
    assert xrisk.inner_estimates(PAUC, s_pos, np.zeros(0)).size == 0


def test_score_weights_apply_the_sigmoid_chain_rule() -> None:
    z = np.array([-2.0, 0.0, 3.0])
    s = xrisk.sigmoid(z)
    eps = 1e-6
    np.testing.assert_allclose(xrisk.score_weights(np.ones(3), s),
                               (xrisk.sigmoid(z + eps) - xrisk.sigmoid(z - eps)) / (2 * eps), rtol=1e-6)
    assert np.isfinite(xrisk.sigmoid(np.array([-1000.0, 1000.0]))).all()


def test_invalid_objectives_are_refused() -> None:
    for kwargs in ({"name": "ndcg"}, {"name": "auroc", "margin": 0.0}, {"name": "pauc", "lam": -1.0}):
        with pytest.raises(LocalProtocolError):
            xrisk.Objective(**kwargs)  # type: ignore[arg-type]

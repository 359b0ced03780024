"""Rollout configs for the quantized algorithms, and the planner wired into a rollout."""

from __future__ import annotations

import pytest

from fedtier.rollout.config import RolloutConfig
from fedtier.algorithms.qhetfed_plan import PlanInputs, plan
from local_fleet.simulate import simulate
from fedtier.algorithms.qhetfed import QHetFedConfig
from fedtier.errors import ConfigError

PLAN = {"t_cp": 1.0, "t_de": 2.0, "t_ec": 20.0, "round_budget_s": 60.0, "q1": 5.0}


def qhetfed(**plan_changes: object) -> RolloutConfig:
    return RolloutConfig.from_mapping({"algorithm": "qhetfed", "topology": {"cells": 2, "devices_per_cell": 3},
                                       "qhetfed": {"bits_device": 3, "plan": {**PLAN, **plan_changes}}})


def test_the_planned_tau_gamma_go_into_the_rollouts_config() -> None:
    cfg = qhetfed()
    expected = plan(PlanInputs(C=2, N=6, q1=5.0, t_cp=1.0, t_de=2.0, t_ec=20.0, round_budget_s=60.0))
    config = cfg.algorithm_config()
    assert isinstance(config, QHetFedConfig)
    assert (config.tau, config.gamma) == (expected.tau, expected.gamma)
    assert config.bits_device == 3


def test_the_replanner_follows_the_measured_q1_unless_told_not_to() -> None:
    low, high = qhetfed().replanner()(0.0), qhetfed().replanner()(50.0)
    assert (low.tau, low.gamma) != (high.tau, high.gamma)  # a = (C/N)(1+q1) crosses 1: the optimum moves
    frozen = qhetfed(replan=False).replanner()
    assert frozen(50.0) == frozen(None)


def test_an_infeasible_budget_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"qhetfed\.plan\.round_budget_s"):
        qhetfed(round_budget_s=10.0)


def test_one_bit_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"\[hier_qsgd\.bits_device\] 1 bit leaves QSGD no level"):
        RolloutConfig.from_mapping({"algorithm": "hier_qsgd", "hier_qsgd": {"bits_device": 1}})


def test_a_planned_qhetfed_rollout_records_its_plan_per_round(small_rollout) -> None:
    cfg = small_rollout(rounds=2, algorithm="qhetfed",
                        qhetfed={"lr": 0.2, "bits_device": 4, "plan": {**PLAN, "round_budget_s": 40.0}})
    result = simulate(cfg)
    taus = [r["config"]["tau"] for r in result.rounds]
    assert taus[0] == cfg.algorithm_config().tau
    assert all(r["q1"] > 0 for r in result.rounds)

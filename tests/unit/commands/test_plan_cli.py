"""commands.plan: `plan qhetfed`, invoked directly (it is not registered in `fedtier` yet)."""

from __future__ import annotations

import json
import math

import click
import pytest
from click.testing import CliRunner

from commands.plan import plan
from fedtier.algorithms.qhetfed_plan import PlanInputs
from fedtier.algorithms.qhetfed_plan import plan as make_plan

T_CP = 20 * (100 * 3072 * 8) / 1e9
T_DE = 591274 * 32 / (1e6 * math.log2(1 + 1e-8 * 0.5 / 1e-10))
T_EC = 10 * T_DE
ARGS = ["qhetfed", "--C", "3", "--N", "60", "--q1", "11.9", "--t-cp", repr(T_CP), "--t-de", repr(T_DE),
        "--t-ec", repr(T_EC), "--budget", "156"]


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(plan, list(args))
    return result.exit_code, result.output


def with_option(option: str, value: str) -> list[str]:
    args = list(ARGS)
    args[args.index(option) + 1] = value
    return args


def test_help_of_the_group_and_the_subcommand() -> None:
    code, out = run("--help")
    assert code == 0 and "qhetfed" in out

    code, out = run("qhetfed", "--help")
    assert code == 0
    for text in ("t_CP", "t_DE", "t_EC", "seconds", "--budget", "--mode", "--uploads", "--json"):
        assert text in out


def test_every_option_is_explained() -> None:
    assert isinstance(plan, click.Group)
    command = plan.commands["qhetfed"]
    for param in command.params:
        if isinstance(param, click.Option) and param.name != "help":
            assert param.help and len(param.help) > 20, param.name


def test_a_run_prints_tau_and_gamma() -> None:
    code, out = run(*ARGS)

    assert code == 0, out
    assert "tau (intra-set gradient rounds)   36" in out
    assert "gamma (local SGD steps)           16" in out
    assert "of 156 s budget" in out and "INFEASIBLE" not in out


def test_json_matches_the_library() -> None:
    code, out = run(*ARGS, "--json", "--uploads", "tau+1")

    assert code == 0, out
    doc = json.loads(out)
    inputs = PlanInputs(C=3, N=60, q1=11.9, t_cp=T_CP, t_de=T_DE, t_ec=T_EC, round_budget_s=156.0, uploads="tau+1")
    assert doc["plan"] == make_plan(inputs).to_json()
    assert PlanInputs(**doc["inputs"]) == inputs


def test_paper_mode_flags_the_infeasible_closed_form() -> None:
    code, out = run(*ARGS, "--mode", "paper")

    assert code == 0, out
    assert out.startswith("WARNING: INFEASIBLE")
    assert "36.4432" in out and "37.0941" in out
    doc = json.loads(run(*ARGS, "--mode", "paper", "--json")[1])
    assert doc["plan"]["feasible"] is False and doc["plan"]["mode"] == "paper"


@pytest.mark.parametrize(("option", "value"), [
    ("--N", "2"), ("--C", "0"), ("--q1", "-1"), ("--t-cp", "0"), ("--t-de", "-3"), ("--t-ec", "nan"),
    ("--budget", "0"),
])
def test_a_bad_value_exits_2_and_names_the_option(option: str, value: str) -> None:
    code, out = run(*with_option(option, value))

    assert code == 2
    assert f"Invalid value for '{option}'" in out


def test_a_budget_too_small_names_the_budget_and_the_minimum() -> None:
    code, out = run(*with_option("--budget", "30"))

    assert code == 2
    assert "'--budget'" in out and "minimum budget is 36.7896 s" in out


def test_unknown_mode_is_rejected_by_click() -> None:
    code, out = run(*ARGS, "--mode", "fast")
    assert code == 2 and "--mode" in out

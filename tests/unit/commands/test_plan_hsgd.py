"""`fedtier plan hsgd`: eq. (19) and strategies 1-3 on the digest's worked examples (A6, A7)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from commands.plan import plan


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(plan, ["hsgd", *args])
    return result.exit_code, result.output


def test_defaults_print_the_worked_examples_and_flag_strategy_2() -> None:
    code, out = run()
    assert code == 0, out
    assert "47640 values = 190560 bytes" in out
    assert "as printed (eta^2)               1.95789 -> 2" in out
    assert "as eq. (20) gives (eta^3)        19.5789 -> 20" in out
    assert "WARNING: strategy 2" in out


def test_json_carries_strategy_3_and_the_bound() -> None:
    code, out = run("--P", "20", "--Q", "10", "--delta", "1", "--grad-sq", "1", "--xi", "5", "--eta", "0.001",
                    "--iterations", "100000",
                    "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert abs(doc["plan"]["strategy3"]["eta2"] - 0.0018729) < 1e-6
    assert doc["plan"]["strategy3"]["eta_star"] == min(doc["plan"]["strategy3"]["eta2"], 1 / 160)
    assert doc["plan"]["strategy1"]["lambda_bound"] is not None and doc["plan"]["strategy1"]["xi_reachable"]
    code, out = run("--xi", "0.0001", "--json")
    assert json.loads(out)["plan"]["strategy1"]["xi_reachable"] is False


def test_p_must_be_a_multiple_of_q_and_help_has_an_example() -> None:
    code, out = run("--P", "6", "--Q", "4")
    assert code == 2 and "multiple" in out
    code, out = run("--help")
    assert code == 0 and "fedtier plan hsgd --P" in out

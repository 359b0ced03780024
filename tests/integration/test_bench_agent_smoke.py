"""The agent-footprint benchmark's harness at a tiny size: real agent processes through Mosquitto
(no timing asserted; ``benchmarks/bench_agent.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_helpers import load_benchmark
from conftest import mosquitto_binary, require

pytestmark = pytest.mark.broker


def test_two_rounds_measure_every_agent_and_the_ort_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require(mosquitto_binary() is not None, "Mosquitto")
    bench = load_benchmark("agent", tmp_path, monkeypatch)
    result = bench.main(["--devices", "2", "--rounds", "2", "--reps", "1", "--starts", "0", "--timeout", "240"])
    [one] = result["runs"]
    assert one["rounds"] == 2 and set(one["agents"]) == {"dev-00", "dev-01"} and one["bytecode"]
    for agent in one["agents"].values():
        # each agent was sampled while it ran, and its first update was seen on the broker
        assert agent["peak_rss_mb"] > 20 and agent["first_update_s"] is not None and agent["first_update_s"] > 0
    assert 0 < one["ort_session_baseline_mb"] < max(a["peak_rss_mb"] for a in one["agents"].values())
    assert result["above_runtime_mb"]["median"] > 0  # the agent's own stack costs something
    assert json.loads((tmp_path / "agent.json").read_text())["runs"][0]["rounds"] == 2
    assert result["first_update_s"]["seen"] == 2 and result["first_update_s"]["median"] > 0

"""``fedtier demo --algorithm fedavg`` with every strategy option, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import mosquitto_binary, require

pytestmark = pytest.mark.slow


def test_demo_takes_every_strategy_option_and_says_it_is_an_attack_run() -> None:
    require(mosquitto_binary() is not None, "Mosquitto")
    args = ["--algorithm", "fedavg", "--devices", "10", "--cells", "2", "--rounds", "3",
            "--edge-aggregator", "median", "--cloud-aggregator", "mean", "--server-optimizer", "adam",
            "--server-lr", "0.03", "--attack", "sign_flip", "--attack-fraction", "0.2", "--proximal-mu", "0.01",
            "--partial-work"]
    proc = subprocess.run([sys.executable, "-m", "fedtier", "demo", "--json", *args], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["attack"]["kind"] == "sign_flip" and len(doc["attack"]["devices"]) == 2
    assert doc["strategy"]["edge"]["rule"] == "median" and doc["strategy"]["server_optimizer"]["kind"] == "adam"
    assert len(doc["rounds"]) == 3 and all(r["devices_reported"] == 10 for r in doc["rounds"])
    assert all(r["attack"]["kind"] == "sign_flip" for r in doc["rounds"])
    assert doc["attack"]["note"].startswith("ATTACK RUN")  # (the narration, off under --json, says it too)


def test_demo_runs_fedbuff_asynchronously_and_learns() -> None:
    """``--algorithm fedbuff``: a version from every 2 cell updates of 3 deltas each; the model learns (digits,
    ten classes: 0.1 is chance) and every byte tier is counted."""
    require(mosquitto_binary() is not None, "Mosquitto")
    proc = subprocess.run([sys.executable, "-m", "fedtier", "demo", "--json", "--algorithm", "fedbuff", "--rounds",
                           "12"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    rounds = doc["rounds"]
    assert len(rounds) == 12 and all(r["devices_reported"] == 6 for r in rounds)
    assert rounds[-1]["accuracy"] > 0.6 > rounds[0]["accuracy"]
    assert all(r["bytes"]["device_up"] > 0 and r["bytes"]["edge_up"] > 0 for r in rounds)

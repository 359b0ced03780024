"""`fedtier simulate` with [fleet] traces (synchronous FedAvg) and with FedBuff: the trace simulator path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from local_fleet.simulate import simulate


def test_fedavg_under_a_diurnal_fleet_runs_on_the_virtual_clock(small_rollout, tmp_path: Path) -> None:
    cfg = small_rollout(rounds=3, fedavg={"local_steps": 10, "lr": 0.2, "quorum": 0.5, "deadline_s": 300},
                        topology={"cells": 2, "devices_per_cell": 4},
                        fleet={"availability": "diurnal", "share_online": 0.5, "compute_s": 60, "day_s": 3600},
                        metrics_file=str(tmp_path / "m.json"))
    result = simulate(cfg)
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["finished"] and len(result.rounds) == 3
    # Virtual time moves (rounds wait for training and deadlines); not every device reports every round.
    times = [r["time_s"] for r in result.rounds]
    assert times == sorted(times) and times[0] > 0
    assert all(1 <= r["devices_reported"] <= 8 for r in result.rounds)
    assert doc["fleet"]["availability"] == "diurnal" and doc["bytes"]["device_up"] > 0


def test_fedbuff_learns_in_simulate_and_is_deterministic(small_rollout) -> None:
    def cfg():  # type: ignore[no-untyped-def]
        return small_rollout(rounds=30, algorithm="fedbuff",
                             fedbuff={"local_steps": 10, "lr": 0.2, "batch_size": 16, "k_edge": 2, "k_cloud": 1},
                             fleet={"availability": "diurnal", "share_online": 0.5, "compute_s": 60, "day_s": 3600})
    a = simulate(cfg())
    acc = [r["accuracy"] for r in a.rounds]
    assert len(acc) == 30 and acc[-1] > 0.6 and acc[-1] > acc[0] + 0.2
    assert all(r["mean_staleness"] >= 0 for r in a.rounds)
    b = simulate(cfg())
    for name in a.params:
        assert np.array_equal(a.params[name], b.params[name])

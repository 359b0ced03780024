"""``fedtier simulate --backend ray``: the devices sharded over actors of a local Ray that the test starts,
the edges and the cloud in the driver; the final model and the bytes per tier equal the local backend's
for the same config and seeds (local_fleet/simulate_ray.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from bench_helpers import load_benchmark
from conftest import require

from local_fleet.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]


def _ray() -> Any:
    require(importlib.util.find_spec("ray") is not None, "Ray (pip install -e '.[all,dev]': fedtier[ray])")
    import ray

    return ray


def test_ray_backend_gives_the_local_model_for_the_digits_fedavg_config(small_rollout: Any, tmp_path: Path) -> None:
    ray = _ray()
    cfg = small_rollout(rounds=3, topology={"cells": 2, "devices_per_cell": 3})
    cfg = dataclasses.replace(cfg, metrics_file=tmp_path / "metrics.json")
    local = simulate(cfg)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        sharded = simulate(cfg, backend="ray", shards=2)  # 6 devices over 2 actors, the driver's Ray
        assert ray.is_initialized()  # a Ray the caller started is left running
    finally:
        ray.shutdown()

    assert [r["round"] for r in sharded.rounds] == [0, 1, 2]
    for name, value in local.params.items():
        np.testing.assert_allclose(sharded.params[name], value, rtol=0, atol=1e-5)
    initial = local.prepared.initial_params
    assert max(float(np.abs(local.params[k] - initial[k]).max()) for k in initial) > 1e-3  # the model moved
    assert [r["bytes"] for r in sharded.rounds] == [r["bytes"] for r in local.rounds]
    assert [r["accuracy"] for r in sharded.rounds] == [r["accuracy"] for r in local.rounds]


def test_simulate_cli_refuses_ray_options_without_the_ray_backend(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "fedtier", "simulate", "--config",
                           str(ROOT / "experiments" / "digits_fedavg.toml"), "--shards", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "only make sense with --backend ray" in done.stderr


def test_bench_ray_harness_runs_at_a_tiny_size(tmp_path: Path, monkeypatch: Any) -> None:
    """benchmarks/bench_ray.py at 20 devices, one repetition: both backends run and agree (no timing asserted)."""
    _ray()
    bench = load_benchmark("ray", tmp_path, monkeypatch)

    results = bench.main(["--sizes", "20", "--per-cell", "10", "--rounds", "1", "--reps", "1", "--name", "tiny"])

    (row,) = results["sizes"]
    assert row["devices"] == 20 and row["same_accuracy"]
    assert row["local"]["round_s"]["median"] > 0 and row["ray"]["setup_s"]["median"] > 0
    assert (tmp_path / "tiny.json").is_file()

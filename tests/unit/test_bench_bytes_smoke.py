"""The bytes-to-accuracy benchmark's harness at a tiny size (no timing; ``benchmarks/bench_bytes.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_helpers import load_benchmark


def test_bytes_are_summed_up_to_the_first_round_at_the_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("bytes", tmp_path, monkeypatch)
    rows = [{"round": r, "accuracy": acc, "bytes": {"device_up": 100, "edge_up": 10}}
            for r, acc in enumerate([0.5, 0.91, 0.95])]
    hit = bench.bytes_to_target(rows, 0.9)
    assert hit["reached"] and hit["round"] == 1 and hit["bytes"]["device_up"] == 200 and hit["bytes"]["edge_up"] == 20
    assert not bench.bytes_to_target(rows, 0.99)["reached"]


def test_quick_run_writes_results_and_counts_quantized_uplinks_smaller(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("bytes", tmp_path, monkeypatch)
    doc = bench.main(["--quick"])
    assert json.loads((tmp_path / "bytes.json").read_text())["target"] == doc["target"] == 0.9
    by_run = {r["run"]: r for r in doc["runs"]}
    f32, q4 = by_run["fedavg f32 (baseline)"]["bytes"], by_run["hier_qsgd 4/8 bits"]["bytes"]
    assert 0 < q4["device_up"] < 0.5 * f32["device_up"]  # 4-bit QSGD against float32, same rounds and devices

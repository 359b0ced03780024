"""The codec benchmark's harness at a tiny size: it runs, measures every encoding and size asked for, skips
what is above the memory cap, and writes its JSON (correctness of the harness only; no timing is asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bench_helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_bench_codec_runs_at_a_tiny_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("codec", tmp_path, monkeypatch)

    results = bench.main(["--reps", "2", "--params", "500", "--sizes", "2x100,5x50,100x100",
                          "--max-elements", "1000", "--name", "tiny", "--clock", "cpu"])

    written = json.loads((tmp_path / "tiny.json").read_text())
    assert written["machine"]["cpus"] >= 1
    assert set(bench.ENCODINGS) <= set(results["codec"]) and results["codec"]["params"] == 500
    # QSGD at fewer bits puts fewer bytes on the wire; f16 about half of f32
    sizes = {e: results["codec"][e]["bytes"] for e in bench.ENCODINGS}
    assert sizes["qsgd2"] < sizes["qsgd4"] < sizes["qsgd8"] < sizes["f16"] < sizes["f32"]
    assert [(r["n"], r["d"]) for r in results["aggregation"]] == [(2, 100), (5, 50), (100, 100)]
    assert "skipped" in results["aggregation"][2] and "f32" in results["aggregation"][0]
    assert all(r["qsgd4"]["fraction_of_numpy"] > 0 for r in results["aggregation"][:2])
    # both paths, and what bounds the new one, in every measured size (ratios taken within a repetition)
    for r in results["aggregation"][:2]:
        for name in ("f32_old", "qsgd4_old", "crc32_f32", "sha256_f32", "fold_alone", "codes_fold_alone", "numpy_sum"):
            assert r[name]["fraction_min"] <= r[name]["fraction_of_numpy"] <= r[name]["fraction_max"], name
    assert results["aggregation"][0]["numpy_sum"]["fraction_of_numpy"] == 1.0
    assert "load average" in written["load_before"] and "Machine load" in bench.table(results)
    assert written["clock"] == "cpu" and "Clock: cpu" in bench.table(results)
    assert set(results["digests"]) == {str(s) for s in bench.DIGEST_SIZES}
    assert all(v > 0 for speeds in results["digests"].values() for v in speeds.values())


def test_python_m_benchmarks_lists_and_refuses_unknown_names() -> None:
    import subprocess

    listed = subprocess.run([sys.executable, "-m", "benchmarks"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    unknown = subprocess.run([sys.executable, "-m", "benchmarks", "nope"], capture_output=True, text=True, cwd=ROOT,
                             timeout=60)

    assert listed.returncode == 0 and "codec" in listed.stdout and "fleet" in listed.stdout and "ray" in listed.stdout
    assert unknown.returncode == 2 and "no benchmark 'nope'" in unknown.stderr

"""Every benchmark without a smoke test of its own runs here at a tiny size: the harness works, measures
what it says, writes its JSON (and, where it publishes one, its table between its markers of the docs).
Correctness of the harness only; no timing is asserted."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from bench_helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def docs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of docs/benchmarks.md that the benchmark under test publishes into."""
    copy = tmp_path / "benchmarks.md"
    shutil.copy(ROOT / "docs" / "benchmarks.md", copy)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _common

    monkeypatch.setattr(_common, "DOCS", copy)
    return copy


def _block(text: str, name: str) -> str:
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    assert text.count(start) == 1 and text.count(end) == 1, f"docs/benchmarks.md must hold one {name} block"
    return text.split(start, 1)[1].split(end, 1)[0]


def test_trainer_benchmark_times_both_backends_at_every_batch_and_publishes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docs: Path) -> None:
    bench = load_benchmark("trainer", tmp_path, monkeypatch)
    before = docs.read_text()

    results = bench.main(["--reps", "2", "--steps", "3"])

    rows = results["steps_table"]
    assert [(r["model"], r["batch"]) for r in rows] == [(m, b) for m in bench.MODELS for b in bench.BATCHES]
    assert all(r[k]["wall_us"]["min"] <= r[k]["wall_us"]["median"] <= r[k]["wall_us"]["max"]
               for r in rows for k in bench.BACKENDS)
    parts = results["ort_breakdown"]["median_us"]
    assert parts["graph"] > 0 and parts["train_steps"] > 0
    assert results["imports"]["device stack with the shim, ORT training API"]["torch_imported"] is False
    assert json.loads((tmp_path / "trainer.json").read_text())["steps"] == 3
    block = _block(docs.read_text(), "trainer")
    assert "python -m benchmarks trainer --reps 2 --steps 3" in block and "| mlp 64-64-10 | 16 |" in block
    # only the block changed: the prose around it stays as people wrote it
    assert docs.read_text().split("<!-- bench:trainer -->")[0] == before.split("<!-- bench:trainer -->")[0]


def test_simulate_benchmark_reports_every_size_and_the_ratios(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docs: Path) -> None:
    bench = load_benchmark("simulate", tmp_path, monkeypatch)

    results = bench.main(["--sizes", "1x3,2x3", "--reps", "1", "--rounds", "1"])

    first, second = results["rows"]
    assert (first["devices"], second["devices"]) == (3, 6)
    assert first["per_device_time_vs_first"] == 1.0 and first["kb_per_device_beyond_first"] is None
    assert second["kb_per_device_beyond_first"] is not None and 0 <= second["final_accuracy"] <= 1
    assert "| 6 | 2 |" in _block(docs.read_text(), "simulate")


def test_secure_aggregation_benchmark_compares_plain_and_masked_rounds(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("secagg", tmp_path, monkeypatch)

    results = bench.main(["--sizes", "4", "--reps", "1", "--degree", "3"])

    (row,) = results["rows"]
    # masking costs bytes: the masked vectors, the keys and the shares go up besides the update
    assert row["secure"]["up_per_device"] > row["plain"]["up_per_device"] > 0
    assert (tmp_path / "secagg_bits48.json").exists()


def test_secure_noise_benchmark_times_both_generators(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("secure_noise", tmp_path, monkeypatch)

    results = bench.main(["--reps", "2", "--params", "1000", "--releases", "2"])

    assert set(results["seconds_per_release"]) == {"default", "secure"} and results["ratio_secure_over_default"] > 0


def test_backends_benchmark_runs_each_backend_in_its_own_process(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("backends", tmp_path, monkeypatch)
    if not bench.PORTABLE_PYTHON.exists():
        pytest.fail(f"{bench.PORTABLE_PYTHON} is missing: ./install.sh makes it")

    results = bench.main(["--reps", "1", "--steps", "3", "--models", "mlp 64-64-10", "--no-sizes"])

    row = results["models"]["mlp 64-64-10"]
    assert set(row) == set(bench.BACKENDS)
    assert row["torch"]["torch_imported"] and not row["ort"]["torch_imported"]
    assert row["portable"]["trainer"] == "PortableTrainer"


@pytest.mark.slow
@pytest.mark.fleet  # two demos, one after the other
def test_demo_benchmark_runs_the_demo_on_both_brokers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("mosquitto") is None:
        pytest.fail("mosquitto is not on PATH: ./install.sh installs it")
    bench = load_benchmark("demo", tmp_path, monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench_demo.py"])

    results = bench.main(["--repeat", "1", "--rounds", "2", "--devices", "2"])

    assert {"mosquitto", "embedded"} <= set(results)
    assert all(0 <= results[b]["median_final_accuracy"] <= 1 for b in ("mosquitto", "embedded"))

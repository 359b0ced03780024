"""``fedtier fleet emulate``: real device agents (all on one thread per worker, their sockets multiplexed, or a
thread each), real edges and coordinator, through the test's Mosquitto; every round closes with every device,
and the timings add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from local_fleet.emulator import EmulatorOptions, FleetEmulator
from process_helpers import alive, descendants

pytestmark = [pytest.mark.broker, pytest.mark.fleet]  # fleets of worker processes: one at a time


@pytest.mark.parametrize("loop", ["mux", "threads"])
def test_twenty_devices_in_two_cells_complete_their_rounds(mosquitto: Any, tmp_path: Path, loop: str) -> None:
    said: list[str] = []
    opts = EmulatorOptions(devices=20, cells=2, rounds=2, broker=f"{mosquitto.host}:{mosquitto.port}",
                           compute_delay_ms=20, workdir=tmp_path / "fleet", loop=loop)

    ram_before = set(Path("/dev/shm").glob("fedtier-fleet-devices-*"))

    result = FleetEmulator(opts, progress=said.append).run()

    # the devices kept their state on the RAM disk (each board's flash is its own), removed after the run
    assert (tmp_path / "fleet" / "devices").exists() != os.access("/dev/shm", os.W_OK)
    assert set(Path("/dev/shm").glob("fedtier-fleet-devices-*")) <= ram_before
    assert [r.round for r in result.rounds] == [0, 1]
    assert all(r.devices_reported == 20 for r in result.rounds)
    for r in result.rounds:
        # every device's run holds the simulated 20 ms; the round waited for its slowest device
        assert r.slowest_device_s >= 0.02 and r.round_s >= r.slowest_device_s > 0 and r.training_s > 0
        assert r.overhead_s == pytest.approx(r.round_s - r.slowest_device_s)
        # the breakdown: the edges decoded 20 updates and did their work, the coordinator committed the round
        assert 0 < r.edge_decode_s < r.edge_work_s and r.coordinator_s > 0
        assert r.rest_s == pytest.approx(r.round_s - r.training_s / r.workers - r.edge_work_s - r.coordinator_s)
    assert result.rounds[-1].accuracy is not None and result.rounds[-1].accuracy > 0.1  # ten classes: above chance
    assert any("round 0 closed: 20 devices" in line for line in said)
    assert (tmp_path / "fleet" / "configs" / "coordinator.toml").is_file()  # --workdir kept
    assert json.dumps(result.to_dict())


def test_fedbuff_runs_through_the_emulated_fleet_a_version_at_a_time(mosquitto: Any, tmp_path: Path) -> None:
    """``--algorithm fedbuff``: each version folds half of each cell's devices (k_edge = 5 of 10), one cell update
    per cell (k_cloud = 2), and the model learns; the deltas still in flight at the end are no warnings."""
    from fedtier.runtime.config import read_toml

    opts = EmulatorOptions(devices=20, cells=2, rounds=3, broker=f"{mosquitto.host}:{mosquitto.port}",
                           compute_delay_ms=5, workdir=tmp_path / "fleet", algorithm="fedbuff")

    result = FleetEmulator(opts, progress=None).run()

    section = read_toml(tmp_path / "fleet" / "configs" / "coordinator.toml")["fedbuff"]
    assert (section["k_edge"], section["k_cloud"], section["once_per_version"]) == (5, 2, True)
    assert [r.round for r in result.rounds] == [0, 1, 2]
    assert all(r.devices_reported == 10 for r in result.rounds)  # 2 cell updates of 5 deltas each
    assert result.rounds[-1].accuracy is not None and result.rounds[-1].accuracy > 0.1


def test_the_cli_refuses_more_cells_than_devices() -> None:
    done = subprocess.run([sys.executable, "-m", "fedtier", "fleet", "emulate", "--devices", "2", "--cells", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "at least one device per cell" in done.stderr


def test_bench_fleet_harness_runs_at_a_tiny_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/bench_fleet.py at 10 devices, one repetition (its own Mosquitto); no timing asserted."""
    from bench_helpers import load_benchmark

    bench = load_benchmark("fleet", tmp_path, monkeypatch)

    results = bench.main(["--sizes", "10", "--reps", "1", "--rounds", "2", "--name", "tiny"])

    (row,) = results["sizes"]
    assert row["devices"] == 10 and row["round_s"]["median"] > 0 and row["training_s"]["median"] > 0
    assert "| 10 | 1 of 1 |" in bench.table(results) and (tmp_path / "tiny.json").is_file()
    assert row["edge_work_s"]["median"] > 0 and "edges: decoding" in bench.table(results)


def test_bench_fleet_records_a_run_that_did_not_finish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repetition stopped at its timeout (SIGTERM) is recorded with the emulator's last words, and written."""
    from bench_helpers import load_benchmark

    bench = load_benchmark("fleet", tmp_path, monkeypatch)

    results = bench.main(["--sizes", "4", "--reps", "1", "--rounds", "1", "--timeout", "2", "--name", "cut"])

    (row,) = results["sizes"]
    assert row["finished"] == 0 and len(row["failures"]) == 1
    assert "4 devices: no result within 2 s" in row["failures"][0]
    text = bench.table(results)
    assert "| 4 | 0 of 1 | – |" in text and "A run of 4 devices did not finish" in text
    assert json.loads((tmp_path / "cut.json").read_text())["sizes"][0]["failures"] == row["failures"]


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_a_stopped_emulator_leaves_no_worker_or_broker_running(tmp_path: Path, signum: str) -> None:
    # Prepare: an emulation with its own Mosquitto and two worker processes, long enough to be stopped mid-run
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "fedtier", "fleet", "emulate", "--devices", "4", "--rounds", "500",
                             "--workdir", str(tmp_path / "w")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        seen = ""
        while "round 0 closed" not in seen:  # the workers and the broker are up
            line = proc.stderr.readline() if proc.stderr else ""
            assert line or proc.poll() is None, f"the emulator ended early:\n{seen}"
            seen += line
        started = descendants(proc.pid)
        assert len(started) >= 3, started  # two workers (one per core) and Mosquitto
        # Execute: a supervisor's SIGTERM, or a SIGKILL that skips every clean-up of the emulator
        proc.send_signal(getattr(signal, signum))
        proc.wait(60)
        deadline = time.monotonic() + 30
        while alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        # Assert: nothing the emulator started runs on
        assert not alive(started), f"still running after {signum}: {alive(started)}"
    finally:
        for pid in alive(descendants(proc.pid)):
            os.kill(pid, 9)
        proc.kill()


def test_a_stalled_run_stops_and_says_where_every_cell_stands(mosquitto: Any, tmp_path: Path) -> None:
    # Prepare: every local run takes 7 s of simulated compute, and a round without progress for 3 s is a stall.
    opts = EmulatorOptions(devices=3, cells=1, rounds=1, broker=f"{mosquitto.host}:{mosquitto.port}", loop="threads",
                           compute_delay_ms=7000, stall_s=3, workdir=tmp_path / "fleet")
    # Execute
    with pytest.raises(RuntimeError) as caught:
        FleetEmulator(opts).run()
    # Assert: the error names the stall and, per cell, the edge's open round and the devices' states.
    text = str(caught.value)
    assert "no update reached an edge and no round closed for 3 s" in text, text
    assert "cell-a: edge round 0 step 0 collecting, 0 of 3 updates held, inbox 0, connected" in text, text
    assert "devices: " in text and "3 training, round 0 step 0" in text and "did not answer" not in text, text

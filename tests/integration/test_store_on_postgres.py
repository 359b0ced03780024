"""The coordinator's store on a real PostgreSQL server, through the commands an operator runs:
``rollout create`` with ``store = "postgresql://..."`` in the config, a coordinator driving it over
Mosquitto, the rollout CLI reading it with ``--store``, and a second coordinator refused with the
name of the first."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fleet_helpers import Procs
from fleet_threads import ThreadFleet

pytestmark = pytest.mark.broker

FEDTIER = [sys.executable, "-m", "fedtier"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FEDTIER, *args], capture_output=True, text=True, timeout=120)


def test_a_rollout_on_postgresql_runs_and_a_second_coordinator_is_refused_naming_the_holder(
        tmp_path: Path, small_rollout: Any, mosquitto: Any, postgres_server: Any) -> None:
    from local_fleet.configs import write_fleet

    # Prepare: a 2x2 fleet whose rollout config names a fresh PostgreSQL database as its store.
    url = postgres_server.create_database()
    plain = small_rollout(rounds=3).to_dict()
    plain.pop("broker", None)
    plain.pop("state_dir", None)
    paths = write_fleet({**plain, "store": url}, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    created = _cli("rollout", "create", "--config", str(paths.coordinator), "--start", "--json")
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["store"] == url
    assert not (tmp_path / "fleet" / "coordinator" / "coordinator.db").exists()  # nothing went to SQLite
    procs = Procs(tmp_path)
    fleet = ThreadFleet(paths)
    try:
        first = procs.start("coordinator-1", [*FEDTIER, "coordinator", "run", "--config", str(paths.coordinator)])
        deadline = time.monotonic() + 120
        while "hosting" not in first.text() and "rollout t:" not in first.text():
            assert time.monotonic() < deadline and first.popen.poll() is None, first.text()
            time.sleep(0.1)
        # Execute: a second coordinator of the same rollout and store, while the first drives it.
        second = _cli("coordinator", "run", "--config", str(paths.coordinator))
        for device in paths.devices:
            fleet.start_device(device)
        for cell in paths.edges:
            fleet.start_edge(cell)
        assert first.popen.wait(180) == 0, first.text()
        fleet.check()
    finally:
        fleet.stop()
        procs.close()

    # Assert: the second was refused by name; the rollout finished in PostgreSQL; the CLI reads it there.
    assert second.returncode == 1, second.stdout + second.stderr
    assert "rollout 't'" in second.stderr and "is driven by coordinator cloud (pid" in second.stderr, second.stderr
    assert f"pid {first.popen.pid} " in second.stderr
    status = _cli("rollout", "status", "t", "--store", url, "--json")
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert doc["status"] == "finished" and doc["rounds_closed"] == 3
    models = json.loads(_cli("rollout", "models", "t", "--store", url, "--json").stdout)
    assert [m["version"] for m in models] == [0, 1, 2, 3]

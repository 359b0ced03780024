"""Every operator command against `fedtier demo --keep-running`, as an operator types them.

The demo leaves its fleet up (broker, `coordinator serve`, edges, agents); the test runs each
`fedtier rollout ...` and `fedtier devices list` command as a process, creates two more rollouts
that the same coordinator serves (one to the end, one paused, resumed and stopped), kills an
edge with SIGKILL and sees the demo restart it and say so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import mosquitto_binary, require
from process_helpers import stop_tree

from fedtier.runtime.config import dumps_toml, read_toml

pytestmark = pytest.mark.slow

FEDTIER = [sys.executable, "-m", "fedtier"]


def fedtier(*args: str, env: dict[str, str], code: int = 0) -> str:
    proc = subprocess.run([*FEDTIER, *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == code, (args, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc.stdout


def as_json(*args: str, env: dict[str, str], code: int = 0) -> Any:
    return json.loads(fedtier(*args, "--json", env=env, code=code))


def wait_until(predicate: Any, timeout: float, what: str, demo: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if demo.poll() is not None:
            raise AssertionError(f"the demo exited ({demo.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


def test_every_operator_command_against_a_demo_left_running(tmp_path: Path) -> None:
    require(mosquitto_binary() is not None, "Mosquitto")
    work = tmp_path / "fleet"
    log = tmp_path / "demo.out"
    env = {**os.environ, "FEDTIER_STATE_DIR": str(work / "coordinator"), "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as fh:
        demo = subprocess.Popen([*FEDTIER, "demo", "--keep-running", "--devices", "4", "--cells", "2", "--rounds", "3",
                                 "--workdir", str(work)], stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        wait_until(lambda: "the fleet keeps running" in log.read_text(), 240, "the demo's rollout", demo, log)
        # Every command has --help with an example.
        for command in (["rollout", "create"], ["rollout", "start"], ["rollout", "pause"], ["rollout", "resume"],
                        ["rollout", "stop"], ["rollout", "list"], ["rollout", "status"], ["rollout", "models"],
                        ["rollout", "export"], ["rollout", "promote"], ["rollout", "rollback"], ["devices", "list"],
                        ["coordinator", "serve"], ["agent", "install-service"], ["edge", "install-service"],
                        ["coordinator", "install-service"]):
            assert "Example" in fedtier(*command, "--help", env=env) or "fedtier " in fedtier(*command, "--help",
                                                                                               env=env), command
        status = as_json("rollout", "status", "demo", env=env)
        assert status["status"] == "finished" and status["rounds_closed"] == 3
        assert all(c["devices_online"] == 2 and c["edge"] == "online" for c in status["cells"].values())
        assert "rounds closed 3/3" in fedtier("rollout", "status", "demo", env=env)
        devices = as_json("devices", "list", env=env)
        assert sum(d["role"] == "device" and d["state"] == "online" and d["last_round"] == 2 for d in devices) == 4
        models = as_json("rollout", "models", "demo", env=env)
        assert [m["version"] for m in models] == [0, 1, 2, 3]
        exported = as_json("rollout", "export", "demo", "--version", "3", "--out", str(tmp_path / "demo.onnx"), env=env)
        assert exported["version"] == 3 and (tmp_path / "demo.onnx").stat().st_size > 0
        promoted = as_json("rollout", "promote", "demo", "--canary", "cell-a", "--observe", "1", env=env)
        assert promoted["passed"] and set(promoted["deployed"].values()) == {3}
        rolled = as_json("rollout", "rollback", "demo", "--to", "2", env=env)
        assert set(rolled["deployed"].values()) == {2}
        assert {d["model_version"] for d in as_json("devices", "list", "--cell", "cell-b", env=env)} == {2}

        # Two more rollouts on the same fleet, served by the same coordinator process.
        config = read_toml(work / "configs" / "coordinator.toml")
        for rollout, rounds in (("second", 2), ("third", 200)):
            path = tmp_path / f"{rollout}.toml"
            path.write_text(dumps_toml({**config, "rollout": rollout, "rounds": rounds}))
            plan = as_json("rollout", "create", "--config", str(path), "--start", env=env)
            assert plan["rollout"] == rollout and plan["devices"] == 4
        wait_until(lambda: as_json("rollout", "status", "second", env=env)["status"] == "finished", 120,
                   "the second rollout", demo, log)
        wait_until(lambda: as_json("rollout", "status", "third", env=env)["rounds_closed"] >= 1, 120,
                   "the third rollout's first round", demo, log)
        assert as_json("rollout", "pause", "third", env=env)["desired"] == "paused"
        wait_until(lambda: as_json("rollout", "status", "third", env=env)["status"] == "paused", 60, "the pause",
                   demo, log)
        as_json("rollout", "resume", "third", env=env)
        wait_until(lambda: as_json("rollout", "status", "third", env=env)["status"] == "running", 30, "the resume",
                   demo, log)
        as_json("rollout", "stop", "third", env=env)
        wait_until(lambda: as_json("rollout", "status", "third", env=env)["status"] == "stopped", 30, "the stop",
                   demo, log)
        listed = {r["rollout"]: r["status"] for r in as_json("rollout", "list", env=env)}
        assert listed == {"demo": "finished", "second": "finished", "third": "stopped"}

        # An edge dies: the demo restarts it and says so; it comes back online.
        edge_pid = next(int(line.split()[0]) for line in subprocess.run(
            ["pgrep", "-a", "-f", f"edge run --config {work}/configs/edge-cell-a.toml"], capture_output=True,
            text=True).stdout.splitlines())
        os.kill(edge_pid, signal.SIGKILL)
        wait_until(lambda: "edge-cell-a died (exit code -9); restarted it" in log.read_text(), 30, "the restart",
                   demo, log)
        wait_until(lambda: next(d for d in as_json("devices", "list", env=env) if d["node"] == "cell-a")["state"]
                   == "online", 30, "the edge back online", demo, log)
    finally:
        stopped = stop_tree(demo, signal.SIGTERM, grace_s=60, marker=str(work))
    assert stopped.code == 128 + signal.SIGTERM and "terminated (SIGTERM): stopped" in log.read_text()
    assert stopped.leftover == set()

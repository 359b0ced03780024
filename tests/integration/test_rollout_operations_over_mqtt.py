"""A rollout as an operator runs it: `fedtier rollout ...` and `fedtier devices list` against a
`fedtier coordinator serve` process over Mosquitto (edges and agents as threads, built as
`fedtier edge|agent run` builds them).

The coordinator is killed (-9) while the rollout is paused and restarted: the status reads the
same before and after, and the final model equals the in-memory simulation of the same rollout
(a pause and a crash change nothing that was trained).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from fleet_helpers import Procs
from fleet_threads import ThreadFleet
from mqtt_helpers import RawClient

from fedtier.cli import cli
from fedtier.transport import topics
from fedtier.wire.messages import CellUpdate

pytestmark = pytest.mark.broker

ROUNDS = 10
FEDTIER = [sys.executable, "-m", "fedtier"]


def run_cli(*args: str) -> Any:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result


def cli_json(*args: str) -> Any:
    result = run_cli(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def wait_until(predicate: Any, timeout: float, what: str, procs: Procs | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if procs is not None:
            for p in procs.started:
                if p.name.startswith("coordinator") and p.popen.poll() not in (None, -signal.SIGKILL):
                    raise AssertionError(f"{p.name} exited:\n{p.text()[-3000:]}")
        time.sleep(0.2)
    logs = "\n".join(p.text()[-2000:] for p in (procs.started if procs else []))
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def test_rollout_lifecycle_pause_restart_inventory_export_and_canary(mosquitto, small_rollout, tmp_path: Path) -> None:
    import onnxruntime as ort

    from fedtier.rollout.config import RolloutConfig
    from local_fleet.configs import write_fleet
    from cloud_coordinator.node import OrtEvaluator
    from cloud_coordinator.rollout import prepare
    from local_fleet.simulate import simulate
    from cloud_coordinator.store import CoordinatorStore
    from fedtier.runtime.config import load

    # Prepare: a 2x2 fleet on disk; the rollout registered (not started) in the coordinator's store.
    plain = small_rollout(rounds=ROUNDS, fedavg={"local_steps": 10, "lr": 0.2}).to_dict()
    plain.pop("broker", None)
    plain.pop("state_dir", None)
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    state = str(tmp_path / "fleet" / "coordinator")
    created = cli_json("rollout", "create", "--config", str(paths.coordinator))
    assert created["devices"] == 4 and created["started"] is False and created["algorithm"] == "fedavg"
    assert run_cli("rollout", "create", "--config", str(paths.coordinator)).exit_code == 2  # ids are not reused
    assert cli_json("rollout", "list", "--state-dir", state)[0]["status"] == "created"
    cells = sorted(created["cells"])

    fleet = ThreadFleet(paths)
    procs = Procs(tmp_path)

    def status() -> dict[str, Any]:
        return cli_json("rollout", "status", "t", "--state-dir", state)

    try:
        for device in paths.devices:
            fleet.start_device(device)
        for cell in paths.edges:
            fleet.start_edge(cell)
        serve = procs.start("coordinator-0", [*FEDTIER, "coordinator", "serve", "--state-dir", state])
        wait_until(lambda: "is created, not started: waiting for" in serve.text(), 60, "the coordinator to host the "
                   "created rollout", procs)
        assert status()["rounds_closed"] == 0 and status()["open_round"] is None  # created: waits for start

        # Execute: start; pause as soon as a round is open: the open round finishes and no new one
        # opens. (Waiting for a round to close first raced an idle machine, where the small rounds
        # all closed before the pause was written.)
        assert run_cli("rollout", "start", "t", "--state-dir", state).exit_code == 0
        wait_until(lambda: status()["open_round"] is not None or status()["rounds_closed"] >= 1, 90,
                   "round 0 to open", procs)
        assert run_cli("rollout", "pause", "t", "--state-dir", state).exit_code == 0
        wait_until(lambda: status()["status"] == "paused", 60, "the pause", procs)
        wait_until(lambda: all(c["devices_online"] == 2 for c in status()["cells"].values()), 20, "presence", procs)
        before = status()
        time.sleep(2.0)
        assert status() == before and before["open_round"] is None and before["rounds_closed"] < ROUNDS
        assert run_cli("rollout", "start", "t", "--state-dir", state).exit_code == 2  # not a created rollout

        # The coordinator dies (-9) while paused and comes back: the status is the same.
        serve.send(signal.SIGKILL)
        assert serve.popen.wait(10) == -signal.SIGKILL
        serve = procs.start("coordinator-1", [*FEDTIER, "coordinator", "serve", "--state-dir", state])
        wait_until(lambda: "is paused before round" in serve.text(), 60, "the restarted coordinator", procs)
        # An edge re-sending a closed round's update to the paused rollout is refused as late, not a crash.
        raw = RawClient(mosquitto.host, mosquitto.port, "late-edge")
        stale = CellUpdate(rollout="t", round=0, sender=cells[0], delta={"w": np.zeros(2, np.float32)}, weight=2.0,
                           reported=tuple(created["cells"][cells[0]]))
        raw.publish(topics.edge_up("t", cells[0], stale.KIND), stale.encode())
        raw.close()
        wait_until(lambda: "rejected message" in serve.text(), 20, "the late update's rejection", procs)
        time.sleep(2.0)  # presence redelivered, nothing reopened
        assert serve.popen.poll() is None and "late" in serve.text()
        assert status() == before

        # Resume to the end.
        assert run_cli("rollout", "resume", "t", "--state-dir", state).exit_code == 0
        wait_until(lambda: status()["status"] == "finished", 120, "the rollout to finish", procs)
        final = status()
        devices = cli_json("devices", "list", "--state-dir", state)
        models = cli_json("rollout", "models", "t", "--state-dir", state)
        exported = cli_json("rollout", "export", "t", "--version", str(ROUNDS), "--out", str(tmp_path / "m.onnx"),
                            "--state-dir", state)
        # Canary: the newest version passes; an older, worse one fails the accuracy gate on cell 0.
        good = cli_json("rollout", "promote", "t", "--canary", cells[0], "--observe", "1", "--state-dir", state)
        worst = min(models[1:-1], key=lambda m: m["accuracy"])
        bad = run_cli("rollout", "promote", "t", "--canary", cells[0], "--version", str(worst["version"]),
                      "--margin", "0", "--observe", "0", "--state-dir", state, "--json")
        after_bad = cli_json("devices", "list", "--state-dir", state)
        rolled = cli_json("rollout", "rollback", "t", "--to", str(ROUNDS - 1), "--state-dir", state)
        after_rollback = cli_json("devices", "list", "--cell", cells[1], "--state-dir", state)
    finally:
        fleet.stop()
        procs.close()

    # Assert: every round closed with every device; nothing was rejected.
    assert final["rounds_closed"] == ROUNDS and final["open_round"] is None and final["model_version"] == ROUNDS
    for cell in cells:
        c = final["cells"][cell]
        assert c["devices_known"] == 2 and c["updates_accepted"] == 2 * ROUNDS and c["updates_rejected"] == {}
        assert c["stragglers"] == []
    assert final["bytes"]["device_up"] > 0 and final["bytes"]["edge_up"] > 0 and final["bytes"]["cloud_down"] > 0
    # The inventory: every device online, its agent version, trainer, last round and the version it trained from.
    from fedtier import __version__

    by_node = {d["node"]: d for d in devices}
    for device in paths.devices:
        d = by_node[device]
        assert d["role"] == "device" and d["state"] == "online" and d["agent_version"] == __version__
        assert d["trainer"] == "ort" and d["last_round"] == ROUNDS - 1 and d["trained_version"] == ROUNDS - 1
    assert {by_node[c]["role"] for c in cells} == {"edge"}
    # The registry: one version per round plus the initial one, each with its sha256.
    assert [m["version"] for m in models] == list(range(ROUNDS + 1))
    assert [m["round"] for m in models] == list(range(-1, ROUNDS))
    assert all(len(m["sha256"]) == 64 for m in models) and models[0]["accuracy"] is None
    # The final model equals the in-memory simulation of the same rollout (the pause and the crash changed nothing).
    cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    trained = store.model("t", ROUNDS)
    store.close()
    simulated = simulate(RolloutConfig.from_mapping({**plain, "state_dir": str(tmp_path / "sim")}))
    assert trained is not None
    for name, value in simulated.params.items():
        np.testing.assert_allclose(trained.params[name], value, rtol=0, atol=1e-5)
    # The exported ONNX model predicts what the coordinator's evaluation model computes, to 1e-5.
    assert exported["version"] == ROUNDS and exported["round"] == ROUNDS - 1
    evaluator = OrtEvaluator(prepare(cfg))
    evaluator.trainer.set_parameters(trained.params)
    expected = np.asarray(evaluator.trainer.predict(evaluator.x))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: evaluator.x.astype(np.float32)})[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    accuracy = float(np.mean(np.argmax(got, axis=1) == np.asarray(evaluator.y).reshape(-1)))
    assert accuracy == pytest.approx(models[-1]["accuracy"], abs=1e-6)
    # Canary: the good version reached every cell; the failed gate left every device on it, and said why.
    assert good["passed"] and good["previous"] is None and set(good["deployed"].values()) == {ROUNDS}
    assert bad.exit_code == 1, bad.output
    refused = json.loads(bad.output)
    assert not refused["passed"] and "accuracy" in refused["reasons"][0] and refused["previous"] == ROUNDS
    assert worst["accuracy"] < models[-1]["accuracy"]
    assert {d["model_version"] for d in after_bad if d["role"] == "device"} == {ROUNDS}
    assert set(rolled["deployed"].values()) == {ROUNDS - 1}
    assert {d["model_version"] for d in after_rollback} == {ROUNDS - 1} and len(after_rollback) == 3

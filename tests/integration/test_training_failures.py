"""A device whose training runtime crashes does not stop the rollout, nor the next one (DESIGN §9, containment;
issue 31), through real processes and a real Mosquitto.

The crashing agent is a real ``fedtier agent run`` process whose trainer kills it with SIGSEGV (a test-only
fault, ``device_agent.faults``: the same death as a native crash inside onnxruntime, with nothing to catch); the
test restarts it when it dies, as systemd would. The coordinator is a ``fedtier coordinator serve`` process; the
edges and the other devices run as threads built as their ``run`` commands build them, so the test reads their
metrics. Quorum is 1.0: before the fix a device that never reports held its cell's round for ever.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import start_mosquitto
from fleet_helpers import Proc, Procs, count_rows
from fleet_threads import ThreadFleet
from mqtt_helpers import RawClient

from device_agent.faults import ENV
from fedtier.runtime.node_base import ACCEPTED, REJECTED
from fedtier.transport import topics
from fedtier.wire import messages
from fedtier.wire.messages import CellTask, DeviceTask

pytestmark = [pytest.mark.broker, pytest.mark.slow]

FEDTIER = [sys.executable, "-m", "fedtier"]
TRAINING_FAILED = "fedtier_training_failed_total"


def is_task(topic: str) -> bool:
    """A cell task (cloud -> edge) or a device task (edge -> devices), not an artifact's chunks."""
    parsed = topics.parse(topic)
    return parsed is not None and parsed.kind in (CellTask.KIND, DeviceTask.KIND)


class Fleet:
    """A 2x2 fleet over a fresh Mosquitto: the coordinator as a process hosting the store's rollouts, one device
    (``victim``) as a restartable process with a crashing trainer, the rest as threads."""

    def __init__(self, tmp: Path, small_rollout: Any, rounds: int, fault_round: int) -> None:
        from cloud_coordinator.status import cells_of
        from cloud_coordinator.store import CoordinatorStore
        from fedtier.rollout.config import RolloutConfig
        from fedtier.runtime.config import load
        from local_fleet.configs import write_fleet

        self.broker = start_mosquitto(tmp / "broker")
        plain = small_rollout(rounds=rounds).to_dict()
        plain.pop("broker", None)
        plain.pop("state_dir", None)
        self.paths = write_fleet(plain, tmp / "fleet", {"host": self.broker.host, "port": self.broker.port})
        self.cfg = load(RolloutConfig, self.paths.coordinator)
        self.cell, members = sorted(cells_of(self.cfg.to_dict()).items())[0]
        self.victim = members[-1]
        self.db = self.cfg.state_dir / "coordinator.db"
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        store = CoordinatorStore(self.db)
        store.create_rollout(self.cfg.rollout, self.cfg.to_dict())
        store.set_desired(self.cfg.rollout, "running")
        store.close()
        self.procs = Procs(tmp)
        self.procs.env[ENV] = f"{self.victim}:segv@{fault_round}"  # read by the victim's process only
        self.threads = ThreadFleet(self.paths)
        self.agents: list[Proc] = []
        self.exits: list[int] = []

    def start(self) -> None:
        for device in self.paths.devices:
            if device != self.victim:
                self.threads.start_device(device)
        for cell in self.paths.edges:
            self.threads.start_edge(cell)
        self.start_agent()
        self.procs.start("coordinator", [*FEDTIER, "coordinator", "serve", "--state-dir", str(self.cfg.state_dir)])

    def start_agent(self) -> Proc:
        agent = self.procs.start(f"agent-{len(self.agents)}",
                                 [*FEDTIER, "agent", "run", "--config", str(self.paths.devices[self.victim])])
        self.agents.append(agent)
        return agent

    @property
    def agent(self) -> Proc:
        return self.agents[-1]

    def supervise(self, until: Callable[[], bool], timeout: float, what: str, restart: bool = True) -> None:
        """Wait for ``until``; restart the victim whenever it dies (as a service manager would)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.threads.check()
            if until():
                return
            code = self.agent.popen.poll()
            if code is not None and restart:
                self.exits.append(code)
                self.start_agent()
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; exits {self.exits}\n"
                             + "\n".join(f"--- {p.name}\n{p.text()[-2500:]}" for p in self.procs.started))

    def status(self, rollout: str) -> dict[str, Any]:
        from cloud_coordinator.status import rollout_status
        from cloud_coordinator.store import CoordinatorStore

        store = CoordinatorStore(self.db)
        try:
            return rollout_status(store, rollout)
        finally:
            store.close()

    def ended(self, rollout: str, status: str = "finished") -> bool:
        return count_rows(self.db, f"SELECT COUNT(*) FROM rollouts WHERE rollout = '{rollout}' AND status = "
                                   f"'{status}'") == 1

    def close(self) -> None:
        self.threads.stop()
        self.procs.close()
        self.broker.stop()


def test_a_device_whose_runtime_crashes_twice_is_counted_as_failed_and_every_round_finishes(
        tmp_path: Path, small_rollout: Any) -> None:
    # Prepare: 4 rounds; the victim's trainer segfaults whenever it trains round 1.
    rounds = 4
    fleet = Fleet(tmp_path, small_rollout, rounds=rounds, fault_round=1)
    rollout = fleet.cfg.rollout
    try:
        # Execute: run the rollout, restarting the victim each time it dies.
        fleet.start()
        fleet.supervise(lambda: fleet.ended(rollout), 300, "the rollout to finish")
        status = fleet.status(rollout)
        edge_metrics = fleet.threads.nodes[fleet.cell].node.metrics
        fleet.agent.stop(signal.SIGINT)
    finally:
        fleet.close()
    texts = [a.text() for a in fleet.agents]

    # Assert: it died twice in round 1 (SIGSEGV, with the faulthandler's dump in its output), then reported it.
    assert fleet.exits == [-signal.SIGSEGV] * 2, fleet.exits
    assert all("Segmentation fault" in t for t in texts[:2]), texts[0][-2000:]
    assert "the previous run of this agent died while it trained round 1 step 0" in texts[1]
    assert f"round 1 step 0 of {rollout} not trained" in texts[2] and "training_failed (crash)" in texts[2]
    # Every round closed; round 1 without the victim, which the cell names as failed (crash); it trained the rest.
    from cloud_coordinator.store import CoordinatorStore

    store = CoordinatorStore(fleet.db)
    history = store.rounds(rollout)
    store.close()
    assert len(history) == rounds and status["rounds_closed"] == rounds
    cell_rows = [r["cells"][fleet.cell] for r in history]
    assert [fleet.victim in c["reported"] for c in cell_rows] == [True, False, True, True]
    assert cell_rows[1]["failed"] == {fleet.victim: "crash"} and cell_rows[1]["missing"] == [fleet.victim]
    assert all(c["failed"] == {} for i, c in enumerate(cell_rows) if i != 1)
    assert status["cells"][fleet.cell]["training_failed"] == {"crash": 1}
    assert edge_metrics.get(TRAINING_FAILED, reason="crash") == 1
    assert not any("Traceback" in t for t in texts)


def test_a_stopped_rollouts_task_is_never_trained_after_a_restart_and_a_replay_of_it_is_rejected(
        tmp_path: Path, small_rollout: Any) -> None:
    """The issue's second half: the rollout is stopped while the crashing agent is down; restarted, its
    persistent session redelivers the stopped rollout's task. It must not train it (and die again), and the
    next rollout must not wait for that cell. A replay of the stopped rollout's cell task is rejected."""
    from cloud_coordinator.store import CoordinatorStore

    fleet = Fleet(tmp_path, small_rollout, rounds=4, fault_round=1)
    first = fleet.cfg.rollout
    observer = RawClient(fleet.broker.host, fleet.broker.port, "observer")
    observer.subscribe(topics.cloud_down_filter(fleet.cell))
    observer.subscribe(topics.cell_down_filter(fleet.cell))
    try:
        fleet.start()
        # The victim dies in round 1; while it is down, the operator stops the rollout and starts the next one
        # (one round, so the victim's fault never fires in it).
        fleet.supervise(lambda: fleet.agent.popen.poll() is not None, 120, "the victim to crash", restart=False)
        assert fleet.agent.popen.returncode == -signal.SIGSEGV
        store = CoordinatorStore(fleet.db)
        store.set_desired(first, "stopped")
        store.close()
        fleet.supervise(lambda: fleet.ended(first, "stopped"), 60, "the rollout to stop", restart=False)
        edge = fleet.threads.nodes[fleet.cell].node
        fleet.supervise(lambda: first not in edge.roles, 30, "the edge to end the rollout", restart=False)
        store = CoordinatorStore(fleet.db)
        store.create_rollout("next", {**fleet.cfg.to_dict(), "rollout": "next", "rounds": 1})
        store.set_desired("next", "running")
        store.close()
        # Execute: the victim is restarted.
        fleet.start_agent()
        fleet.supervise(lambda: fleet.ended("next"), 180, "the next rollout to finish")
        time.sleep(1.0)  # anything the restarted agent would still do with the stopped rollout's task
        alive = fleet.agent.popen.poll() is None
        # A replay of the stopped rollout's cell task reaches the edge.
        tasks: dict[str, list[Any]] = {}
        while not observer.messages.empty():
            topic, payload = observer.messages.get_nowait()
            if is_task(topic):
                tasks.setdefault(topic, []).append(messages.decode_message(payload))
        [(task_topic, sent)] = [(t, m[-1]) for t, m in tasks.items() if isinstance(m[-1], CellTask)
                                and m[-1].rollout == first]
        relayed = sum(1 for t, ms in tasks.items() for m in ms if isinstance(m, DeviceTask) and m.rollout == first)
        accepted = edge.metrics.get(ACCEPTED, kind="cell_task")
        observer.publish(task_topic, sent.encode())
        fleet.supervise(lambda: edge.metrics.get(REJECTED, reason="rollout_ended") >= 1, 30,
                        "the replayed task to be rejected", restart=False)
        time.sleep(0.5)
        after = [messages.decode_message(p) for t, p in list(observer.messages.queue) if is_task(t)]
        fleet.agent.stop(signal.SIGINT)
    finally:
        observer.close()
        fleet.close()
    text = fleet.agent.text()

    # Assert: the restarted agent did not train the stopped rollout's task (no second death), trained the next
    # rollout, which finished with every device.
    assert alive and fleet.exits == [], fleet.exits
    assert f"resuming rollout {first}" in text and f"of {first}: device_update sent" not in text
    assert "round 0 step 0 of next: device_update sent" in text and "Segmentation fault" not in text
    next_status = fleet.status("next")
    assert next_status["rounds_closed"] == 1
    assert all(c["stragglers"] == [] for c in next_status["cells"].values()), next_status
    # The replayed task: rejected by reason, not accepted, nothing relayed to the devices.
    assert edge.metrics.get(ACCEPTED, kind="cell_task") == accepted and relayed >= 1
    assert not any(isinstance(m, DeviceTask) and m.rollout == first for m in after)

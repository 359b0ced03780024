"""Faults a fleet has, through real processes and a real Mosquitto: the node killed with SIGKILL mid-round
(the coordinator, an edge, the broker) is restarted and the rollout completes with the model an undisturbed
run computes — the in-memory simulation of the same rollout, where every round takes every device's
update once (quorum 1.0): an update lost would stall a round, one counted twice would change the model.

The killed node runs as a process (`fedtier coordinator serve`, `fedtier edge run`, `mosquitto`); the
other nodes run as threads built exactly as their `run` commands build them.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from conftest import start_mosquitto
from fleet_helpers import Procs, count_rows
from fleet_threads import ThreadFleet
from mqtt_helpers import RawClient

from fedtier.algorithms import aggregate
from fedtier.transport import topics
from fedtier.wire import messages
from fedtier.wire.messages import DeviceUpdate

pytestmark = pytest.mark.broker

ROUNDS = 4
FEDTIER = [sys.executable, "-m", "fedtier"]


def _wait(predicate: Callable[[], bool], timeout: float, what: str, procs: Procs) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(p.text()[-2500:] for p in procs.started))


@pytest.mark.parametrize(("victim", "backend"), [("coordinator", "sqlite"), ("coordinator", "postgresql"),
                                                 ("edge", "sqlite"), ("broker", "sqlite")])
def test_a_node_killed_mid_round_is_restarted_and_the_rollout_ends_with_the_undisturbed_model(
        tmp_path: Path, small_rollout: Any, victim: str, backend: str, request: pytest.FixtureRequest) -> None:
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.configs import write_fleet
    from local_fleet.simulate import simulate
    from cloud_coordinator.status import rollout_status
    from cloud_coordinator.store import CoordinatorStore
    from fedtier.runtime.config import load

    # Prepare: a 2x2 fleet; the rollout created and started in the coordinator's store.
    broker = start_mosquitto(tmp_path / "broker")
    plain = small_rollout(rounds=ROUNDS).to_dict()
    plain.pop("broker", None)
    plain.pop("state_dir", None)
    paths = write_fleet(plain, tmp_path / "fleet", {"host": broker.host, "port": broker.port})
    cfg = load(RolloutConfig, paths.coordinator)
    # the store: a SQLite file in the state dir, or a database of the test's PostgreSQL server
    url = request.getfixturevalue("postgres_server").create_database() if backend == "postgresql" else None
    db: Path | str = url or cfg.state_dir / "coordinator.db"
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    store = CoordinatorStore(db)
    store.create_rollout(cfg.rollout, cfg.to_dict())
    store.set_desired(cfg.rollout, "running")
    store.close()
    cells = sorted(paths.edges)
    fleet = ThreadFleet(paths)
    procs = Procs(tmp_path)

    def coordinator(run: int) -> Any:
        where = ["--store", url] if url else []
        return procs.start(f"coordinator-{run}", [*FEDTIER, "coordinator", "serve", "--state-dir", str(cfg.state_dir),
                                                  *where])

    def edge(run: int) -> Any:
        return procs.start(f"edge-{run}", [*FEDTIER, "edge", "run", "--config", str(paths.edges[cells[0]])])

    edge_db = tmp_path / "fleet" / "edges" / cells[0] / "edge.db"
    killed_mid_round = False
    from cloud_coordinator.status import cells_of

    # This device joins only after the restart: its cell cannot close round 0 before, so the kill lands
    # while the round is open (the other cell's update accepted, at the edge or at the coordinator).
    late = cells_of(cfg.to_dict())[cells[0] if victim == "edge" else cells[-1]][-1]
    try:
        for device in paths.devices:
            if device != late:
                fleet.start_device(device)
        for cell in cells[1:] if victim == "edge" else cells:
            fleet.start_edge(cell)
        serve = coordinator(0)
        edge_proc = edge(0) if victim == "edge" else None
        # Execute: wait until round 1 is half done at the victim, kill it with SIGKILL, restart it.
        if victim == "coordinator":
            # one cell's update of round 0 accepted and durable; the other cell waits for its late device
            _wait(lambda: count_rows(db, "SELECT COUNT(*) FROM inputs") == 1, 120, "a cell update", procs)
            serve.send(signal.SIGKILL)
            killed_mid_round = count_rows(db, "SELECT COUNT(*) FROM rounds") == 0
            serve.popen.wait(10)
            serve = coordinator(1)
            fleet.start_device(late)
        elif victim == "edge":
            # one device's update of round 0 accepted by the edge; the cell waits for its other device
            _wait(lambda: count_rows(edge_db, "SELECT COUNT(*) FROM inputs WHERE kind = 'device_update'") >= 1, 120,
                  "a device update at the edge", procs)
            assert edge_proc is not None
            edge_proc.send(signal.SIGKILL)
            killed_mid_round = count_rows(edge_db, "SELECT COUNT(*) FROM outputs") == 0
            edge_proc.popen.wait(10)
            edge_proc = edge(1)
            fleet.start_device(late)  # now its cell can close
        else:
            _wait(lambda: count_rows(db, "SELECT COUNT(*) FROM inputs") == 1, 120, "a cell update", procs)
            broker.proc.kill()
            broker.proc.wait(10)
            killed_mid_round = count_rows(db, "SELECT COUNT(*) FROM rounds") == 0
            time.sleep(1.0)  # everyone notices the broker is gone
            broker = start_mosquitto(tmp_path / "broker2", port=broker.port)
            fleet.start_device(late)

        def finished() -> bool:
            return count_rows(db, "SELECT COUNT(*) FROM rollouts WHERE status = 'finished'") == 1

        _wait(finished, 180, "the rollout to finish", procs)
        fleet.check()
        store = CoordinatorStore(db)
        status = rollout_status(store, cfg.rollout)
        final = store.model(cfg.rollout, ROUNDS)
        rounds = store.rounds(cfg.rollout)
        store.close()
    finally:
        fleet.stop()
        procs.close()
        broker.stop()

    # Assert: the kill really hit an open round; every round took each device's update exactly once.
    assert killed_mid_round
    assert [r["devices_reported"] for r in rounds] == [4] * ROUNDS and all(r["missing"] == [] for r in rounds)
    assert all(c["updates_accepted"] == 2 * ROUNDS for c in status["cells"].values()), status
    assert final is not None
    simulated = simulate(RolloutConfig.from_mapping({**plain, "state_dir": str(tmp_path / "sim")}))
    for name, value in simulated.params.items():
        np.testing.assert_allclose(final.params[name], value, rtol=0, atol=1e-5)
    texts = {p.name: p.text() for p in procs.started}
    assert not any("Traceback" in t for t in texts.values()), texts
    if victim == "coordinator":
        assert "resuming rollout t at round" in texts["coordinator-1"]


@pytest.mark.slow
def test_a_device_offline_for_several_rounds_is_a_straggler_and_its_stale_updates_count_once(
        tmp_path: Path, small_rollout: Any) -> None:
    """Quorum 2 of 3 and a 2 s deadline: a device frozen (SIGSTOP) for several rounds is left out at each
    deadline and named a straggler; thawed, it delivers what it had queued once — refused as late, never
    applied — and contributes again to the following rounds."""
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.configs import write_fleet
    from cloud_coordinator.status import cells_of, rollout_status
    from cloud_coordinator.store import CoordinatorStore
    from fedtier.runtime.config import load

    rounds = 10
    broker = start_mosquitto(tmp_path / "broker")
    plain = small_rollout(rounds=rounds, topology={"cells": 1, "devices_per_cell": 3},
                          fedavg={"quorum": 0.6, "deadline_s": 2.0}).to_dict()
    plain.pop("broker", None)
    plain.pop("state_dir", None)
    paths = write_fleet(plain, tmp_path / "fleet", {"host": broker.host, "port": broker.port})
    cfg = load(RolloutConfig, paths.coordinator)
    ((cell, members),) = cells_of(cfg.to_dict()).items()
    frozen = members[-1]
    db = cfg.state_dir / "coordinator.db"
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    store = CoordinatorStore(db)
    store.create_rollout(cfg.rollout, cfg.to_dict())
    store.set_desired(cfg.rollout, "running")
    store.close()
    fleet = ThreadFleet(paths)
    procs = Procs(tmp_path)

    def closed() -> int:
        return count_rows(db, "SELECT COUNT(*) FROM rounds")

    observer = RawClient(broker.host, broker.port, "observer")  # every device update, as the edge received it
    observer.subscribe(topics.cell_up_filter(cell))
    try:
        for device in members[:-1]:
            fleet.start_device(device)
        fleet.start_edge(cell)
        agent = procs.start("agent", [*FEDTIER, "agent", "run", "--config", str(paths.devices[frozen])])
        procs.start("coordinator", [*FEDTIER, "coordinator", "serve", "--state-dir", str(cfg.state_dir)])
        _wait(lambda: closed() >= 2, 120, "two rounds with every device", procs)
        agent.send(signal.SIGSTOP)
        at_freeze = closed()
        _wait(lambda: closed() >= at_freeze + 4, 60, "rounds without the frozen device", procs)
        store = CoordinatorStore(db)
        while_frozen = rollout_status(store, cfg.rollout)
        store.close()
        agent.send(signal.SIGCONT)
        _wait(lambda: count_rows(db, "SELECT COUNT(*) FROM rollouts WHERE status = 'finished'") == 1, 120,
              "the rollout to finish", procs)
        fleet.check()
        store = CoordinatorStore(db)
        status = rollout_status(store, cfg.rollout)
        history = store.rounds(cfg.rollout)
        initial, final = store.model(cfg.rollout, 0), store.model(cfg.rollout, rounds)
        store.close()
    finally:
        observer.close()
        fleet.stop()
        procs.close()
        broker.stop()
    sent: dict[tuple[int, str], Any] = {}
    while not observer.messages.empty():
        _, payload = observer.messages.get_nowait()
        msg = messages.decode_message(payload)
        if isinstance(msg, DeviceUpdate):
            sent.setdefault((msg.round, msg.sender), msg.delta)

    # Assert: left out at each deadline while frozen, and named a straggler.
    assert while_frozen["cells"][cell]["stragglers"] == [frozen]
    reported = [set(r["cells"][cell]["reported"]) for r in history]
    out = [i for i, r in enumerate(reported) if frozen not in r]
    assert len(out) >= 3 and all(len(reported[i]) == 2 for i in out)
    # Back, it contributes again; what it had queued was refused as late, once each, never applied.
    assert frozen in reported[-1] and len(reported[-1]) == 3
    assert status["cells"][cell]["updates_accepted"] == sum(len(r) for r in reported)
    rejected = status["cells"][cell]["updates_rejected"]
    assert set(rejected) <= {"late", "wrong_round"} and 1 <= sum(rejected.values()) <= len(out), rejected
    # The final model is the undisturbed computation over exactly the accepted updates: each round, the mean
    # of the deltas of the devices it counted, once each (one cell: the cloud adds its cell's mean).
    assert initial is not None and final is not None
    expected = dict(initial.params)
    for r, members_r in enumerate(reported):
        expected = aggregate.add(expected, aggregate.weighted_mean([(sent[(r, d)], 1.0) for d in sorted(members_r)]))
    for name, value in expected.items():
        np.testing.assert_allclose(final.params[name], value, rtol=0, atol=1e-5)

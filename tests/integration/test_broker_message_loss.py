"""A broker restarted without persistence forgets the messages it had acknowledged but not yet delivered.

An upload acknowledged by the broker has left the sender's outbox; if the broker then restarts before
delivering it (Mosquitto with ``persistence false``, or a crash between its autosaves), it is gone.
The receiver asks again — the edge sends a member its task again when the member reconnects, the
coordinator a cell its task when the edge reconnects — and the sender answers with the same stored
bytes, never a second training (a second noisy release). The rollout then ends with the model an
undisturbed run computes (quorum 1.0: a lost update would stall the round for ever).

Every node runs as a thread built as its ``run`` command builds it (``ThreadFleet``); the test stops
the receiver, lets the sender's message be acknowledged into the broker's queue for it, and restarts
the broker, once for a device's update (round 0) and once for the cell's update (round 1).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Broker, start_mosquitto
from fleet_helpers import count_rows
from fleet_threads import ThreadFleet

pytestmark = pytest.mark.broker

ROUNDS = 3



class Gate:
    """Holds a device's local training of chosen rounds until released (the device's thread waits)."""

    def __init__(self, rounds: tuple[int, ...]) -> None:
        self.entered = {r: threading.Event() for r in rounds}
        self.release = {r: threading.Event() for r in rounds}

    def install(self, node: Any) -> None:
        train = node.train

        def gated(trainer: Any, action: Any) -> Any:
            if action.round in self.entered:
                self.entered[action.round].set()
                assert self.release[action.round].wait(120), "gate never released"
            return train(trainer, action)

        node.train = gated


def _restart(broker: Broker, directory: Path) -> Broker:
    """SIGKILL the broker and start a fresh one (nothing persisted) on the same port."""
    broker.proc.kill()
    broker.proc.wait(10)
    return start_mosquitto(directory, port=broker.port)


def test_messages_a_restarted_broker_lost_are_sent_again_from_storage(
        tmp_path: Path, small_rollout: Any, caplog: pytest.LogCaptureFixture) -> None:
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.configs import write_fleet
    from local_fleet.simulate import simulate
    from cloud_coordinator.store import CoordinatorStore
    from device_agent.node import log as device_log
    from edge_broker.service import log as edge_log
    from fedtier.runtime.config import load

    # Prepare: one cell of two devices; dev-1's training of rounds 0 and 1 waits for the test.
    caplog.set_level(logging.INFO, logger=device_log.name)
    caplog.set_level(logging.INFO, logger=edge_log.name)
    broker = start_mosquitto(tmp_path / "broker")
    plain = small_rollout(rounds=ROUNDS, topology={"cells": 1, "devices_per_cell": 2}).to_dict()
    plain.pop("broker", None)
    plain.pop("state_dir", None)
    rollout = plain["rollout"]
    paths = write_fleet(plain, tmp_path / "fleet", {"host": broker.host, "port": broker.port})
    [cell] = sorted(paths.edges)
    first, second = sorted(paths.devices)
    edge_db = tmp_path / "fleet" / "edges" / cell / "edge.db"
    gate = Gate((0, 1))
    fleet = ThreadFleet(paths)
    try:
        fleet.start_device(first)
        fleet.start_device(second, prepare=gate.install)
        fleet.start_edge(cell)
        fleet.start_coordinator()

        # Execute 1: the edge is away while the second device's round-0 update is acknowledged into the
        # broker's queue for it; the broker restarts and forgets it; the edge comes back.
        fleet.wait_until(lambda: gate.entered[0].is_set() and count_rows(
            edge_db, "SELECT COUNT(*) FROM inputs WHERE kind='device_update' AND round=0") == 1,
            "the first device's round-0 update at the edge")
        fleet.stop_node(cell)
        gate.release[0].set()
        device = fleet.nodes[second].node
        fleet.wait_until(lambda: device.state.last_sent(rollout) == (0, 0) and device.state.pending() == [],
                         "the broker's acknowledgement of the second device's update")
        broker = _restart(broker, tmp_path / "broker")
        fleet.start_edge(cell)

        # Execute 2: the coordinator is away while the cell's round-1 update is acknowledged; the broker
        # restarts and forgets it; the coordinator comes back.
        fleet.wait_until(lambda: gate.entered[1].is_set() and count_rows(
            edge_db, "SELECT COUNT(*) FROM inputs WHERE kind='device_update' AND round=1") == 1,
            "the first device's round-1 update at the edge")
        fleet.stop_node("coordinator")
        acknowledged = threading.Event()
        edge = fleet.nodes[cell].node
        publish = edge.cloud_tx.publish

        def watched(topic: str, payload: bytes, *, retain: bool = False, on_done: Any = None) -> int:
            def done(ok: bool) -> None:
                if ok and "/cell_update" in topic:
                    acknowledged.set()
                if on_done is not None:
                    on_done(ok)
            return publish(topic, payload, retain=retain, on_done=done)

        edge.cloud_tx.publish = watched
        gate.release[1].set()
        fleet.wait_until(acknowledged.is_set, "the broker's acknowledgement of the cell's round-1 update")
        broker = _restart(broker, tmp_path / "broker")
        fleet.start_coordinator()
        cloud = fleet.wait_finished(120)
        store = CoordinatorStore(load(RolloutConfig, paths.coordinator).state_dir / "coordinator.db")
        rounds = store.rounds(rollout)
        store.close()
    finally:
        fleet.stop()
        broker.stop()

    # Assert: both lost messages were sent again from storage, and the model is the undisturbed run's.
    log = caplog.text
    assert f"round 0 step 0 of {rollout} asked for again: sent the same 1 upload(s) again" in log
    assert f"round 1 of {rollout} asked for again: published the cell's 1 stored message(s) again" in log
    assert [r["devices_reported"] for r in rounds] == [2] * ROUNDS and all(r["missing"] == [] for r in rounds)
    simulated = simulate(RolloutConfig.from_mapping({**plain, "state_dir": str(tmp_path / "sim")}))
    for name, value in simulated.params.items():
        np.testing.assert_allclose(cloud.params[name], value, rtol=0, atol=1e-5)

"""A client that takes over the coordinator's client id for a second costs at most a deadline, never the rollout.

A client connecting with the coordinator's id (a copied bundle started by mistake, a test tool) makes the broker
drop the coordinator's connection and its session; what an edge sends meanwhile has no subscriber and is lost.
Without asking again, a quorum-1.0 round then waits for ever for the lost cell update. The coordinator asks the
cells that owe the open round again as soon as its connection is back (and at the latest once the round is past
its deadline); the edge answers with its stored cell update, never a second aggregate. The rollout ends with the
model an undisturbed run computes.

Every node runs as a thread built as its ``run`` command builds it (``ThreadFleet``); the edge's cell update of
round 1 is held until the intruder holds the coordinator's id, so it is lost for sure. On Mosquitto and on the
embedded broker.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from conftest import start_mosquitto
from fleet_threads import ThreadFleet
from paho.mqtt.enums import CallbackAPIVersion

pytestmark = pytest.mark.broker

ROUNDS = 3
DEADLINE_S = 20.0
TAKEOVER_S = 1.0



class Intruder:
    """A plain MQTT client under someone else's client id (clean session): it never reconnects once dropped."""

    def __init__(self, host: str, port: int, client_id: str) -> None:
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                                  clean_session=True)
        self.connected = threading.Event()
        self.client.on_connect = lambda *args: self.connected.set()
        self.leave = threading.Event()
        self.client.connect(host, port, keepalive=30)
        self.thread = threading.Thread(target=self._loop, name="intruder", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.leave.is_set():
            if self.client.loop(timeout=0.05) != mqtt.MQTT_ERR_SUCCESS:
                return  # dropped (the owner of the id came back): gone for good
        self.client.disconnect()
        self.client.loop(timeout=0.2)

    def go(self) -> None:
        self.leave.set()
        self.thread.join(5)


@pytest.fixture(params=["mosquitto", "embedded"])
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, int]]:
    if request.param == "mosquitto":
        running = start_mosquitto(tmp_path / "broker")
        yield running.host, running.port
        running.stop()
        return
    from fedtier.embedded_broker import EmbeddedBroker

    embedded = EmbeddedBroker("127.0.0.1", 0).start()
    yield "127.0.0.1", embedded.port
    embedded.stop()


def test_a_one_second_takeover_of_the_coordinators_id_costs_at_most_a_deadline(
        tmp_path: Path, small_rollout: Any, broker: tuple[str, int], caplog: pytest.LogCaptureFixture) -> None:
    from cloud_coordinator.node import log as coordinator_log
    from edge_broker.service import log as edge_log
    from fedtier import wire
    from fedtier.rollout.config import RolloutConfig
    from fedtier.runtime.config import load
    from local_fleet.configs import write_fleet
    from local_fleet.simulate import simulate

    # Prepare: one cell of two devices, every round needs both (quorum 1.0: a lost update stalls it).
    caplog.set_level(logging.INFO, logger=coordinator_log.name)
    caplog.set_level(logging.INFO, logger=edge_log.name)
    host, port = broker
    plain = small_rollout(rounds=ROUNDS, topology={"cells": 1, "devices_per_cell": 2},
                          fedavg={"deadline_s": DEADLINE_S}).to_dict()
    plain.pop("broker", None)
    plain.pop("state_dir", None)
    rollout = plain["rollout"]
    paths = write_fleet(plain, tmp_path / "fleet", {"host": host, "port": port})
    cloud_id = load(RolloutConfig, paths.coordinator).cloud_id
    [cell] = sorted(paths.edges)
    fleet = ThreadFleet(paths)
    held = threading.Event()  # the edge is about to publish its round-1 update
    taken = threading.Event()  # the intruder holds the coordinator's id
    acknowledged = threading.Event()
    try:
        edge = fleet.start_edge(cell).node
        publish = edge.cloud_tx.publish

        def held_back(topic: str, payload: bytes, *, retain: bool = False, on_done: Any = None) -> int:
            if not topic.endswith("/cell_update") or wire.peek_header(payload)["r"] != 1 or held.is_set():
                return publish(topic, payload, retain=retain, on_done=on_done)
            held.set()
            assert taken.wait(30), "the takeover never happened"

            def done(ok: bool) -> None:
                acknowledged.set()
                if on_done is not None:
                    on_done(ok)
            return publish(topic, payload, retain=retain, on_done=done)

        edge.cloud_tx.publish = held_back
        for device in sorted(paths.devices):
            fleet.start_device(device)
        coordinator = fleet.start_coordinator().node

        # Execute: when the edge has the cell's round-1 update, a client takes the coordinator's id for a
        # second; the update goes out while it holds the id.
        fleet.wait_until(held.is_set, "the edge's round-1 update")
        started = time.monotonic()
        intruder = Intruder(host, port, cloud_id)
        fleet.wait_until(lambda: intruder.connected.is_set() and not coordinator.tx.connected,
                         "the intruder to take the coordinator's session", 10)
        taken.set()
        fleet.wait_until(acknowledged.is_set, "the broker's acknowledgement of the update", 10)
        time.sleep(max(0.0, TAKEOVER_S - (time.monotonic() - started)))
        intruder.go()
        cloud = fleet.wait_finished(120)
        rows = list(cloud.history)
    finally:
        fleet.stop()

    # Assert: the coordinator asked again, the edge answered from storage, round 1 cost less than a deadline
    # and every round had both devices; the model is the one an undisturbed run computes.
    log = caplog.text
    assert f"round 1 of rollout {rollout}: the coordinator" in log and f"asked cell {cell} again" in log
    assert f"round 1 of {rollout} asked for again: published the cell's 1 stored message(s) again" in log
    assert [r["devices_reported"] for r in rows] == [2] * ROUNDS and all(r["missing"] == [] for r in rows)
    assert rows[1]["round_s"] < DEADLINE_S, rows[1]["round_s"]
    simulated = simulate(RolloutConfig.from_mapping({**plain, "state_dir": str(tmp_path / "sim")}))
    for name, value in simulated.params.items():
        np.testing.assert_allclose(cloud.params[name], value, rtol=0, atol=1e-5)

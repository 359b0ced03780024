"""The coordinator asks its cells again for what they owe, and learns presence from the edges' summaries.

What an edge sent while the coordinator's session was gone is lost: another client that connected with the
coordinator's id took the session (or the broker restarted without persistence). The coordinator asks every
cell that owes the open round again when its connection comes back, and any cell still silent once the round is
past its deadline (then once per deadline); the edge answers from storage (tests/unit/edge_broker).

Devices announce themselves in their cell, which a gateway's bridge does not carry: the edge's ``cell_presence``
summary is what tells the coordinator which devices are online there (``fedtier_devices_online``, the store's
device inventory behind ``rollout status`` and ``devices list``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_coordinator.node import CloudNode
from cloud_coordinator.observe.prom import DEVICES_ONLINE
from cloud_coordinator.rollout import prepare
from cloud_coordinator.status import device_inventory, rollout_status
from cloud_coordinator.store import CoordinatorStore
from fedtier.runtime.node_base import REJECTED
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker
from fedtier.wire.messages import CellPresence, CellUpdate

DEADLINE_S = 10.0


class Rig:
    """A coordinator over a memory broker; ``edges`` sees every task it sends and speaks for every edge."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.broker = MemoryBroker()
        self.tasks: list = []
        self.edges = self.broker.connect("edges", self.tasks.append)
        self.edges.subscribe(f"{topics.PREFIX}/+/cloud/down/+/#")
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = CoordinatorStore(cfg.store_location)
        self.tx = self.broker.connect("cloud")
        self.node = CloudNode(prepared=prepare(cfg), transport=self.tx, store=self.store, evaluator=None)
        self.tx.set_handler(lambda inbound: self.node.handle(inbound, self.broker.now))
        self.node.start(0.0)
        self.broker.run_until_idle()
        self.cells = sorted(self.node.prepared.cells)

    def tick(self, now: float) -> None:
        self.broker.now = now
        self.node.tick(now)
        self.broker.run_until_idle()

    def answer(self, cell: str) -> None:
        """The cell's update of the open round, as its edge would send it."""
        assert self.node.role is not None
        update = CellUpdate(rollout=self.cfg.rollout, round=self.node.role.round, sender=cell,
                            delta={k: np.zeros_like(v) for k, v in self.node.role.params.items()}, weight=1.0,
                            reported=tuple(self.node.prepared.cells[cell]), mean_loss=0.0)
        self.edges.publish(topics.edge_up(self.cfg.rollout, cell, update.KIND), update.encode())
        self.broker.run_until_idle()

    def summary(self, cell: str, online: tuple[str, ...]) -> None:
        msg = CellPresence(rollout=self.cfg.rollout, round=0, sender=cell, online=online, known=len(online) + 1)
        self.edges.publish(topics.edge_up(self.cfg.rollout, cell, msg.KIND), msg.encode())
        self.broker.run_until_idle()

    def close(self) -> None:
        self.store.close()


def asked(rig: Rig) -> list[str]:
    """The cells the coordinator sent a task since the last call, by their topics."""
    cells = [topics.parse(i.topic).cell for i in rig.tasks]  # type: ignore[union-attr]
    rig.tasks.clear()
    return sorted(c for c in cells if c is not None)


@pytest.fixture
def rig(small_rollout: Any) -> Any:
    made = Rig(small_rollout(rounds=2, fedavg={"deadline_s": DEADLINE_S}))
    yield made
    made.close()


def test_a_coordinator_that_reconnected_asks_the_cells_that_owe_the_round_again(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: round 0 is open; the first cell has answered, the second not (its update was lost).
    first, second = rig.cells
    assert asked(rig) == [first, second]
    rig.answer(first)
    rig.tx.connects = 1  # type: ignore[attr-defined]  (as MqttTransport counts its connections)
    rig.tick(1.0)
    assert asked(rig) == []  # the first connection is not a reconnection
    # Execute: the connection comes back without its session (another client took the coordinator's id).
    rig.tx.connects = 2  # type: ignore[attr-defined]
    rig.tx.session_present = False  # type: ignore[attr-defined]
    with caplog.at_level(logging.INFO, logger="fedtier.coordinator"):
        rig.tick(2.0)
        rig.tick(3.0)
    # Assert: the cell that owes the round got its task again, once; the one that answered did not.
    assert asked(rig) == [second]
    assert "the coordinator's session was lost; asked cell " + second + " again" in caplog.text
    rig.answer(second)
    assert [r["round"] for r in rig.node.history] == [0]


def test_a_round_past_its_deadline_asks_the_silent_cells_again_once_per_deadline(rig: Rig) -> None:
    first, second = rig.cells
    asked(rig)
    rig.answer(first)
    for now in (1.0, DEADLINE_S / 2):
        rig.tick(now)
    assert asked(rig) == []  # before the deadline, nobody is asked again
    rig.tick(DEADLINE_S + 0.1)
    assert asked(rig) == [second]
    for now in (DEADLINE_S + 1, DEADLINE_S * 1.5, DEADLINE_S * 2):
        rig.tick(now)
    assert asked(rig) == []  # once per deadline
    rig.tick(DEADLINE_S * 2 + 0.2)
    assert asked(rig) == [second]
    # The cell answers (its edge published its stored update again): the round closes, nobody is asked more.
    rig.answer(second)
    assert [r["round"] for r in rig.node.history] == [0]
    assert asked(rig) == [first, second]  # round 1's tasks
    rig.tick(DEADLINE_S * 2 + 0.3)
    assert asked(rig) == []


def test_devices_online_in_a_bridged_cell_come_from_its_edges_summary(rig: Rig) -> None:
    # Prepare: no device's own presence reaches the coordinator (as behind a bridge).
    first, second = rig.cells
    a0, a1 = rig.node.prepared.cells[first]
    # Execute: the edges' summaries; one names a device that is not a member of the rollout.
    rig.summary(first, (a0, a1, "stranger"))
    rig.summary(second, ())
    rig.node.presence.flush()  # type: ignore[union-attr]
    # Assert: the gauge, rollout status and the device inventory agree.
    assert rig.node.metrics.get(DEVICES_ONLINE, cell=first) == 2
    assert rig.node.metrics.get(DEVICES_ONLINE, cell=second) == 0
    status = rollout_status(rig.store, rig.cfg.rollout)
    assert status["cells"][first]["devices_online"] == 2 and status["cells"][second]["devices_online"] == 0
    inventory = {d["node"]: d for d in device_inventory(rig.store)}
    assert inventory[a0]["state"] == "online" and inventory[a0]["cell"] == first and "stranger" not in inventory
    # A device that leaves: the next summary says so.
    rig.summary(first, (a1,))
    rig.node.presence.flush()  # type: ignore[union-attr]
    assert rig.node.metrics.get(DEVICES_ONLINE, cell=first) == 1
    assert rollout_status(rig.store, rig.cfg.rollout)["cells"][first]["offline"] == [a0]


def test_a_devices_own_presence_wins_over_its_edges_summary(rig: Rig) -> None:
    first, _ = rig.cells
    a0, a1 = rig.node.prepared.cells[first]
    doc = {"node": a0, "role": "device", "cell": first, "state": "online", "since": 3.0, "trainer": "ort"}
    rig.edges.publish(topics.cell_status(first, a0), json.dumps(doc).encode(), retain=True)
    # An older agent's cell-less document of the same device, left retained: superseded by the cell's topic.
    rig.edges.publish(topics.status(a0), json.dumps({**doc, "state": "offline"}).encode(), retain=True)
    rig.broker.run_until_idle()
    rig.summary(first, (a1,))  # an edge's view that lags behind
    rig.node.presence.flush()  # type: ignore[union-attr]
    assert rig.node.metrics.get(DEVICES_ONLINE, cell=first) == 2
    inventory = {d["node"]: d for d in device_inventory(rig.store)}
    assert inventory[a0]["state"] == "online" and inventory[a0]["trainer"] == "ort"


def test_a_roaming_device_is_where_the_last_summary_listing_it_online_came_from(small_rollout: Any) -> None:
    # Prepare: a roaming FedBuff rollout; a0 (a member of the first cell) is online in the second.
    rig = Rig(small_rollout(rounds=2, algorithm="fedbuff", topology={"cells": 2, "devices_per_cell": 2,
                                                                     "roaming": True}))
    try:
        first, second = rig.cells
        a0, a1 = rig.node.prepared.cells[first]
        b0, _ = rig.node.prepared.cells[second]
        rig.summary(second, (a0, b0))
        # Execute: the first cell's edge, which lost a0, sends its summary after the second's.
        rig.summary(first, (a1,))
        rig.node.presence.flush()  # type: ignore[union-attr]
        # Assert: a0 stays online in the second cell (the first cell's summary only speaks for who is there).
        inventory = {d["node"]: d for d in device_inventory(rig.store)}
        assert (inventory[a0]["cell"], inventory[a0]["state"]) == (second, "online")
        assert (inventory[a1]["cell"], inventory[a1]["state"]) == (first, "online")
        # a0 leaves the second cell: that cell's next summary says so.
        rig.summary(second, (b0,))
        rig.node.presence.flush()  # type: ignore[union-attr]
        inventory = {d["node"]: d for d in device_inventory(rig.store)}
        assert (inventory[a0]["cell"], inventory[a0]["state"]) == (second, "offline")
    finally:
        rig.close()


def test_a_roaming_devices_offline_document_in_the_cell_it_left_does_not_undo_where_it_is(small_rollout: Any) -> None:
    # A shared broker keeps a moved device's documents of both cells retained: online in the new one, offline in the
    # old one; they reach a (restarted) coordinator in either order.
    rig = Rig(small_rollout(rounds=2, algorithm="fedbuff", topology={"cells": 2, "devices_per_cell": 2,
                                                                     "roaming": True}))
    try:
        first, second = rig.cells
        a0 = rig.node.prepared.cells[first][0]
        doc = {"node": a0, "role": "device", "state": "online", "since": 3.0}
        rig.edges.publish(topics.cell_status(second, a0), json.dumps({**doc, "cell": second}).encode(), retain=True)
        left = {**doc, "cell": first, "state": "offline"}
        rig.edges.publish(topics.cell_status(first, a0), json.dumps(left).encode(), retain=True)
        rig.broker.run_until_idle()
        rig.node.presence.flush()  # type: ignore[union-attr]
        inventory = {d["node"]: d for d in device_inventory(rig.store)}
        assert (inventory[a0]["cell"], inventory[a0]["state"]) == (second, "online")
        assert rig.node.metrics.get(DEVICES_ONLINE, cell=first) == 1  # counted where it is enrolled
        # It goes offline where it is: that counts.
        rig.edges.publish(topics.cell_status(second, a0), json.dumps({**doc, "cell": second, "state": "offline"})
                          .encode(), retain=True)
        rig.broker.run_until_idle()
        rig.node.presence.flush()  # type: ignore[union-attr]
        assert {d["node"]: d for d in device_inventory(rig.store)}[a0]["state"] == "offline"
    finally:
        rig.close()


def test_a_summary_from_a_node_that_is_not_a_cell_of_the_rollout_is_rejected(rig: Rig) -> None:
    rig.summary("cell-x", ("d0",))
    assert rig.node.metrics.get(REJECTED, reason="unknown_sender") == 1


def test_the_service_writes_the_summaries_into_its_inventory(small_rollout: Any, tmp_path: Path) -> None:
    """``coordinator serve``: the hosted node reads the summary, the service's buffer writes the store."""
    from cloud_coordinator.service import CoordinatorService

    cfg = small_rollout(rounds=1)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    store = CoordinatorStore(cfg.store_location)
    store.create_rollout(cfg.rollout, cfg.to_dict())
    broker = MemoryBroker()
    tx = broker.connect("cloud")
    service = CoordinatorService(store=store, transport=tx, cloud_id="cloud", make_node=lambda c: CloudNode(
        prepared=prepare(c), transport=tx, store=store, evaluator=None))
    tx.set_handler(lambda inbound: service.handle(inbound, broker.now))
    try:
        service.start(0.0)
        broker.run_until_idle()
        node = service.nodes[cfg.rollout]
        cell = sorted(node.prepared.cells)[0]
        msg = CellPresence(rollout=cfg.rollout, round=0, sender=cell, online=tuple(node.prepared.cells[cell]),
                           known=2)
        broker.connect("edge").publish(topics.edge_up(cfg.rollout, cell, msg.KIND), msg.encode())
        broker.run_until_idle()
        service.tick(5.0)
        status = rollout_status(store, cfg.rollout)
    finally:
        store.close()
    assert status["cells"][cell]["devices_online"] == 2

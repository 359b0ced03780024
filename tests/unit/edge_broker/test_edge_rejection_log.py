"""An edge under a flood of bad input: every message counted, the log thinned; redeliveries at DEBUG.

The issue this guards: 10,000 fuzzed messages wrote 3,813 WARNING lines (660 KB) per edge, and an
expected redelivery after a restart logged a WARNING too.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest

from edge_broker.service import EdgeNode
from edge_broker.store import EdgeStore
from fedtier.algorithms.fedavg import FedAvgConfig
from fedtier.artifacts.cache import ArtifactCache
from fedtier.runtime.node_base import DROPPED, REJECT_LOG_BUDGET, REJECTED
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker
from fedtier.wire.messages import CellTask, DeviceUpdate

CELL, ROLLOUT = "cell-a", "r"
MEMBERS = ("dev-0", "dev-1", "dev-2")
PARAMS = {"w": np.zeros((2, 2), np.float32)}
FUZZED = 10_000
GARBAGE = b"not an envelope at all"


class Rig:
    """An edge over the in-memory broker; the test plays the cloud and the devices."""

    def __init__(self, tmp: Path) -> None:
        self.broker = MemoryBroker()
        self.cloud = self.broker.connect("cloud", lambda inbound: None)
        self.devices = self.broker.connect("devices", lambda inbound: None)
        self.edge = EdgeNode(cell=CELL, cell_transport=self.broker.connect("edge-cell"),
                             cloud_transport=self.broker.connect("edge-cloud"), store=EdgeStore(":memory:"),
                             cache=ArtifactCache(tmp / "cache"))
        for tx in (self.edge.cell_tx, self.edge.cloud_tx):
            tx.set_handler(lambda inbound: self.edge.handle(inbound, self.broker.now))
        self.edge.start(self.broker.now)
        task = CellTask(rollout=ROLLOUT, round=0, sender="cloud", params=PARAMS, members=MEMBERS,
                        config=FedAvgConfig(deadline_s=600).to_dict())
        self.cloud.publish(topics.cloud_down(ROLLOUT, CELL, task.KIND), task.encode())
        self.broker.run_until_idle()

    def send(self, device: str, payload: bytes) -> None:
        self.devices.publish(topics.cell_up(ROLLOUT, CELL, device, DeviceUpdate.KIND), payload)
        self.broker.run_until_idle()


def update(sender: str, round: int = 0, value: float = 1.0) -> bytes:
    return DeviceUpdate(rollout=ROLLOUT, round=round, sender=sender, delta={"w": np.full((2, 2), value, np.float32)},
                        num_samples=1, train_loss=0.0, steps=1).encode()


def fuzzed(rng: random.Random, good: bytes) -> tuple[str, bytes]:
    """One message the edge must refuse: (the device whose uplink it goes up on, its bytes)."""
    member = rng.choice(MEMBERS)
    kind = rng.randrange(6)
    if kind == 0:  # noise
        return member, rng.randbytes(rng.randrange(0, 300))
    if kind == 1:  # cut short
        return member, good[:rng.randrange(0, len(good) - 1)]
    if kind == 2:  # one byte of the tensors changed (the header's sha256 no longer matches)
        data = bytearray(good)
        data[rng.randrange(len(data) - 16, len(data))] ^= 1 + rng.randrange(255)
        return member, bytes(data)
    if kind == 3:  # a valid envelope for a round the cell is not in
        return member, update(member, round=rng.randrange(1, 10**6))
    if kind == 4:  # a sender that is no member of the cell, under an id of its own (a new one every time)
        intruder = f"x{rng.randrange(10**9)}"
        return intruder, update(intruder)
    other = rng.choice([m for m in MEMBERS if m != member])  # another member's update on this one's topic
    return member, update(other, value=rng.random())


def test_ten_thousand_fuzzed_messages_are_all_counted_and_logged_in_a_few_dozen_lines(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(tmp_path)
    rng = random.Random(0)
    good = update("dev-0")
    with caplog.at_level(logging.INFO):
        for _ in range(FUZZED):
            rig.send(*fuzzed(rng, good))
    m = rig.edge.metrics
    assert m.total(REJECTED) == FUZZED  # every message counted...
    assert m.total(DROPPED) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= REJECT_LOG_BUDGET + 1, "\n".join(warnings)  # ... in at most 21 lines a minute
    assert sum("of more than 20 reasons and senders this minute" in w for w in warnings) == 1  # saying it thins them
    reasons = {w.split(": ")[1] for w in warnings if w.startswith("rejected message")}
    assert {"bad_magic", "sha_mismatch", "wrong_round", "unknown_sender", "sender_mismatch"} <= reasons
    assert sum(len(w) for w in warnings) < 10_000  # the 660 KB it was: a few KB
    # The round is unharmed: the three members' updates still close it.
    for device in MEMBERS:
        rig.send(device, update(device))
    assert m.get(REJECTED, reason="late") == 0 and ROLLOUT in rig.edge.roles


def test_a_reason_and_sender_is_logged_once_a_minute_with_the_count_left_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(tmp_path)
    now = [1000.0]
    monkeypatch.setattr(rig.edge._reject_log, "clock", lambda: now[0])
    with caplog.at_level(logging.WARNING):
        for second in range(13):  # one garbage message a second from dev-1, and one from dev-2 at the start
            now[0] = 1000.0 + second
            rig.send("dev-1", GARBAGE)
        rig.send("dev-2", GARBAGE)
        now[0] = 1061.0
        rig.send("dev-1", GARBAGE)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("rejected message on ft/v1/r/cell/cell-a/up/dev-1/device_update: bad_magic: ")
    assert "dev-2" in lines[1] and "more since" not in lines[1]  # another sender: at once
    assert "dev-1" in lines[2] and lines[2].endswith(" (12 more since)")
    assert rig.edge.metrics.get(REJECTED, reason="bad_magic") == 15


def test_a_redelivered_update_of_a_closed_round_is_counted_and_logged_at_debug(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(tmp_path)
    for device in MEMBERS:
        rig.send(device, update(device))
    task = CellTask(rollout=ROLLOUT, round=1, sender="cloud", params=PARAMS, members=MEMBERS,
                    config=FedAvgConfig(deadline_s=600).to_dict())
    rig.cloud.publish(topics.cloud_down(ROLLOUT, CELL, task.KIND), task.encode())
    rig.broker.run_until_idle()
    with caplog.at_level(logging.DEBUG):
        rig.send("dev-0", update("dev-0"))  # round 0's update again (a resend from its store after a reconnect)
        rig.send("dev-1", update("dev-1", round=5))  # something new: a warning
    m = rig.edge.metrics
    assert m.get(REJECTED, reason="late") == 1 and m.get(REJECTED, reason="wrong_round") == 1  # both counted
    rejected = [(r.levelname, r.getMessage()) for r in caplog.records if "rejected" in r.getMessage()]
    assert [level for level, _ in rejected] == ["DEBUG", "WARNING"], rejected
    assert "dev-0" in rejected[0][1] and "again (a redelivery): late: " in rejected[0][1]
    assert "dev-1" in rejected[1][1] and ": wrong_round: " in rejected[1][1]

"""What every shell shares: presence (and identity conflicts), the diagnostics' log levels."""

from __future__ import annotations

import json
import logging

import pytest

from fedtier.algorithms.base import Dropped
from fedtier.runtime.metrics import Metrics
from fedtier.runtime.node_base import DROPPED, IDENTITY_CONFLICTS, NodeBase
from fedtier.transport import topics
from fedtier.transport.base import Inbound

log = logging.getLogger("test.node")


def presence(node: str, instance: str, since: float, state: str = "online") -> Inbound:
    doc = {"node": node, "state": state, "since": since, "instance": instance}
    return Inbound("cell", topics.status(node), json.dumps(doc).encode())


def online(base: NodeBase, *events: tuple[str, float]) -> list[str | None]:
    out = []
    for instance, since in events:
        inbound = presence("dev-0", instance, since)
        parsed = topics.parse(inbound.topic)
        assert parsed is not None
        out.append(base.came_online(inbound, parsed))
    return out


def test_a_restart_is_a_new_instance_once_and_not_a_conflict() -> None:
    base = NodeBase("cell-a", Metrics(node="cell-a", role="edge"), log, 1 << 20)
    assert online(base, ("A", 1.0), ("B", 2.0), ("B", 3.0)) == ["dev-0", "dev-0", "dev-0"]
    assert base.metrics.get(IDENTITY_CONFLICTS, identity="dev-0") == 0


def test_two_instances_taking_turns_are_counted_and_named_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    base = NodeBase("cell-a", Metrics(node="cell-a", role="edge"), log, 1 << 20)
    with caplog.at_level(logging.ERROR, logger="test.node"):
        online(base, ("A", 1.0), ("B", 2.0), ("A", 3.0), ("B", 4.0), ("A", 5.0))
    assert base.metrics.get(IDENTITY_CONFLICTS, identity="dev-0") == 3
    [line] = [r.getMessage() for r in caplog.records]  # one line a minute, however often they flap
    assert "two clients use the identity dev-0" in line and "copied bundle" in line


def test_expected_redeliveries_log_at_debug_other_drops_at_info(caplog: pytest.LogCaptureFixture) -> None:
    base = NodeBase("cell-a", Metrics(node="cell-a", role="edge"), log, 1 << 20)
    with caplog.at_level(logging.DEBUG, logger="test.node"):
        base.diagnostics([Dropped("duplicate", "k1"), Dropped("late", "k2")])
    assert [(r.levelname, "k1" in r.getMessage()) for r in caplog.records] == [("DEBUG", True), ("INFO", False)]
    assert base.metrics.get(DROPPED, reason="duplicate") == 1


def test_a_round_past_its_deadline_is_reported_then_repeated_at_intervals(caplog: pytest.LogCaptureFixture) -> None:
    base = NodeBase("cloud", Metrics(node="cloud", role="cloud"), log, 1 << 20)
    base.overdue_interval_s = 30.0
    with caplog.at_level(logging.WARNING, logger="test.node"):
        for now in (100.0, 110.0, 131.0):
            base.report_overdue("round 3 of rollout r", (3,), ["cell cell-b"], now)
        base.report_overdue("round 4 of rollout r", (4,), ["cell cell-a"], 132.0)  # a new round: at once
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("past its deadline and still waits for" in m for m in lines)
    assert "cell cell-a" in lines[-1]
    with caplog.at_level(logging.WARNING, logger="test.node"):
        base.report_overdue("round 5 of rollout r", (5,), [f"dev-{i:03d}" for i in range(1000)], 140.0)
    crowd = caplog.records[-1].getMessage()  # a cell of 1,000 devices: the first 20 and a count
    assert "dev-019 and 980 more (1000 in all)" in crowd and "dev-020" not in crowd


def test_a_late_message_is_a_straggler_and_a_rejection() -> None:
    from fedtier.errors import LateMessageError, ShaMismatchError
    from fedtier.runtime.node_base import REJECTED, STRAGGLERS

    m = Metrics(node="cloud", role="cloud")
    base = NodeBase("cloud", m, log, 1 << 20)
    inbound = Inbound(source="cloud", topic=topics.edge_up("r", "cell-a", "cell_update"), payload=b"")
    assert STRAGGLERS in m.snapshot() and m.get(STRAGGLERS) == 0  # exported before the first one

    base.reject(inbound, LateMessageError("update for round 1; cloud is at round 2"))
    base.reject(inbound, ShaMismatchError("bad"))

    assert m.get(STRAGGLERS) == 1
    assert m.get(REJECTED, reason="late") == 1 and m.total(REJECTED) == 2


def test_an_identity_conflict_is_labelled_by_the_exporting_node_and_the_shared_identity() -> None:
    base = NodeBase("cell-a", Metrics(node="cell-a", role="edge"), log, 1 << 20)
    online(base, ("A", 1.0), ("B", 2.0), ("A", 3.0))

    exported = [line for line in base.metrics.render().splitlines() if line.startswith(IDENTITY_CONFLICTS)]

    assert exported == [f'{IDENTITY_CONFLICTS}{{identity="dev-0",node="cell-a",role="edge"}} 1.0']


def test_a_seen_message_on_another_senders_topic_is_no_redelivery(caplog: pytest.LogCaptureFixture) -> None:
    """The same bytes on another device's topic are a spoofing attempt, not a redelivery: a WARNING."""
    import numpy as np

    from fedtier.runtime.node_base import REJECTED, sender_of
    from fedtier.wire.messages import DeviceUpdate

    base = NodeBase("cell-a", Metrics(node="cell-a", role="edge"), log, 1 << 20)
    payload = DeviceUpdate(rollout="r", round=0, sender="dev-1", delta={"w": np.zeros(2, np.float32)},
                           num_samples=1, train_loss=0.0, steps=1).encode()
    own = Inbound("cell", topics.cell_up("r", "cell-a", "dev-1", "device_update"), payload)
    other = Inbound("cell", topics.cell_up("r", "cell-a", "dev-2", "device_update"), payload)
    with caplog.at_level(logging.DEBUG, logger="test.node"):
        for inbound in (own, other):
            parsed = topics.parse(inbound.topic)
            assert parsed is not None
            assert (base.decode_inbound(inbound, parsed) is None) == (inbound is other)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "sender_mismatch" in caplog.text
    assert base.metrics.get(REJECTED, reason="sender_mismatch") == 1
    assert [sender_of(t) for t in (own.topic, topics.edge_up("r", "cell-b", "cell_update"),
                                   topics.cloud_down("r", "cell-a", "cell_task"), "x/y")] == \
        ["dev-1", "cell-b", "cloud_down", "other"]


def test_an_upgraded_devices_old_presence_topic_is_stale_once_its_cell_topic_was_seen() -> None:
    base = NodeBase("cloud", Metrics(node="cloud", role="cloud"), log, 1 << 20)
    old, new = topics.parse(topics.status("dev-0")), topics.parse(topics.cell_status("cell-a", "dev-0"))
    edge = topics.parse(topics.status("cell-a"))
    assert old is not None and new is not None and edge is not None
    assert not base.stale_presence(old)  # an older agent: its only presence
    assert not base.stale_presence(new)
    assert base.stale_presence(old)  # now superseded by the cell's topic
    assert not base.stale_presence(new) and not base.stale_presence(edge)

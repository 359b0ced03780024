"""Presence documents reach the store in batches: the newest per node, in one transaction per flush."""

from __future__ import annotations

from pathlib import Path

from cloud_coordinator.presence import FLUSH_S, PresenceBuffer
from cloud_coordinator.store import CoordinatorStore


class CountingStore(CoordinatorStore):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.batches: list[int] = []

    def record_presences(self, docs):  # type: ignore[no-untyped-def]
        self.batches.append(len(docs))
        return super().record_presences(docs)


def test_a_thousand_announcements_are_one_write_keeping_the_newest_document(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "c.db")
    buffer = PresenceBuffer(store)
    buffer.flush_due(0.0)  # nothing pending: nothing written
    for i in range(1000):
        buffer.add(f"dev-{i:04d}", {"node": f"dev-{i:04d}", "state": "offline", "role": "device"}, 5.0)
        buffer.add(f"dev-{i:04d}", {"node": f"dev-{i:04d}", "state": "online", "role": "device"}, 6.0)
    assert store.presence() == []  # not yet written
    buffer.flush_due(0.5)  # before FLUSH_S: still waiting
    assert store.batches == [] and store.presence() == []
    buffer.flush_due(FLUSH_S)
    assert store.batches == [1000]
    seen = store.presence()
    assert len(seen) == 1000 and {d["state"] for d in seen} == {"online"} and {d["last_seen"] for d in seen} == {6.0}
    buffer.add("dev-0000", {"node": "dev-0000", "state": "online", "role": "device"}, 9.0)  # a redelivery
    assert buffer.flush() == []  # unchanged: not a new sighting
    assert next(d for d in store.presence() if d["node"] == "dev-0000")["last_seen"] == 6.0
    store.close()

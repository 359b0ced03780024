"""Group commit at the edge: the messages waiting in the inbox are recorded in one transaction and acknowledged only
after it committed; a crash inside the batch commits and acknowledges nothing; an output is durable before it is
published, inside a batch too."""

from __future__ import annotations

import queue
import sqlite3
import threading
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from edge_broker.store import EdgeStore
from fedtier.runtime.node_base import run_loop


class Inbound:
    def __init__(self, n: int, log: list[str]) -> None:
        self.n, self.log = n, log

    def confirm(self) -> None:
        self.log.append(f"ack {self.n}")


class Node:
    """Records each message in an EdgeStore, as the edge does; ``crash_at`` raises while handling that message."""

    def __init__(self, store: EdgeStore, stop: threading.Event, log: list[str], crash_at: int | None = None) -> None:
        self.store, self.stop, self.log, self.crash_at = store, stop, log, crash_at
        self.busy_s = {"decode": 0.0, "handle": 0.0, "tick": 0.0}

    def batch(self) -> AbstractContextManager[None]:
        return self.store.batch()

    def handle(self, inbound: Inbound, now: float) -> None:
        if inbound.n == self.crash_at:
            raise RuntimeError("crash while handling")
        self.store.record("r", 0, "device_update", f"k{inbound.n}", b"x" * 10)
        self.log.append(f"handled {inbound.n}")
        if inbound.n == 4:
            self.stop.set()

    def tick(self, now: float) -> None:
        return None


def committed(path: Path) -> int:
    with sqlite3.connect(path) as other:  # a second connection sees only what was committed
        return int(other.execute("SELECT COUNT(*) FROM inputs").fetchone()[0])


def test_waiting_messages_are_committed_together_and_acknowledged_after(tmp_path: Path) -> None:
    store, stop, log = EdgeStore(tmp_path / "edge.db"), threading.Event(), []
    inbox: queue.Queue[Any] = queue.Queue()
    for n in range(5):
        inbox.put(Inbound(n, log))
    real_batch = store.db.batch

    @contextmanager
    def observed() -> Iterator[None]:  # after each commit: what is durable, and what was acknowledged by then
        with real_batch():
            yield
        log.append(f"commit {committed(tmp_path / 'edge.db')}")

    store.db.batch = observed  # type: ignore[method-assign]
    run_loop(Node(store, stop, log), inbox, stop, tick_s=10)
    # one batch, one commit holding all five inputs, and only then the five acknowledgements
    assert log == [*(f"handled {n}" for n in range(5)), "commit 5", *(f"ack {n}" for n in range(5))]


def test_a_crash_inside_a_batch_commits_and_acknowledges_nothing(tmp_path: Path) -> None:
    store, stop, log = EdgeStore(tmp_path / "edge.db"), threading.Event(), []
    inbox: queue.Queue[Any] = queue.Queue()
    for n in range(5):
        inbox.put(Inbound(n, log))
    with pytest.raises(RuntimeError, match="crash while handling"):
        run_loop(Node(store, stop, log, crash_at=3), inbox, stop, tick_s=10)
    assert committed(tmp_path / "edge.db") == 0  # rolled back: the broker redelivers all five
    assert not any(e.startswith("ack") for e in log)
    store.record("r", 0, "device_update", "later", b"y")  # the store is usable again, outside a batch
    assert committed(tmp_path / "edge.db") == 1


def test_an_output_is_durable_before_it_is_published_inside_a_batch(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path / "edge.db")
    with store.batch():
        store.record("r", 0, "device_update", "k1", b"in")
        store.save_output("r", 0, "out", b"noised aggregate")
        with sqlite3.connect(tmp_path / "edge.db") as other:
            assert other.execute("SELECT payload FROM outputs").fetchone() == (b"noised aggregate",)
            assert other.execute("SELECT COUNT(*) FROM inputs").fetchone() == (1,)  # committed with it
        store.prune("r", 0)  # a transaction inside the batch is a savepoint
        store.record("r", 0, "device_update", "k2", b"in")
    assert committed(tmp_path / "edge.db") == 2

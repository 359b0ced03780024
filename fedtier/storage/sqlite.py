"""SQLite as the device's and the edge's stores use it: one connection shared by threads under a lock,
write-ahead logging, and explicit transactions for changes that must land together. (The
coordinator's store, SQLite or PostgreSQL, is ``cloud_coordinator/store.py`` on SQLAlchemy.)"""

from __future__ import annotations

import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class Database:
    """A connection plus the lock that serializes its users (node thread, paho callbacks).

    Args:
        path: the database file, or ``":memory:"`` (the simulator's nodes).
        schema: ``CREATE TABLE IF NOT EXISTS ...`` statements, run once.
        synchronous: ``FULL`` where an acknowledged message depends on the write having
            reached the disk (stores of accepted updates), ``NORMAL`` for caches.
    """

    def __init__(self, path: Path | str, schema: str, *, synchronous: str = "FULL") -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        self.lock = threading.Lock()
        self.conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={synchronous}")
        self.conn.executescript(schema)
        self.synchronous = synchronous
        self._batching = False

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Group commit: everything written inside (by any of the methods) lands in one transaction, committed
        (one fsync) when the block ends, or rolled back if it raises. Why: a store that must be durable before
        each message is acknowledged pays one fsync per message; a node that handles the messages waiting in its
        inbox together and acknowledges them after the block pays one for all (``run_loop``)."""
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            self._batching = True
        try:
            yield
        except BaseException:
            with self.lock:
                self._batching = False
                self.conn.execute("ROLLBACK")
            raise
        with self.lock:
            self._batching = False
            self.conn.execute("COMMIT")

    def commit_pending(self) -> None:
        """Inside ``batch``: commit what was written so far now (and go on batching); outside, nothing to do."""
        with self.lock:
            if self._batching:
                self.conn.execute("COMMIT")
                self.conn.execute("BEGIN IMMEDIATE")

    @contextmanager
    def transaction(self, *, flushed: bool = True) -> Iterator[sqlite3.Connection]:
        """Hold the lock; commit everything done inside, or nothing if it raises (inside ``batch``: a savepoint,
        committed with the batch).

        ``flushed=False``: the commit is written to the log but not flushed to the disk (``synchronous=NORMAL``
        for it): it survives the process dying, not the machine losing power. For records worth less than an
        fsync each (the device's work in progress: one before and one after every piece of local work)."""
        with self.lock:
            begin, commit, rollback = (("SAVEPOINT tx", "RELEASE tx", "ROLLBACK TO tx") if self._batching
                                       else ("BEGIN IMMEDIATE", "COMMIT", "ROLLBACK"))
            relaxed = not flushed and not self._batching and self.synchronous != "NORMAL"
            if relaxed:
                self.conn.execute("PRAGMA synchronous=NORMAL")
            try:
                self.conn.execute(begin)
                try:
                    yield self.conn
                except BaseException:
                    self.conn.execute(rollback)
                    if self._batching:
                        self.conn.execute("RELEASE tx")
                    raise
                self.conn.execute(commit)
            finally:
                if relaxed:
                    self.conn.execute(f"PRAGMA synchronous={self.synchronous}")

    @contextmanager
    def locked(self) -> Iterator[sqlite3.Connection]:
        """Hold the lock for single statements (each commits by itself)."""
        with self.lock:
            yield self.conn

    def close(self) -> None:
        with self.lock:
            self.conn.close()

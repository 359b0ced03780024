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

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Hold the lock; commit everything done inside, or nothing if it raises."""
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    @contextmanager
    def locked(self) -> Iterator[sqlite3.Connection]:
        """Hold the lock for single statements (each commits by itself)."""
        with self.lock:
            yield self.conn

    def close(self) -> None:
        with self.lock:
            self.conn.close()

"""Presence documents written to the coordinator's store in batches.

Every node announces itself on ``ft/v1/status/<node>`` (retained): a fleet of 10,000 devices does so
within a minute of starting, and after every reconnection. One transaction per document (each an
fsync under SQLite's ``synchronous=FULL``) put the coordinator's artifact and round messages behind
10,000 disk flushes. The inventory is not round state: a document kept in memory for up to
``FLUSH_S`` and lost in a crash comes back anyway (the broker redelivers retained presence).
"""

from __future__ import annotations

from typing import Any, Mapping

FLUSH_S = 1.0
"""Longest a presence document waits in memory."""
MAX_PENDING = 2000
"""A batch this large is written at once."""


class PresenceBuffer:
    """The newest document of each node since the last write (``store.record_presences``)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._pending: dict[str, tuple[Mapping[str, Any], float]] = {}
        self._next = 0.0

    def add(self, node: str, doc: Mapping[str, Any], wall_time: float) -> None:
        self._pending[node] = (doc, wall_time)
        if len(self._pending) >= MAX_PENDING:
            self.flush()

    def flush_due(self, now: float) -> None:
        """Write what is pending if ``FLUSH_S`` has passed since the last write (call from ``tick``)."""
        if now >= self._next:
            self._next = now + FLUSH_S
            self.flush()

    def flush(self) -> list[str]:
        pending, self._pending = self._pending, {}
        return self.store.record_presences(pending) if pending else []

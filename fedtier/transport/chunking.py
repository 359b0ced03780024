"""Split messages larger than the broker's limit into chunk envelopes, and put them back.

paho does not check the broker's Maximum Packet Size; a QoS 1 publish over the limit makes
the broker drop the client, and paho re-sends it on every reconnect, forever (field notes
§2.2). So every transport splits before publishing.

A chunk is an ordinary envelope of type ``chunk`` whose ``data`` tensor (u8) holds a slice
of the whole message's bytes. Its header carries the whole message's idempotency key,
its length and sha256, and the chunk's index and count. The receiver keeps the chunks in a
``ChunkStore`` (memory, or SQLite for nodes that must not lose anything on a crash),
verifies the reassembled bytes against the sha256, and hands the whole message on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedtier import wire
from fedtier.errors import ChunkError, LocalProtocolError, OversizeError, ShaMismatchError
from fedtier.storage.sqlite import Database
from fedtier.wire import Envelope, TensorEncoding

CHUNK_TYPE = "chunk"
_MIN_CHUNK_DATA = 256


def _chunk_envelope(whole_key: str, sender: str, rollout: str, index: int, count: int,
                    total_len: int, total_sha: str, data: bytes) -> Envelope:
    return Envelope(
        type=CHUNK_TYPE, rollout=rollout, round=0, sender=sender,
        key=f"{whole_key}#{index}/{count}",
        meta={"wk": whole_key, "tlen": total_len, "tsha": total_sha},
        tensors={"data": np.frombuffer(data, dtype=np.uint8)},
        encodings={"data": TensorEncoding("u8")},
        chunk_index=index, chunk_count=count,
    )


def split(payload: bytes, max_size: int) -> list[bytes]:
    """Return ``[payload]`` if it fits in ``max_size`` bytes, else chunk envelopes that each fit.

    Args:
        payload: an encoded envelope.
        max_size: the largest payload the transport may publish.

    Raises:
        LocalProtocolError: ``max_size`` is too small to carry any data.
    """
    if len(payload) <= max_size:
        return [payload]
    header = wire.peek_header(payload)
    whole_key, sender, rollout = header["k"], header["s"], header["ro"]
    total_sha = hashlib.sha256(payload).hexdigest()
    # Measure the overhead of a chunk envelope with the largest index/count we could need.
    probe_count = len(payload)
    overhead = len(wire.encode(_chunk_envelope(whole_key, sender, rollout, probe_count - 1, probe_count,
                                               len(payload), total_sha, b"")))
    room = max_size - overhead - 16
    if room < _MIN_CHUNK_DATA:
        raise LocalProtocolError(f"max_size {max_size} leaves no room for chunk data (overhead {overhead})")
    count = -(-len(payload) // room)
    return [
        wire.encode(_chunk_envelope(whole_key, sender, rollout, i, count, len(payload), total_sha,
                                    payload[i * room:(i + 1) * room]))
        for i in range(count)
    ]


def is_chunk(env: Envelope) -> bool:
    return env.type == CHUNK_TYPE


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    whole_key: str
    index: int
    count: int
    total_len: int
    total_sha: str
    data: bytes


def chunk_info(env: Envelope) -> ChunkInfo:
    """Validate a decoded chunk envelope's fields."""
    meta = env.meta
    wk, tlen, tsha = meta.get("wk"), meta.get("tlen"), meta.get("tsha")
    data = env.tensors.get("data")
    if (not isinstance(wk, str) or not isinstance(tlen, int) or isinstance(tlen, bool) or tlen <= 0
            or not isinstance(tsha, str) or len(tsha) != 64 or data is None or data.dtype != np.uint8
            or env.chunk_index is None or env.chunk_count is None):
        raise ChunkError("chunk envelope lacks valid wk/tlen/tsha/data/index/count")
    if env.key != f"{wk}#{env.chunk_index}/{env.chunk_count}":
        raise ChunkError("chunk key does not match its whole-message key and index")
    return ChunkInfo(wk, env.chunk_index, env.chunk_count, tlen, tsha, data.tobytes())


class ChunkStore(Protocol):
    """Where partial messages wait. Must be safe to call from one thread at a time."""

    def put(self, topic: str, info: ChunkInfo, now: float) -> None: ...
    def parts(self, whole_key: str) -> list[tuple[str, ChunkInfo]]: ...
    def delete(self, whole_key: str) -> None: ...
    def pending_bytes(self) -> int: ...
    def keys_older_than(self, cutoff: float) -> list[str]:
        """Keys of *partial* messages first received before ``cutoff``."""
        ...
    def complete_keys(self) -> list[str]: ...


class MemoryChunkStore:
    """Chunks in a dict: lost on a crash (fine for devices, whose updates sit in an outbox)."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[int, tuple[str, ChunkInfo, float]]] = {}

    def put(self, topic: str, info: ChunkInfo, now: float) -> None:
        self._parts.setdefault(info.whole_key, {})[info.index] = (topic, info, now)

    def parts(self, whole_key: str) -> list[tuple[str, ChunkInfo]]:
        return [(t, i) for t, i, _ in sorted(self._parts.get(whole_key, {}).values(), key=lambda p: p[1].index)]

    def delete(self, whole_key: str) -> None:
        self._parts.pop(whole_key, None)

    def pending_bytes(self) -> int:
        return sum(len(i.data) for parts in self._parts.values() for _, i, _ in parts.values())

    def keys_older_than(self, cutoff: float) -> list[str]:
        """Partial messages (not complete ones) whose first chunk arrived before ``cutoff``."""
        return [k for k, parts in self._parts.items()
                if len(parts) < next(iter(parts.values()))[1].count
                and min(t for _, _, t in parts.values()) < cutoff]

    def complete_keys(self) -> list[str]:
        return [k for k, parts in self._parts.items()
                if len(parts) == next(iter(parts.values()))[1].count]


class SqliteChunkStore:
    """Chunks in SQLite: a restarted edge or coordinator finds what it had received (and acked)."""

    def __init__(self, path: str) -> None:
        # FULL: a chunk is acknowledged to the broker as soon as it is stored.
        self.db = Database(path, "CREATE TABLE IF NOT EXISTS chunks (wk TEXT NOT NULL, idx INTEGER NOT NULL,"
                                 " cnt INTEGER NOT NULL, tlen INTEGER NOT NULL, tsha TEXT NOT NULL,"
                                 " topic TEXT NOT NULL, data BLOB NOT NULL, received REAL NOT NULL,"
                                 " PRIMARY KEY (wk, idx));")

    def put(self, topic: str, info: ChunkInfo, now: float) -> None:
        with self.db.locked() as db:
            db.execute("INSERT OR REPLACE INTO chunks VALUES (?,?,?,?,?,?,?,?)",
                             (info.whole_key, info.index, info.count, info.total_len, info.total_sha,
                              topic, info.data, now))

    def parts(self, whole_key: str) -> list[tuple[str, ChunkInfo]]:
        with self.db.locked() as db:
            rows = db.execute("SELECT topic, wk, idx, cnt, tlen, tsha, data FROM chunks WHERE wk=?"
                                    " ORDER BY idx", (whole_key,)).fetchall()
        return [(r[0], ChunkInfo(r[1], r[2], r[3], r[4], r[5], bytes(r[6]))) for r in rows]

    def delete(self, whole_key: str) -> None:
        with self.db.locked() as db:
            db.execute("DELETE FROM chunks WHERE wk=?", (whole_key,))

    def pending_bytes(self) -> int:
        with self.db.locked() as db:
            return int(db.execute("SELECT COALESCE(SUM(LENGTH(data)),0) FROM chunks").fetchone()[0])

    def keys_older_than(self, cutoff: float) -> list[str]:
        with self.db.locked() as db:
            return [r[0] for r in db.execute(
                "SELECT wk FROM chunks GROUP BY wk HAVING COUNT(*) < MAX(cnt) AND MIN(received) < ?",
                (cutoff,))]

    def complete_keys(self) -> list[str]:
        with self.db.locked() as db:
            return [r[0] for r in db.execute(
                "SELECT wk FROM chunks GROUP BY wk HAVING COUNT(*) = MAX(cnt)")]

    def close(self) -> None:
        with self.db.locked() as db:
            db.close()


class Reassembler:
    """Collects chunks until a message is whole, then verifies and returns it.

    The caller deletes a completed message with ``done(key)`` only after it has processed
    it, so a crash in between finds the message again (``complete()`` on restart).
    """

    def __init__(self, store: ChunkStore | None = None, *, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
                 max_pending_bytes: int = 512 << 20, ttl_s: float = 600.0) -> None:
        self.store: ChunkStore = store if store is not None else MemoryChunkStore()
        self.max_message_bytes = max_message_bytes
        self.max_pending_bytes = max_pending_bytes
        self.ttl_s = ttl_s
        # Wire bytes received per partial message, for traffic accounting only (not
        # persisted: after a restart the count covers the chunks received since).
        self._wire: dict[str, int] = {}

    def add(self, topic: str, env: Envelope, now: float, wire_len: int = 0
            ) -> tuple[str, bytes, int] | None:
        """Store one chunk; return ``(whole_key, payload, wire_bytes)`` when its message is complete.

        Raises:
            ChunkError: the chunk contradicts earlier chunks of the same message.
            OversizeError: the message, or all pending chunks together, exceed the limits.
            ShaMismatchError: the reassembled bytes do not match the announced sha256.
        """
        info = chunk_info(env)
        if info.total_len > self.max_message_bytes:
            raise OversizeError(f"chunked message of {info.total_len} bytes exceeds {self.max_message_bytes}")
        existing = self.store.parts(info.whole_key)
        if existing:
            first_topic, first = existing[0]
            if (first.count, first.total_len, first.total_sha) != (info.count, info.total_len, info.total_sha):
                raise ChunkError(f"chunk {info.index} of {info.whole_key!r} disagrees with earlier chunks")
            if first_topic != topic:
                raise ChunkError(f"chunk {info.index} of {info.whole_key!r} arrived on another topic")
            if any(p.index == info.index for _, p in existing):
                return None  # a redelivered chunk: already have it
        if self.store.pending_bytes() + len(info.data) > self.max_pending_bytes:
            raise OversizeError("too many bytes in partially received messages")
        self.store.put(topic, info, now)
        self._wire[info.whole_key] = self._wire.get(info.whole_key, 0) + wire_len
        assembled = self._assemble(info.whole_key)
        if assembled is None:
            return None
        return assembled[0], assembled[1], self._wire.pop(info.whole_key, 0)

    def _assemble(self, whole_key: str) -> tuple[str, bytes] | None:
        parts = self.store.parts(whole_key)
        if not parts or len(parts) != parts[0][1].count:
            return None
        payload = b"".join(p.data for _, p in parts)
        first = parts[0][1]
        if len(payload) != first.total_len or hashlib.sha256(payload).hexdigest() != first.total_sha:
            self.store.delete(whole_key)
            raise ShaMismatchError(f"reassembled message {whole_key!r} does not match its sha256")
        return whole_key, payload

    def complete(self) -> list[tuple[str, str, bytes]]:
        """Messages that were complete but not yet ``done`` (after a restart): (topic, key, bytes)."""
        out = []
        for key in self.store.complete_keys():
            parts = self.store.parts(key)
            try:
                assembled = self._assemble(key)
            except ShaMismatchError:
                continue
            if assembled is not None:
                out.append((parts[0][0], key, assembled[1]))
        return out

    def done(self, whole_key: str) -> None:
        self.store.delete(whole_key)
        self._wire.pop(whole_key, None)

    def expire(self, now: float) -> list[str]:
        """Drop partial messages older than the TTL; returns their keys (for logging)."""
        stale = self.store.keys_older_than(now - self.ttl_s)
        for key in stale:
            self.done(key)
        return stale


__all__ = ["split", "is_chunk", "Reassembler", "MemoryChunkStore", "SqliteChunkStore", "ChunkInfo",
           "CHUNK_TYPE"]

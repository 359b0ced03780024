"""What every transport offers, and the chunking/accounting logic they share."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Protocol

from fedtier import wire
from fedtier.errors import RemoteProtocolError
from fedtier.transport import chunking, topics

log = logging.getLogger("fedtier.transport")

DoneCallback = Callable[[bool], None]
"""Called once a publish is acknowledged by the broker (True) or refused (False)."""


def _noop() -> None:
    return None


@dataclass(slots=True)
class Inbound:
    """One message delivered to a node.

    ``payload`` is whole (chunks already reassembled). ``error`` is set instead when the
    transport itself had to reject what arrived (a chunk that contradicts its siblings, a
    reassembled message whose sha256 is wrong): the node logs and counts it like any other
    rejection. ``confirm`` must be called once the node has processed (and, where it
    matters, persisted) the message: only then is it acknowledged / forgotten.
    """

    source: str
    topic: str
    payload: bytes
    confirm: Callable[[], None] = _noop
    error: RemoteProtocolError | None = None
    wire_bytes: int = -1
    """Bytes this message took on the wire (all its chunks); -1 means ``len(payload)``."""

    @property
    def size_on_wire(self) -> int:
        return len(self.payload) if self.wire_bytes < 0 else self.wire_bytes


class Transport(Protocol):
    """A connection of one node to one broker."""

    name: str

    def subscribe(self, topic_filter: str) -> None:
        """Subscribe now and after every reconnect."""
        ...

    def publish(self, topic: str, payload: bytes, *, retain: bool = False,
                on_done: DoneCallback | None = None) -> int:
        """Publish (QoS 1), chunking if needed. Returns the bytes put on the wire."""
        ...

    @property
    def traffic(self) -> "Traffic": ...


@dataclass
class Traffic:
    """Bytes and messages per (direction, channel); channel from ``topics.parse``."""

    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    messages: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, direction: str, topic: str, nbytes: int) -> None:
        parsed = topics.parse(topic)
        channel = parsed.channel if parsed is not None else "other"
        with self._lock:
            self.bytes[(direction, channel)] += nbytes
            self.messages[(direction, channel)] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f"{d}.{c}": n for (d, c), n in sorted(self.bytes.items())}


class ChunkingMixin:
    """Outbound splitting and inbound reassembly, shared by the memory and MQTT transports."""

    name: str
    reassembler: chunking.Reassembler

    def _split(self, payload: bytes, limit: int) -> list[bytes]:
        if not payload.startswith(wire.MAGIC):
            if len(payload) > limit:
                raise ValueError(f"non-envelope payload of {len(payload)} bytes exceeds the limit {limit}")
            return [payload]
        return chunking.split(payload, limit)

    def _classify(self, topic: str, payload: bytes, now: float,
                  ack: Callable[[], None]) -> Inbound | None:
        """Turn one received publish into an ``Inbound`` for the node, or ``None`` (a chunk of
        a message that is not complete yet, which has been stored and acknowledged)."""
        if not payload.startswith(wire.MAGIC):
            return Inbound(self.name, topic, payload, ack)
        try:
            header = wire.peek_header(payload)
        except RemoteProtocolError:
            return Inbound(self.name, topic, payload, ack)  # the node decodes, rejects and counts it
        if header.get("t") != chunking.CHUNK_TYPE:
            return Inbound(self.name, topic, payload, ack)
        try:
            env = wire.decode(payload)
            done = self.reassembler.add(topic, env, now, wire_len=len(payload))
        except RemoteProtocolError as exc:
            ack()
            return Inbound(self.name, topic, b"", _noop, error=exc)
        ack()  # the chunk is stored (durably, for durable stores): the broker may forget it
        if done is None:
            return None
        key, whole, wire_total = done
        return Inbound(self.name, topic, whole, lambda: self.reassembler.done(key), wire_bytes=wire_total)

    def pending_complete(self) -> list[Inbound]:
        """Whole messages left in a durable chunk store by a crash, for redelivery at start."""
        return [Inbound(self.name, topic, data, self._done_callback(key))
                for topic, key, data in self.reassembler.complete()]

    def _done_callback(self, key: str) -> Callable[[], None]:
        return lambda: self.reassembler.done(key)

"""An in-memory broker and transports, for the simulator and for unit tests of shells.

Delivery is deterministic: publishes are queued in one FIFO and ``run_until_idle`` hands
them to subscribers in order, on the caller's thread. One exception keeps a simulated round's
memory bounded: what a *leaf* transport (``connect(..., leaf=True)``: a simulated device)
publishes while it handles a delivery is handed out right after its handler returns, ahead
of the queue. In FIFO order every device would receive its task before the first update
reached an edge, so a whole round's updates (100,000 of them at 100,000 devices) would wait
at once; with leaves delivered at once, an edge folds each update as it is published. Every
node still receives its messages in the same order as in FIFO order (a device's update comes
after the tasks already queued only for other devices, and what the edges publish in turn
still joins the queue's tail), so the models are bit-identical; ``eager_leaves=False``
restores plain FIFO (tests compare the two). Retained messages, chunking (when a
``max_payload`` is set) and traffic accounting behave as over MQTT, so the simulator's
byte counts are comparable to a real run's.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from fedtier.errors import TransportError
from fedtier.transport import chunking
from fedtier.transport.base import ChunkingMixin, DoneCallback, Inbound, Traffic
from fedtier.transport.topic_filters import SubscriptionTree, topic_matches

Handler = Callable[[Inbound], None]


class MemoryBroker:
    """Routes publishes between ``MemoryTransport``s by MQTT topic-filter matching."""

    def __init__(self, *, max_payload: int = 1 << 30, eager_leaves: bool = True) -> None:
        self.max_payload = max_payload
        self.eager_leaves = eager_leaves
        self._transports: list[MemoryTransport] = []
        self._connected: dict[int, int] = {}
        """``id`` of each connected transport -> its place in the connection order (routes follow it)."""
        self._connections = 0
        self._queue: deque[tuple[MemoryTransport, str, bytes]] = deque()
        self._at_once: deque[tuple[MemoryTransport, str, bytes]] | None = None
        """While a leaf handles a delivery: where its publishes go, delivered right after it."""
        self._held: dict[int, int] = {}
        """``id`` of each payload waiting -> how many deliveries of it wait (a payload routed to 200 devices is
        one ``bytes`` object: memory counts it once)."""
        self._queued_bytes = 0
        self.peak_queued = 0
        """The most messages waiting at once (in the queue, or a leaf's publishes not yet handed out)."""
        self.peak_queued_bytes = 0
        """The most bytes of distinct payloads waiting at once."""
        self._retained: dict[str, bytes] = {}
        # topic -> subscribed transports. Topics repeat every round, so routing is a dict
        # lookup instead of matching every filter of every node (quadratic in fleet size).
        self._routes: dict[str, list[MemoryTransport]] = {}
        self._tree: SubscriptionTree[MemoryTransport] = SubscriptionTree()
        self.now: float = 0.0

    def connect(self, name: str, handler: Handler | None = None, *, leaf: bool = False) -> "MemoryTransport":
        """A transport; ``leaf``: what it publishes while handling a delivery is delivered at once (module doc)."""
        return self.register(MemoryTransport(self, name, handler, leaf=leaf))

    def register(self, transport: "MemoryTransport") -> "MemoryTransport":
        """Connect a transport built by hand (a subclass): only registered transports are routed to."""
        self._transports.append(transport)
        self._connected[id(transport)] = self._connections
        self._connections += 1
        return transport

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        if retain:
            if payload:
                self._retained[topic] = payload
            else:
                self._retained.pop(topic, None)
        routes = self._routes.get(topic)
        if routes is None:
            matched = {id(t): t for _, t in self._tree.match(topic) if id(t) in self._connected}  # once each
            # Connection order (deterministic), by sorting the matches: every device publishes on topics of its
            # own, so a scan of all transports per new topic cost the fleet's size squared (10^10 steps for
            # 100,000 devices' first round).
            routes = sorted(matched.values(), key=lambda t: self._connected[id(t)])
            self._routes[topic] = routes
        queue = self._queue if self._at_once is None else self._at_once
        for t in routes:
            queue.append((t, topic, payload))
        self._hold(payload, len(routes))

    def _hold(self, payload: bytes, deliveries: int) -> None:
        if not deliveries:
            return
        held = self._held.get(id(payload), 0)
        if not held:
            self._queued_bytes += len(payload)
        self._held[id(payload)] = held + deliveries
        self.peak_queued = max(self.peak_queued, len(self._queue) + len(self._at_once or ()))
        self.peak_queued_bytes = max(self.peak_queued_bytes, self._queued_bytes)

    def _release(self, payload: bytes) -> None:
        held = self._held.pop(id(payload), 0) - 1
        if held > 0:
            self._held[id(payload)] = held
        else:
            self._queued_bytes -= len(payload)

    def _subscribed(self, transport: "MemoryTransport", topic_filter: str) -> None:
        self._tree.add(topic_filter, str(id(transport)), transport)
        self._routes.clear()
        for topic, payload in sorted(self._retained.items()):
            if topic_matches(topic_filter, topic):
                self._queue.append((transport, topic, payload))
                self._hold(payload, 1)

    def run_until_idle(self, max_deliveries: int = 10_000_000) -> int:
        """Deliver queued messages (and whatever handlers publish in turn) until none are left."""
        delivered = 0
        while self._queue:
            transport, topic, payload = self._queue.popleft()
            delivered += self._deliver(transport, topic, payload)
            if delivered >= max_deliveries:
                raise RuntimeError("message storm: more deliveries than max_deliveries")
        return delivered

    def _deliver(self, transport: "MemoryTransport", topic: str, payload: bytes) -> int:
        """One delivery, and if its receiver is a leaf, the deliveries of what it published meanwhile."""
        self._release(payload)
        if not (transport.leaf and self.eager_leaves):
            transport._deliver(topic, payload, self.now)
            return 1
        at_once: deque[tuple[MemoryTransport, str, bytes]] = deque()
        self._at_once = at_once
        try:
            transport._deliver(topic, payload, self.now)
        finally:
            self._at_once = None
        delivered = 1
        while at_once:  # receivers' own publishes join the queue's tail, as in FIFO order
            receiver, sub_topic, sub_payload = at_once.popleft()
            self._release(sub_payload)
            receiver._deliver(sub_topic, sub_payload, self.now)
            delivered += 1
        return delivered


class MemoryTransport(ChunkingMixin):
    """One node's connection to a ``MemoryBroker``."""

    def __init__(self, broker: MemoryBroker, name: str, handler: Handler | None, *, leaf: bool = False) -> None:
        self.broker = broker
        self.name = name
        self.leaf = leaf
        self.secure = True  # in-process: nothing travels over a network
        self.handler = handler
        self.filters: list[str] = []
        self.reassembler = chunking.Reassembler()
        self._traffic = Traffic()

    @property
    def traffic(self) -> Traffic:
        return self._traffic

    def set_handler(self, handler: Handler) -> None:
        self.handler = handler

    def close(self) -> None:
        """Disconnect: no more deliveries (messages already queued for us are dropped)."""
        if self in self.broker._transports:
            self.broker._transports.remove(self)
        self.broker._connected.pop(id(self), None)
        for topic_filter in self.filters:
            self.broker._tree.remove(topic_filter, str(id(self)))
        self.broker._routes.clear()
        for q in self.broker._queue:
            if q[0] is self:
                self.broker._release(q[2])
        self.broker._queue = type(self.broker._queue)(q for q in self.broker._queue if q[0] is not self)

    def subscribe(self, topic_filter: str) -> None:
        if topic_filter not in self.filters:
            self.filters.append(topic_filter)
            self.broker._subscribed(self, topic_filter)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False,
                on_done: DoneCallback | None = None) -> int:
        total = 0
        parts = self._split(payload, self.broker.max_payload)
        if retain and len(parts) > 1:
            raise TransportError(f"retained message on {topic} is {len(payload)} bytes, over the limit "
                                 f"{self.broker.max_payload} (retained messages are not chunked)")
        for part in parts:
            self.broker._publish(topic, part, retain)
            self._traffic.count("out", topic, len(part))
            total += len(part)
        if on_done is not None:
            on_done(True)
        return total

    def _deliver(self, topic: str, payload: bytes, now: float) -> None:
        self._traffic.count("in", topic, len(payload))
        inbound = self._classify(topic, payload, now, ack=lambda: None)
        if inbound is not None and self.handler is not None:
            self.handler(inbound)
            inbound.confirm()

"""Sessions: what the broker remembers about a client id, connected or not (MQTT §4.1).

A :class:`Session` owns the client's subscriptions, the QoS 1 and 2 messages it has been sent
but not acknowledged (*in flight*: awaiting PUBACK or PUBREC, then PUBCOMP after our PUBREL),
the messages waiting for a free slot in the client's Receive Maximum window or for the client
to come back (*pending*), and the QoS 2 messages the client sent us that wait for its PUBREL
(*incoming*). It talks to the network only through the small :class:`ClientLink` interface,
so the delivery rules here can be read (and tested) without asyncio.

Every message a session keeps is charged to the broker's byte budget
(:class:`~.limits.MessageHolds`) from the moment it is queued until its flow ends.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from fedtier.embedded_broker.limits import ByteBudget, MessageHolds
from fedtier.embedded_broker.packets import (
    NO_PROPERTIES,
    Packet,
    Properties,
    Publish,
    PubRel,
    SubscriptionOptions,
)

logger = logging.getLogger("fedtier.embedded_broker")

_DROP_WARNING_INTERVAL = 5.0


@dataclass(frozen=True, slots=True)
class Message:
    """An application message as the broker stores and routes it.

    ``properties`` holds only what is forwarded to subscribers (§3.3.2.3: Payload Format
    Indicator, Content Type, Response Topic, Correlation Data, User Properties); the Message
    Expiry Interval is kept as an absolute ``expires_at`` so a forwarded copy can carry the
    time *remaining* ([MQTT-3.3.2-6]).
    """

    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: Properties = NO_PROPERTIES
    expires_at: float | None = None
    origin: str | None = None
    """Client id of the publisher, for the No Local subscription option."""

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    @property
    def size(self) -> int:
        """Bytes charged to the budget while the message is kept: payload and topic."""
        return len(self.payload) + len(self.topic)


@dataclass(frozen=True, slots=True)
class Subscription:
    """One subscription of a session: granted options plus the v5 Subscription Identifier."""

    options: SubscriptionOptions
    identifier: int | None = None


@dataclass(slots=True)
class Delivery:
    """One message on its way to one client, at the QoS and RETAIN flag chosen for it.

    ``released`` marks a QoS 2 delivery whose PUBREC arrived: only our PUBREL is outstanding.
    """

    message: Message
    qos: int
    retain: bool
    subscription_ids: tuple[int, ...] = ()
    packet_id: int = 0
    released: bool = False


class Cancellable(Protocol):
    """A scheduled callback that can be cancelled (``asyncio.TimerHandle`` fits)."""

    def cancel(self) -> None: ...


class ClientLink:
    """What a session needs from a network connection. Implemented by the server.

    Attributes are filled from the client's CONNECT: ``receive_maximum`` is the QoS 1/2
    window (§3.1.2.11.3) and ``maximum_packet_size`` the client's limit on what we send it
    (§3.1.2.11.4), ``None`` if it declared none.
    """

    client_id: str = ""
    protocol_level: int = 4
    receive_maximum: int = 20
    maximum_packet_size: int | None = None

    def send_packet(self, packet: Packet) -> bool:
        """Queue a packet for the client. False if it was dropped (too large, link closing)."""
        raise NotImplementedError

    def writable(self) -> bool:
        """False while the client's unsent output is over the backlog limit (it is not reading)."""
        raise NotImplementedError

    def close(self, reason_code: int | None = None) -> None:
        """Close the connection; with a reason code, tell an MQTT 5 client why first."""
        raise NotImplementedError


class Session:
    """State of one client id. All methods run on the broker's event loop thread."""

    def __init__(
        self,
        client_id: str,
        *,
        expiry_interval: int,
        max_queued_messages: int,
        clock: Callable[[], float],
        holds: MessageHolds | None = None,
        max_queued_bytes: int | None = None,
        username: str | None = None,
    ) -> None:
        self.client_id = client_id
        self.username = username
        """The user name of the CONNECT that created or last resumed the session (for the ACL)."""
        self.expiry_interval = expiry_interval
        """Seconds the session outlives its connection; 0 = ends with it, 0xFFFFFFFF = never."""
        self.subscriptions: dict[str, Subscription] = {}
        self.link: ClientLink | None = None
        self.expiry_timer: Cancellable | None = None
        self.incoming: dict[int, Message | None] = {}
        """QoS 2 messages received from the client and acknowledged with PUBREC, routed on its
        PUBREL (§4.3.3 method A); ``None`` for one that is refused but whose flow completes."""
        self._max_queued = max_queued_messages
        self._max_queued_bytes = max_queued_bytes
        self._holds = holds if holds is not None else MessageHolds(ByteBudget(2**62))
        self._clock = clock
        self._inflight: dict[int, Delivery] = {}  # insertion order = send order
        self._pending: deque[Delivery] = deque()
        self._pending_bytes = 0
        self._next_packet_id = 1
        self._dropped = 0
        self._last_drop_warning = -math.inf

    @property
    def dropped(self) -> int:
        """Messages this session dropped (queue full, budget exhausted, client not reading)."""
        return self._dropped

    # --- delivery ---------------------------------------------------------------------------

    def deliver(self, delivery: Delivery) -> None:
        """Send now, or queue until the window opens / the client reconnects."""
        link = self.link
        if delivery.qos == 0:
            # QoS 0 is never queued for an offline client (§4.1 lets us choose) nor held
            # behind the QoS 1/2 window: ordering is only promised per QoS ([MQTT-4.6.0-6]).
            if link is None:
                return
            if not link.writable():
                self._note_drop("QoS 0 message: client is not reading")
                return
            self._transmit(link, delivery, dup=False)
            return
        message = delivery.message
        if not self._holds.hold(message, message.size):
            self._note_drop("message: the broker's buffer budget is exhausted")
            return
        if link is not None and not self._pending and self._window_open(link):
            self._send(link, delivery)
            return
        self._pending.append(delivery)
        self._pending_bytes += message.size
        while len(self._pending) > self._max_queued or (
                self._max_queued_bytes is not None and self._pending_bytes > self._max_queued_bytes
                and len(self._pending) > 1):
            self._drop_oldest_pending()

    def acknowledge(self, packet_id: int) -> bool:
        """Handle PUBACK: free the slot and fill the window from the queue."""
        delivery = self._inflight.get(packet_id)
        if delivery is None or delivery.qos != 1:
            return False
        self._finish(packet_id)
        return True

    def received(self, packet_id: int, reason_code: int) -> bool:
        """Handle PUBREC of a QoS 2 delivery: send PUBREL (or end the flow on an error code,
        §4.3.3). False if no QoS 2 delivery with that id awaits a PUBREC."""
        delivery = self._inflight.get(packet_id)
        if delivery is None or delivery.qos != 2:
            return False
        if reason_code >= 0x80:
            self._finish(packet_id)
            return True
        if not delivery.released:
            delivery.released = True
            self._holds.release(delivery.message)  # only the packet id is needed from now on
        if self.link is not None:
            self.link.send_packet(PubRel(packet_id))
        return True

    def completed(self, packet_id: int) -> bool:
        """Handle PUBCOMP: the QoS 2 flow is over; free the slot."""
        delivery = self._inflight.get(packet_id)
        if delivery is None or not delivery.released:
            return False
        self._finish(packet_id)
        return True

    def attach(self, link: ClientLink) -> None:
        """Bind a new connection (after its CONNACK was sent) and resume delivery.

        Unacknowledged PUBLISH and PUBREL packets are re-sent first, PUBLISH with DUP set,
        with their original packet ids, in their original order ([MQTT-4.4.0-1],
        [MQTT-3.3.1-1]).
        """
        self.link = link
        for packet_id, delivery in list(self._inflight.items()):
            if delivery.released:
                link.send_packet(PubRel(packet_id))
            else:
                self._transmit(link, delivery, dup=True)
        self.pump()

    def detach(self) -> None:
        """Forget the connection; in-flight and pending messages stay for the next one."""
        self.link = None

    def discard(self) -> None:
        """The session ends: give back every byte it holds."""
        for delivery in self._inflight.values():
            if not delivery.released:
                self._holds.release(delivery.message)
        for delivery in self._pending:
            self._holds.release(delivery.message)
        for message in self.incoming.values():
            if message is not None:
                self._holds.release(message)
        self._inflight.clear()
        self._pending.clear()
        self._pending_bytes = 0
        self.incoming.clear()

    def pump(self) -> None:
        """Send queued messages while the window is open and the client reads."""
        link = self.link
        while link is not None and self._pending and self._window_open(link):
            delivery = self._pending.popleft()
            self._pending_bytes -= delivery.message.size
            self._send(link, delivery)

    def _window_open(self, link: ClientLink) -> bool:
        return len(self._inflight) < min(link.receive_maximum, 0xFFFF) and link.writable()

    def _finish(self, packet_id: int) -> None:
        delivery = self._inflight.pop(packet_id)
        if not delivery.released:
            self._holds.release(delivery.message)
        self.pump()

    def _drop_oldest_pending(self) -> None:
        dropped = self._pending.popleft()
        self._pending_bytes -= dropped.message.size
        self._holds.release(dropped.message)
        self._note_drop(f"oldest queued message: queue full ({self._max_queued} messages, "
                        f"{self._max_queued_bytes} bytes)")

    def _send(self, link: ClientLink, delivery: Delivery) -> None:
        if delivery.message.expired(self._clock()):
            self._holds.release(delivery.message)
            return  # [MQTT-3.3.2-5]: an expired message is not delivered
        delivery.packet_id = self._allocate_packet_id()
        if self._transmit(link, delivery, dup=False):
            self._inflight[delivery.packet_id] = delivery
        else:
            # Too large for this client: §3.1.2.11.4 says behave as if it was delivered.
            self._holds.release(delivery.message)

    def _transmit(self, link: ClientLink, delivery: Delivery, *, dup: bool) -> bool:
        message = delivery.message
        properties = message.properties
        if message.expires_at is not None or delivery.subscription_ids:
            expiry = None
            if message.expires_at is not None:
                expiry = max(0, math.ceil(message.expires_at - self._clock()))
            properties = _with(properties, expiry, delivery.subscription_ids)
        packet = Publish(
            topic=message.topic,
            payload=message.payload,
            qos=delivery.qos,
            retain=delivery.retain,
            dup=dup,
            packet_id=delivery.packet_id if delivery.qos else None,
            properties=properties,
        )
        return link.send_packet(packet)

    def _allocate_packet_id(self) -> int:
        # Only called with a free window slot, so at least one id in 1..65535 is unused.
        while True:
            packet_id = self._next_packet_id
            self._next_packet_id = packet_id % 0xFFFF + 1
            if packet_id not in self._inflight:
                return packet_id

    def _note_drop(self, what: str) -> None:
        self._dropped += 1
        now = self._clock()
        if now - self._last_drop_warning >= _DROP_WARNING_INTERVAL:
            self._last_drop_warning = now
            logger.warning("client %r: dropped %s (%d dropped so far)",
                           self.client_id, what, self._dropped)


def _with(properties: Properties, expiry: int | None, subscription_ids: tuple[int, ...]
          ) -> Properties:
    """Copy of ``properties`` with the per-delivery fields a forwarded PUBLISH carries."""
    return replace(properties, message_expiry_interval=expiry,
                   subscription_identifiers=subscription_ids)

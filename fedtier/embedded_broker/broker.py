"""The broker core: connects clients to sessions, routes messages, keeps retained messages
and wills, applies the ACL. It is driven by decoded packets and knows nothing of sockets or
asyncio.

Every method runs on the single event-loop thread of the server, so the state below needs
no locks. Anything a client does wrong is raised as an :class:`MqttProtocolError`; the
server turns that into a (v5: reasoned) disconnect of that client only.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from fedtier.embedded_broker.acl import Access, AccessList
from fedtier.embedded_broker.limits import DEFAULT_LIMITS, BrokerLimits, ByteBudget, MessageHolds
from fedtier.embedded_broker.passwords import PasswordFile
from fedtier.embedded_broker.packets import (
    MQTT_5,
    NO_PROPERTIES,
    SESSION_EXPIRY_NEVER,
    Auth,
    ConnAck,
    Connect,
    ConnectReturnCode,
    Disconnect,
    MalformedPacketError,
    Packet,
    PingReq,
    PingResp,
    Properties,
    ProtocolViolationError,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
    Will,
)
from fedtier.embedded_broker.session import (
    Cancellable,
    ClientLink,
    Delivery,
    Message,
    Session,
    Subscription,
)
from fedtier.embedded_broker.topics import (
    SHARED_SUBSCRIPTION_PREFIX,
    SubscriptionTree,
    is_valid_topic_filter,
    is_valid_topic_name,
    topic_matches,
)

logger = logging.getLogger("fedtier.embedded_broker")

MAXIMUM_QOS = 2
DEFAULT_V311_RECEIVE_MAXIMUM = 20
"""3.1.1 has no Receive Maximum; this is the QoS 1/2 window we grant such clients."""
DEFAULT_V5_RECEIVE_MAXIMUM = 65_535
"""Receive Maximum of a v5 client that does not declare one (§3.1.2.11.3)."""

CallLater = Callable[[float, Callable[[], None]], Cancellable]


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Limits of the broker (some announced to v5 clients in CONNACK) and its ACL."""

    limits: BrokerLimits = DEFAULT_LIMITS
    acl: AccessList | None = None
    """``None``: every client may read and write every topic (no ``acl_file``)."""
    receive_maximum: int = 20
    """How many QoS 2 messages a client may have awaiting PUBREL at once (§3.2.2.3.3)."""
    passwords: PasswordFile | None = None
    """``None``: anyone may connect; else only the users of this file, with their password."""

    @property
    def max_packet_size(self) -> int | None:
        return self.limits.max_packet_size


class ServerLink(ClientLink):
    """A client connection as the broker core sees it. The server's protocol subclasses it.

    ``connected`` turns true once CONNACK is sent; ``session`` and ``will`` are managed by
    the core (a normal DISCONNECT clears the will; a takeover steals the session).
    """

    connected: bool = False
    session: Session | None = None
    will: Will | None = None
    username: str | None = None
    keep_alive: int = 0
    """Seconds the server allows between packets / 1.5, set at CONNECT (0: no limit)."""


class Broker:
    """Sessions, subscriptions and retained messages, driven by :meth:`handle_packet`."""

    def __init__(
        self,
        config: BrokerConfig,
        *,
        call_later: CallLater,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._call_later = call_later
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._retained: dict[str, Message] = {}
        self.budget = ByteBudget(config.limits.max_buffered_bytes)
        """Bytes held for clients: partial packets (the server's), queued and retained messages."""
        self._holds = MessageHolds(self.budget)
        self._tree: SubscriptionTree[Subscription] = SubscriptionTree()
        self._acl = config.acl
        self._shut_down = False

    def stats(self) -> dict[str, int]:
        """Counters for operators and tests: what the broker holds and what it has dropped."""
        return {
            "sessions": len(self._sessions),
            "retained": len(self._retained),
            "buffered_bytes": self.budget.used,
            "budget_refusals": self.budget.refusals,
            "dropped_messages": sum(s.dropped for s in self._sessions.values()),
        }

    def online_clients(self) -> list[str]:
        """Client ids whose session currently has a live connection, sorted."""
        return sorted(cid for cid, s in self._sessions.items() if s.link is not None)

    # --- entry points ----------------------------------------------------------------------

    def handle_packet(self, link: ServerLink, packet: Packet) -> None:
        """Act on one packet from ``link``. Raises :class:`MqttProtocolError` on violations."""
        if not link.connected:
            if not isinstance(packet, Connect):
                raise ProtocolViolationError("first packet is not CONNECT")  # [MQTT-3.1.0-1]
            self._connect(link, packet)
            return
        if isinstance(packet, Publish):
            self._publish(link, packet)
        elif isinstance(packet, PubAck):
            self._puback(link, packet)
        elif isinstance(packet, PubRec):
            self._pubrec(link, packet)
        elif isinstance(packet, PubRel):
            self._pubrel(link, packet)
        elif isinstance(packet, PubComp):
            self._pubcomp(link, packet)
        elif isinstance(packet, Subscribe):
            self._subscribe(link, packet)
        elif isinstance(packet, Unsubscribe):
            self._unsubscribe(link, packet)
        elif isinstance(packet, PingReq):
            link.send_packet(PingResp())
        elif isinstance(packet, Disconnect):
            self._disconnect(link, packet)
        elif isinstance(packet, Connect):
            raise ProtocolViolationError("second CONNECT")  # [MQTT-3.1.0-2]
        elif isinstance(packet, Auth):
            # [MQTT-4.12.0-6]: AUTH is a Protocol Error without an Authentication Method.
            raise ProtocolViolationError("AUTH without enhanced authentication")
        else:
            raise ProtocolViolationError(f"{type(packet).__name__} is sent by servers only")

    def link_closed(self, link: ServerLink) -> None:
        """The connection is closing or gone: fire its will if still armed, park or end its
        session. Idempotent: the server calls it on close and again on connection loss."""
        if self._shut_down:
            return
        session, will = link.session, link.will
        was_connected = link.connected
        link.session, link.will, link.connected = None, None, False
        if session is not None and session.link is link:
            session.detach()
            self._schedule_expiry(session)
        if will is not None:
            logger.info("client %r: connection lost, publishing will to %r",
                        link.client_id, will.topic)
            self._publish_will(will, link.client_id, link.username)
        if was_connected:
            logger.info("client %r disconnected", link.client_id)

    def shutdown(self) -> None:
        """Stop acting on closes (no wills at shutdown) and cancel session timers."""
        self._shut_down = True
        for session in self._sessions.values():
            if session.expiry_timer is not None:
                session.expiry_timer.cancel()
                session.expiry_timer = None

    # --- CONNECT ---------------------------------------------------------------------------

    def _connect(self, link: ServerLink, packet: Connect) -> None:
        link.protocol_level = packet.protocol_level
        v5 = packet.protocol_level == MQTT_5
        props = packet.properties
        if v5 and props.authentication_method is not None:
            self._refuse(link, ReasonCode.BAD_AUTHENTICATION_METHOD, "enhanced authentication")
            return
        if packet.will is not None:
            if not is_valid_topic_name(packet.will.topic):
                if not v5:
                    raise ProtocolViolationError(f"invalid will topic {packet.will.topic!r}")
                self._refuse(link, ReasonCode.TOPIC_NAME_INVALID, "invalid will topic")
                return
        passwords = self.config.passwords
        if passwords is not None and not passwords.check(packet.username, packet.password):
            # As Mosquitto with allow_anonymous false: the same answer for no user name, an
            # unknown one and a wrong password.
            self._refuse(link, ReasonCode.NOT_AUTHORIZED if v5 else ConnectReturnCode.NOT_AUTHORIZED,
                         f"user {packet.username!r} not authorized")
            return

        client_id = packet.client_id
        assigned: str | None = None
        if not client_id:
            if not v5 and not packet.clean_start:
                # 3.1.1 [MQTT-3.1.3-8]: an empty id needs Clean Session = 1.
                self._refuse(link, ConnectReturnCode.IDENTIFIER_REJECTED, "empty client id")
                return
            client_id = f"auto-{uuid.uuid4().hex}"
            assigned = client_id if v5 else None

        # 3.1.1 has no expiry: a Clean Session 0 session lives as long as the broker does.
        if v5:
            expiry = props.session_expiry_interval or 0
        else:
            expiry = 0 if packet.clean_start else SESSION_EXPIRY_NEVER

        existing = self._sessions.get(client_id)
        if existing is not None and existing.link is not None:
            self._take_over(existing)
        if existing is not None and packet.clean_start:
            self._discard_session(existing)  # [MQTT-3.1.2-4]
            existing = None
        if existing is None:
            limits = self.config.limits
            session = Session(client_id, expiry_interval=expiry,
                              max_queued_messages=limits.max_queued_messages,
                              max_queued_bytes=limits.max_queued_bytes, holds=self._holds,
                              clock=self._clock, username=packet.username)
            self._sessions[client_id] = session
        else:
            session = existing
            if session.expiry_timer is not None:
                session.expiry_timer.cancel()
                session.expiry_timer = None
            session.expiry_interval = expiry
            session.username = packet.username
        session_present = existing is not None  # [MQTT-3.2.2-2]

        link.client_id = client_id
        link.session = session
        link.will = packet.will
        link.username = packet.username
        link.connected = True
        max_keepalive = self.config.limits.max_keepalive
        server_keep_alive: int | None = None
        if v5:
            link.receive_maximum = props.receive_maximum or DEFAULT_V5_RECEIVE_MAXIMUM
            link.maximum_packet_size = props.maximum_packet_size
            if packet.keep_alive == 0 or packet.keep_alive > max_keepalive:
                # §3.2.2.3.14, as Mosquitto's max_keepalive: the client must use ours.
                server_keep_alive = max_keepalive
            link.keep_alive = packet.keep_alive if server_keep_alive is None else server_keep_alive
        else:
            link.receive_maximum = DEFAULT_V311_RECEIVE_MAXIMUM
            link.maximum_packet_size = None
            # 3.1.1 cannot tell the client; one that asked for none is still not kept forever.
            link.keep_alive = packet.keep_alive or max_keepalive
        link.send_packet(ConnAck(0, session_present, self._connack_properties(assigned, server_keep_alive)
                                 if v5 else NO_PROPERTIES))
        logger.info("client %r connected (MQTT %s, clean_start=%s, session_present=%s)",
                    client_id, "5.0" if v5 else "3.1.1", packet.clean_start, session_present)
        session.attach(link)  # after CONNACK: re-sends in-flight messages, drains the queue

    def _connack_properties(self, assigned_client_id: str | None, server_keep_alive: int | None) -> Properties:
        return Properties(
            assigned_client_identifier=assigned_client_id,
            server_keep_alive=server_keep_alive,
            receive_maximum=self.config.receive_maximum,
            retain_available=1,
            maximum_packet_size=self.config.max_packet_size,
            topic_alias_maximum=0,
            wildcard_subscription_available=1,
            subscription_identifier_available=1,
            shared_subscription_available=0,
        )

    def _refuse(self, link: ServerLink, code: int, why: str) -> None:
        logger.info("refusing connection: %s (code 0x%02x)", why, code)
        link.send_packet(ConnAck(code, False))
        link.close()  # [MQTT-3.2.2-7]: close after a refusing CONNACK, no DISCONNECT

    def _take_over(self, session: Session) -> None:
        """A new connection claims a connected client id: end the old one (§3.1.4 step 3).

        The old connection did not end with DISCONNECT, so its will is published (there is
        no Will Delay here); v5 clients are told why with reason 0x8E.
        """
        old = session.link
        assert isinstance(old, ServerLink)
        logger.info("client %r: session taken over by a new connection", session.client_id)
        session.detach()
        will = old.will
        old.session, old.will = None, None
        old.close(ReasonCode.SESSION_TAKEN_OVER)
        old.connected = False
        if will is not None:
            self._publish_will(will, session.client_id, old.username)

    # --- PUBLISH ---------------------------------------------------------------------------

    def _publish(self, link: ServerLink, packet: Publish) -> None:
        session = link.session
        assert session is not None
        v5 = link.protocol_level == MQTT_5
        if packet.properties.topic_alias is not None:
            # We announce Topic Alias Maximum 0 ([MQTT-3.2.2-17]): any alias is invalid.
            raise ProtocolViolationError("topic aliases are not supported",
                                         ReasonCode.TOPIC_ALIAS_INVALID)
        if not packet.topic:
            raise ProtocolViolationError("empty topic name")  # §3.3.2.1, no alias to resolve
        if not is_valid_topic_name(packet.topic):
            # [MQTT-3.3.2-2]: a Protocol Error (0x90 is for a well-formed name not accepted).
            raise ProtocolViolationError(f"wildcard in topic name {packet.topic!r}")
        if packet.properties.subscription_identifiers:
            raise ProtocolViolationError("subscription identifier in a client PUBLISH")
        if packet.qos == 2:
            assert packet.packet_id is not None
            self._publish_qos2(link, session, packet)
            return
        message = self._message_of(packet, link.client_id)
        code = self._accept(link, session, message)
        if code is None:
            matched = self._route(message)
            code = ReasonCode.SUCCESS
            if v5 and not matched:
                code = ReasonCode.NO_MATCHING_SUBSCRIBERS  # a success code (< 0x80)
        if packet.qos == 1:
            assert packet.packet_id is not None
            # 3.1.1 has no way to say "refused": the PUBACK is plain and the message dropped.
            link.send_packet(PubAck(packet.packet_id, code if v5 else 0))

    def _accept(self, link: ServerLink, session: Session, message: Message, *,
                store: bool = True) -> int | None:
        """Check write access and, for a retained message (if ``store``), store it. ``None``
        if the message may be routed, else the reason code refusing it (§3.4.2.1)."""
        if self._acl is not None and not self._acl.allows(session.username, session.client_id,
                                                          message.topic, Access.WRITE):
            logger.info("client %r: publish to %r denied by the ACL", link.client_id, message.topic)
            return ReasonCode.NOT_AUTHORIZED
        if store and message.retain and not self._store_retained(message):
            logger.warning("client %r: retained message on %r refused: buffer budget exhausted",
                           link.client_id, message.topic)
            return ReasonCode.QUOTA_EXCEEDED
        return None

    def _publish_qos2(self, link: ServerLink, session: Session, packet: Publish) -> None:
        """QoS 2 from a client, §4.3.3 method A: store, PUBREC; route on PUBREL."""
        packet_id = packet.packet_id
        assert packet_id is not None
        v5 = link.protocol_level == MQTT_5
        if packet_id in session.incoming:
            link.send_packet(PubRec(packet_id))  # a re-sent PUBLISH: same answer, no new copy
            return
        if len(session.incoming) >= self.config.receive_maximum:
            raise ProtocolViolationError("more QoS 2 messages awaiting PUBREL than Receive Maximum",
                                         ReasonCode.RECEIVE_MAXIMUM_EXCEEDED)  # [MQTT-3.3.4-9]
        message: Message | None = self._message_of(packet, link.client_id)
        assert message is not None
        code = self._accept(link, session, message, store=False)  # retained on PUBREL
        if code is None and not self._holds.hold(message, message.size):
            code = ReasonCode.QUOTA_EXCEEDED
        if code is not None:
            if v5:
                link.send_packet(PubRec(packet_id, code))  # the flow ends here (§4.3.3)
                return
            message = None  # 3.1.1 cannot refuse: complete the flow, deliver nothing
        session.incoming[packet_id] = message
        link.send_packet(PubRec(packet_id))

    def _pubrel(self, link: ServerLink, packet: PubRel) -> None:
        session = link.session
        assert session is not None
        if packet.packet_id not in session.incoming:
            # §3.7.2.1: nothing stored under that id (the flow completed, or never started).
            link.send_packet(PubComp(packet.packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
            return
        message = session.incoming.pop(packet.packet_id)
        if message is not None:
            if message.retain and not self._store_retained(message):
                logger.warning("client %r: retained message on %r not stored: buffer budget exhausted",
                               link.client_id, message.topic)
            self._route(message)
            self._holds.release(message)
        link.send_packet(PubComp(packet.packet_id))

    def _puback(self, link: ServerLink, packet: PubAck) -> None:
        assert link.session is not None
        if not link.session.acknowledge(packet.packet_id):
            logger.debug("client %r: PUBACK for unknown packet id %d",
                         link.client_id, packet.packet_id)

    def _pubrec(self, link: ServerLink, packet: PubRec) -> None:
        assert link.session is not None
        if not link.session.received(packet.packet_id, packet.reason_code):
            link.send_packet(PubRel(packet.packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))

    def _pubcomp(self, link: ServerLink, packet: PubComp) -> None:
        assert link.session is not None
        if not link.session.completed(packet.packet_id):
            logger.debug("client %r: PUBCOMP for unknown packet id %d",
                         link.client_id, packet.packet_id)

    def _message_of(self, packet: Publish, origin: str) -> Message:
        return self._make_message(packet.topic, packet.payload, packet.qos, packet.retain,
                                  packet.properties, origin)

    def _make_message(self, topic: str, payload: bytes, qos: int, retain: bool,
                      props: Properties, origin: str) -> Message:
        forwarded = Properties(
            payload_format_indicator=props.payload_format_indicator,
            content_type=props.content_type,
            response_topic=props.response_topic,
            correlation_data=props.correlation_data,
            user_properties=props.user_properties,
        )
        expires_at = None
        if props.message_expiry_interval is not None:
            expires_at = self._clock() + props.message_expiry_interval
        return Message(topic, payload, min(qos, MAXIMUM_QOS), retain, forwarded, expires_at,
                       origin)

    def _store_retained(self, message: Message) -> bool:
        """§3.3.1.3: a retained PUBLISH replaces the stored one; an empty payload clears it.
        False if the budget cannot hold the new one (the old one then stays)."""
        old = self._retained.get(message.topic)
        if message.payload:
            if not self._holds.hold(message, message.size):
                return False
            self._retained[message.topic] = message
        else:
            self._retained.pop(message.topic, None)
        if old is not None:
            self._holds.release(old)
        return True

    def _may_read(self, session: Session, topic: str) -> bool:
        return self._acl is None or self._acl.allows(session.username, session.client_id, topic,
                                                     Access.READ)

    def _route(self, message: Message) -> int:
        """Deliver to every matching session once, at the highest granted QoS (§4.7.1.2 note,
        [MQTT-3.3.4-2]), if the ACL lets it read the topic. Returns the number of sessions
        it went to."""
        targets: dict[str, tuple[int, bool, list[int]]] = {}
        for client_id, sub in self._tree.match(message.topic):
            options = sub.options
            if options.no_local and client_id == message.origin:
                continue  # [MQTT-3.8.3-3]
            qos, retain, ids = targets.get(client_id, (0, False, []))
            # Live forwarding clears RETAIN unless Retain As Published ([MQTT-3.3.1-12/13]).
            retain = retain or (options.retain_as_published and message.retain)
            if sub.identifier is not None:
                ids.append(sub.identifier)
            targets[client_id] = (max(qos, options.qos), retain, ids)
        delivered = 0
        for client_id, (qos, retain, ids) in targets.items():
            session = self._sessions[client_id]
            if not self._may_read(session, message.topic):
                continue
            session.deliver(Delivery(message, min(message.qos, qos), retain, tuple(ids)))
            delivered += 1
        return delivered

    def _publish_will(self, will: Will, client_id: str, username: str | None) -> None:
        if self._acl is not None and not self._acl.allows(username, client_id, will.topic,
                                                          Access.WRITE):
            logger.info("client %r: will on %r denied by the ACL", client_id, will.topic)
            return
        message = self._make_message(will.topic, will.payload, will.qos, will.retain,
                                     will.properties, client_id)
        if will.retain and not self._store_retained(message):
            logger.warning("client %r: retained will on %r dropped: buffer budget exhausted",
                           client_id, will.topic)
            return
        self._route(message)

    # --- SUBSCRIBE / UNSUBSCRIBE -----------------------------------------------------------

    def _subscribe(self, link: ServerLink, packet: Subscribe) -> None:
        session = link.session
        assert session is not None
        v5 = link.protocol_level == MQTT_5
        for topic_filter, _options in packet.subscriptions:
            if not is_valid_topic_filter(topic_filter):
                # [MQTT-4.7.1-1..3], [MQTT-4.7.3-1]: not a Topic Filter at all, so a Malformed
                # Packet (0x8F in SUBACK is for a well-formed filter not allowed, §3.9.3).
                raise MalformedPacketError(f"invalid topic filter {topic_filter!r}")
        ids = packet.properties.subscription_identifiers
        identifier = ids[0] if ids else None
        codes: list[int] = []
        wants_retained: list[tuple[str, Subscription]] = []
        for topic_filter, options in packet.subscriptions:
            if v5 and topic_filter.startswith(SHARED_SUBSCRIPTION_PREFIX):
                codes.append(ReasonCode.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED)
                continue
            granted = min(options.qos, MAXIMUM_QOS)
            subscription = Subscription(replace(options, qos=granted), identifier)
            existed = topic_filter in session.subscriptions
            session.subscriptions[topic_filter] = subscription  # replaces ([MQTT-3.8.4-3])
            self._tree.add(topic_filter, session.client_id, subscription)
            codes.append(granted)
            # Retain Handling (§3.8.3.1): 0 always, 1 only for a new subscription, 2 never.
            if options.retain_handling == 0 or (options.retain_handling == 1 and not existed):
                wants_retained.append((topic_filter, subscription))
        link.send_packet(SubAck(packet.packet_id, tuple(codes)))
        for topic_filter, subscription in wants_retained:
            self._send_retained(session, topic_filter, subscription)

    def _send_retained(self, session: Session, topic_filter: str, sub: Subscription) -> None:
        now = self._clock()
        ids = () if sub.identifier is None else (sub.identifier,)
        for topic, message in list(self._retained.items()):
            if message.expired(now):
                del self._retained[topic]  # [MQTT-3.3.2-5]
                self._holds.release(message)
            elif topic_matches(topic_filter, topic) and self._may_read(session, topic):
                # [MQTT-3.3.1-9]: sent because of a new subscription, so RETAIN is 1.
                qos = min(message.qos, sub.options.qos)
                session.deliver(Delivery(message, qos, True, ids))

    def _unsubscribe(self, link: ServerLink, packet: Unsubscribe) -> None:
        session = link.session
        assert session is not None
        for topic_filter in packet.topic_filters:
            if not is_valid_topic_filter(topic_filter):
                raise MalformedPacketError(f"invalid topic filter {topic_filter!r}")
        codes: list[int] = []
        for topic_filter in packet.topic_filters:
            if session.subscriptions.pop(topic_filter, None) is not None:
                self._tree.remove(topic_filter, session.client_id)
                codes.append(ReasonCode.SUCCESS)
            else:
                codes.append(ReasonCode.NO_SUBSCRIPTION_EXISTED)
        v5 = link.protocol_level == MQTT_5
        link.send_packet(UnsubAck(packet.packet_id, tuple(codes) if v5 else ()))

    # --- DISCONNECT and session lifetime ---------------------------------------------------

    def _disconnect(self, link: ServerLink, packet: Disconnect) -> None:
        session = link.session
        assert session is not None
        if link.protocol_level == MQTT_5:
            new_expiry = packet.properties.session_expiry_interval
            if new_expiry is not None:
                if session.expiry_interval == 0 and new_expiry != 0:
                    raise ProtocolViolationError(  # [MQTT-3.14.2-2]
                        "session expiry set on DISCONNECT after 0 on CONNECT")
                session.expiry_interval = new_expiry
            # [MQTT-3.14.4-3]: only reason 0x00 discards the will; 0x04 and errors keep it.
            if packet.reason_code == ReasonCode.SUCCESS:
                link.will = None
        else:
            link.will = None
        link.close()  # the server never answers a DISCONNECT

    def _schedule_expiry(self, session: Session) -> None:
        if session.expiry_interval == 0:
            self._discard_session(session)
        elif session.expiry_interval != SESSION_EXPIRY_NEVER:
            session.expiry_timer = self._call_later(
                session.expiry_interval, functools.partial(self._expire, session))

    def _expire(self, session: Session) -> None:
        session.expiry_timer = None
        if self._sessions.get(session.client_id) is session and session.link is None:
            logger.info("client %r: session expired", session.client_id)
            self._discard_session(session)

    def _discard_session(self, session: Session) -> None:
        if session.expiry_timer is not None:
            session.expiry_timer.cancel()
            session.expiry_timer = None
        for topic_filter in session.subscriptions:
            self._tree.remove(topic_filter, session.client_id)
        session.subscriptions.clear()
        session.discard()
        if self._sessions.get(session.client_id) is session:
            del self._sessions[session.client_id]

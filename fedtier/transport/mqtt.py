"""MQTT transport on paho-mqtt 2.x (``CallbackAPIVersion.VERSION2``).

What it adds on top of paho, and why (field notes §2):

* **Size limit.** paho does not check the broker's Maximum Packet Size; an oversize QoS 1
  publish makes the broker drop the client and paho resends it forever. We read the limit
  from CONNACK (MQTT 5), take the smaller of it and the configured one, and chunk.
* **Acknowledge after processing.** ``manual_ack=True``: a received QoS 1 message is
  acknowledged only when the node calls ``Inbound.confirm()`` after handling (and
  persisting) it, so a crash in between makes the broker redeliver it. Chunks are stored
  in the chunk store (SQLite for edges and the coordinator) and acknowledged at once: the
  broker's in-flight window (20 by default) would otherwise stall on a many-chunk message.
* **Persistent session, presence.** ``clean_start=False`` with a session expiry, so
  subscriptions and queued QoS 1 messages survive reconnects; a retained ``online`` status
  published after every (re)subscription, a retained ``offline`` last will.
* **Publish before connect.** Messages published while disconnected wait in a local queue
  and are chunked with the limit learned from the next CONNACK.
* **Never block in callbacks.** paho calls ``on_publish`` holding its own mutex, so our
  lock is never held while calling into paho (see ``publish``).
"""

from __future__ import annotations

import json
import logging
import queue
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from fedtier import wire
from fedtier.errors import TransportError
from fedtier.transport import chunking, topics
from fedtier.transport.base import ChunkingMixin, DoneCallback, Inbound, Traffic

log = logging.getLogger("fedtier.transport.mqtt")

DEFAULT_MAX_PACKET = 256 * 1024
"""Used when neither the broker (CONNACK) nor the configuration states a limit."""
PACKET_OVERHEAD = 128
"""Fixed header, packet id and properties of a PUBLISH, on top of topic and payload."""


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """Mutual TLS: the CA that signed the broker's certificate, and this node's certificate and key."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None

    def context(self) -> ssl.SSLContext:
        """TLS 1.2+, the broker's certificate checked against the CA *and* the host name
        (brokers get certificates with the addresses clients use, ``fedtier provision broker``)."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


@dataclass(slots=True)
class _Group:
    remaining: int
    ok: bool
    on_done: DoneCallback | None


class MqttTransport(ChunkingMixin):
    """One node's MQTT connection; inbound messages go to ``inbox`` as ``Inbound``."""

    def __init__(self, *, name: str, client_id: str, host: str, port: int, inbox: "queue.Queue[Inbound]",
                 protocol: int = 5, keepalive: int = 30, session_expiry_s: int = 3600,
                 max_packet_size: int | None = None, status: dict[str, Any] | None = None,
                 chunk_store: chunking.ChunkStore | None = None,
                 max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, reconnect_max_s: int = 30,
                 tls: TlsSettings | None = None) -> None:
        """
        Args:
            name: label of this connection in traffic stats and logs ("cell", "cloud", ...).
            client_id: MQTT client id (= node id; with mTLS, = certificate CN).
            host, port: broker address.
            inbox: where received messages are queued for the node's thread.
            protocol: 5 (MQTT 5) or 4 (MQTT 3.1.1, e.g. for older brokers).
            keepalive: seconds.
            session_expiry_s: MQTT 5 session expiry (the broker keeps subscriptions and
                queued messages this long after a disconnect).
            max_packet_size: configured packet limit; the smaller of it and the broker's wins.
            status: if given, a retained presence document (must contain ``node``) published
                on ``ft/v1/status/<node>`` with ``state = online`` after every connect, and
                ``offline`` as last will and on a clean stop.
            chunk_store: where partial chunked messages wait (default: memory).
            max_message_bytes: refuse reassembled messages larger than this.
            reconnect_max_s: longest back-off between reconnection attempts.
            tls: mutual-TLS settings, or None for plain TCP.
        """
        if protocol not in (4, 5):
            raise ValueError(f"protocol must be 4 (MQTT 3.1.1) or 5, got {protocol}")
        self.name = name
        self.client_id = client_id
        self.host = host
        self.port = port
        self.inbox = inbox
        self.protocol = protocol
        self.keepalive = keepalive
        self.session_expiry_s = session_expiry_s
        self.configured_max_packet = max_packet_size
        self.broker_max_packet: int | None = None
        self.status = status
        self.reassembler = chunking.Reassembler(chunk_store, max_message_bytes=max_message_bytes)
        self._traffic = Traffic()
        self._filters: list[str] = []
        self._lock = threading.Lock()
        self._groups: dict[int, _Group] = {}
        self._early_acks: dict[int, bool] = {}
        self._pending: list[tuple[str, bytes, bool, DoneCallback | None]] = []
        self._connected = threading.Event()
        self._closing = False
        self.denials: list[tuple[str, int]] = []
        self.secure = tls is not None
        """Whether payloads travel encrypted (clear DP payloads may only travel where this holds)."""

        proto = mqtt.MQTTv5 if protocol == 5 else mqtt.MQTTv311
        kwargs: dict[str, Any] = {"client_id": client_id, "protocol": proto, "manual_ack": True}
        if protocol == 4:
            kwargs["clean_session"] = False
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, **kwargs)
        self.client.max_queued_messages_set(0)
        if tls is not None:
            self.client.tls_set_context(tls.context())
        self.client.reconnect_delay_set(min_delay=1, max_delay=reconnect_max_s)
        if status is not None:
            offline = json.dumps({**status, "state": "offline"}).encode()
            self.client.will_set(topics.status(status["node"]), offline, qos=1, retain=True)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "MqttTransport":
        """Connect in the background (retrying with back-off until the broker answers)."""
        kwargs: dict[str, Any] = {}
        if self.protocol == 5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.session_expiry_s
            kwargs = {"clean_start": False, "properties": props}
        self.client.connect_async(self.host, self.port, keepalive=self.keepalive, **kwargs)
        self.client.loop_start()
        return self

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def stop(self, timeout: float = 2.0) -> None:
        """Publish ``offline`` (the will is only for unclean ends), disconnect, stop the loop."""
        self._closing = True
        if self.status is not None and self._connected.is_set():
            done = threading.Event()
            self._publish_raw(topics.status(self.status["node"]),
                              json.dumps({**self.status, "state": "offline"}).encode(), True,
                              lambda ok: done.set())
            done.wait(timeout)
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()

    # --- sending ---------------------------------------------------------------------------------

    @property
    def traffic(self) -> Traffic:
        return self._traffic

    @property
    def max_payload(self) -> int:
        """Largest payload per PUBLISH: the packet limit minus topic and fixed overhead."""
        limits = [x for x in (self.configured_max_packet, self.broker_max_packet) if x]
        packet = min(limits) if limits else DEFAULT_MAX_PACKET
        return packet - PACKET_OVERHEAD

    def subscribe(self, topic_filter: str) -> None:
        with self._lock:
            if topic_filter in self._filters:
                return
            self._filters.append(topic_filter)
        if self._connected.is_set():
            self.client.subscribe(topic_filter, qos=1)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False,
                on_done: DoneCallback | None = None) -> int:
        """Publish at QoS 1; chunk if over the limit. Never blocks.

        Returns the number of bytes handed to paho now (0 if queued until connected).
        """
        if not self._connected.is_set():
            with self._lock:
                if not self._connected.is_set():
                    self._pending.append((topic, payload, retain, on_done))
                    return 0
        return self._publish_raw(topic, payload, retain, on_done)

    def _publish_raw(self, topic: str, payload: bytes, retain: bool, on_done: DoneCallback | None) -> int:
        limit = self.max_payload - len(topic.encode())
        parts = self._split(payload, limit)
        if retain and len(parts) > 1:
            raise TransportError(f"retained message on {topic} is {len(payload)} bytes, over the limit {limit}")
        group = _Group(remaining=len(parts), ok=True, on_done=on_done)
        total = 0
        for part in parts:
            info = self.client.publish(topic, part, qos=1, retain=retain)
            self._traffic.count("out", topic, len(part))
            total += len(part)
            finished = None
            with self._lock:
                early = self._early_acks.pop(info.mid, None)
                if early is None:
                    self._groups[info.mid] = group
                else:
                    finished = self._ack_group(group, early)
            if finished is not None:
                finished()
        return total

    def _ack_group(self, group: _Group, ok: bool) -> Callable[[], None] | None:
        """Count one acknowledged part (caller holds the lock); returns the completion to run."""
        group.remaining -= 1
        group.ok = group.ok and ok
        if group.remaining == 0 and group.on_done is not None:
            cb, result = group.on_done, group.ok
            return lambda: cb(result)
        return None

    # --- paho callbacks (network thread; never block here) ------------------------------------

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            log.warning("%s: connection to %s:%s refused: %s", self.name, self.host, self.port, reason)
            return
        if props is not None and hasattr(props, "MaximumPacketSize"):
            self.broker_max_packet = int(props.MaximumPacketSize)
        with self._lock:
            filters = list(self._filters)
        for f in filters:
            client.subscribe(f, qos=1)
        log.info("%s: connected to %s:%s as %s (session present: %s, max packet: %s)", self.name, self.host,
                 self.port, self.client_id, getattr(flags, "session_present", None), self.broker_max_packet)
        if self.status is not None:
            # Published after the SUBSCRIBEs on the same connection, so whoever reacts to our
            # presence (a parent resending the open task) finds us subscribed.
            doc = {**self.status, "state": "online", "since": time.time()}
            client.publish(topics.status(self.status["node"]), json.dumps(doc).encode(), qos=1, retain=True)
        with self._lock:
            self._connected.set()
            pending, self._pending = self._pending, []
        for topic, payload, retain, on_done in pending:
            self._publish_raw(topic, payload, retain, on_done)

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self._connected.clear()
        if not self._closing:
            log.warning("%s: disconnected from %s:%s: %s; reconnecting", self.name, self.host, self.port, reason)

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        for rc in reasons:
            if getattr(rc, "is_failure", False):
                log.warning("%s: subscription refused by broker: %s", self.name, rc)
                self.denials.append(("subscribe", int(rc.value)))

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        ok = not getattr(reason, "is_failure", False)
        if not ok:
            # MQTT 5 PUBACK reason 135 = not authorized (ACL). Visible in the log, by design.
            log.warning("%s: broker refused publish (mid %s): %s (reason code %s)", self.name, mid, reason,
                        getattr(reason, "value", "?"))
            self.denials.append(("publish", int(getattr(reason, "value", 0))))
        finished = None
        with self._lock:
            group = self._groups.pop(mid, None)
            if group is None:
                self._early_acks[mid] = ok
            else:
                finished = self._ack_group(group, ok)
        if finished is not None:
            finished()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        self._traffic.count("in", msg.topic, len(msg.payload))
        mid, qos = msg.mid, msg.qos

        def ack() -> None:
            if qos > 0:
                client.ack(mid, qos)

        inbound = self._classify(msg.topic, bytes(msg.payload), time.time(), ack)
        if inbound is not None:
            self.inbox.put(inbound)


def from_config(cfg: Any, *, name: str, client_id: str, inbox: "queue.Queue[Inbound]",
                status: dict[str, Any] | None = None, chunk_store: chunking.ChunkStore | None = None,
                max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES) -> MqttTransport:
    """An ``MqttTransport`` from a ``fedtier.runtime.config.BrokerConfig`` section."""
    tls = None
    if cfg.tls_ca is not None:
        tls = TlsSettings(ca_file=str(cfg.tls_ca), cert_file=str(cfg.tls_cert) if cfg.tls_cert else None,
                          key_file=str(cfg.tls_key) if cfg.tls_key else None)
    return MqttTransport(name=name, client_id=client_id, host=cfg.host, port=cfg.port, inbox=inbox,
                         protocol=cfg.protocol, keepalive=cfg.keepalive_s, session_expiry_s=cfg.session_expiry_s,
                         max_packet_size=cfg.max_packet_size or None, status=status, chunk_store=chunk_store,
                         max_message_bytes=max_message_bytes, tls=tls)

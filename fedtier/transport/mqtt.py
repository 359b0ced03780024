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
* **Failures that say what is wrong.** paho swallows the exception behind a failed connection
  attempt and reports a TLS refusal of our certificate as "Unspecified error". The client
  subclass keeps that exception; ``fedtier.transport.diagnosis`` names the cause and the likely
  fix, logged at WARNING (may heal: refused, unknown host, lost) or ERROR (will not: a
  certificate refused on either side, not authorized), first at once, then at most once a
  minute. ``max_auth_failures`` such failures in a row (connection attempts, or tries of one
  refused publish or subscription, retried with back-off) set ``fatal``: the service loop
  then ends the process with exit code 77.
* **One identity, one client.** The presence document carries a random ``instance`` per
  process; the transport reads its own presence topic, and an ``online`` from another
  instance since this one announced itself means a second client uses this identity — a
  copied bundle (see ``_check_own_presence``). Logged as an ERROR naming the id (brokers
  configured by fedtier bind the client id to the certificate, so the two keep disconnecting
  each other).
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
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
from fedtier.transport import chunking, diagnosis, topics
from fedtier.transport.base import ChunkingMixin, DoneCallback, Inbound, Traffic
from fedtier.transport.diagnosis import Diagnosis
from fedtier.transport.topic_filters import topic_matches

log = logging.getLogger("fedtier.transport.mqtt")

DEFAULT_MAX_PACKET = 256 * 1024
"""Used when neither the broker (CONNACK) nor the configuration states a limit."""
PACKET_OVERHEAD = 128
"""Fixed header, packet id and properties of a PUBLISH, on top of topic and payload."""
SESSION_TAKEN_OVER = 142
"""MQTT 5 DISCONNECT reason: another client connected with this client id."""
RETRY_MAX_S = 30.0
"""Longest pause before a refused publish or subscription is tried again."""


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


@dataclass(slots=True)
class _Part:
    """One PUBLISH in flight (a whole message or one chunk), kept to try again if refused."""

    topic: str
    payload: bytes
    retain: bool
    group: _Group
    tries: int = 0


class _Client(mqtt.Client):
    """paho's client, keeping the exception behind each failed connection attempt or read.

    paho catches it (``loop_forever``, ``_packet_read``) and reports only that something
    failed; ``last_error`` lets the transport say what.
    """

    last_error: BaseException | None = None

    def reconnect(self) -> Any:
        try:
            return super().reconnect()
        except OSError as exc:
            self.last_error = exc
            raise

    def _sock_recv(self, bufsize: int) -> bytes:
        try:
            return super()._sock_recv(bufsize)
        except BlockingIOError:
            raise
        except OSError as exc:
            self.last_error = exc
            raise


def _retry_delay(tries: int) -> float:
    return min(2.0 ** (tries - 1), RETRY_MAX_S)


class MqttTransport(ChunkingMixin):
    """One node's MQTT connection; inbound messages go to ``inbox`` as ``Inbound``."""

    def __init__(self, *, name: str, client_id: str, host: str, port: int, inbox: "queue.Queue[Inbound]",
                 protocol: int = 5, keepalive: int = 30, session_expiry_s: int = 3600,
                 max_packet_size: int | None = None, status: dict[str, Any] | None = None,
                 chunk_store: chunking.ChunkStore | None = None,
                 max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, reconnect_max_s: int = 30,
                 tls: TlsSettings | None = None, max_auth_failures: int = 5,
                 status_topic: str | None = None) -> None:
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
                on ``status_topic`` with ``state = online`` after every connect, and
                ``offline`` as last will and on a clean stop.
            chunk_store: where partial chunked messages wait (default: memory).
            max_message_bytes: refuse reassembled messages larger than this.
            reconnect_max_s: longest back-off between reconnection attempts.
            tls: mutual-TLS settings, or None for plain TCP.
            max_auth_failures: set ``fatal`` after this many authorization failures in a row
                (see the module docstring); 0 = keep retrying forever.
            status_topic: where the presence goes: ``ft/v1/status/<node>`` by default (edges, the
                coordinator); a device's is under its cell, ``topics.cell_status``.
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
        self._pending: list[tuple[str, bytes, bool, DoneCallback | None]] = []
        self._connected = threading.Event()
        self._closing = False
        self._external_loop = False
        self.denials: list[tuple[str, int]] = []
        self.secure = tls is not None
        """Whether payloads travel encrypted (clear DP payloads may only travel where this holds)."""
        self.tls = tls
        self.max_auth_failures = max_auth_failures
        self.fatal: Diagnosis | None = None
        """Set when authorization failed ``max_auth_failures`` times in a row: the process should end."""
        self.instance = secrets.token_hex(4)
        """This process's mark in its presence document (tells a second client with our id apart)."""
        self._own_status = (status_topic or topics.status(status["node"])) if status is not None else None
        self._auth_failures = 0
        self._connects = 0
        self.session_present: bool | None = None
        """What the last CONNACK said: whether the broker still had this client's session (``None``
        before the first connect). See ``connects``."""
        self._own_echo = False
        self._inflight: dict[int, _Part] = {}
        self._early_acks: dict[int, tuple[int, str]] = {}
        self._sub_mids: dict[int, str] = {}
        self._acknowledged: set[str] = set()
        """Filters the broker acknowledged on this connection (``subscribed``)."""
        self._sub_tries: dict[str, int] = {}
        self._throttle = diagnosis.Throttle()

        proto = mqtt.MQTTv5 if protocol == 5 else mqtt.MQTTv311
        kwargs: dict[str, Any] = {"client_id": client_id, "protocol": proto, "manual_ack": True}
        if protocol == 4:
            kwargs["clean_session"] = False
        self.client = _Client(CallbackAPIVersion.VERSION2, **kwargs)
        self.client.max_queued_messages_set(0)
        if tls is not None:
            self.client.tls_set_context(tls.context())
        self.client.reconnect_delay_set(min_delay=1, max_delay=reconnect_max_s)
        if status is not None and self._own_status is not None:
            self.status = status = {**status, "instance": self.instance}
            offline = json.dumps({**status, "state": "offline"}).encode()
            self.client.will_set(self._own_status, offline, qos=1, retain=True)
        self.client.on_connect = self._on_connect
        self.client.on_connect_fail = self._on_connect_fail
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self, *, external_loop: bool = False) -> "MqttTransport":
        """Connect in the background (retrying with back-off until the broker answers).

        ``external_loop``: no network thread; the caller drives the client's socket (``client.reconnect``,
        ``loop_read``/``loop_write``/``loop_misc``), as the fleet emulator does for hundreds of
        devices on one thread (``local_fleet/mux.py``)."""
        kwargs: dict[str, Any] = {}
        if self.protocol == 5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.session_expiry_s
            kwargs = {"clean_start": False, "properties": props}
        self.client.connect_async(self.host, self.port, keepalive=self.keepalive, **kwargs)
        self._external_loop = external_loop
        if not external_loop:
            self.client.loop_start()
        return self

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def subscribed(self) -> bool:
        """Connected, and the broker acknowledged every subscription of this connection: from now on a
        message published on one of them reaches this node (what a test or a supervisor waits for)."""
        with self._lock:
            return self._connected.is_set() and set(self._filters) <= self._acknowledged

    @property
    def connects(self) -> int:
        """Connections the broker accepted so far. A node that sees it grow past 1 knows it reconnected, and
        that whatever was sent to it meanwhile may be lost: the broker may have dropped its session
        (``session_present`` false), or another client with its id took the session and its queued
        messages. It then asks again for what it is owed (the coordinator, ``CloudNode``) and
        republishes what it keeps retained in its cell (the edge). Read from the node's thread; counted
        before the connection's subscriptions are sent, so what the node publishes on seeing it goes
        out after them."""
        return self._connects

    def stop(self, timeout: float = 2.0) -> None:
        """Publish ``offline`` (the will is only for unclean ends), disconnect, stop the loop."""
        self._closing = True
        if self.status is not None and self._own_status is not None and self._connected.is_set():
            done = threading.Event()
            self._publish_raw(self._own_status,
                              json.dumps({**self.status, "state": "offline"}).encode(), True,
                              lambda ok: done.set())
            if not self._external_loop:  # else nobody reads the acknowledgement: the publish is written, not awaited
                done.wait(timeout)
        try:
            self.client.disconnect()
        finally:
            if not self._external_loop:
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
            self._subscribe_now(topic_filter)

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
            self._send_part(_Part(topic, part, retain, group))
            total += len(part)
        return total

    def _send_part(self, part: _Part) -> None:
        info = self.client.publish(part.topic, part.payload, qos=1, retain=part.retain)
        self._traffic.count("out", part.topic, len(part.payload))
        with self._lock:
            early = self._early_acks.pop(info.mid, None)
            if early is None:
                self._inflight[info.mid] = part
        if early is not None:
            self._settle(part, *early)

    def _settle(self, part: _Part, code: int, reason: str) -> None:
        """A PUBACK for ``part``: count it done, or try it again after a refusal (see module docstring)."""
        if code >= 128:
            diag = diagnosis.publish_refused(part.topic, code, reason, client_id=self.client_id)
            if part.tries == 0:
                self.denials.append(("publish", code))
            part.tries += 1
            self._report(diag)
            if diag.credential and not self._closing and not self._give_up(diag, part.tries):
                timer = threading.Timer(_retry_delay(part.tries), self._retry_part, args=(part,))
                timer.daemon = True
                timer.start()
                return
        finished = None
        with self._lock:
            finished = self._ack_group(part.group, code < 128)
        if finished is not None:
            finished()

    def _retry_part(self, part: _Part) -> None:
        if self._closing:
            return
        log.debug("%s: publishing on %s again (try %d)", self.name, part.topic, part.tries + 1)
        self._send_part(part)

    def _ack_group(self, group: _Group, ok: bool) -> Callable[[], None] | None:
        """Count one acknowledged part (caller holds the lock); returns the completion to run."""
        group.remaining -= 1
        group.ok = group.ok and ok
        if group.remaining == 0 and group.on_done is not None:
            cb, result = group.on_done, group.ok
            return lambda: cb(result)
        return None

    # --- failures ----------------------------------------------------------------------------------

    def _report(self, diag: Diagnosis) -> None:
        """Log a failure: the first of its cause at once, then at most once a minute."""
        skipped = self._throttle(diag.cause)
        level = logging.ERROR if diag.credential or diag.cause == "identity_conflict" else logging.WARNING
        if skipped is None:
            log.debug("%s: %s", self.name, diag.message)
            return
        more = f" ({skipped} more since the last report)" if skipped else ""
        log.log(level, "%s: %s%s", self.name, diag.text(), more)

    def _give_up(self, diag: Diagnosis, tries: int) -> bool:
        """Whether ``tries`` credential failures in a row end this node (sets ``fatal``)."""
        if not self.max_auth_failures or tries < self.max_auth_failures:
            return False
        if self.fatal is None:
            self.fatal = diag
            log.error("%s: giving up after %d authorization failures in a row (%s); the process ends with exit "
                      "code 77", self.name, tries, diag.cause)
        return True

    def _connection_failed(self, diag: Diagnosis) -> None:
        self._report(diag)
        if diag.credential:
            self._auth_failures += 1
            self._give_up(diag, self._auth_failures)

    def _take_error(self) -> BaseException | None:
        exc, self.client.last_error = self.client.last_error, None
        return exc

    def _diagnose_connection(self, exc: BaseException | None, was_connected: bool = False) -> Diagnosis:
        return diagnosis.connect_failure(exc, host=self.host, port=self.port, tls=self.tls is not None,
                                         ca_file=self.tls.ca_file if self.tls is not None else None,
                                         was_connected=was_connected)

    # --- paho callbacks (network thread; never block here) ------------------------------------

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            self._connection_failed(diagnosis.connack_refused(int(getattr(reason, "value", 0)), str(reason),
                                                              host=self.host, port=self.port,
                                                              client_id=self.client_id))
            return
        self._auth_failures = 0
        self.client.last_error = None
        self.session_present = bool(getattr(flags, "session_present", False))
        self._connects += 1
        self._own_echo = False
        if props is not None and hasattr(props, "MaximumPacketSize"):
            self.broker_max_packet = int(props.MaximumPacketSize)
        with self._lock:
            filters = list(self._filters)
            self._acknowledged.clear()  # a new connection: acknowledged again (or the session remembers them)
        if self._own_status is not None and not any(topic_matches(f, self._own_status) for f in filters):
            filters.append(self._own_status)  # to notice a second client with our id (not passed to the node)
        for f in filters:
            self._subscribe_now(f)
        log.info("%s: connected to %s:%s as %s (session present: %s, max packet: %s)", self.name, self.host,
                 self.port, self.client_id, getattr(flags, "session_present", None), self.broker_max_packet)
        if self.status is not None and self._own_status is not None:
            # Published after the SUBSCRIBEs on the same connection, so whoever reacts to our
            # presence (a parent resending the open task) finds us subscribed.
            doc = {**self.status, "state": "online", "since": time.time()}
            client.publish(self._own_status, json.dumps(doc).encode(), qos=1, retain=True)
        with self._lock:
            self._connected.set()
            pending, self._pending = self._pending, []
        for topic, payload, retain, on_done in pending:
            self._publish_raw(topic, payload, retain, on_done)

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        self._connection_failed(self._diagnose_connection(self._take_error()))

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        was_connected = self._connected.is_set()
        self._connected.clear()
        exc = self._take_error()
        if self._closing:
            log.debug("%s: disconnected from %s:%s (stopping)", self.name, self.host, self.port)
            return
        code = int(getattr(reason, "value", 0) or 0)
        if code == SESSION_TAKEN_OVER:
            self._report(diagnosis.identity_conflict(self.client_id, "unknown"))
            return
        if code not in (0, 128) and exc is None:  # a DISCONNECT the broker sent, with its reason
            self._report(Diagnosis("disconnected", f"the broker at {self.host}:{self.port} disconnected us: {reason} "
                                                   f"(reason code {code})", "reconnecting; the broker's log says why"))
            return
        self._connection_failed(self._diagnose_connection(exc, was_connected))

    def _subscribe_now(self, topic_filter: str) -> None:
        # Under the lock: the SUBACK may be read on the network thread before ``subscribe`` returns, and its
        # callback must find the mid (``_on_subscribe`` takes the lock first, so it waits for this).
        with self._lock:
            result, mid = self.client.subscribe(topic_filter, qos=1)
            if mid is not None:
                self._sub_mids[mid] = topic_filter

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        with self._lock:
            topic_filter = self._sub_mids.pop(mid, "?")
        for rc in reasons:
            if not getattr(rc, "is_failure", False):
                self._sub_tries.pop(topic_filter, None)
                with self._lock:
                    self._acknowledged.add(topic_filter)
                continue
            code = int(rc.value)
            self.denials.append(("subscribe", code))
            diag = diagnosis.subscribe_refused(topic_filter, code, str(rc), client_id=self.client_id)
            self._report(diag)
            tries = self._sub_tries[topic_filter] = self._sub_tries.get(topic_filter, 0) + 1
            if diag.credential and not self._give_up(diag, tries) and not self._closing:
                timer = threading.Timer(_retry_delay(tries), self._retry_subscribe, args=(topic_filter,))
                timer.daemon = True
                timer.start()

    def _retry_subscribe(self, topic_filter: str) -> None:
        if not self._closing and self._connected.is_set():
            self._subscribe_now(topic_filter)

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        failed = getattr(reason, "is_failure", False)
        outcome = (int(getattr(reason, "value", 0)) if failed else 0, str(reason))
        with self._lock:
            part = self._inflight.pop(mid, None)
            if part is None:
                self._early_acks[mid] = outcome
        if part is not None:
            self._settle(part, *outcome)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        self._traffic.count("in", msg.topic, len(msg.payload))
        mid, qos = msg.mid, msg.qos

        def ack() -> None:
            if qos > 0:
                client.ack(mid, qos)

        if msg.topic == self._own_status:
            self._check_own_presence(bytes(msg.payload))
            with self._lock:
                wanted = any(topic_matches(f, msg.topic) for f in self._filters)
            if not wanted:
                ack()
                return
        inbound = self._classify(msg.topic, bytes(msg.payload), time.time(), ack)
        if inbound is not None:
            self.inbox.put(inbound)

    def _check_own_presence(self, payload: bytes) -> None:
        """Another instance ``online`` under our id since we last announced ourselves: a second client.

        At every connect the broker first replays the retained presence as it was before our own
        ``online`` (then echoes ours). On the first connect of this process that history is an
        earlier run's; on a reconnect it should be our own announcement — unless another client
        connected with our id meanwhile (and took our session: brokers configured by fedtier bind
        the client id to the certificate). An ``online`` of another instance after our own echo
        means the same.
        """
        try:
            doc = json.loads(payload.decode()) if payload else None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return
        if not isinstance(doc, dict) or doc.get("state") != "online" or doc.get("instance") is None:
            return
        if doc.get("instance") == self.instance:
            self._own_echo = True
            return
        if self._own_echo or self._connects > 1:
            node = self.status["node"] if self.status is not None else self.client_id
            self._report(diagnosis.identity_conflict(str(node), str(doc.get("instance"))))


def from_config(cfg: Any, *, name: str, client_id: str, inbox: "queue.Queue[Inbound]",
                status: dict[str, Any] | None = None, chunk_store: chunking.ChunkStore | None = None,
                max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
                status_topic: str | None = None) -> MqttTransport:
    """An ``MqttTransport`` from a ``fedtier.runtime.config.BrokerConfig`` section."""
    tls = None
    if cfg.tls_ca is not None:
        tls = TlsSettings(ca_file=str(cfg.tls_ca), cert_file=str(cfg.tls_cert) if cfg.tls_cert else None,
                          key_file=str(cfg.tls_key) if cfg.tls_key else None)
    return MqttTransport(name=name, client_id=client_id, host=cfg.host, port=cfg.port, inbox=inbox,
                         protocol=cfg.protocol, keepalive=cfg.keepalive_s, session_expiry_s=cfg.session_expiry_s,
                         max_packet_size=cfg.max_packet_size or None, status=status, chunk_store=chunk_store,
                         max_message_bytes=max_message_bytes, tls=tls,
                         max_auth_failures=getattr(cfg, "max_auth_failures", 5), status_topic=status_topic)

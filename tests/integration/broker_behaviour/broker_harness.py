"""The broker-behaviour harness: the same tests, assertion for assertion, against both brokers.

Every test here takes the ``kind`` parameter (``mosquitto`` or ``embedded``) through the
``broker``/``start`` fixtures, and states what it checks through ``check``:

* ``check.same(label, actual, expected)`` — an assertion both brokers must pass. Once the
  same labelled assertion of the same test has passed on both, it is *shared*; the session
  summary prints how many there are ("broker behaviour: N assertions shared by ...").
* ``check.differs(label, actual, {"mosquitto": a, "embedded": b}, spec)`` — a documented
  difference (docs/broker.md lists each, with ``spec``, the MQTT section that allows it):
  each broker must show exactly its own value, so a change on either side fails the test.

Mosquitto is started by the test on a free port with a config rendered from fedtier's limits
(``provisioning.broker_limits``), as fedtier configures it; the embedded broker runs in this
process with the same :class:`BrokerLimits`. Clients are raw sockets speaking through the
embedded broker's codec (to send exactly the bytes a test needs and see exactly the packets a
broker answers) and paho-mqtt 2.x (to check what a real client library experiences).

Waits are bounded events, never bare sleeps used as synchronisation: to prove that something
did *not* arrive, a test publishes a sentinel after it and relies on the broker delivering one
client's messages in order.
"""

from __future__ import annotations

import getpass
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.reasoncodes import ReasonCode as PahoReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from fedtier.embedded_broker import EmbeddedBroker
from fedtier.embedded_broker.acl import AccessList
from fedtier.embedded_broker.codec import PacketFramer, decode_packet, encode_packet
from fedtier.embedded_broker.limits import DEFAULT_LIMITS, BrokerLimits
from fedtier.embedded_broker.packets import MQTT_5, ConnAck, Connect, Packet
from fedtier.embedded_broker.passwords import PasswordFile

from conftest import Broker, start_mosquitto

KINDS = ("mosquitto", "embedded")
WAIT = 10.0
HOST = "127.0.0.1"


# --- the count of shared assertions -------------------------------------------------------------


@dataclass
class _Registry:
    passed: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    """(test, label) -> the broker kinds on which that assertion passed."""
    differences: dict[tuple[str, str], set[str]] = field(default_factory=dict)


REGISTRY = _Registry()


def export() -> dict[str, list[list[Any]]]:
    """The registry as plain data (a pytest-xdist worker sends it to the controller, ``tests/conftest.py``)."""
    return {name: [[test, label, sorted(kinds)] for (test, label), kinds in getattr(REGISTRY, name).items()]
            for name in ("passed", "differences")}


def merge(data: dict[str, list[list[Any]]]) -> None:
    """Add a worker's ``export()`` to this process's registry."""
    for name in ("passed", "differences"):
        table = getattr(REGISTRY, name)
        for test, label, kinds in data.get(name, []):
            table.setdefault((test, label), set()).update(kinds)


def summary_lines() -> list[str]:
    """What tests/conftest.py's terminal-summary hook prints after a run of this suite."""
    if not REGISTRY.passed and not REGISTRY.differences:
        return []
    both = set(KINDS)
    shared = sum(1 for kinds in REGISTRY.passed.values() if kinds >= both)
    tests = len({test for (test, _), kinds in REGISTRY.passed.items() if kinds >= both})
    one_sided = sum(1 for kinds in REGISTRY.passed.values() if not kinds >= both)
    diffs = sum(1 for kinds in REGISTRY.differences.values() if kinds >= both)
    lines = [f"broker behaviour: {shared} assertions shared by mosquitto and embedded "
             f"(in {tests} tests); {diffs} documented differences asserted per broker "
             "(docs/broker.md)"]
    if one_sided:
        lines.append(f"broker behaviour: {one_sided} assertions passed on one broker only "
                     "(the other was deselected, skipped or failed)")
    return lines


class Check:
    """Assertions of one test on one broker, recorded for the shared count."""

    def __init__(self, kind: str, test: str) -> None:
        self.kind = kind
        self.test = test
        self._labels: set[str] = set()

    def _label(self, label: str) -> str:
        if label in self._labels:  # the same label twice in one test: number the repeats
            n = 2
            while f"{label} #{n}" in self._labels:
                n += 1
            label = f"{label} #{n}"
        self._labels.add(label)
        return label

    def same(self, label: str, actual: Any, expected: Any) -> None:
        """Assert ``actual == expected``; a shared assertion once it passes on both brokers."""
        assert actual == expected, f"[{self.kind}] {label}: {actual!r} != {expected!r}"
        REGISTRY.passed.setdefault((self.test, self._label(label)), set()).add(self.kind)

    def that(self, label: str, condition: bool, detail: Any = "") -> None:
        """Assert ``condition``; shared like :meth:`same`."""
        assert condition, f"[{self.kind}] {label} {detail}"
        REGISTRY.passed.setdefault((self.test, self._label(label)), set()).add(self.kind)

    def differs(self, label: str, actual: Any, expected: dict[str, Any], spec: str) -> None:
        """A documented difference: each broker must show its own ``expected[kind]``."""
        assert spec, "a difference needs the MQTT section that allows it"
        assert set(expected) == set(KINDS)
        assert actual == expected[self.kind], (
            f"[{self.kind}] {label} ({spec}): {actual!r} != {expected[self.kind]!r}")
        REGISTRY.differences.setdefault((self.test, self._label(label)), set()).add(self.kind)


def _test_key(request: pytest.FixtureRequest) -> str:
    node = request.node
    params = getattr(getattr(node, "callspec", None), "params", {})
    rest = ",".join(f"{k}={v}" for k, v in sorted(params.items()) if k != "kind")
    return f"{node.module.__name__}::{node.originalname}[{rest}]"


# --- brokers ----------------------------------------------------------------------------------


@dataclass
class RunningBroker:
    """A broker under test: where it listens and how to stop it."""

    kind: str
    host: str
    port: int
    limits: BrokerLimits
    stop: Callable[[], None]
    pid: int | None = None
    """Process id of a broker in its own process (Mosquitto), else None."""
    process: Broker | None = None
    embedded: EmbeddedBroker | None = None


def start_broker(kind: str, directory: Path, *, limits: BrokerLimits = DEFAULT_LIMITS,
                 acl: str | None = None, password_file: Path | None = None) -> RunningBroker:
    """Start ``kind`` with fedtier's limits (``limits``) and, if given, the ACL text ``acl`` and
    the Mosquitto-format ``password_file`` (then only its users may connect)."""
    if kind == "mosquitto":
        extra: list[str] = []
        if acl is not None:
            directory.mkdir(parents=True, exist_ok=True)
            acl_path = directory / "fedtier.acl"
            acl_path.write_text(acl)
            extra.append(f"acl_file {acl_path}")
        if password_file is not None:
            extra += ["allow_anonymous false", f"password_file {password_file}"]
        if acl is not None or password_file is not None:
            # Started as root, Mosquitto switches to user `mosquitto` before it opens the ACL,
            # which then cannot read the test's private directory: stay the current user.
            extra.append(f"user {getpass.getuser()}")
        if limits.max_keepalive != DEFAULT_LIMITS.max_keepalive:
            # Not in fedtier's Mosquitto configurations (Mosquitto's default, 65535, stays there);
            # a test that sets it means both brokers.
            extra.append(f"max_keepalive {limits.max_keepalive}")
        proc = start_mosquitto(directory, limits=limits, extra=tuple(extra))
        return RunningBroker(kind, proc.host, proc.port, limits, proc.stop, proc.proc.pid, process=proc)
    if kind == "embedded":
        embedded = EmbeddedBroker(HOST, 0, limits=limits,
                                  acl=AccessList.parse(acl) if acl is not None else None,
                                  passwords=PasswordFile.load(password_file) if password_file else None).start()
        return RunningBroker(kind, HOST, embedded.port, limits, embedded.stop, embedded=embedded)
    raise ValueError(kind)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def start(kind: str, tmp_path: Path) -> Iterator[Callable[..., RunningBroker]]:
    """Start brokers of this test's kind (``start(limits=..., acl=...)``); all stopped after."""
    started: list[RunningBroker] = []

    def factory(**kwargs: Any) -> RunningBroker:
        broker = start_broker(kind, tmp_path / f"{kind}{len(started)}", **kwargs)
        started.append(broker)
        return broker

    yield factory
    for broker in started:
        broker.stop()


@pytest.fixture
def broker(start: Callable[..., RunningBroker]) -> RunningBroker:
    """A broker of this test's kind with fedtier's default limits."""
    return start()


@pytest.fixture
def check(kind: str, request: pytest.FixtureRequest) -> Check:
    return Check(kind, _test_key(request))


# --- clients ----------------------------------------------------------------------------------


class RawClient:
    """A socket speaking MQTT through the codec, for what paho will not send."""

    def __init__(self, port: int, protocol: int = MQTT_5, *, timeout: float = WAIT,
                 receive_buffer: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:  # before connecting, so the TCP window is small from the start
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(timeout)
        self.sock.connect((HOST, port))
        self.protocol = protocol
        self._framer = PacketFramer()

    def send(self, packet: Packet) -> None:
        self.sock.sendall(encode_packet(packet, self.protocol))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> Packet | None:
        """The next packet, or None once the broker has closed the connection."""
        while True:
            frame = self._framer.next_frame()
            if frame is not None:
                return decode_packet(frame, self.protocol)
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self._framer.feed(data)

    def connect(self, client_id: str, **fields: Any) -> ConnAck:
        fields.setdefault("protocol_level", self.protocol)
        self.send(Connect(client_id, **fields))
        connack = self.recv()
        assert isinstance(connack, ConnAck), connack
        return connack

    def packets_until_closed(self) -> list[Packet]:
        packets: list[Packet] = []
        while (packet := self.recv()) is not None:
            packets.append(packet)
        return packets

    def close(self) -> None:
        self.sock.close()


def raw_connect(*, name: bytes = b"MQTT", level: int = 5, flags: int = 0x02, client_id: bytes = b"raw",
                properties: bytes = b"\x00", payload: bytes = b"", keep_alive: int = 60) -> bytes:
    """A CONNECT built byte by byte (for the malformed ones no codec would write)."""
    body = (len(name).to_bytes(2, "big") + name + bytes([level, flags]) + keep_alive.to_bytes(2, "big")
            + (properties if level == 5 else b"") + len(client_id).to_bytes(2, "big") + client_id
            + payload)
    return b"\x10" + varint(len(body)) + body


def varint(value: int) -> bytes:
    """``value`` as an MQTT Variable Byte Integer (a Remaining Length, §1.5.5)."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


class Peer:
    """A paho client whose callbacks feed queues and events the test can wait on."""

    def __init__(self, port: int, client_id: str = "", *, protocol: int = MQTT_5,
                 clean: bool = True, session_expiry: int | None = None,
                 maximum_packet_size: int | None = None, manual_ack: bool = False,
                 keepalive: int = 60, username: str | None = None, password: str | None = None) -> None:
        self.port = port
        self.protocol = protocol
        self.clean = clean
        self.keepalive = keepalive
        v5 = protocol == MQTT_5
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id,
            protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
            clean_session=None if v5 else clean, manual_ack=manual_ack,
            reconnect_on_failure=False,
        )
        if username is not None:
            self.client.username_pw_set(username, password)
        self.connect_properties: PahoProperties | None = None
        if v5 and (session_expiry is not None or maximum_packet_size is not None):
            self.connect_properties = PahoProperties(PacketTypes.CONNECT)
            if session_expiry is not None:
                self.connect_properties.SessionExpiryInterval = session_expiry
            if maximum_packet_size is not None:
                self.connect_properties.MaximumPacketSize = maximum_packet_size
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.connected = threading.Event()
        self.disconnected = threading.Event()
        self.session_present: bool | None = None
        self.connack_properties: Any = None
        self.connect_reason: int | None = None
        """The CONNACK's reason code (3.1.1: its return code) once it arrived."""
        self.disconnect_reason: PahoReasonCode | None = None
        self.publish_reasons: dict[int, int] = {}
        self._subacks: dict[int, list[PahoReasonCode]] = {}
        self._suback_cond = threading.Condition()
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.on_unsubscribe = self._on_subscribe  # same shape: (mid, reason codes)
        self.client.on_publish = self._on_publish

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any,
                    properties: Any) -> None:
        self.session_present = flags.session_present
        self.connack_properties = properties
        self.connect_reason = int(getattr(reason, "value", reason))
        self.connected.set()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any,
                       properties: Any) -> None:
        self.disconnect_reason = reason
        self.disconnected.set()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        self.messages.put(message)

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any,
                    properties: Any) -> None:
        self.publish_reasons[mid] = int(getattr(reason, "value", 0))

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, codes: Any,
                      properties: Any) -> None:
        with self._suback_cond:
            self._subacks[mid] = list(codes)
            self._suback_cond.notify_all()

    def connect(self) -> Peer:
        kwargs: dict[str, Any] = {}
        if self.protocol == MQTT_5:
            kwargs = {"clean_start": self.clean, "properties": self.connect_properties}
        self.client.connect(HOST, self.port, keepalive=self.keepalive, **kwargs)
        self.client.loop_start()
        assert self.connected.wait(WAIT), "no CONNACK"
        return self

    def subscribe(self, topic: str, qos: int = 0, **options: Any) -> list[int]:
        if options:
            result, mid = self.client.subscribe(topic, options=SubscribeOptions(qos=qos, **options))
        else:
            result, mid = self.client.subscribe(topic, qos)
        assert result == mqtt.MQTT_ERR_SUCCESS and mid is not None
        with self._suback_cond:
            assert self._suback_cond.wait_for(lambda: mid in self._subacks, WAIT), "no SUBACK"
            return [code.value for code in self._subacks.pop(mid)]

    def unsubscribe(self, topic: str) -> list[int]:
        result, mid = self.client.unsubscribe(topic)
        assert result == mqtt.MQTT_ERR_SUCCESS and mid is not None
        with self._suback_cond:
            assert self._suback_cond.wait_for(lambda: mid in self._subacks, WAIT), "no UNSUBACK"
            return [code.value for code in self._subacks.pop(mid)]

    def publish(self, topic: str, payload: bytes | str, qos: int = 0, retain: bool = False,
                properties: PahoProperties | None = None) -> int:
        """Publish; for QoS 1/2 wait for the flow to finish. Returns the reason code (v5) or 0."""
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if qos:
            info.wait_for_publish(WAIT)
            assert info.is_published(), f"no acknowledgement for {topic}"
        return self.publish_reasons.get(info.mid, 0)

    def get(self, timeout: float = WAIT) -> mqtt.MQTTMessage:
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("expected a message, none arrived") from None

    def collect_until(self, sentinel_topic: str, *, ignore_prefix: str = "sentinel/"
                      ) -> list[mqtt.MQTTMessage]:
        """Messages received before the one on ``sentinel_topic`` (other sentinels ignored)."""
        received: list[mqtt.MQTTMessage] = []
        while True:
            message = self.get()
            if message.topic == sentinel_topic:
                return received
            if not message.topic.startswith(ignore_prefix):
                received.append(message)

    def close(self) -> None:
        if self.client.is_connected():
            self.client.disconnect()
        self.client.loop_stop()


def sentinel(*subscribers: Peer, name: str = "end", qos: int = 1) -> str:
    """Subscribe each subscriber to a sentinel topic; return it for publishing later (at the
    QoS of the messages it follows: paho hands a QoS 2 message over only after PUBREL)."""
    topic = f"sentinel/{name}"
    for peer in subscribers:
        assert peer.subscribe(topic, qos) == [qos]
    return topic


def round_trip(port: int, topic: str = "health/check") -> bytes:
    """A fresh subscriber and publisher exchange one QoS 1 message; returns what arrived."""
    sub = Peer(port).connect()
    pub = Peer(port).connect()
    try:
        assert sub.subscribe(topic, 1) == [1]
        pub.publish(topic, b"still alive", qos=1)
        return bytes(sub.get().payload)
    finally:
        sub.close()
        pub.close()


def disconnect_and_wait(raw: RawClient, packet: Packet) -> list[Packet]:
    """Send DISCONNECT (``packet``) and read until the broker closes: a barrier after which the
    broker has processed it (both brokers close the connection on DISCONNECT)."""
    raw.send(packet)
    return raw.packets_until_closed()


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of process ``pid`` in KiB, from /proc/PID/status."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0])
    return values["VmRSS"], values["VmHWM"]


__all__ = ["HOST", "KINDS", "WAIT", "Check", "Peer", "RawClient", "RunningBroker", "broker", "check",
           "disconnect_and_wait", "kind", "raw_connect", "round_trip", "rss_kib", "sentinel",
           "start", "start_broker", "summary_lines", "varint"]

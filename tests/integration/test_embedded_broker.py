"""Integration tests of the embedded MQTT broker against real paho-mqtt clients and raw sockets.

Every test starts its own broker on port 0. Waits are bounded events, never bare sleeps used
as synchronisation: to prove that something did *not* arrive, a test publishes a sentinel
after it and relies on the broker delivering one client's messages in order.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.reasoncodes import ReasonCode as PahoReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from fedtier.embedded_broker import EmbeddedBroker
from fedtier.embedded_broker.codec import PacketFramer, decode_packet, encode_packet
from fedtier.embedded_broker.packets import (
    MQTT_5,
    MQTT_311,
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    SubscriptionOptions,
    UnsubAck,
    Unsubscribe,
    Will,
)

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0
HOST = "127.0.0.1"


# --- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as b:
        yield b


class Peer:
    """A paho client whose callbacks feed queues and events the test can wait on."""

    def __init__(self, port: int, client_id: str = "", *, protocol: int = MQTT_5,
                 clean: bool = True, session_expiry: int | None = None,
                 maximum_packet_size: int | None = None, manual_ack: bool = False,
                 keepalive: int = 60) -> None:
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
        self.disconnect_reason: PahoReasonCode | None = None
        self._subacks: dict[int, list[PahoReasonCode]] = {}
        self._suback_cond = threading.Condition()
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.on_unsubscribe = self._on_subscribe  # same shape: (mid, reason codes)

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any,
                    properties: Any) -> None:
        self.session_present = flags.session_present
        self.connack_properties = properties
        self.connected.set()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any,
                       properties: Any) -> None:
        self.disconnect_reason = reason
        self.disconnected.set()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        self.messages.put(message)

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
                properties: PahoProperties | None = None) -> None:
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if qos:
            info.wait_for_publish(WAIT)
            assert info.is_published(), f"no PUBACK for {topic}"

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


def sentinel(publisher: Peer, *subscribers: Peer, name: str = "end") -> str:
    """Subscribe each subscriber to a sentinel topic; return it for publishing later."""
    topic = f"sentinel/{name}"
    for peer in subscribers:
        assert peer.subscribe(topic, 1) == [1]
    return topic


class RawClient:
    """A socket speaking MQTT through the codec, for what paho will not send."""

    def __init__(self, port: int, protocol: int = MQTT_5) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=WAIT)
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


def assert_round_trip(port: int, topic: str = "health/check") -> None:
    """A fresh subscriber and publisher exchange one QoS 1 message: the broker still works."""
    sub = Peer(port).connect()
    pub = Peer(port).connect()
    try:
        assert sub.subscribe(topic, 1) == [1]
        pub.publish(topic, b"still alive", qos=1)
        message = sub.get()
        assert (message.topic, message.payload) == (topic, b"still alive")
    finally:
        sub.close()
        pub.close()


# --- publish / subscribe --------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [MQTT_5, MQTT_311], ids=["v5", "v311"])
def test_publish_subscribe_delivers_at_min_qos(broker: EmbeddedBroker, protocol: int) -> None:
    sub_q1 = Peer(broker.port, "sub-q1", protocol=protocol).connect()
    sub_q0 = Peer(broker.port, "sub-q0", protocol=protocol).connect()
    pub = Peer(broker.port, "pub", protocol=protocol).connect()
    assert sub_q1.subscribe("room/temp", 1) == [1]
    assert sub_q0.subscribe("room/temp", 0) == [0]
    # QoS 2 requests are granted QoS 1: the broker's maximum.
    assert sub_q1.subscribe("room/other", 2) == [1]

    pub.publish("room/temp", b"q0", qos=0)
    pub.publish("room/temp", b"q1", qos=1)

    got = [sub_q1.get(), sub_q1.get()]
    assert [(m.payload, m.qos, m.retain) for m in got] == [(b"q0", 0, False), (b"q1", 1, False)]
    got = [sub_q0.get(), sub_q0.get()]
    assert [(m.payload, m.qos) for m in got] == [(b"q0", 0), (b"q1", 0)]
    for peer in (sub_q1, sub_q0, pub):
        peer.close()


def test_wildcards_and_dollar_topics(broker: EmbeddedBroker) -> None:
    filters = ["sensors/+/temp", "sensors/#", "#", "+/+/temp", "$SYS/#", "+/broker/uptime"]
    subscribers = {f: Peer(broker.port).connect() for f in filters}
    pub = Peer(broker.port).connect()
    for index, (topic_filter, peer) in enumerate(subscribers.items()):
        assert peer.subscribe(topic_filter, 1) == [1]
        assert peer.subscribe(f"sentinel/{index}", 1) == [1]
    topics = ["sensors/a/temp", "sensors/a/hum", "sensors", "$SYS/broker/uptime", "other/x/temp"]
    for topic in topics:
        pub.publish(topic, topic.encode(), qos=1)
    for index in range(len(filters)):
        pub.publish(f"sentinel/{index}", b"", qos=1)

    expected = {
        "sensors/+/temp": {"sensors/a/temp"},
        "sensors/#": {"sensors/a/temp", "sensors/a/hum", "sensors"},
        "#": {"sensors/a/temp", "sensors/a/hum", "sensors", "other/x/temp"},
        "+/+/temp": {"sensors/a/temp", "other/x/temp"},
        "$SYS/#": {"$SYS/broker/uptime"},
        "+/broker/uptime": set(),  # a leading wildcard never matches a $ topic
    }
    for index, (topic_filter, peer) in enumerate(subscribers.items()):
        received = [m.topic for m in peer.collect_until(f"sentinel/{index}")]
        assert sorted(received) == sorted(expected[topic_filter]), topic_filter
        peer.close()
    pub.close()


def test_overlapping_subscriptions_deliver_once_at_highest_qos(broker: EmbeddedBroker) -> None:
    sub = Peer(broker.port).connect()
    pub = Peer(broker.port).connect()
    assert sub.subscribe("a/#", 0) == [0]
    assert sub.subscribe("a/+", 1) == [1]
    end = sentinel(pub, sub)
    pub.publish("a/b", b"once", qos=1)
    pub.publish(end, b"", qos=1)
    received = sub.collect_until(end)
    assert [(m.topic, m.payload, m.qos) for m in received] == [("a/b", b"once", 1)]
    sub.close()
    pub.close()


def test_unsubscribe_stops_delivery(broker: EmbeddedBroker) -> None:
    sub = Peer(broker.port).connect()
    pub = Peer(broker.port).connect()
    assert sub.subscribe("u/t", 1) == [1]
    end = sentinel(pub, sub)
    assert sub.unsubscribe("u/t") == [0]
    assert sub.unsubscribe("u/t") == [0x11]  # No subscription existed
    pub.publish("u/t", b"after unsubscribe", qos=1)
    pub.publish(end, b"", qos=1)
    assert sub.collect_until(end) == []
    sub.close()
    pub.close()


@pytest.mark.parametrize("protocol", [MQTT_5, MQTT_311], ids=["v5", "v311"])
def test_invalid_filters_are_refused_per_entry(broker: EmbeddedBroker, protocol: int) -> None:
    raw = RawClient(broker.port, protocol)
    assert raw.connect("raw-filters").reason_code == 0
    entries = ("a/#/b", "a+", "ok/#", "$share/g/t", "")
    raw.send(Subscribe(1, tuple((f, SubscriptionOptions(qos=1)) for f in entries)))
    suback = raw.recv()
    assert isinstance(suback, SubAck) and suback.packet_id == 1
    if protocol == MQTT_5:
        assert suback.reason_codes == (0x8F, 0x8F, 0x01, 0x9E, 0x8F)
    else:  # 3.1.1 has one failure code; "$share/..." is an ordinary filter there
        assert suback.reason_codes == (0x80, 0x80, 0x01, 0x01, 0x80)
    raw.send(Unsubscribe(2, ("ok/#", "never/subscribed")))
    unsuback = raw.recv()
    assert isinstance(unsuback, UnsubAck) and unsuback.packet_id == 2
    assert unsuback.reason_codes == ((0x00, 0x11) if protocol == MQTT_5 else ())
    raw.close()


# --- retained messages ----------------------------------------------------------------------------


def test_retained_delivery_and_clear(broker: EmbeddedBroker) -> None:
    pub = Peer(broker.port).connect()
    pub.publish("r/1", b"v1", qos=1, retain=True)
    pub.publish("r/2", b"v2", qos=1, retain=True)

    sub = Peer(broker.port).connect()
    assert sub.subscribe("r/#", 1) == [1]
    first = {m.topic: m for m in (sub.get(), sub.get())}
    assert {t: (m.payload, m.retain) for t, m in first.items()} == {
        "r/1": (b"v1", True), "r/2": (b"v2", True)}

    # Live forwarding carries RETAIN=0, even for a retained publish ([MQTT-3.3.1-12]).
    pub.publish("r/1", b"v1-updated", qos=1, retain=True)
    live = sub.get()
    assert (live.topic, live.payload, live.retain) == ("r/1", b"v1-updated", False)

    # An empty retained payload clears the topic.
    pub.publish("r/1", b"", qos=1, retain=True)
    assert sub.get().payload == b""

    late = Peer(broker.port).connect()
    end = sentinel(pub, late)
    assert late.subscribe("r/#", 1) == [1]
    pub.publish(end, b"", qos=1)
    received = late.collect_until(end)
    assert [(m.topic, m.payload, m.retain) for m in received] == [("r/2", b"v2", True)]
    for peer in (pub, sub, late):
        peer.close()


def test_retain_as_published_and_retain_handling(broker: EmbeddedBroker) -> None:
    pub = Peer(broker.port).connect()
    pub.publish("rap/t", b"stored", qos=1, retain=True)
    sub = Peer(broker.port).connect()
    end = sentinel(pub, sub)
    # retainHandling 2: no retained messages at subscribe time.
    assert sub.subscribe("rap/t", 1, retainAsPublished=True, retainHandling=2) == [1]
    pub.publish("rap/t", b"live", qos=1, retain=True)
    pub.publish(end, b"", qos=1)
    received = sub.collect_until(end)
    assert [(m.payload, m.retain) for m in received] == [(b"live", True)]
    pub.close()
    sub.close()


# --- wills ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [MQTT_5, MQTT_311], ids=["v5", "v311"])
def test_will_published_when_socket_closes_without_disconnect(broker: EmbeddedBroker,
                                                               protocol: int) -> None:
    watcher = Peer(broker.port).connect()
    assert watcher.subscribe("will/#", 1) == [1]
    raw = RawClient(broker.port, protocol)
    will_props = Properties(content_type="text/plain", user_properties=(("why", "crash"),))
    will = Will("will/raw", b"gone", qos=1, retain=False,
                properties=will_props if protocol == MQTT_5 else Properties())
    assert raw.connect("dying", will=will).reason_code == 0
    raw.close()  # no DISCONNECT: abnormal

    message = watcher.get()
    assert (message.topic, message.payload, message.qos) == ("will/raw", b"gone", 1)
    if protocol == MQTT_5:
        props: Any = message.properties
        assert props.ContentType == "text/plain"
        assert props.UserProperty == [("why", "crash")]
    watcher.close()


def test_will_published_when_paho_socket_is_closed(broker: EmbeddedBroker) -> None:
    watcher = Peer(broker.port).connect()
    assert watcher.subscribe("will/#", 1) == [1]
    victim = Peer(broker.port, "victim")
    victim.client.will_set("will/victim", b"lost", qos=1, retain=True)
    victim.connect()
    victim.client.loop_stop()  # stop paho's thread so it cannot notice and clean up
    sock = victim.client.socket()
    assert sock is not None
    sock.close()
    message = watcher.get()
    assert (message.topic, message.payload) == ("will/victim", b"lost")
    # A retained will is stored too.
    late = Peer(broker.port).connect()
    assert late.subscribe("will/victim", 1) == [1]
    stored = late.get()
    assert (stored.payload, stored.retain) == (b"lost", True)
    watcher.close()
    late.close()


def test_no_will_on_normal_disconnect_but_will_on_reason_0x04(broker: EmbeddedBroker) -> None:
    watcher = Peer(broker.port).connect()
    assert watcher.subscribe("will/#", 1) == [1]
    pub = Peer(broker.port).connect()
    end = sentinel(pub, watcher)

    polite = Peer(broker.port, "polite")
    polite.client.will_set("will/polite", b"should not appear", qos=1)
    polite.connect()
    polite.client.disconnect()
    assert polite.disconnected.wait(WAIT)
    polite.client.loop_stop()

    with_will = Peer(broker.port, "with-will")
    with_will.client.will_set("will/with-will", b"asked for it", qos=1)
    with_will.connect()
    with_will.client.disconnect(reasoncode=PahoReasonCode(PacketTypes.DISCONNECT,
                                                          identifier=0x04))
    assert with_will.disconnected.wait(WAIT)
    with_will.client.loop_stop()

    message = watcher.get()
    assert (message.topic, message.payload) == ("will/with-will", b"asked for it")
    pub.publish(end, b"", qos=1)
    assert watcher.collect_until(end) == []  # in particular, nothing from "polite"
    watcher.close()
    pub.close()


def test_keep_alive_expiry_disconnects_and_publishes_will(broker: EmbeddedBroker) -> None:
    watcher = Peer(broker.port).connect()
    assert watcher.subscribe("will/#", 1) == [1]
    raw = RawClient(broker.port)
    started = time.monotonic()
    assert raw.connect("silent", keep_alive=1, will=Will("will/silent", b"timed out")
                       ).reason_code == 0
    packets = raw.packets_until_closed()  # we send nothing: no PINGREQ
    elapsed = time.monotonic() - started
    assert packets == [Disconnect(0x8D)]  # Keep Alive timeout
    assert 1.4 <= elapsed < 5.0  # one and a half times the keep alive
    message = watcher.get()
    assert (message.topic, message.payload) == ("will/silent", b"timed out")
    watcher.close()


def test_ping(broker: EmbeddedBroker) -> None:
    raw = RawClient(broker.port)
    assert raw.connect("pinger", keep_alive=1).reason_code == 0
    for _ in range(3):
        raw.send(PingReq())
        assert raw.recv() == PingResp()
    raw.send(Disconnect())
    assert raw.packets_until_closed() == []


# --- sessions -------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [MQTT_5, MQTT_311], ids=["v5", "v311"])
def test_persistent_session_queues_while_offline(broker: EmbeddedBroker, protocol: int) -> None:
    def durable() -> Peer:
        return Peer(broker.port, "durable", protocol=protocol, clean=False, session_expiry=300)

    first = durable().connect()
    assert first.session_present is False
    assert first.subscribe("jobs/#", 1) == [1]
    first.close()
    # Wait until the broker has processed the DISCONNECT: until then the session is online,
    # and a QoS 0 message may legitimately wait in it (MQTT 5 §3.1.2.4).
    deadline = time.monotonic() + WAIT
    while "durable" in broker.online_clients() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "durable" not in broker.online_clients()

    pub = Peer(broker.port).connect()
    pub.publish("jobs/1", b"offline-1", qos=1)
    pub.publish("jobs/2", b"offline-2", qos=1)
    pub.publish("jobs/3", b"offline-qos0", qos=0)  # QoS 0 is not queued for offline clients
    # Barrier: a QoS 1 publish on the same connection is processed after the QoS 0 one, so
    # once it is acknowledged the QoS 0 message was routed while "durable" was offline.
    pub.publish("barrier/none", b"", qos=1)

    second = durable().connect()
    assert second.session_present is True
    end = sentinel(pub, second)
    pub.publish(end, b"", qos=1)
    received = second.collect_until(end)
    assert [(m.topic, m.payload, m.qos) for m in received] == [
        ("jobs/1", b"offline-1", 1), ("jobs/2", b"offline-2", 1)]
    second.close()

    # A clean start discards the session.
    third = Peer(broker.port, "durable", protocol=protocol, clean=True).connect()
    assert third.session_present is False
    third.close()
    pub.close()


def test_v5_session_without_expiry_ends_with_the_connection(broker: EmbeddedBroker) -> None:
    first = Peer(broker.port, "short", clean=False).connect()  # Session Expiry absent = 0
    assert first.subscribe("s/t", 1) == [1]
    first.close()
    assert first.disconnected.wait(WAIT)
    again = Peer(broker.port, "short", clean=False).connect()
    assert again.session_present is False
    again.close()


def test_unacknowledged_qos1_is_redelivered_with_dup(broker: EmbeddedBroker) -> None:
    lazy = Peer(broker.port, "lazy", clean=False, session_expiry=300, manual_ack=True).connect()
    assert lazy.subscribe("work", 1) == [1]
    pub = Peer(broker.port).connect()
    pub.publish("work", b"do it", qos=1)
    first = lazy.get()
    assert (first.payload, first.dup) == (b"do it", False)
    lazy.close()  # never acked

    back = Peer(broker.port, "lazy", clean=False, session_expiry=300).connect()
    assert back.session_present is True
    again = back.get()
    assert (again.topic, again.payload, again.qos, again.dup) == ("work", b"do it", 1, True)
    end = sentinel(pub, back)
    pub.publish(end, b"", qos=1)
    assert back.collect_until(end) == []  # acked now: exactly one redelivery
    back.close()
    pub.close()


def test_session_takeover_disconnects_the_first_connection(broker: EmbeddedBroker) -> None:
    first = Peer(broker.port, "twin").connect()
    second = Peer(broker.port, "twin").connect()
    assert first.disconnected.wait(WAIT)
    assert first.disconnect_reason is not None
    assert first.disconnect_reason.value == 0x8E  # Session taken over
    assert second.client.is_connected()
    first.client.loop_stop()
    second.close()


def test_receive_maximum_window_is_honoured(broker: EmbeddedBroker) -> None:
    raw = RawClient(broker.port)
    assert raw.connect("windowed", properties=Properties(receive_maximum=2)).reason_code == 0
    raw.send(Subscribe(1, (("win/t", SubscriptionOptions(qos=1)),)))
    assert isinstance(raw.recv(), SubAck)
    pub = Peer(broker.port).connect()
    for i in range(5):
        pub.publish("win/t", f"m{i}".encode(), qos=1)  # PUBACK means routed

    def publishes_before_pong() -> list[Publish]:
        raw.send(PingReq())
        got: list[Publish] = []
        while not isinstance(packet := raw.recv(), PingResp):
            assert isinstance(packet, Publish), packet
            got.append(packet)
        return got

    window = publishes_before_pong()
    assert [p.payload for p in window] == [b"m0", b"m1"]
    first_id, second_id = (p.packet_id for p in window)
    assert first_id is not None and second_id is not None
    raw.send(PubAck(first_id))
    assert [p.payload for p in publishes_before_pong()] == [b"m2"]
    raw.send(PubAck(second_id))
    raw.send(Disconnect())
    pub.close()


# --- limits and properties ------------------------------------------------------------------------


def test_connack_announces_limits_and_oversize_publish_disconnects() -> None:
    with EmbeddedBroker(max_packet_size=1024) as broker:
        peer = Peer(broker.port).connect()
        props = peer.connack_properties
        assert props.MaximumPacketSize == 1024
        assert props.MaximumQoS == 1
        assert props.RetainAvailable == 1
        assert props.WildcardSubscriptionAvailable == 1
        assert props.SharedSubscriptionAvailable == 0
        assert props.TopicAliasMaximum == 0
        assert props.ReceiveMaximum == 20

        peer.client.publish("big", b"x" * 2000, qos=0)
        assert peer.disconnected.wait(WAIT)
        assert peer.disconnect_reason is not None
        assert peer.disconnect_reason.value == 0x95  # Packet too large
        peer.client.loop_stop()

        v311 = Peer(broker.port, protocol=MQTT_311).connect()
        v311.client.publish("big", b"x" * 2000, qos=0)
        assert v311.disconnected.wait(WAIT)  # 3.1.1: just closed
        v311.client.loop_stop()

        assert_round_trip(broker.port)  # a 1 KB limit still fits a small message


def test_broker_never_sends_a_v5_client_more_than_its_maximum_packet_size(
        broker: EmbeddedBroker) -> None:
    small = Peer(broker.port, maximum_packet_size=512).connect()
    large = Peer(broker.port).connect()
    pub = Peer(broker.port).connect()
    for peer in (small, large):
        assert peer.subscribe("sized/#", 1) == [1]
    end = sentinel(pub, small, large)
    pub.publish("sized/big", b"B" * 1000, qos=1)
    pub.publish("sized/small", b"s" * 10, qos=1)
    pub.publish(end, b"", qos=1)
    assert [m.topic for m in small.collect_until(end)] == ["sized/small"]
    assert [m.topic for m in large.collect_until(end)] == ["sized/big", "sized/small"]
    assert small.client.is_connected()
    for peer in (small, large, pub):
        peer.close()


@pytest.mark.parametrize("protocol", [MQTT_5, MQTT_311], ids=["v5", "v311"])
def test_four_megabyte_payload_round_trips(broker: EmbeddedBroker, protocol: int) -> None:
    payload = os.urandom(4 * 1024 * 1024)
    sub = Peer(broker.port, protocol=protocol).connect()
    pub = Peer(broker.port, protocol=protocol).connect()
    assert sub.subscribe("blob", 1) == [1]
    pub.publish("blob", payload, qos=1)
    message = sub.get(timeout=20)
    assert message.payload == payload
    sub.close()
    pub.close()


def test_v5_publish_properties_are_forwarded(broker: EmbeddedBroker) -> None:
    sub = Peer(broker.port).connect()
    pub = Peer(broker.port).connect()
    assert sub.subscribe("props/t", 1) == [1]
    props = PahoProperties(PacketTypes.PUBLISH)
    props.UserProperty = [("k", "1"), ("k", "2"), ("model", "mlp")]
    props.ContentType = "application/msgpack"
    props.ResponseTopic = "props/reply"
    props.CorrelationData = b"\x00\x01corr"
    props.PayloadFormatIndicator = 0
    props.MessageExpiryInterval = 60
    pub.publish("props/t", b"\x81\xa1a\x01", qos=1, properties=props)
    received: Any = sub.get().properties
    assert received.UserProperty == [("k", "1"), ("k", "2"), ("model", "mlp")]
    assert received.ContentType == "application/msgpack"
    assert received.ResponseTopic == "props/reply"
    assert received.CorrelationData == b"\x00\x01corr"
    assert received.PayloadFormatIndicator == 0
    assert 59 <= received.MessageExpiryInterval <= 60
    sub.close()
    pub.close()


def test_qos2_publish_is_refused() -> None:
    with EmbeddedBroker() as broker:
        v5 = RawClient(broker.port)
        assert v5.connect("q2-v5").reason_code == 0
        v5.send(Publish("q2", b"x", qos=2, packet_id=1))
        assert v5.packets_until_closed() == [Disconnect(0x9B)]  # QoS not supported

        v311 = RawClient(broker.port, MQTT_311)
        assert v311.connect("q2-v311").reason_code == 0
        v311.send(Publish("q2", b"x", qos=2, packet_id=1))
        assert v311.packets_until_closed() == []

        v5_will = RawClient(broker.port)
        assert v5_will.connect("q2-will", will=Will("w", b"", qos=2)).reason_code == 0x9B


def test_unsupported_protocol_levels_are_refused(broker: EmbeddedBroker) -> None:
    v31 = RawClient(broker.port, MQTT_311)
    assert v31.connect("old", protocol_name="MQIsdp", protocol_level=3).reason_code == 1
    assert v31.packets_until_closed() == []

    future = RawClient(broker.port, MQTT_5)
    future.send_raw(encode_packet(Connect("future", protocol_level=MQTT_311), MQTT_311)
                    .replace(b"MQTT\x04", b"MQTT\x06"))
    assert future.recv() == ConnAck(0x84)  # Unsupported Protocol Version
    assert future.packets_until_closed() == []

    empty_id = RawClient(broker.port, MQTT_311)
    assert empty_id.connect("", clean_start=False).reason_code == 2  # identifier rejected


def test_v5_empty_client_id_is_assigned(broker: EmbeddedBroker) -> None:
    raw = RawClient(broker.port)
    connack = raw.connect("")
    assert connack.reason_code == 0
    assert connack.properties.assigned_client_identifier
    raw.send(Disconnect())


# --- robustness -----------------------------------------------------------------------------------

_CONNECT_V5 = encode_packet(Connect("bad-actor"), MQTT_5)

MALFORMED = {
    "http-request": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "five-byte-remaining-length": _CONNECT_V5 + b"\x30\xff\xff\xff\xff\x01",
    "publish-qos-3": _CONNECT_V5 + b"\x36\x05\x00\x01a\x00\x01",
    "subscribe-wrong-flags": _CONNECT_V5 + b"\x80\x06\x00\x01\x00\x01a\x00",
    "truncated-topic-string": _CONNECT_V5 + b"\x30\x05\x00\x0aabc",
    "invalid-utf8-topic": _CONNECT_V5 + b"\x30\x05\x00\x02\xff\xfe\x00",
    "unknown-property-id": _CONNECT_V5 + b"\x30\x07\x00\x01a\x02\x7f\x00x",
    "property-length-overruns": _CONNECT_V5 + b"\x30\x05\x00\x01a\x09\x01",
    "second-connect": _CONNECT_V5 + _CONNECT_V5,
    "server-only-packet": _CONNECT_V5 + b"\x20\x02\x00\x00",
    "wildcard-in-topic-name": _CONNECT_V5 + b"\x30\x05\x00\x01#\x00x",
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_input_disconnects_only_that_client(broker: EmbeddedBroker,
                                                      data: bytes) -> None:
    bystander = Peer(broker.port).connect()
    assert bystander.subscribe("calm/#", 1) == [1]
    stalled = RawClient(broker.port)
    stalled.send_raw(_CONNECT_V5.replace(b"bad-actor", b"stalled!!") + b"\x30\x64\x00")
    assert isinstance(stalled.recv(), ConnAck)  # ...and a half-sent PUBLISH it never finishes

    bad = RawClient(broker.port)
    bad.send_raw(data)
    packets = bad.packets_until_closed()
    assert all(isinstance(p, ConnAck | Disconnect) for p in packets), packets
    disconnects = [p for p in packets if isinstance(p, Disconnect)]
    if disconnects:
        assert disconnects[0].reason_code >= 0x80

    assert_round_trip(broker.port)
    pub = Peer(broker.port).connect()
    pub.publish("calm/after", b"ok", qos=1)
    assert bystander.get().payload == b"ok"
    assert bystander.client.is_connected()
    stalled.close()
    bystander.close()
    pub.close()


def test_malformed_packet_reason_code(broker: EmbeddedBroker) -> None:
    raw = RawClient(broker.port)
    assert raw.connect("reasoned").reason_code == 0
    raw.send_raw(b"\x30\x05\x00\x0aabc")  # topic length says 10, packet has 3
    assert raw.packets_until_closed() == [Disconnect(0x81)]  # Malformed Packet


def test_fifty_concurrent_publishers(broker: EmbeddedBroker) -> None:
    clients, per_client = 50, 20
    expected = {f"{c}:{i}".encode() for c in range(clients) for i in range(per_client)}
    subscribers = [Peer(broker.port, "load-sub-v5").connect(),
                   Peer(broker.port, "load-sub-v311", protocol=MQTT_311).connect()]
    for sub in subscribers:
        assert sub.subscribe("load/#", 1) == [1]
    publishers = [Peer(broker.port, f"load-pub-{c}", protocol=MQTT_5 if c % 2 else MQTT_311)
                  .connect() for c in range(clients)]
    errors: list[BaseException] = []

    def run(index: int, peer: Peer) -> None:
        try:
            infos = [peer.client.publish(f"load/{index}", f"{index}:{i}".encode(), qos=1)
                     for i in range(per_client)]
            for info in infos:
                info.wait_for_publish(WAIT)
                assert info.is_published()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(publishers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT * 2)
    assert not errors, errors

    for sub in subscribers:
        received: list[bytes] = []
        while len(set(received)) < len(expected):
            received.append(bytes(sub.get().payload))
        assert len(received) >= clients * per_client
        assert set(received) == expected
    for peer in subscribers + publishers:
        peer.close()


# --- command line -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def test_module_entry_point_serves_and_stops_on_sigterm() -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedtier.embedded_broker", "--host", HOST, "--port", str(port),
         "--max-packet-size", "65536"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump_stderr() -> None:
        for line in proc.stderr or ():
            lines.put(line)

    threading.Thread(target=pump_stderr, daemon=True).start()
    try:
        deadline = time.monotonic() + WAIT
        while True:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if re.search(rf"listening on {re.escape(HOST)}:{port}\b", line):
                break
        assert_round_trip(port)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0
        stdout = proc.stdout.read() if proc.stdout else ""
        assert stdout == ""  # logging only, never print
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- codec sanity ---------------------------------------------------------------------------------

_PACKETS: list[Packet] = [
    Connect("c", will=Will("w/t", b"bye", 1, True), username="u", password=b"p", keep_alive=5),
    ConnAck(0, True),
    Publish("a/b", b"payload", qos=1, retain=True, dup=True, packet_id=7),
    Publish("a/b", b""),
    PubAck(7),
    Subscribe(3, (("a/+", SubscriptionOptions(qos=1)), ("#", SubscriptionOptions()))),
    SubAck(3, (1, 0x80)),
    Unsubscribe(4, ("a/+",)),
    PingReq(),
    PingResp(),
    Disconnect(),
]

_PACKETS_V5_ONLY: list[Packet] = [
    Connect("c", properties=Properties(session_expiry_interval=30, receive_maximum=5,
                                       user_properties=(("a", "b"),)),
            will=Will("w", b"x", properties=Properties(will_delay_interval=0,
                                                       content_type="t"))),
    ConnAck(0, False, Properties(maximum_packet_size=100, topic_alias_maximum=0)),
    Publish("t", b"p", properties=Properties(user_properties=(("k", "v"), ("k", "w")),
                                             subscription_identifiers=(1, 300))),
    PubAck(9, 0x10),
    Subscribe(1, (("t", SubscriptionOptions(1, True, True, 2)),),
              Properties(subscription_identifiers=(42,))),
    UnsubAck(4, (0, 0x11)),
    Disconnect(0x04, Properties(session_expiry_interval=0, reason_string="bye")),
]


@pytest.mark.parametrize("packet", _PACKETS + _PACKETS_V5_ONLY, ids=lambda p: type(p).__name__)
def test_codec_round_trip(packet: Packet) -> None:
    levels = (MQTT_5,) if packet in _PACKETS_V5_ONLY else (MQTT_311, MQTT_5)
    for level in levels:
        if isinstance(packet, Connect):
            packet = Connect(**{**{f: getattr(packet, f) for f in packet.__dataclass_fields__},
                                "protocol_level": level})
        framer = PacketFramer()
        framer.feed(encode_packet(packet, level))
        frame = framer.next_frame()
        assert frame is not None and framer.buffered == 0
        assert decode_packet(frame, level) == packet


def test_online_clients_lists_live_connections(broker: EmbeddedBroker) -> None:
    peer = Peer(broker.port, "listed").connect()
    assert "listed" in broker.online_clients()
    peer.close()
    deadline = time.monotonic() + WAIT
    while "listed" in broker.online_clients() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "listed" not in broker.online_clients()

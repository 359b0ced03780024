"""Wills, keep alive, sessions (resumption, expiry, takeover) and the in-flight window, on both brokers."""

from __future__ import annotations

import time
from typing import Any

import pytest
from broker_harness import (
    WAIT,
    Check,
    Peer,
    RawClient,
    RunningBroker,
    broker,
    check,
    disconnect_and_wait,
    kind,
    sentinel,
    start,
)
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode as PahoReasonCode

from fedtier.embedded_broker.limits import BrokerLimits
from fedtier.embedded_broker.packets import (
    MQTT_5,
    MQTT_311,
    Disconnect,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    SubscriptionOptions,
    Will,
)

__all__ = ["broker", "check", "kind", "start"]  # fixtures
pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]
BOTH = pytest.mark.parametrize("protocol", [MQTT_5, MQTT_311], ids=["v5", "v311"])
DURABLE = {"clean_start": False, "properties": Properties(session_expiry_interval=300)}


# --- wills -------------------------------------------------------------------------------------


@BOTH
def test_will_is_published_when_the_socket_closes_without_disconnect(broker: RunningBroker, check: Check,
                                                                      protocol: int) -> None:
    watcher = Peer(broker.port).connect()
    assert watcher.subscribe("will/#", 1) == [1]
    raw = RawClient(broker.port, protocol)
    will_props = Properties(content_type="text/plain", user_properties=(("why", "crash"),))
    will = Will("will/raw", b"gone", qos=1, properties=will_props if protocol == MQTT_5 else Properties())
    assert raw.connect("dying", will=will).reason_code == 0
    raw.close()  # no DISCONNECT: abnormal
    message = watcher.get()
    check.same("will delivered", (message.topic, bytes(message.payload), message.qos), ("will/raw", b"gone", 1))
    if protocol == MQTT_5:
        props: Any = message.properties
        check.same("will content type", props.ContentType, "text/plain")
        check.same("will user properties", props.UserProperty, [("why", "crash")])
    watcher.close()


def test_retained_will_of_a_dropped_paho_client(broker: RunningBroker, check: Check) -> None:
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
    check.same("will delivered", (message.topic, bytes(message.payload)), ("will/victim", b"lost"))
    late = Peer(broker.port).connect()
    assert late.subscribe("will/victim", 1) == [1]
    stored = late.get()
    check.same("a retained will is stored", (bytes(stored.payload), stored.retain), (b"lost", True))
    watcher.close()
    late.close()


def test_no_will_on_disconnect_but_will_on_reason_0x04(broker: RunningBroker, check: Check) -> None:
    watcher = Peer(broker.port).connect()
    assert watcher.subscribe("will/#", 1) == [1]
    pub = Peer(broker.port).connect()
    end = sentinel(watcher)

    polite = RawClient(broker.port)
    polite.connect("polite", will=Will("will/polite", b"should not appear", qos=1))
    check.same("DISCONNECT 0x00: closed by the broker", disconnect_and_wait(polite, Disconnect()), [])
    v311 = RawClient(broker.port, MQTT_311)
    v311.connect("polite-v311", will=Will("will/polite-v311", b"should not appear", qos=1))
    check.same("3.1.1 DISCONNECT: closed by the broker", disconnect_and_wait(v311, Disconnect()), [])
    with_will = RawClient(broker.port)
    with_will.connect("with-will", will=Will("will/with-will", b"asked for it", qos=1))
    check.same("DISCONNECT 0x04: closed by the broker", disconnect_and_wait(with_will, Disconnect(0x04)), [])

    message = watcher.get()
    check.same("will published for 0x04 Disconnect with Will Message",
               (message.topic, bytes(message.payload)), ("will/with-will", b"asked for it"))
    pub.publish(end, b"", qos=1)
    check.same("no will after a normal DISCONNECT", watcher.collect_until(end), [])
    watcher.close()
    pub.close()


def test_keep_alive_expiry_disconnects_and_publishes_the_will(broker: RunningBroker, check: Check) -> None:
    watcher = Peer(broker.port).connect()
    assert watcher.subscribe("will/#", 1) == [1]
    raw = RawClient(broker.port)
    assert raw.connect("silent", keep_alive=1, will=Will("will/silent", b"timed out")).reason_code == 0
    packets = raw.packets_until_closed()  # we send nothing, not even PINGREQ
    check.that("closed, with no packet but a DISCONNECT", all(isinstance(p, Disconnect) for p in packets), packets)
    check.differs("DISCONNECT 0x8D Keep Alive timeout before closing", packets,
                  {"mosquitto": [], "embedded": [Disconnect(0x8D)]},
                  spec="MQTT 5 §3.1.2.10, §4.13.2 (the Server MAY send DISCONNECT 0x8D)")
    message = watcher.get()
    check.same("will published", (message.topic, bytes(message.payload)), ("will/silent", b"timed out"))
    watcher.close()


def test_a_client_without_keep_alive_is_held_to_max_keepalive(start: Any, check: Check, kind: str) -> None:
    """``max_keepalive``: v5 clients asking for no keep-alive (or a longer one) are told it in CONNACK
    (Server Keep Alive) and closed after 1.5 x it without a packet; a silent 3.1.1 client without
    keep-alive is closed after as long by the embedded broker only (Mosquitto keeps it forever)."""
    limit = 10 if kind == "mosquitto" else 2  # Mosquitto accepts no max_keepalive under 10
    broker = start(limits=BrokerLimits(max_keepalive=limit))
    started = time.monotonic()
    silent = RawClient(broker.port, MQTT_5, timeout=3 * limit + WAIT)
    connack = silent.connect("no-keep-alive", keep_alive=0)
    check.same("v5, keep-alive 0: Server Keep Alive is max_keepalive", connack.properties.server_keep_alive, limit)
    longer = RawClient(broker.port, MQTT_5)
    connack = longer.connect("long-keep-alive", keep_alive=10 * limit)
    check.same("v5, keep-alive over it: Server Keep Alive is max_keepalive", connack.properties.server_keep_alive,
               limit)
    longer.close()
    shorter = RawClient(broker.port, MQTT_5)
    connack = shorter.connect("short-keep-alive", keep_alive=limit - 1)
    check.same("v5, keep-alive under it: no Server Keep Alive", connack.properties.server_keep_alive, None)
    shorter.close()
    v311 = RawClient(broker.port, MQTT_311, timeout=WAIT)
    check.same("3.1.1, keep-alive 0: accepted", v311.connect("no-keep-alive-311", keep_alive=0).reason_code, 0)
    packets = silent.packets_until_closed()
    elapsed = time.monotonic() - started
    check.that("v5: closed after 1.5 x max_keepalive without a packet", 1.5 * limit - 0.5 <= elapsed <= 1.5 * limit + 3,
               f"{elapsed:.1f} s")
    check.differs("v5: DISCONNECT 0x8D before closing", packets, {"mosquitto": [], "embedded": [Disconnect(0x8D)]},
                  spec="MQTT 5 §3.1.2.10, §4.13.2 (the Server MAY send DISCONNECT 0x8D)")
    v311.sock.settimeout(max(0.1, 1.5 * limit + 1 - (time.monotonic() - started)))
    try:
        closed = v311.recv() is None
    except TimeoutError:
        closed = False
    check.differs("3.1.1, keep-alive 0: closed after 1.5 x max_keepalive of silence", closed,
                  {"mosquitto": False, "embedded": True},
                  spec="3.1.1 §3.1.2.10 (Keep Alive 0 turns the mechanism off) and §4.13 of MQTT 5 "
                       "(a server may close a connection for its own reasons)")
    v311.close()


def test_ping(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port)
    assert raw.connect("pinger", keep_alive=2).reason_code == 0
    for i in range(3):
        raw.send(PingReq())
        check.same(f"PINGRESP {i}", raw.recv(), PingResp())
    check.same("DISCONNECT: closed without a reply", disconnect_and_wait(raw, Disconnect()), [])


# --- sessions ----------------------------------------------------------------------------------


@BOTH
def test_persistent_session_queues_while_offline(broker: RunningBroker, check: Check, protocol: int) -> None:
    first = RawClient(broker.port, protocol)
    check.same("new session", first.connect("durable", **DURABLE).session_present, False)
    first.send(Subscribe(1, (("jobs/#", SubscriptionOptions(qos=1)),)))
    assert first.recv() == SubAck(1, (1,))
    disconnect_and_wait(first, Disconnect())  # the broker has processed it: the session is offline

    pub = Peer(broker.port).connect()
    pub.publish("jobs/1", b"offline-1", qos=1)
    pub.publish("jobs/2", b"offline-2", qos=1)
    pub.publish("jobs/3", b"offline-qos0", qos=0)  # QoS 0 is not queued for offline clients
    pub.publish("barrier/none", b"", qos=1)  # processed after the QoS 0 one on the same connection

    second = Peer(broker.port, "durable", protocol=protocol, clean=False, session_expiry=300).connect()
    check.same("session present", second.session_present, True)
    end = sentinel(second)
    pub.publish(end, b"", qos=1)
    received = [(m.topic, bytes(m.payload), m.qos) for m in second.collect_until(end)]
    check.same("queued QoS 1 messages delivered in order, QoS 0 not queued", received,
               [("jobs/1", b"offline-1", 1), ("jobs/2", b"offline-2", 1)])
    second.close()
    third = Peer(broker.port, "durable", protocol=protocol, clean=True).connect()
    check.same("clean start discards the session", third.session_present, False)
    third.close()
    pub.close()


def test_v5_session_without_expiry_ends_with_the_connection(broker: RunningBroker, check: Check) -> None:
    first = RawClient(broker.port)
    first.connect("short", clean_start=False)  # Session Expiry absent = 0
    first.send(Subscribe(1, (("s/t", SubscriptionOptions(qos=1)),)))
    assert first.recv() == SubAck(1, (1,))
    disconnect_and_wait(first, Disconnect())
    again = RawClient(broker.port)
    check.same("no session after expiry 0", again.connect("short", clean_start=False).session_present, False)
    again.close()


def test_session_expiry_interval(broker: RunningBroker, check: Check) -> None:
    short = {"clean_start": False, "properties": Properties(session_expiry_interval=1)}
    raw = RawClient(broker.port)
    raw.connect("expiring", **short)
    disconnect_and_wait(raw, Disconnect())
    raw = RawClient(broker.port)
    check.same("resumed within the interval", raw.connect("expiring", **short).session_present, True)
    disconnect_and_wait(raw, Disconnect())
    time.sleep(3.0)  # let the one-second expiry pass; Mosquitto checks expiry about once a second
    raw = RawClient(broker.port)
    check.same("gone after the interval", raw.connect("expiring", **short).session_present, False)
    raw.close()


def test_disconnect_can_change_the_session_expiry(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port)
    raw.connect("shortened", **DURABLE)
    disconnect_and_wait(raw, Disconnect(0, Properties(session_expiry_interval=0)))
    raw = RawClient(broker.port)
    check.same("expiry set to 0 on DISCONNECT ends the session",
               raw.connect("shortened", **DURABLE).session_present, False)
    raw.close()
    zero = RawClient(broker.port)
    zero.connect("was-zero", clean_start=False)
    check.same("0 on CONNECT, non-zero on DISCONNECT: Protocol Error [MQTT-3.14.2-2]",
               disconnect_and_wait(zero, Disconnect(0, Properties(session_expiry_interval=30))),
               [Disconnect(0x82)])


def test_unacknowledged_qos1_is_redelivered_with_dup(broker: RunningBroker, check: Check) -> None:
    lazy = Peer(broker.port, "lazy", clean=False, session_expiry=300, manual_ack=True).connect()
    assert lazy.subscribe("work", 1) == [1]
    pub = Peer(broker.port).connect()
    pub.publish("work", b"do it", qos=1)
    first = lazy.get()
    check.same("first delivery", (bytes(first.payload), first.dup), (b"do it", False))
    lazy.close()  # never acked
    back = Peer(broker.port, "lazy", clean=False, session_expiry=300).connect()
    check.same("session present", back.session_present, True)
    again = back.get()
    check.same("redelivered with DUP", (again.topic, bytes(again.payload), again.qos, again.dup),
               ("work", b"do it", 1, True))
    end = sentinel(back)
    pub.publish(end, b"", qos=1)
    check.same("acked now: exactly one redelivery", back.collect_until(end), [])
    back.close()
    pub.close()


def test_session_takeover(broker: RunningBroker, check: Check) -> None:
    watcher = Peer(broker.port).connect()
    assert watcher.subscribe("will/#", 1) == [1]
    first = RawClient(broker.port)
    first.connect("twin", will=Will("will/twin", b"taken over"))
    second = RawClient(broker.port)
    check.same("the second connection is accepted", second.connect("twin").reason_code, 0)
    packets = first.packets_until_closed()
    check.that("the first connection is closed", all(isinstance(p, Disconnect) for p in packets), packets)
    check.differs("... with DISCONNECT 0x8E Session taken over", packets,
                  {"mosquitto": [], "embedded": [Disconnect(0x8E)]},
                  spec="MQTT 5 §3.1.4 step 3 [MQTT-3.1.4-3] (Mosquitto 2.0.11 closes without it)")
    message = watcher.get()
    check.same("the first connection's will is published", (message.topic, bytes(message.payload)),
               ("will/twin", b"taken over"))
    second.send(PingReq())
    check.same("the second connection works", second.recv(), PingResp())
    second.close()
    watcher.close()


def test_receive_maximum_window_is_honoured(broker: RunningBroker, check: Check) -> None:
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
    check.same("two in flight", [p.payload for p in window], [b"m0", b"m1"])
    raw.send(PubAck(window[0].packet_id or 0))
    more = publishes_before_pong()
    check.differs("one acknowledged: what follows", [p.payload for p in more],
                  {"mosquitto": [b"m2", b"m3"], "embedded": [b"m2"]},
                  spec="MQTT 5 §3.3.4 [MQTT-3.3.4-9] (Mosquitto 2.0.11 exceeds the client's Receive Maximum here)")
    received = [*window, *more]
    for packet in received[1:]:
        raw.send(PubAck(packet.packet_id or 0))
    while len(received) < 5:
        batch = publishes_before_pong()
        for packet in batch:
            raw.send(PubAck(packet.packet_id or 0))
        received += batch
    check.same("all five, in order, once acknowledged", [p.payload for p in received],
               [f"m{i}".encode() for i in range(5)])
    raw.send(Disconnect())
    pub.close()


def test_queue_limit_of_an_offline_session(start: Any, check: Check) -> None:
    broker = start(limits=BrokerLimits(max_queued_messages=3))
    raw = RawClient(broker.port)
    raw.connect("queued", **DURABLE)
    raw.send(Subscribe(1, (("q/#", SubscriptionOptions(qos=1)),)))
    assert raw.recv() == SubAck(1, (1,))
    disconnect_and_wait(raw, Disconnect())
    pub = Peer(broker.port).connect()
    for i in range(6):
        pub.publish("q/t", f"m{i}".encode(), qos=1)
    back = Peer(broker.port, "queued", clean=False, session_expiry=300).connect()
    end = sentinel(back)
    pub.publish(end, b"", qos=1)
    kept = [bytes(m.payload) for m in back.collect_until(end)]
    check.same("no more than max_queued_messages kept", len(kept), 3)
    check.differs("which ones", kept, {"mosquitto": [b"m0", b"m1", b"m2"], "embedded": [b"m3", b"m4", b"m5"]},
                  spec="MQTT 5 §4.1 (limits on session state are the Server's choice)")
    back.close()
    pub.close()


def test_paho_sees_the_takeover_reason(broker: RunningBroker, check: Check) -> None:
    first = Peer(broker.port, "paho-twin").connect()
    second = Peer(broker.port, "paho-twin").connect()
    assert first.disconnected.wait(WAIT)
    reason = first.disconnect_reason
    assert reason is not None
    check.same("paho reports a failure", reason.is_failure, True)
    check.differs("paho's reason", reason, {
        "mosquitto": PahoReasonCode(PacketTypes.DISCONNECT, identifier=0x80),  # no DISCONNECT: paho's own
        "embedded": PahoReasonCode(PacketTypes.DISCONNECT, identifier=0x8E)},
        spec="MQTT 5 §3.1.4 [MQTT-3.1.4-3]")
    check.same("the new connection stays", second.client.is_connected(), True)
    first.client.loop_stop()
    second.close()

"""Publish and subscribe on both brokers: QoS 0/1/2 flows, topic filters and wildcards,
retained messages, forwarded properties, large payloads, many publishers."""

from __future__ import annotations

import os
import threading
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
from paho.mqtt.properties import Properties as PahoProperties

from fedtier.embedded_broker.limits import DEFAULT_LIMITS, MIB
from fedtier.embedded_broker.packets import (
    MQTT_5,
    MQTT_311,
    Disconnect,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    SubscriptionOptions,
    UnsubAck,
    Unsubscribe,
)

__all__ = ["broker", "check", "kind", "start"]  # fixtures
pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]
BOTH = pytest.mark.parametrize("protocol", [MQTT_5, MQTT_311], ids=["v5", "v311"])


def subscribed(broker: RunningBroker, client_id: str, topic_filter: str, qos: int = 2, *,
               protocol: int = MQTT_5, **connect: Any) -> RawClient:
    raw = RawClient(broker.port, protocol)
    assert raw.connect(client_id, **connect).reason_code == 0
    raw.send(Subscribe(1, ((topic_filter, SubscriptionOptions(qos=qos)),)))
    suback = raw.recv()
    assert isinstance(suback, SubAck) and suback.reason_codes == (qos,), suback
    return raw


def until_pong(raw: RawClient) -> list[Any]:
    """Send PINGREQ; return what arrived before PINGRESP (the broker answers in order)."""
    raw.send(PingReq())
    got = []
    while not isinstance(packet := raw.recv(), PingResp):
        assert packet is not None, "connection closed"
        got.append(packet)
    return got


# --- QoS ---------------------------------------------------------------------------------------


@BOTH
def test_delivery_at_the_minimum_of_publish_and_subscription_qos(broker: RunningBroker, check: Check,
                                                                 protocol: int) -> None:
    subs = {qos: Peer(broker.port, f"sub-q{qos}", protocol=protocol).connect() for qos in (0, 1, 2)}
    pub = Peer(broker.port, "pub", protocol=protocol).connect()
    for qos, peer in subs.items():
        check.same(f"SUBACK grants QoS {qos}", peer.subscribe("room/temp", qos), [qos])
    for qos in (0, 1, 2):
        pub.publish("room/temp", f"q{qos}".encode(), qos=qos)
    for sub_qos, peer in subs.items():
        got = sorted((bytes(m.payload), m.qos) for m in (peer.get(), peer.get(), peer.get()))
        check.same(f"subscriber at QoS {sub_qos}", got,
                   [(f"q{q}".encode(), min(q, sub_qos)) for q in (0, 1, 2)])
    for peer in (*subs.values(), pub):
        peer.close()


@BOTH
def test_qos1_flow(broker: RunningBroker, check: Check, protocol: int) -> None:
    sub = subscribed(broker, "q1-sub", "q1/#", 1, protocol=protocol)
    pub = RawClient(broker.port, protocol)
    pub.connect("q1-pub")
    pub.send(Publish("q1/a", b"one", qos=1, packet_id=7))
    check.same("PUBACK with the packet id", pub.recv(), PubAck(7))
    got = sub.recv()
    assert isinstance(got, Publish)
    check.same("forwarded at QoS 1", (got.topic, got.payload, got.qos, got.dup, got.retain),
               ("q1/a", b"one", 1, False, False))
    sub.send(PubAck(got.packet_id or 0))
    check.same("acknowledged: nothing more", until_pong(sub), [])
    pub.send(Publish("nobody/listens", b"x", qos=1, packet_id=8))
    expected = PubAck(8, 0x10) if protocol == MQTT_5 else PubAck(8)
    check.same("no matching subscribers (v5: 0x10, a success code)", pub.recv(), expected)
    for raw in (sub, pub):
        raw.close()


@BOTH
def test_qos2_flow_from_publisher_to_subscriber(broker: RunningBroker, check: Check, protocol: int) -> None:
    sub = subscribed(broker, "q2-sub", "q2/#", 2, protocol=protocol)
    pub = RawClient(broker.port, protocol)
    pub.connect("q2-pub")
    pub.send(Publish("q2/a", b"exactly once", qos=2, packet_id=5))
    check.same("PUBREC", pub.recv(), PubRec(5))
    check.same("not delivered before PUBREL (§4.3.3 method A)", until_pong(sub), [])
    pub.send(Publish("q2/a", b"exactly once", qos=2, packet_id=5, dup=True))
    check.same("a re-sent PUBLISH gets PUBREC again", pub.recv(), PubRec(5))
    pub.send(PubRel(5))
    check.same("PUBCOMP", pub.recv(), PubComp(5))
    got = sub.recv()
    assert isinstance(got, Publish)
    check.same("delivered once at QoS 2", (got.topic, got.payload, got.qos, got.dup),
               ("q2/a", b"exactly once", 2, False))
    assert got.packet_id is not None
    sub.send(PubRec(got.packet_id))
    check.same("PUBREL from the broker", sub.recv(), PubRel(got.packet_id))
    sub.send(PubComp(got.packet_id))
    check.same("no duplicate, nothing more", until_pong(sub), [])
    for raw in (sub, pub):
        raw.close()


def test_qos2_flow_resumes_after_reconnect(broker: RunningBroker, check: Check) -> None:
    durable = {"clean_start": False, "properties": Properties(session_expiry_interval=300)}
    sub = subscribed(broker, "q2-durable", "resume/#", 2, **durable)
    pub = RawClient(broker.port)
    pub.connect("q2-resume-pub")
    pub.send(Publish("resume/a", b"one", qos=2, packet_id=1))
    assert pub.recv() == PubRec(1)
    pub.send(PubRel(1))
    assert pub.recv() == PubComp(1)
    first = sub.recv()
    assert isinstance(first, Publish) and first.packet_id is not None
    sub.close()  # no PUBREC: the broker must send the PUBLISH again

    sub = RawClient(broker.port)
    check.same("session present", sub.connect("q2-durable", **durable).session_present, True)
    again = sub.recv()
    assert isinstance(again, Publish)
    check.same("PUBLISH re-sent with DUP and the same id", (again.payload, again.qos, again.dup, again.packet_id),
               (b"one", 2, True, first.packet_id))
    sub.send(PubRec(first.packet_id))
    check.same("PUBREL", sub.recv(), PubRel(first.packet_id))
    sub.close()  # no PUBCOMP: the broker must send the PUBREL again, not the PUBLISH

    sub = RawClient(broker.port)
    check.same("session present again", sub.connect("q2-durable", **durable).session_present, True)
    check.same("PUBREL re-sent", sub.recv(), PubRel(first.packet_id))
    sub.send(PubComp(first.packet_id))
    check.same("flow complete: nothing more", until_pong(sub), [])
    sub.close()
    pub.close()


def test_acknowledgements_for_unknown_packet_ids(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port)
    raw.connect("unknown-ids")
    raw.send(PubRel(41))
    comp = raw.recv()
    assert isinstance(comp, PubComp)
    check.same("PUBREL of an unknown id: PUBCOMP with that id", comp.packet_id, 41)
    check.differs("... its reason code", comp.reason_code, {"mosquitto": 0, "embedded": 0x92},
                  spec="MQTT 5 §3.7.2.1 (0x92 Packet Identifier not found)")
    raw.send(PubRec(42))
    rel = raw.recv()
    assert isinstance(rel, PubRel)
    check.same("PUBREC of an unknown id: PUBREL with that id", rel.packet_id, 42)
    check.differs("... its reason code", rel.reason_code, {"mosquitto": 0, "embedded": 0x92},
                  spec="MQTT 5 §3.6.2.1 (0x92 Packet Identifier not found)")
    raw.send(PubAck(43))
    raw.send(PubComp(44))
    check.same("PUBACK and PUBCOMP of unknown ids are ignored", until_pong(raw), [])
    raw.close()


@BOTH
def test_qos2_with_paho(broker: RunningBroker, check: Check, protocol: int) -> None:
    sub = Peer(broker.port, "paho-q2-sub", protocol=protocol).connect()
    pub = Peer(broker.port, "paho-q2-pub", protocol=protocol).connect()
    check.same("granted QoS 2", sub.subscribe("pq2/t", 2), [2])
    end = sentinel(sub, qos=2)
    for i in range(5):
        pub.publish("pq2/t", f"m{i}".encode(), qos=2)
    pub.publish(end, b"", qos=2)
    got = [(bytes(m.payload), m.qos) for m in sub.collect_until(end)]
    check.same("each exactly once, in order, at QoS 2", got, [(f"m{i}".encode(), 2) for i in range(5)])
    sub.close()
    pub.close()


# --- topic filters ------------------------------------------------------------------------------


def test_wildcards_and_dollar_topics(broker: RunningBroker, check: Check) -> None:
    filters = ["sensors/+/temp", "sensors/#", "#", "+/+/temp", "$fedtier/#", "+/broker/uptime", "+", "/+"]
    subscribers = {f: Peer(broker.port).connect() for f in filters}
    pub = Peer(broker.port).connect()
    for index, (topic_filter, peer) in enumerate(subscribers.items()):
        check.same(f"subscribe {topic_filter}", peer.subscribe(topic_filter, 1), [1])
        assert peer.subscribe(f"sentinel/{index}", 1) == [1]
    topics = ["sensors/a/temp", "sensors/a/hum", "sensors", "$fedtier/broker/uptime", "other/x/temp", "/lead"]
    for topic in topics:
        pub.publish(topic, topic.encode(), qos=1)
    for index in range(len(filters)):
        pub.publish(f"sentinel/{index}", b"", qos=1)
    expected = {
        "sensors/+/temp": {"sensors/a/temp"},
        "sensors/#": {"sensors/a/temp", "sensors/a/hum", "sensors"},
        "#": {"sensors/a/temp", "sensors/a/hum", "sensors", "other/x/temp", "/lead"},
        "+/+/temp": {"sensors/a/temp", "other/x/temp"},
        "$fedtier/#": {"$fedtier/broker/uptime"},
        "+/broker/uptime": set(),  # a leading wildcard never matches a $ topic ([MQTT-4.7.2-1])
        "+": {"sensors"},
        "/+": {"/lead"},
    }
    for index, (topic_filter, peer) in enumerate(subscribers.items()):
        received = sorted(m.topic for m in peer.collect_until(f"sentinel/{index}"))
        check.same(f"{topic_filter} matches", received, sorted(expected[topic_filter]))
        peer.close()
    pub.close()


def test_overlapping_subscriptions(broker: RunningBroker, check: Check) -> None:
    sub = Peer(broker.port).connect()
    pub = Peer(broker.port).connect()
    assert sub.subscribe("a/#", 0) == [0]
    assert sub.subscribe("a/+", 1) == [1]
    end = sentinel(sub)
    pub.publish("a/b", b"once", qos=1)
    pub.publish(end, b"", qos=1)
    received = [(m.topic, bytes(m.payload), m.qos) for m in sub.collect_until(end)]
    check.that("delivered at the highest QoS of the matching subscriptions [MQTT-3.3.4-2]",
               ("a/b", b"once", 1) in received, received)
    check.differs("copies, one per matching subscription or one in all", len(received),
                  {"mosquitto": 2, "embedded": 1}, spec="MQTT 5 §3.3.4 (the Server MAY deliver further copies)")
    sub.close()
    pub.close()


def test_unsubscribe_stops_delivery(broker: RunningBroker, check: Check) -> None:
    sub = Peer(broker.port).connect()
    pub = Peer(broker.port).connect()
    assert sub.subscribe("u/t", 1) == [1]
    end = sentinel(sub)
    check.same("UNSUBACK success", sub.unsubscribe("u/t"), [0])
    check.same("UNSUBACK no subscription existed", sub.unsubscribe("u/t"), [0x11])
    pub.publish("u/t", b"after unsubscribe", qos=1)
    pub.publish(end, b"", qos=1)
    check.same("nothing delivered after UNSUBSCRIBE", sub.collect_until(end), [])
    sub.close()
    pub.close()


@BOTH
def test_invalid_topic_filters_are_malformed(start: Any, check: Check, protocol: int) -> None:
    broker = start()
    expected = [Disconnect(0x81)] if protocol == MQTT_5 else []
    for topic_filter in ("a/#/b", "a+", "#a", "a/b#", ""):
        raw = RawClient(broker.port, protocol)
        raw.connect("filters")
        raw.send(Subscribe(1, (("ok/#", SubscriptionOptions(qos=1)), (topic_filter, SubscriptionOptions(qos=1)))))
        check.same(f"SUBSCRIBE {topic_filter!r}: closed (v5: DISCONNECT 0x81)", raw.packets_until_closed(), expected)
    raw = RawClient(broker.port, protocol)
    raw.connect("filters")
    raw.send(Unsubscribe(2, ("a/#/b",)))
    check.same("UNSUBSCRIBE with an invalid filter: closed", raw.packets_until_closed(), expected)


def test_shared_subscriptions(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port)
    raw.connect("share-v5")
    raw.send(Subscribe(1, (("$share/g/t", SubscriptionOptions(qos=1)), ("plain/t", SubscriptionOptions(qos=1)))))
    suback = raw.recv()
    assert isinstance(suback, SubAck)
    check.same("the other filter is granted", suback.reason_codes[1], 1)
    check.differs("$share/g/t in MQTT 5", suback.reason_codes[0], {"mosquitto": 1, "embedded": 0x9E},
                  spec="MQTT 5 §4.8.2, §3.9.3 (0x9E Shared Subscriptions not supported)")
    raw.send(Unsubscribe(2, ("$share/g/t", "plain/t")))
    unsuback = raw.recv()
    assert isinstance(unsuback, UnsubAck)
    check.same("UNSUBACK for plain/t", unsuback.reason_codes[1], 0)
    raw.close()


# --- retained messages -------------------------------------------------------------------------


def test_retained_set_replace_clear(broker: RunningBroker, check: Check) -> None:
    pub = Peer(broker.port).connect()
    pub.publish("r/1", b"v1", qos=1, retain=True)
    pub.publish("r/2", b"v2", qos=1, retain=True)
    sub = Peer(broker.port).connect()
    check.same("SUBACK", sub.subscribe("r/#", 1), [1])
    first = {m.topic: (bytes(m.payload), m.retain) for m in (sub.get(), sub.get())}
    check.same("retained messages on subscribe, RETAIN=1", first, {"r/1": (b"v1", True), "r/2": (b"v2", True)})

    pub.publish("r/1", b"v1-updated", qos=1, retain=True)
    live = sub.get()
    check.same("live forwarding clears RETAIN [MQTT-3.3.1-12]", (live.topic, bytes(live.payload), live.retain),
               ("r/1", b"v1-updated", False))
    late = Peer(broker.port).connect()
    end = sentinel(late)
    assert late.subscribe("r/1", 1) == [1]
    pub.publish(end, b"", qos=1)
    check.same("a retained message is replaced", [(bytes(m.payload), m.retain) for m in late.collect_until(end)],
               [(b"v1-updated", True)])

    pub.publish("r/1", b"", qos=1, retain=True)
    cleared = sub.get()
    check.same("the clearing message is forwarded live", (cleared.topic, bytes(cleared.payload)), ("r/1", b""))
    later = Peer(broker.port).connect()
    end = sentinel(later, name="end2")
    assert later.subscribe("r/#", 1) == [1]
    pub.publish(end, b"", qos=1)
    check.same("an empty retained payload clears the topic",
               [(m.topic, bytes(m.payload), m.retain) for m in later.collect_until(end)], [("r/2", b"v2", True)])
    for peer in (pub, sub, late, later):
        peer.close()


def test_retained_qos_and_retain_handling(broker: RunningBroker, check: Check) -> None:
    raw_pub = RawClient(broker.port)
    raw_pub.connect("rh-pub")
    raw_pub.send(Publish("rh/t", b"kept", qos=2, retain=True, packet_id=1))
    assert raw_pub.recv() == PubRec(1)
    raw_pub.send(PubRel(1))
    assert raw_pub.recv() == PubComp(1)
    raw = RawClient(broker.port)
    raw.connect("rh-sub")
    raw.send(Subscribe(1, (("rh/t", SubscriptionOptions(qos=1, retain_handling=1)),)))
    got = until_pong(raw)
    check.same("retain handling 1, new subscription: sent, at min(QoS 2, QoS 1)",
               [(type(p).__name__, getattr(p, "payload", None), getattr(p, "qos", None), getattr(p, "retain", None))
                for p in got], [("SubAck", None, None, None), ("Publish", b"kept", 1, True)])
    raw.send(PubAck(got[1].packet_id))
    raw.send(Subscribe(2, (("rh/t", SubscriptionOptions(qos=1, retain_handling=1)),)))
    check.same("retain handling 1, existing subscription: not sent", until_pong(raw), [SubAck(2, (1,))])
    raw.send(Subscribe(3, (("rh/t", SubscriptionOptions(qos=1, retain_handling=2)),)))
    check.same("retain handling 2: never sent", until_pong(raw), [SubAck(3, (1,))])
    raw.send(Subscribe(4, (("rh/t", SubscriptionOptions(qos=0, retain_handling=0)),),
                       Properties(subscription_identifiers=(9,))))
    got = until_pong(raw)
    check.same("retain handling 0: sent again, with the subscription identifier",
               [(type(p).__name__, getattr(p, "payload", None), getattr(p, "retain", None),
                 getattr(getattr(p, "properties", None), "subscription_identifiers", None)) for p in got],
               [("SubAck", None, None, ()), ("Publish", b"kept", True, (9,))])
    raw.close()
    raw_pub.close()


def test_a_retained_qos2_message_is_stored_on_pubrel(broker: RunningBroker, check: Check) -> None:
    pub = RawClient(broker.port)
    pub.connect("rq2-pub")
    pub.send(Publish("rq2/t", b"released", qos=2, retain=True, packet_id=3))
    assert pub.recv() == PubRec(3)
    early = RawClient(broker.port)
    early.connect("rq2-early")
    early.send(Subscribe(1, (("rq2/t", SubscriptionOptions(qos=0)),)))
    check.same("before PUBREL: nothing retained yet", until_pong(early), [SubAck(1, (0,))])
    pub.send(PubRel(3))
    assert pub.recv() == PubComp(3)
    live = early.recv()
    assert isinstance(live, Publish)
    check.same("on PUBREL: delivered live", (live.payload, live.retain), (b"released", False))
    late = RawClient(broker.port)
    late.connect("rq2-late")
    late.send(Subscribe(1, (("rq2/t", SubscriptionOptions(qos=0)),)))
    got = until_pong(late)
    check.same("after PUBREL: retained", [(getattr(p, "payload", None), getattr(p, "retain", None)) for p in got],
               [(None, None), (b"released", True)])
    for raw in (pub, early, late):
        raw.close()


def test_retain_as_published_no_local_and_subscription_ids(broker: RunningBroker, check: Check) -> None:
    pub = Peer(broker.port, "rap-pub").connect()
    sub = Peer(broker.port, "rap-sub").connect()
    end = sentinel(sub, pub)
    check.same("retain as published", sub.subscribe("rap/t", 1, retainAsPublished=True, retainHandling=2), [1])
    check.same("no local", pub.subscribe("rap/t", 1, noLocal=True), [1])
    pub.publish("rap/t", b"live", qos=1, retain=True)
    pub.publish(end, b"", qos=1)
    check.same("RETAIN kept for a retain-as-published subscription",
               [(bytes(m.payload), m.retain) for m in sub.collect_until(end)], [(b"live", True)])
    check.same("no local: the publisher gets nothing of its own", pub.collect_until(end), [])
    props = PahoProperties(PacketTypes.SUBSCRIBE)
    props.SubscriptionIdentifier = 77
    ids_peer = Peer(broker.port, "ids").connect()
    result, mid = ids_peer.client.subscribe("ids/#", qos=1, properties=props)
    end2 = sentinel(ids_peer, name="ids-end")
    pub.publish("ids/x", b"x", qos=1)
    pub.publish(end2, b"", qos=1)
    received = ids_peer.collect_until(end2)
    check.same("the subscription identifier travels with the message",
               [getattr(m.properties, "SubscriptionIdentifier", None) for m in received], [[77]])
    for peer in (pub, sub, ids_peer):
        peer.close()


def test_retained_message_expiry(broker: RunningBroker, check: Check) -> None:
    pub = Peer(broker.port).connect()
    props = PahoProperties(PacketTypes.PUBLISH)
    props.MessageExpiryInterval = 1
    pub.publish("exp/short", b"soon gone", qos=1, retain=True, properties=props)
    pub.publish("exp/long", b"stays", qos=1, retain=True)
    time.sleep(2.2)  # let the one-second expiry pass (no timing is asserted)
    sub = Peer(broker.port).connect()
    end = sentinel(sub)
    assert sub.subscribe("exp/#", 1) == [1]
    pub.publish(end, b"", qos=1)
    check.same("an expired retained message is not delivered [MQTT-3.3.2-5]",
               [m.topic for m in sub.collect_until(end)], ["exp/long"])
    sub.close()
    pub.close()


# --- properties, sizes, load -------------------------------------------------------------------


def test_v5_publish_properties_are_forwarded(broker: RunningBroker, check: Check) -> None:
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
    check.same("user properties, order and repeats kept", received.UserProperty,
               [("k", "1"), ("k", "2"), ("model", "mlp")])
    check.same("content type", received.ContentType, "application/msgpack")
    check.same("response topic", received.ResponseTopic, "props/reply")
    check.same("correlation data", received.CorrelationData, b"\x00\x01corr")
    check.same("payload format indicator", received.PayloadFormatIndicator, 0)
    check.that("message expiry: the time remaining", 59 <= received.MessageExpiryInterval <= 60,
               received.MessageExpiryInterval)
    sub.close()
    pub.close()


@BOTH
def test_four_megabyte_payload_round_trips_under_a_raised_limit(start: Any, check: Check, protocol: int) -> None:
    broker = start(limits=DEFAULT_LIMITS.__class__(max_packet_size=8 * MIB))
    payload = os.urandom(4 * MIB)
    sub = Peer(broker.port, protocol=protocol).connect()
    pub = Peer(broker.port, protocol=protocol).connect()
    assert sub.subscribe("blob", 1) == [1]
    pub.publish("blob", payload, qos=1)
    check.same("4 MiB intact", bytes(sub.get(timeout=30).payload) == payload, True)
    sub.close()
    pub.close()


def test_fifty_concurrent_publishers(broker: RunningBroker, check: Check) -> None:
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
    check.same("every publish acknowledged", errors, [])
    for sub in subscribers:
        received: set[bytes] = set()
        while len(received) < len(expected):
            received.add(bytes(sub.get().payload))
        check.same(f"{sub.protocol}: every message delivered", received, expected)
    for peer in subscribers + publishers:
        peer.close()


def test_disconnect_is_a_barrier(broker: RunningBroker, check: Check) -> None:
    """The harness relies on it: after DISCONNECT the broker closes the connection."""
    raw = RawClient(broker.port)
    raw.connect("barrier")
    check.same("closed without a reply", disconnect_and_wait(raw, Disconnect()), [])

"""Maximum packet size (both directions), the pre-CONNECT limit, oversize and malformed packets,
on both brokers as fedtier configures them."""

from __future__ import annotations

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
    kind,
    round_trip,
    sentinel,
    start,
)

from fedtier.embedded_broker.codec import encode_packet
from fedtier.embedded_broker.limits import DEFAULT_LIMITS, KIB, MIB, BrokerLimits
from fedtier.embedded_broker.packets import (
    MQTT_5,
    MQTT_311,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    PingReq,
    PingResp,
    Properties,
    Publish,
)

__all__ = ["broker", "check", "kind", "start"]  # fixtures
pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]
BOTH = pytest.mark.parametrize("protocol", [MQTT_5, MQTT_311], ids=["v5", "v311"])
SMALL = BrokerLimits(max_packet_size=4 * KIB)


def test_the_default_limits_are_fedtiers_safe_ones(broker: RunningBroker, check: Check) -> None:
    check.same("1 MiB packets", broker.limits.max_packet_size, 1 * MIB)
    raw = RawClient(broker.port)
    check.same("announced in CONNACK", raw.connect("limits").properties.maximum_packet_size, 1 * MIB)
    raw.send(Publish("just/under", b"x" * (MIB - 64)))
    raw.send(PingReq())
    check.same("a packet just under the limit is accepted", raw.recv(), PingResp())
    # Only the head of the packet: both brokers refuse on the announced length, and a refusal that races
    # the rest of a 1 MiB body would reset the socket before the DISCONNECT is read (seen under load).
    raw.send_raw(encode_packet(Publish("just/over", b"x" * MIB), raw.protocol)[:64])
    check.same("one just over it is refused", raw.packets_until_closed(), [Disconnect(0x95)])


@BOTH
def test_oversize_publish_disconnects_with_packet_too_large(start: Any, check: Check, protocol: int) -> None:
    broker = start(limits=SMALL)
    raw = RawClient(broker.port, protocol)
    raw.connect("too-big")
    raw.send(Publish("big", b"x" * 5000, qos=1, packet_id=1))
    expected = [Disconnect(0x95)] if protocol == MQTT_5 else []
    check.same("disconnected (v5: 0x95 Packet too large)", raw.packets_until_closed(), expected)
    check.same("the broker still works", round_trip(broker.port), b"still alive")


def test_an_oversize_announcement_is_refused_before_its_body(start: Any, check: Check) -> None:
    broker = start(limits=SMALL)
    raw = RawClient(broker.port)
    raw.connect("announcer")
    raw.send_raw(b"\x30\xff\xff\xff\x7f")  # a PUBLISH of 256 MiB, header only: no body is ever sent
    check.same("refused on the fixed header alone", raw.packets_until_closed(), [Disconnect(0x95)])


def test_paho_learns_the_limit_and_is_disconnected_over_it(start: Any, check: Check) -> None:
    broker = start(limits=SMALL)
    peer = Peer(broker.port).connect()
    check.same("CONNACK Maximum Packet Size", peer.connack_properties.MaximumPacketSize, 4 * KIB)
    peer.client.publish("big", b"x" * 5000, qos=0)
    assert peer.disconnected.wait(WAIT)
    assert peer.disconnect_reason is not None
    check.same("paho sees 0x95", peer.disconnect_reason.value, 0x95)
    peer.client.loop_stop()


def test_the_broker_never_sends_a_v5_client_more_than_its_maximum(broker: RunningBroker, check: Check) -> None:
    small = Peer(broker.port, maximum_packet_size=512).connect()
    large = Peer(broker.port).connect()
    pub = Peer(broker.port).connect()
    for peer in (small, large):
        assert peer.subscribe("sized/#", 1) == [1]
    end = sentinel(small, large)
    pub.publish("sized/big", b"B" * 1000, qos=1)
    pub.publish("sized/small", b"s" * 10, qos=1)
    pub.publish(end, b"", qos=1)
    check.same("the small client gets only what fits [MQTT-3.1.2-25]",
               [m.topic for m in small.collect_until(end)], ["sized/small"])
    check.same("the other client gets both", [m.topic for m in large.collect_until(end)],
               ["sized/big", "sized/small"])
    check.same("the small client stays connected", small.client.is_connected(), True)
    for peer in (small, large, pub):
        peer.close()


def test_a_huge_connect_is_refused_on_its_header(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port)
    raw.send_raw(b"\x10\xff\xff\xff\x7f" + b"\x00" * 65536)  # announces 256 MiB
    check.same("closed without CONNACK", raw.packets_until_closed(), [])


def test_the_pre_connect_limit(broker: RunningBroker, check: Check) -> None:
    props = Properties(user_properties=(("a", "x" * 40_000), ("b", "y" * 40_000)))
    data = encode_packet(Connect("big-connect", properties=props), MQTT_5)
    assert DEFAULT_LIMITS.max_connect_size < len(data) < DEFAULT_LIMITS.max_packet_size  # type: ignore[operator]
    raw = RawClient(broker.port)
    raw.send_raw(data)
    first = raw.recv()
    raw.close()
    check.differs("an 80 KB CONNECT (under max_packet_size, over max_connect_size)",
                  type(first).__name__, {"mosquitto": "ConnAck", "embedded": "NoneType"},
                  spec="MQTT 5 §3.1.4, §4.13 (Mosquitto 2.0 has no separate pre-CONNECT limit)")


_CONNECT = encode_packet(Connect("bad-actor"), MQTT_5)

# label -> (bytes after CONNECT, what Mosquitto 2.0.11 sends before closing, what the embedded broker sends)
MALFORMED: dict[str, tuple[bytes, list[int], list[int]]] = {
    "truncated topic string": (b"\x30\x05\x00\x0aabc", [0x81], [0x81]),
    "PUBLISH with QoS 3": (b"\x36\x05\x00\x01a\x00\x01", [0x81], [0x81]),
    "SUBSCRIBE with wrong fixed-header flags": (b"\x80\x06\x00\x01\x00\x01a\x00", [0x81], [0x81]),
    "topic not UTF-8": (b"\x30\x05\x00\x02\xff\xfe\x00", [0x81], [0x81]),
    "unknown property identifier": (b"\x30\x07\x00\x01a\x02\x7f\x00x", [0x81], [0x81]),
    "property length past the packet": (b"\x30\x05\x00\x01a\x09\x01", [0x81], [0x81]),
    "wildcard in a topic name": (b"\x30\x05\x00\x01#\x00x", [0x82], [0x82]),
    "empty topic name without alias": (encode_packet(Publish("", b"x"), MQTT_5), [0x82], [0x82]),
    "five-byte remaining length": (b"\x30\xff\xff\xff\xff\x01", [], [0x81]),
    "a server-only packet (CONNACK)": (b"\x20\x02\x00\x00", [], [0x81]),
    "AUTH without authentication method": (encode_packet(Auth(0x18), MQTT_5), [], [0x82]),
    "a second CONNECT": (_CONNECT, [], [0x82]),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_malformed_packets_disconnect_only_that_client(broker: RunningBroker, check: Check, kind: str,
                                                       case: str) -> None:
    data, mosquitto_codes, embedded_codes = MALFORMED[case]
    bystander = Peer(broker.port).connect()
    assert bystander.subscribe("calm/#", 1) == [1]
    stalled = RawClient(broker.port)
    stalled.send_raw(_CONNECT.replace(b"bad-actor", b"stalled!!") + b"\x30\x64\x00")
    assert isinstance(stalled.recv(), ConnAck)  # ...and a half-sent PUBLISH it never finishes

    bad = RawClient(broker.port)
    bad.send_raw(_CONNECT + data)
    packets = bad.packets_until_closed()
    check.that("CONNACK, then closed", isinstance(packets[0], ConnAck)
               and all(isinstance(p, Disconnect) for p in packets[1:]), packets)
    codes = [p.reason_code for p in packets[1:] if isinstance(p, Disconnect)]
    check.that("any DISCONNECT carries an error code", all(c >= 0x80 for c in codes), codes)
    if mosquitto_codes == embedded_codes:
        check.same("DISCONNECT reason", codes, embedded_codes)
    else:
        check.differs("DISCONNECT reason", codes, {"mosquitto": mosquitto_codes, "embedded": embedded_codes},
                      spec="MQTT 5 §4.13 (the receiver MAY send DISCONNECT with a reason before closing)")
    check.same("others are served", round_trip(broker.port), b"still alive")
    pub = Peer(broker.port).connect()
    pub.publish("calm/after", b"ok", qos=1)
    check.same("the bystander still receives", bytes(bystander.get().payload), b"ok")
    stalled.close()
    bystander.close()
    pub.close()


def test_topic_aliases(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port)
    raw.connect("alias")
    raw.send(Publish("ta/x", b"x", properties=Properties(topic_alias=1)))
    raw.send(PingReq())
    got = raw.recv()
    check.differs("a PUBLISH with a topic alias", got,
                  {"mosquitto": PingResp(), "embedded": Disconnect(0x94)},
                  spec="MQTT 5 §3.2.2.3.8 (Topic Alias Maximum 0 in CONNACK), [MQTT-3.3.2-9]")
    raw.close()

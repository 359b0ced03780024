"""CONNECT and CONNACK on both brokers: accepted connections, refusals, client ids, malformed CONNECTs."""

from __future__ import annotations

import pytest
from broker_harness import Check, RawClient, RunningBroker, broker, check, kind, raw_connect, start

from fedtier.embedded_broker.packets import MQTT_5, MQTT_311, ConnAck, Disconnect, Properties, Will

__all__ = ["broker", "check", "kind", "start"]  # fixtures
pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]


def answers(broker: RunningBroker, data: bytes, level: int = MQTT_5) -> list[object]:
    """Everything the broker sends back to ``data`` on a fresh socket until it closes."""
    raw = RawClient(broker.port, level, timeout=5.0)
    raw.send_raw(data)
    try:
        return list(raw.packets_until_closed())
    finally:
        raw.close()


def test_connack_of_an_accepted_v5_connect(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port)
    connack = raw.connect("v5-client")
    props = connack.properties
    check.same("reason code", connack.reason_code, 0)
    check.same("session present", connack.session_present, False)
    check.same("maximum packet size announced", props.maximum_packet_size, broker.limits.max_packet_size)
    check.same("receive maximum", props.receive_maximum, 20)
    check.same("maximum QoS (absent = 2)", props.maximum_qos, None)
    check.that("retain available", props.retain_available in (None, 1), props.retain_available)
    check.that("wildcards available", props.wildcard_subscription_available in (None, 1))
    check.that("subscription identifiers available", props.subscription_identifier_available in (None, 1))
    check.same("no assigned id for a given id", props.assigned_client_identifier, None)
    check.differs("topic alias maximum", props.topic_alias_maximum, {"mosquitto": 10, "embedded": 0},
                  spec="MQTT 5 §3.2.2.3.8")
    check.differs("shared subscriptions available", props.shared_subscription_available,
                  {"mosquitto": None, "embedded": 0}, spec="MQTT 5 §3.2.2.3.13, §4.8.2")
    raw.close()


def test_connack_of_an_accepted_v311_connect(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port, MQTT_311)
    connack = raw.connect("v311-client", clean_start=False)
    check.same("return code", connack.reason_code, 0)
    check.same("session present", connack.session_present, False)
    check.same("no properties in 3.1.1", connack.properties, Properties())
    raw.close()


def test_unsupported_protocol_levels_are_refused(broker: RunningBroker, check: Check) -> None:
    for level in (0, 2, 6, 255):
        got = answers(broker, raw_connect(level=level), MQTT_311)
        check.same(f"level {level}: 3.1.1 CONNACK 0x01, then closed", got,
                   [ConnAck(0x01)])
    raw = RawClient(broker.port, MQTT_311)
    raw.send_raw(raw_connect(name=b"MQIsdp", level=3))
    connack = raw.recv()
    raw.close()
    assert isinstance(connack, ConnAck)
    check.differs("MQTT 3.1 (MQIsdp, level 3)", connack.reason_code, {"mosquitto": 0, "embedded": 1},
                  spec="MQTT 3.1.1 §3.1.2.2 (return code 0x01 for an unsupported level)")


def test_unknown_protocol_name_is_closed_without_connack(broker: RunningBroker, check: Check) -> None:
    for name in (b"MQTX", b"mqtt", b"HTTP"):
        check.same(f"protocol name {name!r}", answers(broker, raw_connect(name=name, level=4), MQTT_311), [])


def test_client_identifier_rules(broker: RunningBroker, check: Check) -> None:
    v311 = RawClient(broker.port, MQTT_311)
    connack = v311.connect("", clean_start=False)
    check.same("3.1.1 empty id without clean session: identifier rejected", connack.reason_code, 0x02)
    check.same("... then closed", v311.packets_until_closed(), [])

    v311 = RawClient(broker.port, MQTT_311)
    check.same("3.1.1 empty id with clean session: accepted", v311.connect("", clean_start=True).reason_code, 0)
    v311.close()

    for clean in (True, False):
        v5 = RawClient(broker.port)
        connack = v5.connect("", clean_start=clean)
        assigned = connack.properties.assigned_client_identifier
        check.same(f"v5 empty id (clean_start={clean}): accepted", connack.reason_code, 0)
        check.that(f"v5 empty id (clean_start={clean}): an id is assigned", bool(assigned), assigned)
        check.that("assigned ids start with auto-", str(assigned).startswith("auto-"), assigned)
        v5.close()

    for level in (MQTT_311, MQTT_5):
        long_id = RawClient(broker.port, level)
        check.same(f"level {level}: a 300-character id is accepted",
                   long_id.connect("c" * 300).reason_code, 0)
        long_id.close()


def test_malformed_connects_are_closed_without_connack(broker: RunningBroker, check: Check) -> None:
    cases = {
        "reserved flag (v5)": (raw_connect(flags=0x03), MQTT_5),
        "reserved flag (3.1.1)": (raw_connect(level=4, flags=0x03), MQTT_311),
        "will QoS 3": (raw_connect(level=4, flags=0x1E, payload=b"\x00\x01w\x00\x00"), MQTT_311),
        "will QoS without will flag": (raw_connect(level=4, flags=0x0A), MQTT_311),
        "will retain without will flag": (raw_connect(level=4, flags=0x22), MQTT_311),
        "password without user name (3.1.1)": (raw_connect(level=4, flags=0x42, payload=b"\x00\x01p"), MQTT_311),
        "client id not UTF-8 (3.1.1)": (raw_connect(level=4, client_id=b"\xff\xfe"), MQTT_311),
        "client id not UTF-8 (v5)": (raw_connect(client_id=b"\xff\xfe"), MQTT_5),
        "client id with U+0000": (raw_connect(level=4, client_id=b"a\x00b"), MQTT_311),
        "bytes after the payload": (raw_connect(payload=b"zz"), MQTT_5),
        "truncated client id": (raw_connect(client_id=b"abc")[:-2], MQTT_5),
        "will topic with a wildcard (3.1.1)": (raw_connect(level=4, flags=0x06, payload=b"\x00\x01#\x00\x00"),
                                               MQTT_311),
        "unknown CONNECT property": (raw_connect(properties=b"\x02\x7f\x00"), MQTT_5),
    }
    for label, (data, level) in cases.items():
        if label == "truncated client id":  # the length in the fixed header must still fit
            data = data[:1] + bytes([data[1] - 2]) + data[2:]
        check.same(label, answers(broker, data, level), [])
    got = answers(broker, raw_connect(flags=0x06, payload=b"\x00\x00\x01#\x00\x00"), MQTT_5)
    check.that("will topic with a wildcard (v5): refused",
               all(isinstance(p, ConnAck) and p.reason_code >= 0x80 for p in got), got)
    check.differs("will topic with a wildcard (v5): CONNACK before closing",
                  [p.reason_code for p in got if isinstance(p, ConnAck)],
                  {"mosquitto": [], "embedded": [0x90]}, spec="MQTT 5 §3.2.2.2 (0x90), §4.13.1")


def test_first_packet_must_be_connect(broker: RunningBroker, check: Check) -> None:
    for label, data in {"PUBLISH": b"\x30\x05\x00\x01a\x00x", "PINGREQ": b"\xc0\x00",
                        "SUBSCRIBE": b"\x82\x06\x00\x01\x00\x01a\x00",
                        "an HTTP request": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"}.items():
        check.same(f"{label} before CONNECT: closed", answers(broker, data), [])


def test_second_connect_closes_the_connection(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port)
    check.same("first CONNECT", raw.connect("twice").reason_code, 0)
    raw.send_raw(raw_connect(client_id=b"twice"))
    got = raw.packets_until_closed()
    check.that("no second CONNACK", not any(isinstance(p, ConnAck) for p in got), got)
    check.differs("DISCONNECT before closing", got, {"mosquitto": [], "embedded": [Disconnect(0x82)]},
                  spec="MQTT 5 §3.1.0 [MQTT-3.1.0-2], §4.13.2 (MAY send DISCONNECT)")


def test_enhanced_authentication_is_refused(broker: RunningBroker, check: Check) -> None:
    got = answers(broker, raw_connect(properties=b"\x05\x15\x00\x02xx"))
    check.same("CONNACK 0x8C Bad authentication method, then closed", got, [ConnAck(0x8C)])


def test_v5_password_without_user_name_is_accepted(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port)
    check.same("accepted", raw.connect("pw-only", password=b"secret").reason_code, 0)
    raw.close()


def test_will_properties_and_flags_are_accepted(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port)
    will = Will("will/props", b"bye", qos=2, retain=True,
                properties=Properties(content_type="text/plain", message_expiry_interval=60))
    check.same("will QoS 2, retained, with properties", raw.connect("will-props", will=will).reason_code, 0)
    raw.close()


def test_server_keep_alive_for_a_v5_client_without_keep_alive(broker: RunningBroker, check: Check) -> None:
    raw = RawClient(broker.port)
    connack = raw.connect("no-keep-alive", keep_alive=0)
    check.same("accepted", connack.reason_code, 0)
    check.differs("Server Keep Alive in CONNACK (max_keepalive)", connack.properties.server_keep_alive,
                  {"mosquitto": 65535, "embedded": 300},
                  spec="§3.2.2.3.14 (the Server may impose its own Keep Alive); Mosquitto's default "
                       "max_keepalive is 65535, fedtier's 300 s")
    raw.close()

"""ACL refusals on both brokers, from the same ``acl_file`` text (Mosquitto's format).

The user name is the one the client sends in CONNECT: these brokers run without passwords or
TLS, so the tests exercise the rules, not authentication (fedtier's secure setup ties the user
name to the certificate, which only Mosquitto offers; docs/broker.md).
"""

from __future__ import annotations

from typing import Any

import pytest
from broker_harness import Check, Peer, RawClient, RunningBroker, check, kind, sentinel, start

from fedtier.embedded_broker.packets import (
    MQTT_5,
    MQTT_311,
    PingReq,
    PingResp,
    PubAck,
    Publish,
    PubRec,
    SubAck,
    Subscribe,
    SubscriptionOptions,
    Will,
)
from provisioning.broker_config import cell_acl

__all__ = ["check", "kind", "start"]  # fixtures
pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]

ACL = """\
# clients without a user name
topic read pub/#
topic write anon/#
# everyone, by name
pattern readwrite own/%u/#
pattern write hello/%c
# the tests' sentinels (broker_harness.sentinel)
pattern readwrite sentinel/#

user alice
topic readwrite alice/#
topic read shared/#
topic deny alice/secret/#
topic readwrite will/alice
topic read elsewhere/#
"""


@pytest.fixture
def acl_broker(start: Any) -> RunningBroker:
    return start(acl=ACL)  # type: ignore[no-any-return]


def connected(broker: RunningBroker, client_id: str, username: str | None = None,
              protocol: int = MQTT_5, **fields: Any) -> RawClient:
    raw = RawClient(broker.port, protocol)
    assert raw.connect(client_id, username=username, **fields).reason_code == 0
    return raw


def quiet(raw: RawClient) -> list[Any]:
    """Packets that arrive before the answer to a PINGREQ (nothing pending: [])."""
    raw.send(PingReq())
    got = []
    while not isinstance(packet := raw.recv(), PingResp):
        got.append(packet)
    return got


def test_publish_refusals(acl_broker: RunningBroker, check: Check) -> None:
    anon = connected(acl_broker, "anon")
    anon.send(Publish("alice/x", b"denied", qos=1, packet_id=1))
    check.same("v5 QoS 1 denied: PUBACK 0x87 Not authorized", anon.recv(), PubAck(1, 0x87))
    anon.send(Publish("alice/x", b"denied", qos=2, packet_id=2))
    check.same("v5 QoS 2 denied: PUBREC 0x87", anon.recv(), PubRec(2, 0x87))
    anon.send(Publish("anon/x", b"ok", qos=1, packet_id=3))
    check.same("allowed (no subscriber): 0x10", anon.recv(), PubAck(3, 0x10))
    v311 = connected(acl_broker, "anon-v311", protocol=MQTT_311)
    v311.send(Publish("alice/x", b"denied", qos=1, packet_id=4))
    check.same("3.1.1 denied: a plain PUBACK, nothing else to say", v311.recv(), PubAck(4))
    for raw in (anon, v311):
        raw.close()


def test_denied_messages_are_not_delivered(acl_broker: RunningBroker, check: Check) -> None:
    alice = Peer(acl_broker.port, "alice-1", username="alice").connect()
    check.same("SUBSCRIBE is granted even where reading is not (acl_file checks delivery)",
               alice.subscribe("#", 1), [1])
    end = sentinel(alice)
    anon = Peer(acl_broker.port, "anon-pub").connect()
    bob = Peer(acl_broker.port, "bob-1", username="bob").connect()
    anon.publish("alice/from-anon", b"denied write", qos=1)
    anon.publish("anon/x", b"alice may not read", qos=0)
    alice.publish("alice/secret/plan", b"denied by a deny rule", qos=1)
    alice.publish("alice/notes", b"mine", qos=1)
    bob.publish("own/bob/1", b"bob's own", qos=1)
    alice.publish(end, b"", qos=1)
    check.same("alice receives only what she may read and others may write",
               [(m.topic, bytes(m.payload)) for m in alice.collect_until(end)], [("alice/notes", b"mine")])
    for peer in (alice, anon, bob):
        peer.close()


def test_patterns_substitute_user_name_and_client_id(acl_broker: RunningBroker, check: Check) -> None:
    bob = connected(acl_broker, "bob-2", "bob")
    bob.send(Subscribe(1, (("own/#", SubscriptionOptions(qos=1)),)))
    assert bob.recv() == SubAck(1, (1,))
    bob.send(Publish("own/bob/x", b"mine", qos=1, packet_id=2))
    got = quiet(bob)
    check.same("%u: own topics are read and written",
               sorted(type(p).__name__ for p in got), ["PubAck", "Publish"])
    bob.send(Publish("own/carol/x", b"not mine", qos=1, packet_id=3))
    check.same("%u: another user's topic is denied", bob.recv(), PubAck(3, 0x87))
    bob.send(Publish("hello/bob-2", b"hi", qos=1, packet_id=4))
    check.same("%c: the client id's topic", bob.recv(), PubAck(4, 0x10))
    bob.send(Publish("hello/someone-else", b"hi", qos=1, packet_id=5))
    check.same("%c: another client id's topic is denied", bob.recv(), PubAck(5, 0x87))
    anon = connected(acl_broker, "anon-2")
    anon.send(Publish("own/None/x", b"?", qos=1, packet_id=6))
    check.same("%u never matches a client without a user name", anon.recv(), PubAck(6, 0x87))
    for raw in (bob, anon):
        raw.close()


def test_retained_messages_obey_read_rules(acl_broker: RunningBroker, check: Check) -> None:
    alice = connected(acl_broker, "alice-2", "alice")
    alice.send(Publish("alice/kept", b"retained", qos=1, retain=True, packet_id=1))
    assert alice.recv() == PubAck(1, 0x10)
    anon = connected(acl_broker, "anon-3")
    anon.send(Subscribe(1, (("alice/#", SubscriptionOptions(qos=1)),)))
    check.same("no retained message for a reader without access", quiet(anon), [SubAck(1, (1,))])
    reader = connected(acl_broker, "alice-3", "alice")
    reader.send(Subscribe(1, (("alice/#", SubscriptionOptions(qos=1)),)))
    got = quiet(reader)
    check.same("... but for one with access", [getattr(p, "payload", None) for p in got], [None, b"retained"])
    for raw in (alice, anon, reader):
        raw.close()


def test_wills_obey_write_rules(acl_broker: RunningBroker, check: Check) -> None:
    watcher = Peer(acl_broker.port, "alice-watch", username="alice").connect()
    assert watcher.subscribe("#", 1) == [1]
    end = sentinel(watcher)
    denied = connected(acl_broker, "w1", "alice", will=Will("elsewhere/will", b"x"))
    denied.close()
    allowed = connected(acl_broker, "w2", "alice", will=Will("will/alice", b"gone"))
    allowed.close()
    message = watcher.get()
    check.same("an allowed will is published", (message.topic, bytes(message.payload)), ("will/alice", b"gone"))
    Peer(acl_broker.port, "alice-end", username="alice").connect().publish(end, b"", qos=1)
    check.same("a will to a topic the client may not write is dropped", watcher.collect_until(end), [])
    watcher.close()


def test_fedtiers_cell_acl(start: Any, check: Check) -> None:
    """The ACL provisioning writes for a cell, applied to device and gateway connections."""
    broker = start(acl=cell_acl("cell-a") + "pattern readwrite sentinel/#\n")
    up, down = "ft/v1/r1/cell/cell-a/up", "ft/v1/r1/cell/cell-a/down"
    gateway = Peer(broker.port, "cell-a", username="cell-a").connect()
    assert gateway.subscribe(f"{up}/#", 1) == [1]
    assert gateway.subscribe("ft/v1/status/cell-a/+", 1) == [1]
    device = Peer(broker.port, "dev-0", username="dev-0").connect()
    assert device.subscribe(f"{down}/#", 1) == [1]
    end = sentinel(gateway, device)
    check.same("a device writes its own uplink", device.publish(f"{up}/dev-0/update", b"u0", qos=1), 0)
    check.same("... not another device's", device.publish(f"{up}/dev-1/update", b"forged", qos=1), 0x87)
    check.same("... nor the downlink", device.publish(f"{down}/task", b"forged", qos=1), 0x87)
    check.same("the gateway writes the downlink", gateway.publish(f"{down}/task", b"t", qos=1), 0)
    check.same("a device writes its presence", device.publish("ft/v1/status/dev-0", b"{}", qos=1), 0x10)
    check.same("... not another node's", device.publish("ft/v1/status/cell-a", b"{}", qos=1), 0x87)
    check.same("a device writes its presence in its cell", device.publish("ft/v1/status/cell-a/dev-0", b"on", qos=1), 0)
    check.same("... not another device's", device.publish("ft/v1/status/cell-a/dev-1", b"{}", qos=1), 0x87)
    check.same("... nor in another cell", device.publish("ft/v1/status/cell-b/dev-0", b"{}", qos=1), 0x87)
    gateway.publish(end, b"", qos=1)
    check.same("the gateway reads the device's uplink and its presence",
               [(m.topic, bytes(m.payload)) for m in gateway.collect_until(end)],
               [(f"{up}/dev-0/update", b"u0"), ("ft/v1/status/cell-a/dev-0", b"on")])
    check.same("the device reads the downlink", [bytes(m.payload) for m in device.collect_until(end)], [b"t"])
    gateway.close()
    device.close()

"""The MQTT transport against a real Mosquitto: size limits, presence, durability of delivery."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from conftest import free_port, start_mosquitto
from mqtt_helpers import RawClient
from paho.mqtt.enums import CallbackAPIVersion

from fedtier import wire
from fedtier.transport import topics
from fedtier.transport.base import Inbound
from fedtier.transport.mqtt import MqttTransport

pytestmark = pytest.mark.broker
TOPIC = "ft/v1/t/cell/cell-a/up/dev-0/device_update"


def transport(broker, client_id: str, inbox: queue.Queue | None = None, **kw) -> MqttTransport:
    tx = MqttTransport(name=client_id, client_id=client_id, host=broker.host, port=broker.port,
                       inbox=inbox if inbox is not None else queue.Queue(), **kw)
    tx.start()
    assert tx.wait_connected(10), f"{client_id} did not connect"
    return tx


def big_envelope(n_floats: int) -> bytes:
    rng = np.random.default_rng(0)
    env = wire.Envelope(type="device_update", rollout="t", round=0, sender="dev-0", key="k",
                        tensors={"w": rng.normal(size=n_floats).astype(np.float32)})
    return wire.encode(env)


def receive(inbox: queue.Queue, timeout: float = 10.0) -> Inbound:
    item = inbox.get(timeout=timeout)
    item.confirm()
    return item



def wait_for(predicate, timeout: float = 10.0) -> None:  # noqa: ANN001
    """Until ``predicate()`` holds (the harness's sentinel, instead of a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)

def test_payload_over_the_broker_limit_is_chunked_and_arrives_intact(mosquitto_factory) -> None:
    # Prepare: a broker that refuses packets over 16 KiB, and a ~400 KB message.
    broker = mosquitto_factory(max_packet_size=16384)
    payload = big_envelope(100_000)
    inbox: queue.Queue = queue.Queue()
    rx = transport(broker, "rx", inbox)
    rx.subscribe(TOPIC)
    tx = transport(broker, "tx")
    wait_for(rx.subscribed)
    try:
        # Execute
        tx.publish(TOPIC, payload)
        got = receive(inbox, 20)
    finally:
        tx.stop()
        rx.stop()
    # Assert: learned the limit from CONNACK, split into many packets, reassembled byte-identical.
    assert tx.broker_max_packet == 16384
    assert tx.traffic.messages[("out", "cell_up")] >= len(payload) // 16384
    assert got.topic == TOPIC and got.payload == payload and got.error is None
    assert "oversize" not in broker.log_text().lower()


def test_the_broker_really_drops_an_unchunked_oversize_publish(mosquitto_factory) -> None:
    # Control for the test above: without chunking, the same message gets the client disconnected.
    broker = mosquitto_factory(max_packet_size=16384)
    disconnected: queue.Queue = queue.Queue()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="naive", protocol=mqtt.MQTTv5)
    c.on_disconnect = lambda *a: disconnected.put(a[3])
    c.connect(broker.host, broker.port)
    c.loop_start()
    try:
        c.publish(TOPIC, big_envelope(100_000), qos=1)
        reason = disconnected.get(timeout=10)
    finally:
        c.loop_stop()
    assert reason.is_failure


def test_publish_before_the_broker_is_up_is_delivered_after_connect(tmp_path: Path) -> None:
    port = free_port()
    inbox_unused: queue.Queue = queue.Queue()
    tx = MqttTransport(name="early", client_id="early", host="127.0.0.1", port=port, inbox=inbox_unused,
                       reconnect_max_s=1)
    tx.start()
    done: queue.Queue = queue.Queue()
    tx.publish(TOPIC, b"hello", on_done=done.put)  # nothing listens yet: queued locally
    broker = start_mosquitto(tmp_path / "late", port=port)
    rx = RawClient(broker.host, broker.port, "late-rx")
    try:
        rx.subscribe(TOPIC)
        assert tx.wait_connected(15)
        assert done.get(timeout=10) is True
    finally:
        tx.stop()
        rx.close()
        broker.stop()


def test_presence_online_then_offline_on_clean_stop_and_via_will_on_crash(mosquitto) -> None:
    watcher = RawClient(mosquitto.host, mosquitto.port, "watcher")
    watcher.subscribe(topics.ALL_STATUS)
    clean = transport(mosquitto, "dev-clean", status={"node": "dev-clean", "role": "device"})
    crash = transport(mosquitto, "dev-crash", status={"node": "dev-crash", "role": "device"})
    try:
        states: dict[str, list[str]] = {}

        def collect(until: tuple[str, str], timeout: float = 10) -> None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    topic, payload = watcher.messages.get(timeout=0.1)
                except queue.Empty:
                    continue
                node = topic.rsplit("/", 1)[-1]
                states.setdefault(node, []).append(json.loads(payload)["state"])
                if states.get(until[0], [])[-1:] == [until[1]]:
                    return
            raise AssertionError(f"no {until} in {states}")

        collect(("dev-crash", "online"))
        clean.stop()
        collect(("dev-clean", "offline"))
        # A crash: the socket goes away without DISCONNECT; the broker publishes the will.
        crash.client.loop_stop()
        crash.client.socket().close()
        collect(("dev-crash", "offline"), timeout=15)
        assert states["dev-clean"][0] == "online"
    finally:
        watcher.close()


def test_a_devices_presence_on_its_cell_topic_and_a_takeover_of_its_id_is_seen_as_a_lost_session(mosquitto) -> None:
    """A device announces itself under its cell (will included); a client that takes its id for a moment makes
    the transport reconnect without its session (``connects``, ``session_present``: what a node reads to ask
    again for what it is owed)."""
    watcher = RawClient(mosquitto.host, mosquitto.port, "watcher")
    watcher.subscribe(topics.ALL_CELL_STATUS)
    own = topics.cell_status("cell-a", "dev-c")
    tx = transport(mosquitto, "dev-c", status={"node": "dev-c", "role": "device", "cell": "cell-a"}, status_topic=own)
    try:
        topic, payload = watcher.wait_for(own)
        assert json.loads(payload)["state"] == "online" and tx.connects == 1 and tx.session_present is False
        intruder = RawClient(mosquitto.host, mosquitto.port, "dev-c")  # a clean session under the device's id
        time.sleep(0.3)
        intruder.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (tx.connects == 2 and tx.connected):
            time.sleep(0.05)
        assert tx.connects == 2 and tx.session_present is False
        # A crash: the will goes to the cell's topic too.
        tx.client.loop_stop()
        tx.client.socket().close()
        states = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and states[-1:] != ["offline"]:
            topic, payload = watcher.wait_for(own)
            states.append(json.loads(payload)["state"])
        assert states[-1:] == ["offline"]
    finally:
        watcher.close()


def test_a_message_not_confirmed_before_a_crash_is_delivered_again(mosquitto) -> None:
    # Prepare: a persistent-session receiver that takes a message but crashes before confirming it.
    inbox: queue.Queue = queue.Queue()
    rx = transport(mosquitto, "durable-rx", inbox, session_expiry_s=600)
    rx.subscribe(TOPIC)
    wait_for(rx.subscribed)
    sender = RawClient(mosquitto.host, mosquitto.port, "sender")
    sender.publish(TOPIC, b"important")
    first = inbox.get(timeout=10)
    assert first.payload == b"important"
    rx.client.loop_stop()
    rx.client.socket().close()  # crash: no PUBACK was sent, no DISCONNECT
    time.sleep(0.5)
    # Execute: the same node comes back.
    inbox2: queue.Queue = queue.Queue()
    rx2 = transport(mosquitto, "durable-rx", inbox2, session_expiry_s=600)
    try:
        again = receive(inbox2, 10)
    finally:
        rx2.stop()
        sender.close()
    # Assert
    assert again.payload == b"important"


def test_reconnects_and_resubscribes_after_the_broker_restarts(tmp_path: Path) -> None:
    # Prepare: a subscriber connected to a broker that then dies (no persistence: sessions lost).
    first = start_mosquitto(tmp_path / "b1")
    inbox: queue.Queue = queue.Queue()
    rx = MqttTransport(name="rx", client_id="resilient", host=first.host, port=first.port, inbox=inbox,
                       reconnect_max_s=1)
    rx.subscribe(TOPIC)
    rx.start()
    assert rx.wait_connected(10)
    first.stop()
    deadline = time.monotonic() + 10
    while rx.connected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rx.connected
    # Execute: a new broker on the same port.
    second = start_mosquitto(tmp_path / "b2", port=first.port)
    sender = None
    try:
        assert rx.wait_connected(15)
        sender = RawClient(second.host, second.port, "sender2")
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:  # until the resubscription is in place
            sender.publish(TOPIC, b"after restart")
            try:
                got = receive(inbox, 0.5)
            except queue.Empty:
                pass
    finally:
        rx.stop()
        if sender:
            sender.close()
        second.stop()
    # Assert
    assert got is not None and got.payload == b"after restart"

"""The fleet emulator's multiplexed host (``local_fleet/mux.py``) against a real Mosquitto:
many transports on one thread receive in order, acknowledge after handling, publish, and come back
after the broker restarts. The node is a recorder here (nodes are tested elsewhere); the transports,
the broker and the loop are real."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from conftest import start_mosquitto

from local_fleet.mux import MuxHost
from fedtier.transport.mqtt import MqttTransport

pytestmark = pytest.mark.broker


class Recorder:
    """Subscribes to its own topic; answers each message on ``echo/<name>``; ticks are counted."""

    def __init__(self, name: str, tx: MqttTransport) -> None:
        self.name, self.tx = name, tx
        self.got: list[bytes] = []
        self.ticks = 0

    def start(self, now: float) -> None:
        self.tx.subscribe(f"to/{self.name}")

    def handle(self, inbound: Any, now: float) -> None:
        self.got.append(inbound.payload)
        self.tx.publish(f"echo/{self.name}", inbound.payload)

    def tick(self, now: float) -> None:
        self.ticks += 1


def _wait(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_fifty_devices_on_one_thread_receive_answer_and_survive_a_broker_restart(tmp_path: Path) -> None:
    broker = start_mosquitto(tmp_path / "b1")
    mux = MuxHost()
    nodes = []
    for i in range(50):
        inbox: queue.Queue = queue.Queue()
        tx = MqttTransport(name="cell", client_id=f"dev-{i:02d}", host=broker.host, port=broker.port, inbox=inbox,
                           reconnect_max_s=1)
        node = Recorder(f"dev-{i:02d}", tx)
        mux.add(node.name, node, tx, inbox)
        nodes.append(node)
    stop = threading.Event()
    runner = threading.Thread(target=mux.run, args=(stop.is_set,), daemon=True)
    runner.start()
    echoes: list[str] = []
    probe = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="probe", protocol=paho.MQTTv5)
    probe.on_message = lambda c, u, m: echoes.append(f"{m.topic}:{m.payload.decode()}")
    try:
        probe.connect(broker.host, broker.port)
        probe.subscribe("echo/#", qos=1)
        probe.loop_start()
        _wait(lambda: all(n.tx.subscribed() for n in nodes))
        for n in nodes:
            for k in range(3):
                probe.publish(f"to/{n.name}", f"m{k}".encode(), qos=1)
        _wait(lambda: all(len(n.got) == 3 for n in nodes))
        assert all(n.got == [b"m0", b"m1", b"m2"] for n in nodes)  # in order, once each
        _wait(lambda: len(echoes) == 150)
        assert all(n.ticks > 0 for n in nodes)

        # Execute: the broker dies and comes back on the same port; the loop reconnects every device.
        probe.loop_stop()
        broker.proc.kill()
        broker.proc.wait(10)
        _wait(lambda: not any(n.tx.connected for n in nodes))
        broker = start_mosquitto(tmp_path / "b2", port=broker.port)
        _wait(lambda: all(n.tx.subscribed() for n in nodes), timeout=60)
        probe = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="probe2", protocol=paho.MQTTv5)
        probe.connect(broker.host, broker.port)
        probe.loop_start()
        for n in nodes:
            probe.publish(f"to/{n.name}", b"after", qos=1)
        _wait(lambda: all(n.got[-1:] == [b"after"] for n in nodes))
        assert mux.errors() == []
    finally:
        stop.set()
        runner.join(10)
        mux.close()
        probe.loop_stop()
        broker.stop()

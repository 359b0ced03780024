"""Raw MQTT clients and hand-crafted bad envelopes for integration tests."""

from __future__ import annotations

import hashlib
import queue
import struct
import time
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from fedtier import wire


class RawClient:
    """A plain paho MQTT 5 client: publish anything, collect what arrives on subscriptions."""

    def __init__(self, host: str, port: int, client_id: str) -> None:
        self.messages: "queue.Queue[tuple[str, bytes]]" = queue.Queue()
        self._subacks: "queue.Queue[int]" = queue.Queue()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self.client.on_message = lambda c, u, m: self.messages.put((m.topic, bytes(m.payload)))
        self.client.on_subscribe = lambda c, u, mid, codes, p: self._subacks.put(mid)
        self.client.connect(host, port)
        self.client.loop_start()

    def subscribe(self, topic_filter: str, timeout: float = 10.0) -> None:
        """Subscribe, and return once the broker's SUBACK says the subscription is in place."""
        result, mid = self.client.subscribe(topic_filter, qos=1)
        assert result == mqtt.MQTT_ERR_SUCCESS
        try:
            while self._subacks.get(timeout=timeout) != mid:
                pass
        except queue.Empty:
            raise AssertionError(f"no SUBACK for {topic_filter} within {timeout}s") from None

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(5)

    def wait_for(self, topic_prefix: str, timeout: float = 20.0) -> tuple[str, bytes]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                topic, payload = self.messages.get(timeout=0.1)
            except queue.Empty:
                continue
            if topic.startswith(topic_prefix):
                return topic, payload
        raise AssertionError(f"nothing arrived on {topic_prefix} within {timeout}s")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _split(payload: bytes) -> tuple[dict[str, Any], bytearray]:
    _, _, hlen = struct.unpack_from(">4sBI", payload, 0)
    header = msgpack.unpackb(payload[9:9 + hlen], raw=False)
    return header, bytearray(payload[9 + hlen:])


def _join(header: dict[str, Any], body: bytes) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">4sBI", wire.MAGIC, wire.SCHEMA_VERSION, len(packed)) + packed + bytes(body)


def with_nan(payload: bytes) -> bytes:
    """A valid envelope whose first float is NaN, with a *correct* sha256 (so only the NaN check can catch it)."""
    header, body = _split(payload)
    body[0:4] = struct.pack("<f", float("nan"))
    header.pop("dg", None), header.pop("dv", None)  # resealed with sha256, which every receiver reads
    header["sha"] = hashlib.sha256(body).digest()
    return _join(header, body)


def with_flipped_byte(payload: bytes) -> bytes:
    """A valid envelope with one body byte changed and the old sha256 (a corrupted transfer)."""
    data = bytearray(payload)
    data[-1] ^= 0xFF
    return bytes(data)

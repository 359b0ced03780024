"""fedtier.transport.memory: deterministic in-memory broker (FIFO, retained, chunking, traffic)."""

from __future__ import annotations

import numpy as np
import pytest

from fedtier.errors import TransportError
from fedtier.transport import chunking, topics
from fedtier.transport.base import Inbound
from fedtier.transport.memory import MemoryBroker
from fedtier.wire.messages import DeviceUpdate, decode_message, messages_equal

UP = topics.cell_up("r1", "c1", "d1", "device_update")
DOWN = topics.cell_down("r1", "c1", "device_task")
MANIFEST = topics.cell_manifest("r1", "c1")


def recorder() -> tuple[list[Inbound], object]:
    got: list[Inbound] = []
    return got, got.append


def big_update(n: int = 3000) -> DeviceUpdate:
    return DeviceUpdate(rollout="r1", round=1, sender="d1", delta={"w": np.linspace(-1, 1, n, dtype=np.float32)},
                        num_samples=10, train_loss=0.5, steps=3)


def test_fifo_delivery_in_publish_order() -> None:
    # Prepare
    broker = MemoryBroker()
    got, handler = recorder()
    edge = broker.connect("edge", handler)  # type: ignore[arg-type]
    edge.subscribe(topics.cell_up_filter("c1"))
    device = broker.connect("d1")

    # Execute
    for i in range(5):
        device.publish(UP, f"m{i}".encode())
    delivered = broker.run_until_idle()

    # Assert
    assert delivered == 5
    assert [g.payload for g in got] == [b"m0", b"m1", b"m2", b"m3", b"m4"]
    assert all(g.topic == UP and g.source == "edge" and g.error is None for g in got)


def test_nothing_is_delivered_before_run_until_idle() -> None:
    broker = MemoryBroker()
    got, handler = recorder()
    broker.connect("edge", handler).subscribe("#")  # type: ignore[arg-type]

    broker.connect("d1").publish(UP, b"x")

    assert got == []
    assert broker.run_until_idle() == 1
    assert broker.run_until_idle() == 0


def test_messages_published_by_handlers_queue_behind_earlier_ones() -> None:
    # Prepare: the edge answers every uplink with a downlink; a device records downlinks.
    broker = MemoryBroker()
    order: list[bytes] = []
    edge = broker.connect("edge")
    edge.set_handler(lambda m: (order.append(m.payload), edge.publish(DOWN, b"re:" + m.payload)))
    edge.subscribe(topics.cell_up_filter("c1"))
    device = broker.connect("d1", lambda m: order.append(m.payload))
    device.subscribe(topics.cell_down_filter("c1"))

    # Execute
    device.publish(UP, b"a")
    device.publish(UP, b"b")
    broker.run_until_idle()

    # Assert: both uplinks first (they were queued first), then the replies in order.
    assert order == [b"a", b"b", b"re:a", b"re:b"]


def test_only_matching_subscribers_receive() -> None:
    broker = MemoryBroker()
    got1, h1 = recorder()
    got2, h2 = recorder()
    broker.connect("edge-c1", h1).subscribe(topics.cell_up_filter("c1"))  # type: ignore[arg-type]
    broker.connect("edge-c2", h2).subscribe(topics.cell_up_filter("c2"))  # type: ignore[arg-type]

    broker.connect("d1").publish(UP, b"x")
    broker.run_until_idle()

    assert [g.payload for g in got1] == [b"x"]
    assert got2 == []


def test_subscribers_of_a_topic_are_served_in_connection_order_and_a_closed_one_is_not() -> None:
    # Prepare: three subscribers of the cell's uplink, subscribing in the reverse of their connection order.
    broker = MemoryBroker()
    order: list[str] = []
    nodes = [broker.connect(name, lambda inbound, name=name: order.append(name))  # type: ignore[misc]
             for name in ("first", "second", "third")]
    for node in reversed(nodes):
        node.subscribe(topics.cell_up_filter("c1"))
    device = broker.connect("d1")

    # Execute: one message, then another after the second subscriber left.
    device.publish(UP, b"x")
    broker.run_until_idle()
    nodes[1].close()
    device.publish(UP, b"y")
    broker.run_until_idle()

    # Assert
    assert order == ["first", "second", "third", "first", "third"]


def test_subscribing_twice_does_not_duplicate_delivery() -> None:
    broker = MemoryBroker()
    got, handler = recorder()
    edge = broker.connect("edge", handler)  # type: ignore[arg-type]
    edge.subscribe("#")
    edge.subscribe("#")

    broker.connect("d1").publish(UP, b"x")
    broker.run_until_idle()

    assert len(got) == 1


def test_retained_message_reaches_a_late_subscriber() -> None:
    # Prepare
    broker = MemoryBroker()
    edge = broker.connect("edge")
    edge.publish(MANIFEST, b"v1", retain=True)
    edge.publish(MANIFEST, b"v2", retain=True)  # replaces v1
    broker.run_until_idle()
    got, handler = recorder()

    # Execute: a device subscribes afterwards.
    broker.connect("d1", handler).subscribe(topics.cell_down_filter("c1"))  # type: ignore[arg-type]
    broker.run_until_idle()

    # Assert
    assert [(g.topic, g.payload) for g in got] == [(MANIFEST, b"v2")]


def test_empty_retained_payload_clears_it() -> None:
    broker = MemoryBroker()
    edge = broker.connect("edge")
    edge.publish(MANIFEST, b"v1", retain=True)
    edge.publish(MANIFEST, b"", retain=True)
    broker.run_until_idle()
    got, handler = recorder()

    broker.connect("d1", handler).subscribe(topics.cell_down_filter("c1"))  # type: ignore[arg-type]
    broker.run_until_idle()

    assert got == []


def test_non_retained_messages_are_not_kept() -> None:
    broker = MemoryBroker()
    broker.connect("edge").publish(MANIFEST, b"v1")
    broker.run_until_idle()
    got, handler = recorder()

    broker.connect("d1", handler).subscribe("#")  # type: ignore[arg-type]
    broker.run_until_idle()

    assert got == []


def test_large_envelope_is_chunked_and_arrives_whole() -> None:
    # Prepare: a broker limit far below the message size.
    broker = MemoryBroker(max_payload=1024)
    got, handler = recorder()
    edge = broker.connect("edge", handler)  # type: ignore[arg-type]
    edge.subscribe(topics.cell_up_filter("c1"))
    device = broker.connect("d1")
    msg = big_update()
    payload = msg.encode()
    assert len(payload) > 10 * 1024

    # Execute
    sent = device.publish(UP, payload)
    broker.run_until_idle()

    # Assert: one whole message for the node, many chunks on the wire.
    assert len(got) == 1
    assert got[0].payload == payload
    assert got[0].error is None
    assert messages_equal(decode_message(got[0].payload), msg)
    out_msgs = device.traffic.messages[("out", "cell_up")]
    assert out_msgs > 1
    assert edge.traffic.messages[("in", "cell_up")] == out_msgs
    assert sent == device.traffic.bytes[("out", "cell_up")] > len(payload)  # chunk headers cost bytes
    assert got[0].size_on_wire == sent == edge.traffic.bytes[("in", "cell_up")]


def test_confirm_forgets_the_reassembled_message() -> None:
    broker = MemoryBroker(max_payload=1024)
    edge = broker.connect("edge", lambda m: None)
    edge.subscribe("#")

    broker.connect("d1").publish(UP, big_update().encode())
    broker.run_until_idle()

    assert edge.reassembler.store.pending_bytes() == 0
    assert edge.pending_complete() == []


def test_small_envelope_is_not_chunked() -> None:
    broker = MemoryBroker(max_payload=1 << 20)
    got, handler = recorder()
    broker.connect("edge", handler).subscribe("#")  # type: ignore[arg-type]
    device = broker.connect("d1")
    payload = big_update(10).encode()

    device.publish(UP, payload)
    broker.run_until_idle()

    assert [g.payload for g in got] == [payload]
    assert device.traffic.messages[("out", "cell_up")] == 1


def test_non_envelope_payload_over_the_limit_is_refused() -> None:
    broker = MemoryBroker(max_payload=1024)

    with pytest.raises(ValueError):
        broker.connect("d1").publish(UP, b"{" + b" " * 2000 + b"}")


def test_traffic_bytes_in_equal_bytes_out() -> None:
    # Prepare: mixed small, chunked and non-envelope traffic in both directions.
    broker = MemoryBroker(max_payload=1024)
    edge = broker.connect("edge", lambda m: None)
    edge.subscribe(topics.cell_up_filter("c1"))
    device = broker.connect("d1", lambda m: None)
    device.subscribe(topics.cell_down_filter("c1"))

    # Execute
    device.publish(UP, big_update().encode())
    device.publish(UP, big_update(5).encode())
    edge.publish(DOWN, b"plain")
    edge.publish(DOWN, big_update(2000).encode())
    broker.run_until_idle()

    # Assert: every byte sent is received by the single subscriber, per channel.
    assert device.traffic.bytes[("out", "cell_up")] == edge.traffic.bytes[("in", "cell_up")] > 0
    assert edge.traffic.bytes[("out", "cell_down")] == device.traffic.bytes[("in", "cell_down")] > 0
    assert device.traffic.messages[("out", "cell_up")] == edge.traffic.messages[("in", "cell_up")]
    assert device.traffic.snapshot() == {
        "in.cell_down": edge.traffic.bytes[("out", "cell_down")],
        "out.cell_up": edge.traffic.bytes[("in", "cell_up")],
    }


def test_traffic_on_foreign_topics_is_counted_as_other() -> None:
    broker = MemoryBroker()
    node = broker.connect("n")

    node.publish("some/other/topic", b"abc")

    assert node.traffic.bytes[("out", "other")] == 3


def test_a_contradicting_chunk_is_reported_as_an_error_inbound() -> None:
    # Prepare: chunk 0 of one message, then chunk 1 of another message under the same key.
    broker = MemoryBroker()
    got, handler = recorder()
    edge = broker.connect("edge", handler)  # type: ignore[arg-type]
    edge.subscribe("#")
    device = broker.connect("d1")
    a = chunking.split(big_update().encode(), 1024)
    b = chunking.split(DeviceUpdate(rollout="r1", round=1, sender="d1", delta={"w": np.zeros(3000, np.float32)},
                                    num_samples=10, train_loss=0.5, steps=3).encode(), 1024)

    # Execute: publish the raw chunks (they fit, so they are not split again).
    device.publish(UP, a[0])
    device.publish(UP, b[1])
    broker.run_until_idle()

    # Assert
    assert len(got) == 1
    assert got[0].payload == b""
    assert got[0].error is not None and got[0].error.reason == "chunk"


def test_a_retained_envelope_reaches_a_late_subscriber_whole_and_one_needing_chunks_is_refused() -> None:
    """A retained message that needs chunking: the broker retains one payload per topic, so
    each chunk would overwrite the previous one and a late subscriber would get only the last
    chunk, never the message. ``publish`` refuses it before any chunk goes out (as the MQTT
    transport does): the envelope retained before stays, and a late subscriber gets that one whole."""
    # Prepare: a retained envelope that fits under the limit, then one that needs chunks.
    broker = MemoryBroker(max_payload=1024)
    edge = broker.connect("edge")
    fits = big_update(10).encode()
    payload = big_update().encode()
    assert len(fits) <= 1024 < len(payload)
    edge.publish(MANIFEST, fits, retain=True)

    # Execute
    with pytest.raises(TransportError, match="retained messages are not chunked"):
        edge.publish(MANIFEST, payload, retain=True)
    broker.run_until_idle()
    got, handler = recorder()
    broker.connect("d1", handler).subscribe(topics.cell_down_filter("c1"))  # type: ignore[arg-type]
    broker.run_until_idle()

    # Assert: the late subscriber got the retained envelope whole, no chunk of the refused one.
    assert [g.payload for g in got] == [fits]
    assert got[0].error is None

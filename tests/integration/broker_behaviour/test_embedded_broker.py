"""What only the embedded broker has: its limits beyond Mosquitto's options (per-address
connections, the byte budget, the output backlog), its command line, its codec, its API.

Everything both brokers do is asserted in the other modules of this directory, against both.
"""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from broker_harness import HOST, WAIT, Peer, RawClient, round_trip, varint
from conftest import free_port, wait_port

from fedtier.embedded_broker import EmbeddedBroker
from fedtier.embedded_broker.acl import AccessList
from fedtier.embedded_broker.codec import PacketFramer, decode_packet, encode_packet
from fedtier.embedded_broker.limits import KIB, MIB, BrokerLimits
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
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    SubscriptionOptions,
    UnsubAck,
    Unsubscribe,
    Will,
)
from fedtier.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as b:
        yield b


def wait_until(condition: object, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


# --- limits Mosquitto has no option for ------------------------------------------------------


def test_connections_per_address_and_in_total_are_limited() -> None:
    with EmbeddedBroker(max_connections_per_address=3, max_connections=3) as broker:
        kept = [RawClient(broker.port) for _ in range(3)]
        for i, raw in enumerate(kept):
            assert raw.connect(f"c{i}").reason_code == 0
        extra = RawClient(broker.port)
        extra.send(Connect("c3"))
        assert extra.recv() is None  # closed at once, before any CONNACK
        kept[0].send(Disconnect())
        assert kept[0].packets_until_closed() == []
        assert wait_until(lambda: len(broker.online_clients()) == 2)
        again = RawClient(broker.port)  # a freed slot is usable again
        assert again.connect("c4").reason_code == 0
        for raw in (*kept[1:], again):
            raw.close()


def test_partial_packets_are_charged_to_the_byte_budget() -> None:
    limits = BrokerLimits(max_packet_size=64 * KIB, max_buffered_bytes=100 * KIB)
    with EmbeddedBroker(limits=limits) as broker:
        header = b"\x30\xfc\xff\x03"  # a PUBLISH of 65,536 bytes in all (Remaining Length 65,532)
        first = RawClient(broker.port)
        first.connect("holds-60k")
        first.send_raw(header + b"\x00\x01a\x00" + b"x" * 59_996)  # 60,000 of its 65,532 bytes
        second = RawClient(broker.port)
        second.connect("holds-more")
        assert wait_until(lambda: len(broker.online_clients()) == 2)
        second.send_raw(header + b"\x00\x01a\x00" + b"y" * 49_996)  # 110,000 in all > 100 KiB
        assert second.packets_until_closed() == [Disconnect(0x97)]  # Quota exceeded
        first.send_raw(b"x" * 5_532)  # completes the packet: its bytes are given back
        first.send(PingReq())
        assert first.recv() == PingResp()
        assert round_trip(broker.port) == b"still alive"
        first.close()


def _stall(port: int, client_id: str, announced: int, sent: int) -> RawClient:
    """A connected client that sends a PUBLISH head announcing ``announced`` bytes of body and
    ``sent`` of them, then stalls (the sending is non-blocking: what the broker does not read
    stays in the kernel)."""
    raw = RawClient(port)
    raw.connect(client_id, keep_alive=0)
    head = b"\x30" + varint(announced) + b"\x00\x01s\x00"
    raw.sock.setblocking(False)
    data = head + b"s" * (sent - 4)
    try:
        raw.sock.send(data)
    except BlockingIOError:
        pass
    return raw


def test_stalled_partial_packets_are_bounded_and_evicted_for_a_client_that_sends() -> None:
    limits = BrokerLimits(max_packet_size=64 * KIB, input_allowance=4 * KIB, max_input_bytes=128 * KIB,
                          stall_timeout=1)
    with EmbeddedBroker(limits=limits) as broker:
        stalled = [_stall(broker.port, f"stalled-{i}", 64 * KIB - 5, 60_000) for i in range(6)]
        assert wait_until(lambda: broker.stats()["input_waiting"] >= 3)  # 6 x 56 KB do not fit 128 KiB
        stats = broker.stats()
        assert stats["input_total_used"] <= 128 * KIB + 6, stats  # a read never outgrows the total
        assert stats["input_bytes"] <= 6 * 4 * KIB + 128 * KIB + 6, stats
        # A client with small packets needs nothing from the total: served at once.
        assert round_trip(broker.port) == b"still alive"
        # One that sends a packet as large as the stalled ones waits for the total, which the
        # stalled ones give back when they are closed (their packets began over 1 s ago).
        sub = Peer(broker.port, "big-sub").connect()
        assert sub.subscribe("big", 1) == [1]
        pub = Peer(broker.port, "big-pub").connect()
        pub.publish("big", b"b" * 60_000, qos=1)
        assert bytes(sub.get().payload) == b"b" * 60_000
        stats = broker.stats()
        assert stats["evicted_stalled"] >= 1 and stats["input_waits"] >= 3, stats
        closed = [raw for raw in stalled if wait_until(lambda raw=raw: _closed(raw), 0.2)]
        assert closed, "no stalled client was closed"
        for raw in stalled:
            raw.close()
        sub.close()
        pub.close()
        assert wait_until(lambda: broker.stats()["input_total_used"] == 0)


def _closed(raw: RawClient) -> bool:
    try:
        data = raw.sock.recv(65536)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return not data or data.startswith(b"\xe0")  # EOF, or the DISCONNECT before it


def test_a_new_connection_takes_the_slot_of_the_oldest_one_without_connect() -> None:
    with EmbeddedBroker(max_connections_per_address=3, max_connections=3) as broker:
        silent = [RawClient(broker.port) for _ in range(2)]  # sockets that never send CONNECT
        assert wait_until(lambda: broker.stats()["connections"] == 2)
        client = RawClient(broker.port)
        assert client.connect("client").reason_code == 0
        newcomer = RawClient(broker.port)  # the limit is reached: the oldest silent one goes
        assert newcomer.connect("newcomer").reason_code == 0
        assert silent[0].recv() is None
        assert wait_until(lambda: broker.stats()["evicted_unconnected"] == 1)
        third = RawClient(broker.port)  # then the other silent one
        assert third.connect("third").reason_code == 0
        assert silent[1].recv() is None
        refused = RawClient(broker.port)  # all three connected: refused, as before
        refused.send(Connect("refused"))
        assert refused.recv() is None
        for raw in (client, newcomer, third):
            raw.send(PingReq())
            assert raw.recv() == PingResp()
            raw.close()


def test_a_subscriber_that_does_not_read_is_bounded() -> None:
    limits = BrokerLimits(max_output_backlog=256 * KIB, max_queued_messages=5)
    with EmbeddedBroker(limits=limits) as broker:
        lazy = RawClient(broker.port, receive_buffer=4096)
        lazy.connect("lazy", properties=Properties(receive_maximum=100))
        lazy.send(Subscribe(1, (("flood/#", SubscriptionOptions(qos=1)),)))
        assert isinstance(lazy.recv(), SubAck)
        pub = Peer(broker.port).connect()
        for i in range(200):  # 200 x 64 KiB at QoS 1 and 0: far more than the socket buffers hold
            pub.publish(f"flood/{i % 2}", bytes(64 * KIB), qos=i % 2)
        assert round_trip(broker.port) == b"still alive"
        stats = broker.stats()
        # Output stops at the backlog limit (plus the packet that crossed it), QoS 0 is dropped
        # and QoS 1 waits in the session, whose queue drops its oldest beyond 5 messages.
        assert stats["max_output_bytes"] <= 256 * KIB + 64 * KIB + 100, stats
        assert stats["dropped_messages"] >= 100 - 5, stats
        # Held: QoS 1 in flight (at most the client's Receive Maximum, 100) and queued (5).
        assert stats["buffered_bytes"] <= (100 + 5) * (64 * KIB + 16), stats
        pub.close()
        lazy.close()


def test_messages_queued_for_offline_sessions_are_bounded_in_bytes() -> None:
    limits = BrokerLimits(max_queued_bytes=100 * KIB)
    with EmbeddedBroker(limits=limits) as broker:
        raw = RawClient(broker.port)
        raw.connect("offline", clean_start=False, properties=Properties(session_expiry_interval=60))
        raw.send(Subscribe(1, (("bulk", SubscriptionOptions(qos=1)),)))
        assert isinstance(raw.recv(), SubAck)
        raw.send(Disconnect())
        raw.packets_until_closed()
        pub = Peer(broker.port).connect()
        for i in range(10):
            pub.publish("bulk", bytes([i]) * (30 * KIB), qos=1)
        back = Peer(broker.port, "offline", clean=False, session_expiry=60).connect()
        kept = []
        while (got := back.messages.get(timeout=WAIT)) is not None:
            kept.append(bytes(got.payload)[0])
            if kept[-1] == 9:
                break
        assert kept == [7, 8, 9]  # 3 x 30 KiB fit in 100 KiB: the oldest were dropped
        back.close()
        pub.close()


def test_qos2_state_is_bounded_by_receive_maximum(broker: EmbeddedBroker) -> None:
    raw = RawClient(broker.port)
    assert raw.connect("q2-flood").properties.receive_maximum == 20
    for packet_id in range(1, 21):
        raw.send(Publish("q2/flood", b"x", qos=2, packet_id=packet_id))
        assert raw.recv() == PubRec(packet_id)
    raw.send(Publish("q2/flood", b"x", qos=2, packet_id=21))
    assert raw.packets_until_closed() == [Disconnect(0x93)]  # Receive Maximum exceeded


def test_acl_from_a_file(tmp_path: object) -> None:
    acl = AccessList.parse("user dev\ntopic write up/dev/#\n")
    with EmbeddedBroker(acl=acl) as broker:
        raw = RawClient(broker.port)
        raw.connect("dev", username="dev")
        raw.send(Publish("up/dev/x", b"ok", qos=1, packet_id=1))
        assert raw.recv() == PubAck(1, 0x10)
        raw.send(Publish("up/other/x", b"no", qos=1, packet_id=2))
        assert raw.recv() == PubAck(2, 0x87)
        raw.close()


# --- the command line ----------------------------------------------------------------------


def test_module_entry_point_serves_and_stops_on_sigterm() -> None:
    port = free_port()
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
        raw = RawClient(port)
        assert raw.connect("cli").properties.maximum_packet_size == 65536
        raw.close()
        assert round_trip(port) == b"still alive"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0
        stdout = proc.stdout.read() if proc.stdout else ""
        assert stdout == ""  # logging only, never print
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_invalid_limits_and_acl_files_are_refused_up_front(tmp_path: object) -> None:
    from pathlib import Path

    from fedtier.embedded_broker.cli import main

    assert main(["--port", "0", "--max-connections", "0"]) == 2
    bad = Path(str(tmp_path)) / "bad.acl"
    bad.write_text("topic read a/#\nrule write b\n")
    assert main(["--port", "0", "--acl-file", str(bad)]) == 2
    with pytest.raises(ConfigError) as info:
        EmbeddedBroker(max_packet_size=10)
    assert info.value.key == "max_packet_size"


def test_default_limits_are_the_documented_ones() -> None:
    limits = BrokerLimits()
    assert (limits.max_packet_size, limits.max_connect_size, limits.max_buffered_bytes) == (MIB, 64 * KIB, 256 * MIB)
    assert (limits.max_queued_messages, limits.max_queued_bytes, limits.max_output_backlog) == (10_000, 64 * MIB,
                                                                                                 8 * MIB)
    assert (limits.max_connections, limits.max_connections_per_address) == (1024, 256)


def test_the_limits_of_issue_31_and_their_total() -> None:
    limits = BrokerLimits()
    assert (limits.max_input_bytes, limits.input_allowance, limits.stall_timeout, limits.max_keepalive) == (
        32 * MIB, 16 * KIB, 10, 300)
    # What partial packets can hold at most, however many clients stall: under 64 MB.
    assert limits.max_input_held == 48 * MIB < 64_000_000
    with pytest.raises(ConfigError) as info:
        BrokerLimits(max_keepalive=65_536)
    assert info.value.key == "max_keepalive"


def test_password_file_option(tmp_path: object) -> None:
    from pathlib import Path

    from click.testing import CliRunner

    from fedtier.embedded_broker.cli import main
    from fedtier.embedded_broker.command import broker as broker_group

    path = Path(str(tmp_path)) / "broker.passwd"
    result = CliRunner().invoke(broker_group, ["passwd", str(path), "edge-1", "--password", "s3cret"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(broker_group, ["passwd", str(path), "edge-2"], input="two\ntwo\n")
    assert result.exit_code == 0, result.output
    assert path.stat().st_mode & 0o777 == 0o600
    assert [line.split(":")[0] for line in path.read_text().splitlines()] == ["edge-1", "edge-2"]
    plain = Path(str(tmp_path)) / "plain.passwd"
    plain.write_text("edge-1:s3cret\n")
    assert main(["--port", "0", "--password-file", str(plain)]) == 2  # plain text: refused up front
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fedtier.embedded_broker", "--host", HOST, "--port", str(port),
                             "--password-file", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        raw = RawClient(port)
        assert raw.connect("anonymous").reason_code == 0x87
        raw = RawClient(port)
        assert raw.connect("edge-2", username="edge-2", password=b"two").reason_code == 0
        raw.close()
    finally:
        proc.terminate()
        proc.wait(WAIT)


# --- API and codec -----------------------------------------------------------------------------


def test_online_clients_lists_live_connections(broker: EmbeddedBroker) -> None:
    peer = Peer(broker.port, "listed").connect()
    assert "listed" in broker.online_clients()
    peer.close()
    assert wait_until(lambda: "listed" not in broker.online_clients())


_PACKETS: list[Packet] = [
    Connect("c", will=Will("w/t", b"bye", 1, True), username="u", password=b"p", keep_alive=5),
    ConnAck(0, True),
    Publish("a/b", b"payload", qos=1, retain=True, dup=True, packet_id=7),
    Publish("a/b", b"payload", qos=2, packet_id=8),
    Publish("a/b", b""),
    PubAck(7),
    PubRec(8),
    PubRel(8),
    PubComp(8),
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
            will=Will("w", b"x", properties=Properties(will_delay_interval=0, content_type="t"))),
    ConnAck(0, False, Properties(maximum_packet_size=100, topic_alias_maximum=0)),
    Publish("t", b"p", properties=Properties(user_properties=(("k", "v"), ("k", "w")),
                                             subscription_identifiers=(1, 300))),
    PubAck(9, 0x10),
    PubRec(9, 0x87),
    PubComp(9, 0x92),
    Subscribe(1, (("t", SubscriptionOptions(1, True, True, 2)),), Properties(subscription_identifiers=(42,))),
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

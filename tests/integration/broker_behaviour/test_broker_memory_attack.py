"""The memory attack of issue 20, against each broker in its own process as fedtier starts it.

Eight sockets each announce a 256 MiB CONNECT (the largest Remaining Length MQTT allows) and
stream 64 MiB of it, while a normal client keeps publishing and receiving round trips. With
fedtier's limits the broker refuses each on its fixed header: its RSS (VmHWM, the peak, from
/proc) grows by less than 64 MB and the normal client is served throughout. The control runs
the same attack, smaller, with the limits lifted, to show the measurement sees the attack.
"""

from __future__ import annotations

import errno
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from broker_harness import HOST, Check, Peer, check, kind, raw_connect, round_trip, rss_kib, varint
from conftest import free_port, start_mosquitto, wait_port

from fedtier.embedded_broker.limits import DEFAULT_LIMITS, GIB, MIB, BrokerLimits

__all__ = ["check", "kind"]  # fixtures
pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

ATTACKERS = 8
ANNOUNCED = 268_435_455  # 256 MiB - 1: the largest four-byte Remaining Length (§1.5.5)
STREAM = 64 * MIB
GROWTH_LIMIT = 64_000_000  # bytes: "less than 64 MB"
UNLIMITED = BrokerLimits(max_packet_size=None, max_connect_size=ANNOUNCED + 5, max_buffered_bytes=8 * GIB,
                         max_input_bytes=8 * GIB)


@dataclass
class BrokerProcess:
    pid: int
    port: int


def start_process(kind: str, directory: Path, limits: BrokerLimits) -> tuple[BrokerProcess, subprocess.Popen[bytes]]:
    """The broker in its own process: Mosquitto with fedtier's config, or
    ``python -m fedtier.embedded_broker`` as ``fedtier demo --broker embedded`` runs it."""
    if kind == "mosquitto":
        broker = start_mosquitto(directory, limits=limits)
        return BrokerProcess(broker.proc.pid, broker.port), broker.proc
    port = free_port()
    argv = [sys.executable, "-m", "fedtier.embedded_broker", "--host", HOST, "--port", str(port),
            "--log-level", "WARNING"]
    if limits != DEFAULT_LIMITS:
        argv += ["--max-packet-size", str(limits.max_packet_size or 0),
                 "--max-connect-size", str(limits.max_connect_size),
                 "--max-buffered-bytes", str(limits.max_buffered_bytes),
                 "--max-input-bytes", str(limits.max_input_bytes)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return BrokerProcess(proc.pid, port), proc


@pytest.fixture
def launch(kind: str, tmp_path: Path) -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def factory(limits: BrokerLimits = DEFAULT_LIMITS) -> BrokerProcess:
        broker, proc = start_process(kind, tmp_path / f"{kind}{len(procs)}", limits)
        procs.append(proc)
        return broker

    yield factory
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def attack(port: int, stream: int, deadline_s: float = 60.0) -> list[int]:
    """Open ATTACKERS sockets, announce a 256 MiB CONNECT on each and stream ``stream`` bytes
    of it; returns how many bytes each got to send before the broker cut it off (or all)."""
    header = b"\x10" + bytes([0xFF, 0xFF, 0xFF, 0x7F])
    socks = []
    for _ in range(ATTACKERS):
        sock = socket.create_connection((HOST, port))
        sock.sendall(header)
        sock.setblocking(False)
        socks.append(sock)
    sent = dict.fromkeys(socks, 0)
    live = set(socks)
    chunk = b"\x00" * (256 * 1024)
    deadline = time.monotonic() + deadline_s
    while live and time.monotonic() < deadline:
        _, writable, _ = select.select([], list(live), [], 0.5)
        for sock in writable:
            try:
                sent[sock] += sock.send(chunk[:stream - sent[sock]])
            except OSError as exc:  # reset or broken pipe: the broker closed it
                assert exc.errno in (errno.ECONNRESET, errno.EPIPE), exc
                live.discard(sock)
                continue
            if sent[sock] >= stream:
                live.discard(sock)
    for sock in socks:
        sock.close()
    return list(sent.values())


@dataclass
class RoundTrips:
    """A normal client publishing to itself and waiting for each message, in a thread."""

    port: int
    done: list[tuple[float, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        peer = Peer(self.port, "normal-client").connect()
        try:
            assert peer.subscribe("health/rt", 1) == [1]
            i = 0
            while not self.stop.is_set():
                started = time.monotonic()
                payload = f"rt-{i}".encode()
                try:
                    peer.publish("health/rt", payload, qos=1)
                    got = bytes(peer.get(timeout=10).payload)
                except AssertionError as exc:
                    self.failures.append(f"round trip {i}: {exc}")
                    return
                if got != payload:
                    self.failures.append(f"round trip {i}: got {got!r}")
                    return
                self.done.append((started, time.monotonic()))
                i += 1
            if not peer.client.is_connected():
                self.failures.append("disconnected")
        finally:
            peer.close()


def test_eight_256_mib_connects_cost_under_64_mb_and_a_client_is_served_throughout(
        launch: object, check: Check) -> None:
    broker = launch()  # type: ignore[operator]
    client = RoundTrips(broker.port)
    thread = threading.Thread(target=client.run)
    thread.start()
    try:
        while len(client.done) < 3 and not client.failures and thread.is_alive():
            time.sleep(0.01)
        rss_before, _ = rss_kib(broker.pid)
        attack_started = time.monotonic()
        sent = attack(broker.port, STREAM)
        attack_ended = time.monotonic()
        after = len(client.done)
        while len(client.done) < after + 3 and not client.failures and thread.is_alive():
            time.sleep(0.01)
    finally:
        client.stop.set()
        thread.join(30)
    _, peak = rss_kib(broker.pid)
    growth = (peak - rss_before) * 1024
    print(f"\n{check.kind} pid {broker.pid}: RSS {rss_before} KiB before, peak {peak} KiB; "
          f"attackers sent {[s // 1024 for s in sent]} KiB before being cut off; "
          f"{len(client.done)} round trips")
    check.that("every attacker is cut off before streaming its 64 MiB", all(s < STREAM for s in sent), sent)
    check.that("RSS grows by less than 64 MB", growth < GROWTH_LIMIT, f"{growth / 1e6:.1f} MB")
    check.same("no round trip failed", client.failures, [])
    overlapping = [d for d in client.done if d[0] < attack_ended and d[1] > attack_started]
    later = [d for d in client.done if d[0] >= attack_ended]
    check.that("round trips completed while the attack ran", len(overlapping) >= 1, client.done)
    check.that("... and after it", len(later) >= 1)


def test_control_without_the_limits_the_same_attack_costs_memory(launch: object, check: Check) -> None:
    """The measurement is able to fail: with no packet and no pre-CONNECT limit (and the budget and
    the input total far away) eight sockets streaming 16 MiB each grow either broker by more than 64 MB."""
    broker = launch(UNLIMITED)  # type: ignore[operator]
    rss_before, _ = rss_kib(broker.pid)
    sent = attack(broker.port, 16 * MIB)
    _, peak = rss_kib(broker.pid)
    print(f"\n{check.kind} without limits: RSS {rss_before} KiB before, peak {peak} KiB")
    check.same("nothing cut off", sent, [16 * MIB] * ATTACKERS)
    check.that("RSS grows by more than 64 MB", (peak - rss_before) * 1024 > GROWTH_LIMIT,
               f"{(peak - rss_before) / 1024:.1f} MiB")


# --- issue 31: connected clients that stall in the middle of a large PUBLISH ---------------------

STALLED = 250
STALL_REMAINING = DEFAULT_LIMITS.max_packet_size - 4 if DEFAULT_LIMITS.max_packet_size else MIB
"""The Remaining Length of each stalled PUBLISH: with its 4-byte fixed header, exactly the packet limit."""
STALL_SENT = STALL_REMAINING - 1024
"""Bytes of that body each client sends before it stalls: all but the last KiB."""


def _stalled_publish_head() -> bytes:
    """A v5 PUBLISH (QoS 0, topic ``stall/x``, no properties) announcing STALL_REMAINING bytes, and the
    first STALL_SENT bytes of its body."""
    body_head = b"\x00\x07stall/x\x00"
    return b"\x30" + varint(STALL_REMAINING) + body_head + b"s" * (STALL_SENT - len(body_head))


def stall(port: int, count: int, *, settle_s: float = 3.0, deadline_s: float = 60.0) -> list[socket.socket]:
    """Open ``count`` connections, CONNECT each (v5, keep-alive 0), then send each a PUBLISH head that
    announces ~1 MiB and all of its body but the last KiB, as far as the broker reads it: a socket whose
    send would block is left as it is once no socket has made progress for ``settle_s``."""
    connect = raw_connect(client_id=b"", level=5, keep_alive=0)
    socks = []
    for _ in range(count):
        sock = socket.create_connection((HOST, port))
        sock.sendall(connect)
        socks.append(sock)
    for sock in socks:  # CONNACK: each is a connected client before it stalls
        sock.settimeout(10)
        head = sock.recv(2)
        assert head[:1] == b"\x20", f"no CONNACK: {head!r}"
        sock.setblocking(False)
    data = _stalled_publish_head()
    sent = dict.fromkeys(socks, 0)
    last_progress = time.monotonic()
    deadline = last_progress + deadline_s
    while time.monotonic() - last_progress < settle_s and time.monotonic() < deadline:
        pending = [s for s in socks if sent[s] < len(data)]
        if not pending:
            break
        _, writable, _ = select.select([], pending, [], 0.2)
        for sock in writable:
            try:
                n = sock.send(data[sent[sock]:sent[sock] + 256 * 1024])
            except BlockingIOError:
                continue
            except OSError:  # the broker closed it
                sent[sock] = len(data)
                continue
            if n:
                sent[sock] += n
                last_progress = time.monotonic()
    return socks


def still_open(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the broker has not closed (nothing to read, no EOF, no reset)."""
    open_count = 0
    for sock in socks:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            open_count += 1
            continue
        except OSError:
            continue
        if data and not data.startswith(b"\xe0"):  # anything but a DISCONNECT: still connected
            open_count += 1
    return open_count


def test_250_clients_stalled_mid_publish_cost_under_64_mb_and_a_new_client_is_served(
        launch: object, check: Check) -> None:
    broker = launch()  # type: ignore[operator]
    rss_before, _ = rss_kib(broker.pid)
    started = time.monotonic()
    socks = stall(broker.port, STALLED)
    stalled_s = time.monotonic() - started
    try:
        time.sleep(1.0)  # whatever the broker was going to read of them, it has read
        served = round_trip(broker.port, "health/stalled") == b"still alive"
        rss_after, peak = rss_kib(broker.pid)
        open_count = still_open(socks)
    finally:
        for sock in socks:
            sock.close()
    growth = (peak - rss_before) * 1024
    print(f"\n{check.kind} pid {broker.pid}: RSS {rss_before} KiB before, {rss_after} KiB with "
          f"{STALLED} clients stalled mid-PUBLISH ({stalled_s:.1f} s to stall them), peak {peak} KiB "
          f"(growth {growth / 1e6:.1f} MB); {open_count} of them still connected")
    check.same("a new client connects, subscribes, publishes and receives meanwhile", served, True)
    check.differs("RSS grows by less than 64 MB", growth < GROWTH_LIMIT,
                  {"mosquitto": False, "embedded": True},
                  "§4.13 (a server's resource limits are its own): Mosquitto allocates each packet's "
                  "announced length on its fixed header")

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
from broker_harness import HOST, Check, Peer, check, kind, rss_kib
from conftest import free_port, start_mosquitto, wait_port

from fedtier.embedded_broker.limits import DEFAULT_LIMITS, GIB, MIB, BrokerLimits

__all__ = ["check", "kind"]  # fixtures
pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

ATTACKERS = 8
ANNOUNCED = 268_435_455  # 256 MiB - 1: the largest four-byte Remaining Length (§1.5.5)
STREAM = 64 * MIB
GROWTH_LIMIT = 64_000_000  # bytes: "less than 64 MB"
UNLIMITED = BrokerLimits(max_packet_size=None, max_connect_size=ANNOUNCED + 5, max_buffered_bytes=8 * GIB)


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
                 "--max-buffered-bytes", str(limits.max_buffered_bytes)]
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
    """The measurement is able to fail: with no packet and no pre-CONNECT limit (and a budget
    far away) eight sockets streaming 16 MiB each grow either broker by more than 64 MB."""
    broker = launch(UNLIMITED)  # type: ignore[operator]
    rss_before, _ = rss_kib(broker.pid)
    sent = attack(broker.port, 16 * MIB)
    _, peak = rss_kib(broker.pid)
    print(f"\n{check.kind} without limits: RSS {rss_before} KiB before, peak {peak} KiB")
    check.same("nothing cut off", sent, [16 * MIB] * ATTACKERS)
    check.that("RSS grows by more than 64 MB", (peak - rss_before) * 1024 > GROWTH_LIMIT,
               f"{(peak - rss_before) / 1024:.1f} MiB")

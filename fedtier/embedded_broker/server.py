"""The network shell: an asyncio server on a background thread feeding the broker core.

One event loop serves every connection. Each connection is an :class:`asyncio.BufferedProtocol`
whose ``buffer_updated`` frames, decodes and hands packets to the core synchronously, so the
core's state is only ever touched from the loop thread. Writes go straight into the
transport's buffer: a slow subscriber never blocks a publisher or the loop. Above
``max_output_backlog`` unsent bytes the transport pauses the connection's writing: QoS 0
messages to it are dropped and QoS 1/2 messages wait in its session until it drains.

Limits (:mod:`.limits`) are enforced here before anything is buffered: a socket over the
connection limits takes the slot of the oldest connection without CONNECT, or is closed at
once; until CONNECT is accepted the framer refuses a packet announcing more than
``max_connect_size`` as soon as its fixed header is in, afterwards more than
``max_packet_size``. Every socket is read into one shared buffer, never more at a time than the
connection may keep if it all stayed a partial packet (its ``input_allowance`` left plus what
is left of ``max_input_bytes``); a connection with no room is not read until bytes are given
back, and connections whose partial packet has stalled longer than ``stall_timeout`` are closed
to make room. Partial packets are also charged to the broker's byte budget, and a connection
the budget cannot hold is closed.

A client that misbehaves — garbage bytes, a packet over the size limit, a protocol error,
keep-alive silence — is disconnected on its own; any unexpected exception while handling its
packets is logged and costs only that connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fedtier.embedded_broker.acl import AccessList
from fedtier.embedded_broker.broker import Broker, BrokerConfig, ServerLink
from fedtier.embedded_broker.codec import PacketFramer, decode_packet, encode_packet
from fedtier.embedded_broker.limits import DEFAULT_LIMITS, KIB, BrokerLimits, ByteBudget, ConnectionGate
from fedtier.embedded_broker.packets import (
    MQTT_5,
    MQTT_311,
    ConnAck,
    Connect,
    ConnectReturnCode,
    Disconnect,
    MqttProtocolError,
    Packet,
    PacketTooLargeError,
    PacketType,
    ProtocolViolationError,
    QuotaExceededError,
    Publish,
    ReasonCode,
    UnsupportedProtocolVersionError,
)
from fedtier.embedded_broker.passwords import PasswordFile
from fedtier.errors import ConfigError, LocalProtocolError

logger = logging.getLogger("fedtier.embedded_broker")

CONNECT_TIMEOUT = 10.0
"""Seconds a new connection may take to send CONNECT before it is dropped."""
CLOSE_GRACE = 5.0
"""Seconds a closing connection gets to flush its output before it is aborted."""
START_TIMEOUT = 10.0
"""Seconds :meth:`EmbeddedBroker.start` waits for the listener to come up."""
READ_CHUNK = 64 * KIB
"""The most one read takes from a socket."""
LOG_INTERVAL = 10.0
"""Seconds between two warnings of one kind about misbehaving clients (the rest are counted)."""


class _RateLimitedLog:
    """A warning logged at most once per ``interval`` seconds per kind; the rest are counted and
    reported with the next line, so a flood of misbehaving clients cannot flood the log."""

    def __init__(self, clock: Callable[[], float], interval: float = LOG_INTERVAL) -> None:
        self._clock = clock
        self._interval = interval
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = self._clock()
        if now < self._next.get(kind, 0.0):
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._next[kind] = now + self._interval
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            message += " (and %d more like it in the last %.0f s)"
            args = (*args, suppressed, self._interval)
        logger.warning(message, *args)


class _Shared:
    """What the connections of one broker share: the core, the connection gate, the bytes of
    partial packets (``max_input_bytes``) and the connections waiting for some, the read buffer,
    counters and the rate-limited log. Touched only on the loop thread."""

    def __init__(self, broker: Broker, loop: asyncio.AbstractEventLoop) -> None:
        self.broker = broker
        self.limits = broker.config.limits
        self.loop = loop
        self.connections: set[_Connection] = set()
        self.gate = ConnectionGate(self.limits)
        self.input = ByteBudget(self.limits.max_input_bytes)
        """Bytes of partial packets beyond each connection's ``input_allowance``."""
        self.waiting: dict[_Connection, None] = {}
        """Connections not read until ``input`` has bytes for them, oldest first."""
        self.read_buffer = memoryview(bytearray(READ_CHUNK))
        """Every socket is read into this and its bytes framed at once (one loop thread)."""
        self._stall_timer: asyncio.TimerHandle | None = None
        self.counters = {"evicted_stalled": 0, "evicted_unconnected": 0, "input_waits": 0}
        self.log = _RateLimitedLog(loop.time)

    def wake(self) -> None:
        """Resume reading connections that wait for input bytes, as many as the bytes given back
        can serve a full read (at least one)."""
        budget = max(1, self.input.available // READ_CHUNK) if self.input.available else 0
        while self.waiting and budget:
            connection = next(iter(self.waiting))
            del self.waiting[connection]
            if connection.resume_input():
                budget -= 1

    def evict_stalled(self, needed: int, asking: _Connection | None = None) -> None:
        """Close connections holding input bytes for a packet begun more than ``stall_timeout``
        ago, oldest first, until ``needed`` bytes are available (or none is left to close)."""
        cutoff = self.loop.time() - self.limits.stall_timeout
        stale = sorted((c for c in self.connections
                        if c.input_charge and c.partial_since <= cutoff and c is not asking),
                       key=lambda c: c.partial_since)
        for connection in stale:
            if self.input.available >= needed:
                break
            self.counters["evicted_stalled"] += 1
            self.log.warning("stalled", "%s: partial packet stalled for %.0f s while others wait "
                             "for input bytes (%d of %d in use); disconnecting",
                             connection.describe(), self.loop.time() - connection.partial_since,
                             self.input.used, self.input.limit)
            connection.close(ReasonCode.QUOTA_EXCEEDED)

    def watch_stalls(self) -> None:
        """While connections wait, come back when the oldest partial packet may be evicted."""
        if self._stall_timer is not None or not self.waiting:
            return
        holders = [c.partial_since for c in self.connections if c.input_charge]
        if not holders:
            return
        delay = max(0.0, min(holders) + self.limits.stall_timeout - self.loop.time()) + 0.01
        self._stall_timer = self.loop.call_later(delay, self._on_stall_timer)

    def _on_stall_timer(self) -> None:
        self._stall_timer = None
        if self.waiting:
            self.evict_stalled(READ_CHUNK)
            self.wake()
            self.watch_stalls()

    def make_room(self, address: str) -> str | None:
        """Admit a socket from ``address``; at a connection limit, in place of the oldest
        connection that has not completed CONNECT (from ``address`` if the per-address limit is
        the one reached). Returns why the socket is refused, or None if it is admitted."""
        refused = self.gate.admit(address)
        if refused is None:
            return None
        any_address = self.gate.total >= self.limits.max_connections
        candidates = [c for c in self.connections if not c.connected and not c.closing
                      and (any_address or c.address == address)]
        if not candidates:
            return refused
        victim = min(candidates, key=lambda c: c.opened)
        self.counters["evicted_unconnected"] += 1
        self.log.warning("unconnected", "%s: no CONNECT yet and %s; closed for a new connection",
                         victim.describe(), refused)
        victim.evict()
        return self.gate.admit(address)

    def cancel(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None


class _Connection(asyncio.BufferedProtocol, ServerLink):
    """One client connection: framing, decoding, keep-alive, and the write side of a link."""

    def __init__(self, shared: _Shared) -> None:
        self._shared = shared
        self._broker = shared.broker
        self._limits = shared.limits
        self._loop = shared.loop
        # Until CONNECT is accepted, a peer may announce only a small packet.
        self._framer = PacketFramer(self._limits.connect_limit)
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self.address: str | None = None
        """The peer's address while it counts against the connection limits."""
        self.opened = self._loop.time()
        self._held_input = 0
        """Bytes of partial packets charged to the broker's budget."""
        self.input_charge = 0
        """Bytes of the partial packet charged to the shared input total (beyond the allowance)."""
        self.partial_since = 0.0
        """Loop time at which the partial packet held began arriving."""
        self._reading_paused = False
        self._paused = False
        self.closing = False
        self._last_received = self._loop.time()
        self._keep_alive_limit = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._abort_timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        refused = self._shared.make_room(address)
        if refused is not None:
            self._shared.log.warning("refused", "%s: connection refused: %s", self._peer, refused)
            self.closing = True
            transport.abort()
            return
        self.address = address
        self._shared.connections.add(self)
        high = self._limits.max_output_backlog
        transport.set_write_buffer_limits(high=high, low=high // 4)
        self._timer = self._loop.call_later(CONNECT_TIMEOUT, self._connect_timeout)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self.session is not None and self.session.link is self and not self.closing:
            self.session.pump()

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the next read goes: never more than this connection may hold if all of it
        stayed a partial packet (its allowance left, plus the input total's bytes left)."""
        room = self._input_room()
        if room <= 0:
            # Others took the input total since this connection last read (it was not paused
            # then): take one byte, then wait for bytes to be given back.
            room = 1
            self._wait_for_input()
        return self._shared.read_buffer[:min(READ_CHUNK, room)]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        self._last_received = self._loop.time()
        partial_before = self._framer.buffered
        self._framer.feed(self._shared.read_buffer[:nbytes])
        completed = False
        try:
            if not self.connected and self._framer.peek_packet_type() not in (
                    None, PacketType.CONNECT):
                # [MQTT-3.1.0-1]: the first packet must be CONNECT. Checked on the first byte
                # so a non-MQTT peer (an HTTP probe, say) is dropped at once.
                raise ProtocolViolationError("first packet is not CONNECT")
            while not self.closing:
                frame = self._framer.next_frame()
                if frame is None:
                    break
                completed = True
                packet = decode_packet(frame, self.protocol_level)
                self._broker.handle_packet(self, packet)
                if isinstance(packet, Connect) and self.connected:
                    self._framer.max_packet_size = self._limits.max_packet_size
                    self._start_keep_alive(self.keep_alive)
            if not self.closing:
                if completed or not partial_before:
                    self.partial_since = self._last_received
                self._charge_input()
        except UnsupportedProtocolVersionError as exc:
            self._refuse_protocol_version(exc)
        except PacketTooLargeError as exc:
            self._shared.log.warning("too-large", "%s: %s; disconnecting", self.describe(), exc)
            self.close(exc.reason_code)
        except QuotaExceededError as exc:
            self._shared.log.warning("quota", "%s: %s; disconnecting", self.describe(), exc)
            self.close(exc.reason_code)
        except MqttProtocolError as exc:
            logger.warning("%s: protocol error (%s): %s; disconnecting",
                           self.describe(), exc.reason, exc)
            self.close(exc.reason_code)
        except Exception:
            logger.exception("%s: unexpected error while handling a packet; disconnecting",
                             self.describe())
            self.close(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)

    def eof_received(self) -> bool:
        return False  # half-closed is closed: let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        for timer in (self._timer, self._abort_timer):
            if timer is not None:
                timer.cancel()
        self._leave()
        self._release()

    # --- ClientLink ----------------------------------------------------------------------------

    def send_packet(self, packet: Packet) -> bool:
        if self.closing or self._transport is None:
            return False
        data = encode_packet(packet, self.protocol_level)
        limit = self.maximum_packet_size
        if limit is not None and len(data) > limit:
            # §3.1.2.11.4 [MQTT-3.1.2-25]: never send a v5 client more than it declared;
            # the message is discarded for this client as if it had been delivered.
            what = f"message on {packet.topic!r}" if isinstance(packet, Publish) else (
                type(packet).__name__)
            logger.warning("%s: not sending %s: %d bytes exceed the client's maximum packet "
                           "size %d", self.describe(), what, len(data), limit)
            return False
        self._transport.write(data)
        return True

    def writable(self) -> bool:
        return not self._paused and not self.closing

    @property
    def partial_bytes(self) -> int:
        """Bytes of a partial packet held for this client."""
        return self._framer.buffered

    @property
    def output_bytes(self) -> int:
        """Bytes written for this client but not yet sent."""
        return 0 if self._transport is None else self._transport.get_write_buffer_size()

    def close(self, reason_code: int | None = None) -> None:
        if self.closing or self._transport is None:
            return
        if reason_code is not None and self.connected and self.protocol_level == MQTT_5:
            self.send_packet(Disconnect(reason_code))
        self.closing = True
        self._framer.clear()  # a refused packet's bytes are not kept until the socket is gone
        self._transport.close()  # stops reading; flushes what is buffered, then closes
        self._abort_timer = self._loop.call_later(CLOSE_GRACE, self._transport.abort)
        # Release the session and fire the will now, not at connection_lost: a client that
        # reconnects at once must find its session detached and its will already handled.
        self._release()

    def abort(self) -> None:
        """Drop the connection now, unsent data included (broker shutdown)."""
        self.closing = True
        if self._transport is not None:
            self._transport.abort()

    def evict(self) -> None:
        """Drop a connection that has not completed CONNECT, for a new one: its slot is free at
        once (the transport's connection_lost comes later)."""
        self.abort()
        self._leave()
        self._release()

    # --- input accounting ----------------------------------------------------------------------

    def _input_room(self) -> int:
        """Bytes this connection may read now: its allowance left plus the input total's left."""
        return max(0, self._limits.input_allowance - self._framer.buffered) + self._shared.input.available

    def _charge_input(self) -> None:
        """Charge the partial packet still buffered: to the broker's byte budget (over it,
        disconnect), and beyond the allowance to the input total (which the read was sized to
        fit). If the next read would find no room, stop reading until bytes are given back."""
        held = self._framer.buffered
        delta = held - self._held_input
        if delta > 0 and not self._broker.budget.take(delta):
            raise QuotaExceededError(
                f"{held} buffered bytes exceed the broker's buffer budget "
                f"({self._broker.budget.used} of {self._broker.budget.limit} in use)")
        if delta < 0:
            self._broker.budget.give_back(-delta)
        self._held_input = held
        self._set_input_charge(max(0, held - self._limits.input_allowance))
        if self._input_room() <= 0:
            self._shared.evict_stalled(READ_CHUNK, asking=self)
            if self._input_room() <= 0:
                self._wait_for_input()

    def _set_input_charge(self, charge: int) -> None:
        shared = self._shared
        if charge > self.input_charge:
            shared.input.force(charge - self.input_charge)
        elif charge < self.input_charge:
            shared.input.give_back(self.input_charge - charge)
            self.input_charge = charge
            shared.wake()
        self.input_charge = charge

    def _wait_for_input(self) -> None:
        if self._reading_paused or self._transport is None:
            return
        self._reading_paused = True
        self._transport.pause_reading()
        shared = self._shared
        shared.waiting[self] = None
        shared.counters["input_waits"] += 1
        shared.log.warning("input-wait", "%s: %d bytes of a partial packet held and the input total "
                           "is in use (%d of %d bytes); not reading it until bytes are given back",
                           self.describe(), self._framer.buffered, shared.input.used, shared.input.limit)
        shared.watch_stalls()

    def resume_input(self) -> bool:
        """Read again (bytes were given back); False if the connection is closing."""
        if self.closing or self._transport is None:
            return False
        self._reading_paused = False
        self._transport.resume_reading()
        return True

    def _leave(self) -> None:
        """Stop counting against the connection limits (once)."""
        self._shared.connections.discard(self)
        self._shared.waiting.pop(self, None)
        if self.address is not None:
            self._shared.gate.leave(self.address)
            self.address = None

    def _release(self) -> None:
        """Tell the core this link is finished. Safe to call twice (close, then lost)."""
        if self._held_input:
            self._broker.budget.give_back(self._held_input)
            self._held_input = 0
        self._framer.clear()
        self._shared.waiting.pop(self, None)
        self._set_input_charge(0)
        try:
            self._broker.link_closed(self)
        except Exception:
            logger.exception("%s: error while cleaning up after disconnect", self.describe())

    # --- timers ------------------------------------------------------------------------------

    def _connect_timeout(self) -> None:
        if not self.connected:
            logger.info("%s: no CONNECT within %.0f s; closing", self.describe(), CONNECT_TIMEOUT)
            self.close()

    def _start_keep_alive(self, keep_alive: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if keep_alive > 0:
            # §3.1.2.10: allow one and a half times the Keep Alive between packets.
            self._keep_alive_limit = 1.5 * keep_alive
            self._timer = self._loop.call_later(self._keep_alive_limit, self._check_keep_alive)

    def _check_keep_alive(self) -> None:
        if self._reading_paused:  # the client may well be sending: its bytes wait in the kernel
            self._last_received = self._loop.time()
        idle = self._loop.time() - self._last_received
        if idle >= self._keep_alive_limit:
            logger.info("%s: keep alive expired after %.1f s; disconnecting",
                        self.describe(), idle)
            self.close(ReasonCode.KEEP_ALIVE_TIMEOUT)  # the will is published on close
        else:
            self._timer = self._loop.call_later(self._keep_alive_limit - idle,
                                                self._check_keep_alive)

    # --- helpers -----------------------------------------------------------------------------

    def _refuse_protocol_version(self, exc: UnsupportedProtocolVersionError) -> None:
        """Answer a CONNECT of an unknown level with the 3.1.1 CONNACK, return code 0x01.

        3.1.1 §3.1.2.2 asks for exactly that; MQTT 5 §3.1.2.2 only says the server MAY answer
        0x84 in a v5 CONNACK. The four-byte 3.1.1 form is what Mosquitto 2.0 sends for every
        level it does not speak (checked by the broker-behaviour tests), and what a 3.1 client
        can read.
        """
        logger.info("%s: %s; refusing", self.describe(), exc)
        self.protocol_level = MQTT_311
        self.send_packet(ConnAck(ConnectReturnCode.UNACCEPTABLE_PROTOCOL_VERSION))
        self.close()

    def describe(self) -> str:
        return f"client {self.client_id!r} ({self._peer})" if self.client_id else self._peer


class EmbeddedBroker:
    """A pure-Python MQTT 3.1.1/5.0 broker serving on a daemon thread.

    Used by ``fedtier demo`` when Mosquitto is not installed, and by tests. QoS 0, 1 and 2,
    retained messages, wills, persistent in-memory sessions, an optional Mosquitto-style ACL
    and password file (``passwords``: then only its users may connect); no TLS. ``host`` is an
    address or name to bind; with ``port=0`` every address it resolves to listens on the same
    free port, which :attr:`port` reports once :meth:`start` returns. ``limits`` bounds what
    clients can make it hold (defaults in :class:`~.limits.BrokerLimits`); keyword
    ``overrides`` replace single limits, e.g. ``max_packet_size=4096``.

    >>> with EmbeddedBroker() as broker:   # port 0: the OS picks a free port
    ...     port = broker.port
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 limits: BrokerLimits = DEFAULT_LIMITS, acl: AccessList | None = None,
                 passwords: PasswordFile | None = None, **overrides: int | None) -> None:
        try:
            limits = replace(limits, **overrides)  # type: ignore[arg-type]  # checked by BrokerLimits
        except TypeError as exc:
            raise ConfigError(f"unknown broker limit in {sorted(overrides)}: {exc}") from None
        self._host = host
        self._requested_port = port
        self._config = BrokerConfig(limits=limits, acl=acl, passwords=passwords)
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._core: Broker | None = None
        self._shared: _Shared | None = None

    @property
    def limits(self) -> BrokerLimits:
        return self._config.limits

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with port 0)."""
        if self._port is None:
            raise LocalProtocolError("the broker is not started")
        return self._port

    @property
    def host(self) -> str:
        return self._host

    def start(self) -> EmbeddedBroker:
        """Bind, start serving on a daemon thread, and return once the socket listens."""
        with self._lock:
            if self._thread is not None:
                raise LocalProtocolError("the broker was already started")
            self._thread = threading.Thread(target=self._run, name="fedtier-embedded-broker",
                                            daemon=True)
            self._thread.start()
        if not self._ready.wait(START_TIMEOUT):
            raise TimeoutError(f"embedded broker did not start within {START_TIMEOUT} s")
        if self._startup_error is not None:
            self._thread.join()
            raise self._startup_error
        logger.info("listening on %s:%d", self._host, self.port)
        return self

    def stop(self) -> None:
        """Close the listener and every connection, then join the thread. Idempotent."""
        with self._lock:
            if self._stopped or self._thread is None:
                self._stopped = True
                return
            self._stopped = True
            loop, thread = self._loop, self._thread
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(timeout=10.0)
            if thread.is_alive():
                logger.warning("embedded broker thread did not stop within 10 s")

    def online_clients(self, timeout: float = 5.0) -> list[str]:
        """Ids of the clients connected right now, read on the broker's own thread.

        Raises:
            LocalProtocolError: the broker is not running.
        """
        loop, core = self._loop, self._core
        if loop is None or core is None or self._stopped or loop.is_closed():
            raise LocalProtocolError("the broker is not running")
        done: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
        loop.call_soon_threadsafe(lambda: done.set_result(core.online_clients()))
        return done.result(timeout)

    def stats(self, timeout: float = 5.0) -> dict[str, int]:
        """The core's counters (:meth:`Broker.stats`) plus open connections, the bytes waiting
        in their output buffers, the bytes of partial packets held, the connections not read
        until some are given back, and the connections closed to make room (``evicted_stalled``:
        partial packets stalled while others waited; ``evicted_unconnected``: no CONNECT yet
        when a new socket needed the slot), read on the broker's own thread.

        Raises:
            LocalProtocolError: the broker is not running.
        """
        loop, core, shared = self._loop, self._core, self._shared
        if loop is None or core is None or shared is None or self._stopped or loop.is_closed():
            raise LocalProtocolError("the broker is not running")
        done: concurrent.futures.Future[dict[str, int]] = concurrent.futures.Future()

        def read() -> None:
            connections = shared.connections
            stats = core.stats()
            stats["connections"] = len(connections)
            stats["output_bytes"] = sum(c.output_bytes for c in connections)
            stats["max_output_bytes"] = max((c.output_bytes for c in connections), default=0)
            stats["input_bytes"] = sum(c.partial_bytes for c in connections)
            stats["input_total_used"] = shared.input.used
            stats["input_waiting"] = len(shared.waiting)
            stats.update(shared.counters)
            done.set_result(stats)

        loop.call_soon_threadsafe(read)
        return done.result(timeout)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    # --- loop thread -------------------------------------------------------------------------

    async def _listen(self, factory: Callable[[], asyncio.BaseProtocol]) -> asyncio.Server:
        """Bind the listener. With port 0, every address the host resolves to (``localhost``
        is often 127.0.0.1 *and* ::1) must share the one port :attr:`port` reports, whereas
        asyncio would give each its own; so pick the first one's port and rebind all."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(factory, self._host, self._requested_port)
        for _attempt in range(5):
            ports = {sock.getsockname()[1] for sock in server.sockets}
            if len(ports) == 1:
                return server
            port = server.sockets[0].getsockname()[1]
            server.close()
            await server.wait_closed()
            try:
                server = await loop.create_server(factory, self._host, port)
            except OSError:  # another address family has that port taken: try a new one
                server = await loop.create_server(factory, self._host, 0)
        raise OSError(f"could not bind all addresses of {self._host!r} to one port")

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        broker = Broker(self._config, call_later=loop.call_later)
        shared = _Shared(broker, loop)
        connections = shared.connections
        self._core, self._shared = broker, shared
        try:
            server = loop.run_until_complete(self._listen(lambda: _Connection(shared)))
        except BaseException as exc:  # bind failure: hand it to start()'s caller
            self._startup_error = exc
            self._ready.set()
            loop.close()
            return
        self._port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            broker.shutdown()
            shared.cancel()
            server.close()
            for connection in list(connections):
                connection.abort()
            # Let the aborts run their connection_lost callbacks before the loop closes.
            loop.run_until_complete(asyncio.sleep(0))
            loop.run_until_complete(server.wait_closed())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            logger.info("stopped listening on %s:%d", self._host, self._port)

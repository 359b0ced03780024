"""The network shell: an asyncio server on a background thread feeding the broker core.

One event loop serves every connection. Each connection is an :class:`asyncio.Protocol`
whose ``data_received`` frames, decodes and hands packets to the core synchronously, so the
core's state is only ever touched from the loop thread. Writes go straight into the
transport's buffer: a slow subscriber never blocks a publisher or the loop. Above
``max_output_backlog`` unsent bytes the transport pauses the connection's writing: QoS 0
messages to it are dropped and QoS 1/2 messages wait in its session until it drains.

Limits (:mod:`.limits`) are enforced here before anything is buffered: a socket over the
connection limits is closed at once; until CONNECT is accepted the framer refuses a packet
announcing more than ``max_connect_size`` as soon as its fixed header is in, afterwards more
than ``max_packet_size``; partial packets are charged to the broker's byte budget, and a
connection the budget cannot hold is closed.

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
from fedtier.embedded_broker.limits import DEFAULT_LIMITS, BrokerLimits, ConnectionGate
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
from fedtier.errors import ConfigError, LocalProtocolError

logger = logging.getLogger("fedtier.embedded_broker")

CONNECT_TIMEOUT = 10.0
"""Seconds a new connection may take to send CONNECT before it is dropped."""
CLOSE_GRACE = 5.0
"""Seconds a closing connection gets to flush its output before it is aborted."""
START_TIMEOUT = 10.0
"""Seconds :meth:`EmbeddedBroker.start` waits for the listener to come up."""


class _Connection(asyncio.Protocol, ServerLink):
    """One client connection: framing, decoding, keep-alive, and the write side of a link."""

    def __init__(self, broker: Broker, connections: set[_Connection], gate: ConnectionGate,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._broker = broker
        self._limits = broker.config.limits
        self._connections = connections
        self._gate = gate
        self._loop = loop
        # Until CONNECT is accepted, a peer may announce only a small packet.
        self._framer = PacketFramer(self._limits.connect_limit)
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._address: str | None = None
        """The peer's address while it counts against the connection limits."""
        self._held_input = 0
        """Bytes of partial packets charged to the broker's budget."""
        self._paused = False
        self._closing = False
        self._last_received = loop.time()
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
        refused = self._gate.admit(address)
        if refused is not None:
            logger.warning("%s: connection refused: %s", self._peer, refused)
            self._closing = True
            transport.abort()
            return
        self._address = address
        self._connections.add(self)
        high = self._limits.max_output_backlog
        transport.set_write_buffer_limits(high=high, low=high // 4)
        self._timer = self._loop.call_later(CONNECT_TIMEOUT, self._connect_timeout)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self.session is not None and self.session.link is self and not self._closing:
            self.session.pump()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._last_received = self._loop.time()
        self._framer.feed(data)
        try:
            if not self.connected and self._framer.peek_packet_type() not in (
                    None, PacketType.CONNECT):
                # [MQTT-3.1.0-1]: the first packet must be CONNECT. Checked on the first byte
                # so a non-MQTT peer (an HTTP probe, say) is dropped at once.
                raise ProtocolViolationError("first packet is not CONNECT")
            while not self._closing:
                frame = self._framer.next_frame()
                if frame is None:
                    break
                packet = decode_packet(frame, self.protocol_level)
                self._broker.handle_packet(self, packet)
                if isinstance(packet, Connect) and self.connected:
                    self._framer.max_packet_size = self._limits.max_packet_size
                    self._start_keep_alive(packet.keep_alive)
            self._charge_input()
        except UnsupportedProtocolVersionError as exc:
            self._refuse_protocol_version(exc)
        except PacketTooLargeError as exc:
            logger.warning("%s: %s; disconnecting", self._describe(), exc)
            self.close(exc.reason_code)
        except MqttProtocolError as exc:
            logger.warning("%s: protocol error (%s): %s; disconnecting",
                           self._describe(), exc.reason, exc)
            self.close(exc.reason_code)
        except Exception:
            logger.exception("%s: unexpected error while handling a packet; disconnecting",
                             self._describe())
            self.close(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)

    def eof_received(self) -> bool:
        return False  # half-closed is closed: let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        for timer in (self._timer, self._abort_timer):
            if timer is not None:
                timer.cancel()
        self._connections.discard(self)
        if self._address is not None:
            self._gate.leave(self._address)
            self._address = None
        self._release()

    # --- ClientLink ----------------------------------------------------------------------------

    def send_packet(self, packet: Packet) -> bool:
        if self._closing or self._transport is None:
            return False
        data = encode_packet(packet, self.protocol_level)
        limit = self.maximum_packet_size
        if limit is not None and len(data) > limit:
            # §3.1.2.11.4 [MQTT-3.1.2-25]: never send a v5 client more than it declared;
            # the message is discarded for this client as if it had been delivered.
            what = f"message on {packet.topic!r}" if isinstance(packet, Publish) else (
                type(packet).__name__)
            logger.warning("%s: not sending %s: %d bytes exceed the client's maximum packet "
                           "size %d", self._describe(), what, len(data), limit)
            return False
        self._transport.write(data)
        return True

    def writable(self) -> bool:
        return not self._paused and not self._closing

    @property
    def output_bytes(self) -> int:
        """Bytes written for this client but not yet sent."""
        return 0 if self._transport is None else self._transport.get_write_buffer_size()

    def close(self, reason_code: int | None = None) -> None:
        if self._closing or self._transport is None:
            return
        if reason_code is not None and self.connected and self.protocol_level == MQTT_5:
            self.send_packet(Disconnect(reason_code))
        self._closing = True
        self._framer.clear()  # a refused packet's bytes are not kept until the socket is gone
        self._transport.close()  # stops reading; flushes what is buffered, then closes
        self._abort_timer = self._loop.call_later(CLOSE_GRACE, self._transport.abort)
        # Release the session and fire the will now, not at connection_lost: a client that
        # reconnects at once must find its session detached and its will already handled.
        self._release()

    def abort(self) -> None:
        """Drop the connection now, unsent data included (broker shutdown)."""
        self._closing = True
        if self._transport is not None:
            self._transport.abort()

    def _charge_input(self) -> None:
        """Charge the partial packet still buffered to the byte budget; over it, disconnect."""
        held = self._framer.buffered
        delta = held - self._held_input
        if delta > 0 and not self._broker.budget.take(delta):
            raise QuotaExceededError(
                f"{held} buffered bytes exceed the broker's buffer budget "
                f"({self._broker.budget.used} of {self._broker.budget.limit} in use)")
        if delta < 0:
            self._broker.budget.give_back(-delta)
        self._held_input = held

    def _release(self) -> None:
        """Tell the core this link is finished. Safe to call twice (close, then lost)."""
        if self._held_input:
            self._broker.budget.give_back(self._held_input)
            self._held_input = 0
        try:
            self._broker.link_closed(self)
        except Exception:
            logger.exception("%s: error while cleaning up after disconnect", self._describe())

    # --- timers ------------------------------------------------------------------------------

    def _connect_timeout(self) -> None:
        if not self.connected:
            logger.info("%s: no CONNECT within %.0f s; closing", self._describe(), CONNECT_TIMEOUT)
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
        idle = self._loop.time() - self._last_received
        if idle >= self._keep_alive_limit:
            logger.info("%s: keep alive expired after %.1f s; disconnecting",
                        self._describe(), idle)
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
        logger.info("%s: %s; refusing", self._describe(), exc)
        self.protocol_level = MQTT_311
        self.send_packet(ConnAck(ConnectReturnCode.UNACCEPTABLE_PROTOCOL_VERSION))
        self.close()

    def _describe(self) -> str:
        return f"client {self.client_id!r} ({self._peer})" if self.client_id else self._peer


class EmbeddedBroker:
    """A pure-Python MQTT 3.1.1/5.0 broker serving on a daemon thread.

    Used by ``fedtier demo`` when Mosquitto is not installed, and by tests. QoS 0, 1 and 2,
    retained messages, wills, persistent in-memory sessions, an optional Mosquitto-style ACL;
    no TLS, no passwords. ``host`` is an address or name to bind; with ``port=0`` every
    address it resolves to listens on the same free port, which :attr:`port` reports once
    :meth:`start` returns. ``limits`` bounds what clients can make it hold (defaults in
    :class:`~.limits.BrokerLimits`); keyword ``overrides`` replace single limits, e.g.
    ``max_packet_size=4096``.

    >>> with EmbeddedBroker() as broker:   # port 0: the OS picks a free port
    ...     port = broker.port
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 limits: BrokerLimits = DEFAULT_LIMITS, acl: AccessList | None = None,
                 **overrides: int | None) -> None:
        try:
            limits = replace(limits, **overrides)  # type: ignore[arg-type]  # checked by BrokerLimits
        except TypeError as exc:
            raise ConfigError(f"unknown broker limit in {sorted(overrides)}: {exc}") from None
        self._host = host
        self._requested_port = port
        self._config = BrokerConfig(limits=limits, acl=acl)
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._core: Broker | None = None
        self._connections: set[_Connection] = set()

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
        """The core's counters (:meth:`Broker.stats`) plus open connections and the bytes
        waiting in their output buffers, read on the broker's own thread.

        Raises:
            LocalProtocolError: the broker is not running.
        """
        loop, core, connections = self._loop, self._core, self._connections
        if loop is None or core is None or self._stopped or loop.is_closed():
            raise LocalProtocolError("the broker is not running")
        done: concurrent.futures.Future[dict[str, int]] = concurrent.futures.Future()

        def read() -> None:
            stats = core.stats()
            stats["connections"] = len(connections)
            stats["output_bytes"] = sum(c.output_bytes for c in connections)
            stats["max_output_bytes"] = max((c.output_bytes for c in connections), default=0)
            done.set_result(stats)

        loop.call_soon_threadsafe(read)
        return done.result(timeout)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    # --- loop thread -------------------------------------------------------------------------

    async def _listen(self, factory: Callable[[], asyncio.Protocol]) -> asyncio.Server:
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
        connections = self._connections
        broker = Broker(self._config, call_later=loop.call_later)
        gate = ConnectionGate(self._config.limits)
        self._core = broker
        try:
            server = loop.run_until_complete(self._listen(
                lambda: _Connection(broker, connections, gate, loop)))
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
            server.close()
            for connection in list(connections):
                connection.abort()
            # Let the aborts run their connection_lost callbacks before the loop closes.
            loop.run_until_complete(asyncio.sleep(0))
            loop.run_until_complete(server.wait_closed())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            logger.info("stopped listening on %s:%d", self._host, self._port)

"""Many emulated devices on one thread: their MQTT sockets multiplexed with ``selectors`` (epoll).

Why: the threaded host (``emulator._DeviceHost``) gives every device a node thread, paho's
network thread and a watcher: about 3,000 threads for 1,000 devices, which on 2 cores starve each
other (the GIL hands over every 5 ms, keep-alives are missed, a round takes minutes to start). Here
one thread per worker process does, in turn, for all of its devices what those threads do: read
what the sockets have (``loop_read``), hand each device's inbound messages to its node in order and
acknowledge them after (as ``run_loop`` does), tick the nodes, write what is queued
(``loop_write``) and keep the connections alive (``loop_misc``). The nodes, transports and trainers
are exactly those ``fedtier agent run`` builds; only who drives them differs. epoll also lifts
paho's own ``select`` limit (descriptors below 1024), so a worker may host more than 120 devices.

Under availability traces (``RealTimeTraces``, ``fleet emulate --availability``) the mux is also the
devices' world: a device whose window closes loses its connection and stops (no messages handled,
no ticks) until its window opens, when it reconnects; and a local training holds the device for its
trace's extra seconds (``_Device.busy_until``) without holding the thread, as a device computing on
its own CPU does: what it publishes meanwhile (its update) goes out when the time is up, and the
messages that arrive meanwhile wait, unacknowledged, until then. Its connection is kept alive
meanwhile (a real agent's network thread does that while its main thread trains).

Going offline drops the socket (``_leave``): the broker sees the connection end without a
DISCONNECT, publishes the device's ``offline`` will at once and keeps its session, as for a board
that loses power or walks out of range (a clean DISCONNECT would tell the broker to drop the will,
and the edge would not learn that the device left). Coming back is an ordinary reconnect: the same
persistent session (what was queued for it while away is delivered, what it had in flight is resent),
its ``online`` presence, upon which its edge gives it work again (``resend``).
"""

from __future__ import annotations

import heapq
import logging
import queue
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import paho.mqtt.client as paho

if TYPE_CHECKING:
    from local_fleet.realtime_traces import RealTimeTraces

log = logging.getLogger("fedtier.fleet")

TICK_S = 0.5
"""How often each node's ``tick`` runs. An agent on its own CPU ticks every 0.1 s (``run_loop``); here
thousands share one thread, and ticking each ten times a second cost a 2,000-device worker a fifth of
its time. Half a second is far below the shortest timer a device keeps (``ARTIFACT_RETRY_S``, 5 s);
messages are handled as they arrive, whatever the tick."""
MISC_S = 1.0
"""How often keep-alives are checked (``loop_misc``)."""
RECONNECT_S = 2.0
"""Wait before reconnecting a device whose connection dropped."""
LEAVE_READS = 1000
"""Reads of a dropped socket at most before paho sees its end (each takes what arrived before it)."""


@dataclass
class _Device:
    name: str
    node: Any
    tx: Any  # MqttTransport
    inbox: "queue.Queue[Any]"
    next_tick: float = 0.0
    down_since: float | None = None
    sock: Any = None
    errors: list[BaseException] = field(default_factory=list)
    away: bool = False
    """Offline by its availability trace: not connected, not served, until its window opens."""
    busy_until: float = 0.0
    """Training (its trace's extra seconds) until this instant: its messages wait, its publishes are held."""
    held: list[tuple[str, bytes, bool, Any]] = field(default_factory=list)


class MuxHost:
    """Device nodes of one worker process, driven by one thread (``run``).

    Each pass of the loop serves only the devices that have something to do: those whose socket had
    data, whose tick is due, or whose output is still queued. Scanning every device on every pass, as
    this loop once did, cost thousands of devices x every message a worker received, and made the
    10,000-device emulation spend most of a round in the loop itself."""

    def __init__(self, traces: "RealTimeTraces | None" = None) -> None:
        self.traces = traces
        """Availability and speed in real time (``fleet emulate --availability``); None: always online."""
        self._changes: list[tuple[float, int, _Device]] = []  # heap: (a window opens or closes, order, device)
        self._busy: list[tuple[float, int, _Device]] = []  # heap: (a training's extra time ends, order, device)
        self._dropping = False  # a trace is taking a device offline: its transport's warning is expected
        self._quiet = _DroppedFilter(self)
        self.selector = selectors.DefaultSelector()
        self.devices: list[_Device] = []
        self._ticks: list[tuple[float, int, _Device]] = []  # heap: (next tick, order, device)
        self._ready: dict[int, _Device] = {}  # served on the next pass, by id(), in arrival order
        self._crashed: list[_Device] = []
        self._next_misc = time.monotonic() + MISC_S

    def add(self, name: str, node: Any, tx: Any, inbox: "queue.Queue[Any]") -> None:
        """Start ``node`` and connect ``tx`` (not yet started) without a network thread."""
        now = time.monotonic()
        node.start(now)
        for pending in tx.pending_complete():
            inbox.put(pending)
        tx.start(external_loop=True)
        dev = _Device(name, node, tx, inbox, next_tick=now)
        self.devices.append(dev)
        heapq.heappush(self._ticks, (now, len(self.devices), dev))
        self._ready[id(dev)] = dev
        if self.traces is not None:
            self._follow_trace(dev, len(self.devices))
            dev.away = not self.traces.online(name, now)
            heapq.heappush(self._changes, (self.traces.next_change(name, now), len(self.devices), dev))
            if dev.away:
                return
        self._connect(dev, now)

    def _follow_trace(self, dev: _Device, order: int) -> None:
        """Make ``dev``'s local training take its trace's extra time: after its computation, the device is busy
        until then, and what it publishes in the meantime is held (``_release``)."""
        assert self.traces is not None
        delay = self.traces.train_delay_s(dev.name)
        train, publish = dev.node.train, dev.tx.publish

        def timed_train(trainer: Any, action: Any) -> Any:
            result = train(trainer, action)
            dev.busy_until = time.monotonic() + delay
            heapq.heappush(self._busy, (dev.busy_until, order, dev))
            return result

        def held_publish(topic: str, payload: bytes, *, retain: bool = False, on_done: Any = None) -> int:
            if time.monotonic() < dev.busy_until:
                dev.held.append((topic, payload, retain, on_done))
                return 0
            return int(publish(topic, payload, retain=retain, on_done=on_done))

        dev.node.train = timed_train
        dev.tx.publish = held_publish

    def _connect(self, dev: _Device, now: float) -> None:
        try:
            rc = dev.tx.client.reconnect()
        except OSError as exc:
            log.warning("device %s: cannot connect (%s); retrying in %g s", dev.name, exc, RECONNECT_S)
            dev.down_since = now
            return
        if rc != paho.MQTT_ERR_SUCCESS:
            dev.down_since = now
            return
        dev.sock = dev.tx.client.socket()
        self.selector.register(dev.sock, selectors.EVENT_READ, dev)
        dev.down_since = None
        self._ready[id(dev)] = dev  # CONNECT is queued

    def _leave(self, dev: _Device, now: float) -> None:
        """The device's window closed: drop its socket (see the module docstring) and stop serving it."""
        dev.away = True
        sock = dev.sock
        self._lost(dev, now)
        dev.down_since = None  # not to be reconnected until its window opens
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._dropping = True
        try:
            for _ in range(LEAVE_READS):  # what arrived before the end goes to the inbox, handled on its return
                if dev.tx.client.loop_read() != paho.MQTT_ERR_SUCCESS:
                    break  # paho read the end: it closed the socket and the transport noted the loss
        finally:
            self._dropping = False

    def _arrive(self, dev: _Device, now: float) -> None:
        """The device's window opened: reconnect it (its persistent session resumes) and serve it again."""
        dev.away = False
        self._ready[id(dev)] = dev
        self._connect(dev, now)

    def _due_changes(self, now: float) -> None:
        """Act on the windows that opened or closed; each device's state is read from its trace at ``now``, so
        a loop that fell behind by more than a window does not invert it."""
        assert self.traces is not None
        while self._changes and self._changes[0][0] <= now:
            _, order, dev = heapq.heappop(self._changes)
            online = self.traces.online(dev.name, now)
            if online and dev.away:
                self._arrive(dev, now)
            elif not online and not dev.away:
                self._leave(dev, now)
            heapq.heappush(self._changes, (self.traces.next_change(dev.name, now), order, dev))
        while self._busy and self._busy[0][0] <= now:
            _, _, dev = heapq.heappop(self._busy)
            self._ready[id(dev)] = dev  # its training's time is up: _serve releases what it held

    def _release(self, dev: _Device) -> None:
        """Hand what the device published while it trained to its transport (queued there while offline)."""
        held, dev.held = dev.held, []
        for topic, payload, retain, on_done in held:
            dev.tx.publish(topic, payload, retain=retain, on_done=on_done)

    def _lost(self, dev: _Device, now: float) -> None:
        if dev.sock is not None:
            try:
                self.selector.unregister(dev.sock)
            except (KeyError, ValueError):
                pass
            dev.sock = None
        dev.down_since = now

    def run(self, stop: Callable[[], bool]) -> None:
        """Drive every device until ``stop()``; a node that raises is recorded and no longer driven."""
        while not stop():
            self.run_once()

    def run_once(self, wait: bool = True) -> None:
        """One pass: read what arrived, serve the devices with work, keep the connections alive. The
        worker also calls it between building devices (``wait=False``), or the first of thousands would
        miss their CONNACK and keep-alives while the last are built, and the broker would drop them."""
        timeout = 0.0 if self._ready or not wait else self._until_next_tick(time.monotonic())
        for key, _ in self.selector.select(timeout=timeout):
            dev = key.data
            if dev.tx.client.loop_read() != paho.MQTT_ERR_SUCCESS:
                self._lost(dev, time.monotonic())
            self._ready[id(dev)] = dev
        now = time.monotonic()
        self._due_ticks(now)
        if self.traces is not None:
            self._due_changes(now)
        ready, self._ready = self._ready, {}
        for dev in ready.values():
            if dev.errors:
                continue
            try:
                self._serve(dev, now)
            except Exception as exc:  # noqa: BLE001 - reported by errors()
                log.exception("device %s crashed", dev.name)
                dev.errors.append(exc)
                self._crashed.append(dev)
        if now >= self._next_misc:
            self._next_misc = now + MISC_S
            self._keep_alive(now)

    def _until_next_tick(self, now: float) -> float:
        due = [heap[0][0] for heap in (self._ticks, self._changes, self._busy) if heap]
        return min([0.02] + [max(0.0, t - now) for t in due])

    def _due_ticks(self, now: float) -> None:
        while self._ticks and self._ticks[0][0] <= now:
            _, order, dev = heapq.heappop(self._ticks)
            self._ready[id(dev)] = dev
            heapq.heappush(self._ticks, (now + TICK_S, order, dev))

    def _keep_alive(self, now: float) -> None:
        for dev in self.devices:
            if dev.sock is not None:
                if dev.tx.client.loop_misc() != paho.MQTT_ERR_SUCCESS:
                    self._lost(dev, now)
                elif dev.tx.client.want_write():
                    self._ready[id(dev)] = dev  # a PINGREQ is queued
            elif dev.down_since is not None and not dev.away and now - dev.down_since >= RECONNECT_S:
                self._connect(dev, now)

    def _serve(self, dev: _Device, now: float) -> None:
        if dev.away:
            return
        if dev.busy_until <= now:
            if dev.held:
                self._release(dev)
            self._work(dev, now)
        client = dev.tx.client
        if dev.sock is not None and client.want_write():
            if client.loop_write() != paho.MQTT_ERR_SUCCESS:
                self._lost(dev, now)
            elif client.want_write():
                self._ready[id(dev)] = dev  # the socket took part of it: the rest on the next pass

    def _work(self, dev: _Device, now: float) -> None:
        """Handle the device's messages and tick it, as ``run_loop`` does; a training that holds it (its trace's
        extra time) leaves the rest of its messages for when it is done."""
        while dev.busy_until <= now:
            try:
                inbound = dev.inbox.get_nowait()
            except queue.Empty:
                break
            dev.node.handle(inbound, now)
            inbound.confirm()  # after handling, as run_loop does: a crash leaves it with the broker
        if now >= dev.next_tick and dev.busy_until <= now:
            dev.node.tick(now)
            dev.next_tick = now + TICK_S

    def errors(self) -> list[str]:
        return [f"node {d.name} crashed: {d.errors[0]!r}" for d in self._crashed]

    def close(self) -> None:
        """Publish every device's ``offline`` presence and disconnect."""
        logging.getLogger("fedtier.transport.mqtt").removeFilter(self._quiet)
        for dev in self.devices:
            try:
                dev.tx.stop()
                if dev.sock is not None:
                    dev.tx.client.loop_write()
            except Exception:  # noqa: BLE001 - closing: the broker's will covers a device we cannot close
                log.debug("device %s: unclean close", dev.name, exc_info=True)
        self.selector.close()


class _DroppedFilter(logging.Filter):
    """Keeps the transport's "connection lost" warning of a device its trace takes offline out of the log (it
    is the trace, not a fault); logged at DEBUG instead. Installed by ``MuxHost`` under traces."""

    def __init__(self, host: MuxHost) -> None:
        super().__init__()
        self.host = host
        if host.traces is not None:
            logging.getLogger("fedtier.transport.mqtt").addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.host._dropping and record.levelno > logging.DEBUG:
            log.debug("offline by its trace: %s", record.getMessage())
            return False
        return True

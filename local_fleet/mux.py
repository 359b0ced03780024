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
"""

from __future__ import annotations

import heapq
import logging
import queue
import selectors
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import paho.mqtt.client as paho

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


class MuxHost:
    """Device nodes of one worker process, driven by one thread (``run``).

    Each pass of the loop serves only the devices that have something to do: those whose socket had
    data, whose tick is due, or whose output is still queued. Scanning every device on every pass, as
    this loop once did, cost thousands of devices x every message a worker received, and made the
    10,000-device emulation spend most of a round in the loop itself."""

    def __init__(self) -> None:
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
        self._connect(dev, now)

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
        if not self._ticks:
            return 0.02
        return min(0.02, max(0.0, self._ticks[0][0] - now))

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
            elif dev.down_since is not None and now - dev.down_since >= RECONNECT_S:
                self._connect(dev, now)

    def _serve(self, dev: _Device, now: float) -> None:
        while True:
            try:
                inbound = dev.inbox.get_nowait()
            except queue.Empty:
                break
            dev.node.handle(inbound, now)
            inbound.confirm()  # after handling, as run_loop does: a crash leaves it with the broker
        if now >= dev.next_tick:
            dev.node.tick(now)
            dev.next_tick = now + TICK_S
        client = dev.tx.client
        if dev.sock is not None and client.want_write():
            if client.loop_write() != paho.MQTT_ERR_SUCCESS:
                self._lost(dev, now)
            elif client.want_write():
                self._ready[id(dev)] = dev  # the socket took part of it: the rest on the next pass

    def errors(self) -> list[str]:
        return [f"node {d.name} crashed: {d.errors[0]!r}" for d in self._crashed]

    def close(self) -> None:
        """Publish every device's ``offline`` presence and disconnect."""
        for dev in self.devices:
            try:
                dev.tx.stop()
                if dev.sock is not None:
                    dev.tx.client.loop_write()
            except Exception:  # noqa: BLE001 - closing: the broker's will covers a device we cannot close
                log.debug("device %s: unclean close", dev.name, exc_info=True)
        self.selector.close()

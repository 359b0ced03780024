"""Running a node as a long-lived process over MQTT: start, loop, stop on a signal.

The node and its transports are built by the role's ``run`` module; this is the common
tail: start the node (subscriptions, replay of durable state), start the connections,
run the single processing thread until the node is done or SIGINT/SIGTERM arrives, then
close the connections cleanly (publishing ``offline`` presence).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from typing import Callable, Sequence

from fedtier.runtime.node_base import Node, run_loop
from fedtier.transport.base import Inbound
from fedtier.transport.mqtt import MqttTransport

log = logging.getLogger("fedtier.runtime.mqtt_service")


def run(node: Node, transports: Sequence[MqttTransport], inbox: "queue.Queue[Inbound]", *,
        start: Callable[[float], None], stop: threading.Event | None = None,
        done: Callable[[], bool] = lambda: False, install_signals: bool = True) -> int:
    """Run until ``done()`` or ``stop`` is set (or a signal). Returns a process exit code."""
    stop = stop or threading.Event()
    if install_signals and threading.current_thread() is threading.main_thread():
        def _stop(signum: int, frame: object) -> None:
            log.info("signal %s: stopping", signal.Signals(signum).name)
            stop.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
    start(time.monotonic())
    for t in transports:
        for pending in t.pending_complete():  # whole messages a crash left in a durable chunk store
            inbox.put(pending)
        t.start()
    watcher = threading.Thread(target=_watch, args=(stop, done), daemon=True)
    watcher.start()
    try:
        run_loop(node, inbox, stop)
    finally:
        for t in transports:
            t.stop()
    return 0


def _watch(stop: threading.Event, done: Callable[[], bool]) -> None:
    while not stop.is_set():
        if done():
            stop.set()
            return
        time.sleep(0.05)

"""Running a node as a long-lived process over MQTT: start, loop, stop on a signal.

The node and its transports are built by the role's ``run`` module; this is the common
tail: start the node (subscriptions, replay of durable state), start the connections,
run the single processing thread until the node is done or SIGINT/SIGTERM arrives, then
close the connections cleanly (publishing ``offline`` presence).

Exit codes (what ``fedtier agent|edge|coordinator run`` exits with, for a supervisor to act on):

* ``0`` — stopped by a signal, or the coordinator's rollout ended;
* ``1`` — an unexpected error (a traceback is logged);
* ``77`` (``EXIT_UNAUTHORIZED``, sysexits' EX_NOPERM) — this node's credentials do not work
  and retrying will not change that: its certificate is expired or not its key's, or the
  broker refused it (unknown CA, revoked) or refused what it may do (not authorized)
  ``[broker] max_auth_failures`` times in a row. The log names the cause and the fix.
  Restarting will not help until an operator acts (systemd: ``RestartPreventExitStatus=77``).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from typing import Callable, Sequence

from fedtier.runtime.metrics import Metrics
from fedtier.runtime.node_base import Node, run_loop
from fedtier.transport.base import Inbound
from fedtier.transport.mqtt import MqttTransport

log = logging.getLogger("fedtier.runtime.mqtt_service")

EXIT_UNAUTHORIZED = 77
"""The node's credentials do not work and retrying will not help (see the module docstring)."""


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
    unique = list(dict.fromkeys(transports))  # an edge may use one connection for both of its sides
    metrics = getattr(node, "metrics", None)
    if isinstance(metrics, Metrics):  # messages and bytes per tier and direction, read at scrape time
        for t in unique:
            metrics.watch(t)
    start(time.monotonic())
    for t in unique:
        for pending in t.pending_complete():  # whole messages a crash left in a durable chunk store
            inbox.put(pending)
        t.start()
    fatal = threading.Event()
    watcher = threading.Thread(target=_watch, args=(stop, done, unique, fatal), daemon=True)
    watcher.start()
    try:
        run_loop(node, inbox, stop)
    finally:
        for t in unique:
            t.stop()
    if fatal.is_set():
        return EXIT_UNAUTHORIZED
    return 0


def _watch(stop: threading.Event, done: Callable[[], bool], transports: Sequence[MqttTransport],
           fatal: threading.Event) -> None:
    while not stop.is_set():
        if done():
            stop.set()
            return
        for t in transports:
            if t.fatal is not None:
                log.error("stopping (exit code %d): %s", EXIT_UNAUTHORIZED, t.fatal.text())
                fatal.set()
                stop.set()
                return
        time.sleep(0.05)

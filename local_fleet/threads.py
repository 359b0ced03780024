"""Run a fleet's nodes as threads in one process, over a real broker.

The nodes are built exactly as ``fedtier ... run`` builds them (``build()`` of each role's
``run`` module, from the TOML files ``write_fleet`` wrote), each with its own MQTT connection;
only the process boundary is missing, so a test can look inside a node (metrics, store) while it
runs, and ``fedtier demo --algorithm hsgd`` runs a hundred agents without a hundred interpreters.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from fedtier.rollout.config import RolloutConfig
from local_fleet.configs import FleetPaths
from device_agent.config import DeviceConfig
from edge_broker.config import EdgeConfig
from fedtier.runtime import mqtt_service
from fedtier.runtime.config import load


class FleetError(AssertionError):
    """A node crashed, or the rollout did not finish in time (an ``AssertionError`` in tests)."""


@dataclass
class Running:
    name: str
    node: Any
    thread: threading.Thread
    stop: threading.Event
    errors: list[BaseException] = field(default_factory=list)


class ThreadFleet:
    def __init__(self, paths: FleetPaths) -> None:
        self.paths = paths
        self.nodes: dict[str, Running] = {}

    def _start(self, name: str, node: Any, transports: list[Any], inbox: Any, done: Any = None) -> Running:
        stop = threading.Event()
        running = Running(name, node, threading.Thread(target=lambda: None), stop)

        def target() -> None:
            try:
                mqtt_service.run(node, transports, inbox, start=node.start, stop=stop, install_signals=False,
                            done=done or (lambda: False))
            except BaseException as exc:  # surfaced by check()
                running.errors.append(exc)
                raise

        running.thread = threading.Thread(target=target, name=name, daemon=True)
        running.thread.start()
        self.nodes[name] = running
        return running

    def start_edge(self, cell: str) -> Running:
        from edge_broker.run import build

        node, transports, inbox = build(load(EdgeConfig, self.paths.edges[cell]))
        return self._start(cell, node, transports, inbox)

    def start_device(self, device: str, prepare: Callable[[Any], None] | None = None) -> Running:
        """Build and start a device; ``prepare(node)`` runs before its thread starts (a test's hooks)."""
        from device_agent.run import build

        node, tx, inbox = build(load(DeviceConfig, self.paths.devices[device]))
        if prepare is not None:
            prepare(node)
        return self._start(device, node, [tx], inbox)

    def start_coordinator(self) -> Running:
        from cloud_coordinator.run import build

        node, tx, inbox = build(load(RolloutConfig, self.paths.coordinator))
        return self._start("coordinator", node, [tx], inbox, done=lambda: node.finished)

    def start_all(self) -> None:
        for device in self.paths.devices:
            self.start_device(device)
        for cell in self.paths.edges:
            self.start_edge(cell)
        self.start_coordinator()

    def stop_node(self, name: str) -> None:
        """Stop one node as its process would end: its loop, then its store (a coordinator's releases its
        hold on the rollout), so that a node started again from the same files takes over."""
        running = self.nodes[name]
        running.stop.set()
        running.thread.join(10)
        store = getattr(running.node, "store", None)
        if store is not None:
            store.close()

    def check(self) -> None:
        for r in self.nodes.values():
            if r.errors:
                raise FleetError(f"node {r.name} crashed: {r.errors[0]!r}") from r.errors[0]

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        """Until ``predicate()`` holds, checking every node meanwhile (a crashed node fails at once).

        Raises:
            FleetError: a node crashed, or ``predicate`` did not hold within ``timeout`` seconds (naming ``what``).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check()
            if predicate():
                return
            time.sleep(0.02)
        raise FleetError(f"timed out waiting for {what} ({timeout:g} s)")

    def wait_finished(self, timeout: float) -> Any:
        coordinator = self.nodes["coordinator"]
        try:
            self.wait_until(lambda: bool(coordinator.node.finished), "the rollout to finish", timeout)
        except FleetError as exc:
            raise FleetError(f"{exc}; history: {coordinator.node.history}") from None
        coordinator.thread.join(5)
        return coordinator.node

    def stop(self) -> None:
        for r in self.nodes.values():
            r.stop.set()
        for r in self.nodes.values():
            r.thread.join(10)

    @classmethod
    def run(cls, paths: FleetPaths, timeout: float) -> Any:
        """Start every node of ``paths``, wait until the rollout finished, stop them all; the coordinator node.

        Raises:
            FleetError: a node crashed, or the rollout did not finish within ``timeout`` seconds.
        """
        fleet = cls(paths)
        try:
            fleet.start_all()
            return fleet.wait_finished(timeout)
        finally:
            fleet.stop()

"""``fedtier coordinator serve``: one long-running coordinator process for every rollout of a store.

The operator's commands (``fedtier rollout create|start|pause|resume|stop|promote|rollback``)
never talk to this process: they write rows into its store (SQLite, ``coordinator.db`` in the
state directory, or PostgreSQL) and this process polls them — a new rollout is picked up within
``SCAN_S`` seconds, a desired state within ``CloudNode.control_poll_s``. Reads
(``rollout status``, ``devices list``, ``rollout models``) come straight from the store. So the
CLI needs no port, no credentials beyond file access, and works while the coordinator is down;
the store is the one source of truth, which is also what makes a restart resume everything.

A rollout whose model fails admission (``cloud_coordinator.admission``: a stored rollout that
``rollout create`` did not admit, e.g. one of an older fedtier) is stopped with the reason in the
log and its metrics file, never started: its manifest is not published.

One MQTT connection serves every rollout: messages on a rollout's topics go to its
``CloudNode`` (an edge's presence summary, ``cell_presence``, too: its node writes the devices'
states into the service's inventory); presence goes to all of them (and into the store's device
inventory). Each node watches the connection: when it comes back, each asks its cells again for
the open round (``CloudNode._ask_again``). The
connection uses the ``[broker]`` and ``cloud_id`` of the rollouts, which ``rollout create``
keeps identical across one store.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from fedtier.rollout.config import RolloutConfig
from cloud_coordinator.admission import ModelRefused
from cloud_coordinator.node import CloudNode, write_json_atomic
from cloud_coordinator.presence import PresenceBuffer
from cloud_coordinator.store import CoordinatorStore
from cloud_coordinator.store_backend import RolloutHeldError
from fedtier.errors import UnexpectedMessageError
from fedtier.runtime import identity, mqtt_service
from fedtier.runtime.metrics import Metrics
from fedtier.runtime.node_base import NodeBase
from fedtier.transport import topics
from fedtier.transport.base import Inbound, Transport

log = logging.getLogger("fedtier.coordinator")

SCAN_S = 1.0
"""How often the service looks for rollouts created since it started."""
SERVED = ("created", "running", "paused")
"""Rollout statuses the service hosts (finished and stopped ones are over)."""


def stored_config(row: dict[str, Any]) -> RolloutConfig:
    """A rollout's config as ``rollout create`` stored it (plain data, paths already absolute)."""
    return RolloutConfig.from_mapping(row["config"], source=f"rollout {row['rollout']} (stored config)")


class CoordinatorService(NodeBase):
    """Hosts a ``CloudNode`` per served rollout of ``store`` over one transport."""

    def __init__(self, *, store: CoordinatorStore, transport: Transport, cloud_id: str,
                 make_node: Callable[[RolloutConfig], CloudNode], metrics: Metrics | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        super().__init__(cloud_id, metrics or Metrics(node=cloud_id, role="cloud"), log, 256 << 20)
        self.store = store
        self.tx = transport
        self.make_node = make_node
        self.wall_clock = wall_clock
        self.nodes: dict[str, CloudNode] = {}
        self.presence = PresenceBuffer(store)
        self.held_elsewhere: set[str] = set()
        """Rollouts another coordinator drives (warned once; retried every scan)."""
        self._next_scan = 0.0

    def start(self, now: float) -> None:
        self.tx.subscribe(topics.edge_up_filter())
        self.tx.subscribe(topics.ALL_STATUS)
        self.tx.subscribe(topics.ALL_CELL_STATUS)
        self._scan(now)

    def _scan(self, now: float) -> None:
        self._next_scan = now + SCAN_S
        for row in self.store.rollout_rows():
            rollout = row["rollout"]
            if rollout in self.nodes or row["status"] not in SERVED:
                continue
            try:
                node = self.make_node(stored_config(row))
            except RolloutHeldError as exc:
                if rollout not in self.held_elsewhere:
                    log.warning("%s", exc)
                    self.held_elsewhere.add(rollout)
                continue
            except ModelRefused as exc:
                self._refuse(row, exc)
                continue
            self.held_elsewhere.discard(rollout)
            node.presence = None  # this service records every node's presence once, for all its rollouts
            node.inventory = self.presence  # and the devices' states from the edges' summaries
            log.info("hosting rollout %s (%s)", rollout, row["status"])
            self.nodes[rollout] = node
            self.metrics.include(node.metrics)  # one scrape: the service's series and each rollout's
            node.start(now)

    def _refuse(self, row: dict[str, Any], exc: ModelRefused) -> None:
        """A rollout whose model fails admission is stopped with the reason, never started (its manifest is
        never published): the reason goes to the log and to its metrics file, as a stop's reason does."""
        rollout = row["rollout"]
        log.error("rollout %s stopped before it started: %s", rollout, exc.message)
        self.store.set_desired(rollout, "stopped")
        self.store.set_status(rollout, "stopped")
        cfg = stored_config(row)
        try:
            write_json_atomic(cfg.metrics_path, {"rollout": rollout, "algorithm": cfg.algorithm,
                                                 "rounds_planned": cfg.rounds, "finished": True, "rounds": [],
                                                 "stopped": f"model refused: {exc.message}"})
        except OSError as err:
            log.warning("cannot write the metrics file of rollout %s: %s", rollout, err)

    def tick(self, now: float) -> None:
        self.presence.flush_due(now)
        if now >= self._next_scan:
            self._scan(now)
        for rollout, node in list(self.nodes.items()):
            node.tick(now)
            if node.done:
                log.info("rollout %s is %s: no longer hosted", rollout, self.store.status(rollout))
                del self.nodes[rollout]
                self.metrics.exclude(node.metrics)

    def handle(self, inbound: Inbound, now: float) -> None:
        parsed = self.parse_topic(inbound)
        if parsed is None:
            return
        if parsed.channel == "status":
            if self.stale_presence(parsed):
                return
            self._record_presence(inbound, parsed)
            for hosted in list(self.nodes.values()):
                hosted.handle(inbound, now)
            return
        node = self.nodes.get(parsed.rollout or "")
        if node is None:
            if parsed.channel == "edge_up":
                self.reject(inbound, UnexpectedMessageError(f"message for rollout {parsed.rollout!r}, which this "
                                                            "coordinator does not serve"))
            return
        node.handle(inbound, now)

    def _record_presence(self, inbound: Inbound, parsed: topics.Topic) -> None:
        if parsed.device is None or not inbound.payload:
            return
        try:
            doc = json.loads(inbound.payload.decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return
        if isinstance(doc, dict) and doc.get("node", parsed.device) == parsed.device:
            self.presence.add(parsed.device, doc, self.wall_clock())


def wait_for_rollout(store: CoordinatorStore, stop: threading.Event, poll_s: float = 1.0) -> dict[str, Any] | None:
    """The first served rollout of the store (its broker settings open the connection); waits for one."""
    said = False
    while not stop.is_set():
        rows = [r for r in store.rollout_rows() if r["status"] in SERVED] or store.rollout_rows()
        if rows:
            return rows[0]
        if not said:
            log.info("no rollout in the store yet: waiting for `fedtier rollout create`")
            said = True
        stop.wait(poll_s)
    return None


def serve(state_dir: Path, stop: threading.Event | None = None, store_url: str | None = None,
          http: tuple[str, int] | None = None) -> int:
    """Serve every rollout of the store (``store_url``, else ``state_dir/coordinator.db``) until a
    signal (or ``stop``). A rollout another coordinator holds is left to it (and taken over if it
    stops holding it). ``http`` = (host, port): also the read-only dashboard of every rollout of the
    store, running or ended, from the start (before any rollout exists) until the service stops."""
    from fedtier.rollout.config import store_url as resolve

    stop = stop or threading.Event()
    state_dir.mkdir(parents=True, exist_ok=True)
    location = resolve(state_dir, store_url)
    store = CoordinatorStore(location)
    if threading.current_thread() is threading.main_thread():
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
    hosted: dict[str, CoordinatorService] = {}
    dashboard = None
    if http is not None:
        from cloud_coordinator.observe import web
        from cloud_coordinator.observe.status import StoreStatus

        def live(rollout: str) -> Any:  # what only this process knows of a rollout it drives: its rejects
            node = hosted["service"].nodes.get(rollout) if "service" in hosted else None
            return None if node is None else node.observed

        dashboard = web.start(StoreStatus(location, live_for=live), *http)
    try:
        return _serve(state_dir, store, stop, hosted)
    finally:
        if dashboard is not None:
            dashboard.stop()
        store.close()


def _serve(state_dir: Path, store: CoordinatorStore, stop: threading.Event,
           hosted: dict[str, "CoordinatorService"]) -> int:
    from cloud_coordinator.node import OrtEvaluator
    from cloud_coordinator.rollout import prepare
    from cloud_coordinator.run import validate
    from fedtier.transport import mqtt
    from fedtier.transport.chunking import SqliteChunkStore

    first = wait_for_rollout(store, stop)
    if first is None:
        return 0
    base = stored_config(first)
    if not identity.preflight(base.cloud_id, [base.broker]):
        return mqtt_service.EXIT_UNAUTHORIZED
    inbox: queue.Queue = queue.Queue()
    tx = mqtt.from_config(base.broker, name="cloud", client_id=base.cloud_id, inbox=inbox,
                          status={"node": base.cloud_id, "role": "cloud"},
                          chunk_store=SqliteChunkStore(str(state_dir / "chunks.db")))

    def make_node(cfg: RolloutConfig) -> CloudNode:
        validate(cfg)
        store.hold_rollout(cfg.rollout, base.cloud_id)
        prepared = prepare(cfg)
        return CloudNode(prepared=prepared, transport=tx, store=store, evaluator=OrtEvaluator.for_rollout(prepared),
                         metrics=Metrics(node=base.cloud_id, role="cloud", rollout=cfg.rollout))

    service = CoordinatorService(store=store, transport=tx, cloud_id=base.cloud_id, make_node=make_node)
    hosted["service"] = service
    if base.metrics_port:
        service.metrics.serve(base.metrics_port)
    log.info("coordinator serving the rollouts of %s; broker %s:%d", store.where, base.broker.host, base.broker.port)
    return mqtt_service.run(service, [tx], inbox, start=service.start, stop=stop, install_signals=False)

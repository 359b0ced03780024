"""``fedtier coordinator run``: drive a rollout over MQTT until its last round closes."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from fedtier.rollout.config import RolloutConfig
from cloud_coordinator.node import CloudNode, OrtEvaluator
from cloud_coordinator.rollout import prepare
from cloud_coordinator.store import CoordinatorStore
from fedtier.errors import ConfigError
from fedtier.runtime import identity, mqtt_service
from fedtier.security.signing import load_signing_key
from fedtier.transport import mqtt
from fedtier.transport.chunking import SqliteChunkStore

log = logging.getLogger("fedtier.coordinator")


def validate(cfg: RolloutConfig) -> None:
    """Everything that can be checked before any state is created or any artifact is built.

    Raises:
        ConfigError: naming the key: a fixed noise seed, or a signing key that is missing, not
            readable or not Ed25519.
    """
    if cfg.privacy is not None and cfg.privacy.noise_seed is not None:
        raise ConfigError("a fixed noise seed lets anyone who knows it remove the noise: simulations only",
                          key="privacy.noise_seed")
    if cfg.signing_key is not None:
        try:
            load_signing_key(cfg.signing_key)
        except ConfigError as exc:
            raise ConfigError(f"{exc.message} ({exc.source})", key="signing_key") from None


def build(cfg: RolloutConfig, on_round: Callable[[dict[str, Any]], None] | None = None
          ) -> tuple[CloudNode, mqtt.MqttTransport, "queue.Queue"]:
    validate(cfg)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    store = CoordinatorStore(cfg.store_location)
    try:
        store.hold_rollout(cfg.rollout, cfg.cloud_id)  # refuses a second coordinator of this rollout
        prepared = prepare(cfg)
    except BaseException:
        store.close()
        raise
    inbox: queue.Queue = queue.Queue()
    tx = mqtt.from_config(cfg.broker, name="cloud", client_id=cfg.cloud_id, inbox=inbox,
                          status={"node": cfg.cloud_id, "role": "cloud"},
                          chunk_store=SqliteChunkStore(str(cfg.state_dir / "chunks.db")))
    node = CloudNode(prepared=prepared, transport=tx, store=store, evaluator=OrtEvaluator.for_rollout(prepared),
                     on_round=on_round)
    return node, tx, inbox


def run(cfg: RolloutConfig, stop: threading.Event | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None, http: tuple[str, int] | None = None,
        exit_when_done: bool = False, on_done: Callable[[int], None] | None = None,
        linger: threading.Event | None = None) -> int:
    """Run the rollout; ``http`` = (host, port) also serves the read-only dashboard (``observe.web``).

    The dashboard listens before the rollout's artifacts are built (its page says so while the store
    has no rollout yet), and when the rollout has ended it keeps serving the finished rollout until
    SIGINT/SIGTERM (or ``linger`` is set), unless ``exit_when_done``. ``on_done(code)`` is called when
    the rollout's loop has ended, before that wait (the CLI prints its summary there).
    """
    validate(cfg)
    if not identity.preflight(cfg.cloud_id, [cfg.broker]):
        return mqtt_service.EXIT_UNAUTHORIZED
    dashboard = None
    hosted: dict[str, Any] = {}
    if http is not None:
        from cloud_coordinator.observe import web
        from cloud_coordinator.observe.status import StoreStatus

        status = StoreStatus(cfg.store_location, live_for=lambda rollout: hosted.get(rollout))
        dashboard = web.start(status, *http)
    try:
        node, tx, inbox = build(cfg, on_round)
        hosted[cfg.rollout] = node.observed  # what only this process knows: its rejects, by reason
        if cfg.metrics_port:
            node.metrics.serve(cfg.metrics_port)
        log.info("rollout %s: %s, %d rounds, %d cells, %d devices; broker %s:%d", cfg.rollout, cfg.algorithm,
                 cfg.rounds, len(node.prepared.cells), len(node.prepared.devices), cfg.broker.host, cfg.broker.port)
        code = mqtt_service.run(node, [tx], inbox, start=node.start, stop=stop, done=lambda: node.done)
        if on_done is not None:
            on_done(code)
        if dashboard is not None and not exit_when_done and code == 0 and node.done:
            _linger(dashboard.url, cfg.rollout, linger or threading.Event())
        return code
    finally:
        if dashboard is not None:
            dashboard.stop()


def _linger(url: str, rollout: str, until: threading.Event) -> None:
    """Keep the dashboard up for a look at the ended rollout: until SIGINT/SIGTERM or ``until``."""
    if threading.current_thread() is threading.main_thread():
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: until.set())
    log.info("rollout %s has ended; the dashboard keeps serving it on %s until Ctrl-C (--exit-when-done: exit "
             "at once)", rollout, url)
    until.wait()

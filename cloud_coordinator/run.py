"""``fedtier coordinator run``: drive a rollout over MQTT until its last round closes."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from cloud_coordinator.config import RolloutConfig
from cloud_coordinator.node import CloudNode, OrtEvaluator
from cloud_coordinator.rollout import prepare
from cloud_coordinator.store import CoordinatorStore
from fedtier.errors import ConfigError
from fedtier.runtime import mqtt_service
from fedtier.transport import mqtt
from fedtier.transport.chunking import SqliteChunkStore

log = logging.getLogger("fedtier.coordinator")


def build(cfg: RolloutConfig, on_round: Callable[[dict[str, Any]], None] | None = None
          ) -> tuple[CloudNode, mqtt.MqttTransport, "queue.Queue"]:
    if cfg.privacy is not None and cfg.privacy.noise_seed is not None:
        raise ConfigError("a fixed noise seed lets anyone who knows it remove the noise: simulations only",
                          key="privacy.noise_seed")
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    prepared = prepare(cfg)
    inbox: queue.Queue = queue.Queue()
    tx = mqtt.from_config(cfg.broker, name="cloud", client_id=cfg.cloud_id, inbox=inbox,
                          status={"node": cfg.cloud_id, "role": "cloud"},
                          chunk_store=SqliteChunkStore(str(cfg.state_dir / "chunks.db")))
    node = CloudNode(prepared=prepared, transport=tx, store=CoordinatorStore(cfg.state_dir / "coordinator.db"),
                     evaluator=OrtEvaluator.for_rollout(prepared), on_round=on_round)
    return node, tx, inbox


def run(cfg: RolloutConfig, stop: threading.Event | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None) -> int:
    node, tx, inbox = build(cfg, on_round)
    if cfg.metrics_port:
        node.metrics.serve(cfg.metrics_port)
    log.info("rollout %s: %s, %d rounds, %d cells, %d devices; broker %s:%d", cfg.rollout, cfg.algorithm,
             cfg.rounds, len(node.prepared.cells), len(node.prepared.devices), cfg.broker.host, cfg.broker.port)
    return mqtt_service.run(node, [tx], inbox, start=node.start, stop=stop, done=lambda: node.finished)

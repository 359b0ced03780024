"""``fedtier edge run``: build the edge node over two MQTT connections from ``edge.toml`` and run it."""

from __future__ import annotations

import logging
import queue
import socket
import threading

from edge_broker.config import EdgeConfig
from edge_broker.service import EdgeNode
from edge_broker.store import EdgeStore
from fedtier import __version__
from fedtier.artifacts.cache import ArtifactCache
from fedtier.runtime import identity, mqtt_service
from fedtier.runtime.config import BrokerConfig
from fedtier.runtime.metrics import Metrics
from fedtier.security.signing import load_trusted_keys
from fedtier.transport import mqtt
from fedtier.transport.chunking import SqliteChunkStore

log = logging.getLogger("fedtier.edge")


def build(cfg: EdgeConfig) -> tuple[EdgeNode, list[mqtt.MqttTransport], "queue.Queue"]:
    """The node and its connections, not yet started.

    One connection when the cell broker and the cloud broker are the same (equal ``[cell_broker]``
    and ``[cloud_broker]``): brokers configured by fedtier bind the client id to the certificate,
    so a second connection with the edge's certificate would take the first one's session over.
    """
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    inbox: queue.Queue = queue.Queue()
    max_bytes = int(cfg.max_message_mb * (1 << 20))
    status = {"node": cfg.cell, "role": "edge", "cell": cfg.cell, "version": __version__}
    # Chunks are acknowledged as soon as they are stored, so they are stored durably.
    if cfg.cell_broker != cfg.cloud_broker and _same_address(cfg.cell_broker, cfg.cloud_broker):
        log.warning("[cell_broker] (%s:%d) and [cloud_broker] (%s:%d) reach the same broker but differ: the edge opens "
                    "two connections with one certificate, and a broker configured by fedtier takes each for the "
                    "other's session; make the two sections identical so the edge uses one connection",
                    cfg.cell_broker.host, cfg.cell_broker.port, cfg.cloud_broker.host, cfg.cloud_broker.port)
    if cfg.cell_broker == cfg.cloud_broker:
        cell_tx = cloud_tx = mqtt.from_config(cfg.cloud_broker, name="broker", client_id=cfg.cell, inbox=inbox,
                                              status=status,
                                              chunk_store=SqliteChunkStore(str(cfg.state_dir / "chunks.db")),
                                              max_message_bytes=max_bytes)
    else:
        cell_tx = mqtt.from_config(cfg.cell_broker, name="cell", client_id=cfg.cell, inbox=inbox,
                                   chunk_store=SqliteChunkStore(str(cfg.state_dir / "chunks-cell.db")),
                                   max_message_bytes=max_bytes)
        cloud_tx = mqtt.from_config(cfg.cloud_broker, name="cloud", client_id=f"{cfg.cell}.up", inbox=inbox,
                                    status=status,
                                    chunk_store=SqliteChunkStore(str(cfg.state_dir / "chunks-cloud.db")),
                                    max_message_bytes=max_bytes)
    node = EdgeNode(cell=cfg.cell, cell_transport=cell_tx, cloud_transport=cloud_tx,
                    store=EdgeStore(cfg.state_dir / "edge.db"), cache=ArtifactCache(cfg.state_dir / "artifacts"),
                    parent=cfg.parent, metrics=Metrics(node=cfg.cell, role="edge"), max_message_bytes=max_bytes,
                    trusted_keys=load_trusted_keys(cfg.trusted_keys))
    return node, [cell_tx, cloud_tx], inbox


def _same_address(a: BrokerConfig, b: BrokerConfig) -> bool:
    """Whether two broker sections dial the same address and port (best effort: False if a name does not resolve)."""
    if a.port != b.port:
        return False
    try:
        found = [{info[4][0] for info in socket.getaddrinfo(c.host, c.port, type=socket.SOCK_STREAM)} for c in (a, b)]
    except OSError:
        return False
    return bool(found[0] & found[1])


def run(cfg: EdgeConfig, stop: threading.Event | None = None) -> int:
    if not identity.preflight(cfg.cell, [cfg.cell_broker, cfg.cloud_broker]):
        return mqtt_service.EXIT_UNAUTHORIZED
    node, transports, inbox = build(cfg)
    if cfg.metrics_port:
        node.metrics.serve(cfg.metrics_port)
        log.info("metrics on http://127.0.0.1:%d/metrics", cfg.metrics_port)
    log.info("edge of cell %s: cell broker %s:%d, cloud broker %s:%d", cfg.cell, cfg.cell_broker.host,
             cfg.cell_broker.port, cfg.cloud_broker.host, cfg.cloud_broker.port)
    return mqtt_service.run(node, transports, inbox, start=node.start, stop=stop)

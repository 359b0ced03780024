"""``edge.toml``: the configuration of one gateway's edge service."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedtier.runtime.config import LOG_LEVELS, BrokerConfig, Section, node_id, opt


@dataclass(frozen=True)
class EdgeConfig(Section):
    """One edge cell: the cell broker its devices use, and the cloud broker above it."""

    cell: str = opt(help="Cell id (= this edge's node id). Devices of the cell name it in their config.",
                    check=node_id)
    state_dir: Path = opt(help="Directory for round state (SQLite), chunk stores and the artifact cache.")
    parent: str = opt("cloud", check=node_id, help="Node id of the coordinator whose tasks are accepted.")
    cell_broker: BrokerConfig = opt(default_factory=BrokerConfig, help="The broker the cell's devices connect to.")
    cloud_broker: BrokerConfig = opt(default_factory=BrokerConfig, help="The broker the coordinator listens on.")
    trusted_keys: tuple[Path, ...] = opt((), help="Ed25519 public keys (PEM) whose manifest signatures the edge "
                                                  "accepts before relaying to its cell; empty = not verified.")
    metrics_port: int = opt(0, min=0, max=65535, help="Serve Prometheus /metrics on this port; 0 = off.")
    max_message_mb: float = opt(64.0, gt=0, help="Refuse messages (after reassembly) larger than this.")
    log_level: str = opt("info", choices=LOG_LEVELS, help="Logging level.")

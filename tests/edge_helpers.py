"""An edge node on the in-memory broker, for tests that drive one edge by hand (tests/unit/edge_broker)."""

from __future__ import annotations

from pathlib import Path

from edge_broker.service import EdgeNode
from edge_broker.store import EdgeStore
from fedtier.artifacts.cache import ArtifactCache
from fedtier.transport.memory import MemoryBroker


def memory_edge(broker: MemoryBroker, cell: str, db: Path | str, cache: Path) -> EdgeNode:
    """The edge of ``cell`` connected to ``broker`` on both sides, its store at ``db`` (``":memory:"``: none kept),
    started and settled (``run_until_idle``): what a restart makes again over the same ``db``."""
    edge = EdgeNode(cell=cell, cell_transport=broker.connect("edge-cell"), cloud_transport=broker.connect("edge-cloud"),
                    store=EdgeStore(db), cache=ArtifactCache(cache))
    for tx in (edge.cell_tx, edge.cloud_tx):
        tx.set_handler(lambda inbound, e=edge: e.handle(inbound, broker.now))
    edge.start(broker.now)
    broker.run_until_idle()
    return edge

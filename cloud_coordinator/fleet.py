"""Configs and data for a fleet on one machine: a coordinator, an edge per cell, an agent per device.

``fedtier demo`` and the integration tests both lay fleets out with ``write_fleet``: one
TOML per node (validated by loading it back), each device's training split as
``data/<device>/train.npz``, and separate state directories — exactly what an operator
would write by hand for ``fedtier coordinator|edge|agent run``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from cloud_coordinator.config import RolloutConfig
from cloud_coordinator.datasets import make_federated
from device_agent.config import DeviceConfig
from edge_broker.config import EdgeConfig
from fedtier.config import dumps_toml, load


@dataclass(frozen=True)
class FleetPaths:
    coordinator: Path
    edges: dict[str, Path]
    devices: dict[str, Path]
    workdir: Path

    def all(self) -> list[Path]:
        return [self.coordinator, *self.edges.values(), *self.devices.values()]


def write_fleet(rollout: Mapping[str, Any], workdir: Path, broker: Mapping[str, Any]) -> FleetPaths:
    """Write every node's config and every device's data under ``workdir``.

    Args:
        rollout: a rollout config as plain data (``RolloutConfig`` keys); its ``broker``
            table is set to ``broker``, and ``state_dir`` defaults to ``workdir/coordinator``.
        workdir: where configs (``configs/``), data (``data/``) and state go.
        broker: the ``[broker]`` table every node uses (host, port, ...).

    Returns:
        Paths of the written configs.
    """
    workdir = Path(workdir)
    cfg_dir = workdir / "configs"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    rollout = {"state_dir": str(workdir / "coordinator"), **rollout, "broker": dict(broker)}
    coordinator = cfg_dir / "coordinator.toml"
    coordinator.write_text(dumps_toml(rollout))
    cfg = load(RolloutConfig, coordinator)
    cells = cfg.topology.layout()
    data = make_federated(cfg.data, [d for ds in cells.values() for d in ds], cells)
    edges: dict[str, Path] = {}
    devices: dict[str, Path] = {}
    for cell, members in cells.items():
        edge = {"cell": cell, "state_dir": str(workdir / "edges" / cell), "parent": cfg.cloud_id,
                "cell_broker": dict(broker), "cloud_broker": dict(broker)}
        edges[cell] = cfg_dir / f"edge-{cell}.toml"
        edges[cell].write_text(dumps_toml(edge))
        load(EdgeConfig, edges[cell])
        for device in members:
            data_dir = workdir / "data" / device
            data_dir.mkdir(parents=True, exist_ok=True)
            x, y = data.train[device]
            np.savez(data_dir / "train.npz", x=x, y=y)
            dev = {"device_id": device, "cell": cell, "data_dir": str(data_dir),
                   "state_dir": str(workdir / "devices" / device), "broker": dict(broker)}
            devices[device] = cfg_dir / f"device-{device}.toml"
            devices[device].write_text(dumps_toml(dev))
            load(DeviceConfig, devices[device])
    return FleetPaths(coordinator=coordinator, edges=edges, devices=devices, workdir=workdir)

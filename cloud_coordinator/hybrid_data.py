"""HSGD's hybrid data for a rollout: a built-in dataset split by columns (host | devices) and by rows (cells).

Why one sample per device: in HSGD's setting (seed 000, §1) a device is a patient's wearable, holding the
sensor features of that patient alone, and the host (the hospital) holds the record features of every
patient of its group. ``make_hybrid`` takes the rollout's ``[data]`` exactly as the other algorithms do
(``make_federated``: the same split, test set and partition), gives each device the first row of its
partition, and cuts every row into the host's first ``[hsgd] host_features`` columns and the device's rest.
``write_hybrid_shards`` writes what each node's ``fedtier agent run`` reads: a device's ``train.npz`` holds
its one row; the host's holds its cell's rows in device order with their ids (array ``ids``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from cloud_coordinator.config import RolloutConfig
from cloud_coordinator.datasets import make_federated
from cloud_coordinator.hsgd_loop import HybridCell
from fedtier.errors import ConfigError
from fedtier.training.split import SplitArch



@dataclass(frozen=True)
class HybridData:
    cells: dict[str, HybridCell]
    test: tuple[np.ndarray, np.ndarray, np.ndarray]
    """The central test set as (x1, x2, y)."""
    host_features: int
    device_features: int
    num_classes: int

    def arch(self, d1: int, d2: int) -> SplitArch:
        return SplitArch(self.host_features, self.device_features, d1, d2, max(2, self.num_classes))

    def shard(self, node: str) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
        """``(x, y, ids)`` of a host (every row of its cell) or a device (its one row)."""
        for c in self.cells.values():
            if node == c.host:
                return c.x1, c.y, c.devices
            if node in c.devices:
                n = c.devices.index(node)
                return c.x2[n:n + 1], c.y[n:n + 1], (node,)
        raise KeyError(node)


def make_hybrid(cfg: RolloutConfig) -> HybridData:
    """The rollout's hybrid data (see the module docstring).

    Raises:
        ConfigError: the dataset has too few columns to split, or ``host_features`` leaves the devices none.
    """
    cells = cfg.topology.layout()
    devices = [d for members in cells.values() for d in members]
    try:
        data = make_federated(cfg.data, devices, cells)
    except ValueError as exc:
        raise ConfigError(f"{exc} (hsgd gives every device one sample)", key="topology") from None
    assert data.test is not None  # built-in datasets always have one
    features = data.num_features
    h = cfg.hsgd.split_columns(features)
    if features < 2 or h >= features:
        raise ConfigError(f"the host takes {h} of the dataset's {features} columns, leaving the devices none",
                          key="hsgd.host_features")
    hosts = cfg.hsgd_hosts()
    out = {}
    for cell, members in cells.items():
        rows = np.stack([np.asarray(data.train[d][0][0], np.float32).reshape(-1) for d in members])
        labels = np.array([int(data.train[d][1][0]) for d in members], np.int64)
        out[cell] = HybridCell(host=hosts[cell], devices=tuple(members), x1=rows[:, :h], x2=rows[:, h:], y=labels)
    xt, yt = data.test
    xt = np.asarray(xt, np.float32).reshape(len(xt), -1)
    return HybridData(cells=out, test=(xt[:, :h], xt[:, h:], np.asarray(yt, np.int64)), host_features=h,
                      device_features=features - h, num_classes=data.num_classes)


def write_hybrid_shards(data: HybridData, data_dirs: Mapping[str, Path]) -> dict[str, int]:
    """Write each node's shard (``train.npz``: ``x``, ``y``, and ``ids`` for a host); node -> rows written."""
    written = {}
    for node, directory in data_dirs.items():
        x, y, ids = data.shard(node)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if ids == (node,):  # a device: its one row is its own
            np.savez(directory / "train.npz", x=x, y=y)
        else:
            np.savez(directory / "train.npz", x=x, y=y, ids=np.array(ids))
        written[node] = len(y)
    return written

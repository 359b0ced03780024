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

from fedtier.rollout.config import RolloutConfig
from fleet_data.datasets import make_federated
from fedtier.errors import ConfigError
from fedtier.training.split import SplitArch



@dataclass(frozen=True)
class HybridCell:
    """One cell's data: the host's block ``x1`` and the devices' block ``x2`` of the same samples
    (row ``n`` is device ``devices[n]``'s sample), and the labels."""

    host: str
    devices: tuple[str, ...]
    x1: np.ndarray
    x2: np.ndarray
    y: np.ndarray


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
    if cfg.data.dataset == "files":
        return load_hybrid_files(cfg)
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


def load_hybrid_files(cfg: RolloutConfig) -> HybridData:
    """Your own hybrid data (``dataset = "files"``): the widths from ``[hsgd]``; with ``[data] dir``, each node's
    shard as ``write_hybrid_shards`` writes it (``<dir>/<host>/train.npz`` with ``ids``, ``<dir>/<device>/train.npz``
    with its one row: what the simulator trains on; a coordinator runs without them); the test set from
    ``eval_file``, its first ``host_features`` columns the host's block.

    Raises:
        ConfigError: a shard is missing or does not fit (the message names the file).
    """
    from fleet_data.tables import read_table
    from device_agent.data import load_data_dir
    from device_agent.hybrid import load_row_ids

    h, w = cfg.hsgd.host_features, cfg.hsgd.device_features
    hosts, out = cfg.hsgd_hosts(), {}
    for cell, members in cfg.topology.layout().items():
        x1, x2, y = np.zeros((0, h), np.float32), np.zeros((0, w), np.float32), np.zeros(0, np.int64)
        order = tuple(members)
        if cfg.data.dir is not None:
            host_dir = cfg.data.dir / hosts[cell]
            ids = load_row_ids(host_dir)
            if ids is None or sorted(ids) != sorted(members):
                raise ConfigError(f"{host_dir / 'train.npz'} must hold one row per device of {cell} with their ids "
                                  f"(array 'ids'); it has {'none' if ids is None else len(ids)}", key="data.dir")
            rows = load_data_dir(host_dir)
            order, x1, y = ids, rows.x.reshape(len(rows.x), -1).astype(np.float32), rows.y.astype(np.int64)
            device_rows = [load_data_dir(cfg.data.dir / d) for d in order]
            if any(len(r) != 1 for r in device_rows):
                raise ConfigError(f"every device shard of {cell} holds its one sample", key="data.dir")
            x2 = np.concatenate([r.x.reshape(1, -1) for r in device_rows]).astype(np.float32)
            if x1.shape[1] != h or x2.shape[1] != w:
                raise ConfigError(f"cell {cell}: host rows of {x1.shape[1]} columns and device rows of {x2.shape[1]}; "
                                  f"[hsgd] says {h} and {w}", key="data.dir")
        out[cell] = HybridCell(host=hosts[cell], devices=tuple(order), x1=x1, x2=x2, y=y)
    classes = cfg.hsgd.classes
    xt = np.zeros((0, h + w), np.float32)
    yt = np.zeros(0, np.int64)
    if cfg.data.eval_file is not None:
        table = read_table(cfg.data.eval_file, cfg.data.label_column, key="data.eval_file",
                           label_key="data.label_column")
        xt, yt = np.asarray(table.x, np.float32).reshape(len(table.x), -1), np.asarray(table.y).astype(np.int64)
        if xt.shape[1] != h + w:
            raise ConfigError(f"eval_file rows have {xt.shape[1]} columns; host_features + device_features = {h + w}",
                              key="data.eval_file")
        classes = classes or int(yt.max()) + 1
    return HybridData(cells=out, test=(xt[:, :h], xt[:, h:], yt), host_features=h, device_features=w,
                      num_classes=classes)


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

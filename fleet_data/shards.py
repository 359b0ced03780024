"""Each device's share of a rollout's built-in dataset, written where its agent reads it.

The split is the coordinator's own (``[data]``: the same seed, partition and held-out set), so a
fleet laid out on one machine (``local_fleet.configs``) or provisioned with ``--sample-data``
(``provisioning.rollout``) trains on exactly what the simulator would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from device_agent.data import write_shard
from fedtier.rollout.config import RolloutConfig
from fleet_data.datasets import make_federated


def write_device_data(cfg: RolloutConfig, data_dirs: Mapping[str, Path]) -> dict[str, int]:
    """Write each device's share of the rollout's built-in dataset as a shard (``write_shard``:
    ``train.npz``, and ``eval/eval.npz`` when ``[data] holdout`` keeps rows for federated evaluation).

    The split is the coordinator's own (``[data]``: the same seed, partition and held-out
    set), so what devices train on and what the coordinator evaluates on never overlap. For
    trials: real devices bring their own data (``fedtier data split``).

    Args:
        cfg: the rollout.
        data_dirs: device id -> its data directory (created).

    Returns:
        Device id -> number of samples written.
    """
    cells = cfg.topology.layout()
    data = make_federated(cfg.data, [d for ds in cells.values() for d in ds], cells)
    written = {}
    for device, directory in data_dirs.items():
        write_shard(Path(directory), data.train[device], data.holdout.get(device))
        written[device] = int(len(data.train[device][1]))
    return written

"""Each device's data, put where its agent reads it (its bundle's ``data/``).

* ``write_device_data``: each device's share of a rollout's built-in dataset. The split is the
  coordinator's own (``[data]``: the same seed, partition and held-out set), so a fleet laid out on
  one machine (``local_fleet.configs``) or provisioned with ``--sample-data``
  (``provisioning.rollout``) trains on exactly what the simulator would.
* ``place_shards``: the shards ``fedtier data split`` wrote (``provision fleet --shards DIR``), each to
  the device of the same name; names that do not match are refused, never guessed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Mapping, Sequence

from device_agent.data import write_shard
from fedtier.errors import ConfigError
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


def shards_in(split_dir: Path) -> dict[str, Path]:
    """The per-device shards of a ``fedtier data split`` output: each sub-directory holding data files.

    Raises:
        ConfigError(key="--shards"): no such directory, or no shard in it.
    """
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise ConfigError(f"directory not found: {split_dir} (the --out of fedtier data split)", key="--shards")
    found = {p.name: p for p in sorted(split_dir.iterdir())
             if p.is_dir() and any(f.suffix in (".npz", ".csv") for f in p.iterdir() if f.is_file())}
    if not found:
        raise ConfigError(f"{split_dir} holds no shard (a sub-directory per device with train.npz, as fedtier data "
                          "split writes)", key="--shards")
    return found


def match_shards(shards: Mapping[str, Path], devices: Sequence[str], split_dir: Path) -> None:
    """Every device of the topology has a shard and every shard a device, by name; else say how they differ.

    Raises:
        ConfigError(key="--shards"): the names differ (the message lists both, and the likely fix).
    """
    missing = [d for d in devices if d not in shards]
    extra = sorted(set(shards) - set(devices))
    if not missing and not extra:
        return
    parts = []
    if missing:
        parts.append(f"no shard for {', '.join(missing)}")
    if extra:
        parts.append(f"no device in the topology for shard{'s' if len(extra) > 1 else ''} {', '.join(extra)}")
    numbers = [_number(n) for n in (*missing, *extra)]
    if None not in numbers and {_number(n) for n in missing} == {_number(n) for n in extra}:
        fix = ("the names differ only in their zero padding: fedtier data split names shards as a generated topology "
               f"names devices ({', '.join(sorted(shards))}); use those names in [topology.members]")
    else:
        fix = (f"split into as many shards as the topology has devices (fedtier data split --devices {len(devices)}; "
               "it names them dev-00, dev-01, ...), and name the devices in [topology.members] as the shards are named")
    raise ConfigError(f"{split_dir}: {'; '.join(parts)}. Each device gets the shard of its own name: {fix}",
                      key="--shards")


def _number(name: str) -> tuple[str, int] | None:
    """``dev-07`` -> ``("dev-", 7)``: a name's stem and number, to spot names that differ only in padding."""
    stem = name.rstrip("0123456789")
    digits = name[len(stem):]
    return (stem, int(digits)) if digits else None


def place_shards(split_dir: Path, data_dirs: Mapping[str, Path]) -> dict[str, tuple[int, int]]:
    """Copy each device's shard of ``split_dir`` to its data directory, which it replaces (after ``match_shards``).

    Returns:
        Device id -> (training rows, held-out rows).

    Raises:
        ConfigError: a shard is not readable (naming its file), or names do not match (``match_shards``).
    """
    from device_agent.data import load_data_dir, load_eval_dir

    shards = shards_in(split_dir)
    match_shards(shards, list(data_dirs), Path(split_dir))
    placed: dict[str, tuple[int, int]] = {}
    for device, target in data_dirs.items():
        shard = shards[device]
        rows = len(load_data_dir(shard))  # a shard an agent could not read is refused here, not on the device
        held = load_eval_dir(shard)
        target = Path(target)
        staging = target.with_name(f".{target.name}.new")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(shard, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        placed[device] = (rows, len(held) if held is not None else 0)
    return placed

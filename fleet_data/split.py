"""Split a user's table across devices: the library behind ``fedtier data split``.

The rows are partitioned with the simulator's own schemes (``fleet_data.datasets.partition``:
``iid``, ``dirichlet``, label ``shards``), each device keeps a held-out share for federated
evaluation, and an optional central test set is split off first. Every device's shard is written
with ``device_agent.data.write_shard`` — the format agents read and the demo's fleet writer
uses — under ``<out>/<device>/``; the device ids are the ones a generated topology uses
(``dev-00``, ...), so ``[data] dataset = "files"`` with ``dir = <out>`` finds them.

``<out>/split.json`` records what was done (input, options, per-device counts and label
histogram, class names); ``<out>/test.npz`` is the central test set (``[data] eval_file``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedtier.rollout.config import DataConfig, device_ids
from fleet_data.datasets import holdout_split, partition, train_test_split
from fleet_data.tables import Table
from device_agent.data import write_shard
from fedtier.errors import ConfigError
from fedtier.rng import stream

SPLIT_PARTITIONS = ("iid", "dirichlet", "shards")
SUMMARY_FILE = "split.json"
TEST_FILE = "test.npz"


@dataclass(frozen=True)
class SplitOptions:
    """How to split (the options of ``fedtier data split``)."""

    devices: int
    partition: str = "iid"
    alpha: float = 0.5
    classes_per_device: int = 2
    seed: int = 0
    holdout: float = 0.2
    test_fraction: float = 0.0


def split_table(table: Table, options: SplitOptions, out: Path, *, source: str = "", force: bool = False
                ) -> dict[str, Any]:
    """Partition ``table`` over ``options.devices`` devices and write their shards under ``out``.

    Returns:
        The summary also written to ``out/split.json``.

    Raises:
        ConfigError: ``out`` is not empty (without ``force``), fewer rows than devices, or a
            label partition of labels that are not class numbers; the message names the option.
    """
    if options.partition not in SPLIT_PARTITIONS:
        raise ConfigError(f"must be one of {', '.join(SPLIT_PARTITIONS)}", key="--partition")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise ConfigError(f"{out} is not empty (use --force to write into it)", key="--out")
    if options.partition != "iid" and not table.classes:
        raise ConfigError(f"{options.partition} partitions by class label, but the labels are not class numbers "
                          "(use --partition iid for regression targets)", key="--partition")
    x, y = table.x, table.y
    test: tuple[np.ndarray, np.ndarray] | None = None
    if options.test_fraction > 0:
        (x, y), test = _test_split(x, y, options.test_fraction, options.seed, table.classes)
    names = device_ids(options.devices)
    if len(y) < options.devices:
        raise ConfigError(f"{len(y)} rows cannot be spread over {options.devices} devices", key="--devices")
    scheme = DataConfig(partition=options.partition, alpha=options.alpha,
                        classes_per_device=options.classes_per_device, seed=options.seed)
    labels = y if table.classes else np.zeros(len(y), dtype=np.int64)
    parts = partition(labels, names, scheme)
    devices: dict[str, dict[str, Any]] = {}
    for name in names:
        idx = parts[name]
        keep, held = holdout_split(len(idx), options.holdout, options.seed, name)
        train_rows, eval_rows = idx[keep], idx[held]
        write_shard(out / name, (x[train_rows], y[train_rows]), (x[eval_rows], y[eval_rows]) if len(held) else None)
        entry: dict[str, Any] = {"train": int(len(train_rows)), "eval": int(len(eval_rows))}
        if table.classes:
            values, counts = np.unique(y[idx], return_counts=True)
            entry["labels"] = {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)}
        devices[name] = entry
    if test is not None:
        np.savez(out / TEST_FILE, x=test[0], y=test[1])
    summary: dict[str, Any] = {
        "input": source, "rows": int(len(table.y)), "features": int(np.prod(table.x.shape[1:])),
        "partition": options.partition, "alpha": options.alpha, "classes_per_device": options.classes_per_device,
        "seed": options.seed, "holdout": options.holdout, "test_fraction": options.test_fraction,
        "test": int(len(test[1])) if test is not None else 0,
        "class_names": list(table.class_names) if table.class_names is not None else None,
        "devices": devices,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _test_split(x: np.ndarray, y: np.ndarray, fraction: float, seed: int, classes: bool
                ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The central test set: stratified by class, or a random share of regression rows."""
    if classes:
        return train_test_split(x, y, fraction, seed)
    order = stream(seed, "test-split").permutation(len(y))
    k = max(1, int(round(fraction * len(y))))
    test, rest = np.sort(order[:k]), np.sort(order[k:])
    return (x[rest], y[rest]), (x[test], y[test])


def write_example_csv(path: Path) -> int:
    """scikit-learn's bundled digits as a CSV (columns ``p0..p63`` in [0, 1], then ``label``).

    Returns:
        The number of data rows written.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = digits.data / 16.0, digits.target
    lines = [",".join([*(f"p{i}" for i in range(x.shape[1])), "label"])]
    lines += [",".join([*(f"{v:g}" for v in row), str(int(label))]) for row, label in zip(x, y, strict=True)]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
    return len(y)

"""HSGD on a node (a host, ``role = "host"``, or a device): its rows by sample id and its split trainer.

HSGD's roles name rows by sample id: a device's one sample is its own id; the host's rows are its cell's
devices' ids, in the ``ids`` array of its shard (``fleet_data.hybrid.write_hybrid_shards``). The
trainer is the side's ORT graphs of the manifest's split bundle (``OrtSplitTrainer``) where
onnxruntime-training is installed, else the numpy split model (``SplitTrainer``), which computes the same
steps (docs/hsgd.md).
"""

from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from device_agent.data import TRAIN_FILE, LocalData
from fedtier.artifacts.split_bundle import SplitBundle
from fedtier.errors import ArtifactError, ConfigError, LocalProtocolError
from fedtier.storage import npz
from fedtier.training import split

SIDES = ("device", "host")
SplitProvider = Callable[[SplitBundle, str, Mapping[str, np.ndarray], Mapping[str, int]], Any]
"""``(bundle, side, rows by id, labels by id) -> trainer`` with ``embed`` and ``train``."""


def load_row_ids(data_dir: Path) -> tuple[str, ...] | None:
    """The sample ids of a host's shard (array ``ids`` of ``train.npz``); ``None`` if it has none.

    Raises:
        ConfigError: ``ids`` is not an array of strings.
    """
    path = Path(data_dir) / TRAIN_FILE
    if not path.is_file():
        return None
    try:
        with npz.LOCK, np.load(path, allow_pickle=False) as z:
            if "ids" not in z.files:
                return None
            ids = np.asarray(z["ids"])
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"not a readable numeric .npz: {exc}", source=str(path)) from None
    if ids.dtype.kind != "U" or ids.ndim != 1:
        raise ConfigError(f"array 'ids' must be a list of sample ids (strings), not {ids.dtype}", source=str(path))
    return tuple(str(i) for i in ids)


def rows_by_id(data: LocalData, ids: tuple[str, ...], bundle: SplitBundle,
               side: str) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """The node's rows and labels keyed by sample id, checked against the split model.

    Raises:
        ConfigError: the ids and rows differ in number, a row has the wrong width for the side's block,
            or a label is not a class of the model.
    """
    arch = bundle.arch
    width = arch.x1 if side == "host" else arch.x2
    x = np.asarray(data.x, np.float32).reshape(len(data), -1)
    if len(ids) != len(data) or len(set(ids)) != len(ids):
        what = "its devices' ids (array 'ids' of train.npz)" if side == "host" else "one sample, its own"
        raise ConfigError(f"an hsgd {side} holds {what}: {len(data)} rows for {len(set(ids))} distinct ids")
    if x.shape[1] != width:
        raise ConfigError(f"local rows have {x.shape[1]} columns; the split model's {side} block takes {width}")
    y = np.asarray(data.y)
    if y.ndim != 1 or not np.array_equal(y, np.round(y)) or y.min() < 0 or y.max() >= arch.classes:
        raise ConfigError(f"labels must be class numbers below {arch.classes}")
    return dict(zip(ids, x, strict=True)), {i: int(v) for i, v in zip(ids, y, strict=True)}


def split_provider(backend: str) -> SplitProvider:
    """The split trainer of a backend: ORT graphs for ``ort``, the numpy split model otherwise."""

    def make(bundle: SplitBundle, side: str, x: Mapping[str, np.ndarray], y: Mapping[str, int]) -> Any:
        if backend == "ort":
            from device_agent.trainers.ort_split import OrtSplitTrainer

            return OrtSplitTrainer(bundle, side, x, y)
        return split.SplitTrainer(x, y)

    return make


def health_check(trainer: Any, bundle: SplitBundle, side: str, ids: tuple[str, ...]) -> None:
    """The side's encoder runs on local rows and gives finite embeddings of the right width.

    Raises:
        ArtifactError: it does not.
    """
    block = "theta1" if side == "host" else "theta2"
    width = bundle.arch.d1 if side == "host" else bundle.arch.d2
    try:
        zeta = np.asarray(trainer.embed(block, split.init_params(bundle.arch, bundle.seed), ids[:32]))
    except (LocalProtocolError, RuntimeError, ValueError, KeyError) as exc:
        raise ArtifactError(f"health check failed: {exc}") from exc
    if zeta.shape != (min(len(ids), 32), width) or not all(math.isfinite(v) for v in zeta.ravel().tolist()):
        raise ArtifactError(f"health check failed: embedding of shape {zeta.shape}, finite: "
                            f"{bool(np.isfinite(zeta).all())}")

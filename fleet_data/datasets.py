"""Federated datasets from data that ships with a dependency, is generated, or is the user's own.

``make_federated`` loads a dataset, splits off a stratified held-out test set, and
partitions the rest across devices:

* ``iid``       — shuffled, equal shares;
* ``shards``    — sorted by label and cut into ``devices x classes_per_device`` shards,
                  dealt so each device holds about ``classes_per_device`` classes
                  (McMahan et al.'s pathological non-iid split);
* ``dirichlet`` — each class split across devices by Dirichlet(alpha) proportions
                  (Hsu et al., 2019); small alpha means strongly skewed devices;
* ``cell_shards`` — iid across cells, label shards within each cell (HIST's "cell iid").

With ``[data] holdout`` > 0, each device keeps that share of its partition as held-out rows
(federated evaluation: the device evaluates each round's incoming global model on them).

``dataset = "files"`` reads the user's own shards instead (``load_files``): one directory per
device as ``fedtier data split`` writes them (``train.npz``, ``eval/``), and the optional
central test set ``eval_file``.

Everything is a deterministic function of the config's seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from fedtier.rollout.config import DataConfig
from fedtier.errors import ConfigError
from fedtier.rng import stream


@dataclass(frozen=True)
class FederatedData:
    """Every device's training rows, their held-out rows, and the central test set.

    ``test`` is ``None`` when there is no central test set (``dataset = "files"`` without
    ``eval_file``); ``train`` is empty on a coordinator that has no device data (a user model
    with ``dataset = "files"`` and no ``dir``); ``num_classes`` is 0 when the labels are not
    class numbers (regression targets).
    """

    train: dict[str, tuple[np.ndarray, np.ndarray]]
    test: tuple[np.ndarray, np.ndarray] | None
    num_features: int
    num_classes: int
    holdout: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def summary(self) -> dict[str, dict[str, int]]:
        """Per device: sample count and the number of distinct labels (for logs and docs)."""
        return {d: {"samples": int(len(y)), "classes": int(len(np.unique(y)))} for d, (_, y) in self.train.items()}


SYNTHETIC_BLOCK = 65536
"""Rows of the synthetic set generated at a time (16 MB of float64 temporaries at 64 features)."""


def load_dataset(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """Features (float32, scaled) and int64 labels of the configured dataset."""
    if cfg.dataset == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
    if cfg.dataset == "breast_cancer":
        from sklearn.datasets import load_breast_cancer

        d = load_breast_cancer()
        x = d.data.astype(np.float64)
        x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-12)
        return x.astype(np.float32), d.target.astype(np.int64)
    if cfg.dataset == "rare_event":
        return rare_event(cfg)
    if cfg.dataset == "synthetic":
        gen = stream(cfg.seed, "synthetic-data")
        means = gen.normal(size=(cfg.classes, cfg.modes, cfg.features))
        if cfg.mean_std > 0:
            means *= cfg.mean_std
        else:
            means *= cfg.separation / np.maximum(np.linalg.norm(means, axis=2, keepdims=True), 1e-12)
        y = gen.integers(0, cfg.classes, size=cfg.samples)
        mode = gen.integers(0, cfg.modes, size=cfg.samples)
        # In blocks of rows: the same draws in the same order (a Generator's normals do not depend on how a
        # request is split), so the same float32 values, without the float64 temporaries of the whole set
        # (three of 2 GB each at 4 million samples of 64 features, the simulator's 100,000 devices).
        x = np.empty((cfg.samples, cfg.features), np.float32)
        for lo in range(0, cfg.samples, SYNTHETIC_BLOCK):
            hi = min(lo + SYNTHETIC_BLOCK, cfg.samples)
            x[lo:hi] = means[y[lo:hi], mode[lo:hi]] + cfg.noise * gen.normal(size=(hi - lo, cfg.features))
        return x, y.astype(np.int64)
    raise ValueError(f"unknown dataset {cfg.dataset!r}")


RARE_EVENT_SIGNAL = 5
"""rare_event: the classes differ on this many coordinates, and devices are shifted on as many others."""


def rare_event(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """A binary task with rare positives (the synthetic setting FeDXL's acceptance checks use): negatives
    ``N(0, noise^2 I)`` and positives ``N(delta, noise^2 I)`` in ``features`` dimensions, ``delta`` of norm
    ``separation`` spread evenly over the first 5 coordinates (with the defaults the Bayes AUROC is
    ``Phi(separation / (noise sqrt 2)) = 0.921``); positives at ``positive_rate`` (default 1/6: 1 to 5)."""
    gen = stream(cfg.seed, "rare-event-data")
    rate = cfg.positive_rate or 1.0 / 6.0
    y = (gen.random(cfg.samples) < rate).astype(np.int64)
    x = cfg.noise * gen.normal(size=(cfg.samples, cfg.features))
    x[y == 1, :RARE_EVENT_SIGNAL] += cfg.separation / np.sqrt(RARE_EVENT_SIGNAL)
    return x.astype(np.float32), y


def _binary(y: np.ndarray, what: str) -> None:
    if not np.isin(y, (0, 1)).all():
        raise ConfigError(f"{what} is for binary tasks (labels 0 and 1); this dataset has labels "
                          f"{sorted(np.unique(y).tolist())[:10]}", key=f"data.{what}")


def keep_positive_rate(x: np.ndarray, y: np.ndarray, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A random subset of the positives (label 1), all negatives, so that positives are ``rate`` of the rows
    (stream ``(seed, "positive-rate")``); unchanged when there are too few positives for it."""
    _binary(y, "positive_rate")
    pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    keep = int(round(rate / (1.0 - rate) * len(neg)))
    if keep >= len(pos):
        return x, y
    chosen = stream(seed, "positive-rate").choice(pos, size=max(1, keep), replace=False)
    rows = np.sort(np.concatenate([neg, chosen]))
    return x[rows], y[rows]


def flip_labels(y: np.ndarray, share: float, seed: int) -> np.ndarray:
    """``share`` of each class's labels flipped (0 <-> 1) at random (stream ``(seed, "label-noise")``): the
    paper's corrupted-label setting flips 20 % of the positives and 20 % of the negatives."""
    _binary(y, "label_noise")
    gen = stream(seed, "label-noise")
    out = y.copy()
    for c in (0, 1):
        idx = np.flatnonzero(y == c)
        flip = gen.choice(idx, size=int(round(share * len(idx))), replace=False) if len(idx) else idx
        out[flip] = 1 - c
    return out


def device_shifts(cfg: DataConfig, count: int) -> np.ndarray:
    """``(count, features)``: device ``i``'s nuisance shift ``(i - (count-1)/2) * device_shift`` on the 5
    coordinates after the signal's (the paper's per-machine noise mean, made a feature shift)."""
    shifts = np.zeros((count, cfg.features), np.float32)
    span = slice(RARE_EVENT_SIGNAL, 2 * RARE_EVENT_SIGNAL)
    for i in range(count):
        shifts[i, span] = (i - (count - 1) / 2.0) * cfg.device_shift
    return shifts


def train_test_split(x: np.ndarray, y: np.ndarray, fraction: float, seed: int
                     ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Stratified split: ``fraction`` of every class goes to the test set."""
    gen = stream(seed, "test-split")
    test_idx = []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        gen.shuffle(idx)
        test_idx.append(idx[: max(1, int(round(fraction * len(idx))))])
    test = np.sort(np.concatenate(test_idx))
    mask = np.ones(len(y), bool)
    mask[test] = False
    return (x[mask], y[mask]), (x[test], y[test])


def _label_shards(indices: np.ndarray, y: np.ndarray, n_dev: int, per_device: int,
                  gen: np.random.Generator) -> list[np.ndarray]:
    """Sort ``indices`` by label, cut ``n_dev * per_device`` shards, deal ``per_device`` to each."""
    order = indices[np.argsort(y[indices], kind="stable")]
    shards = np.array_split(order, n_dev * per_device)
    deal = gen.permutation(len(shards))
    return [np.concatenate([shards[s] for s in deal[i::n_dev]]) for i in range(n_dev)]


def partition(y: np.ndarray, devices: Sequence[str], cfg: DataConfig,
              cells: Mapping[str, Sequence[str]] | None = None) -> dict[str, np.ndarray]:
    """Indices of ``y`` per device, by the configured scheme. Every device gets >= 1 sample.

    ``cell_shards`` needs ``cells`` (cell -> devices): an iid split across cells, then label
    shards within each (HIST's "cell iid, client non-iid", digest §5).
    """
    n_dev = len(devices)
    gen = stream(cfg.seed, "partition", cfg.partition)
    if len(y) < n_dev:
        raise ValueError(f"{len(y)} training samples cannot be spread over {n_dev} devices")
    if cfg.partition == "iid":
        parts = np.array_split(gen.permutation(len(y)), n_dev)
    elif cfg.partition == "shards":
        parts = _label_shards(np.arange(len(y)), y, n_dev, cfg.classes_per_device, gen)
    elif cfg.partition == "cell_shards":
        if cells is None:
            raise ValueError("the cell_shards partition needs the topology")
        by_device: dict[str, np.ndarray] = {}
        for cell_indices, members in zip(np.array_split(gen.permutation(len(y)), len(cells)),
                                         (cells[c] for c in sorted(cells)), strict=True):
            for d, p in zip(members, _label_shards(cell_indices, y, len(members), cfg.classes_per_device, gen),
                            strict=True):
                by_device[d] = p
        parts = [by_device[d] for d in devices]
    elif cfg.partition == "one_class":
        parts = _one_class(y, n_dev, gen)
    else:
        buckets: list[list[np.ndarray]] = [[] for _ in range(n_dev)]
        for c in np.unique(y):
            idx = gen.permutation(np.flatnonzero(y == c))
            props = gen.dirichlet(np.full(n_dev, cfg.alpha))
            cuts = (np.cumsum(props)[:-1] * len(idx)).astype(int)
            for i, chunk in enumerate(np.split(idx, cuts)):
                buckets[i].append(chunk)
        parts = [np.concatenate(b) for b in buckets]
        # Dirichlet can leave a device empty; give it one sample from the largest device.
        for i, p in enumerate(parts):
            if len(p) == 0:
                j = int(np.argmax([len(q) for q in parts]))
                parts[i], parts[j] = parts[j][:1], parts[j][1:]
    return {d: np.sort(p) for d, p in zip(devices, parts, strict=True)}


def _one_class(y: np.ndarray, n_dev: int, gen: np.random.Generator) -> list[np.ndarray]:
    """Devices 1, 3, 5, ... hold only positives, devices 0, 2, 4, ... only negatives (consecutive devices —
    one cell — get both kinds); each class is shuffled and split evenly over its devices."""
    _binary(y, "partition")
    if n_dev < 2:
        raise ConfigError("the one_class partition needs at least 2 devices (one per class)", key="data.partition")
    holders = {1: list(range(1, n_dev, 2)), 0: list(range(0, n_dev, 2))}
    parts: list[np.ndarray] = [np.zeros(0, np.int64)] * n_dev
    for c, devices in holders.items():
        idx = gen.permutation(np.flatnonzero(y == c))
        if len(idx) < len(devices):
            raise ConfigError(f"{len(idx)} rows of class {c} cannot be spread over {len(devices)} devices",
                              key="data.partition")
        for d, chunk in zip(devices, np.array_split(idx, len(devices)), strict=True):
            parts[d] = chunk
    return parts


def holdout_split(n: int, fraction: float, seed: int, device: str) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, held_out)`` of a device's ``n`` rows: ``round(fraction * n)`` rows held
    out at random (stream ``(seed, "holdout", device)``), always leaving one to train on."""
    if fraction <= 0 or n < 2:
        return np.arange(n), np.zeros(0, dtype=np.int64)
    k = min(n - 1, int(round(fraction * n)))
    order = stream(seed, "holdout", device).permutation(n)
    return np.sort(order[k:]), np.sort(order[:k])


def make_federated(cfg: DataConfig, devices: Sequence[str],
                   cells: Mapping[str, Sequence[str]] | None = None) -> FederatedData:
    """Load, split and partition; see the module docstring."""
    if cfg.dataset == "files":
        return load_files(cfg, devices)
    x, y = load_dataset(cfg)
    if cfg.positive_rate and cfg.dataset != "rare_event":
        x, y = keep_positive_rate(x, y, cfg.positive_rate, cfg.seed)
    (xtr, ytr), (xte, yte) = train_test_split(x, y, cfg.test_fraction, cfg.seed)
    features, classes = int(x.shape[1]), int(y.max()) + 1
    del x, y  # the split holds copies: free the whole set before the devices' shards are cut
    if cfg.standardize:
        mu, sd = xtr.mean(axis=0), xtr.std(axis=0) + 1e-6
        xtr, xte = ((xtr - mu) / sd).astype(np.float32), ((xte - mu) / sd).astype(np.float32)
    if cfg.label_noise:
        ytr = flip_labels(ytr, cfg.label_noise, cfg.seed)
    parts = partition(ytr, devices, cfg, cells)
    if cfg.dataset == "rare_event" and cfg.device_shift:
        shifts = device_shifts(cfg, len(devices))
        xtr = xtr.copy()
        for i, d in enumerate(devices):
            xtr[parts[d]] += shifts[i]
        xte = (xte + shifts[stream(cfg.seed, "rare-event-test-shift").integers(0, len(devices), len(xte))]
               ).astype(np.float32)
    test = (xte, yte)
    train: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    holdout: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for d, idx in parts.items():
        keep, held = holdout_split(len(idx), cfg.holdout, cfg.seed, d)
        train[d] = (xtr[idx[keep]], ytr[idx[keep]])
        if len(held):
            holdout[d] = (xtr[idx[held]], ytr[idx[held]])
    return FederatedData(train=train, test=test, num_features=features, num_classes=classes, holdout=holdout)


def load_files(cfg: DataConfig, devices: Sequence[str]) -> FederatedData:
    """The user's own data: ``<dir>/<device>/`` shards (``fedtier data split``) and ``eval_file``.

    Raises:
        ConfigError: A device has no shard under ``dir``, or a file is malformed (the message
            names the key and the file).
    """
    from fleet_data.tables import read_table
    from device_agent.data import load_data_dir, load_eval_dir

    train: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    holdout: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if cfg.dir is not None:
        for d in devices:
            shard = cfg.dir / d
            if not shard.is_dir():
                raise ConfigError(f"no shard for device {d!r} in {cfg.dir} (fedtier data split --devices N writes "
                                  "dev-00 ... in the topology's naming)", key="data.dir")
            rows = load_data_dir(shard)
            train[d] = (rows.x.reshape(len(rows.x), -1), rows.y)
            held = load_eval_dir(shard)
            if held is not None and len(held):
                holdout[d] = (held.x.reshape(len(held.x), -1), held.y)
    test = None
    if cfg.eval_file is not None:
        table = read_table(cfg.eval_file, cfg.label_column, key="data.eval_file", label_key="data.label_column")
        if table.class_names is not None:
            raise ConfigError("labels must be numbers (fedtier data split --test-fraction writes a test.npz "
                              "numbered like the shards)", key="data.eval_file", source=str(cfg.eval_file))
        test = (table.x, table.y)
    parts = [*train.values(), *holdout.values(), *([test] if test is not None else [])]
    widths = {int(np.prod(x.shape[1:])) for x, _ in parts}
    if len(widths) > 1:
        raise ConfigError(f"the shards and eval_file disagree on the number of features: {sorted(widths)}",
                          key="data.dir")
    labels = [np.asarray(y) for _, y in parts]
    classes = 0
    if labels and all(y.ndim == 1 and np.array_equal(y, np.round(y)) and (len(y) == 0 or y.min() >= 0)
                      for y in labels):
        classes = int(max((y.max() for y in labels if len(y)), default=-1)) + 1
    return FederatedData(train=train, test=test, num_features=widths.pop() if widths else 0, num_classes=classes,
                         holdout=holdout)

"""A device's local data: every ``.npz`` and ``.csv`` file of a directory, concatenated.

* ``.npz``: arrays ``x`` (features, float) and ``y`` (labels: integer classes, or float
  targets of shape ``(n,)`` or ``(n, outputs)`` for ``bce``/``mse`` models); ``X``/``Y`` too.
* ``.csv``: numeric rows, the last column is the label; a first row that is not numeric
  is taken as a header and skipped.

A device's **shard** (what ``fedtier data split`` and the demo's fleet writer produce, with
:func:`write_shard`) is such a directory with ``train.npz``, and optionally an ``eval/``
sub-directory of held-out rows the device never trains on: it evaluates each round's incoming
global model on them (federated evaluation). ``load_data_dir`` reads only the files directly in
a directory, so the held-out rows never leak into training.

Labels are checked against the model once its manifest arrives (:func:`fit_to_model`): class
numbers for ``cross_entropy``, targets for ``bce``/``mse``.

Files are read without pickle (``allow_pickle=False``): a data directory may be written by
other software on the device, and a pickled array is code.
"""

from __future__ import annotations

import csv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedtier.errors import ConfigError
from fedtier.storage import npz
from fedtier.training.layout import SCORE_LOSSES, ArchSpec

TRAIN_FILE = "train.npz"
"""A shard's training rows."""

EVAL_DIR = "eval"
"""A shard's sub-directory of held-out rows (federated evaluation)."""


@dataclass(frozen=True, slots=True)
class LocalData:
    """Features (float32) and labels of one device: int64 when every label is a whole number,
    float32 otherwise (regression targets)."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"{len(self.x)} feature rows but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)


def _load_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with npz.LOCK, np.load(path, allow_pickle=False) as z:
            xk = "x" if "x" in z.files else "X" if "X" in z.files else None
            yk = "y" if "y" in z.files else "Y" if "Y" in z.files else None
            if xk is None or yk is None:
                raise ConfigError(f"needs arrays 'x' and 'y', has {z.files}", source=str(path))
            x, y = np.asarray(z[xk]), np.asarray(z[yk])
    except ConfigError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        # Includes object (pickled) arrays, which allow_pickle=False refuses to load.
        raise ConfigError(f"not a readable numeric .npz: {exc}", source=str(path)) from None
    if x.dtype.kind not in "biuf" or y.dtype.kind not in "biuf":
        raise ConfigError(f"arrays must be numeric (x is {x.dtype}, y is {y.dtype})", source=str(path))
    return x, y


def _load_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    rows: list[list[float]] = []
    with open(path, newline="") as fh:
        for i, row in enumerate(csv.reader(fh)):
            if not row:
                continue
            try:
                rows.append([float(v) for v in row])
            except ValueError:
                if i == 0:
                    continue  # header
                raise ConfigError(f"line {i + 1} is not numeric", source=str(path)) from None
    if not rows:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
    arr = np.asarray(rows, dtype=np.float64)
    return arr[:, :-1], arr[:, -1]


def load_data_dir(directory: Path, input_shape: tuple[int, ...] | None = None) -> LocalData:
    """Load and concatenate every data file of ``directory``.

    Args:
        directory: a directory of ``.npz``/``.csv`` files.
        input_shape: if given, each example is reshaped to it (and must have its size).

    Raises:
        ConfigError: the directory is missing or empty, a file is malformed, labels are not
            finite numbers, or features do not fit ``input_shape``.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError("data directory does not exist", source=str(directory))
    files = sorted(p for p in directory.iterdir() if p.suffix in (".npz", ".csv"))
    if not files:
        raise ConfigError("data directory holds no .npz or .csv files", source=str(directory))
    xs, ys = [], []
    for f in files:
        x, y = _load_npz(f) if f.suffix == ".npz" else _load_csv(f)
        if len(x) != len(y):
            raise ConfigError(f"{len(x)} feature rows but {len(y)} labels", source=str(f))
        if len(y) and not np.all(np.isfinite(np.asarray(y, dtype=np.float64))):
            raise ConfigError("labels contain NaN or infinity", source=str(f))
        if not np.all(np.isfinite(np.asarray(x, dtype=np.float64))):
            raise ConfigError("features contain NaN or infinity", source=str(f))
        if input_shape is not None and len(x):
            size = int(np.prod(input_shape))
            if int(np.prod(x.shape[1:])) != size:
                raise ConfigError(f"examples have {int(np.prod(x.shape[1:]))} values, the model takes "
                                  f"{input_shape}", source=str(f))
            x = x.reshape((len(x), *input_shape))
        xs.append(np.asarray(x, dtype=np.float32))
        ys.append(np.asarray(y, dtype=np.float64))
    if len({y.shape[1:] for y in ys}) > 1:
        raise ConfigError(f"files disagree on the label shape: {sorted({y.shape[1:] for y in ys})}",
                          source=str(directory))
    y = np.concatenate(ys)
    labels = y.astype(np.int64) if np.array_equal(y, np.round(y)) else y.astype(np.float32)
    return LocalData(x=np.ascontiguousarray(np.concatenate(xs)), y=labels)


def load_eval_dir(data_dir: Path, eval_dir: Path | None = None) -> LocalData | None:
    """The held-out rows of a device: ``eval_dir``, or ``<data_dir>/eval`` if it exists, else ``None``.

    Raises:
        ConfigError: ``eval_dir`` was given but does not exist, or its files are malformed.
    """
    directory = Path(eval_dir) if eval_dir is not None else Path(data_dir) / EVAL_DIR
    if eval_dir is None and not (directory.is_dir() and any(p.suffix in (".npz", ".csv") for p in directory.iterdir())):
        return None
    return load_data_dir(directory)


def write_shard(directory: Path, train: tuple[np.ndarray, np.ndarray],
                held_out: tuple[np.ndarray, np.ndarray] | None = None) -> Path:
    """Write one device's shard: ``train.npz`` and, if given, ``eval/eval.npz`` (the format
    ``load_data_dir`` and ``load_eval_dir`` read). A stale ``eval/eval.npz`` is removed when
    no held-out rows are given.

    Returns:
        The shard directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / TRAIN_FILE, x=np.asarray(train[0]), y=np.asarray(train[1]))
    eval_file = directory / EVAL_DIR / "eval.npz"
    if held_out is not None and len(held_out[1]):
        eval_file.parent.mkdir(exist_ok=True)
        np.savez(eval_file, x=np.asarray(held_out[0]), y=np.asarray(held_out[1]))
    elif eval_file.parent.is_dir():
        eval_file.unlink(missing_ok=True)
        if not any(eval_file.parent.iterdir()):
            eval_file.parent.rmdir()
    return directory


def fit_to_model(data: LocalData, arch: ArchSpec) -> LocalData:
    """``data`` checked against the model and laid out as it takes it.

    Examples are reshaped to ``arch.input_shape``; labels become int64 classes in
    ``[0, num_classes)`` (``cross_entropy``), classes 0/1 (``weighted_score``, an X-risk scorer) or
    float32 targets ``(n, outputs)`` (``bce``, in ``[0, 1]``; ``mse``).

    Raises:
        ConfigError: no samples, examples of the wrong size, or labels that do not fit the loss.
    """
    x, y, shape = data.x, np.asarray(data.y), arch.input_shape
    if len(y) == 0:
        raise ConfigError("no local samples")
    if int(np.prod(x.shape[1:])) != int(np.prod(shape)):
        raise ConfigError(f"local examples have shape {x.shape[1:]}, the model takes {shape}")
    if x.shape[1:] != shape:
        x = np.ascontiguousarray(x.reshape((len(x), *shape)))
    k = arch.num_classes
    if arch.loss in SCORE_LOSSES:
        # An X-risk scorer (FeDXL) trains on pairs of a positive (1) and a negative (0).
        if y.ndim != 1 or not np.isin(y, (0, 1)).all():
            raise ConfigError("labels must be 0 (negative) or 1 (positive) for a score model (fedxl)")
        return LocalData(x=x, y=y.astype(np.int64))
    if arch.loss == "cross_entropy":
        if y.ndim != 1 or not np.array_equal(y, np.round(y)):
            raise ConfigError(f"labels must be class numbers (non-negative integers) for cross_entropy; got "
                              f"{'shape ' + str(y.shape) if y.ndim != 1 else 'fractions'}")
        if int(y.min()) < 0 or int(y.max()) >= k:
            raise ConfigError(f"local labels span [{int(y.min())}, {int(y.max())}]; the model has {k} classes "
                              "(labels must be non-negative integers below that)")
        return LocalData(x=x, y=y.astype(np.int64))
    targets = y.reshape(len(y), 1) if y.ndim == 1 and k == 1 else y
    if targets.shape[1:] != (k,):
        width = 1 if y.ndim == 1 else int(np.prod(y.shape[1:]))
        if arch.loss == "bce" and y.ndim == 1 and np.isin(y, (0, 1)).all():
            fix = (f"for labels 0/1 the model needs one output with bce, or loss = 'cross_entropy' for its {k} "
                   "outputs (labels 0 and 1 as classes)")
        else:
            fix = f"give the model {width} output(s), one per target column"
        raise ConfigError(f"the rollout's [model] loss = {arch.loss!r} trains one model output per target column: "
                          f"local labels have {width} column(s) per example (shape {y.shape[1:]}), the model has {k} "
                          f"output(s); fix the rollout's [model]: {fix}")
    if arch.loss == "bce" and (targets.min() < 0 or targets.max() > 1):
        raise ConfigError(f"the rollout's [model] loss = 'bce' trains on targets in [0, 1]; local targets span "
                          f"[{targets.min()}, {targets.max()}] (class numbers: loss = 'cross_entropy')")
    return LocalData(x=x, y=np.ascontiguousarray(targets, dtype=np.float32))

"""A device's local data: every ``.npz`` and ``.csv`` file of a directory, concatenated.

* ``.npz``: arrays ``x`` (features, float) and ``y`` (integer class labels); ``X``/``Y`` too.
* ``.csv``: numeric rows, the last column is the label; a first row that is not numeric
  is taken as a header and skipped.

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


@dataclass(frozen=True, slots=True)
class LocalData:
    """Features (float32) and labels (int64) of one device."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"{len(self.x)} feature rows but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)


def _load_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
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
            non-negative integers, or features do not fit ``input_shape``.
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
        if len(y) and (not np.all(np.isfinite(y)) or np.any(y < 0) or np.any(np.asarray(y) != np.round(y))):
            raise ConfigError("labels must be non-negative integers", source=str(f))
        if not np.all(np.isfinite(np.asarray(x, dtype=np.float64))):
            raise ConfigError("features contain NaN or infinity", source=str(f))
        if input_shape is not None and len(x):
            size = int(np.prod(input_shape))
            if int(np.prod(x.shape[1:])) != size:
                raise ConfigError(f"examples have {int(np.prod(x.shape[1:]))} values, the model takes "
                                  f"{input_shape}", source=str(f))
            x = x.reshape((len(x), *input_shape))
        xs.append(np.asarray(x, dtype=np.float32))
        ys.append(np.asarray(y).astype(np.int64))
    return LocalData(x=np.ascontiguousarray(np.concatenate(xs)), y=np.concatenate(ys))

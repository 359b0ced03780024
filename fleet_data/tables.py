"""Reading a user's tabular data (``.csv`` or ``.npz``) into features and labels.

Used by ``fedtier data split`` (the input to split across devices) and by ``[data] eval_file``
(the coordinator's central test set). What devices read is the shard format of
``device_agent.data``; this module reads what users have.

* ``.csv``: one example per row. The label column is chosen by name (the first row is then
  the header) or by 0-based index (negative counts from the end; default: the last column);
  several label columns, comma-separated, give multi-output targets. A first row with a
  non-numeric feature cell is a header. Labels that are not numbers (``cat``, ``dog``) are
  numbered in sorted order, and the names are kept (``Table.class_names``).
* ``.npz``: arrays ``x`` and ``y`` (or ``X``/``Y``), read without pickle.

Every problem is a ``ConfigError`` naming the option or key and the file.
"""

from __future__ import annotations

import csv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedtier.errors import ConfigError
from fedtier.storage import npz as npz_file


@dataclass(frozen=True)
class Table:
    """Features ``x`` (float32, ``(n, features)`` or as stored in an ``.npz``) and labels ``y``
    (int64 class numbers when whole numbers, else float32; ``(n,)`` or ``(n, outputs)``)."""

    x: np.ndarray
    y: np.ndarray
    feature_names: tuple[str, ...] | None = None
    class_names: tuple[str, ...] | None = None

    @property
    def classes(self) -> bool:
        """Whether the labels are class numbers (one column of non-negative whole numbers)."""
        y = self.y
        return bool(y.ndim == 1 and np.issubdtype(y.dtype, np.integer) and (len(y) == 0 or y.min() >= 0))


def read_table(path: Path, label_column: str | None = None, *, key: str = "--input",
               label_key: str = "--label-column") -> Table:
    """Read ``path`` (``.csv`` or ``.npz``); see the module docstring.

    Args:
        path: The file.
        label_column: CSV only: name(s) or index(es) of the label column(s), comma-separated.
        key: What to name in errors about the file (an option or a config key).
        label_key: What to name in errors about the label column.

    Raises:
        ConfigError: Missing or unreadable file, unknown label column, non-numeric features,
            ragged rows, NaN or infinity.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"file not found: {path}", key=key)
    if path.suffix == ".npz":
        if label_column is not None:
            raise ConfigError("an .npz file has its labels in array y; --label-column is for CSV files",
                              key=label_key, source=str(path))
        return _read_npz(path, key)
    if path.suffix != ".csv":
        raise ConfigError(f"expected a .csv or .npz file, got {path.name}", key=key)
    return _read_csv(path, label_column, key, label_key)


def _read_npz(path: Path, key: str) -> Table:
    try:
        with npz_file.LOCK, np.load(path, allow_pickle=False) as z:
            xk = next((k for k in ("x", "X") if k in z.files), None)
            yk = next((k for k in ("y", "Y") if k in z.files), None)
            if xk is None or yk is None:
                raise ConfigError(f"needs arrays 'x' and 'y', has {z.files}", key=key, source=str(path))
            x, y = np.asarray(z[xk]), np.asarray(z[yk])
    except ConfigError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"not a readable numeric .npz: {exc}", key=key, source=str(path)) from None
    if x.dtype.kind not in "biuf" or y.dtype.kind not in "biuf":
        raise ConfigError(f"arrays must be numeric (x is {x.dtype}, y is {y.dtype})", key=key, source=str(path))
    if len(x) != len(y):
        raise ConfigError(f"{len(x)} feature rows but {len(y)} labels", key=key, source=str(path))
    return Table(x=_finite(x.astype(np.float32), key, path), y=_labels(y.astype(np.float64), key, path))


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _read_csv(path: Path, label_column: str | None, key: str, label_key: str) -> Table:
    """Read the rows, choose the label and feature columns (which settles the header), then parse the body."""
    rows = _csv_rows(path, key)
    header, label_idx, features = _columns(rows[0][1], label_column, label_key, path)
    body = rows[1:] if header is not None else rows
    if not body:
        raise ConfigError("the file has a header but no data rows", key=key, source=str(path))
    x, raw_labels = _parse_body(body, len(rows[0][1]), features, label_idx, header, key, path)
    y, class_names = _label_values(raw_labels, len(label_idx), label_key, path)
    names = tuple(header[i] for i in features) if header is not None else None
    return Table(x=_finite(x.astype(np.float32), key, path), y=_labels(y, key, path), feature_names=names,
                 class_names=class_names)


def _columns(first: list[str], label_column: str | None, label_key: str,
             path: Path) -> tuple[list[str] | None, list[int], list[int]]:
    """``(header, label columns, feature columns)`` from the first row and ``label_column``. The first row is
    the header when a label column is named, or when one of its feature cells is not a number."""
    width = len(first)
    tokens = [t.strip() for t in (label_column or "-1").split(",") if t.strip()]
    if not tokens:
        raise ConfigError("names no column", key=label_key, source=str(path))
    by_name = any(_number(t) is None for t in tokens)
    header: list[str] | None = [c.strip() for c in first] if by_name else None
    label_idx = [_label_index(token, header, width, label_key, path) for token in tokens]
    features = [i for i in range(width) if i not in label_idx]
    if not features:
        raise ConfigError("every column is a label; no features left", key=label_key, source=str(path))
    if header is None and any(_number(first[i]) is None for i in features):
        header = [c.strip() for c in first]
    return header, label_idx, features


def _csv_rows(path: Path, key: str) -> list[tuple[int, list[str]]]:
    """The non-blank rows with their 1-based line numbers (for errors); a BOM is dropped."""
    with open(path, newline="", encoding="utf-8-sig") as fh:
        rows = [(i + 1, row) for i, row in enumerate(csv.reader(fh)) if row and any(c.strip() for c in row)]
    if not rows:
        raise ConfigError("the file has no rows", key=key, source=str(path))
    return rows


def _label_index(token: str, header: list[str] | None, width: int, label_key: str, path: Path) -> int:
    """One label column's 0-based index: by its name in the header, or a (possibly negative) index."""
    if _number(token) is None:
        assert header is not None  # a non-numeric token makes the first row the header
        if token not in header:
            raise ConfigError(f"no column {token!r}; the header has {header}", key=label_key, source=str(path))
        return header.index(token)
    index = int(float(token))
    if not -width <= index < width:
        raise ConfigError(f"column {index} does not exist: rows have {width} columns", key=label_key,
                          source=str(path))
    return index % width


def _parse_body(body: list[tuple[int, list[str]]], width: int, features: list[int], label_idx: list[int],
                header: list[str] | None, key: str, path: Path) -> tuple[np.ndarray, list[list[str]]]:
    """The feature matrix (float64) and each row's label cells as text; a ragged row or a non-numeric feature
    cell is an error naming its line (and column)."""
    x = np.empty((len(body), len(features)), dtype=np.float64)
    raw_labels: list[list[str]] = []
    for r, (line, row) in enumerate(body):
        if len(row) != width:
            raise ConfigError(f"line {line} has {len(row)} columns, the first row {width}", key=key,
                              source=str(path))
        for j, col in enumerate(features):
            value = _number(row[col])
            if value is None:
                name = header[col] if header is not None else str(col)
                raise ConfigError(f"line {line}, column {name!r}: {row[col]!r} is not a number", key=key,
                                  source=str(path))
            x[r, j] = value
        raw_labels.append([row[c].strip() for c in label_idx])
    return x, raw_labels


def _label_values(raw_labels: list[list[str]], columns: int, label_key: str,
                  path: Path) -> tuple[np.ndarray, tuple[str, ...] | None]:
    """The labels as numbers, ``(rows,)`` for one label column and ``(rows, columns)`` for several, and the class
    names when the one column holds text: its values numbered in sorted order. Several label columns must all
    be numbers (multi-output targets)."""
    numbers = [[_number(v) for v in labels] for labels in raw_labels]
    class_names: tuple[str, ...] | None = None
    if all(v is not None for labels in numbers for v in labels):
        y = np.asarray(numbers, dtype=np.float64)
    elif columns == 1:
        class_names = tuple(sorted({labels[0] for labels in raw_labels}))
        number_of = {name: i for i, name in enumerate(class_names)}
        y = np.asarray([[number_of[labels[0]]] for labels in raw_labels], dtype=np.float64)
    else:
        raise ConfigError("several label columns must all be numbers", key=label_key, source=str(path))
    return (y[:, 0] if columns == 1 else y), class_names


def _finite(x: np.ndarray, key: str, path: Path) -> np.ndarray:
    if not np.all(np.isfinite(x)):
        raise ConfigError("features contain NaN or infinity", key=key, source=str(path))
    return x


def _labels(y: np.ndarray, key: str, path: Path) -> np.ndarray:
    if not np.all(np.isfinite(y)):
        raise ConfigError("labels contain NaN or infinity", key=key, source=str(path))
    return y.astype(np.int64) if np.array_equal(y, np.round(y)) else y.astype(np.float32)

"""One lock for reading ``.npz`` files in a process.

Why: numpy parses each array's header with ``ast.literal_eval``, and CPython 3.11's AST
constructor keeps its recursion depth in state that threads share (CPython gh-106905). Nodes
built on threads of one process (``local_fleet.threads``, the HSGD demo, the fleet
emulator's servers) loading arrays at the same moment could fail with ``SystemError: AST
constructor recursion depth mismatch``. Every ``np.load`` of the project holds this lock; loads
are rare (a node's data at start, a model version), so it costs nothing.
"""

from __future__ import annotations

import io
import threading
from typing import Any, Mapping

import numpy as np

LOCK = threading.Lock()


def encode_arrays(arrays: Mapping[str, Any]) -> bytes:
    """Named arrays as the bytes of an ``.npz`` (no pickle): a strategy's state, such as a server
    optimizer's moments, as the coordinator and the edges store it."""
    buf = io.BytesIO()
    named: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
    np.savez(buf, **named)
    return buf.getvalue()


def decode_arrays(blob: bytes) -> dict[str, np.ndarray]:
    """``encode_arrays``' inverse; refuses pickled (object) arrays."""
    with LOCK, np.load(io.BytesIO(blob), allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}

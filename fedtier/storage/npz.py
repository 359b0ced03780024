"""One lock for reading ``.npz`` files in a process.

Why: numpy parses each array's header with ``ast.literal_eval``, and CPython 3.11's AST
constructor keeps its recursion depth in state that threads share (CPython gh-106905). Nodes
built on threads of one process (``cloud_coordinator.thread_fleet``, the HSGD demo, the fleet
emulator's servers) loading arrays at the same moment could fail with ``SystemError: AST
constructor recursion depth mismatch``. Every ``np.load`` of the project holds this lock; loads
are rare (a node's data at start, a model version), so it costs nothing.
"""

from __future__ import annotations

import threading

LOCK = threading.Lock()

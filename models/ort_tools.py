"""Keeping onnxruntime's tooling quiet: its logging setup off the application's root logger, and
its native stderr captured (to show the tail when a build fails) instead of printed.

Shared by the artifact builder (``models.artifacts``) and the model source's ONNX checks
(``models.source``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from typing import Any, Iterator

_STDERR_TAIL = 4000
_fd2_lock = threading.Lock()


@contextlib.contextmanager
def no_root_basic_config() -> Iterator[None]:
    """Keep onnxruntime's tooling from configuring the application's root logger.

    Importing ``onnxruntime.training.artifacts`` runs ``logging.basicConfig(...)``
    (``onnxruntime/tools/logger.py``), and ``generate_artifacts`` calls bare
    ``logging.info``, which runs ``basicConfig()`` on a handler-less root logger. Either
    installs a stderr handler and turns the application's own later ``basicConfig(...)``
    into a silent no-op. A temporary ``NullHandler`` on the root logger prevents both.
    """
    root = logging.getLogger()
    guard = logging.NullHandler() if not root.handlers else None
    if guard is not None:
        root.addHandler(guard)
    try:
        yield
    finally:
        if guard is not None:
            root.removeHandler(guard)


class _Captured:
    """Handle to the temp file that received fd 2 during a quiet section."""

    def __init__(self, fh: Any) -> None:
        self._fh = fh

    def tail(self) -> str:
        self._fh.flush()
        self._fh.seek(0, os.SEEK_END)
        size = self._fh.tell()
        self._fh.seek(max(0, size - _STDERR_TAIL))
        return self._fh.read().decode("utf-8", errors="replace")


@contextlib.contextmanager
def quiet_fd2() -> Iterator[_Captured]:
    """Redirect file descriptor 2 (native stderr) to a temp file; always restore it.

    Process-wide while active (other threads' stderr goes to the file too), hence the lock.
    """
    with _fd2_lock, tempfile.TemporaryFile() as sink:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            yield _Captured(sink)
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)

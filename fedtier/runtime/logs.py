"""Logging setup for services: one line per event, key facts first, to stderr or a file."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)-7s %(name)s[%(node)s]: %(message)s"


class _NodeFilter(logging.Filter):
    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    def filter(self, record: logging.LogRecord) -> bool:
        record.node = self.node
        return True


def setup(level: str = "info", *, node: str = "-", file: Path | None = None) -> None:
    """Configure the root logger for a service process (idempotent)."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    handler: logging.Handler = logging.FileHandler(file) if file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_NodeFilter(node))
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # paho logs nothing useful at INFO; ORT's python side is chatty at DEBUG.
    logging.getLogger("paho").setLevel(logging.WARNING)

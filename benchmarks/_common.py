"""Shared helpers: where results go, and the machine they were measured on."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def spread(values: list[float]) -> dict[str, float]:
    """The median of repeated measurements, with their spread."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def write(name: str, results: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **results}, indent=1) + "\n")
    return path

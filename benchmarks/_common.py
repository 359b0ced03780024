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


DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def describe_machine() -> str:
    """One line naming the machine and the time of a run, for the docs."""
    m = machine()
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.0f} GiB, "
    except (OSError, ValueError, IndexError):
        mem = ""
    return f"{m['cpus']} cores, {mem}{m['processor']}, Python {m['python']}; measured {m['measured']}"


def publish(name: str, command: str, markdown: str) -> Path:
    """Put a benchmark's table into ``docs/benchmarks.md``, between ``<!-- bench:NAME -->`` and
    ``<!-- /bench:NAME -->``, under a line with the command that made it and the machine.

    The prose around the markers (what the numbers mean) is written by people and stays; a
    document without the markers gets them appended at its end.
    """
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = (f"{start}\nCommand: `{command}`. Machine: {describe_machine()}.\n\n{markdown.rstrip()}\n{end}")
    text = DOCS.read_text() if DOCS.exists() else ""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    DOCS.write_text(text)
    return DOCS

"""Shared by the experiment runners: progress while they run, one experiment's section of docs/experiments.md."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "experiments.md"
IMG = ROOT / "docs" / "img"
HEADER = ("# Experiments\n\nPaper reproductions, each run by its script in `experiments/` from its config there.\n"
          "Every number below was written by that script; rerun it to regenerate its section.\n")


def write_section(name: str, body: str) -> Path:
    """Replace (or append) the section between ``<!-- experiment:name -->`` markers."""
    start, end = f"<!-- experiment:{name} -->", f"<!-- /experiment:{name} -->"
    text = DOC.read_text() if DOC.exists() else HEADER
    block = f"{start}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    return DOC


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def arguments(description: str, default_config: Path) -> argparse.Namespace:
    """The runners' command line: ``--config`` (default: the runner's TOML) and ``--workers``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", type=Path, default=default_config)
    ap.add_argument("--workers", type=int, default=2, help="simulations run in parallel processes")
    return ap.parse_args()


def progress(total: int) -> Any:
    """The runs' progress on stderr: a line per finished run, and a live bar (run r/N, accuracy,
    epsilon where there is one, elapsed, remaining) when stderr is a terminal."""
    from commands.console import RoundProgress, make_console

    return RoundProgress(make_console(stderr=True), total, unit="run")


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A summary table (the acceptance checks) on stdout, as a rich table."""
    from rich import box
    from rich.table import Table

    from commands.console import make_console

    table = Table(*header, title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for row in rows:
        table.add_row(*map(str, row))
    make_console().print(table)

"""What the coordinator's commands show a person while they run: round lines, a live bar, tables.

One rule for ``fedtier demo``, ``fedtier simulate`` and the experiment runners (built on rich):

* attached to a terminal, a live progress bar (round r/N, accuracy, epsilon where there is one,
  elapsed and remaining time) stays under the round lines and disappears when the run ends;
* not attached to a terminal (piped, redirected, CI logs), only the plain round lines are
  written: no bar, no colours, no control characters;
* with ``--json`` the caller passes ``enabled=False``: nothing at all.

``FEDTIER_FORCE_TERMINAL=1`` forces terminal mode (``0`` forces plain mode), for tests and for
log viewers that render ANSI sequences.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

FORCE_TERMINAL_ENV = "FEDTIER_FORCE_TERMINAL"
# Tables written to a file or a pipe get this width (rich's default there is 80 columns, which
# squeezes a summary of ten columns); a terminal uses its own width, COLUMNS overrides both.
PLAIN_WIDTH = 160


def forced_terminal() -> bool | None:
    """``FEDTIER_FORCE_TERMINAL``: True (``1``, ``true``, ``yes``), False (``0``, ...), or None (detect)."""
    value = os.environ.get(FORCE_TERMINAL_ENV, "").strip().lower()
    if not value:
        return None
    return value not in ("0", "false", "no", "off")


def make_console(file: TextIO | None = None, *, stderr: bool = False) -> Console:
    """A console on ``file`` (default stdout, or stderr) that follows the rule above.

    Highlighting and markup are off: round lines and ids print exactly as written (``[x]`` is
    not a style), and a plain console adds nothing to them.
    """
    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    force = forced_terminal()
    is_tty = force if force is not None else _isatty(stream)
    width = None if is_tty or os.environ.get("COLUMNS") else PLAIN_WIDTH
    return Console(file=stream, force_terminal=force, highlight=False, markup=False, emoji=False,
                   soft_wrap=False, width=width)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class RoundProgress:
    """Round lines, and under them a live bar when the console is a terminal.

    Use as a context manager; ``line`` prints a line above the bar (or alone, when plain),
    ``update`` moves the bar. The bar starts on ``__enter__`` and is removed on ``close``
    (``transient``): what stays on the terminal is the lines.

    Args:
        console: where everything goes (``make_console(stderr=True)`` for commands whose
            stdout carries the result).
        total: rounds (or runs) to do.
        unit: what is counted: ``round`` or ``run``.
        enabled: False prints nothing at all (``--json``).
    """

    def __init__(self, console: Console, total: int, *, unit: str = "round", enabled: bool = True) -> None:
        self.console = console
        self.total = total
        self.unit = unit
        self.enabled = enabled
        self.live = enabled and console.is_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> "RoundProgress":
        if self.live:
            self._progress = Progress(
                TextColumn(f"{self.unit} {{task.completed:>{len(str(self.total))}.0f}}/{{task.total:.0f}}"),
                BarColumn(),
                TextColumn("{task.fields[accuracy]}"),
                TextColumn("{task.fields[epsilon]}"),
                TimeElapsedColumn(),
                TextColumn("remaining"),
                TimeRemainingColumn(),
                console=self.console, transient=True, refresh_per_second=8)
            self._progress.start()
            self._task = self._progress.add_task(self.unit, total=self.total, accuracy="", epsilon="")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def line(self, text: str) -> None:
        """One plain line (above the bar in terminal mode)."""
        if self.enabled:
            self.console.print(text, soft_wrap=True)

    def print(self, renderable: Any) -> None:
        """A rich renderable (a table) above the bar."""
        if self.enabled:
            self.console.print(renderable)

    def update(self, done: int, *, accuracy: float | None = None, epsilon: float | None = None) -> None:
        """``done`` of ``total`` finished; the latest accuracy and epsilon, when there are."""
        if self._progress is None or self._task is None:
            return
        fields: dict[str, Any] = {}
        if accuracy is not None:
            fields["accuracy"] = f"accuracy {accuracy:.4f}"
        if epsilon is not None:
            fields["epsilon"] = f"epsilon {epsilon:.3g}"
        self._progress.update(self._task, completed=done, **fields)

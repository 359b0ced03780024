"""The demo's reaper: stops the demo's children when the demo dies, however it dies.

``fedtier demo`` starts this process first, in its own session, with a pipe on its stdin, and
writes ``+PID`` for every child it starts (each child leads its own process group) and
``-PID`` for every child it has stopped and reaped itself. The demo is the only holder of the
pipe's write end, so when the demo exits — normally, on an exception, or killed with SIGKILL,
which no signal handler sees — the reaper reads end-of-file and sends SIGTERM to the groups
still on its list, then SIGKILL to what remains after a grace period.

Linux's ``PR_SET_PDEATHSIG`` would not do: the kernel clears it when a process changes its
user id, which Mosquitto does when started as root (it drops to the ``mosquitto`` user).

Usage (by the demo only): ``python -m local_fleet.reaper``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Iterable, TextIO

GRACE_S = 5.0


def read_groups(stream: TextIO) -> set[int]:
    """The process groups still on the list when ``stream`` ends."""
    groups: set[int] = set()
    for line in stream:
        line = line.strip()
        if len(line) < 2 or line[0] not in "+-" or not line[1:].isdigit():
            continue  # not ours: ignore rather than signal something unintended
        pid = int(line[1:])
        if line[0] == "+":
            groups.add(pid)
        else:
            groups.discard(pid)
    return groups


def alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def terminate(groups: Iterable[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM every group, wait up to ``grace_s`` for them to exit, SIGKILL the rest."""
    pending = set(groups)
    for group in sorted(pending):
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        pending = {g for g in pending if alive(g)}
        time.sleep(0.05)
    for group in sorted(pending):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only end-of-file ends the watch
    terminate(read_groups(sys.stdin))


if __name__ == "__main__":
    main()

"""The processes a test started, read from /proc: which are below a pid, which still run, and how to stop
them all (``stop_tree``) so that a failing test leaks none."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every live (non-zombie) process below ``pid``, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (zombies, waiting for their parent to reap them, do not)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def mentioning(text: str) -> set[int]:
    """Every live process whose command line contains ``text`` (a test's work directory)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.add(int(entry))
    return alive(pids - {os.getpid()})


@dataclass
class Stopped:
    """How ``stop_tree`` ended a process: its exit code (``None``: it did not exit within the grace and was
    killed) and the processes below it (or naming the marker) that were still running after it and were killed."""

    code: int | None
    leftover: set[int] = field(default_factory=set)


def stop_tree(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 30.0,
              marker: str | None = None) -> Stopped:
    """Stop ``proc`` and everything it started, whatever state a test left them in; call it in a ``finally``.

    If ``proc`` still runs, send it ``sig`` (SIGTERM, or SIGINT — which a process that inherited SIGINT
    ignored must have reset: every ``fedtier`` command does) and wait up to ``grace_s`` for it to exit.
    Then SIGKILL what is left: ``proc`` itself (its process group when it leads one) and every process
    below it or whose command line contains ``marker`` — the processes are collected before the signal
    too, since a parent's exit hands its children to init. Nothing a failed test started outlives it.
    """
    tree = descendants(proc.pid) if proc.poll() is None else set()
    if marker is not None:
        tree |= mentioning(marker)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    code = proc.poll()
    if code is None:
        tree |= descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait(30)
    if marker is not None:
        tree |= mentioning(marker)
    leftover = alive(tree)
    for pid in leftover:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(leftover) and time.monotonic() < deadline:
        time.sleep(0.05)
    return Stopped(code, leftover)

"""The fleet's availability and speed traces on the real clock, for ``fedtier fleet emulate``.

``fedtier.rollout.availability`` describes when each device is online and how long one local training
takes it, in seconds of a *virtual* day (``[fleet] day_s``, 86,400 by default); ``fedtier simulate``
reads them on its own virtual clock. The emulator runs real agents through a real broker, so it plays
the same traces in real time, one emulated day lasting ``real_day_s`` real seconds:

    real time  = epoch + virtual time * scale,    scale = real_day_s / [fleet] day_s

so with ``real_day_s = 120`` a device online from 06:00 to 18:00 of the trace is online from 30 s to
90 s of every two minutes of the run, and a training that takes the device ``train_s`` virtual
seconds takes it ``train_s * scale`` real seconds on top of its actual computation (the median
device's ``compute_s = 60`` becomes 83 ms). The traces are those the simulator builds: the same
spec, the rollout's seed and the device ids (``make_traces``), so the same devices are online at the
same fraction of the day in both.

``epoch`` is a ``time.monotonic()`` reading: on Linux, macOS and Windows that clock is system-wide,
so the emulator's worker processes and the test reading the broker agree on what the trace says now.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from fedtier.rollout.availability import AvailabilitySpec, DeviceTrace, make_traces


@dataclass(frozen=True)
class RealTimeTraces:
    """Every emulated device's trace, on the real clock (see the module docstring). Picklable: the
    emulator hands it to each worker process."""

    traces: Mapping[str, DeviceTrace]
    epoch: float
    """``time.monotonic()`` at virtual time 0 (the start of the first emulated day)."""
    scale: float
    """Real seconds per virtual second: ``real_day_s / [fleet] day_s``."""

    @classmethod
    def build(cls, spec: AvailabilitySpec, seed: int, devices: Sequence[str], real_day_s: float,
              epoch: float | None = None) -> "RealTimeTraces":
        """The simulator's traces for ``devices`` (``make_traces(spec, seed, devices)``), a day lasting
        ``real_day_s`` real seconds from ``epoch`` (default: now)."""
        return cls(traces=make_traces(spec, seed, devices), epoch=time.monotonic() if epoch is None else epoch,
                   scale=real_day_s / spec.day_s)

    def virtual(self, now: float) -> float:
        """The trace's time at the monotonic instant ``now``."""
        return (now - self.epoch) / self.scale

    def real(self, virtual: float) -> float:
        """The monotonic instant of the trace's time ``virtual`` (``inf`` stays ``inf``)."""
        return virtual if math.isinf(virtual) else self.epoch + virtual * self.scale

    def online(self, device: str, now: float) -> bool:
        return self.traces[device].online_at(self.virtual(now))

    def next_change(self, device: str, now: float) -> float:
        """The monotonic instant the device next goes offline or comes online (``inf``: never)."""
        return self.real(self.traces[device].next_change(self.virtual(now)))

    def train_delay_s(self, device: str) -> float:
        """Real seconds a local training of ``device`` takes beyond its computation: ``train_s * scale``."""
        return self.traces[device].train_s * self.scale

    def online_count(self, now: float) -> int:
        return sum(1 for device in self.traces if self.online(device, now))

    def within(self, device: str, now: float, margin_s: float) -> bool:
        """Whether a window of ``device`` opens or closes within ``margin_s`` real seconds of ``now`` (where
        what the broker shows may lag the trace: for tests and reports)."""
        before = self.next_change(device, now - margin_s)
        return before <= now + margin_s

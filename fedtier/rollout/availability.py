"""When each device is online and how fast it trains: the fleet's availability and speed traces.

Theory of operation
-------------------
Real fleets are not always there: a watch syncs while it charges at night, a sensor board sleeps
between readings, a phone gateway is reachable only when its owner is home. ``[fleet]`` describes
that (``docs/configuration.md``), and this module turns it into one ``DeviceTrace`` per device:

* ``always``: online all the time (the synchronous simulator's old world);
* ``diurnal``: online once a day for ``share_online * day_s`` seconds, from a phase drawn uniformly
  over the day per device (a window across midnight wraps), so at any instant about ``share_online``
  of the fleet is online;
* ``file``: the windows (and speeds, when given) read from a JSON file (``load_trace_file``).

Speeds are heavy-tailed in every mode: one local training of a device takes
``compute_s * exp(speed_sigma * g)`` seconds of virtual time, ``g ~ N(0, 1)`` drawn once per device
(lognormal: the median device takes ``compute_s``, one in a hundred about ``exp(2.33 sigma)`` times
longer; ``speed_sigma = 0`` makes every device equally fast).

Everything is a pure function of the spec, the rollout seed and the device ids (named streams,
``fedtier.rng``): the same fleet behaves the same in every run. Nothing here sleeps or reads a clock;
the simulator asks ``online_at``, ``next_online`` and ``next_change`` with its own virtual time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fedtier.errors import ConfigError
from fedtier.rng import stream

MODES = ("always", "diurnal", "file")
EDGE_TOLERANCE_S = 1e-6
"""Times this close to a window's edge are at the edge (rounding of ``period + offset``)."""
DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class AvailabilitySpec:
    """``[fleet]`` as the trace functions need it (``fedtier.rollout.config.FleetSection.spec``)."""

    availability: str = "always"
    share_online: float = 1.0
    day_s: float = DAY_S
    compute_s: float = 60.0
    speed_sigma: float = 1.0
    trace_file: Path | None = None

    def __post_init__(self) -> None:
        if self.availability not in MODES:
            raise ConfigError(f"availability must be one of {', '.join(MODES)}, got {self.availability!r}",
                              key="fleet.availability")
        if not (0 < self.share_online <= 1):
            raise ConfigError(f"share_online must be in (0, 1], got {self.share_online!r}", key="fleet.share_online")
        if not (self.day_s > 0 and math.isfinite(self.day_s)):
            raise ConfigError(f"day_s must be > 0, got {self.day_s!r}", key="fleet.day_s")
        if not (self.compute_s > 0 and math.isfinite(self.compute_s)):
            raise ConfigError(f"compute_s must be > 0, got {self.compute_s!r}", key="fleet.compute_s")
        if not (self.speed_sigma >= 0 and math.isfinite(self.speed_sigma)):
            raise ConfigError(f"speed_sigma must be >= 0, got {self.speed_sigma!r}", key="fleet.speed_sigma")
        if self.availability == "file" and self.trace_file is None:
            raise ConfigError("availability = 'file' reads the windows from trace_file: set it", key="fleet.trace_file")
        if self.availability == "always" and self.share_online != 1.0:
            raise ConfigError("share_online is the diurnal share; with availability = 'always' every device is "
                              "online (leave share_online at 1)", key="fleet.share_online")


@dataclass(frozen=True, slots=True)
class DeviceTrace:
    """One device: its online windows ``[start, end)`` (sorted, disjoint; repeated every ``period_s`` when set)
    and the virtual seconds one local training takes it (``train_s``)."""

    windows: tuple[tuple[float, float], ...]
    train_s: float
    period_s: float | None = None

    def __post_init__(self) -> None:
        last = -math.inf
        for start, end in self.windows:
            if not (start < end) or start < last:
                raise ValueError(f"windows must be sorted, disjoint and non-empty, got {self.windows}")
            last = end
        if self.period_s is not None and self.windows and (self.windows[0][0] < 0
                                                           or self.windows[-1][1] > self.windows[0][0] + self.period_s):
            raise ValueError("a periodic trace's windows must fit in one period")
        if not (self.train_s > 0):
            raise ValueError(f"train_s must be > 0, got {self.train_s}")

    @property
    def always(self) -> bool:
        return len(self.windows) == 1 and self.windows[0] == (-math.inf, math.inf)

    def _shifted(self, t: float) -> tuple[float, float]:
        """``(offset, t - offset)``: the period ``t`` falls in and ``t`` within it (no period: ``(0, t)``)."""
        if self.period_s is None:
            return 0.0, t
        offset = math.floor(t / self.period_s) * self.period_s
        return offset, t - offset

    def online_at(self, t: float) -> bool:
        """Whether the device is online at virtual time ``t``."""
        _, local = self._shifted(t)
        if self.period_s is not None and local >= self.period_s - EDGE_TOLERANCE_S:
            local -= self.period_s  # t is a period's end, up to rounding: the next period's start
        # Window edges are compared with a tolerance: ``next_change`` returns ``period + edge``, and the
        # period taken off again here may leave the edge off by a rounding error.
        return any(s - EDGE_TOLERANCE_S <= local < e - EDGE_TOLERANCE_S for s, e in self.windows)

    def next_change(self, t: float) -> float:
        """The first window start or end strictly after ``t`` (``inf`` if none)."""
        if self.always or not self.windows:
            return math.inf
        offset, local = self._shifted(t)
        periods = (offset - (self.period_s or 0.0), offset, offset + (self.period_s or 0.0)) \
            if self.period_s is not None else (0.0,)
        edges = sorted(o + x for o in periods for w in self.windows for x in w)
        now = self.online_at(t)
        # where one window ends as the next begins (a wrapped window at the period's edge) nothing changes
        return next((x for x in edges if x > t + EDGE_TOLERANCE_S and self.online_at(x) != now), math.inf)

    def next_online(self, t: float) -> float:
        """``t`` if online at ``t``, else the next window's start (``inf`` if the device never comes back)."""
        return t if self.online_at(t) else self.next_change(t)


ALWAYS = ((-math.inf, math.inf),)


def train_seconds(spec: AvailabilitySpec, seed: int, device: str) -> float:
    """Virtual seconds one local training takes ``device``: ``compute_s * exp(speed_sigma * g)``, ``g ~ N(0, 1)``
    from the device's own stream (lognormal, heavy-tailed)."""
    g = float(stream(seed, "fleet-speed", device).standard_normal())
    return spec.compute_s * math.exp(spec.speed_sigma * g)


def diurnal_windows(spec: AvailabilitySpec, seed: int, device: str) -> tuple[tuple[float, float], ...]:
    """The device's daily window within ``[0, day_s)``: ``share_online * day_s`` long from a uniform phase.

    A window that crosses midnight is split in two (its tail at the start of the day), so that every
    instant of the day sees the same expected share of the fleet online."""
    length = spec.share_online * spec.day_s
    start = float(stream(seed, "fleet-phase", device).random()) * spec.day_s
    end = start + length
    if end <= spec.day_s:
        return ((start, end),)
    return ((0.0, end - spec.day_s), (start, spec.day_s))


def make_traces(spec: AvailabilitySpec, seed: int, devices: Sequence[str]) -> dict[str, DeviceTrace]:
    """Every device's trace, a pure function of ``spec``, ``seed`` and the device ids.

    Raises:
        ConfigError: the trace file is missing, malformed, or does not cover a device (``fleet.trace_file``).
    """
    from_file = load_trace_file(spec.trace_file) if spec.availability == "file" and spec.trace_file else {}
    out: dict[str, DeviceTrace] = {}
    for device in devices:
        train_s = train_seconds(spec, seed, device)
        if spec.availability == "always":
            out[device] = DeviceTrace(ALWAYS, train_s)
        elif spec.availability == "diurnal":
            if spec.share_online >= 1.0:
                out[device] = DeviceTrace(ALWAYS, train_s)
            else:
                out[device] = DeviceTrace(diurnal_windows(spec, seed, device), train_s, period_s=spec.day_s)
        else:
            entry = from_file.get(device)
            if entry is None:
                raise ConfigError(f"trace file {spec.trace_file} has no entry for device {device!r}",
                                  key="fleet.trace_file")
            windows, speed, period = entry
            out[device] = DeviceTrace(windows, spec.compute_s / speed if speed is not None else train_s, period)
    return out


FileEntry = tuple[tuple[tuple[float, float], ...], float | None, float | None]


def load_trace_file(path: Path | None) -> dict[str, FileEntry]:
    """Read ``{"period_s": 86400 (optional), "devices": {id: {"windows": [[start, end], ...], "speed": 1.0}}}``.

    ``speed`` (optional) divides ``compute_s``; without it the device's lognormal draw applies. Windows are
    in seconds, sorted and disjoint; with ``period_s`` they repeat every period and must fit in one.

    Raises:
        ConfigError: naming ``fleet.trace_file`` and what is wrong.
    """
    key = "fleet.trace_file"
    if path is None:
        raise ConfigError("no trace file", key=key)
    try:
        data: Any = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read trace file {path}: {exc}", key=key) from None
    if not isinstance(data, Mapping) or not isinstance(data.get("devices"), Mapping):
        raise ConfigError(f"trace file {path} must be an object with a 'devices' object", key=key)
    period = data.get("period_s")
    if period is not None and not (isinstance(period, (int, float)) and period > 0):
        raise ConfigError(f"trace file {path}: period_s must be a positive number, got {period!r}", key=key)
    out: dict[str, FileEntry] = {}
    for device, entry in data["devices"].items():
        try:
            windows = tuple((float(s), float(e)) for s, e in entry["windows"])
            speed = entry.get("speed")
            if speed is not None and not (isinstance(speed, (int, float)) and speed > 0):
                raise ValueError(f"speed must be a positive number, got {speed!r}")
            DeviceTrace(windows, 1.0, float(period) if period is not None else None)  # validates the windows
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"trace file {path}, device {device!r}: {exc}", key=key) from None
        out[str(device)] = (windows, float(speed) if speed is not None else None,
                            float(period) if period is not None else None)
    return out


def share_online(traces: Mapping[str, DeviceTrace], t: float) -> float:
    """The share of devices online at ``t`` (for reports and tests)."""
    if not traces:
        return 0.0
    return sum(tr.online_at(t) for tr in traces.values()) / len(traces)


def speed_quantiles(traces: Mapping[str, DeviceTrace], qs: Sequence[float] = (0.5, 0.9, 0.99)) -> list[float]:
    """Quantiles of the devices' training seconds."""
    return [float(x) for x in np.quantile([tr.train_s for tr in traces.values()], qs)]

"""A hierarchy of sans-I/O roles on a virtual clock, under device availability and speed traces.

``fedtier simulate`` runs here when the rollout has a ``[fleet]`` section or its algorithm is
asynchronous (FedBuff); ``experiments/async.py`` runs here too, with a numpy trainer. The roles are
the algorithm's own (``fedtier.algorithms.load``), unchanged; only the world around them is modelled:

* **Time** is virtual: an event queue ordered by (time, sequence). A device that is asked for
  ``LocalTrain`` answers ``train_s`` seconds later (its trace, ``fedtier.rollout.availability``);
  messages arrive at once (no network delay is modelled); edges and the cloud are ticked every
  ``tick_s`` so deadlines fire.
* **Availability**: a message to an offline device is lost (it holds no session); when the device
  comes online again its edge is told (``edge.resend``) and gives it work if it owes any (a
  synchronous round it has not reported in; for FedBuff, the newest model). A device that goes
  offline while it trains finishes, and its upload waits in its outbox for its next window.
* **Bytes**: every message goes through the real codec (``encode`` then ``decode``), counted per
  link: device->edge, edge->device (a broadcast counts once per device that receives it),
  edge->cloud, cloud->edge. A row's ``bytes`` are the round's, ``bytes_total`` the run's so far.

A synchronous algorithm therefore sees an offline device as one that does not report: its edge's
quorum and deadline decide, as in deployment. Ordering is deterministic: same traces, seed and
trainer, same model.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping

import numpy as np

from fedtier.algorithms.base import (
    Broadcast,
    Dropped,
    Evaluate,
    Finished,
    LocalResult,
    LocalTrain,
    Note,
    RoundClosed,
    SendToChild,
    SendToParent,
)
from fedtier.errors import RemoteProtocolError
from fedtier.privacy.mechanism import NoiseSource
from fedtier.rollout.availability import DeviceTrace
from fedtier.wire import messages

Compute = Callable[[str, LocalTrain], LocalResult]
"""(device, request) -> the result of the local training the request asks for."""
Evaluator = Callable[[Mapping[str, np.ndarray]], Mapping[str, Any]]
"""global params -> metrics of the model (``accuracy``, ``loss``)."""

LINKS = ("device_up", "device_down", "edge_up", "cloud_down")
"""The links bytes are counted on (the names of ``cloud_coordinator.report``'s tiers)."""


@dataclass
class TraceRun:
    """What a run produced: one row per new global model, and the totals."""

    rows: list[dict[str, Any]]
    params: dict[str, np.ndarray]
    bytes: dict[str, int]
    now: float
    finished: bool
    trainings: int
    dropped: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    releases: list[dict[str, Any]] = field(default_factory=list)
    """Every differential-privacy release that reached the cloud (device records under untrusted edges, the
    edges' own under trusted ones), in the order the cloud received them: what the ledger charges."""


class TraceSimulation:
    """One rollout's roles, driven by availability traces on a virtual clock (see the module docstring)."""

    def __init__(self, *, module: ModuleType, cells: Mapping[str, tuple[str, ...]],
                 initial_params: Mapping[str, np.ndarray], config: Any, rounds: int,
                 traces: Mapping[str, DeviceTrace], compute: Compute, evaluate: Evaluator | None = None,
                 rollout: str = "r", cloud_id: str = "cloud", tick_s: float | None = None,
                 noise_seed: int | None = None, cloud_kwargs: Mapping[str, Any] | None = None,
                 on_round: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.cells = {c: tuple(m) for c, m in cells.items()}
        self.cell_of = {d: c for c, m in self.cells.items() for d in m}
        missing = [d for d in self.cell_of if d not in traces]
        if missing:
            raise ValueError(f"no trace for {len(missing)} device(s), e.g. {missing[0]}")
        self.traces = traces
        self.compute = compute
        self.evaluate = evaluate
        self.on_round = on_round
        self.cloud = module.Cloud(rollout=rollout, cells=self.cells, initial_params=initial_params, config=config,
                                  rounds=rounds, cloud_id=cloud_id, **dict(cloud_kwargs or {}))
        self.edges = {c: module.Edge(cell=c, rollout=rollout, parent=cloud_id, noise=self._noise(noise_seed, c))
                      for c in self.cells}
        self.devices = {d: module.Device(device_id=d, cell=c, rollout=rollout, noise=self._noise(noise_seed, d))
                        for c, m in self.cells.items() for d in m}
        self.tick_s = tick_s if tick_s is not None else default_tick(config)
        self.now = 0.0
        self._events: list[tuple[float, int, str, str, Any]] = []
        self._seq = 0
        self._mail: deque[tuple[str, str, messages.Message]] = deque()
        self.online: set[str] = set()
        self._outbox: dict[str, list[messages.Message]] = defaultdict(list)
        self.bytes = dict.fromkeys(LINKS, 0)
        self.rows: list[dict[str, Any]] = []
        self.finished = False
        self.trainings = 0
        self.dropped: dict[str, int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.releases: list[dict[str, Any]] = []

    @staticmethod
    def _noise(seed: int | None, node: str) -> NoiseSource:
        if seed is None:
            return NoiseSource()
        return NoiseSource(seed * 1_000_003 + sum(ord(ch) * 31 ** i for i, ch in enumerate(node)) % 2**61)

    # --- the event loop ---------------------------------------------------------------------------

    def _at(self, t: float, kind: str, node: str = "", payload: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, node, payload))

    def run(self, *, horizon_s: float = math.inf, stop: Callable[[dict[str, Any]], bool] | None = None) -> TraceRun:
        """Run until the cloud finishes, ``stop(row)`` says so, or virtual time passes ``horizon_s``."""
        for device, trace in self.traces.items():
            if device not in self.cell_of:
                continue
            if trace.online_at(0.0):
                self.online.add(device)
                self._at(trace.next_change(0.0), "offline", device)
            else:
                self._at(trace.next_online(0.0), "online", device)
        self._cloud(self.cloud.start(self.now))
        self._drain()
        for device in sorted(self.online):  # the first tasks went out above; a device the broadcast missed asks
            self._came_online(device)
        self._drain()
        self._at(self.tick_s, "tick")
        self._stop = stop
        self._stopped = False
        while self._events and not self.finished and not self._stopped:
            t, _, kind, node, payload = heapq.heappop(self._events)
            if t > horizon_s:
                break
            self.now = t
            self._event(kind, node, payload)
            self._drain()
        return TraceRun(rows=self.rows, params={k: np.array(v) for k, v in self.cloud.params.items()},
                        bytes=dict(self.bytes), now=self.now, finished=self.finished, trainings=self.trainings,
                        dropped=dict(self.dropped), errors=dict(self.errors), releases=self.releases)

    def _event(self, kind: str, node: str, payload: Any) -> None:
        if kind == "tick":
            for cell, edge in self.edges.items():
                self._edge(cell, edge.tick(self.now))
            self._drain()  # what the edges' deadlines closed reaches the cloud before the cloud's own deadline
            self._cloud(self.cloud.tick(self.now))
            self._at(self.now + self.tick_s, "tick")
        elif kind == "online":
            self.online.add(node)
            self._at(self.traces[node].next_change(self.now), "offline", node)
            self._came_online(node)
        elif kind == "offline":
            self.online.discard(node)
            nxt = self.traces[node].next_online(self.now)
            if math.isfinite(nxt):
                self._at(nxt, "online", node)
        elif kind == "done":
            self._trained(node, payload)

    def _came_online(self, device: str) -> None:
        """Its outbox goes first; then, if it holds no work, its edge may give it some."""
        for msg in self._outbox.pop(device, []):
            self._post("edge", self.cell_of[device], msg, "device_up")
        self._drain()
        if self.devices[device].state.value == "idle":
            cell = self.cell_of[device]
            self._edge(cell, self.edges[cell].resend(device, self.now))

    def _trained(self, device: str, request: LocalTrain) -> None:
        self.trainings += 1
        result = self.compute(device, request)
        self._device(device, self.devices[device].trained(request.round, result))

    # --- delivery ---------------------------------------------------------------------------------

    def _wire(self, msg: messages.Message, encodings: Mapping[str, Any] | None) -> tuple[messages.Message, int]:
        data = msg.encode(encodings)
        return messages.decode_message(data), len(data)

    def _post(self, kind: str, target: str, msg: messages.Message, link: str, size: int | None = None,
              encodings: Mapping[str, Any] | None = None) -> None:
        if size is None:
            msg, size = self._wire(msg, encodings)
        self.bytes[link] += size
        self._mail.append((kind, target, msg))

    def _drain(self) -> None:
        while self._mail:
            kind, target, msg = self._mail.popleft()
            try:
                if kind == "edge":
                    self._edge(target, self.edges[target].receive(msg, self.now))
                elif kind == "cloud":
                    self._cloud(self.cloud.receive(msg, self.now))
                else:
                    self._device(target, self.devices[target].receive(msg, self.now))
            except RemoteProtocolError as exc:  # the shell drops a bad peer's message, counts it
                self.errors[type(exc).__name__] += 1

    def _to_device(self, device: str, msg: messages.Message, size: int) -> None:
        if device in self.online:
            self._post("device", device, msg, "device_down", size)
        else:
            self.dropped["offline"] += 1

    def _edge(self, cell: str, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Broadcast):
                msg, size = self._wire(a.message, a.encodings)
                for d in self.cells[cell]:
                    self._to_device(d, msg, size)
            elif isinstance(a, SendToChild):
                msg, size = self._wire(a.message, a.encodings)
                self._to_device(a.child, msg, size)
            elif isinstance(a, SendToParent):
                privacy = getattr(a.message, "privacy", None)
                if privacy:
                    self.releases.extend(privacy.get("releases", []))
                self._post("cloud", "", a.message, "edge_up", encodings=a.encodings)
            elif isinstance(a, Dropped):
                self.dropped[a.reason] += 1

    def _cloud(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, SendToChild):
                self._post("edge", a.child, a.message, "cloud_down", encodings=a.encodings)
            elif isinstance(a, RoundClosed):
                self._closed(a)
            elif isinstance(a, Finished):
                self.finished = True
            elif isinstance(a, Dropped):
                self.dropped[a.reason] += 1

    def _device(self, device: str, actions: list[Any]) -> None:
        queue = deque(actions)
        while queue:
            a = queue.popleft()
            if isinstance(a, LocalTrain):
                self._at(self.now + self.traces[device].train_s, "done", device, a)
            elif isinstance(a, Evaluate):  # devices are built without held-out rows: never asked
                queue.extendleft(reversed(self.devices[device].evaluated(a.round, None)))
            elif isinstance(a, SendToParent):
                if device in self.online:
                    self._post("edge", self.cell_of[device], a.message, "device_up", encodings=a.encodings)
                else:
                    self._outbox[device].append(self._wire(a.message, a.encodings)[0])
            elif isinstance(a, Dropped):
                self.dropped[a.reason] += 1
            elif isinstance(a, Note):
                pass

    def _closed(self, closed: RoundClosed) -> None:
        row: dict[str, Any] = {"round": closed.round, "time_s": self.now, "round_s": self.now - self._last_close,
                               "model_version": closed.metrics.get("model_version"),
                               "devices_reported": sum(len(r) for r in closed.reported.values()),
                               "bytes": {k: v - self._bytes_at_close.get(k, 0) for k, v in self.bytes.items()},
                               "bytes_total": sum(self.bytes.values()), "trainings": self.trainings}
        self._last_close, self._bytes_at_close = self.now, dict(self.bytes)
        for key in ("mean_staleness", "rejected_stale", "deltas"):
            if key in closed.metrics:
                row[key] = closed.metrics[key]
        if self.evaluate is not None:
            row.update(self.evaluate(closed.params))
        self.rows.append(row)
        if self.on_round is not None:
            self.on_round(row)
        if self._stop is not None and self._stop(row):
            self._stopped = True

    _stop: Callable[[dict[str, Any]], bool] | None = None
    _stopped = False
    _last_close = 0.0
    _bytes_at_close: dict[str, int] = {}


def default_tick(config: Any) -> float:
    """Tick often enough for the deadlines the roles keep: a tenth of the shortest (at least 1 s)."""
    limits = [float(v) for v in (getattr(config, "deadline_s", 0.0), getattr(config, "edge_timeout_s", 0.0)) if v]
    return max(1.0, min(limits) / 10.0) if limits else 60.0

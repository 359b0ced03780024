"""An in-memory hierarchy of sans-I/O roles for tests (h11's ConnectionPair, one tier up).

Wires one cloud role, its edge roles and their device roles together; messages go
through real ``encode``/``decode`` so the wire format is exercised too; local training is
replaced by a deterministic function of (params, device, round) that tests can check by
hand. Every message each role receives is recorded.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping

import numpy as np

from fedtier.algorithms.base import (
    Broadcast,
    ComputeGradient,
    Dropped,
    Evaluate,
    Finished,
    GradientResult,
    LocalResult,
    LocalTrain,
    Note,
    RoundClosed,
    ScoreGradient,
    ScoreRows,
    SendToChild,
    SendToParent,
)
from fedtier.algorithms.common import digest
from fedtier.privacy.mechanism import NoiseSource
from fedtier.wire import messages

FakeTrain = Callable[[Mapping[str, np.ndarray], str, int], dict[str, np.ndarray]]
"""(params, device, round) -> delta, for algorithms that ask for ``LocalTrain`` only."""


def default_train(params: Mapping[str, np.ndarray], device: str, round: int) -> dict[str, np.ndarray]:
    """Device ``dev-i`` moves every parameter by ``(i + 1) * 0.01`` (a known, distinct delta)."""
    k = int(device.split("-")[-1]) + 1
    return {n: np.full_like(p, 0.01 * k) for n, p in params.items()}


@dataclass
class Hierarchy:
    algo: ModuleType
    cells: dict[str, tuple[str, ...]]
    params: dict[str, np.ndarray]
    config: Any
    rounds: int = 3
    train: FakeTrain = default_train
    samples: Mapping[str, int] = field(default_factory=dict)
    now: float = 0.0
    compute: Any = None
    """A ``NumpyCompute``: when set, local work uses it (real gradients, the roles' streams)."""
    replan: Any = None
    cloud_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra arguments of the algorithm's cloud role (HIST needs ``arch``)."""
    noise_seed: int | None = None
    """Seed every node's differential-privacy noise (reproducible tests); None: OS-seeded."""
    evaluations: Mapping[str, Any] = field(default_factory=dict)
    """Devices with held-out rows -> the ``EvalStats`` their shell answers every ``Evaluate`` with."""

    def _noise(self, node: str) -> dict[str, Any]:
        if self.noise_seed is None:
            return {}
        return {"noise": NoiseSource(self.noise_seed * 1_000_003 + sum(map(ord, node)) * 7919 + len(node))}

    def __post_init__(self) -> None:
        self.cloud = self.algo.Cloud(rollout="r", cells=self.cells, initial_params=self.params, config=self.config,
                                     rounds=self.rounds, replan=self.replan, **self.cloud_kwargs)
        self.edges = {c: self.algo.Edge(cell=c, rollout="r", **self._noise(c)) for c in self.cells}
        self.devices = {d: self.algo.Device(device_id=d, cell=c, rollout="r", evaluate=d in self.evaluations,
                                            **self._noise(d))
                        for c, ds in self.cells.items() for d in ds}
        self.evaluated: list[tuple[str, int, dict[str, np.ndarray]]] = []
        """(device, round, params) of every ``Evaluate`` a device asked for."""
        self.received: dict[str, list[messages.Message]] = defaultdict(list)
        self.closed: list[RoundClosed] = []
        self.finished = False
        self.dropped: list[Dropped] = []
        self.notes: list[Note] = []  # edges' notes
        self.cloud_notes: list[Note] = []
        self.offline: set[str] = set()
        self.wire_bytes: dict[str, int] = defaultdict(int)
        self.on_step: Callable[[str, messages.CellStep], None] | None = None
        self.device_digests: dict[tuple[str, int, int], str] = {}

    def _wire(self, msg: messages.Message, encodings: Mapping[str, Any] | None = None) -> messages.Message:
        """Through the real codec, with the role's encodings (QSGD included)."""
        data = msg.encode(encodings)
        self.wire_bytes[msg.KIND] += len(data)
        return messages.decode_message(data)

    def start(self) -> None:
        self._run_cloud(self.cloud.start(self.now))

    def _run_cloud(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, SendToChild):
                self.deliver_to_edge(a.child, self._wire(a.message, a.encodings))
            elif isinstance(a, RoundClosed):
                self.closed.append(a)
            elif isinstance(a, Finished):
                self.finished = True
            elif isinstance(a, Dropped):
                self.dropped.append(a)
            elif isinstance(a, Note):
                self.cloud_notes.append(a)

    def deliver_to_edge(self, cell: str, msg: messages.Message) -> None:
        self.received[cell].append(msg)
        self._run_edge(cell, self.edges[cell].receive(msg, self.now))

    def _run_edge(self, cell: str, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Broadcast):
                msg = self._wire(a.message, a.encodings)
                if isinstance(msg, messages.CellStep) and self.on_step is not None:
                    self.on_step(cell, msg)  # before any device reacts: the edge is at this step
                for d in self.cells[cell]:
                    if d not in self.offline:
                        self.deliver_to_device(d, msg)
            elif isinstance(a, SendToChild):
                self.deliver_to_device(a.child, self._wire(a.message, a.encodings))
            elif isinstance(a, SendToParent):
                self.deliver_to_cloud(self._wire(a.message, a.encodings))
            elif isinstance(a, Dropped):
                self.dropped.append(a)
            elif isinstance(a, Note):
                self.notes.append(a)

    def deliver_to_cloud(self, msg: messages.Message) -> None:
        self.received["cloud"].append(msg)
        self._run_cloud(self.cloud.receive(msg, self.now))

    def deliver_to_device(self, device: str, msg: messages.Message) -> None:
        self.received[device].append(msg)
        actions = self.devices[device].receive(msg, self.now)
        if isinstance(msg, messages.CellStep):
            # The set model this device holds right after applying the step (before it trains on).
            self.device_digests[(device, msg.round, msg.step)] = digest(self.devices[device]._params)
        self._run_device(device, actions)

    def _run_device(self, device: str, actions: list[Any]) -> None:
        """Execute a device's actions depth first (what local work answers with runs before the rest), from a
        queue: X-risk rounds answer every step with the next one, which nested calls would stack up."""
        cell = next(c for c, ds in self.cells.items() if device in ds)
        queue = deque(actions)
        while queue:
            a = queue.popleft()
            follow: list[Any] = []
            if isinstance(a, LocalTrain):
                if self.compute is not None:
                    delta, mean_loss = self.compute.local_sgd(a.params, device, a.steps, a.batch_size, a.lr, a.stream)
                else:
                    delta, mean_loss = self.train(a.params, device, a.round), 1.0
                result = LocalResult(delta=delta, num_samples=self.samples.get(device, 10), mean_loss=mean_loss,
                                     steps=a.steps)
                follow = self.devices[device].trained(a.round, result)
            elif isinstance(a, ComputeGradient):
                grad, loss = self.compute.grad(a.params, device, a.batch_size, a.stream)
                result_g = GradientResult(grad=grad, loss=loss, num_samples=self.samples.get(device, 10))
                follow = self.devices[device].gradient_done(a.round, a.step, result_g)
            elif isinstance(a, ScoreRows):
                follow = self.devices[device].scored(a.round, a.step, self.compute.score_rows(device, a))
            elif isinstance(a, ScoreGradient):
                follow = self.devices[device].gradient_done(a.round, a.step, self.compute.score_gradient(device, a))
            elif isinstance(a, Evaluate):
                self.evaluated.append((device, a.round, {k: np.array(v) for k, v in a.params.items()}))
                follow = self.devices[device].evaluated(a.round, self.evaluations[device])
            elif isinstance(a, SendToParent):
                self.deliver_to_edge(cell, self._wire(a.message, a.encodings))
            elif isinstance(a, Dropped):
                self.dropped.append(a)
            queue.extendleft(reversed(follow))

    def tick(self, now: float) -> None:
        self.now = now
        for cell, edge in self.edges.items():
            self._run_edge(cell, edge.tick(now))
        self._run_cloud(self.cloud.tick(now))

    def restart_device(self, device: str, last_sent: tuple[int, int] | None) -> None:
        """Replace ``device``'s role by a fresh one, as an agent restarted from its state would
        build it (``last_round`` and ``last_sent`` are what its outbox transaction recorded)."""
        old = self.devices[device]
        self.devices[device] = self.algo.Device(device_id=device, cell=old.cell, rollout="r",
                                                last_round=old.last_round, last_sent=last_sent,
                                                **self._noise(device))

    def reconnect(self, device: str) -> None:
        """``device`` comes online again: its edge resends the open task if it owes an update."""
        self.offline.discard(device)
        cell = next(c for c, ds in self.cells.items() if device in ds)
        self._run_edge(cell, self.edges[cell].resend(device, self.now))

    def run(self) -> None:
        self.start()

"""HSGD's roles run in one process: cloud, edges, hosts and devices wired by a message queue.

Why: HSGD's experiment and its acceptance checks (digest §8) run thousands of iterations with
hundreds of devices; this loop runs exactly the sans-I/O roles of ``fedtier.algorithms.hsgd`` with
the numpy split-model trainer (``fedtier.training.split.SplitTrainer``), and every message passes
through the wire codec (encoded, decoded), so the bytes it counts per tier are real message sizes.
Time is simulated: when nothing is left to deliver, the clock jumps past the deadlines and the
roles' ``tick`` runs (a silent device then cannot stall an interval).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, cast

import numpy as np

from fedtier.algorithms import hsgd
from fedtier.algorithms.base import Broadcast, Finished, Note, Role, RoundClosed, SendToChild, SendToParent
from fedtier.errors import LocalProtocolError, RemoteProtocolError
from fedtier.training.split import SplitTrainer
from fedtier.wire import peek_header
from fedtier.wire.messages import decode_message
from fleet_data.hybrid import HybridCell

VERTICAL = ("hsgd_embeddings", "hsgd_partner")


def make_cells(groups: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
               prefix: str = "cell") -> dict[str, HybridCell]:
    """Cells ``{prefix}{m}`` with host ``{prefix}{m}-host`` and devices ``{prefix}{m}-d{n:04d}``."""
    out = {}
    for m, (x1, x2, y) in enumerate(groups):
        cell = f"{prefix}{m}"
        out[cell] = HybridCell(host=f"{cell}-host", devices=tuple(f"{cell}-d{n:04d}" for n in range(len(y))),
                               x1=np.asarray(x1), x2=np.asarray(x2), y=np.asarray(y))
    return out


@dataclass
class LoopResult:
    params: dict[str, np.ndarray]
    rounds: list[dict[str, Any]] = field(default_factory=list)
    """Per closed round: round, train_loss, paper_values (sum over cells), wire bytes so far, eval."""
    bytes: Counter[str] = field(default_factory=Counter)
    """Wire bytes per tier and direction: device_up/down, host_up/down, edge_up/down, and vertical
    (the embedding messages among them)."""
    tensors: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    """Tensor body bytes (the envelopes' ``nb``) per (message kind, sender tier, receiver tier); a broadcast
    is counted once per device it reaches."""
    rejected: Counter[str] = field(default_factory=Counter)
    edges: dict[str, hsgd.Edge] = field(default_factory=dict)
    hosts: dict[str, hsgd.Host] = field(default_factory=dict)
    devices: dict[str, hsgd.Device] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    trace: list[tuple[str, str, str, int, int]] = field(default_factory=list)
    """(sender, receiver, kind, round, step) of every delivered message."""


def run(cells: Mapping[str, HybridCell], initial: Mapping[str, np.ndarray], config: hsgd.HsgdConfig, rounds: int, *,
        rollout: str = "hsgd", silent: Sequence[str] = (),
        evaluate: Callable[[Mapping[str, np.ndarray]], Any] | None = None,
        inject: Callable[[str, Any], Any] | None = None, keep_trace: bool = False,
        make_trainer: Callable[[str, Mapping[str, np.ndarray], Mapping[str, int]], Any] | None = None,
        bus: Any = None) -> LoopResult:
    """Run ``rounds`` cloud rounds of HSGD.

    Args:
        cells: the cells' data; ``config.hosts`` must name their hosts.
        initial: the global model at round 0 (all three blocks).
        silent: node ids that receive but never send (stragglers that never answer).
        evaluate: called with the global model after each round; its value is stored in ``rounds``.
        make_trainer: ``(side, rows, labels) -> trainer`` for each host (``"host"``) and device (``"device"``);
            default the numpy ``SplitTrainer`` (``device_agent.trainers.ort_split.OrtSplitTrainer`` runs ORT).
        bus: how messages travel: ``MemoryBus()`` (default; simulated time) or ``MqttBus`` (a real broker,
            wall-clock time).
        inject: test hook ``(sender, message) -> message or None`` applied to every upward message of a
            device or host before it is encoded (to corrupt or drop it).
    """
    edges = {c: hsgd.Edge(cell=c, rollout=rollout) for c in cells}
    hosts = {d.host: hsgd.Host(host_id=d.host, cell=c, rollout=rollout) for c, d in cells.items()}
    devices = {dev: hsgd.Device(device_id=dev, cell=c, rollout=rollout) for c, d in cells.items() for dev in d.devices}
    trainers: dict[str, Any] = {}

    def trainer(side: str, x: Mapping[str, np.ndarray], y: Mapping[str, int]) -> Any:
        return SplitTrainer(x, y) if make_trainer is None else make_trainer(side, x, y)

    cell_of: dict[str, str] = {}
    for c, d in cells.items():
        if config.hosts.get(c) != d.host:
            raise LocalProtocolError(f"config.hosts does not name {d.host!r} for cell {c!r}")
        trainers[d.host] = trainer("host", dict(zip(d.devices, d.x1, strict=True)),
                                   dict(zip(d.devices, d.y.tolist(), strict=True)))
        cell_of[d.host] = c
        for n, dev in enumerate(d.devices):
            trainers[dev] = trainer("device", {dev: d.x2[n]}, {dev: int(d.y[n])})
            cell_of[dev] = c
    cloud = hsgd.Cloud(rollout=rollout, cells={c: (*d.devices, d.host) for c, d in cells.items()},
                       initial_params=initial, config=cast(Any, config), rounds=rounds)
    result = LoopResult(params={k: np.asarray(v, np.float32) for k, v in initial.items()}, edges=edges, hosts=hosts,
                        devices=devices)
    bus = bus if bus is not None else MemoryBus()
    silent_set = set(silent)
    finished = False

    def tier(node: str) -> str:
        if node == "cloud":
            return "cloud"
        if node in edges:
            return "edge"
        return "host" if node in hosts else "device"

    def post(sender: str, receiver: str, message: Any, encodings: Mapping[str, Any] | None = None) -> None:
        data = message.encode(encodings or {})
        t_send, t_recv = tier(sender), tier(receiver)
        if t_send in ("device", "host"):
            result.bytes[f"{t_send}_up"] += len(data)
        elif t_send == "edge" and t_recv in ("device", "host"):
            result.bytes[f"{t_recv}_down"] += len(data)
        elif t_send == "edge":
            result.bytes["edge_up"] += len(data)
        else:
            result.bytes["edge_down"] += len(data)
        if message.KIND in VERTICAL:
            result.bytes["vertical"] += len(data)
        result.tensors[(message.KIND, t_send, t_recv)] += _body(data)
        bus.send(sender, receiver, message.KIND, data)

    def execute(node: str, actions: list[Any]) -> None:
        nonlocal finished
        work = deque(actions)
        while work:
            action = work.popleft()
            if isinstance(action, (SendToParent, SendToChild, Broadcast)):
                if node in silent_set:
                    continue
                message, enc = action.message, dict(action.encodings)
                if node in edges:
                    if isinstance(action, SendToParent):
                        post(node, "cloud", message, enc)
                    elif isinstance(action, SendToChild):
                        post(node, action.child, message, enc)
                    else:  # one publish; counted once per device it reaches
                        data = message.encode(enc)
                        result.bytes["device_down"] += len(data) * len(cells[node].devices)
                        result.tensors[(message.KIND, "edge", "device")] += _body(data) * len(cells[node].devices)
                        bus.broadcast(node, cells[node].devices, message.KIND, data)
                elif node == "cloud":
                    assert isinstance(action, SendToChild)
                    post(node, action.child, message, enc)
                else:
                    if inject is not None:
                        message = inject(node, message)
                        if message is None:
                            continue
                    post(node, cell_of[node], message, enc)
            elif isinstance(action, hsgd.Embed):
                role = hosts.get(node) or devices[node]
                zeta = trainers[node].embed(action.block, action.params, action.rows)
                work.extendleft(reversed(role.embedded(action.round, action.step, zeta)))
            elif isinstance(action, hsgd.SplitTrain):
                role = hosts.get(node) or devices[node]
                params, loss = trainers[node].train(action.side, action.params, action.frozen, action.partner,
                                                    action.rows, action.steps, action.lr)
                work.extendleft(reversed(role.split_trained(action.round, action.step, params, loss)))
            elif isinstance(action, RoundClosed):
                result.params = {k: np.asarray(v, np.float32) for k, v in action.params.items()}
                cells_stats = action.metrics.get("cells", {})
                result.rounds.append({"round": action.round, "train_loss": action.metrics.get("train_loss"),
                                      "paper_values": sum(int(s.get("paper_values", 0)) for s in cells_stats.values()),
                                      "paper_bytes": sum(int(s.get("paper_bytes", 0)) for s in cells_stats.values()),
                                      "vertical_bytes": sum(int(s.get("vertical_bytes", 0))
                                                            for s in cells_stats.values()),
                                      "bytes": sum(v for k, v in result.bytes.items() if k != "vertical"),
                                      "eval": evaluate(result.params) if evaluate else None})
            elif isinstance(action, Finished):
                finished = True
            elif isinstance(action, Note):
                result.notes.append(action)

    def role_of(node: str) -> Role:
        if node == "cloud":
            return cloud
        return edges.get(node) or hosts.get(node) or devices[node]

    bus.start()
    try:
        _drive(bus, cloud, edges, execute, role_of, result, config, keep_trace, lambda: finished)
    finally:
        bus.close()
    return result


def _body(data: bytes) -> int:
    return sum(int(spec["nb"]) for spec in peek_header(data)["ts"])


def _drive(bus: Any, cloud: Any, edges: Mapping[str, hsgd.Edge], execute: Callable[[str, list[Any]], None],
           role_of: Callable[[str], Role], result: LoopResult, config: hsgd.HsgdConfig, keep_trace: bool,
           finished: Callable[[], bool]) -> None:
    now = bus.now()
    execute("cloud", cloud.start(now))
    stalls = 0
    while not finished():
        while True:
            item = bus.get()
            if item is None:
                break
            sender, receiver, data = item
            now = bus.now()
            try:
                message = decode_message(data)
                if keep_trace:
                    result.trace.append((sender, receiver, message.KIND, message.round, message.step))
                actions = role_of(receiver).receive(message, now)
            except RemoteProtocolError as exc:
                result.rejected[exc.reason] += 1
                continue
            execute(receiver, actions)
            if finished():
                return
        if finished():
            return
        now = bus.idle(config.deadline_s)
        before = len(result.rounds)
        for c, edge in edges.items():
            execute(c, edge.tick(now))
        execute("cloud", cloud.tick(now))
        stalls = 0 if bus.pending() or len(result.rounds) > before else stalls + 1
        if stalls > bus.max_stalls:
            raise LocalProtocolError(f"hsgd loop stalled at round {cloud.round}")


class MemoryBus:
    """Messages in one FIFO queue; when it is empty the clock jumps past the deadline."""

    max_stalls = 3

    def __init__(self) -> None:
        self.queue: deque[tuple[str, str, bytes]] = deque()
        self.clock = 0.0

    def start(self) -> None:
        return None

    def close(self) -> None:
        return None

    def now(self) -> float:
        return self.clock

    def send(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        self.queue.append((sender, receiver, data))

    def broadcast(self, sender: str, receivers: Sequence[str], kind: str, data: bytes) -> None:
        self.queue.extend((sender, r, data) for r in receivers)

    def get(self) -> tuple[str, str, bytes] | None:
        return self.queue.popleft() if self.queue else None

    def pending(self) -> bool:
        return bool(self.queue)

    def idle(self, deadline_s: float) -> float:
        self.clock += deadline_s + 1.0
        return self.clock


class MqttBus:
    """Every node its own MQTT connection to one broker, on fedtier's topic tree.

    Cloud -> edge on ``cloud/down/{cell}/{kind}``, edge -> cloud on ``edge/{cell}/up/{kind}``, the edge's
    broadcast on ``cell/{cell}/down/{kind}``, edge -> one host or device on ``cell/{cell}/down/{kind}/{node}``,
    host or device -> edge on ``cell/{cell}/up/{node}/{kind}``. Time is the wall clock."""

    max_stalls = 1

    def __init__(self, host: str, port: int, rollout: str, cells: Mapping[str, HybridCell], *,
                 timeout_s: float = 30.0) -> None:
        import queue

        from fedtier.transport.mqtt import MqttTransport

        self.rollout, self.timeout_s = rollout, timeout_s
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.cell_of: dict[str, str] = {}
        self.clients: dict[str, Any] = {}
        self._t0 = 0.0
        subs: dict[str, list[str]] = {"cloud": [f"ft/v1/{rollout}/edge/+/up/#"]}
        for c, d in cells.items():
            subs[c] = [f"ft/v1/{rollout}/cloud/down/{c}/#", f"ft/v1/{rollout}/cell/{c}/up/+/#"]
            for node in (d.host, *d.devices):
                self.cell_of[node] = c
                subs[node] = [f"ft/v1/{rollout}/cell/{c}/down/+", f"ft/v1/{rollout}/cell/{c}/down/+/{node}"]
        for node, filters in subs.items():
            client = MqttTransport(name=node, client_id=f"{rollout}-{node}", host=host, port=port, inbox=self.inbox)
            for f in filters:
                client.subscribe(f)
            self.clients[node] = client

    def start(self) -> None:
        import time

        for client in self.clients.values():
            client.start()
        for node, client in self.clients.items():
            if not client.wait_connected(self.timeout_s):
                raise LocalProtocolError(f"{node} did not connect to the broker")
        waiting = set(self.clients)
        deadline = time.monotonic() + self.timeout_s
        while waiting and time.monotonic() < deadline:  # every subscription works: each node hears its probe
            for node in list(waiting):
                self.clients[node].publish(self._probe_topic(node), b"probe")
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                try:
                    inbound = self.inbox.get(timeout=0.05)
                except Exception:  # queue.Empty
                    continue
                inbound.confirm()
                if inbound.payload == b"probe":
                    waiting.discard(inbound.source)
        if waiting:
            raise LocalProtocolError(f"subscriptions of {sorted(waiting)[:5]} never took effect")
        while not self.inbox.empty():  # duplicate probes
            self.inbox.get().confirm()
        self._t0 = time.monotonic()

    def _probe_topic(self, node: str) -> str:
        if node == "cloud":
            return f"ft/v1/{self.rollout}/edge/probe/up/probe"
        if node in self.cell_of:
            return f"ft/v1/{self.rollout}/cell/{self.cell_of[node]}/down/probe/{node}"
        return f"ft/v1/{self.rollout}/cloud/down/{node}/probe"

    def close(self) -> None:
        for client in self.clients.values():
            client.stop()

    def now(self) -> float:
        import time

        return time.monotonic() - self._t0

    def send(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        from fedtier.transport import topics

        r = self.rollout
        if sender == "cloud":
            topic = topics.cloud_down(r, receiver, kind)
        elif receiver == "cloud":
            topic = topics.edge_up(r, sender, kind)
        elif sender in self.cell_of:
            topic = topics.cell_up(r, receiver, sender, kind)
        else:
            topic = topics.cell_down(r, sender, kind, receiver)
        self.clients[sender].publish(topic, data)

    def broadcast(self, sender: str, receivers: Sequence[str], kind: str, data: bytes) -> None:
        from fedtier.transport import topics

        self.clients[sender].publish(topics.cell_down(self.rollout, sender, kind), data)

    def get(self) -> tuple[str, str, bytes] | None:
        import queue

        try:
            inbound = self.inbox.get(timeout=self.timeout_s)
        except queue.Empty:
            return None
        inbound.confirm()
        if inbound.payload == b"probe":
            return self.get()
        parts = inbound.topic.split("/")  # ft/v1/{rollout}/{cloud|edge|cell}/...
        if parts[3] == "cloud":
            sender = "cloud"
        elif parts[3] == "cell" and parts[5] == "up":
            sender = parts[6]
        else:
            sender = parts[4]  # an edge: edge/{cell}/up/... or cell/{cell}/down/...
        return sender, inbound.source, inbound.payload

    def pending(self) -> bool:
        return not self.inbox.empty()

    def idle(self, deadline_s: float) -> float:
        return self.now()

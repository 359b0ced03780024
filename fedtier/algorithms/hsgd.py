"""HSGD: hybrid horizontal + vertical federated learning with a feature party (host) in every cell.

Yu, Shen, Wang, Zhang, Zhao, "Communication-Efficient Hybrid Federated Learning for E-health with
Horizontal and Vertical Data Partitioning", Algorithm 1, eqs. (1), (2), (5)-(7); digest
``papers/seed_000_hybrid_fl.md`` §2 and §7.

Theory of operation
-------------------
Every cell has one *host* (the hospital, a feature party) holding feature block ``X1`` of every
sample of the cell, and devices each holding block ``X2`` of one sample (its id is the device's).
The model is split (``fedtier.training.split``): the host trains its encoder ``theta1`` and the head
``theta0``; devices train the encoder ``theta2``. A cloud round is ``P`` iterations, made of
``Lambda = P / Q`` local intervals of ``Q`` iterations (``step`` = the interval's index).

Interval ``lambda`` of round ``r`` in cell ``m``:

1. edge: draw the selected set ``A`` (``round(alpha K_m)`` devices, at least one; stream
   ``(seed, "hsgd-select", rollout, cell, r, lambda)``) and broadcast ``DeviceTask(r, lambda,
   theta2_m, members=A)`` to all devices (line 18; at ``lambda = 0`` ``theta2_m`` is the global
   ``theta2``, and the host gets ``theta0, theta1`` in its own task);
2. selected device: ``zeta2 = h2(theta2_m; X2)`` (``Embed``) -> edge (``Embeddings``)      line 20
3. edge: once every selected device answered, or the deadline passed, the rows it has -> host
   (``PartnerEmbeddings``); embeddings of the wrong width, non-finite, from an unselected device or
   for another interval are refused with a typed reason and counted (``Edge.rejected``);
4. host: ``Z1 = h1(theta1; X1[rows])`` -> edge with ``theta0`` (both before training), then ``Q`` SGD
   steps on ``theta0, theta1`` over those rows with the stale ``Z2``                 eqs. (5)-(6)
5. edge -> each device of the rows: ``theta0`` and its own row of ``Z1``               lines 24-25
6. device: ``Q`` SGD steps on ``theta2`` with ``theta0`` frozen and ``zeta1`` stale -> edge its
   ``theta2`` change (``DeviceUpdate``)                                                     eq. (7)
7. edge: ``theta2_m`` = unweighted mean over the devices that reported (eq. (1)); next interval.

After the last interval the host uploads its change of ``theta0, theta1`` and the edge sends the
cloud one ``CellUpdate`` with all three blocks' changes and weight ``K_m`` (its device count); the
shared cloud role (``fedtier.algorithms.cloud``) then forms ``sum_m K_m theta_m / K`` — eq. (2).

Only embeddings and ``theta0`` cross between the sides, never a gradient w.r.t. an embedding.
``bits_embedding < 32`` compresses that vertical path (``zeta2``, ``Z1``, ``theta0``) on every hop, the
edge's relays included: ``compressor = "qsgd"`` quantizes each row with ``bits_embedding``-bit QSGD
scaled by the row's largest magnitude (``quant.qrows``; this project's substitute, unbiased);
``"topk"`` keeps each row's largest ``bits_embedding / 32`` of its entries (``quant.topk_rows``: the
paper's C-HSGD is top-k sparsification with compression ratio ``log2(b) / 32``, b = 128: 7). Both codecs
encode a row as a pure function of its values, so the edge re-encodes what it relays (``Z2`` stacked
from the devices' rows, each device's row of ``Z1`` and ``theta0``) into the same compressed form without
a second loss, and refuses an embedding or head that is not in that form (``embedding_encoding``).

Learning rate: ``lr_schedule = "step"`` multiplies ``lr`` by ``lr_decay_factor`` every ``lr_decay_every``
iterations (the paper halves it every ``T0``; ``lr_decay_every`` must be a multiple of ``Q``, so the rate is
constant within an interval); the rate of interval ``lambda`` of round ``r`` is the schedule's at iteration
``r P + lambda Q`` (``HsgdConfig.lr_at``), computed by host and devices from the counters alone.

A selected device that never answers does not stall the interval: at the edge's deadline the host
gets the rows that arrived; a device that got its partner row but does not report its ``theta2`` is
left out of eq. (1). The host itself is required (no rows can be trained without it).

Differential privacy: ``zeta2``, ``Z1`` and ``theta0`` are data-dependent releases the noise plan
does not cover, so these roles refuse a task with a noise plan (docs/privacy.md).

Transitions: ``DEVICE_TRANSITIONS``, ``HOST_TRANSITIONS`` and ``EDGE_TRANSITIONS`` below, data that
``StateGuard._transition`` checks (anything else raises ``LocalProtocolError``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import numpy as np

from fedtier.algorithms import aggregate
from fedtier.algorithms.base import (
    Action,
    Broadcast,
    DeviceRoleBase,
    Dropped,
    EdgeRoleBase,
    Embed,
    Note,
    RoleState,
    SendToChild,
    SendToParent,
    SplitTrain,
    Transitions,
)
from fedtier.algorithms.cloud import Cloud
from fedtier.algorithms.common import RoundSettings, check_int, check_lr_schedule, scheduled_lr
from fedtier.errors import (
    EmbeddingEncodingError,
    EmbeddingNonFiniteError,
    EmbeddingWidthError,
    LateMessageError,
    LayoutMismatchError,
    LocalProtocolError,
    RemoteProtocolError,
    StaleIntervalError,
    UnexpectedMessageError,
    UnknownSenderError,
    UnselectedDeviceError,
    WrongRoundError,
)
from fedtier.rng import stream
from fedtier.wire import TensorEncoding, quant
from fedtier.wire.messages import (
    HSGD_ZETA,
    CellTask,
    CellUpdate,
    DeviceTask,
    DeviceUpdate,
    Embeddings,
    Message,
    PartnerEmbeddings,
    TrainingFailed,
)

NAME = "hsgd"
Tensors = Mapping[str, np.ndarray]
OFF = 32
"""``bits_embedding = 32``: float32 on the vertical path (the paper's HSGD)."""
COMPRESSORS = ("qsgd", "topk")
"""How ``bits_embedding < 32`` compresses the vertical path: row-wise QSGD, or row-wise top-k sparsification."""

__all__ = ["HsgdConfig", "Device", "Host", "Edge", "Cloud", "Embed", "SplitTrain", "select", "NAME"]

DEVICE_TRANSITIONS: Transitions = {
    RoleState.IDLE: {
        "task": RoleState.TRAINING,  # selected for the interval: embed zeta2
        "not_selected": RoleState.IDLE,  # the cell's theta2 only; nothing to do this interval
    },
    RoleState.TRAINING: {
        "task": RoleState.TRAINING,  # a newer interval's task supersedes the work
        "not_selected": RoleState.IDLE,
        "embedded": RoleState.WAITING,  # zeta2 sent: wait for the partner row
        "split_trained": RoleState.WAITING,  # theta2's change sent: wait for the next task
        "failed": RoleState.IDLE,  # the shell could not compute the work: training_failed, the interval given up
    },
    RoleState.WAITING: {
        "task": RoleState.TRAINING,
        "not_selected": RoleState.IDLE,
        "partner": RoleState.TRAINING,  # theta0 and the partner row came: train theta2
    },
}
"""A device's transitions (``Device``)."""

HOST_TRANSITIONS: Transitions = {
    RoleState.IDLE: {"task": RoleState.WAITING},  # the round's theta0, theta1: wait for the first interval's Z2
    RoleState.WAITING: {
        "task": RoleState.WAITING,  # a newer round's task
        "partner": RoleState.TRAINING,  # the interval's Z2: embed Z1, then train
        "round_done": RoleState.IDLE,  # the last interval trained: the change of theta0, theta1 went up
    },
    RoleState.TRAINING: {
        "task": RoleState.WAITING,
        "embedded": RoleState.TRAINING,  # Z1 and theta0 sent; training follows
        "split_trained": RoleState.WAITING,  # the interval trained: wait for the next Z2
        "failed": RoleState.IDLE,  # the shell could not compute the work: training_failed, the round given up
    },
}
"""The host's transitions (``Host``)."""

EDGE_TRANSITIONS: Transitions = {
    RoleState.IDLE: {"task": RoleState.COLLECTING},  # the cell task: its intervals run in COLLECTING
    RoleState.COLLECTING: {
        "task": RoleState.COLLECTING,  # a newer round's task abandons the open one
        "forward": RoleState.FORWARDED,  # the last interval closed: the cell update went up
    },
    RoleState.FORWARDED: {"task": RoleState.COLLECTING},
}
"""The edge's transitions (``Edge``)."""


@dataclass(frozen=True, slots=True)
class HsgdConfig(RoundSettings):
    """HSGD's settings (they travel in every task).

    Attributes:
        global_interval: P, iterations per cloud round.
        local_interval: Q, iterations per local interval (P must be a multiple of Q).
        alpha: share of a cell's devices selected each interval, in (0, 1].
        hosts: cell id -> its host's node id.
        bits_embedding: compression level of the vertical path (zeta2, Z1, theta0) on every hop: 2..8, or
            32 = float32. With ``compressor = "qsgd"`` the QSGD width; with ``"topk"`` each row keeps
            ``bits_embedding / 32`` of its entries (the paper's ratio ``log2(b) / 32``).
        compressor: ``qsgd`` (row-wise QSGD, this project's substitute) or ``topk`` (the paper's top-k).
        lr_schedule: ``constant`` or ``step`` (``lr * lr_decay_factor ** (t // lr_decay_every)`` at iteration t;
            the paper halves ``lr`` every ``T0`` iterations: factor 0.5, ``lr_decay_every = T0``).
        lr_decay_every: iterations between two decays (a multiple of Q; needed with ``step``).
        lr_decay_factor: the decay's factor, in (0, 1] (0.5: the paper's halving).
    """

    ALGORITHM: ClassVar[str] = NAME

    global_interval: int = 1
    local_interval: int = 1
    alpha: float = 0.1
    hosts: Mapping[str, str] = field(default_factory=dict)
    bits_embedding: int = OFF
    compressor: str = "qsgd"
    lr_schedule: str = "constant"
    lr_decay_every: int = 0
    lr_decay_factor: float = 0.5

    def __post_init__(self) -> None:
        RoundSettings.__post_init__(self)
        check_int(self.global_interval, "global_interval", 1)
        check_int(self.local_interval, "local_interval", 1)
        if self.global_interval % self.local_interval:
            raise LocalProtocolError(f"global_interval P={self.global_interval} must be a multiple of "
                                     f"local_interval Q={self.local_interval} (P mod Q == 0)")
        if not (isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and 0 < self.alpha <= 1):
            raise LocalProtocolError(f"alpha must be in (0, 1], got {self.alpha!r}")
        if not (isinstance(self.hosts, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in self.hosts.items())):
            raise LocalProtocolError(f"hosts must map cell ids to host ids, got {self.hosts!r}")
        if not (self.bits_embedding == OFF or (isinstance(self.bits_embedding, int) and 2 <= self.bits_embedding <= 8)):
            raise LocalProtocolError(f"bits_embedding must be 32 (float32) or 2..8, got {self.bits_embedding!r}")
        if self.compressor not in COMPRESSORS:
            raise LocalProtocolError(f"compressor must be one of {COMPRESSORS}, got {self.compressor!r}")
        check_lr_schedule(self.lr_schedule, self.lr_decay_every, self.lr_decay_factor)
        if self.lr_schedule == "step" and self.lr_decay_every % self.local_interval:
            raise LocalProtocolError(f"lr_decay_every = {self.lr_decay_every} must be a multiple of local_interval "
                                     f"Q = {self.local_interval} (the rate is constant within an interval)")
        if self.bits_device or self.bits_edge:
            raise LocalProtocolError("hsgd sends models in float32; bits_embedding compresses the vertical path")
        if self.privacy is not None:
            raise LocalProtocolError("hsgd's embeddings (zeta2, Z1) and head theta0 are data-dependent releases "
                                     "the noise plan does not cover: hsgd does not run under [privacy]")

    @property
    def intervals(self) -> int:
        """Lambda = P / Q, local intervals per cloud round."""
        return self.global_interval // self.local_interval

    def lr_at(self, round: int, step: int) -> float:
        """The learning rate of interval ``step`` of round ``round``: the schedule's at iteration
        ``round P + step Q``."""
        return scheduled_lr(self.lr, self.lr_schedule, self.lr_decay_every, self.lr_decay_factor,
                            round * self.global_interval + step * self.local_interval)

    def encoding(self, shape: tuple[int, ...]) -> TensorEncoding | None:
        """The wire encoding of a vertical-path tensor of ``shape`` (``None``: float32)."""
        if self.bits_embedding == OFF:
            return None
        if self.compressor == "qsgd":
            return TensorEncoding("qrows", {"bits": self.bits_embedding})
        return TensorEncoding("topk", {"k": quant.topk_count(quant.rows_of(shape)[1], self.bits_embedding)})

    def compressed(self, values: np.ndarray) -> bool:
        """Whether ``values`` are in the vertical path's compressed form (always, in float32)."""
        enc = self.encoding(np.shape(values))
        if enc is None:
            return True
        if enc.name == "qrows":
            return quant.on_qrows_grid(values, self.bits_embedding)
        return quant.is_topk(values, enc.params["k"])

    def tensor_bytes(self, shape: tuple[int, ...]) -> int:
        """Body bytes of a vertical-path tensor of ``shape`` on the wire (its envelope's ``nb``)."""
        rows, width = quant.rows_of(shape)
        if self.bits_embedding == OFF:
            return 4 * rows * width
        if self.compressor == "qsgd":
            return quant.qrows_size(shape, self.bits_embedding)
        return quant.topk_size(shape, quant.topk_count(width, self.bits_embedding))

    def encodings(self, tensors: Tensors) -> dict[str, TensorEncoding]:
        """Wire encodings of vertical-path tensors already in compressed form (empty in float32)."""
        out = {n: self.encoding(np.shape(t)) for n, t in tensors.items()}
        return {n: e for n, e in out.items() if e is not None}

    def to_dict(self) -> dict[str, Any]:
        out = RoundSettings.to_dict(self)
        out["hosts"] = dict(self.hosts)
        if self.compressor == "qsgd":  # settings added later: left out at their default, tasks stay byte for byte
            del out["compressor"]
        if self.lr_schedule == "constant":
            for key in ("lr_schedule", "lr_decay_every", "lr_decay_factor"):
                del out[key]
        return out


def select(devices: tuple[str, ...], alpha: float, seed: int, rollout: str, cell: str, round: int,
           step: int) -> tuple[str, ...]:
    """The interval's selected devices: ``round(alpha K)`` (at least 1) drawn uniformly without
    replacement from stream ``(seed, "hsgd-select", rollout, cell, round, step)``, sorted."""
    ordered = sorted(devices)
    k = min(len(ordered), max(1, int(math.floor(alpha * len(ordered) + 0.5))))
    picked = stream(seed, "hsgd-select", rollout, cell, round, step).choice(len(ordered), size=k, replace=False)
    return tuple(sorted(ordered[i] for i in picked))


def _block(params: Tensors, name: str) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float32) for k, v in params.items() if k.startswith(f"{name}/")}


def _parse(config: Mapping[str, Any]) -> HsgdConfig:
    if config.get("privacy") is not None:
        raise UnexpectedMessageError("hsgd refuses a task with a noise plan: embeddings would be released in clear")
    return HsgdConfig.from_dict(config)


def _vertical(tensors: Tensors, config: HsgdConfig, *labels: Any) -> tuple[dict[str, np.ndarray],
                                                                             dict[str, TensorEncoding]]:
    """The vertical path's tensors as sent: float32, or compressed row by row with ``bits_embedding``
    (``qsgd``: ``quant.qrows`` with the sender's stream ``(seed, "hsgd-q", *labels, name)``; ``topk``:
    ``quant.topk_rows``, deterministic)."""
    if config.bits_embedding == OFF:
        return {n: np.asarray(t, np.float32) for n, t in tensors.items()}, {}
    values: dict[str, np.ndarray] = {}
    for name in sorted(tensors):
        x = np.asarray(tensors[name], np.float32)
        if config.compressor == "qsgd":
            values[name] = quant.qrows(x, config.bits_embedding, stream(config.seed, "hsgd-q", *labels, name))
        else:
            values[name] = quant.topk_rows(x, quant.topk_count(quant.rows_of(x.shape)[1], config.bits_embedding))
    return values, config.encodings(values)


# --- device -----------------------------------------------------------------------------------------


class Device(DeviceRoleBase):
    """A device holding ``X2`` of one sample; trains ``theta2`` when selected."""

    TRANSITIONS: ClassVar[Transitions] = DEVICE_TRANSITIONS
    SUPPORTS_PRIVACY: ClassVar[bool] = False  # embeddings are releases the mechanism does not cover

    def __init__(self, *, device_id: str, cell: str, rollout: str) -> None:
        self.device_id = device_id
        self.cell = cell
        self.rollout = rollout
        self._state = RoleState.IDLE
        self.config: HsgdConfig | None = None
        self.position = (-1, -1)
        self.theta2: dict[str, np.ndarray] = {}
        self._start: dict[str, np.ndarray] = {}
        self._selected = False
        self._seen: set[str] = set()

    def receive(self, message: Message, now: float) -> list[Action]:
        if message.sender != self.cell:
            raise UnknownSenderError(f"device accepts messages from its cell {self.cell!r}, not {message.sender!r}")
        if message.key in self._seen:
            return [Dropped("duplicate", message.key)]
        if isinstance(message, DeviceTask):
            return self._task(message)
        if isinstance(message, PartnerEmbeddings):
            return self._partner(message)
        raise UnexpectedMessageError(f"hsgd device does not accept {message.KIND}")

    def _task(self, task: DeviceTask) -> list[Action]:
        if (task.round, task.step) <= self.position:
            raise LateMessageError(f"task for ({task.round}, {task.step}); device is at {self.position}")
        config = _parse(task.config)
        theta2 = _block(task.params, "theta2")
        if not theta2 or len(theta2) != len(task.params):
            raise LayoutMismatchError("an hsgd device task carries exactly the theta2 block")
        self._seen.add(task.key)
        self.config = config
        self.position = (task.round, task.step)
        self.theta2 = theta2  # line 18: every device holds the cell's theta2
        self._start = aggregate.copy_tensors(theta2)
        self._selected = self.device_id in task.members
        if not self._selected:
            self._transition("not_selected")
            return []
        self._transition("task")
        return [Embed(task.round, task.step, "theta2", self.theta2, (self.device_id,))]

    @property
    def last_round(self) -> int:
        """The round of the newest task (what a node shell records with each update it sends)."""
        return self.position[0]

    def embedded(self, round: int, step: int, zeta: np.ndarray) -> list[Action]:
        if (round, step) != self.position or self.config is None:
            raise LocalProtocolError(f"embedded({round}, {step}) while {self._state.value} at {self.position}")
        self._transition("embedded")
        values, enc = _vertical({"z": np.asarray(zeta, np.float32)}, self.config, self.rollout, self.device_id,
                                round, step)
        msg = Embeddings(rollout=self.rollout, round=round, sender=self.device_id, step=step, zeta=values["z"],
                         rows=(self.device_id,))
        return [SendToParent(msg, {"hsgd/zeta": enc["z"]} if enc else {})]

    def _partner(self, msg: PartnerEmbeddings) -> list[Action]:
        if (msg.round, msg.step) != self.position or not self._selected:
            raise StaleIntervalError(f"partner rows for ({msg.round}, {msg.step}); device is at {self.position}"
                                     f"{'' if self._selected else ', not selected'}")
        if self._state is not RoleState.WAITING or self.config is None:
            raise UnexpectedMessageError(f"partner rows while {self._state.value}")
        if msg.rows != (self.device_id,):
            raise EmbeddingWidthError(f"partner rows {msg.rows} are not this device's")
        theta0 = _block(msg.params, "theta0")
        if not theta0:
            raise LayoutMismatchError("partner rows lack the head theta0")
        self._seen.add(msg.key)
        self._transition("partner")
        return [SplitTrain(msg.round, msg.step, "device", self.theta2, theta0, msg.zeta, msg.rows,
                           self.config.local_interval, self.config.lr_at(msg.round, msg.step))]

    def split_trained(self, round: int, step: int, params: Tensors, loss: float) -> list[Action]:
        if (round, step) != self.position:
            raise LocalProtocolError(f"split_trained({round}, {step}) while {self._state.value} at {self.position}")
        self._transition("split_trained")
        assert self.config is not None
        self.theta2 = {k: np.asarray(v, np.float32) for k, v in params.items()}
        delta = aggregate.subtract(self.theta2, self._start)
        return [SendToParent(DeviceUpdate(rollout=self.rollout, round=round, sender=self.device_id, step=step,
                                          delta=delta, num_samples=1, train_loss=float(loss),
                                          steps=self.config.local_interval))]

    def failed(self, round: int, step: int, reason: str) -> list[Action]:
        """The shell could not compute this interval's embedding or training: the edge goes on without it."""
        if (round, step) != self.position:
            raise LocalProtocolError(f"failed({round}, {step}) while {self._state.value} at {self.position}")
        self._transition("failed")
        return [SendToParent(TrainingFailed(rollout=self.rollout, round=round, sender=self.device_id, step=step,
                                            reason=reason))]

    def tick(self, now: float) -> list[Action]:
        return []


# --- host (feature party) ---------------------------------------------------------------------------


class Host(DeviceRoleBase):
    """The cell's feature party: ``X1`` of every sample; trains ``theta1`` and the head ``theta0``."""

    TRANSITIONS: ClassVar[Transitions] = HOST_TRANSITIONS
    SUPPORTS_PRIVACY: ClassVar[bool] = False  # embeddings are releases the mechanism does not cover

    def __init__(self, *, host_id: str, cell: str, rollout: str) -> None:
        self.host_id = host_id
        self.cell = cell
        self.rollout = rollout
        self._state = RoleState.IDLE
        self.config: HsgdConfig | None = None
        self.round = -1
        self.params: dict[str, np.ndarray] = {}
        self._start: dict[str, np.ndarray] = {}
        self._exchange: PartnerEmbeddings | None = None
        self._done_step = -1
        self._losses: list[float] = []
        self._seen: set[str] = set()
        self.batches: list[tuple[int, int, tuple[str, ...]]] = []
        """(round, step, rows) of every interval trained: the mini-batch ids (A5's reuse check)."""

    def receive(self, message: Message, now: float) -> list[Action]:
        if message.sender != self.cell:
            raise UnknownSenderError(f"host accepts messages from its cell {self.cell!r}, not {message.sender!r}")
        if message.key in self._seen:
            return [Dropped("duplicate", message.key)]
        if isinstance(message, DeviceTask):
            if any(k.startswith("theta2/") for k in message.params):
                return [Dropped("not_for_host", message.key, "the devices' theta2 broadcast")]
            if message.round <= self.round:
                raise LateMessageError(f"task for round {message.round}; host is at round {self.round}")
            config = _parse(message.config)
            params = {**_block(message.params, "theta0"), **_block(message.params, "theta1")}
            if len(params) != len(message.params) or not params:
                raise LayoutMismatchError("an hsgd host task carries exactly the theta0 and theta1 blocks")
            self._seen.add(message.key)
            self.config, self.round = config, message.round
            self.params, self._start = params, aggregate.copy_tensors(params)
            self._done_step, self._losses = -1, []
            self._transition("task")
            return []
        if isinstance(message, PartnerEmbeddings):
            if message.round != self.round or message.step <= self._done_step:
                raise StaleIntervalError(f"Z2 for ({message.round}, {message.step}); host is at round {self.round}, "
                                         f"step {self._done_step}")
            if self._state is not RoleState.WAITING or self.config is None:
                raise UnexpectedMessageError(f"Z2 while {self._state.value}")
            if message.step >= self.config.intervals:
                raise WrongRoundError(f"Z2 for step {message.step}; a round has {self.config.intervals}")
            self._seen.add(message.key)
            self._exchange = message
            self._transition("partner")
            return [Embed(message.round, message.step, "theta1", self.params, message.rows)]
        raise UnexpectedMessageError(f"hsgd host does not accept {message.KIND}")

    @property
    def last_round(self) -> int:
        """The round of the newest task (what a node shell records with each update it sends)."""
        return self.round

    @property
    def position(self) -> tuple[int, int]:
        """``(round, interval)``: the interval the host trains, else the next one it waits for."""
        return self.round, self._exchange.step if self._exchange is not None else self._done_step + 1

    def embedded(self, round: int, step: int, zeta: np.ndarray) -> list[Action]:
        ex = self._exchange
        if ex is None or (round, step) != (ex.round, ex.step):
            raise LocalProtocolError(f"embedded({round}, {step}) while {self._state.value}")
        self._transition("embedded")
        assert self.config is not None
        values, enc = _vertical({"z": np.asarray(zeta, np.float32), **_block(self.params, "theta0")}, self.config,
                                self.rollout, self.host_id, round, step)
        z1 = values.pop("z")
        encodings = {("hsgd/zeta" if n == "z" else n): e for n, e in enc.items()}
        msg = Embeddings(rollout=self.rollout, round=round, sender=self.host_id, step=step, zeta=z1, rows=ex.rows,
                         params=values)
        self.batches.append((round, step, ex.rows))
        return [SendToParent(msg, encodings),
                SplitTrain(round, step, "host", self.params, {}, ex.zeta, ex.rows,
                           self.config.local_interval if ex.rows else 0, self.config.lr_at(round, step))]

    def split_trained(self, round: int, step: int, params: Tensors, loss: float) -> list[Action]:
        ex = self._exchange
        if ex is None or (round, step) != (ex.round, ex.step):
            raise LocalProtocolError(f"split_trained({round}, {step}) while {self._state.value}")
        self._transition("split_trained")
        assert self.config is not None
        self.params = {k: np.asarray(v, np.float32) for k, v in params.items()}
        if ex.rows:
            self._losses.append(float(loss))
        self._done_step, self._exchange = step, None
        if step < self.config.intervals - 1:
            return []
        self._transition("round_done")
        mean = float(np.mean(self._losses)) if self._losses else 0.0
        return [SendToParent(DeviceUpdate(rollout=self.rollout, round=round, sender=self.host_id, step=step,
                                          delta=aggregate.subtract(self.params, self._start), num_samples=0,
                                          train_loss=mean, steps=self.config.global_interval))]

    def failed(self, round: int, step: int, reason: str) -> list[Action]:
        """The shell could not compute this interval's rows or training: the host gives the round up (the cell's
        round cannot close without it; the next round's task starts afresh)."""
        ex = self._exchange
        if ex is None or (round, step) != (ex.round, ex.step):
            raise LocalProtocolError(f"failed({round}, {step}) while {self._state.value}")
        self._transition("failed")
        self._exchange = None
        return [SendToParent(TrainingFailed(rollout=self.rollout, round=round, sender=self.host_id, step=step,
                                            reason=reason))]

    def tick(self, now: float) -> list[Action]:
        return []


# --- edge -------------------------------------------------------------------------------------------


def _reject(counter: Counter[str], exc: RemoteProtocolError) -> RemoteProtocolError:
    counter[exc.reason] += 1
    return exc


class Edge(EdgeRoleBase):
    """Selects devices, relays embeddings between them and the host, averages ``theta2`` (eq. (1))."""

    TRANSITIONS: ClassVar[Transitions] = EDGE_TRANSITIONS
    SUPPORTS_PRIVACY: ClassVar[bool] = False  # embeddings are releases the mechanism does not cover

    def __init__(self, *, cell: str, rollout: str, parent: str = "cloud", noise: Any = None) -> None:
        """``noise`` is accepted for the edge service's signature and unused: HSGD refuses noise plans."""
        self.cell = cell
        self.rollout = rollout
        self.parent = parent
        self._state = RoleState.IDLE
        self.round = -1
        self.step = 0
        self.config: HsgdConfig | None = None
        self.host = ""
        self.devices: tuple[str, ...] = ()
        self.selected: tuple[str, ...] = ()
        self.theta2: dict[str, np.ndarray] = {}
        self._global: dict[str, np.ndarray] = {}
        self._phase = ""
        self._deadline = math.inf
        self._zeta: dict[str, np.ndarray] = {}
        self._rows: tuple[str, ...] = ()
        self._deltas: dict[str, Tensors] = {}
        self._host_update: DeviceUpdate | None = None
        self._reported: set[str] = set()
        self._seen: set[str] = set()
        self._failed: dict[str, str] = {}
        """Children that reported ``training_failed`` in the open interval, and why: not waited for in it."""
        self.rejected: Counter[str] = Counter()
        """Refused messages by typed reason (``embedding_width``, ``embedding_non_finite``,
        ``unselected_device``, ``stale_interval``, ...)."""
        self.paper_values = 0
        """The paper's communication meter for the open round (values, eq. (19)'s per-round terms)."""
        self.paper_bytes = 0
        """The same meter in bytes as they cross the wire: ``theta1`` and the devices' ``theta2`` in float32, and
        ``theta0``, ``Z1`` (host -> edge) and ``Z2`` (edge -> host) in the vertical path's encoding (their
        envelopes' body bytes)."""
        self.vertical_bytes = 0
        """Body bytes of every vertical-path tensor this round, on every hop: the devices' ``zeta2``, ``Z2`` to the
        host, ``Z1`` and ``theta0`` from it, each device's row of ``Z1`` and ``theta0``."""
        self.history: list[dict[str, Any]] = []
        """Per interval: round, step, selected, rows exchanged, theta2 reporters (A3's message counts)."""
        self._host_task: DeviceTask | None = None
        self._task: DeviceTask | None = None
        self._to_host_msg: PartnerEmbeddings | None = None
        self._partners: dict[str, PartnerEmbeddings] = {}
        self._to_host_enc: dict[str, TensorEncoding] = {}
        """Wire encodings of the relay to the host (``Z2``) and to each device (its row of ``Z1``, ``theta0``)."""
        self._partner_enc: dict[str, TensorEncoding] = {}

    @property
    def members(self) -> tuple[str, ...]:
        """The cell's devices and its host in the open round."""
        return (*self.devices, self.host) if self.host else self.devices

    @property
    def reported(self) -> tuple[str, ...]:
        """The devices whose theta2 made it into eq. (1) so far this round."""
        return tuple(sorted(self._reported))

    # --- rounds and intervals

    def receive(self, message: Message, now: float) -> list[Action]:
        if message.key in self._seen:
            return [Dropped("duplicate", message.key)]
        if isinstance(message, CellTask):
            return self._cell_task(message, now)
        try:
            if isinstance(message, Embeddings) and not isinstance(message, PartnerEmbeddings):
                return self._embeddings(message, now)
            if isinstance(message, DeviceUpdate):
                return self._update(message, now)
            if isinstance(message, TrainingFailed):
                return self._on_failed(message, now)
        except RemoteProtocolError as exc:
            raise _reject(self.rejected, exc) from None
        raise _reject(self.rejected, UnexpectedMessageError(f"hsgd edge does not accept {message.KIND}"))

    def _cell_task(self, task: CellTask, now: float) -> list[Action]:
        if task.sender != self.parent:
            raise UnknownSenderError(f"cell task from {task.sender!r}, not {self.parent!r}")
        if task.round <= self.round:
            raise LateMessageError(f"cell task for round {task.round}; edge is at round {self.round}")
        config = _parse(task.config)
        host = config.hosts.get(self.cell)
        if host is None or host not in task.members:
            raise UnexpectedMessageError(f"hsgd config names no host of cell {self.cell!r} among its members")
        devices = tuple(sorted(set(task.members) - {host}))
        if not devices:
            raise UnexpectedMessageError(f"cell {self.cell!r} has a host and no device")
        blocks = {b: _block(task.params, b) for b in ("theta0", "theta1", "theta2")}
        if any(not t for t in blocks.values()) or sum(len(t) for t in blocks.values()) != len(task.params):
            raise LayoutMismatchError("an hsgd model has exactly the blocks theta0, theta1 and theta2")
        self._seen.add(task.key)
        self.config, self.host, self.devices, self.round = config, host, devices, task.round
        self._global = aggregate.copy_tensors(task.params)
        self.theta2 = blocks["theta2"]
        self._host_update, self._reported, self.paper_values = None, set(), self._size("theta1")
        self.paper_bytes, self.vertical_bytes = 4 * self._size("theta1"), 0
        self._to_host_enc, self._partner_enc = {}, {}
        self._transition("task")
        host_task = DeviceTask(rollout=self.rollout, round=task.round, sender=self.cell,
                               params={**blocks["theta0"], **blocks["theta1"]}, config=task.config,
                               members=(host,))
        self._host_task, self._to_host_msg = host_task, None
        return [SendToChild(host, host_task), *self._open(0, now)]

    def _size(self, name: str) -> int:
        return sum(int(v.size) for k, v in self._global.items() if k.startswith(f"{name}/"))

    def _open(self, step: int, now: float) -> list[Action]:
        assert self.config is not None
        self.step = step
        self.selected = select(self.devices, self.config.alpha, self.config.seed, self.rollout, self.cell,
                               self.round, step)
        self._phase, self._zeta, self._rows, self._deltas, self._failed = "embed", {}, (), {}, {}
        self._deadline = now + self.config.deadline_s
        task = DeviceTask(rollout=self.rollout, round=self.round, sender=self.cell, step=step, params=self.theta2,
                          config=self.config.to_dict(), members=self.selected)
        self._task, self._partners = task, {}
        return [Broadcast(task)]

    def _check_position(self, message: Message, phases: tuple[str, ...]) -> None:
        if self._state is not RoleState.COLLECTING or message.round != self.round:
            if message.round > self.round:
                raise WrongRoundError(f"{message.KIND} for round {message.round}; edge is at round {self.round}")
            raise StaleIntervalError(f"{message.KIND} for round {message.round}; edge is at round {self.round}"
                                     f"{'' if self._state is RoleState.COLLECTING else ' (closed)'}")
        if message.step > self.step:
            raise WrongRoundError(f"{message.KIND} for interval {message.step}; edge is at {self.step}")
        if message.step < self.step or self._phase not in phases:
            raise StaleIntervalError(f"{message.KIND} for interval ({message.round}, {message.step}); the edge's "
                                     f"interval {self.step} is in phase {self._phase!r}")

    def _embeddings(self, msg: Embeddings, now: float) -> list[Action]:
        if msg.sender == self.host:
            self._check_position(msg, ("host",))
            return self._host_rows(msg, now)
        if msg.sender not in self.devices:
            raise UnknownSenderError(f"embedding from {msg.sender!r}, not a device of cell {self.cell!r}")
        if msg.sender not in self.selected:
            self._check_position(msg, ("embed", "host", "train"))
            raise UnselectedDeviceError(f"embedding from {msg.sender!r}, not selected for interval "
                                        f"({self.round}, {self.step})")
        self._check_position(msg, ("embed",))
        width = self._global["theta2/w"].shape[0]
        if msg.zeta.shape != (1, width) or msg.rows != (msg.sender,) or msg.params:
            raise EmbeddingWidthError(f"embedding of shape {msg.zeta.shape} for rows {msg.rows}; expected (1, {width}) "
                                      f"for ({msg.sender!r},)")
        if not np.all(np.isfinite(msg.zeta)):
            raise EmbeddingNonFiniteError(f"embedding from {msg.sender!r} is not finite")
        assert self.config is not None
        if not self.config.compressed(msg.zeta):
            raise EmbeddingEncodingError(f"embedding from {msg.sender!r} is not in the vertical path's "
                                         f"{self._form()} form")
        self._seen.add(msg.key)
        self.vertical_bytes += self.config.tensor_bytes(msg.zeta.shape)
        self._zeta[msg.sender] = np.asarray(msg.zeta, np.float32)
        if len(self._zeta) == len(self.selected):
            return self._to_host()
        return []

    def _to_host(self) -> list[Action]:
        self._rows = tuple(d for d in self.selected if d in self._zeta)
        width = self._global["theta2/w"].shape[0]
        z2 = np.concatenate([self._zeta[d] for d in self._rows]) if self._rows else np.zeros((0, width), np.float32)
        self._phase = "host"
        missing = sorted(set(self.selected) - set(self._rows))
        notes: list[Action] = [Note("hsgd_embeddings_missing", {"round": self.round, "step": self.step,
                                                                "devices": missing})] if missing else []
        self._to_host_msg = PartnerEmbeddings(rollout=self.rollout, round=self.round, sender=self.cell,
                                              step=self.step, zeta=z2, rows=self._rows)
        assert self.config is not None
        self._to_host_enc = self.config.encodings({HSGD_ZETA: z2})  # the relay re-encodes the rows as they came
        z2_bytes = self.config.tensor_bytes(z2.shape)
        self.paper_bytes += z2_bytes
        self.vertical_bytes += z2_bytes
        return [*notes, SendToChild(self.host, self._to_host_msg, self._to_host_enc)]

    def _host_rows(self, msg: Embeddings, now: float) -> list[Action]:
        width = self._global["theta1/w"].shape[0]
        if msg.rows != self._rows or msg.zeta.shape != (len(self._rows), width):
            raise EmbeddingWidthError(f"host rows {msg.rows} of shape {msg.zeta.shape}; expected {self._rows} of "
                                      f"width {width}")
        theta0 = _block(self._global, "theta0")
        if set(msg.params) != set(theta0) or any(msg.params[k].shape != v.shape for k, v in theta0.items()):
            raise LayoutMismatchError("the host's rows must come with the head theta0")
        if not (np.all(np.isfinite(msg.zeta)) and all(np.all(np.isfinite(v)) for v in msg.params.values())):
            raise EmbeddingNonFiniteError("the host's rows or head are not finite")
        assert self.config is not None
        config = self.config
        if not (config.compressed(msg.zeta) and all(config.compressed(v) for v in msg.params.values())):
            raise EmbeddingEncodingError(f"the host's rows or head are not in the vertical path's {self._form()} form")
        self._seen.add(msg.key)
        rows = len(self._rows)
        d1, d2 = width, self._global["theta2/w"].shape[0]
        # eq. (19)'s interval terms: |A||theta2| + |theta0| + |Z1| + |Z2| (|A| = rows exchanged)
        self.paper_values += rows * self._size("theta2") + self._size("theta0") + rows * d1 + rows * d2
        head_bytes = sum(config.tensor_bytes(v.shape) for v in msg.params.values())
        up = config.tensor_bytes(msg.zeta.shape) + head_bytes
        self.paper_bytes += 4 * rows * self._size("theta2") + up  # Z2 was counted when it went to the host
        self.vertical_bytes += up + rows * (config.tensor_bytes((1, width)) + head_bytes)
        self._partner_enc = config.encodings({HSGD_ZETA: msg.zeta[:1], **msg.params})
        self._phase = "train"
        self._deadline = now + self.config.deadline_s
        self._partners = {d: PartnerEmbeddings(rollout=self.rollout, round=self.round, sender=self.cell,
                                               step=self.step, zeta=msg.zeta[i:i + 1], rows=(d,),
                                               params=dict(msg.params))
                          for i, d in enumerate(self._rows)}
        out: list[Action] = [SendToChild(d, m, self._partner_enc) for d, m in self._partners.items()]
        return out + self._maybe_close(now, deadline=False)

    def _form(self) -> str:
        assert self.config is not None
        return f"{self.config.bits_embedding}-bit {self.config.compressor}"

    def _update(self, msg: DeviceUpdate, now: float) -> list[Action]:
        if msg.sender == self.host:
            self._check_position(msg, ("host", "train"))
            if self.config is None or msg.step != self.config.intervals - 1:
                raise StaleIntervalError(f"host update for step {msg.step}; it is due after the last interval")
            expected = {**_block(self._global, "theta0"), **_block(self._global, "theta1")}
            if set(msg.delta) != set(expected) or any(msg.delta[k].shape != v.shape for k, v in expected.items()):
                raise LayoutMismatchError("the host's update must hold theta0 and theta1")
            self._seen.add(msg.key)
            self._host_update = msg
            return self._maybe_close(now, deadline=False)
        if msg.sender not in self.devices:
            raise UnknownSenderError(f"update from {msg.sender!r}, not a device of cell {self.cell!r}")
        self._check_position(msg, ("train",))
        if msg.sender not in self._rows:
            raise UnselectedDeviceError(f"theta2 from {msg.sender!r}, which did not train in interval "
                                        f"({self.round}, {self.step})")
        if set(msg.delta) != set(self.theta2) or any(msg.delta[k].shape != v.shape for k, v in self.theta2.items()):
            raise LayoutMismatchError(f"theta2 update from {msg.sender!r} does not match theta2")
        self._seen.add(msg.key)
        self._deltas[msg.sender] = msg.delta
        return self._maybe_close(now, deadline=False)

    def _on_failed(self, msg: TrainingFailed, now: float) -> list[Action]:
        """A child could not compute its part of the open interval: a selected device is not waited for (the
        interval goes on with the others, as at its deadline); the host's failure is recorded and the round
        waits (nothing closes without the host's update)."""
        if msg.sender != self.host and msg.sender not in self.devices:
            raise UnknownSenderError(f"{msg.KIND} from {msg.sender!r}, not a member of cell {self.cell!r}")
        self._check_position(msg, ("embed", "host", "train"))
        if msg.sender != self.host and msg.sender not in self.selected:
            raise UnselectedDeviceError(f"{msg.KIND} from {msg.sender!r}, not selected for interval "
                                        f"({self.round}, {self.step})")
        self._seen.add(msg.key)
        self._failed[msg.sender] = msg.reason
        if self._phase == "embed" and all(d in self._zeta or d in self._failed for d in self.selected):
            return self._to_host()
        return self._maybe_close(now, deadline=False)

    def _maybe_close(self, now: float, *, deadline: bool) -> list[Action]:
        assert self.config is not None
        if self._phase != "train":
            return []
        last = self.step == self.config.intervals - 1
        if last and self._host_update is None:
            return []
        if not deadline and any(d not in self._deltas and d not in self._failed for d in self._rows):
            return []
        reporters = [d for d in self._rows if d in self._deltas]
        if reporters:  # eq. (1): unweighted mean of the reporting devices' theta2
            mean = aggregate.weighted_mean([(self._deltas[d], 1.0) for d in reporters])
            self.theta2 = {k: np.asarray(v, np.float32) for k, v in aggregate.add(self.theta2, mean).items()}
        self._reported.update(reporters)
        self.history.append({"round": self.round, "step": self.step, "selected": self.selected, "rows": self._rows,
                             "theta2": tuple(reporters)})
        notes: list[Action] = []
        if len(reporters) < len(self._rows):
            notes.append(Note("hsgd_theta2_missing", {"round": self.round, "step": self.step,
                                                      "devices": sorted(set(self._rows) - set(reporters))}))
        if not last:
            return notes + self._open(self.step + 1, now)
        return notes + self._forward()

    def _forward(self) -> list[Action]:
        assert self._host_update is not None
        delta = {**self._host_update.delta, **aggregate.subtract(self.theta2, _block(self._global, "theta2"))}
        self._transition("forward")
        self._phase = ""
        reported = tuple(sorted(self._reported | {self.host}))
        update = CellUpdate(rollout=self.rollout, round=self.round, sender=self.cell,
                            delta={k: np.asarray(v, np.float32) for k, v in delta.items()},
                            weight=float(len(self.devices)), reported=reported,
                            mean_loss=self._host_update.train_loss,
                            stats={"paper_values": int(self.paper_values), "paper_bytes": int(self.paper_bytes),
                                   "vertical_bytes": int(self.vertical_bytes), "intervals": len(self.history)})
        return [SendToParent(update)]

    def tick(self, now: float) -> list[Action]:
        if self._state is not RoleState.COLLECTING or now < self._deadline:
            return []
        if self._phase == "embed":
            self._deadline = now + (self.config.deadline_s if self.config else 0.0)
            return self._to_host()
        if self._phase == "train" and len(self._deltas) < len(self._rows):
            return self._maybe_close(now, deadline=True)
        return []

    def overdue(self, now: float) -> tuple[str, ...]:
        """The children the open interval still waits for once its deadline has passed (else empty)."""
        if self._state is not RoleState.COLLECTING or now < self._deadline:
            return ()
        if self._phase == "embed":
            return tuple(d for d in self.selected if d not in self._zeta and d not in self._failed)
        if self._phase == "host":
            return (self.host,)
        owing = [d for d in self._rows if d not in self._deltas and d not in self._failed]
        last = self.config is not None and self.step == self.config.intervals - 1
        return (*owing, *((self.host,) if last and self._host_update is None else ()))

    def resend(self, child: str, now: float) -> list[Action]:
        """A child (re)appeared: give it what the open interval still expects from it (its task, the
        host its rows, a device its partner row); nothing otherwise."""
        if self._state is not RoleState.COLLECTING or self._task is None:
            return []
        if child == self.host:
            out: list[Action] = []
            if self._host_task is not None and self.step == 0 and self._phase == "embed":
                out.append(SendToChild(child, self._host_task))
            if self._phase == "host" and self._to_host_msg is not None:
                out.append(SendToChild(child, self._to_host_msg, self._to_host_enc))
            return out
        if child in self._failed:
            return []
        if self._phase == "embed" and child in self.selected and child not in self._zeta:
            return [SendToChild(child, self._task)]
        if self._phase == "train" and child in self._partners and child not in self._deltas:
            return [SendToChild(child, self._partners[child], self._partner_enc)]
        return []


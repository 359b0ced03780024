"""The contract between sans-I/O algorithm roles and the shells that host them.

Theory of operation
-------------------
Every algorithm is three small state machines — device, edge, cloud — that never touch a
socket, a clock, a thread or a logger. A shell (``device_agent``, ``edge_broker``,
``cloud_coordinator``, or the in-process simulator) owns all of that. The shell

1. decodes bytes from the wire into a typed ``Message`` (``fedtier.wire.messages``),
2. calls ``role.receive(message, now)`` (or ``role.tick(now)`` periodically, or a
   role-specific verb such as ``device.trained(...)`` when local work finishes),
3. executes the returned ``Action`` list in order: ``Send*`` actions are encoded and
   published, ``LocalTrain`` runs the trainer, ``Evaluate`` evaluates on the device's
   held-out rows, ``ScoreRows``/``ScoreGradient`` score local rows and take the gradient of a
   weighted sum of scores (X-risk algorithms), ``Embed``/``SplitTrain`` compute an embedding and
   train one side of a split model against fixed partner inputs (HSGD), ``RoundClosed`` is persisted and evaluated,
   ``Dropped``/``Note`` are logged and counted.

Federated evaluation: a device role that was told its shell has held-out rows
(``evaluate=True``) answers a round's first task with ``[Evaluate(...), <its first work>]``
when the task's config asks for it (``federated_eval``) and no noise plan is in force; the
shell reports back with ``role.evaluated(round, stats)`` before it runs the work, and the role
puts the stats in its last upload of the round. Edges and the cloud combine them weighted by
row count. The role decides, the shell only computes: the privacy rule lives in one place.

Edge cases every role implements the same way (tested by the role contract suite):

* A message whose idempotency key was already accepted returns ``[Dropped("duplicate")]``:
  QoS 1 delivers duplicates after reconnects, and outboxes resend after restarts.
* A message for another round raises ``WrongRoundError``; for a round that is already
  closed, ``LateMessageError``; from a node that is not a member of the round,
  ``UnknownSenderError``; with tensors that do not match the model, ``LayoutMismatchError``.
  These are ``RemoteProtocolError``: the shell drops the message, logs and counts it, and
  the role's state is unchanged — one bad peer must not stop a round.
* Calling a verb in the wrong state (``trained`` while idle) raises ``LocalProtocolError``
  and moves the role to ``ERROR``; every later call raises too. That is a bug in the shell.
* Quorum not met by the deadline means the round stays open (no new model); the devices
  that did not report are listed in the eventual ``RoundClosed``/cell update.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np

from fedtier.errors import LocalProtocolError
from fedtier.wire import TensorEncoding
from fedtier.wire.messages import EvalStats, Message

Tensors = Mapping[str, np.ndarray]


class RoleState(enum.Enum):
    """States shared by the roles. Each algorithm module documents its transition table."""

    IDLE = "idle"  # waiting for a task (device/edge) or for start() (cloud)
    TRAINING = "training"  # device: local work requested, result not yet back
    WAITING = "waiting"  # device: uploaded this step's result, waiting for the cell's aggregate
    COLLECTING = "collecting"  # edge/cloud: round open, gathering children's updates
    FORWARDED = "forwarded"  # edge: cell update sent upward; waiting for the next task
    FINISHED = "finished"  # cloud: all rounds done
    ERROR = "error"  # a LocalProtocolError happened; the role refuses further calls


# --- actions a role returns -------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class SendToParent:
    """Publish ``message`` on this node's uplink.

    ``encodings`` maps tensor names to wire encodings (default f32). A role that quantized a
    tensor (``fedtier.wire.quant.qsgd``, with its own RNG stream) says ``qsgd`` here; the wire then
    carries the quantized values losslessly.
    """

    message: Message
    encodings: Mapping[str, TensorEncoding] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class Broadcast:
    """Publish ``message`` once on this node's downlink, for all children."""

    message: Message
    encodings: Mapping[str, TensorEncoding] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class SendToChild:
    """Publish ``message`` on the downlink of one child (a cell, or one device)."""

    child: str
    message: Message
    encodings: Mapping[str, TensorEncoding] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class LocalTrain:
    """Device: run ``steps`` SGD steps of ``batch_size`` from ``params`` with rate ``lr``.

    ``stream`` names the RNG stream for minibatch sampling (``fedtier.rng.stream``), so the
    simulator and a real device draw the same batches. The shell reports back with
    ``role.trained(round, result)``.
    """

    round: int
    params: Tensors
    steps: int
    batch_size: int
    lr: float
    stream: tuple[Any, ...]
    step: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class ComputeGradient:
    """Device: the gradient of the mean loss on one minibatch at ``params``, without applying it.

    The batch is the first of ``minibatch_indices(n, batch_size, 1, stream(*stream))``. The shell
    reports back with ``role.gradient_done(round, step, result)``.
    """

    round: int
    step: int
    params: Tensors
    batch_size: int
    stream: tuple[Any, ...]


@dataclass(frozen=True, slots=True, eq=False)
class Evaluate:
    """Device: evaluate ``params`` — the global model round ``round`` started from — on the
    device's held-out rows (never trained on). The shell reports back with
    ``role.evaluated(round, stats)``; ``stats`` is ``None`` when the loss is not finite."""

    round: int
    params: Tensors


@dataclass(frozen=True, slots=True, eq=False)
class ScoreRows:
    """Device: the model's output (its first column, a score logit) at ``params`` on rows of its local
    data drawn by class: ``per_class[label]`` rows with that label, drawn uniformly with replacement
    by ``fedtier.training.batching.class_rows`` from ``stream(*stream)`` (a class the device does not
    hold gives none). The shell reports back with ``role.scored(round, step, result)``.

    For X-risk algorithms (FeDXL), whose per-step coefficients depend on the current scores."""

    round: int
    step: int
    params: Tensors
    per_class: Mapping[int, int]
    stream: tuple[Any, ...]


@dataclass(frozen=True, slots=True, eq=False)
class RowScores:
    """What the shell hands back after ``ScoreRows``: per class label, the local row indices drawn
    (they never leave the device) and the model's outputs on them (float32, ``(n,)``)."""

    rows: Mapping[int, np.ndarray]
    outputs: Mapping[int, np.ndarray]
    num_samples: int


@dataclass(frozen=True, slots=True, eq=False)
class ScoreGradient:
    """Device: the gradient at ``params`` of ``sum_n weights[n] * output(x[rows[n]])`` — a weighted
    sum of the model's scores on local rows, the weights held constant (a bundle built with loss
    ``weighted_score``). The shell reports back with ``role.gradient_done(round, step, result)``,
    ``result.loss`` being the weighted sum itself."""

    round: int
    step: int
    params: Tensors
    rows: np.ndarray
    weights: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class Embed:
    """HSGD (host or device): compute the embedding of encoder ``block`` (``theta1`` host, ``theta2``
    device) at ``params`` on the local rows named ``rows``; the shell reports back with
    ``role.embedded(round, step, zeta)``."""

    round: int
    step: int
    block: str
    params: Tensors
    rows: tuple[str, ...]


@dataclass(frozen=True, slots=True, eq=False)
class SplitTrain:
    """HSGD (host or device): ``steps`` SGD steps with rate ``lr`` on ``rows``: the host (``side = "host"``)
    trains ``params`` (``theta0, theta1``) with the partner embeddings ``partner`` (``Z2``) fixed; a device trains
    ``params`` (``theta2``) with ``frozen`` (``theta0``) and ``partner`` (its ``zeta1``) fixed. The
    shell reports back with ``role.split_trained(round, step, params, mean_loss)``."""

    round: int
    step: int
    side: str
    params: Tensors
    frozen: Tensors
    partner: np.ndarray
    rows: tuple[str, ...]
    steps: int
    lr: float


@dataclass(frozen=True, slots=True, eq=False)
class GradientResult:
    grad: Tensors
    loss: float
    num_samples: int


@dataclass(frozen=True, slots=True, eq=False)
class LocalResult:
    """What the shell hands back after ``LocalTrain``: the parameter change and stats."""

    delta: Tensors
    num_samples: int
    mean_loss: float
    steps: int


@dataclass(frozen=True, slots=True, eq=False)
class RoundClosed:
    """Cloud: round ``round`` is aggregated; ``params`` is the new global model."""

    round: int
    params: Tensors
    reported: Mapping[str, tuple[str, ...]]
    missing: tuple[str, ...]
    metrics: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Finished:
    """Cloud: the rollout is over — the last configured round closed, or ``reason`` stopped it
    before round ``rounds`` opened (e.g. "privacy_budget"); nothing more will be sent."""

    rounds: int
    reason: str = "completed"


@dataclass(frozen=True, slots=True)
class Dropped:
    """A message was ignored without being an error (duplicate, not selected, superseded)."""

    reason: str
    key: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Note:
    """Something worth a log line (a deadline passed, a cell closed with stragglers)."""

    event: str
    fields: Mapping[str, Any] = field(default_factory=dict)


Action = (SendToParent | Broadcast | SendToChild | LocalTrain | ComputeGradient | Evaluate | ScoreRows | ScoreGradient
          | Embed | SplitTrain | RoundClosed | Finished | Dropped | Note)


# --- role protocols -----------------------------------------------------------------------


class Role(Protocol):
    """What every role offers its shell."""

    @property
    def state(self) -> RoleState: ...

    def receive(self, message: Message, now: float) -> list[Action]:
        """Handle one decoded message from a peer. May raise ``RemoteProtocolError``."""
        ...

    def tick(self, now: float) -> list[Action]:
        """Let time pass: deadlines. Called periodically by the shell."""
        ...


class DeviceRole(Role, Protocol):
    def trained(self, round: int, result: LocalResult) -> list[Action]:
        """The shell finished the ``LocalTrain`` of ``round``."""
        ...

    def gradient_done(self, round: int, step: int, result: GradientResult) -> list[Action]:
        """The shell finished a ``ComputeGradient`` (only algorithms that request them)."""
        ...

    def evaluated(self, round: int, stats: EvalStats | None) -> list[Action]:
        """The shell finished an ``Evaluate`` of ``round`` (only roles told they may evaluate)."""
        ...

    def scored(self, round: int, step: int, result: RowScores) -> list[Action]:
        """The shell finished a ``ScoreRows`` (only algorithms that request them: FeDXL)."""
        ...


class EdgeRole(Role, Protocol):
    def resend(self, child: str, now: float) -> list[Action]:
        """A child (re)appeared online: give it the open round's task if it still owes an update."""
        ...


class CloudRole(Role, Protocol):
    def start(self, now: float) -> list[Action]:
        """Open the first round (or the resumed round)."""
        ...

    def resend(self, child: str, now: float) -> list[Action]:
        ...


class StateGuard:
    """Mixin: ``ERROR`` is terminal, and misuse moves a role there (h11's failure state)."""

    _state: RoleState

    @property
    def state(self) -> RoleState:
        return self._state

    def _guard(self) -> None:
        if self._state is RoleState.ERROR:
            raise LocalProtocolError("role is in ERROR state after an earlier misuse")

    def _misuse(self, message: str) -> LocalProtocolError:
        self._state = RoleState.ERROR
        return LocalProtocolError(message)

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

Failed local work: when the shell cannot compute what a device role asked for — the trainer raised, its
result is not finite, or the agent died in it ``max_task_crashes`` times (a native crash of the training
runtime, detected when the agent starts again) — it calls ``role.failed(round, step, reason)`` instead of
the answer. The role gives up the round (as if it had finished it: a repeated task of it is a duplicate) and
answers ``[SendToParent(TrainingFailed)]``; an edge counts that member out of the round and closes its step
without it once every other member reported, as for a straggler that will not come.

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
  and moves the role to ``ERROR``; every later call of a verb raises too. That is a bug in the
  shell. Each role family's legal state changes are data (``Transitions``), checked in one
  function (``StateGuard._transition``); ``ERROR`` is entered in one place (``StateGuard``).
* Quorum not met by the deadline means the round stays open (no new model); the devices
  that did not report are listed in the eventual ``RoundClosed``/cell update.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Protocol, runtime_checkable

import numpy as np

from fedtier.errors import LocalProtocolError
from fedtier.wire import TensorEncoding
from fedtier.wire.messages import EvalStats, Message

if TYPE_CHECKING:
    from fedtier.privacy.plan import NoisePlan

Tensors = Mapping[str, np.ndarray]


class RoleState(enum.Enum):
    """States shared by the roles. Each algorithm module keeps its transition tables (``Transitions``) at its top."""

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
#
# What the shells may call, and nothing else: ``device_agent/node.py`` holds ``DeviceRole``s (HSGD's
# host included), ``edge_broker/service.py`` ``EdgeRole``s, ``cloud_coordinator/node.py`` a ``CloudRole``;
# ``local_fleet`` builds the same nodes. ``fedtier/algorithms/conformance.py`` states that every
# algorithm's classes implement them, so the type checker (run by the suite) fails when a role loses a
# verb or changes a signature; ``runtime_checkable`` lets the unit tests check the same at runtime.
# A capability only some roles have (an edge optimizer's state, a secret sample) is still a member,
# with a neutral default in ``DeviceRoleBase``/``EdgeRoleBase``: a shell never probes a role.


@runtime_checkable
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


@runtime_checkable
class DeviceRole(Role, Protocol):
    """A device-tier role: a device of any algorithm, or HSGD's host (a feature party in a device's shell)."""

    @property
    def last_round(self) -> int:
        """The newest round this role finished or works in: the shell stores it with each upload."""
        ...

    @property
    def position(self) -> tuple[int, int]:
        """``(round, step)`` this role works on or waits for: for diagnostics (``local_fleet.probe``)."""
        ...

    def trained(self, round: int, result: LocalResult) -> list[Action]:
        """The shell finished the ``LocalTrain`` of ``round``."""
        ...

    def gradient_done(self, round: int, step: int, result: GradientResult) -> list[Action]:
        """The shell finished a ``ComputeGradient`` or a ``ScoreGradient``."""
        ...

    def evaluated(self, round: int, stats: EvalStats | None) -> list[Action]:
        """The shell finished an ``Evaluate`` of ``round`` (only roles told they may evaluate)."""
        ...

    def scored(self, round: int, step: int, result: RowScores) -> list[Action]:
        """The shell finished a ``ScoreRows`` (only algorithms that request them: FeDXL)."""
        ...

    def embedded(self, round: int, step: int, zeta: np.ndarray) -> list[Action]:
        """The shell finished an ``Embed`` (HSGD)."""
        ...

    def split_trained(self, round: int, step: int, params: Tensors, loss: float) -> list[Action]:
        """The shell finished a ``SplitTrain`` (HSGD)."""
        ...

    def failed(self, round: int, step: int, reason: str) -> list[Action]:
        """The shell could not compute the work the role asked for at ``(round, step)``; ``reason`` is one of
        ``fedtier.wire.messages.TRAINING_FAILURES``. The role gives up the round and reports it upward."""
        ...


@runtime_checkable
class EdgeRole(Role, Protocol):
    """A cell's role in the edge service."""

    @property
    def round(self) -> int:
        """The open (or last) round; -1 before the first task."""
        ...

    @property
    def step(self) -> int:
        """The step (edge round, interval) of the open round."""
        ...

    @property
    def members(self) -> tuple[str, ...]:
        """The children a broadcast of the open round reaches."""
        ...

    @property
    def reported(self) -> tuple[str, ...]:
        """The children whose upload the open step (or round) holds."""
        ...

    @property
    def sampling_secretly(self) -> bool:
        """The cell samples its members in secret: participation must not leave the cell (docs/privacy.md)."""
        ...

    @property
    def noise_plan(self) -> NoisePlan | None:
        """The open round's noise plan (``None`` without differential privacy): the service audits a trusted
        cell's update against it before it leaves for the cloud."""
        ...

    def resend(self, child: str, now: float) -> list[Action]:
        """A child (re)appeared online: give it the open round's task if it still owes an update."""
        ...

    def overdue(self, now: float) -> tuple[str, ...]:
        """The children the open step still waits for once its deadline has passed (else empty)."""
        ...

    def strategy_state(self) -> Mapping[str, np.ndarray] | None:
        """What the role carries across rounds (an edge optimizer's moments), stored with each cell update."""
        ...

    def load_strategy_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Continue from ``strategy_state()`` as stored, after a restart (before the open round is replayed)."""
        ...


@runtime_checkable
class CloudRole(Role, Protocol):
    """The rollout's role in the coordinator."""

    @property
    def round(self) -> int:
        """The open round (after the last: the number of rounds run)."""
        ...

    @property
    def params(self) -> Tensors:
        """The global model after the last closed round."""
        ...

    def start(self, now: float) -> list[Action]:
        """Open the first round (or the resumed round)."""
        ...

    def resend(self, child: str, now: float) -> list[Action]:
        """A cell's edge (re)appeared online: give it the open round's task if the cell still owes its update."""
        ...

    def overdue(self, now: float) -> tuple[str, ...]:
        """The cells the open round still waits for once its deadline has passed (else empty)."""
        ...

    def strategy_state(self) -> Mapping[str, np.ndarray] | None:
        """The server-side strategy's state after the last closed round, committed with its model version."""
        ...

    def load_strategy_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore ``strategy_state()`` after a restart (before ``start``)."""
        ...


# --- state machines -------------------------------------------------------------------------

Transitions = Mapping[RoleState, Mapping[str, RoleState]]
"""A role family's legal state changes: ``{state: {event: next state}}``; an event absent from its
state's row is illegal there. Each algorithm module keeps its families' tables at its top."""

VERBS = frozenset({"receive", "tick", "start", "resend", "trained", "gradient_done", "evaluated", "scored",
                   "embedded", "split_trained", "failed", "load_strategy_state"})
"""The protocols' methods that feed a role: refused once it is in ``ERROR`` (``StateGuard``)."""
QUERIES = frozenset({"overdue", "strategy_state"})
"""The protocols' methods that only read a role: they still answer in ``ERROR``, so a shell can say where a
failed role stood (as h11 lets its caller read the states after an error)."""


class StateGuard:
    """Base of every role: its transitions as data checked in one function, ``ERROR`` entered in one place.

    As in h11's ``_state.py``: each role family lists its legal state changes in ``TRANSITIONS``, and
    a role changes state only through ``_transition(event)``, which looks the change up and raises
    ``LocalProtocolError`` when the table has none — a bug in the role or in its shell (``trained``
    while idle). Checks the table cannot express (a result for another step) raise
    ``LocalProtocolError`` themselves.

    Every verb (``VERBS``) a subclass defines is wrapped when the class is created: the wrapper refuses
    every call once the role is in ``ERROR``, and moves the role to ``ERROR`` when a
    ``LocalProtocolError`` leaves the verb — the one place ``ERROR`` is entered, like h11's
    ``_process_error``. The promise that every call raises after an error thus holds for a verb whose
    author never thought of it. ``RemoteProtocolError`` passes through and leaves the state as it was:
    one bad peer must not stop a round.
    """

    TRANSITIONS: ClassVar[Transitions] = {}
    _state: RoleState

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in sorted(VERBS.intersection(vars(cls))):
            setattr(cls, name, _guarded(vars(cls)[name]))

    @property
    def state(self) -> RoleState:
        return self._state

    def _transition(self, event: str) -> None:
        """Move to the state ``TRANSITIONS`` gives for ``event`` in the current one.

        Raises:
            LocalProtocolError: the table has no such change (the verb's wrapper then enters ``ERROR``).
        """
        target = self.TRANSITIONS.get(self._state, {}).get(event)
        if target is None:
            raise LocalProtocolError(f"{type(self).__name__}: {event!r} is not allowed in state {self._state.value}")
        self._state = target


GUARDED = "__role_verb__"
"""Marks a method wrapped by ``StateGuard`` (the unit tests check that every verb of every role is)."""


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` refusing calls in ``ERROR``, and entering ``ERROR`` on a ``LocalProtocolError`` (``StateGuard``)."""
    if getattr(method, GUARDED, False):
        return method  # a verb a subclass took over from another role class as it is

    @functools.wraps(method)
    def verb(self: StateGuard, *args: Any, **kwargs: Any) -> Any:
        if self._state is RoleState.ERROR:
            raise LocalProtocolError(f"{type(self).__name__}.{method.__name__}(): role is in ERROR state after an "
                                     "earlier misuse")
        try:
            return method(self, *args, **kwargs)
        except LocalProtocolError:
            self._state = RoleState.ERROR
            raise

    verb.__dict__[GUARDED] = True
    return verb


class DeviceRoleBase(StateGuard):
    """A device-tier role's answers to local work it never asks for: each is a misuse by the shell.

    ``DeviceRole`` lists every kind of local work a device shell runs; an algorithm overrides the
    answers to the requests it makes (``LocalTrain`` -> ``trained``, ...).
    """

    def trained(self, round: int, result: LocalResult) -> list[Action]:
        raise LocalProtocolError(f"{type(self).__name__} never requests LocalTrain")

    def gradient_done(self, round: int, step: int, result: GradientResult) -> list[Action]:
        raise LocalProtocolError(f"{type(self).__name__} never requests a gradient")

    def evaluated(self, round: int, stats: EvalStats | None) -> list[Action]:
        raise LocalProtocolError(f"{type(self).__name__} never requests an evaluation")

    def scored(self, round: int, step: int, result: RowScores) -> list[Action]:
        raise LocalProtocolError(f"{type(self).__name__} never requests ScoreRows")

    def embedded(self, round: int, step: int, zeta: np.ndarray) -> list[Action]:
        raise LocalProtocolError(f"{type(self).__name__} never requests an embedding")

    def split_trained(self, round: int, step: int, params: Tensors, loss: float) -> list[Action]:
        raise LocalProtocolError(f"{type(self).__name__} never requests SplitTrain")

    def failed(self, round: int, step: int, reason: str) -> list[Action]:
        raise LocalProtocolError(f"{type(self).__name__} never requests local work")


class EdgeRoleBase(StateGuard):
    """An edge role's neutral answers about capabilities it may not have (an edge that overrides them has)."""

    @property
    def sampling_secretly(self) -> bool:
        return False

    @property
    def noise_plan(self) -> NoisePlan | None:
        return None

    def strategy_state(self) -> Mapping[str, np.ndarray] | None:
        return None

    def load_strategy_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Nothing is carried across rounds, so nothing is restored."""

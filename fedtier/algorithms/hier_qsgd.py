"""Hier-Local-QSGD: hierarchical local SGD with quantized model deltas (Liu et al., ICC 2020).

The baseline of QHetFed (seed 003, Sec. III, Algorithm 2, digest §2.3); with identity
quantizers and one edge round it is plain hierarchical FedAvg (``fedavg`` uses these roles).

Theory of operation
-------------------
Global round ``t`` from global parameters ``w_t``; set ``l`` starts from ``w_t``:

    for i = 0 .. tau-1                                   (edge rounds, ``edge_rounds``)
        device n: gamma local SGD steps from the set model   (``local_steps``)
                  upload Q1(w_n - w_set)                    DeviceUpdate(step=i), q1 stream
        edge:     avg = sum_n a_n Q1(...) / sum_n a_n        a_n = 1, or samples
                  w_set <- w_set + avg;  acc <- acc + avg
                  i < tau-1: broadcast CellStep(step=i, "delta", avg, sha(w_set))
    edge -> cloud: Q2(acc)  (acc = w_set - w_t, summed exactly as applied)   CellUpdate
    cloud: w_{t+1} = w_t + sum_l W_l Q2(.)_l / sum_l W_l      (fedtier.algorithms.cloud)

Devices apply each broadcast ``avg`` with the same float32 operation as the edge, so every
device of a set holds the bit-identical set model; ``sha`` lets each check it.
Minibatches of device ``n`` in edge round ``i`` come from stream
``(seed, "batches", rollout, n, t, i)``; its quantizer from ``(seed, "q1", rollout, n, t, i, tensor)``,
the edge's from ``(seed, "q2", rollout, cell, t, tensor)``: no two senders share a stream.

Differential privacy (M2FDP, seed 004; ``fedtier.privacy``), when the task carries a noise
plan: every device upload is clipped to L2 norm ``C``; a device under an untrusted edge adds
``N(0, sigma_dev^2 I)`` before quantizing and declares the release in the update; a trusted
edge clips each input again (quantization may have grown it), and adds fresh noise to the
cell's change before it goes to the cloud; an untrusted edge forwards the exact mean of
noised inputs and refuses an input whose release record is missing. Training losses are not
sent to untrusted nodes (they are data-dependent releases the plan does not cover), nor is a
trusted cell's mean QSGD variance of its devices' clear deltas; ``fedtier.privacy.disclosure``
classifies every field an upward message carries. For the same reason devices do not evaluate
on held-out rows under a plan.

Federated evaluation (``fedtier.algorithms.base``): a device with held-out rows evaluates the
global model ``w_t`` when it starts round ``t`` (``Evaluate`` before its first local steps) and
sends the result with its last upload of the round; the edge forwards the count-weighted
combination of its devices' results in the cell update, and each device's own in its
``stats["evaluations"]`` (``_EdgeBase._evaluations``).

Transitions: ``DEVICE_TRANSITIONS`` and ``EDGE_TRANSITIONS`` below, data that
``StateGuard._transition`` checks (anything else raises ``LocalProtocolError``). The device and
edge roles built on this module's (FedAvg, HIST, QHetFed, FeDXL, secure aggregation) share them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from fedtier.algorithms import aggregate, strategies
from fedtier.algorithms.base import (
    Action,
    Broadcast,
    DeviceRoleBase,
    Dropped,
    EdgeRoleBase,
    Evaluate,
    LocalResult,
    LocalTrain,
    Note,
    RoleState,
    SendToChild,
    SendToParent,
    Transitions,
)
from fedtier.algorithms.cloud import Cloud
from fedtier.algorithms.server_opt import OptimizerSpec, ServerOptimizer
from fedtier.algorithms.common import (
    RoundSettings,
    check_int,
    check_like,
    device_weights,
    digest,
    quantize,
    quorum_count,
)
from fedtier.errors import (
    LateMessageError,
    LocalProtocolError,
    UnexpectedMessageError,
    UnknownSenderError,
    WrongRoundError,
)
from fedtier.privacy import audit
from fedtier.privacy.mechanism import NoiseSource, clip
from fedtier.privacy.plan import DEVICE_COUNT_SENSITIVITY, EDGE_COUNT_SENSITIVITY, NoisePlan, fixed_sample_size
from fedtier.rng import stream
from fedtier.wire.messages import (
    CellStep,
    CellTask,
    CellUpdate,
    DeviceTask,
    DeviceUpdate,
    EvalStats,
    Message,
    TrainingFailed,
)

NAME = "hier_qsgd"

__all__ = ["HierConfig", "Device", "Edge", "Cloud", "NAME"]

DEVICE_TRANSITIONS: Transitions = {
    RoleState.IDLE: {
        "task": RoleState.TRAINING,  # a task of a round this device has not finished: local work
        "resume": RoleState.WAITING,  # a task of a step it uploaded before a restart: wait for the cell's average
        "refuse": RoleState.IDLE,  # a task refused once read (FeDXL: a pool of the wrong round)
    },
    RoleState.TRAINING: {
        "task": RoleState.TRAINING,  # a newer round's task supersedes the work (its result comes back superseded)
        "resume": RoleState.WAITING,
        "refuse": RoleState.IDLE,
        # the shell hands back the work the role asked for (the role checks its round and step)
        "trained": RoleState.TRAINING,
        "gradient_done": RoleState.TRAINING,
        "scored": RoleState.TRAINING,
        "evaluated": RoleState.TRAINING,
        "uploaded": RoleState.WAITING,  # step i < tau-1 uploaded: wait for the cell's average
        "round_done": RoleState.IDLE,  # the round's last upload
        "failed": RoleState.IDLE,  # the shell could not compute the work: the round is given up (training_failed)
    },
    RoleState.WAITING: {
        "task": RoleState.TRAINING,  # a newer round's task, or a catch-up (the cell closed our step without us)
        "resume": RoleState.WAITING,
        "refuse": RoleState.IDLE,
        "cell_step": RoleState.TRAINING,  # the cell's average of the step: train the next one
        "desync": RoleState.IDLE,  # our set model differs from the edge's: a catch-up task brings us back
        "round_done": RoleState.IDLE,  # secure aggregation: the reveal after the upload ends the round
    },
}
"""The device roles' transitions (every ``_DeviceBase``)."""

EDGE_TRANSITIONS: Transitions = {
    RoleState.IDLE: {"task": RoleState.COLLECTING},
    RoleState.COLLECTING: {
        "task": RoleState.COLLECTING,  # a newer round's task abandons the open one ("round_abandoned")
        "next_step": RoleState.COLLECTING,  # step i < tau-1 closed: its average went down, step i+1 collects
        "forward": RoleState.FORWARDED,  # the last step closed (all members, or deadline and quorum): cell update up
        "abort": RoleState.FORWARDED,  # secure aggregation aborted: nothing goes up; the next task starts afresh
    },
    RoleState.FORWARDED: {"task": RoleState.COLLECTING},
}
"""The edge roles' transitions (every ``_EdgeBase``)."""


@dataclass(frozen=True, slots=True)
class HierConfig(RoundSettings):
    """Per-rollout settings (``RoundSettings`` plus):

    Attributes:
        local_steps: gamma, SGD steps per device per edge round (> 0).
        edge_rounds: tau, edge aggregations per global round (> 0).
        partial_work: each device runs ``1 + floor(u * local_steps)`` steps per edge round, ``u``
            uniform from its stream ``(seed, "partial-work", rollout, device, round, step)`` — slow
            boards that finish fewer steps than asked and still send their update (FedProx's
            systems heterogeneity). Left out of ``to_dict`` when off.
    """

    ALGORITHM: ClassVar[str] = NAME

    local_steps: int = 10
    edge_rounds: int = 1
    partial_work: bool = False

    def __post_init__(self) -> None:
        RoundSettings.__post_init__(self)
        check_int(self.local_steps, "local_steps", 1)
        check_int(self.edge_rounds, "edge_rounds", 1)
        if not isinstance(self.partial_work, bool):
            raise LocalProtocolError(f"partial_work must be a bool, got {self.partial_work!r}")


def _noise_plan(config: Any, cell: str, supported: bool) -> NoisePlan | None:
    """The task's noise plan, if any; ``UnexpectedMessageError`` if this role cannot honour it."""
    plan = config.noise_plan()
    if plan is None:
        return None
    if not supported:
        raise UnexpectedMessageError(f"{config.ALGORITHM} does not support differential privacy")
    if cell not in plan.cells:
        raise UnexpectedMessageError(f"task's noise plan does not cover cell {cell!r}")
    return plan


def _edge_aggregator(config: Any) -> strategies.Aggregator:
    """The edge rule the task names; ``UnexpectedMessageError`` if this node cannot run it."""
    try:
        return strategies.build(strategies.parse_strategy(config.strategy)["edge"])
    except strategies.StrategyError as exc:
        raise UnexpectedMessageError(f"task's edge aggregator: {exc}") from None


class _DeviceBase(DeviceRoleBase):
    """Round bookkeeping shared by the device roles: which task to accept, catch-up, desync."""

    TRANSITIONS: ClassVar[Transitions] = DEVICE_TRANSITIONS
    CONFIG: ClassVar[type[Any]] = HierConfig
    SUPPORTS_PRIVACY: ClassVar[bool] = True

    def __init__(self, *, device_id: str, cell: str, rollout: str, last_round: int = -1,
                 last_sent: tuple[int, int] | None = None, noise: NoiseSource | None = None,
                 evaluate: bool = False) -> None:
        """
        Args:
            device_id: this device's node id.
            cell: the cell (edge node id) whose messages are accepted.
            rollout: the rollout this role serves.
            last_round: the last round this device finished (after a restart), so a
                redelivered task of that round is a duplicate, not new work.
            last_sent: ``(round, step)`` of the newest upload this device made before a restart;
                updated with every upload after it (``_uploaded``). A task for that step restores
                the set model and waits for the cell's average instead of training the step again
                — after a restart as in the running process (a desync, then the edge repeating the
                step's task): a second upload of the same step would be a second noisy release of
                the same data that the privacy ledger never charges.
            noise: where differential-privacy noise comes from (default: a fresh OS-seeded source).
            evaluate: the shell holds held-out rows, so the role may ask for federated evaluation.
        """
        self.noise = noise if noise is not None else NoiseSource()
        self.can_evaluate = evaluate
        self._evaluation: EvalStats | None = None
        self._plan: NoisePlan | None = None
        self._unclipped: bool | None = None
        self.device_id = device_id
        self.cell = cell
        self.rollout = rollout
        self.last_round = last_round
        self._last_sent = last_sent
        self._round = last_round
        self._step = 0
        self._state = RoleState.IDLE
        self._config: Any = None
        self._params: dict[str, np.ndarray] = {}

    def _accept_task(self, task: DeviceTask) -> list[Action] | None:
        """Validate a task; ``None`` means start it, a list is the answer (a drop)."""
        if task.sender != self.cell:
            raise UnknownSenderError(f"task from {task.sender!r}, expected cell {self.cell!r}")
        if self.device_id not in task.members:
            # Not selected (a trusted edge's secret sample, or partial participation): first, because a
            # broadcast can reach a device that is not in it after the round it names has closed.
            return [Dropped("not_selected", task.key, f"{self.device_id} not in round {task.round}")]
        if task.round < self._round:
            raise WrongRoundError(f"task for round {task.round}, device is at round {self._round}")
        # A catch-up: the cell closed the step this device waits on and went on; its average never came (lost).
        catch_up = (task.round == self._round and self._state is RoleState.WAITING and task.step > self._step
                    and self.last_round < task.round)
        if (task.round == self._round and not catch_up
                and (self._state is not RoleState.IDLE or self.last_round >= task.round)):
            return [Dropped("duplicate", task.key)]
        # (same round while idle and unfinished: a catch-up task after this device dropped out)
        sent = self._last_sent
        if sent is not None and sent[0] == task.round and sent[1] > task.step:
            return [Dropped("duplicate", task.key, f"step {sent[1]} of round {task.round} was already uploaded")]
        config = self.CONFIG.from_dict(task.config)
        if task.step < 0 or task.step > self._max_start_step(config):
            raise UnexpectedMessageError(f"task starts at step {task.step}, beyond the round's steps")
        plan = _noise_plan(config, self.cell, self.SUPPORTS_PRIVACY)
        self._config, self._plan = config, plan
        self._round, self._step = task.round, task.step
        self._evaluation = None
        self._params = aggregate.copy_tensors(task.params)
        if sent == (task.round, task.step):
            # Uploaded before a restart (the upload is in the outbox or with the edge already):
            # hold the step's set model and wait for the cell's average, as before the restart.
            self._transition("resume")
            return [Note("resumed", {"round": task.round, "step": task.step, "reason": "step already uploaded"})]
        return None

    def _max_start_step(self, config: Any) -> int:
        raise NotImplementedError

    @property
    def position(self) -> tuple[int, int]:
        """``(round, step)`` this device trains or waits for the cell's average of."""
        return self._round, self._step

    def _evaluate_request(self) -> list[Action]:
        """``[Evaluate]`` of the round's global model when this device may and should report one:
        it has held-out rows, the task asks for it, no noise plan is in force (the statistics
        would be a clear release), and it starts the round at step 0 (a catch-up task carries
        a set model, not the global one)."""
        if (self.can_evaluate and self._config.federated_eval and self._plan is None and self._step == 0):
            return [Evaluate(round=self._round, params=self._params)]
        return []

    def evaluated(self, round: int, stats: EvalStats | None) -> list[Action]:
        """The shell evaluated the round's global model; the stats go out with the round's last upload."""
        if round != self._round:
            return [Dropped("superseded", f"evaluate/{round}", f"now at round {self._round}")]
        if self._step != 0:
            raise LocalProtocolError("evaluated() called while no evaluation was requested")
        self._transition("evaluated")
        self._evaluation = stats
        return []

    def _uploaded(self, step: int) -> None:
        """Record an upload of ``step`` of the current round: that step is never released again."""
        self._last_sent = (self._round, step)

    def failed(self, round: int, step: int, reason: str) -> list[Action]:
        """The shell could not compute the work of ``(round, step)``: give the round up, as if finished (a repeated
        task of it is a duplicate, after a restart too: the shell stores ``last_round`` with the report), and
        tell the edge, which closes the round without this device."""
        if round != self._round and self._state is RoleState.TRAINING:
            return [Dropped("superseded", f"failed/{round}", f"now at round {self._round}")]
        self._transition("failed")
        self.last_round = max(self.last_round, round)
        self._params = {}
        self._evaluation = None
        return [SendToParent(TrainingFailed(rollout=self.rollout, round=round, sender=self.device_id, step=step,
                                            reason=reason))]

    def _check_step(self, msg: CellStep, kind: str) -> None:
        if msg.sender != self.cell:
            raise UnknownSenderError(f"cell step from {msg.sender!r}, expected {self.cell!r}")
        if msg.round < self._round or (msg.round == self._round and msg.step < self._step):
            raise LateMessageError(f"step {msg.step} of round {msg.round}; device is at {self._step} of {self._round}")
        if msg.round != self._round or msg.step != self._step or self._state is not RoleState.WAITING:
            raise WrongRoundError(f"step {msg.step} of round {msg.round}; device is at {self._step} of "
                                  f"round {self._round} ({self._state.value})")
        if msg.kind != kind:
            raise UnexpectedMessageError(f"cell step of kind {msg.kind!r}, expected {kind!r}")
        check_like(self._params, msg.tensors_, "cell step")

    def _desync(self, msg: CellStep) -> list[Action]:
        """Our set model differs from the edge's: leave the round; a catch-up task brings us back."""
        self._transition("desync")
        return [Dropped("desync", msg.key, f"set model after step {msg.step} differs from the edge's")]

    def _finish_round(self) -> None:
        self._transition("round_done")
        self.last_round = self._round
        self._params = {}  # the next task brings the model: a simulator's 10,000 devices need not keep a copy each

    def tick(self, now: float) -> list[Action]:
        return []


class Device(_DeviceBase):
    """Runs gamma local steps per edge round; uploads Q1(local change); applies the cell's average."""

    def _max_start_step(self, config: Any) -> int:
        return int(config.edge_rounds) - 1

    def receive(self, message: Message, now: float) -> list[Action]:
        if isinstance(message, DeviceTask):
            answer = self._accept_task(message)
            if answer is not None:
                return answer
            self._transition("task")
            return [*self._evaluate_request(), self._local_train()]
        if isinstance(message, CellStep):
            self._check_step(message, "delta")
            self._params = aggregate.add(self._params, message.tensors_)
            if digest(self._params) != message.model_sha:
                return self._desync(message)
            self._step += 1
            self._transition("cell_step")
            return [self._local_train()]
        raise UnexpectedMessageError(f"device does not accept {message.KIND}")

    def _local_train(self) -> LocalTrain:
        c = self._config
        steps = c.local_steps
        if c.partial_work:
            u = stream(c.seed, "partial-work", self.rollout, self.device_id, self._round, self._step).random()
            steps = 1 + min(int(u * c.local_steps), c.local_steps - 1)
        return LocalTrain(round=self._round, step=self._step, params=self._params, steps=steps,
                          batch_size=c.batch_size, lr=c.lr,
                          stream=(c.seed, "batches", self.rollout, self.device_id, self._round, self._step))

    def trained(self, round: int, result: LocalResult) -> list[Action]:
        self._transition("trained")
        if round != self._round:
            return [Dropped("superseded", f"local/{round}", f"now at round {self._round}")]
        check_like(self._params, result.delta, "local result")
        c = self._config
        delta, release, train_loss = self._privatize(result)
        values, encodings, q = quantize(delta, c.bits_device, c.seed, "q1", self.rollout, self.device_id,
                                        self._round, self._step)
        last = self._step + 1 >= c.edge_rounds
        update = DeviceUpdate(rollout=self.rollout, round=self._round, sender=self.device_id, step=self._step,
                              delta=values, num_samples=self._sent_samples(result.num_samples),
                              train_loss=train_loss,
                              steps=result.steps, q=q, release=release,
                              evaluation=self._evaluation if last else None, unclipped=self._unclipped)
        self._uploaded(self._step)
        if not last:
            self._transition("uploaded")
        else:
            self._finish_round()
        return [SendToParent(update, encodings)]


    def _sent_samples(self, count: int) -> int:
        """The sample count a device reports: 0 under device sampling, whose adjacency is user-level, so a
        device's dataset size is its data (``disclosure.SAMPLED``); it weighs nothing under privacy anyway."""
        return 0 if self._plan is not None and self._plan.sampled else count

    def _privatize(self, result: LocalResult) -> tuple[Mapping[str, np.ndarray], dict[str, Any] | None, float]:
        """Clip, then noise where the plan says (before quantization): (delta, release record, loss to send)."""
        plan = self._plan
        self._unclipped = None
        if plan is None:
            return result.delta, None, result.mean_loss
        delta, factor = clip(result.delta, plan.clip)
        fits = factor == 1.0  # adaptive clipping's bit: the update fitted the round's bound
        if plan.cells[self.cell].trusted:
            # clear, to a trusted edge (over TLS), with the bit the edge counts under adaptive clipping
            self._unclipped = fits if plan.adaptive is not None else None
            return delta, None, result.mean_loss
        z = plan.cells[self.cell].device_z
        sigma = plan.device_sigma(self.cell)
        labels = ("dp", self.rollout, self.device_id, self._round, self._step)
        noised = self.noise.add(delta, sigma, *labels, secure=plan.secure_noise)
        count = None
        if plan.adaptive is not None:  # the bit, centred and noised: released with the update, charged with it
            stddev = plan.count_stddev(z, DEVICE_COUNT_SENSITIVITY)
            value = self.noise.add({"count": np.array([float(fits) - 0.5])}, stddev, "dp-count", *labels[1:],
                                   secure=plan.secure_noise)["count"]
            count = (float(value[0]), stddev)
        release = audit.release_record(plan=plan, node=self.device_id, event="device", round=self._round,
                                       step=self._step, sigma=sigma, sensitivity=plan.device_sensitivity,
                                       protected=[self.device_id], z=z, count=count)
        return noised, release, 0.0


class _EdgeBase(EdgeRoleBase):
    """Round, step and membership bookkeeping shared by the edge roles.

    With ``STREAMS``, ``_accept`` hands each upload's tensors to the step's ``strategies.Collector`` as
    it arrives (folded into a running sum for the mean, the norm-bounded mean and the secret-sampling
    sum; kept as float32 rows for the rules that need them all) and keeps the message without them;
    ``_average`` combines what was collected. A restarted edge replays its stored inputs, which
    folds them again in the order they were accepted.
    """

    TRANSITIONS: ClassVar[Transitions] = EDGE_TRANSITIONS
    CONFIG: ClassVar[type[Any]] = HierConfig
    SUPPORTS_PRIVACY: ClassVar[bool] = True
    STREAMS: ClassVar[bool] = False
    """``_accept`` collects uploads' tensors as they arrive (see above); without it every upload is kept
    whole until the step closes (FeDXL's edge, which reads other fields of them too)."""
    EDGE_OPTIMIZER_REFUSAL: ClassVar[str | None] = None
    """Why this edge refuses a task's ``strategy["edge_optimizer"]``; ``None``: it runs one (HIST's edge refuses)."""
    CLOSES_ON_FAILURE: ClassVar[bool] = True
    """A ``training_failed`` of the last member the step waits for closes it (``False``: the phase deadlines of
    secure aggregation decide, which count such a member as a dropout)."""

    def __init__(self, *, cell: str, rollout: str, parent: str = "cloud", noise: NoiseSource | None = None) -> None:
        self.noise = noise if noise is not None else NoiseSource()
        self._plan: NoisePlan | None = None
        self._step_reporters: list[list[str]] = []
        self._releases: list[dict[str, Any]] = []
        self.cell = cell
        self.rollout = rollout
        self.parent = parent
        self._state = RoleState.IDLE
        self._task: CellTask | None = None
        self._config: Any = None
        self._params: dict[str, np.ndarray] = {}
        self._step = 0
        self._deadline = math.inf
        self._updates: dict[str, Any] = {}
        self._inputs: strategies.Collector | None = None
        """The open step's collected tensors (``STREAMS``); created by its first upload."""
        self._seen: set[str] = set()
        self._failed: dict[str, str] = {}
        """Members that reported ``training_failed`` in the open round, and why: out of the round (not waited for,
        not sent its task again)."""
        self._members: tuple[str, ...] = ()  # the cloud's members of the round (the sample is a subset)
        self._aggregator: strategies.Aggregator = strategies.Mean()
        self._edge_optimizer: ServerOptimizer | None = None
        """``strategy["edge_optimizer"]``: a server optimizer on the cell's change, its state kept across
        rounds in this role; the edge node stores ``strategy_state()`` with each cell update and a restarted
        edge hands it back (``load_strategy_state``) before it replays the open round."""
        self._saved_optimizer: dict[str, np.ndarray] | None = None

    @property
    def round(self) -> int:
        return self._task.round if self._task is not None else -1

    @property
    def step(self) -> int:
        return self._step

    @property
    def members(self) -> tuple[str, ...]:
        return self._task.members if self._task is not None else ()

    @property
    def reported(self) -> tuple[str, ...]:
        """Devices that reported in the current step."""
        return tuple(sorted(self._updates))

    def strategy_state(self) -> dict[str, np.ndarray] | None:
        """The edge optimizer's state after the last forwarded round, with its rule as JSON bytes under
        ``"spec"`` (``None``: no edge optimizer). Plain arrays, for the edge's store."""
        if self._edge_optimizer is None:
            return None
        spec = json.dumps(self._edge_optimizer.spec.to_dict(), sort_keys=True).encode()
        return {**self._edge_optimizer.state(), "spec": np.frombuffer(spec, dtype=np.uint8)}

    def load_strategy_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Continue from ``strategy_state()`` as it was stored (after a restart, before the open round's task is
        replayed): applied when that task sets up an edge optimizer with the same rule, ignored otherwise."""
        self._saved_optimizer = dict(state)

    def _restore_optimizer(self) -> None:
        saved, self._saved_optimizer = self._saved_optimizer, None
        if saved is None or self._edge_optimizer is None or "spec" not in saved:
            return
        if json.loads(np.asarray(saved["spec"], dtype=np.uint8).tobytes()) == self._edge_optimizer.spec.to_dict():
            self._edge_optimizer.load_state(saved)

    def _device_task(self) -> DeviceTask:
        assert self._task is not None
        return DeviceTask(rollout=self.rollout, round=self._task.round, sender=self.cell, step=self._step,
                          params=self._params, config=self._task.config, members=self._task.members)

    def _on_task(self, task: CellTask, now: float) -> list[Action]:
        if task.sender != self.parent:
            raise UnknownSenderError(f"cell task from {task.sender!r}, expected {self.parent!r}")
        if task.round == self.round:
            return [Dropped("duplicate", task.key)]
        if task.round < self.round:
            raise WrongRoundError(f"task for round {task.round}, cell is at round {self.round}")
        config = self.CONFIG.from_dict(task.config)
        plan = _noise_plan(config, self.cell, self.SUPPORTS_PRIVACY)
        self._aggregator = _edge_aggregator(config)
        opt = (config.strategy or {}).get("edge_optimizer")
        if opt is not None and self.EDGE_OPTIMIZER_REFUSAL is not None:
            raise UnexpectedMessageError(self.EDGE_OPTIMIZER_REFUSAL)
        if opt is None:
            self._edge_optimizer = None
        elif self._edge_optimizer is None or self._edge_optimizer.spec != OptimizerSpec.from_dict(opt):
            self._edge_optimizer = ServerOptimizer(OptimizerSpec.from_dict(opt))
        self._restore_optimizer()
        notes: list[Action] = []
        if self._state is RoleState.COLLECTING:
            notes.append(Note("round_abandoned", {"round": self.round, "step": self._step}))
        self._members = tuple(task.members)
        if plan is not None and plan.sampled and plan.cells[self.cell].clear_to_edge:
            # Device sampling: this trusted edge draws its round's sample in secret (its CSPRNG-seeded
            # source, never the cloud's); the task its devices see names only the sampled ones.
            task = dataclasses.replace(task, members=self._draw_sample(plan, task))
        self._task, self._config, self._plan = task, config, plan
        self._step_reporters, self._releases = [], []
        self._params = aggregate.copy_tensors(task.params)
        self._step = 0
        self._seen = set()
        self._failed = {}
        self._begin_step(now, "task")
        self._start(config)
        if not task.members:  # nobody sampled: the release is noise alone, so the cloud cannot tell
            return [*notes, *self._close(now)]
        return [*notes, Broadcast(self._device_task())]

    @property
    def noise_plan(self) -> NoisePlan | None:
        """The open round's noise plan (``None`` without differential privacy)."""
        return self._plan

    @property
    def sampling_secretly(self) -> bool:
        """This edge samples its members in secret and releases a fixed-denominator sum (docs/privacy.md)."""
        plan = self._plan
        return plan is not None and plan.sampled and plan.cells[self.cell].clear_to_edge

    def _draw_sample(self, plan: NoisePlan, task: CellTask) -> tuple[str, ...]:
        """Poisson (each member with probability q) or fixed-size (round(q n) of n) from a secret stream."""
        members = sorted(task.members)
        rng = self.noise.generator("sample", self.rollout, self.cell, task.round)
        if plan.sampling == "fixed":
            size = fixed_sample_size(len(members), plan.sample_rate)
            return tuple(sorted(members[int(i)] for i in rng.choice(len(members), size, replace=False)))
        return tuple(m for m, u in zip(members, rng.random(len(members)), strict=True) if u < plan.sample_rate)

    def _start(self, config: Any) -> None:
        """Algorithm-specific state at the start of a round."""

    def _begin_step(self, now: float, event: str) -> None:
        """Collect a step: the round's first (``event`` "task") or the next one ("next_step")."""
        self._updates = {}
        self._inputs = None
        self._deadline = now + self._config.deadline_s
        self._transition(event)

    def _admit(self, msg: Message, expected_step: int) -> list[Action] | None:
        """Common checks for a device upload; ``None`` means accept it, a list is the drop."""
        if self._task is None:
            raise WrongRoundError(f"{msg.KIND} for round {msg.round} but no round is open")
        if msg.key in self._seen:
            return [Dropped("duplicate", msg.key)]
        if msg.round < self._task.round:
            raise LateMessageError(f"{msg.KIND} for round {msg.round}; cell is at round {self._task.round}")
        if msg.round > self._task.round:
            raise WrongRoundError(f"{msg.KIND} for future round {msg.round}; cell is at {self._task.round}")
        if msg.sender not in self._task.members:
            raise UnknownSenderError(f"{msg.sender!r} is not a member of round {msg.round}")
        if self._state is not RoleState.COLLECTING or msg.step < expected_step:
            raise LateMessageError(f"{msg.KIND} for step {msg.step}; cell is at step {self._step} "
                                   f"({self._state.value})")
        if msg.step > expected_step:
            raise WrongRoundError(f"{msg.KIND} for step {msg.step}; cell is at step {expected_step}")
        return None

    def _accept(self, msg: Any, tensors: Mapping[str, np.ndarray]) -> bool:
        """Store an admitted upload; True when every member of the step has reported."""
        assert self._task is not None
        check_like(self._params, tensors, f"{msg.KIND} from {msg.sender}")
        plan = self._plan
        if plan is not None and isinstance(msg, DeviceUpdate):
            if plan.cells[self.cell].trusted:
                # Enforce the bound the edge's sensitivity rests on (quantization may have grown the norm).
                msg = dataclasses.replace(msg, delta=clip(msg.delta, plan.clip)[0])
            else:
                audit.check_device_release(plan, self.cell, msg.sender, msg.round, msg.step, msg.release)
        if self.STREAMS:
            msg = self._collect(msg)
        self._updates[msg.sender] = msg
        self._seen.add(msg.key)
        return self._step_complete()

    def _step_complete(self) -> bool:
        """Every member of the step reported, or reported that it failed (it will not come)."""
        assert self._task is not None
        return all(m in self._updates or m in self._failed for m in self._task.members)

    def _on_failed(self, msg: TrainingFailed, now: float) -> list[Action]:
        """A member could not compute its work (``TrainingFailed``): it is out of the round; the step closes
        without it once every other member reported (never with no upload at all: that waits for a quorum)."""
        if self._task is None:
            raise WrongRoundError(f"{msg.KIND} for round {msg.round} but no round is open")
        if msg.key in self._seen:
            return [Dropped("duplicate", msg.key)]
        if msg.round < self._task.round:
            raise LateMessageError(f"{msg.KIND} for round {msg.round}; cell is at round {self._task.round}")
        if msg.round > self._task.round or msg.step > self._step:
            raise WrongRoundError(f"{msg.KIND} for round {msg.round} step {msg.step}; cell is at step {self._step} "
                                  f"of round {self._task.round}")
        if msg.sender not in self._task.members:
            raise UnknownSenderError(f"{msg.sender!r} is not a member of round {msg.round}")
        if self._state is not RoleState.COLLECTING:
            raise LateMessageError(f"{msg.KIND} after the cell's round closed ({self._state.value})")
        self._seen.add(msg.key)
        self._failed[msg.sender] = msg.reason
        if self.CLOSES_ON_FAILURE and self._updates and self._step_complete():
            return self._close(now)
        return []

    def _collect(self, msg: Any) -> Any:
        """Hand the upload's tensors to the step's collector; the message without them, to keep."""
        assert self._task is not None
        field = msg.TENSOR_FIELD
        if self._inputs is None:
            rule = self._aggregator if field == "delta" and not self.sampling_secretly else strategies.Mean()
            self._inputs = strategies.Collector(rule, self._params, len(self._task.members))
        uniform = self._config.weighting == "uniform" or self.sampling_secretly
        self._inputs.add(msg.sender, getattr(msg, field), 1.0 if uniform else float(msg.num_samples))
        return dataclasses.replace(msg, **{field: {}})

    def _average(self, tensor_field: str) -> tuple[dict[str, np.ndarray], list[str], list[float]]:
        """The step's combined upload: model changes (``delta``) by the task's edge aggregator
        (``fedtier.algorithms.strategies``; the weighted mean unless configured), anything else
        (QHetFed's gradients) by the weighted mean."""
        ids = sorted(self._updates)
        if self.sampling_secretly:
            # The sampled devices' sum over the public, fixed denominator (q n, or round(q n)): dividing by
            # how many were sampled would let the release's scale reveal it (docs/privacy.md).
            assert self._plan is not None
            denominator = self._plan.edge_denominator(self.cell)
            if self._inputs is not None:  # summed in float64 as the uploads arrived
                return ({n: (t / denominator).astype(np.float32) for n, t in self._inputs.sums().items()},
                        ids, [1.0] * len(ids))
            total = {n: np.zeros_like(np.asarray(t, dtype=np.float32)) for n, t in self._params.items()}
            for d in ids:
                total = aggregate.add(total, getattr(self._updates[d], tensor_field))
            return ({n: (np.asarray(t, dtype=np.float64) / denominator).astype(np.float32)
                     for n, t in total.items()}, ids, [1.0] * len(ids))
        weights = device_weights(self._config.weighting, {d: self._updates[d].num_samples for d in ids}, ids)
        if self._inputs is not None:
            try:
                return self._inputs.combine(ids, weights), ids, weights
            except strategies.StrategyError as exc:
                raise LocalProtocolError(f"edge aggregator: {exc}") from None
        tensors = [getattr(self._updates[d], tensor_field) for d in ids]
        if tensor_field == "delta":
            try:
                return strategies.run(self._aggregator, tensors, weights), ids, weights
            except strategies.StrategyError as exc:
                # A custom rule that returns garbage is the node's own code failing: refuse loudly.
                raise LocalProtocolError(f"edge aggregator: {exc}") from None
        mean = aggregate.weighted_mean(list(zip(tensors, weights, strict=True)))
        return mean, ids, weights

    def _forward(self, delta: Mapping[str, np.ndarray], ids: list[str], weights: list[float],
                 mean_loss: float, device_q: float) -> list[Action]:
        """Quantize the cell's change with Q2 and send it to the cloud; the round is done here."""
        assert self._task is not None
        c = self._config
        if self._edge_optimizer is not None:
            # The cell's change as a pseudo-gradient (Reddi et al., Algorithm 2, one tier down).
            start = self._task.params
            delta = aggregate.subtract(self._edge_optimizer.step(start, delta), start)
        delta, privacy = self._privatize(delta)
        stats: dict[str, Any] = {"device_q": device_q}
        if privacy is not None:
            # Nothing computed from clear data leaves a trusted cell unless it passed the mechanism
            # (fedtier.privacy.disclosure): the loss is data-dependent and never noised; the devices' q
            # is measured on noised uploads under an untrusted cell (post-processing), on clear ones here.
            mean_loss = 0.0
            if privacy["trusted"]:
                stats = {}
        values, encodings, q2 = quantize(delta, c.bits_edge, c.seed, "q2", self.rollout, self.cell,
                                         self._task.round)
        evaluation, evaluations = self._evaluations(ids)
        stats.update(evaluations)
        weight, reported = float(sum(weights)), tuple(ids)
        if self.sampling_secretly:  # participation stays inside the cell (disclosure.SAMPLED)
            weight, reported = float(len(self._members)), tuple(sorted(self._members))
        update = CellUpdate(rollout=self.rollout, round=self._task.round, sender=self.cell, delta=values,
                            weight=weight, reported=reported, mean_loss=mean_loss, q=q2,
                            stats=stats, privacy=privacy, evaluation=evaluation)
        self._transition("forward")
        actions: list[Action] = [SendToParent(update, encodings)]
        missing = sorted(set(self._task.members) - set(ids))
        if missing and not self.sampling_secretly:
            actions.insert(0, Note("cell_closed_with_stragglers", {"round": self._task.round, "missing": missing}))
        return actions

    def _evaluations(self, ids: list[str]) -> tuple[EvalStats | None, dict[str, Any]]:
        """The reporting devices' federated evaluations: combined (weighted by held-out rows), and each device's
        own as the cell update's ``stats["evaluations"]`` (``{device: [count, loss, correct, auroc]}``,
        ``EvalStats.to_row``), so the cloud sees how every device does, not just the mean. Neither under a noise
        plan: held-out statistics are data-dependent releases the plan does not cover (devices do not send them
        then either; ``fedtier.privacy.disclosure``); nor, a fortiori, under secret device sampling, where a
        device's own row would name it as sampled (participation stays in the cell)."""
        if self._plan is not None or self.sampling_secretly:
            return None, {}
        own = {d: e for d in ids if (e := getattr(self._updates[d], "evaluation", None)) is not None}
        combined = aggregate.combine_evaluations(list(own.values()))
        return combined, ({"evaluations": {d: e.to_row() for d, e in own.items()}} if own else {})

    def _record_step(self, ids: list[str]) -> None:
        """Privacy bookkeeping of a closed edge round: who reported, and their release records."""
        if self._plan is None:
            return
        self._step_reporters.append(list(ids))
        if not self._plan.cells[self.cell].trusted:
            self._releases.extend(dict(self._updates[d].release) for d in ids)

    def _privatize(self, delta: Mapping[str, np.ndarray]) -> tuple[Mapping[str, np.ndarray], dict[str, Any] | None]:
        """A trusted edge adds fresh noise to the cell's change; an untrusted one passes its devices' records."""
        plan = self._plan
        if plan is None:
            return delta, None
        assert self._task is not None
        steps = self._step_reporters
        report: dict[str, Any] = {"trusted": plan.cells[self.cell].trusted, "steps": steps, "releases": self._releases,
                                  "clear": []}
        if not plan.cells[self.cell].trusted:
            return delta, report
        if plan.sampled:
            everyone = sorted(self._members)
            sigma = plan.edge_sigma(self.cell)
            noised = self.noise.add(delta, sigma, "dp", self.rollout, self.cell, self._task.round,
                                    secure=plan.secure_noise)
            report.update(steps=[everyone], clear=[], releases=[audit.release_record(
                plan=plan, node=self.cell, event="edge", round=self._task.round, step=0, sigma=sigma,
                sensitivity=plan.edge_sensitivity(len(everyone)), z=plan.edge_charged_z(self.cell),
                calibrated_sensitivity=plan.calibrated_edge_sensitivity(len(everyone)), protected=everyone,
                reporters=len(everyone), count=self._clipped_count(plan))])
            return noised, report
        reporters = min(len(s) for s in steps)
        sigma = plan.edge_sigma(self.cell, reporters)
        noised = self.noise.add(delta, sigma, "dp", self.rollout, self.cell, self._task.round,
                                secure=plan.secure_noise)
        protected = sorted({d for s in steps for d in s})
        # Charged against the sound sensitivity, whatever sigma was calibrated against (paper mode: 2C/n).
        report["releases"] = [audit.release_record(plan=plan, node=self.cell, event="edge", round=self._task.round,
                                                   step=0, sigma=sigma, sensitivity=plan.edge_sensitivity(reporters),
                                                   z=plan.edge_charged_z(self.cell, reporters),
                                                   calibrated_sensitivity=plan.calibrated_edge_sensitivity(reporters),
                                                   protected=protected, reporters=reporters)]
        report["clear"] = [{"sender": d, "receiver": self.cell, "step": i} for i, s in enumerate(steps) for d in s]
        return noised, report

    def _clipped_count(self, plan: NoisePlan) -> tuple[float, float] | None:
        """Adaptive clipping at a sampling trusted edge: ``sum (b_i - 1/2)`` over the sampled devices that
        reported, plus fresh noise (sensitivity 1/2 under add/remove), and that noise's std."""
        if plan.adaptive is None or self._task is None:
            return None
        stddev = plan.count_stddev(plan.edge_charged_z(self.cell), EDGE_COUNT_SENSITIVITY)
        # a device that sent no bit counts as neither (0): the count stays centred
        centred = sum(float(u.unclipped) - 0.5 for u in self._updates.values()
                      if getattr(u, "unclipped", None) is not None)
        value = self.noise.add({"count": np.array([centred])}, stddev, "dp-count", self.rollout, self.cell,
                               self._task.round, secure=plan.secure_noise)["count"]
        return float(value[0]), stddev

    def _next_step(self, now: float) -> None:
        self._step += 1
        self._begin_step(now, "next_step")

    def tick(self, now: float) -> list[Action]:
        if self._state is not RoleState.COLLECTING or self._task is None or now < self._deadline:
            return []
        if self._updates and len(self._updates) >= quorum_count(self._config.quorum, len(self._task.members)):
            return self._close(now)
        return []

    def _close(self, now: float) -> list[Action]:
        raise NotImplementedError

    def overdue(self, now: float) -> tuple[str, ...]:
        """The members the open step still waits for once its deadline has passed (else empty)."""
        if self._state is not RoleState.COLLECTING or self._task is None or now < self._deadline:
            return ()
        return tuple(sorted(set(self._task.members) - set(self._updates) - set(self._failed)))

    def resend(self, child: str, now: float) -> list[Action]:
        """A member came online owing the current step: give it the set model at this step (not to one that
        reported it failed: it gave the round up)."""
        if (self._state is RoleState.COLLECTING and self._task is not None and child in self._task.members
                and child not in self._updates and child not in self._failed):
            return [SendToChild(child, self._device_task())]
        return []


class Edge(_EdgeBase):
    """Averages its cell's local changes tau times per round, then sends the cell's change up."""

    STREAMS: ClassVar[bool] = True

    def _start(self, config: Any) -> None:
        self._acc = {n: np.zeros_like(p) for n, p in self._params.items()}

    def receive(self, message: Message, now: float) -> list[Action]:
        if isinstance(message, CellTask):
            return self._on_task(message, now)
        if isinstance(message, DeviceUpdate):
            dropped = self._admit(message, self._step)
            if dropped is not None:
                return dropped
            return self._close(now) if self._accept(message, message.delta) else []
        if isinstance(message, TrainingFailed):
            return self._on_failed(message, now)
        raise UnexpectedMessageError(f"edge does not accept {message.KIND}")

    def _close(self, now: float) -> list[Action]:
        assert self._task is not None
        avg, ids, weights = self._average("delta")
        self._record_step(ids)
        # Devices apply ``avg`` with this same operation, so the set model stays bit-identical.
        self._params = aggregate.add(self._params, avg)
        self._acc = aggregate.add(self._acc, avg)
        step = self._step
        if step + 1 < self._config.edge_rounds:
            msg = CellStep(rollout=self.rollout, round=self._task.round, sender=self.cell, step=step, tensors_=avg,
                           kind="delta", model_sha=digest(self._params), reported=tuple(ids))
            self._next_step(now)
            return [Broadcast(msg)]
        mean_loss = sum(self._updates[d].train_loss for d in ids) / len(ids) if ids else 0.0
        device_q = sum(self._updates[d].q for d in ids) / len(ids) if ids else 0.0
        return self._forward(self._acc, ids, weights, mean_loss, device_q)

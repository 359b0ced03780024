"""Hierarchical FedBuff: buffered asynchronous aggregation in every tier.

Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek, Huba: "Federated Learning with Buffered
Asynchronous Aggregation" (AISTATS 2022), Algorithm 1, arranged in two tiers as Papaya does its
aggregators (Huba et al., "Papaya: Practical, Private, and Scalable Federated Learning", MLSys
2022). No round waits for anybody: a device that is online trains whenever it holds a model, and
every tier aggregates as soon as it has buffered enough.

Theory of operation
-------------------
Model versions ``v = 0, 1, 2, ...`` replace rounds. The wire messages are the synchronous ones,
read as follows (``round`` is a version or a sequence number, never a round):

1. cloud -> edge ``CellTask(round=v, params=w_v, model_version=v)``: at start and after every new
   version, to every cell. The edge keeps only the newest (an older one is ``Dropped("superseded")``).
2. edge -> device ``DeviceTask(round=v, params=w_v)``: when the device comes online (``resend``) and
   after each of its uploads, so a device online keeps training on the newest model its edge holds; a new
   version goes to every member not training (at the start: all of them). With
   ``once_per_version`` a device trains from each version once: after its upload it gets no task until a
   new version arrives.
3. device: ``local_steps`` SGD steps from ``w_v``; ``DeviceUpdate(round=v, step=j, delta)`` where
   ``v`` is the version it started from and ``j`` its own upload counter: ``(device, j)`` is the
   device-step id, the update's idempotency key (a repeat is ``Dropped("duplicate")``).
4. edge: a delta whose staleness ``v_edge - v`` exceeds ``max_staleness`` is ``Dropped("stale")``;
   the others are folded as they arrive (``aggregate.RunningMean``, weight 1 or the sample count).
   Every ``k_edge`` deltas — or ``edge_timeout_s`` after the first of a partial buffer — the edge sends
   ``CellUpdate(round=u, delta=mean, weight=sum of weights, stats={"base_version": min v, "deltas": n})``,
   ``u`` the cell's update counter (its idempotency key). The oldest start version is the base, so no
   delta inside an update is staler than the cloud charges it.
5. cloud: a cell update with staleness ``s = v_cloud - base_version > max_staleness`` is
   ``Dropped("stale")`` (counted by reason in ``rejected``); the others are folded with weight ``W_c``
   and scale ``alpha(s)`` (``staleness_weight``: ``(1 + s)^-a``, ``a = staleness_exponent``, 0.5 by
   default, i.e. ``1/sqrt(1 + s)``; or ``constant``). After ``k_cloud`` of them,
   ``Delta = sum_c W_c alpha(s_c) delta_c / sum_c W_c`` is the pseudo-gradient of the server optimizer
   (``strategy["server_optimizer"]``, ``server_opt``; ``w + Delta`` without one): version ``v + 1``,
   a ``RoundClosed(round=v)``, and step 1 again. ``rounds`` versions end the rollout (``Finished``).

Roaming (``[topology] roaming = true``, ``FedBuffConfig.roaming``): a device may contribute through any cell of
the rollout, wherever it is connected now.

* cloud: every cell task carries the rollout's devices (``config["roster"]``, in the cell task only: an edge
  leaves it out of its device tasks), so an edge knows whom it may accept beyond its own members.
* edge: accepts ``DeviceUpdate`` and ``TrainingFailed`` from any device of the roster; a device of another cell
  that comes online here (``resend``) is a visitor: it gets the newest model, and each new version like the
  members. It cannot know what a device that comes online did elsewhere (it may have trained this version in
  another cell), so a task sent on ``resend`` does not count as held: the next version goes to it whatever.
  Its cell updates list the device-step ids folded in them: ``stats["steps"] = [[device, j], ...]``.
* device: takes tasks from ``cell``, the cell it is connected to now (a shell that moves it sets it); its
  device-step counter ``j`` is its own, so ``(device, j)`` stays one id across cells.
* cloud: counts every device-step once across cells (``_steps``, carried in ``strategy_state`` under
  ``step/<device>``, so a restart keeps it). A cell update that repeats a device-step counted already is
  ``Dropped("duplicate_step")`` (counted by reason in ``rejected``; the detail names the device-steps) and never
  folded: the deltas of new device-steps in it are lost with it, since a mean cannot be taken apart. It takes a
  device that moved while its upload was in flight (the old cell's broker had it, the agent had no
  acknowledgement yet, so it sent it again from its new cell); the agent sends again what its broker did not
  acknowledge, and never re-sends to a new cell an upload the old one acknowledged.

Determinism: each tier folds in arrival order, so the model depends on the order in which updates
arrive; the simulator fixes it with its event order (virtual time, then sequence).

Differential privacy (``fedtier.privacy``): as in ``hier_qsgd``, every device upload is clipped to
``C``, and noised by the device under an untrusted edge (a release record per upload); a trusted edge
adds fresh noise to each cell update it sends (one release per cell update, over its ``n`` deltas).
Each release is charged on the ledger as it is made, at full price: nothing is amplified by sampling,
because nobody samples in secret here (who trains is whoever is online); an untrusted edge forwards
the records of the deltas it rejected as stale too (they were released to it). A device makes at most
``release_cap(plan)`` uploads (the releases its noise is calibrated for), so its epsilon stays within
the plan's however many versions the rollout runs. Secure aggregation is refused
(``SUPPORTS_SECURE_AGGREGATION``): SecAgg+ needs a cohort that agrees keys before it trains, and a
buffer of deltas from devices that started at different versions has none.

Transitions: ``DEVICE_TRANSITIONS``, ``EDGE_TRANSITIONS``, ``CLOUD_TRANSITIONS`` below.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

from fedtier.algorithms import aggregate
from fedtier.algorithms.base import (
    Action,
    DeviceRoleBase,
    Dropped,
    EdgeRoleBase,
    Finished,
    LocalResult,
    LocalTrain,
    Note,
    RoleState,
    RoundClosed,
    SendToChild,
    SendToParent,
    StateGuard,
    Transitions,
)
from fedtier.algorithms.common import RoundSettings, check_int, check_like, device_weights
from fedtier.algorithms.server_opt import OptimizerSpec, ServerOptimizer
from fedtier.errors import LocalProtocolError, UnexpectedMessageError, UnknownSenderError, WrongRoundError
from fedtier.privacy import audit
from fedtier.privacy.mechanism import NoiseSource, clip
from fedtier.privacy.plan import NoisePlan
from fedtier.wire.messages import CellTask, CellUpdate, DeviceTask, DeviceUpdate, Message, TrainingFailed

NAME = "fedbuff"

__all__ = ["FedBuffConfig", "Device", "Edge", "Cloud", "NAME", "staleness_weight"]

STALENESS_WEIGHTS = ("polynomial", "constant")
SEEN_PREFIX = "seen/"
STEP_PREFIX = "step/"
ROSTER = "roster"
"""The cell task's ``config`` key listing the rollout's devices under roaming (an edge's device tasks omit it)."""
COUNTED = "counted"
"""The cell task's ``config`` key saying which of the cell's updates the cloud has counted: every counter ``u``
below it (left out while it is 0; an edge's device tasks omit it). The edge then forgets those outputs: it never
has to send them again (``Note("cell_updates_counted")``)."""
CELL_TASK_ONLY = (ROSTER, COUNTED)
EDGE_STATE = "edge/state"
"""``Edge.strategy_state``'s one array: the edge's state between two cell updates, as UTF-8 JSON bytes."""

DEVICE_TRANSITIONS: Transitions = {
    RoleState.IDLE: {"task": RoleState.TRAINING},
    RoleState.TRAINING: {"trained": RoleState.IDLE, "failed": RoleState.IDLE},
}
EDGE_TRANSITIONS: Transitions = {
    RoleState.IDLE: {"task": RoleState.COLLECTING},
    RoleState.COLLECTING: {"task": RoleState.COLLECTING, "finish": RoleState.FORWARDED},
    RoleState.FORWARDED: {"task": RoleState.COLLECTING},
}
CLOUD_TRANSITIONS: Transitions = {
    RoleState.IDLE: {"start": RoleState.COLLECTING},
    RoleState.COLLECTING: {"finish": RoleState.FINISHED},
}


@dataclass(frozen=True, slots=True)
class FedBuffConfig(RoundSettings):
    """Per-rollout settings (``RoundSettings`` plus; ``quorum`` and ``deadline_s`` are unused):

    Attributes:
        local_steps: SGD steps per local training (> 0).
        k_edge: deltas an edge folds into one cell update (FedBuff's K, first tier).
        edge_timeout_s: an edge sends a partial buffer this long after its first delta (0: never).
        k_cloud: cell updates the cloud folds into one new version (K, second tier).
        max_staleness: versions a delta (edge) or cell update (cloud) may lag; older ones are rejected.
        staleness_weight: ``polynomial`` (``(1 + s)^-staleness_exponent``) or ``constant`` (1).
        staleness_exponent: ``a`` of the polynomial weight (0.5: ``1/sqrt(1 + s)``, the paper's choice).
        once_per_version: a device trains from each model version at most once and then waits for the next
            one (FedBuff's devices train again at once, from the version they have). With ``k_edge`` the cell's
            size and ``k_cloud`` the number of cells, every version then averages every device once, whatever
            order the deltas arrive in: the simulator and a rollout over MQTT end with the same model.
        roaming: a device may contribute through any cell of the rollout (see the module docstring); the cloud
            then counts each device-step once across cells.
    """

    ALGORITHM: ClassVar[str] = NAME

    local_steps: int = 10
    k_edge: int = 4
    edge_timeout_s: float = 0.0
    k_cloud: int = 2
    max_staleness: int = 20
    staleness_weight: str = "polynomial"
    staleness_exponent: float = 0.5
    once_per_version: bool = False
    roaming: bool = False

    def __post_init__(self) -> None:
        RoundSettings.__post_init__(self)
        check_int(self.local_steps, "local_steps", 1)
        check_int(self.k_edge, "k_edge", 1)
        check_int(self.k_cloud, "k_cloud", 1)
        check_int(self.max_staleness, "max_staleness", 0)
        if not (isinstance(self.edge_timeout_s, (int, float)) and math.isfinite(self.edge_timeout_s)
                and self.edge_timeout_s >= 0):
            raise LocalProtocolError(f"edge_timeout_s must be finite and >= 0, got {self.edge_timeout_s!r}")
        if self.staleness_weight not in STALENESS_WEIGHTS:
            raise LocalProtocolError(f"staleness_weight must be one of {STALENESS_WEIGHTS}, "
                                     f"got {self.staleness_weight!r}")
        if not (math.isfinite(self.staleness_exponent) and self.staleness_exponent >= 0):
            raise LocalProtocolError(f"staleness_exponent must be finite and >= 0, got {self.staleness_exponent!r}")
        if self.bits_device or self.bits_edge:
            raise LocalProtocolError("fedbuff sends float32 (bits_device = bits_edge = 0)")
        if not isinstance(self.roaming, bool):
            raise LocalProtocolError(f"roaming must be a bool, got {self.roaming!r}")


def staleness_weight(config: FedBuffConfig, staleness: int) -> float:
    """``alpha(s)``: ``(1 + s)^-a`` (``polynomial``) or 1 (``constant``)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if config.staleness_weight == "constant":
        return 1.0
    return float((1.0 + staleness) ** -config.staleness_exponent)


def release_cap(plan: NoisePlan) -> int:
    """How many uploads a device may make under ``plan``: the releases its noise is calibrated for
    (``device_release_cap``, else the plan's ``rounds``). Each upload is at most one release charged to the device
    (its own under an untrusted edge; its share of one trusted cell update otherwise), so the cap bounds its epsilon
    by the plan's whatever the number of model versions."""
    return plan.device_release_cap or plan.rounds


def _plan(config: FedBuffConfig, cell: str) -> NoisePlan | None:
    plan = config.noise_plan()
    if plan is not None and cell not in plan.cells:
        raise UnexpectedMessageError(f"task's noise plan does not cover cell {cell!r}")
    return plan


# --- device -------------------------------------------------------------------------------------


class Device(DeviceRoleBase):
    """Trains from the newest model its edge gave it; uploads the delta tagged with the start version."""

    TRANSITIONS: ClassVar[Transitions] = DEVICE_TRANSITIONS
    SUPPORTS_PRIVACY: ClassVar[bool] = True

    def __init__(self, *, device_id: str, cell: str, rollout: str, last_round: int = -1,
                 last_sent: tuple[int, int] | None = None, noise: NoiseSource | None = None,
                 evaluate: bool = False) -> None:
        """
        Args:
            device_id, cell, rollout: who this is, whose tasks it takes (the cell it is connected to now: a
                shell that moves the device sets ``cell``), for which rollout.
            last_round: the newest version it trained from (after a restart).
            last_sent: ``(version, j)`` of its newest upload before a restart: the next upload is ``j + 1``, so
                the device-step id is never reused (a reused one would be a second release the ledger ignores).
            noise: differential-privacy noise (default OS-seeded).
            evaluate: unused (no federated evaluation of an asynchronous model).
        """
        self.device_id, self.cell, self.rollout = device_id, cell, rollout
        self.noise = noise if noise is not None else NoiseSource()
        self.last_round = last_round
        self._seq = 0 if last_sent is None else last_sent[1] + 1
        self._version = last_round
        self._params: dict[str, np.ndarray] = {}
        self._config: FedBuffConfig | None = None
        self._plan: NoisePlan | None = None
        self._state = RoleState.IDLE

    @property
    def position(self) -> tuple[int, int]:
        return self._version, self._seq

    def receive(self, message: Message, now: float) -> list[Action]:
        if not isinstance(message, DeviceTask):
            raise UnexpectedMessageError(f"fedbuff device does not accept {message.KIND}")
        if message.sender != self.cell:
            raise UnknownSenderError(f"task from {message.sender!r}, expected cell {self.cell!r}")
        if self._state is RoleState.TRAINING:
            return [Dropped("busy", message.key, f"training from version {self._version}")]
        config = FedBuffConfig.from_dict(message.config)
        if config.once_per_version and message.round <= self.last_round:
            return [Dropped("trained", message.key, f"trained from version {self.last_round} already")]
        plan = _plan(config, self.cell)
        if plan is not None and self._seq >= release_cap(plan):
            # The noise was calibrated for this many releases of this device: it contributes no more.
            return [Dropped("release_budget", message.key, f"{self._seq} releases made, the plan pays for "
                                                           f"{release_cap(plan)}")]
        self._plan = plan
        self._config = config
        self._version = message.round
        self._params = aggregate.copy_tensors(message.params)
        self._transition("task")
        return [LocalTrain(round=message.round, step=self._seq, params=self._params, steps=config.local_steps,
                           batch_size=config.batch_size, lr=config.lr,
                           stream=(config.seed, "batches", self.rollout, self.device_id, NAME, self._seq))]

    def trained(self, round: int, result: LocalResult) -> list[Action]:
        if round != self._version:
            raise LocalProtocolError(f"trained() for version {round}, device trains from {self._version}")
        self._transition("trained")
        check_like(self._params, result.delta, "local result")
        delta, release, loss = self._privatize(result)
        update = DeviceUpdate(rollout=self.rollout, round=self._version, sender=self.device_id, step=self._seq,
                              delta={n: np.asarray(t, dtype=np.float32) for n, t in delta.items()},
                              num_samples=0 if self._plan is not None else result.num_samples,
                              train_loss=loss, steps=result.steps, release=release)
        self._seq += 1
        self.last_round = max(self.last_round, self._version)
        self._params = {}
        return [SendToParent(update)]

    def _privatize(self, result: LocalResult) -> tuple[Mapping[str, np.ndarray], dict[str, Any] | None, float]:
        """Clip; noise under an untrusted edge, with a release record (the edge forwards it to the ledger)."""
        plan = self._plan
        if plan is None:
            return result.delta, None, result.mean_loss
        delta, _ = clip(result.delta, plan.clip)
        if plan.cells[self.cell].trusted:
            return delta, None, 0.0
        sigma = plan.device_sigma(self.cell)
        noised = self.noise.add(delta, sigma, "dp", self.rollout, self.device_id, self._version, self._seq,
                                secure=plan.secure_noise)
        release = audit.release_record(plan=plan, node=self.device_id, event="device", round=self._version,
                                       step=self._seq, sigma=sigma, sensitivity=plan.device_sensitivity,
                                       protected=[self.device_id], z=plan.cells[self.cell].device_z)
        return noised, release, 0.0

    def failed(self, round: int, step: int, reason: str) -> list[Action]:
        self._transition("failed")
        self._params = {}
        return [SendToParent(TrainingFailed(rollout=self.rollout, round=round, sender=self.device_id, step=step,
                                            reason=reason))]

    def tick(self, now: float) -> list[Action]:
        return []


# --- edge ---------------------------------------------------------------------------------------


class Edge(EdgeRoleBase):
    """Holds the newest model; folds its devices' deltas as they arrive; sends a cell update every ``k_edge``."""

    TRANSITIONS: ClassVar[Transitions] = EDGE_TRANSITIONS
    SUPPORTS_PRIVACY: ClassVar[bool] = True

    def __init__(self, *, cell: str, rollout: str, parent: str = "cloud", noise: NoiseSource | None = None) -> None:
        self.cell, self.rollout, self.parent = cell, rollout, parent
        self.noise = noise if noise is not None else NoiseSource()
        self._state = RoleState.IDLE
        self._task: CellTask | None = None
        self._config: FedBuffConfig | None = None
        self._plan: NoisePlan | None = None
        self._seen: dict[tuple[str, str], CountedSteps] = {}
        """(message kind, device) -> the device's upload counters ``j`` of that kind accepted: its idempotency keys,
        as runs (``CountedSteps``), so what the edge remembers stays small however long the rollout."""
        self._busy: set[str] = set()
        """Devices holding a task they have not answered yet (a device is given one task at a time)."""
        self._trained_from: dict[str, int] = {}
        """Device -> the newest version it uploaded a delta from (``once_per_version``: no second task of it)."""
        self._seq = 0
        self._roster: frozenset[str] = frozenset()
        """Roaming: the rollout's devices (the cell task's ``roster``), whom this edge accepts besides its members."""
        self._device_config: Mapping[str, Any] = {}
        """The cell task's config without the roster: what each device task carries."""
        self._visitors: dict[str, None] = {}
        """Roaming: devices of other cells seen here (came online, or uploaded), in order; new versions go to them."""
        self._reset_buffer()
        self.rejected: dict[str, int] = {}
        """Deltas rejected, by reason (``stale``)."""

    def _reset_buffer(self) -> None:
        self._buffer = aggregate.RunningMean()
        self._buffer_since: float | None = None
        self._bases: list[int] = []
        self._reporters: list[str] = []
        self._steps: list[list[Any]] = []
        self._weights: list[float] = []
        self._losses: list[float] = []
        self._releases: list[dict[str, Any]] = []

    @property
    def round(self) -> int:
        return self._task.round if self._task is not None else -1

    @property
    def step(self) -> int:
        return self._seq

    @property
    def members(self) -> tuple[str, ...]:
        return self._task.members if self._task is not None else ()

    @property
    def reported(self) -> tuple[str, ...]:
        return tuple(self._reporters)

    @property
    def noise_plan(self) -> NoisePlan | None:
        return self._plan

    def receive(self, message: Message, now: float) -> list[Action]:
        if isinstance(message, CellTask):
            return self._new_version(message)
        seen = self._seen.get((message.KIND, message.sender))
        if seen is not None and message.step in seen:
            return [Dropped("duplicate", message.key)]
        if self._task is None or not self._accepts(message.sender):
            raise UnknownSenderError(f"{message.KIND} from {message.sender!r}, not a member of {self.cell!r}"
                                     + (" nor a device of the rollout" if self.roaming else ""))
        if isinstance(message, TrainingFailed):
            self._mark_seen(message)
            self._busy.discard(message.sender)
            return [Note("training_failed", {"device": message.sender, "reason": message.reason})]
        if isinstance(message, DeviceUpdate):
            return self._fold(message, now)
        raise UnexpectedMessageError(f"fedbuff edge does not accept {message.KIND}")

    def _new_version(self, task: CellTask) -> list[Action]:
        if task.sender != self.parent:
            raise UnknownSenderError(f"cell task from {task.sender!r}, expected {self.parent!r}")
        if self._task is not None and task.round <= self._task.round:
            return [Dropped("superseded", task.key, f"edge holds version {self._task.round}")]
        config = FedBuffConfig.from_dict(task.config)
        roster = task.config.get(ROSTER, ()) if config.roaming else ()
        if not isinstance(roster, (list, tuple)) or not all(isinstance(d, str) for d in roster):
            raise UnexpectedMessageError(f"cell task's {ROSTER} must be a list of device ids, got {type(roster)}")
        counted = task.config.get(COUNTED, 0)
        if not isinstance(counted, int) or isinstance(counted, bool) or counted < 0:
            raise UnexpectedMessageError(f"cell task's {COUNTED} must be a count of this cell's updates, "
                                         f"got {counted!r}")
        self._plan = _plan(config, self.cell)
        self._config = config
        self._task = task
        self._roster = frozenset(roster)
        self._device_config = {k: v for k, v in task.config.items() if k not in CELL_TASK_ONLY}
        self._transition("task")
        # Every member (and visitor) not training gets it (the first version: all of them); a busy one gets it
        # after its upload, and a task to an offline one is lost and sent again when it comes online (``resend``).
        out: list[Action] = [self._device_task(d) for d in (*task.members, *self._visitors)
                             if d not in self._busy and not self._has_trained(d)]
        return [Note("cell_updates_counted", {"before": counted}), *out] if counted else out

    def _mark_seen(self, message: Message) -> None:
        self._seen.setdefault((message.KIND, message.sender), CountedSteps()).add(message.step)

    def strategy_state(self) -> Mapping[str, np.ndarray] | None:
        """What the edge carries from one cell update to the next beyond its inputs, taken by the shell right
        after a cell update (the buffer is empty then; how often is the shell's choice): the update counter, the
        uploads seen (as runs), who holds a task, who trained from which version, the visitors and the rejects. A
        restarted edge loads it and replays only the inputs accepted after it (the newest cell task first), so an
        asynchronous rollout's edge store holds the inputs since its last checkpoint, not the rollout's."""
        if self._buffer.count:
            return None  # taken only between cell updates: the buffer's deltas are in no checkpoint
        state = {"seq": self._seq, "trained_from": self._trained_from, "busy": sorted(self._busy),
                 "visitors": list(self._visitors), "rejected": self.rejected,
                 "seen": [[kind, device, runs.to_list()] for (kind, device), runs in self._seen.items()]}
        return {EDGE_STATE: np.frombuffer(json.dumps(state, sort_keys=True).encode(), dtype=np.uint8)}

    def load_strategy_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore ``strategy_state`` into a new edge, before its newest cell task is replayed."""
        if EDGE_STATE not in state:
            return
        try:
            loaded = json.loads(np.asarray(state[EDGE_STATE], dtype=np.uint8).tobytes())
            self._seq = int(loaded["seq"])
            self._trained_from = {str(d): int(v) for d, v in loaded["trained_from"].items()}
            self._busy = {str(d) for d in loaded["busy"]}
            self._visitors = dict.fromkeys(str(d) for d in loaded["visitors"])
            self.rejected = {str(r): int(n) for r, n in loaded["rejected"].items()}
            self._seen = {(str(k), str(d)): CountedSteps.from_array(runs) for k, d, runs in loaded["seen"]}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LocalProtocolError(f"unreadable fedbuff edge state: {exc}") from None

    @property
    def roaming(self) -> bool:
        """The rollout lets devices contribute through any of its cells (``FedBuffConfig.roaming``)."""
        return self._config is not None and self._config.roaming

    def _accepts(self, device: str) -> bool:
        """A member of this cell, or under roaming any device of the rollout."""
        assert self._task is not None
        return device in self._task.members or device in self._roster

    def resend(self, child: str, now: float) -> list[Action]:
        """``child`` came online: give it the newest model (a task it still held was lost while it was away;
        one it is still training on makes it answer ``Dropped("busy")``). Under roaming a device of another cell
        is a visitor from now on, and the task does not count as held (it may have trained this version in another
        cell, and then drops it): the next version goes to it whatever."""
        if self._task is None or not self._accepts(child) or self._has_trained(child):
            return []
        if not self.roaming:
            return [self._device_task(child)]
        self._visit(child)
        self._busy.discard(child)
        return [self._device_task(child, held=False)]

    def _visit(self, device: str) -> None:
        assert self._task is not None
        if device not in self._task.members:
            self._visitors[device] = None

    def _has_trained(self, child: str) -> bool:
        """``once_per_version``: ``child`` uploaded a delta from the version the edge holds (it waits for the next)."""
        assert self._task is not None and self._config is not None
        return self._config.once_per_version and self._trained_from.get(child, -1) >= self._task.round

    def _device_task(self, child: str, held: bool = True) -> SendToChild:
        assert self._task is not None
        if held:
            self._busy.add(child)
        return SendToChild(child, DeviceTask(rollout=self.rollout, round=self._task.round, sender=self.cell,
                                             params=self._task.params, config=self._device_config, members=(child,)))

    def _fold(self, update: DeviceUpdate, now: float) -> list[Action]:
        assert self._task is not None and self._config is not None
        version = self._task.round
        if update.round > version:
            raise WrongRoundError(f"delta from version {update.round}, edge holds {version}")
        self._mark_seen(update)
        self._busy.discard(update.sender)
        if self.roaming:
            self._visit(update.sender)  # it is here: new versions go to it
        self._trained_from[update.sender] = max(self._trained_from.get(update.sender, -1), update.round)
        out: list[Action] = []
        if self._plan is not None and not self._plan.cells[self.cell].trusted:
            # Released to this (untrusted) edge whether or not it is folded: the ledger charges it either way.
            audit.check_device_release(self._plan, self.cell, update.sender, update.round, update.step,
                                       update.release)
            assert update.release is not None
            self._releases.append(dict(update.release))
        if version - update.round > self._config.max_staleness:
            self.rejected["stale"] = self.rejected.get("stale", 0) + 1
            out.append(Dropped("stale", update.key, f"from version {update.round}, edge holds {version}"))
        else:
            check_like(self._task.params, update.delta, "device delta")
            weight = device_weights(self._config.weighting, {update.sender: update.num_samples}, [update.sender])[0]
            self._buffer.fold(update.delta, weight)
            self._weights.append(weight)
            self._buffer_since = now if self._buffer_since is None else self._buffer_since
            self._bases.append(update.round)
            self._reporters.append(update.sender)
            self._steps.append([update.sender, update.step])
            self._losses.append(update.train_loss)
            if self._buffer.count >= self._config.k_edge:
                out.extend(self._flush())
        if not self._has_trained(update.sender):
            out.append(self._device_task(update.sender))  # the device is online: it trains again on the newest model
        return out

    def tick(self, now: float) -> list[Action]:
        c = self._config
        if (c is None or not c.edge_timeout_s or self._buffer_since is None
                or now - self._buffer_since < c.edge_timeout_s):
            return []
        return self._flush()

    def _flush(self) -> list[Action]:
        """Send the buffer up as one cell update and start an empty one."""
        assert self._task is not None and self._config is not None
        n = self._buffer.count
        weight = float(sum(self._weights)) or float(n)  # all-zero sample counts: the plain mean, weight n
        delta, privacy = self._privatize(self._buffer.mean())
        update = CellUpdate(rollout=self.rollout, round=self._seq, sender=self.cell, delta=delta, weight=weight,
                            reported=tuple(self._reporters),
                            mean_loss=float(np.mean(self._losses)) if self._plan is None else 0.0,
                            stats={"base_version": min(self._bases), "deltas": n,
                                   **({"steps": self._steps} if self.roaming else {})}, privacy=privacy)
        self._seq += 1
        self._reset_buffer()
        return [SendToParent(update)]

    def _privatize(self, delta: Mapping[str, np.ndarray]) -> tuple[Mapping[str, np.ndarray], dict[str, Any] | None]:
        """A trusted edge noises each cell update (one release over its ``n`` deltas); an untrusted one forwards
        its devices' release records."""
        plan = self._plan
        if plan is None:
            return delta, None
        reporters = self._reporters
        report: dict[str, Any] = {"trusted": plan.cells[self.cell].trusted, "steps": [list(reporters)],
                                  "releases": self._releases, "clear": []}
        if not plan.cells[self.cell].trusted:
            return delta, report
        n = len(reporters)
        sigma = plan.edge_sigma(self.cell, n)
        noised = self.noise.add(delta, sigma, "dp", self.rollout, self.cell, NAME, self._seq, secure=plan.secure_noise)
        report["releases"] = [audit.release_record(
            plan=plan, node=self.cell, event="edge", round=self._seq, step=0, sigma=sigma,
            sensitivity=plan.edge_sensitivity(n), z=plan.edge_charged_z(self.cell, n),
            calibrated_sensitivity=plan.calibrated_edge_sensitivity(n), protected=sorted(set(reporters)),
            reporters=n)]
        report["clear"] = [{"sender": d, "receiver": self.cell, "step": j} for d, j in self._steps]
        return noised, report

    def overdue(self, now: float) -> tuple[str, ...]:
        return ()


# --- cloud --------------------------------------------------------------------------------------


def merge_cell_stats(into: dict[str, Any], stats: Mapping[str, Any]) -> None:
    """Add one cell update's ``stats`` to ``into``: numbers summed (bytes, deltas), ``[reason, n]`` pairs
    (``rejected``) summed by reason, ``[device, reason]`` pairs (``failed``) and ``[device, j]`` device-steps
    (``steps``, under roaming) kept; the rest (``base_version``) left out."""
    for key, value in stats.items():
        if key == "base_version":
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            into[key] = into.get(key, 0) + value
        elif key == "rejected" and isinstance(value, (list, tuple)):
            counts = dict(into.get(key, []))
            for reason, n in value:
                counts[reason] = counts.get(reason, 0) + n
            into[key] = [[r, n] for r, n in sorted(counts.items())]
        elif key in ("failed", "steps") and isinstance(value, (list, tuple)):
            into[key] = [*into.get(key, []), *value]



class CountedSteps:
    """Counted sequence numbers (a device's device-steps ``j``, a cell's update counters ``u``), as runs
    ``[start, end)``: compact whatever the rollout's length.

    A device's steps are counted nearly in order (0, 1, 2, ...), each step it skips (a delta rejected as stale, lost
    with a cell update) leaving a gap for good; a device costs two numbers per gap, in memory and in the strategy
    state the coordinator stores with every model version (a set of every ``j`` would grow with every upload)."""

    __slots__ = ("starts", "ends")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def __contains__(self, j: int) -> bool:
        i = bisect.bisect_right(self.starts, j) - 1
        return i >= 0 and j < self.ends[i]

    def add(self, j: int) -> None:
        if j in self:
            return
        i = bisect.bisect_right(self.starts, j)  # the run before j is runs[i - 1], the one after it runs[i]
        joins_before = i > 0 and self.ends[i - 1] == j
        joins_after = i < len(self.starts) and self.starts[i] == j + 1
        if joins_before and joins_after:
            self.ends[i - 1] = self.ends.pop(i)
            del self.starts[i]
        elif joins_before:
            self.ends[i - 1] = j + 1
        elif joins_after:
            self.starts[i] = j
        else:
            self.starts.insert(i, j)
            self.ends.insert(i, j + 1)

    def prefix(self) -> int:
        """How many numbers are counted from 0 on without a gap: every ``j`` below it is counted."""
        return self.ends[0] if self.starts and self.starts[0] == 0 else 0

    def to_list(self) -> list[int]:
        """``[start0, end0, start1, end1, ...]``, plain ints (what a JSON state holds; no array per device)."""
        return [v for run in zip(self.starts, self.ends, strict=True) for v in run]

    def to_array(self) -> np.ndarray:
        """``to_list`` as an int64 array (what a strategy state holds)."""
        return np.array(self.to_list(), dtype=np.int64)

    @classmethod
    def from_array(cls, array: np.ndarray | list[int]) -> "CountedSteps":
        values = [int(v) for v in np.asarray(array).reshape(-1)]
        if len(values) % 2 or any(b <= a for a, b in zip(values, values[1:], strict=False)):
            raise LocalProtocolError(f"counted device-steps are not increasing [start, end) runs: {values[:8]}")
        counted = cls()
        counted.starts, counted.ends = values[0::2], values[1::2]
        return counted


class Cloud(StateGuard):
    """Applies every ``k_cloud`` cell updates, each weighted by its staleness, through the server optimizer."""

    TRANSITIONS: ClassVar[Transitions] = CLOUD_TRANSITIONS

    def __init__(self, *, rollout: str, cells: Mapping[str, tuple[str, ...]], initial_params: Mapping[str, np.ndarray],
                 config: FedBuffConfig, rounds: int, cloud_id: str = "cloud", start_round: int = 0,
                 model_version: int = 0, replan: Any = None,
                 admit: Callable[..., Any] | None = None, **_: Any) -> None:
        """
        Args:
            rollout, cells, cloud_id: as every cloud role.
            initial_params: the model of version ``model_version``.
            config: the rollout's ``FedBuffConfig`` (sent in every cell task).
            rounds: the versions to produce; the rollout finishes at version ``rounds``.
            start_round, model_version: where a restarted coordinator continues (the version counts rounds).
            replan, admit: unused (no round planner; the ledger is charged by the shell per release).
        """
        if not isinstance(config, FedBuffConfig):
            raise LocalProtocolError(f"fedbuff's cloud needs a FedBuffConfig, got {type(config).__name__}")
        check_int(rounds, "rounds", 1)
        self.rollout, self.cloud_id, self.config, self.rounds = rollout, cloud_id, config, rounds
        self.cells = {c: tuple(m) for c, m in cells.items()}
        self._params = aggregate.copy_tensors(initial_params)
        self._version = max(start_round, model_version)
        strategy = config.strategy or {}
        spec = OptimizerSpec.from_dict(strategy["server_optimizer"]) if "server_optimizer" in strategy else None
        self._optimizer = ServerOptimizer(spec) if spec is not None and not spec.is_plain else None
        self._seen: dict[str, CountedSteps] = {c: CountedSteps() for c in self.cells}
        """Cell -> the update counters ``u`` of its cell updates folded or rejected: each is counted once, across
        a restart too (``strategy_state`` carries them with the model version they went into). A cell numbers its
        updates 0, 1, 2, ..., so as runs (``CountedSteps``) they stay two numbers a cell however long the rollout."""
        self.roster = tuple(sorted({d for m in self.cells.values() for d in m})) if config.roaming else ()
        """Roaming: the rollout's devices, sent in every cell task (``ROSTER``)."""
        self._steps: dict[str, CountedSteps] = {}
        """Roaming: device -> the ``j`` of its device-steps counted (folded), across cells and restarts
        (``strategy_state``): a cell update repeating one is ``Dropped("duplicate_step")``."""
        self.rejected: dict[str, int] = {}
        """Cell updates rejected, by reason (``stale``, ``duplicate_step``)."""
        self._state = RoleState.IDLE
        self._reset()

    def _reset(self) -> None:
        self._sum = aggregate.WeightedSum()
        self._folded: list[tuple[str, int, tuple[str, ...]]] = []
        self._releases: list[dict[str, Any]] = []
        """The release records of every cell update received since the last version, folded or stale (what was
        released is charged either way), each with its ``cell`` and the cell update's counter ``update``."""
        self._clear: list[dict[str, Any]] = []
        self._cell_stats: dict[str, dict[str, Any]] = {}
        """Cell -> its folded updates' statistics, merged (``merge_cell_stats``): the version's row counts
        every device byte and rejection of the updates that made it."""

    @property
    def round(self) -> int:
        return self._version

    @property
    def params(self) -> Mapping[str, np.ndarray]:
        return self._params

    def start(self, now: float) -> list[Action]:
        self._transition("start")
        if self._version >= self.rounds:
            self._transition("finish")
            return [Finished(self._version)]
        return self._broadcast()

    def _broadcast(self) -> list[Action]:
        cfg = self.config.to_dict()
        if self.config.roaming:
            cfg[ROSTER] = list(self.roster)
        return [SendToChild(c, CellTask(rollout=self.rollout, round=self._version, sender=self.cloud_id,
                                        params=self._params, members=m, config=self._with_counted(cfg, c),
                                        model_version=self._version))
                for c, m in self.cells.items()]

    def _with_counted(self, config: dict[str, Any], cell: str) -> dict[str, Any]:
        """``config`` with ``COUNTED``: the cell's updates below the first it has not counted (all of them, as the
        cell numbers them 0, 1, 2, ...; one lost and never sent again holds the prefix where it is)."""
        counted = self._seen[cell].prefix()
        return {**config, COUNTED: counted} if counted else config

    def resend(self, child: str, now: float) -> list[Action]:
        if self._state is not RoleState.COLLECTING or child not in self.cells:
            return []
        return [a for a in self._broadcast() if isinstance(a, SendToChild) and a.child == child]

    def receive(self, message: Message, now: float) -> list[Action]:
        if not isinstance(message, CellUpdate):
            raise UnexpectedMessageError(f"fedbuff cloud does not accept {message.KIND}")
        if message.sender not in self.cells:
            raise UnknownSenderError(f"cell update from {message.sender!r}, not a cell of the rollout")
        if message.round in self._seen[message.sender]:
            return [Dropped("duplicate", message.key)]
        if self._state is not RoleState.COLLECTING:
            return [Dropped("finished", message.key)]
        base = message.stats.get("base_version")
        if not isinstance(base, int) or isinstance(base, bool) or base < 0:
            raise UnexpectedMessageError(f"cell update without a base_version (got {base!r})")
        if base > self._version:
            raise WrongRoundError(f"cell update from version {base}, the cloud is at {self._version}")
        steps = self._device_steps(message) if self.config.roaming else []
        self._seen[message.sender].add(message.round)
        self._note_releases(message)
        staleness = self._version - base
        if staleness > self.config.max_staleness:
            self.rejected["stale"] = self.rejected.get("stale", 0) + 1
            return [Dropped("stale", message.key, f"staleness {staleness} > {self.config.max_staleness}")]
        counted = [(d, j) for d, j in steps if d in self._steps and j in self._steps[d]]
        if counted:
            self.rejected["duplicate_step"] = self.rejected.get("duplicate_step", 0) + 1
            return [Dropped("duplicate_step", message.key,
                            f"device-step(s) {', '.join(f'{d}#{j}' for d, j in counted)} counted already (through "
                            f"another cell update); {len(steps) - len(counted)} other delta(s) in it not counted")]
        check_like(self._params, message.delta, "cell update")
        for d, j in steps:
            self._steps.setdefault(d, CountedSteps()).add(j)
        self._sum.fold(message.delta, message.weight, staleness_weight(self.config, staleness))
        self._folded.append((message.sender, staleness, message.reported))
        merge_cell_stats(self._cell_stats.setdefault(message.sender, {}), message.stats)
        if self._sum.count < self.config.k_cloud:
            return []
        return self._apply()

    def _note_releases(self, message: CellUpdate) -> None:
        """Keep a cell update's privacy report for the ledger (charged when the next version closes)."""
        report = message.privacy
        if not isinstance(report, Mapping):
            return
        self._releases.extend({**dict(r), "cell": message.sender, "update": message.round}
                              for r in report.get("releases", ()) if isinstance(r, Mapping))
        self._clear.extend(dict(c) for c in report.get("clear", ()) if isinstance(c, Mapping))

    def _device_steps(self, message: CellUpdate) -> list[tuple[str, int]]:
        """Roaming: the ``(device, j)`` ids a cell update lists (``stats["steps"]``), one per reporter, in order."""
        steps = message.stats.get("steps")
        if not isinstance(steps, (list, tuple)) or not all(
                isinstance(s, (list, tuple)) and len(s) == 2 and isinstance(s[0], str) and isinstance(s[1], int)
                and not isinstance(s[1], bool) and s[1] >= 0 for s in steps):
            raise UnexpectedMessageError(f"cell update of a roaming rollout without its device-steps (stats['steps'] "
                                         f"= [[device, j], ...]), got {steps!r}")
        out = [(str(d), int(j)) for d, j in steps]
        if [d for d, _ in out] != list(message.reported) or len(set(out)) != len(out):
            raise UnexpectedMessageError("cell update's device-steps do not match its reporters one to one")
        strangers = sorted({d for d, _ in out} - set(self.roster))
        if strangers:
            raise UnknownSenderError(f"cell update with device-steps of {strangers}, not devices of the rollout")
        return out

    def _apply(self) -> list[Action]:
        """``Delta = sum W_c alpha_c delta_c / sum W_c``; the server optimizer's step; version + 1."""
        total = self._sum.total()
        change = {n: (a / total).astype(np.float32) for n, a in self._sum.sums().items()}
        self._params = (self._optimizer.step(self._params, change) if self._optimizer is not None
                        else aggregate.add(self._params, change))
        folded = self._folded
        reported: dict[str, list[str]] = {}
        for cell, _, devices in folded:
            reported.setdefault(cell, []).extend(devices)
        closed = RoundClosed(round=self._version, params=self._params,
                             reported={c: tuple(d) for c, d in reported.items()}, missing=(),
                             metrics={"model_version": self._version + 1, "cell_updates": len(folded),
                                      "deltas": sum(len(d) for _, _, d in folded),
                                      "mean_staleness": float(np.mean([s for _, s, _ in folded])),
                                      "rejected_stale": self.rejected.get("stale", 0),
                                      **({"rejected_duplicate_step": self.rejected.get("duplicate_step", 0)}
                                         if self.config.roaming else {}),
                                      "cells": self._cell_stats,
                                      **({"releases": self._releases, "clear": self._clear}
                                         if self._releases or self._clear else {})})
        self._version += 1
        self._reset()
        if self._version >= self.rounds:
            self._transition("finish")
            return [closed, Finished(self._version)]
        return [closed, *self._broadcast()]

    def tick(self, now: float) -> list[Action]:
        return []

    def overdue(self, now: float) -> tuple[str, ...]:
        return ()

    def strategy_state(self) -> Mapping[str, np.ndarray] | None:
        """The server optimizer's moments; per cell, the counters of the cell updates counted so far
        (``seen/<cell>``): a redelivered one stays a duplicate after the coordinator restarts; under roaming, per
        device, the device-steps counted (``step/<device>``: ``CountedSteps.to_array``)."""
        state = dict(self._optimizer.state()) if self._optimizer is not None else {}
        state.update({f"{SEEN_PREFIX}{c}": u.to_array() for c, u in self._seen.items()})
        state.update({f"{STEP_PREFIX}{d}": j.to_array() for d, j in self._steps.items()})
        return state

    def load_strategy_state(self, state: Mapping[str, np.ndarray]) -> None:
        for name, counters in state.items():
            if name.startswith(SEEN_PREFIX) and name[len(SEEN_PREFIX):] in self._seen:
                self._seen[name[len(SEEN_PREFIX):]] = CountedSteps.from_array(counters)
            elif name.startswith(STEP_PREFIX):
                self._steps[name[len(STEP_PREFIX):]] = CountedSteps.from_array(counters)
        if self._optimizer is not None:
            self._optimizer.load_state({k: v for k, v in state.items()
                                        if not k.startswith((SEEN_PREFIX, STEP_PREFIX))})

"""The cloud role shared by the hierarchical algorithms (FedAvg, Hier-Local-QSGD, QHetFed).

Every one of them ends a global round the same way (QHetFed eq. (10); Hier-Local-QSGD
Algorithm 2 with its 1/N typo corrected): each cell sends the change of its set model since
the global model, ``delta_c`` (possibly quantized by ``Q2``), with a weight ``W_c`` (its
device count, or its sample count), and the cloud sets

    w_{t+1} = w_t + sum_c W_c delta_c / sum_c W_c

summing in cell-id order so the result does not depend on arrival order. What differs
between the algorithms happens below the cloud, in the tasks' ``config``.

Transitions: ``CLOUD_TRANSITIONS`` below, data that ``StateGuard._transition`` checks.

``replan`` (optional, pure): given the running estimate of the devices' quantizer variance
``q1`` (from the cells' reports), return the config of the next round — QHetFed's planner
chooses (tau, gamma) this way.

Federated evaluation: the cells' ``evaluation`` (their devices' held-out statistics for the
model the round started from) are combined weighted by row count into the round's
``metrics["federated"]`` (loss, accuracy, examples, devices, and the evaluated model version);
each device's own (``CellUpdate.device_evaluations``) is kept beside it, in
``metrics["federated"]["per_device"]`` (``{device: {accuracy, loss, examples, auroc?}}``), so a
fleet's worst devices are not hidden by the mean.

Differential privacy: when the config carries a noise plan, every cell update is audited
(``fedtier.privacy.audit.check_cell_update``) before it is accepted — one whose noise is
missing or weaker than planned is refused with ``MissingReleaseError`` — and ``admit``
(optional, supplied by the coordinator's privacy ledger) is asked before each round opens;
when it names a reason (a device's budget would be exceeded), the rollout finishes instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence

import numpy as np

from fedtier.algorithms import aggregate, strategies
from fedtier.algorithms.base import (
    Action,
    Dropped,
    Finished,
    Note,
    RoleState,
    RoundClosed,
    SendToChild,
    StateGuard,
    Tensors,
    Transitions,
)
from fedtier.algorithms.common import check_like, quorum_count
from fedtier.algorithms.server_opt import OptimizerSpec, ServerOptimizer
from fedtier.errors import (
    LateMessageError,
    LocalProtocolError,
    UnexpectedMessageError,
    UnknownSenderError,
    WrongRoundError,
)
from fedtier.privacy import audit
from fedtier.privacy.adaptive_clip import GeometricClip
from fedtier.privacy.plan import NoisePlan
from fedtier.wire.messages import CellTask, CellUpdate, Message

CLOUD_TRANSITIONS: Transitions = {
    RoleState.IDLE: {
        "start": RoleState.IDLE,  # start() once; a second call is the shell's bug
        "open": RoleState.COLLECTING,  # the first (or resumed) round's tasks go out
        "finish": RoleState.FINISHED,  # every round already ran, or ``admit`` refused the first round
    },
    RoleState.COLLECTING: {
        "open": RoleState.COLLECTING,  # the round closed (all cells, or deadline and quorum): the next one opens
        "finish": RoleState.FINISHED,  # the last round closed, or ``admit`` refused the next one
    },
    RoleState.FINISHED: {},
}
"""The cloud role's transitions (``Cloud`` and the algorithms' subclasses)."""


class RoundConfig(Protocol):
    """What the cloud needs from an algorithm's config."""

    quorum: float
    deadline_s: float

    def to_dict(self) -> dict[str, Any]: ...


class Cloud(StateGuard):
    """Drives rounds: tasks to cells, weighted average of their changes, next round."""

    TRANSITIONS: ClassVar[Transitions] = CLOUD_TRANSITIONS

    def __init__(self, *, rollout: str, cells: Mapping[str, Sequence[str]], initial_params: Tensors,
                 config: RoundConfig, rounds: int, cloud_id: str = "cloud", start_round: int = 0,
                 model_version: int = 0, replan: Callable[[float | None], RoundConfig] | None = None,
                 admit: Callable[[int], str | None] | None = None) -> None:
        """
        Args:
            rollout: rollout id.
            cells: cell id -> member device ids (every round uses all members).
            initial_params: global parameters at ``start_round``.
            config: the algorithm's settings, sent to every cell in its task.
            rounds: total rounds; the rollout finishes after round ``rounds - 1``.
            cloud_id: sender id of the cloud's messages.
            start_round: first round to run (> 0 when resuming from saved state).
            model_version: version number of ``initial_params``; incremented every round.
            replan: optional pure function of the q1 estimate giving the next round's config.
            admit: optional check before a round opens: ``None`` to go ahead, or why the rollout
                must stop instead (the privacy budget).
        """
        if not cells or any(not members for members in cells.values()):
            raise LocalProtocolError("every cell needs at least one member device")
        if rounds <= 0 or not (0 <= start_round <= rounds):
            raise LocalProtocolError(f"invalid rounds={rounds} start_round={start_round}")
        self.rollout = rollout
        self.cells = {c: tuple(sorted(m)) for c, m in cells.items()}
        self.config = config
        self.rounds = rounds
        self.cloud_id = cloud_id
        self.params = aggregate.copy_tensors(initial_params)
        self.model_version = model_version
        self.round = start_round
        self.replan = replan
        self.admit = admit
        self._plan_cache: tuple[Any, NoisePlan] | None = None
        self.clip_bound: GeometricClip | None = None
        """Adaptive clipping: the clip bound the cloud moves every round (``None`` without)."""
        self.stop_reason: str | None = None
        self.q1_estimate: float | None = None
        self._state = RoleState.IDLE
        self._updates: dict[str, CellUpdate] = {}
        self._deadline = math.inf
        self._round_cells: dict[str, tuple[str, ...]] = dict(self.cells)
        """The cells taking part in the open round and their members in it (``_participants``)."""
        strategy = getattr(config, "strategy", None)
        self.aggregator_spec = strategies.parse_strategy(strategy)["cloud"]
        self.aggregator: strategies.Aggregator = strategies.build(self.aggregator_spec)
        """How the cells' changes are combined (``fedtier.algorithms.strategies``; the weighted mean by default)."""
        opt = (strategy or {}).get("server_optimizer")
        self.optimizer: ServerOptimizer | None = ServerOptimizer(OptimizerSpec.from_dict(opt)) if opt else None
        """Reddi et al.'s server optimizer on the combined change (``None``: ``w + delta``, FedAvg)."""
        self._start_adaptive_clip()

    # --- hooks for algorithms whose cells train different parameters (HIST) -------------------

    def _cell_params(self, cell: str) -> Tensors:
        """What ``cell`` trains this round: the global model (here), or its submodel (HIST)."""
        return self.params

    def _prepare_round(self) -> list[Action]:
        """Called when a round opens, before its tasks are built (HIST draws its partition)."""
        return []

    def _participants(self) -> dict[str, tuple[str, ...]]:
        """The cells taking part in the round that opens, each with its members in it: every cell and every
        member here; an algorithm that samples devices (FeDXL's partial participation) returns fewer — a
        cell left without a member gets no task, and the round does not wait for it.

        Under a noise plan with device sampling the cloud samples the devices of untrusted cells (public,
        within their release cap: ``NoisePlan.untrusted_sample``); trusted and distributed-DP cells get every
        member and sample in secret themselves."""
        plan = self._noise_plan()
        if plan is None or not plan.sampled:
            return dict(self.cells)
        out: dict[str, tuple[str, ...]] = {}
        for cell, members in self.cells.items():
            chosen = members if plan.cells[cell].cell_releases else plan.untrusted_sample(cell, members,
                                                                                                self.round)
            if chosen:
                out[cell] = tuple(chosen)
        return out

    def _aggregate(self, updates: Mapping[str, CellUpdate]) -> dict[str, Any]:
        """The new global model from the cells' changes: their weighted average (or the configured
        cloud aggregator), added (eq. (10)) or stepped by the server optimizer."""
        cells = sorted(updates)
        delta = strategies.run(self.aggregator, [updates[c].delta for c in cells], [updates[c].weight for c in cells])
        return self._apply(delta)

    def _apply(self, delta: Tensors) -> dict[str, Any]:
        """``w + delta`` (today's rule), or one server-optimizer step with ``delta`` as pseudo-gradient."""
        if self.optimizer is None:
            return aggregate.add(self.params, delta)
        return self.optimizer.step(self.params, delta)

    # --- strategy state (persisted by the shell with each model version) -----------------------------

    def strategy_state(self) -> dict[str, Any] | None:
        """The server optimizer's and a stateful cloud aggregator's state after the last closed round
        (``opt/...`` and ``agg/...`` tensors), or ``None`` when there is none to keep."""
        out: dict[str, Any] = {}
        if self.optimizer is not None:
            out.update({f"opt/{k}": v for k, v in self.optimizer.state().items()})
        state = getattr(self.aggregator, "state", None)
        if callable(state):
            out.update({f"agg/{k}": v for k, v in dict(state()).items()})
        if self.clip_bound is not None:  # adaptive clipping: the next round's clip bound
            out["clip/bound"] = np.array([self.clip_bound.clip], np.float64)
        return out or None

    def load_strategy_state(self, state: Mapping[str, Any]) -> None:
        """Restore ``strategy_state()`` after a restart (before ``start``)."""
        if self.optimizer is not None:
            self.optimizer.load_state({k[4:]: v for k, v in state.items() if k.startswith("opt/")})
        load = getattr(self.aggregator, "load_state", None)
        if callable(load):
            load({k[4:]: v for k, v in state.items() if k.startswith("agg/")})
        if self.clip_bound is not None and "clip/bound" in state:
            self.clip_bound.clip = float(np.asarray(state["clip/bound"]).reshape(-1)[0])
            self.config = dataclasses.replace(self.config, dp_clip=self.clip_bound.clip)  # type: ignore[type-var]

    # --- rounds ---------------------------------------------------------------------------------

    def _noise_plan(self) -> NoisePlan | None:
        """The config's noise plan at the round's clip bound, parsed once per config (not once per cell update)."""
        privacy = getattr(self.config, "privacy", None)
        if privacy is None:
            return None
        if self._plan_cache is None or self._plan_cache[0] is not self.config:
            plan = NoisePlan.from_dict(privacy)
            clip = getattr(self.config, "dp_clip", None)
            self._plan_cache = (self.config, plan if clip is None else plan.at_clip(float(clip)))
        return self._plan_cache[1]

    def _start_adaptive_clip(self) -> None:
        """Adaptive clipping: the clip bound starts at the plan's C and is moved after every round."""
        plan = self._noise_plan()
        if plan is None or plan.adaptive is None:
            self.clip_bound = None
            return
        self.clip_bound = GeometricClip(clip=plan.clip, target_quantile=float(plan.adaptive["quantile"]),
                                        learning_rate=float(plan.adaptive["lr"]))
        self.config = dataclasses.replace(self.config, dp_clip=plan.clip)  # type: ignore[type-var]

    def _move_clip(self, updates: Sequence[CellUpdate]) -> dict[str, float] | None:
        """Adaptive clipping after a round: the cells' noised centred counts over the expected count (public:
        q times a sampling trusted cell's members, the cloud's own sample of an untrusted one) move C
        (``fedtier.privacy.adaptive_clip``); the next round's tasks carry it."""
        plan = self._noise_plan()
        if self.clip_bound is None or plan is None:
            return None
        total, expected = 0.0, 0.0
        for update in updates:
            releases = (update.privacy or {}).get("releases") or []
            total += sum(float(r["count"]) for r in releases if isinstance(r, Mapping) and "count" in r)
        for cell_id, members in self._round_cells.items():
            expected += plan.sample_rate * plan.cells[cell_id].members if plan.cells[cell_id].cell_releases \
                else len(members)
        before = self.clip_bound.clip
        after = self.clip_bound.update(total, max(expected, 1.0))
        self.config = dataclasses.replace(self.config, dp_clip=after)  # type: ignore[type-var]
        return {"clip": before, "next_clip": after, "unclipped_share": total / max(expected, 1.0) + 0.5}

    def _cell_task(self, cell: str) -> CellTask:
        return CellTask(rollout=self.rollout, round=self.round, sender=self.cloud_id, params=self._cell_params(cell),
                        members=self._round_cells[cell], config=self.config.to_dict(), model_version=self.model_version)

    def _open(self, now: float) -> list[Action]:
        notes: list[Action] = []
        if self.admit is not None:
            reason = self.admit(self.round)
            if reason is not None:
                self.stop_reason = reason
                self._transition("finish")
                return [Note("rollout_stopped", {"round": self.round, "reason": reason}), Finished(self.round, reason)]
        if self.replan is not None:
            new = self.replan(self.q1_estimate)
            if new.to_dict() != self.config.to_dict():
                notes.append(Note("replanned", {"round": self.round, "q1": self.q1_estimate, **new.to_dict()}))
            self.config = new
        notes.extend(self._prepare_round())
        self._round_cells = self._participants()
        self._updates = {}
        self._deadline = now + self.config.deadline_s
        self._transition("open")
        return [*notes, *(SendToChild(cell, self._cell_task(cell)) for cell in sorted(self._round_cells))]

    def start(self, now: float) -> list[Action]:
        self._transition("start")
        if self.round >= self.rounds:
            self._transition("finish")
            return [Finished(self.rounds)]
        return self._open(now)

    def receive(self, message: Message, now: float) -> list[Action]:
        if not isinstance(message, CellUpdate):
            raise UnexpectedMessageError(f"cloud does not accept {message.KIND}")
        duplicate = self._check_cell_message(message, "update", self._updates)
        if duplicate:
            return duplicate
        unknown = set(message.reported) - set(self._round_cells[message.sender])
        if unknown:
            raise UnknownSenderError(f"cell {message.sender!r} reports non-members {sorted(unknown)}")
        evaluated = set(message.device_evaluations) - set(message.reported)
        if evaluated:
            raise UnknownSenderError(f"cell {message.sender!r} reports evaluations of devices that did not report "
                                     f"{sorted(evaluated)}")
        check_like(self._cell_params(message.sender), message.delta, f"update from {message.sender}")
        plan = self._noise_plan()
        if plan is not None:
            audit.check_cell_update(plan, message.sender, message.round, message.privacy, message.reported)
        self._updates[message.sender] = message
        if len(self._updates) == len(self._round_cells):
            return self._close(now)
        return []

    def _check_cell_message(self, message: Message, what: str, seen: Mapping[str, Any]) -> list[Action]:
        """The checks every message of a cell for the open round passes (its update, or a report instead of one):
        a known cell, this round, a member of it; ``[Dropped]`` when ``seen`` (this kind's messages of the round,
        by cell) has it already, else ``[]``.

        Raises:
            UnknownSenderError, LateMessageError, WrongRoundError: the message is not for the open round.
        """
        if message.sender not in self.cells:
            raise UnknownSenderError(f"{what} from unknown cell {message.sender!r}")
        if message.round < self.round or self._state is RoleState.FINISHED:
            raise LateMessageError(f"{what} for round {message.round}; cloud is at round {self.round}")
        if message.round > self.round or self._state is not RoleState.COLLECTING:
            raise WrongRoundError(f"{what} for round {message.round}; cloud is at round {self.round}")
        if message.sender in seen:
            return [Dropped("duplicate", message.key)]
        if message.sender not in self._round_cells:
            raise UnknownSenderError(f"cell {message.sender!r} has no member in round {message.round}")
        return []

    def tick(self, now: float) -> list[Action]:
        if self._state is not RoleState.COLLECTING or now < self._deadline:
            return []
        if len(self._updates) >= quorum_count(self.config.quorum, len(self._round_cells)):
            return self._close(now)
        return []

    def overdue(self, now: float) -> tuple[str, ...]:
        """The cells the open round still waits for once its deadline has passed (else empty)."""
        if self._state is not RoleState.COLLECTING or now < self._deadline:
            return ()
        return tuple(sorted(set(self._round_cells) - set(self._updates)))

    def resend(self, child: str, now: float) -> list[Action]:
        if self._state is RoleState.COLLECTING and child in self._round_cells and child not in self._updates:
            return [SendToChild(child, self._cell_task(child))]
        return []

    def _close(self, now: float) -> list[Action]:
        cells = sorted(self._updates)
        updates = [self._updates[c] for c in cells]
        if updates:  # none: every cell answered without one (secure aggregation aborted): the model stays as it is
            self.params = self._aggregate(self._updates)
        self.model_version += 1
        reported = {c: self._updates[c].reported for c in cells}
        all_members = {d for m in self._round_cells.values() for d in m}
        missing = tuple(sorted(all_members - {d for r in reported.values() for d in r}))
        total_weight = sum(u.weight for u in updates)
        mean_loss = sum(u.mean_loss * u.weight for u in updates) / total_weight if total_weight else None
        q1 = [float(u.stats["device_q"]) for u in updates if isinstance(u.stats.get("device_q"), (int, float))]
        if q1:
            self.q1_estimate = sum(q1) / len(q1)
        q2 = sum(u.q for u in updates) / len(updates) if updates else None
        evaluation = aggregate.combine_evaluations([u.evaluation for u in updates])
        federated = None if evaluation is None else {
            "loss": evaluation.loss, "accuracy": evaluation.accuracy, "examples": evaluation.count,
            "devices": evaluation.devices, "model_version": self.model_version - 1,
            **_per_device(updates)}
        config = self.config.to_dict()
        clip = self._move_clip(updates)
        closed = RoundClosed(round=self.round, params=self.params, reported=reported, missing=missing,
                             metrics={"train_loss": mean_loss, "model_version": self.model_version,
                                      "federated": federated,
                                      "q1": self.q1_estimate, "q2": q2,
                                      "config": config,
                                      **({"adaptive_clip": clip} if clip is not None else {}),
                                      "cells": {c: {k: v for k, v in self._updates[c].stats.items()
                                                    if k != "evaluations"} for c in cells},
                                      "privacy": {c: self._updates[c].privacy for c in cells
                                                  if self._updates[c].privacy is not None}})
        self.round += 1
        if self.round >= self.rounds:
            self._transition("finish")
            return [closed, Finished(self.rounds)]
        return [closed, *self._open(now)]


def _per_device(updates: Sequence[Any]) -> dict[str, Any]:
    """``{"per_device": {device: {accuracy, loss, examples[, auroc]}}}`` of the devices whose own evaluation the
    cells forwarded (in device order), or ``{}`` when none did (cells of an older edge)."""
    own = {d: e for u in updates for d, e in u.device_evaluations.items()}
    if not own:
        return {}
    return {"per_device": {d: {"accuracy": e.accuracy, "loss": e.loss, "examples": e.count,
                               **({"auroc": e.auroc} if e.auroc is not None else {})}
                           for d, e in sorted(own.items())}}

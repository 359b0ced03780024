"""Hierarchical FedAvg: local SGD on devices, averaging in each cell, cells averaged by size.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (AISTATS 2017), arranged in two tiers as in hierarchical FL (Liu et al., "Client-Edge-
Cloud Hierarchical Federated Learning", ICC 2020) with one edge aggregation per round.
It is the baseline every other algorithm in ``fedtier.algorithms`` is compared against.

Theory of operation
-------------------
Round ``t``, with global parameters ``w_t``:

1. cloud  -> edge  ``CellTask(t, w_t, members, config)``            (every cell)
2. edge   -> cell  ``DeviceTask(t, w_t, config)``                   (broadcast)
3. device: ``local_steps`` SGD steps of ``batch_size`` at rate ``lr`` from ``w_t``,
   minibatches drawn from stream ``(seed, "batches", device, t)``; sends
   ``DeviceUpdate(t, delta_i = w_i - w_t, n_i)``.
4. edge: when every member reported — or the deadline passed with at least
   ``ceil(quorum * members)`` updates — ``delta_c = sum_i a_i delta_i / sum_i a_i`` with
   ``a_i = 1`` (``weighting = "uniform"``) or ``a_i = n_i`` (``"samples"``), summed in
   device-id order; sends ``CellUpdate(t, delta_c, weight = sum_i a_i)``.
5. cloud: when every cell reported (or deadline + quorum of cells),
   ``w_{t+1} = w_t + sum_c W_c delta_c / sum_c W_c`` — which equals the flat weighted
   average over all reporting devices — then opens round ``t + 1``.

Transition tables (event -> next state; anything else raises):

    device:  IDLE --DeviceTask--> TRAINING --trained--> IDLE
    edge:    IDLE|FORWARDED --CellTask(t > current)--> COLLECTING
             COLLECTING --DeviceUpdate (last one) | tick (deadline & quorum)--> FORWARDED
    cloud:   IDLE --start--> COLLECTING --CellUpdate (last) | tick--> COLLECTING (t+1) | FINISHED
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

from fedtier import aggregate
from fedtier.algorithms.base import (
    Action,
    Broadcast,
    Dropped,
    Finished,
    LocalResult,
    LocalTrain,
    Note,
    RoleState,
    RoundClosed,
    SendToChild,
    SendToParent,
    StateGuard,
    Tensors,
)
from fedtier.errors import (
    LateMessageError,
    LayoutMismatchError,
    LocalProtocolError,
    UnexpectedMessageError,
    UnknownSenderError,
    WrongRoundError,
)
from fedtier.messages import CellTask, CellUpdate, DeviceTask, DeviceUpdate, Message

NAME = "fedavg"
WEIGHTINGS = ("uniform", "samples")


@dataclass(frozen=True, slots=True)
class FedAvgConfig:
    """Per-rollout settings, sent to every edge and device inside the tasks.

    Attributes:
        local_steps: SGD steps each device runs per round (> 0).
        batch_size: minibatch size (> 0).
        lr: SGD learning rate (>= 0; 0 leaves the model unchanged, useful in tests).
        weighting: "uniform" (every device counts 1) or "samples" (by local sample count).
        quorum: fraction of a cell's members (and of the cells) needed once the deadline
            has passed, in (0, 1]. With 1.0 a round waits for everyone.
        deadline_s: seconds an edge (and the cloud) waits before accepting a quorum.
        seed: rollout seed; names every RNG stream of the rollout.
    """

    local_steps: int = 10
    batch_size: int = 32
    lr: float = 0.05
    weighting: str = "uniform"
    quorum: float = 1.0
    deadline_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.local_steps, int) and self.local_steps > 0):
            raise LocalProtocolError(f"local_steps must be a positive int, got {self.local_steps!r}")
        if not (isinstance(self.batch_size, int) and self.batch_size > 0):
            raise LocalProtocolError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise LocalProtocolError(f"lr must be finite and >= 0, got {self.lr!r}")
        if self.weighting not in WEIGHTINGS:
            raise LocalProtocolError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if not (0 < self.quorum <= 1):
            raise LocalProtocolError(f"quorum must be in (0, 1], got {self.quorum!r}")
        if not (self.deadline_s > 0):
            raise LocalProtocolError(f"deadline_s must be > 0, got {self.deadline_s!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": NAME, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "FedAvgConfig":
        """Parse the ``config`` map of a task. Raises ``UnexpectedMessageError`` if invalid."""
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in config.items() if k in known})
        except (LocalProtocolError, TypeError) as exc:
            raise UnexpectedMessageError(f"invalid fedavg config in task: {exc}") from None


def quorum_count(quorum: float, members: int) -> int:
    """How many of ``members`` must report once the deadline has passed (at least 1)."""
    return max(1, math.ceil(quorum * members - 1e-9))


def _check_like(reference: Tensors, tensors: Tensors, what: str) -> None:
    if set(reference) != set(tensors):
        raise LayoutMismatchError(f"{what}: tensor names {sorted(tensors)} differ from the model's")
    for name, ref in reference.items():
        if tensors[name].shape != ref.shape:
            raise LayoutMismatchError(f"{what}: {name} has shape {tensors[name].shape}, model {ref.shape}")


# --- device -----------------------------------------------------------------------------------


class Device(StateGuard):
    """Runs local SGD for each round it is a member of, and reports the parameter change."""

    def __init__(self, *, device_id: str, cell: str, rollout: str, last_round: int = -1) -> None:
        """
        Args:
            device_id: this device's node id.
            cell: the cell (edge node id) whose tasks are accepted.
            rollout: the rollout this role serves.
            last_round: the last round this device already reported (after a restart), so
                a redelivered task of that round is a duplicate, not new work.
        """
        self.device_id = device_id
        self.cell = cell
        self.rollout = rollout
        self.last_round = last_round
        self._state = RoleState.IDLE
        self._task: DeviceTask | None = None
        self._config: FedAvgConfig | None = None

    def receive(self, message: Message, now: float) -> list[Action]:
        self._guard()
        if not isinstance(message, DeviceTask):
            raise UnexpectedMessageError(f"device does not accept {message.KIND}")
        if message.sender != self.cell:
            raise UnknownSenderError(f"task from {message.sender!r}, expected cell {self.cell!r}")
        current = self._task.round if self._task is not None else self.last_round
        if message.round == current:
            return [Dropped("duplicate", message.key)]
        if message.round < current:
            raise WrongRoundError(f"task for round {message.round}, device is at round {current}")
        if self.device_id not in message.members:
            return [Dropped("not_selected", message.key, f"{self.device_id} not in round {message.round}")]
        config = FedAvgConfig.from_dict(message.config)
        self._task, self._config = message, config
        self._state = RoleState.TRAINING
        return [LocalTrain(round=message.round, params=message.params, steps=config.local_steps,
                           batch_size=config.batch_size, lr=config.lr,
                           stream=(config.seed, "batches", self.device_id, message.round))]

    def trained(self, round: int, result: LocalResult) -> list[Action]:
        self._guard()
        if self._state is not RoleState.TRAINING or self._task is None:
            raise self._misuse("trained() called while no local training was requested")
        if round != self._task.round:
            # A newer task superseded this work while it ran; its result is stale.
            return [Dropped("superseded", f"local/{round}", f"now at round {self._task.round}")]
        _check_like(self._task.params, result.delta, "local result")
        update = DeviceUpdate(rollout=self.rollout, round=round, sender=self.device_id, delta=result.delta,
                              num_samples=result.num_samples, train_loss=result.mean_loss, steps=result.steps)
        self.last_round = round
        self._state = RoleState.IDLE
        return [SendToParent(update)]

    def tick(self, now: float) -> list[Action]:
        self._guard()
        return []


# --- edge --------------------------------------------------------------------------------------


class Edge(StateGuard):
    """Aggregates one cell per round and forwards the cell's average change upward."""

    def __init__(self, *, cell: str, rollout: str, parent: str = "cloud") -> None:
        self.cell = cell
        self.rollout = rollout
        self.parent = parent
        self._state = RoleState.IDLE
        self._task: CellTask | None = None
        self._config: FedAvgConfig | None = None
        self._deadline = math.inf
        self._updates: dict[str, DeviceUpdate] = {}

    @property
    def round(self) -> int:
        return self._task.round if self._task is not None else -1

    @property
    def reported(self) -> tuple[str, ...]:
        return tuple(sorted(self._updates))

    def _device_task(self) -> DeviceTask:
        assert self._task is not None
        return DeviceTask(rollout=self.rollout, round=self._task.round, sender=self.cell,
                          params=self._task.params, config=self._task.config, members=self._task.members)

    def receive(self, message: Message, now: float) -> list[Action]:
        self._guard()
        if isinstance(message, CellTask):
            return self._on_task(message, now)
        if isinstance(message, DeviceUpdate):
            return self._on_update(message, now)
        raise UnexpectedMessageError(f"edge does not accept {message.KIND}")

    def _on_task(self, task: CellTask, now: float) -> list[Action]:
        if task.sender != self.parent:
            raise UnknownSenderError(f"cell task from {task.sender!r}, expected {self.parent!r}")
        if task.round == self.round:
            return [Dropped("duplicate", task.key)]
        if task.round < self.round:
            raise WrongRoundError(f"task for round {task.round}, cell is at round {self.round}")
        config = FedAvgConfig.from_dict(task.config)
        notes: list[Action] = []
        if self._state is RoleState.COLLECTING:
            notes.append(Note("round_abandoned", {"round": self.round, "reported": len(self._updates)}))
        self._task, self._config = task, config
        self._updates = {}
        self._deadline = now + config.deadline_s
        self._state = RoleState.COLLECTING
        return [*notes, Broadcast(self._device_task())]

    def _on_update(self, update: DeviceUpdate, now: float) -> list[Action]:
        if self._task is None:
            raise WrongRoundError(f"update for round {update.round} but no round is open")
        if update.round != self._task.round:
            if update.round < self._task.round:
                raise LateMessageError(f"update for round {update.round}; cell is at round {self._task.round}")
            raise WrongRoundError(f"update for future round {update.round}; cell is at {self._task.round}")
        if update.sender not in self._task.members:
            raise UnknownSenderError(f"{update.sender!r} is not a member of round {update.round}")
        if update.sender in self._updates:
            return [Dropped("duplicate", update.key)]
        if self._state is not RoleState.COLLECTING:
            raise LateMessageError(f"update from {update.sender!r} after the cell closed round {update.round}")
        _check_like(self._task.params, update.delta, f"update from {update.sender}")
        self._updates[update.sender] = update
        if len(self._updates) == len(self._task.members):
            return self._close(now)
        return []

    def tick(self, now: float) -> list[Action]:
        self._guard()
        if self._state is not RoleState.COLLECTING or self._task is None or now < self._deadline:
            return []
        assert self._config is not None
        need = quorum_count(self._config.quorum, len(self._task.members))
        if len(self._updates) >= need:
            return self._close(now)
        return []

    def resend(self, child: str, now: float) -> list[Action]:
        self._guard()
        if (self._state is RoleState.COLLECTING and self._task is not None and child in self._task.members
                and child not in self._updates):
            return [SendToChild(child, self._device_task())]
        return []

    def _close(self, now: float) -> list[Action]:
        assert self._task is not None and self._config is not None
        ids = sorted(self._updates)
        weights = [1.0 if self._config.weighting == "uniform" else float(self._updates[d].num_samples)
                   for d in ids]
        if sum(weights) <= 0:  # every reporting device had zero samples: weight them equally
            weights = [1.0] * len(ids)
        delta = aggregate.weighted_mean([(self._updates[d].delta, w) for d, w in zip(ids, weights, strict=True)])
        mean_loss = sum(self._updates[d].train_loss for d in ids) / len(ids)
        missing = sorted(set(self._task.members) - set(ids))
        update = CellUpdate(rollout=self.rollout, round=self._task.round, sender=self.cell, delta=delta,
                            weight=float(sum(weights)), reported=tuple(ids), mean_loss=mean_loss)
        self._state = RoleState.FORWARDED
        actions: list[Action] = [SendToParent(update)]
        if missing:
            actions.insert(0, Note("cell_closed_with_stragglers", {"round": self._task.round, "missing": missing}))
        return actions


# --- cloud -------------------------------------------------------------------------------------


class Cloud(StateGuard):
    """Drives rounds: sends tasks to cells, averages their updates by weight, advances the model."""

    def __init__(self, *, rollout: str, cells: Mapping[str, Sequence[str]], initial_params: Tensors,
                 config: FedAvgConfig, rounds: int, cloud_id: str = "cloud", start_round: int = 0,
                 model_version: int = 0) -> None:
        """
        Args:
            rollout: rollout id.
            cells: cell id -> member device ids (every round uses all members).
            initial_params: global parameters at ``start_round``.
            config: the rollout's FedAvg settings.
            rounds: total number of rounds; the rollout finishes after round ``rounds - 1``.
            cloud_id: sender id of the cloud's messages.
            start_round: first round to run (> 0 when resuming from saved state).
            model_version: version number of ``initial_params``; incremented every round.
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
        self._state = RoleState.IDLE
        self._updates: dict[str, CellUpdate] = {}
        self._deadline = math.inf

    def _cell_task(self, cell: str) -> CellTask:
        return CellTask(rollout=self.rollout, round=self.round, sender=self.cloud_id, params=self.params,
                        members=self.cells[cell], config=self.config.to_dict(), model_version=self.model_version)

    def _open(self, now: float) -> list[Action]:
        self._updates = {}
        self._deadline = now + self.config.deadline_s
        self._state = RoleState.COLLECTING
        return [SendToChild(cell, self._cell_task(cell)) for cell in sorted(self.cells)]

    def start(self, now: float) -> list[Action]:
        self._guard()
        if self._state is not RoleState.IDLE:
            raise self._misuse("start() called twice")
        if self.round >= self.rounds:
            self._state = RoleState.FINISHED
            return [Finished(self.rounds)]
        return self._open(now)

    def receive(self, message: Message, now: float) -> list[Action]:
        self._guard()
        if not isinstance(message, CellUpdate):
            raise UnexpectedMessageError(f"cloud does not accept {message.KIND}")
        if message.sender not in self.cells:
            raise UnknownSenderError(f"cell update from unknown cell {message.sender!r}")
        if message.round < self.round or self._state is RoleState.FINISHED:
            raise LateMessageError(f"update for round {message.round}; cloud is at round {self.round}")
        if message.round > self.round or self._state is not RoleState.COLLECTING:
            raise WrongRoundError(f"update for round {message.round}; cloud is at round {self.round}")
        if message.sender in self._updates:
            return [Dropped("duplicate", message.key)]
        unknown = set(message.reported) - set(self.cells[message.sender])
        if unknown:
            raise UnknownSenderError(f"cell {message.sender!r} reports non-members {sorted(unknown)}")
        _check_like(self.params, message.delta, f"update from {message.sender}")
        self._updates[message.sender] = message
        if len(self._updates) == len(self.cells):
            return self._close(now)
        return []

    def tick(self, now: float) -> list[Action]:
        self._guard()
        if self._state is not RoleState.COLLECTING or now < self._deadline:
            return []
        if len(self._updates) >= quorum_count(self.config.quorum, len(self.cells)):
            return self._close(now)
        return []

    def resend(self, child: str, now: float) -> list[Action]:
        self._guard()
        if self._state is RoleState.COLLECTING and child in self.cells and child not in self._updates:
            return [SendToChild(child, self._cell_task(child))]
        return []

    def _close(self, now: float) -> list[Action]:
        cells = sorted(self._updates)
        delta = aggregate.weighted_mean([(self._updates[c].delta, self._updates[c].weight) for c in cells])
        self.params = aggregate.add(self.params, delta)
        self.model_version += 1
        reported = {c: self._updates[c].reported for c in cells}
        all_members = {d for m in self.cells.values() for d in m}
        missing = tuple(sorted(all_members - {d for r in reported.values() for d in r}))
        total_weight = sum(self._updates[c].weight for c in cells)
        mean_loss = sum(self._updates[c].mean_loss * self._updates[c].weight for c in cells) / total_weight
        closed = RoundClosed(round=self.round, params=self.params, reported=reported, missing=missing,
                             metrics={"train_loss": mean_loss, "model_version": self.model_version,
                                      "cells": {c: dict(self._updates[c].stats) for c in cells}})
        self.round += 1
        if self.round >= self.rounds:
            self._state = RoleState.FINISHED
            return [closed, Finished(self.rounds)]
        return [closed, *self._open(now)]

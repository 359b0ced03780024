"""Hierarchical FedAvg with secure aggregation in every cell: the edge learns only the cell's sum.

What ``[fedavg] secure_aggregation = true`` runs (the wire's algorithm name is
``secure_fedavg``). The round is FedAvg's (``fedtier.algorithms.fedavg``, one edge round) with
the device upload replaced by SecAgg+ (``fedtier.secagg.protocol``):

    edge   -> cell    DeviceTask(t, w_t)                         (as FedAvg)
    device: local steps; x_i = ring-encode(clip(w_i - w_t))      (``fedtier.secagg.ring``)
    device -> edge    SecAggKeys       edge -> each   SecAggRoster   (U1: its neighbours' keys)
    device -> edge    SecAggShares     edge -> each   SecAggBundle   (U2)
    device -> edge    SecAggMasked     edge -> each   SecAggUnmask   (U3, dropped: its neighbours)
    device -> edge    SecAggReveal     edge: sum of U3's x_i, decoded; mean = sum / |U3|
    edge   -> cloud   CellUpdate(mean, weight |U3|, reported U3)  (as FedAvg)

Each phase closes when everyone it waits for answered, or at its own deadline with whoever did.
The deadlines split the round's (``deadline_s``, which the cloud also waits): ``secagg_phases``
gives each phase a share of it, counted from the cell task's arrival and cumulated — keys
(training included) by ``f_1 deadline_s``, shares by ``(f_1 + f_2) deadline_s``, and so on — so a
phase that closes early leaves its time to the next ones, and the last closes by ``sum(f)
deadline_s``: what is left (at least 5 %) carries the cell's update to the cloud in time. A
cell with at least ``secagg_min_survivors`` answering devices thus always delivers within the
round. A phase that closes with fewer aborts the cell's round: a ``Note("secagg_abort")`` with
the typed reason, and a ``SecAggAborted`` report to the cloud instead of a cell update. The
cloud role here counts the cell as answered (the round closes as soon as every cell updated
or aborted and a quorum of cells updated) and hands the abort to the privacy ledger, which
charges nobody for a cell that aborted before any device revealed a share (nothing can ever be
unmasked: ``protocol.UNREVEALED``). Per round the edge says which phase closed without whom:
one ``Note("secagg_waited")`` and the cell update's ``stats["secagg_waited"]`` (phase -> devices).

Restrictions (validated): one edge round, uniform weighting (the edge sees only a sum, so it
cannot weight), no quantization (the ring encoding is the quantizer), no federated evaluation
(a device's held-out statistics would be individual values in clear). A device that restarts
mid-round has lost its session keys: it is a dropout for that round.

Under a noise plan every cell runs distributed DP (``fedtier.privacy.plan``, docs/privacy.md):
a device clips its delta to C, adds its share ``sigma_d = sigma_sum / sqrt(s_min)`` of the cell's
noise, and only then rounds into the ring (sized by ``NoisePlan.ring_clip`` so that its clipping
practically never touches the noise); the edge, which sees the sum alone, adds nothing and
reports one release record for the cell (``sqrt(|U3|) sigma_d`` on the sum, ``|U3| >= s_min``).
With device sampling every member takes part in the protocol and decides in secret (its own
noise source) whether it is sampled: the sampled train and contribute their noised clipped
delta, the others noise alone; the edge divides the sum by the public ``q n`` as a trusted edge
does, so the release never reveals who or how many were sampled.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fedtier.algorithms.base import Action, Dropped, LocalResult, LocalTrain, Note, RoleState, RoundClosed, \
    SendToChild, SendToParent
from fedtier.algorithms import strategies
from fedtier.algorithms.cloud import Cloud as _Cloud
from fedtier.algorithms.common import check_int, check_like
from fedtier.algorithms.fedavg import FedAvgConfig
from fedtier.algorithms.hier_qsgd import _DeviceBase, _EdgeBase
from fedtier.privacy import audit
from fedtier.privacy.mechanism import clip
from fedtier.privacy.plan import NoisePlan
from fedtier.errors import (
    LateMessageError,
    LocalProtocolError,
    UnexpectedMessageError,
    UnknownSenderError,
    WrongPhaseError,
    WrongRoundError,
)
from fedtier.rng import stream
from fedtier.secagg import ring
from fedtier.secagg.messages import (
    SecAggAborted,
    SecAggBundle,
    SecAggKeys,
    SecAggMasked,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
)
from fedtier.secagg.protocol import PHASES, Abort, DeviceSession, EdgeSession, Phase, SecAggParams, Unmasked
from fedtier.wire.messages import CellTask, CellUpdate, DeviceTask, Message, TrainingFailed

NAME = "secure_fedavg"

PHASE_SHARES = (0.6, 0.1, 0.1, 0.1)
"""Default shares of the round's deadline for the keys (training included), shares, masked and reveal
phases: together 0.9, so the cell's update leaves by 90 % of the deadline."""
MAX_PHASES_SHARE = 0.95
"""The phases may take at most this share of the round's deadline: the rest is the hops' (the cloud's task
to the edge, the cell's update to the cloud)."""


def check_phase_shares(shares: Any) -> tuple[float, ...]:
    """``secagg_phases`` as a tuple of four floats, or ``LocalProtocolError`` saying what is wrong."""
    if (not isinstance(shares, (list, tuple)) or len(shares) != len(PHASES)
            or not all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in shares)):
        raise LocalProtocolError(f"secagg_phases must be {len(PHASES)} shares of deadline_s (keys, shares, masked, "
                                 f"reveal), got {shares!r}")
    out = tuple(float(f) for f in shares)
    if not all(math.isfinite(f) and f > 0 for f in out) or sum(out) > MAX_PHASES_SHARE + 1e-9:
        raise LocalProtocolError(f"secagg_phases must each be > 0 and sum to at most {MAX_PHASES_SHARE} of "
                                 f"deadline_s (the rest carries the update to the cloud), got {shares!r}")
    return out

__all__ = ["SecureFedAvgConfig", "Device", "Edge", "Cloud", "NAME", "edge_sees_individual_updates"]


@dataclass(frozen=True, slots=True)
class SecureFedAvgConfig(FedAvgConfig):
    """``FedAvgConfig`` plus the secure-aggregation settings (every member of a cell uses the same).

    Attributes:
        secagg_min_survivors: s_min, the fewest devices a cell's sum may contain (a cell smaller
            than this never completes a round).
        secagg_degree: neighbours per device in the sharing graph (SecAgg+; the complete graph in
            cells of up to ``secagg_degree + 1`` devices).
        secagg_threshold: shares of a device's secrets needed to rebuild them, as a share of its
            neighbours in the roster (who hold them), in (0.5, 1]: a device may lose
            ``(1 - secagg_threshold)`` of them between the shares and reveal phases.
        secagg_bits: the ring Z_{2^bits} updates are encoded in (16..62).
        secagg_clip: L2 bound each device's update is clipped to before encoding.
        secagg_phases: each phase's share of ``deadline_s`` — keys (training included), shares,
            masked, reveal —, each > 0, at most ``MAX_PHASES_SHARE`` together (the rest carries the
            cell's update to the cloud within the round's deadline).
    """

    ALGORITHM: ClassVar[str] = NAME

    secagg_min_survivors: int = 2
    secagg_degree: int = 8
    secagg_threshold: float = 0.6
    secagg_bits: int = 48
    secagg_clip: float = 10.0
    secagg_phases: tuple[float, ...] = PHASE_SHARES

    def __post_init__(self) -> None:
        FedAvgConfig.__post_init__(self)
        if self.edge_rounds != 1:
            raise LocalProtocolError("secure aggregation runs one edge round per global round (edge_rounds = 1)")
        if self.weighting != "uniform":
            raise LocalProtocolError("secure aggregation needs weighting = 'uniform' (the edge sees only a sum)")
        check_int(self.secagg_min_survivors, "secagg_min_survivors", 1)
        check_int(self.secagg_degree, "secagg_degree", 2)
        object.__setattr__(self, "secagg_phases", check_phase_shares(self.secagg_phases))  # a task's list: a tuple
        self.params(1)  # validates threshold, bits and clip

    def phase_deadlines(self, start: float) -> tuple[float, ...]:
        """When each phase of a round whose cell task arrived at ``start`` closes at the latest (cumulated)."""
        ends, elapsed = [], 0.0
        for share in self.secagg_phases:
            elapsed += share
            ends.append(start + elapsed * self.deadline_s)
        return tuple(ends)

    def params(self, members: int, ring_clip: float | None = None) -> SecAggParams:
        """The protocol's parameters for a cell of ``members`` devices; ``ring_clip`` replaces
        ``secagg_clip`` under distributed DP (``NoisePlan.ring_clip``: room for the noise)."""
        return SecAggParams(min_survivors=self.secagg_min_survivors, degree=self.secagg_degree,
                            threshold_fraction=float(self.secagg_threshold),
                            codec=ring.RingCodec(bits=self.secagg_bits,
                                                 clip=float(self.secagg_clip if ring_clip is None else ring_clip),
                                                 max_inputs=max(1, members)))


def distributed_plan(plan: NoisePlan | None, cell: str, min_survivors: int) -> NoisePlan | None:
    """The task's plan if the cell runs distributed DP with the protocol's own ``s_min``; ``None``
    without a plan. A plan whose s_min is not the protocol's could accept sums with less noise than
    planned: refused."""
    if plan is None:
        return None
    p = plan.cells[cell]
    if not p.distributed:
        raise UnexpectedMessageError(f"secure aggregation under a noise plan needs distributed DP for cell {cell!r} "
                                     "(the plan's cell has no min_survivors)")
    if p.min_survivors != min_survivors:
        raise UnexpectedMessageError(f"the plan's s_min {p.min_survivors} for cell {cell!r} is not the protocol's "
                                     f"secagg_min_survivors {min_survivors}: a smaller sum would carry less noise")
    return plan


def edge_sees_individual_updates(config: Any) -> bool:
    """Whether an edge running ``config`` holds each device's update (False under secure aggregation).

    For aggregators that need individual updates (robust statistics, per-device weights): they
    must refuse a config for which this is False. ``config`` is an algorithm config, its dict
    (a task's ``config``), a rollout config (anything with ``algorithm_config()``), or anything
    with a ``secure_aggregation`` attribute (a ``[fedavg]`` section).
    """
    if hasattr(config, "secure_aggregation"):  # a [fedavg] section
        return not bool(config.secure_aggregation)
    if callable(getattr(config, "algorithm_config", None)):  # a rollout config
        config = config.algorithm_config()
    if isinstance(config, dict):
        return config.get("algorithm") != NAME and not config.get("secure_aggregation", False)
    return not (getattr(config, "ALGORITHM", None) == NAME or bool(getattr(config, "secure_aggregation", False)))


class Device(_DeviceBase):
    """Trains like a FedAvg device, then takes part in the cell's SecAgg+ round."""

    CONFIG: ClassVar[type[Any]] = SecureFedAvgConfig
    SUPPORTS_PRIVACY: ClassVar[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        kwargs["evaluate"] = False  # held-out statistics would reach the edge in clear
        super().__init__(**kwargs)
        self._session: DeviceSession | None = None
        self._encoded: np.ndarray | None = None
        self._members: tuple[str, ...] = ()

    def _max_start_step(self, config: Any) -> int:
        return 0

    def receive(self, message: Message, now: float) -> list[Action]:
        if isinstance(message, DeviceTask):
            answer = self._accept_task(message)
            if answer is not None:
                return answer
            self._session, self._encoded, self._members = None, None, message.members
            c = self._config
            distributed_plan(self._plan, self.cell, c.secagg_min_survivors)
            self._transition("task")
            if not self._sampled():  # distributed DP with sampling: take part with noise alone
                return self.trained(self._round, LocalResult(
                    delta={n: np.zeros_like(v) for n, v in self._params.items()}, num_samples=0, mean_loss=0.0,
                    steps=0))
            return [LocalTrain(round=self._round, step=0, params=self._params, steps=c.local_steps,
                               batch_size=c.batch_size, lr=c.lr,
                               stream=(c.seed, "batches", self.rollout, self.device_id, self._round, 0))]
        if isinstance(message, (SecAggRoster, SecAggBundle, SecAggUnmask)) and message.receiver != self.device_id:
            return [Dropped("not_addressed", message.key)]
        if isinstance(message, SecAggRoster):
            session = self._phase_message(message, Phase.SHARES)
            if session is None:
                return [Dropped("duplicate" if self._session else "no_session", message.key)]
            shares = session.share_keys(message.keys, message.size)
            return [SendToParent(SecAggShares(rollout=self.rollout, round=self._round, sender=self.device_id,
                                              shares=shares))]
        if isinstance(message, SecAggBundle):
            session = self._phase_message(message, Phase.MASKED)
            if session is None:
                return [Dropped("duplicate" if self._session else "no_session", message.key)]
            assert self._encoded is not None
            y = session.masked_input(self._encoded, message.shares)
            return [SendToParent(SecAggMasked(rollout=self.rollout, round=self._round, sender=self.device_id,
                                              masked=y, width=(session.params.codec.bits + 7) // 8))]
        if isinstance(message, SecAggUnmask):
            session = self._phase_message(message, Phase.REVEAL)
            if session is None:
                return [Dropped("duplicate" if self._session else "no_session", message.key)]
            reveal = session.unmask(message.survivors, message.dropped, message.count)
            self._encoded = None
            self._finish_round()
            return [SendToParent(SecAggReveal(rollout=self.rollout, round=self._round, sender=self.device_id,
                                              shares=reveal))]
        raise UnexpectedMessageError(f"device does not accept {message.KIND}")

    def _phase_message(self, msg: Message, phase: Phase) -> DeviceSession | None:
        """The session if ``msg`` is for the phase it is in; ``None`` for a redelivery of a past phase."""
        if msg.sender != self.cell:
            raise UnknownSenderError(f"{msg.KIND} from {msg.sender!r}, expected cell {self.cell!r}")
        if msg.round < self._round:
            raise LateMessageError(f"{msg.KIND} for round {msg.round}; device is at round {self._round}")
        if msg.round > self._round:
            raise WrongRoundError(f"{msg.KIND} for round {msg.round}; device is at round {self._round}")
        if self._session is None:
            return None  # still training, or restarted: this device is a dropout of the round
        order = [Phase.KEYS, Phase.SHARES, Phase.MASKED, Phase.REVEAL, Phase.DONE]
        if order.index(self._session.phase) > order.index(phase):
            return None
        if self._session.phase is not phase:
            raise WrongPhaseError(f"{msg.KIND} while the device is in phase {self._session.phase.value}")
        return self._session

    def trained(self, round: int, result: LocalResult) -> list[Action]:
        self._transition("trained")
        if round != self._round:
            return [Dropped("superseded", f"local/{round}", f"now at round {self._round}")]
        check_like(self._params, result.delta, "local result")
        c = self._config
        vector, ring_clip = self._privatized(result.delta)
        params = c.params(len(self._members), ring_clip)
        self._encoded = params.codec.encode(vector, stream(c.seed, "secagg_rounding", self.rollout, self.device_id,
                                                           self._round))
        self._session = DeviceSession(self.device_id, self._members, params, c.seed, self.rollout, self._round)
        keys = self._session.advertise()
        self._uploaded(0)
        self._transition("uploaded")
        return [SendToParent(SecAggKeys(rollout=self.rollout, round=self._round, sender=self.device_id,
                                        c_pk=keys.c_pk, s_pk=keys.s_pk, b_commit=keys.b_commit))]


    def _sampled(self) -> bool:
        """Whether this device contributes its update this round: always, except under distributed DP
        with device sampling, where it draws ``u < q`` from its own noise source — a secret from the
        edge, which sees every member take part either way."""
        plan = self._plan
        if plan is None or not plan.sampled:
            return True
        u = self.noise.generator("sample", self.rollout, self.device_id, self._round).random()
        return bool(u < plan.sample_rate)

    def _privatized(self, delta: Any) -> tuple[np.ndarray, float | None]:
        """The vector to encode and the ring's clip: the delta as is without a plan; under distributed DP
        the delta clipped to C plus this device's share of the cell's noise, and a ring clip with room
        for the noise (noise before rounding: docs/privacy.md "Distributed DP")."""
        plan = self._plan
        if plan is None:
            return ring.flatten(delta), None
        clipped, _ = clip(delta, plan.clip)
        noised = self.noise.add(clipped, plan.device_sigma(self.cell), "dp", self.rollout, self.device_id,
                                self._round, 0, secure=plan.secure_noise)
        vector = ring.flatten(noised)
        return vector, plan.ring_clip(self.cell, vector.size)


class Edge(_EdgeBase):
    """Runs the cell's SecAgg+ round; forwards the decoded mean of the survivors' updates."""

    CONFIG: ClassVar[type[Any]] = SecureFedAvgConfig
    SUPPORTS_PRIVACY: ClassVar[bool] = True
    CLOSES_ON_FAILURE: ClassVar[bool] = False  # a failed device is a dropout: the phase deadlines close without it

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.session: EdgeSession | None = None
        self.aborts: list[Abort] = []
        self._survivors: list[str] = []
        self._opened = 0.0
        self._phase_ends: tuple[float, ...] = ()
        """When each phase of the open round closes at the latest (``SecureFedAvgConfig.phase_deadlines``)."""
        self._waited: dict[str, tuple[str, ...]] = {}
        """Phase -> the members it closed without at its deadline, in the open round."""

    def _begin_step(self, now: float, event: str) -> None:
        self._opened = now  # the phases' deadlines count from the task's arrival (``_start``)
        super()._begin_step(now, event)

    def _start(self, config: Any) -> None:
        assert self._task is not None
        length = sum(int(np.prod(p.shape)) for p in self._params.values())
        plan = distributed_plan(self._plan, self.cell, config.secagg_min_survivors)
        ring_clip = plan.ring_clip(self.cell, length) if plan is not None else None
        self.session = EdgeSession(self._task.members, config.params(len(self._task.members), ring_clip), config.seed,
                                   self.rollout, self._task.round, length)
        self._phase_ends = config.phase_deadlines(self._opened)
        self._deadline = self._phase_ends[0]
        self._waited = {}

    @property
    def reported(self) -> tuple[str, ...]:
        return self.session.answered() if self.session is not None else ()

    def receive(self, message: Message, now: float) -> list[Action]:
        if isinstance(message, CellTask):
            self._check_edge_rule(message)
            return self._on_task(message, now)
        if isinstance(message, TrainingFailed):
            return self._on_failed(message, now)
        handlers = {SecAggKeys: lambda s, m: s.receive_keys(m.sender, m.advertised()),
                    SecAggShares: lambda s, m: s.receive_shares(m.sender, m.shares),
                    SecAggMasked: lambda s, m: s.receive_masked(m.sender, m.masked),
                    SecAggReveal: lambda s, m: s.receive_reveal(m.sender, m.shares)}
        handler = handlers.get(type(message))
        if handler is None:
            raise UnexpectedMessageError(f"edge does not accept {message.KIND}")
        session = self._admit_secagg(message)
        if not handler(session, message):
            return [Dropped("duplicate", message.key)]
        self._seen.add(message.key)
        return self._advance(now) if session.complete() else []

    def _check_edge_rule(self, task: CellTask) -> None:
        """Refuse (before any state changes) a task whose edge rule needs each device's update."""
        config = self.CONFIG.from_dict(task.config)
        try:
            strategies.check_visibility(strategies.parse_strategy(config.strategy)["edge"], "edge",
                                        individual=edge_sees_individual_updates(config))
        except strategies.StrategyError as exc:
            raise UnexpectedMessageError(f"task's edge aggregator: {exc}") from None

    def _admit_secagg(self, msg: Message) -> EdgeSession:
        if self._task is None or self.session is None:
            raise WrongRoundError(f"{msg.KIND} for round {msg.round} but no round is open")
        if msg.round < self._task.round:
            raise LateMessageError(f"{msg.KIND} for round {msg.round}; cell is at round {self._task.round}")
        if msg.round > self._task.round:
            raise WrongRoundError(f"{msg.KIND} for future round {msg.round}; cell is at {self._task.round}")
        if msg.sender not in self._task.members:
            raise UnknownSenderError(f"{msg.sender!r} is not a member of round {msg.round}")
        if self._state is not RoleState.COLLECTING:
            raise LateMessageError(f"{msg.KIND} after the cell's round closed ({self._state.value})")
        return self.session

    def tick(self, now: float) -> list[Action]:
        if self._state is not RoleState.COLLECTING or self.session is None or now < self._deadline:
            return []
        return self._advance(now)

    def overdue(self, now: float) -> tuple[str, ...]:
        if self._state is not RoleState.COLLECTING or self.session is None or now < self._deadline:
            return ()
        return tuple(sorted(set(self.session.expected()) - set(self.session.answered())))

    def resend(self, child: str, now: float) -> list[Action]:
        """Only while keys are collected can a (re)appearing device still join the round."""
        s = self.session
        if (self._state is RoleState.COLLECTING and s is not None and s.phase is Phase.KEYS
                and child in s.members and child not in s.answered()):
            return [SendToChild(child, self._device_task())]
        return []

    def _advance(self, now: float) -> list[Action]:
        """Close the current phase with whoever answered and start the next (or finish, or abort)."""
        s = self.session
        assert s is not None and self._task is not None
        r = self._task.round
        missing = tuple(sorted(set(s.expected()) - set(s.answered())))
        if missing:  # closed at its deadline: say who it waited for
            self._waited[s.phase.value] = missing
        self._deadline = self._phase_ends[min(PHASES.index(s.phase) + 1, len(self._phase_ends) - 1)]
        if s.phase is Phase.KEYS:
            roster = s.close_keys()
            if isinstance(roster, Abort):
                return self._abort(roster)
            return [SendToChild(d, SecAggRoster(rollout=self.rollout, round=r, sender=self.cell, receiver=d,
                                                keys=s.roster_for(d, roster), size=len(roster))) for d in roster]
        if s.phase is Phase.SHARES:
            bundles = s.close_shares()
            if isinstance(bundles, Abort):
                return self._abort(bundles)
            return [SendToChild(d, SecAggBundle(rollout=self.rollout, round=r, sender=self.cell, receiver=d,
                                                shares=b)) for d, b in bundles.items()]
        if s.phase is Phase.MASKED:
            closed = s.close_masked()
            if isinstance(closed, Abort):
                return self._abort(closed)
            survivors, dropped = closed
            actions: list[Action] = []
            for d in survivors:
                near_alive, near_gone = s.survivors_for(d, survivors, dropped)
                actions.append(SendToChild(d, SecAggUnmask(rollout=self.rollout, round=r, sender=self.cell,
                                                           receiver=d, survivors=near_alive, dropped=near_gone,
                                                           count=len(survivors))))
            return actions
        result = s.close_reveal()
        if isinstance(result, Abort):
            return self._abort(result)
        return self._finish(result)

    def _finish(self, result: Unmasked) -> list[Action]:
        codec = self.session.params.codec if self.session is not None else None
        assert codec is not None
        n = len(result.survivors)
        ids = list(result.survivors)
        plan = self._plan
        # Under distributed DP with sampling: the fixed, public denominator q n (as a trusted edge's release).
        denominator = plan.release_denominator(self.cell, n) if plan is not None else float(n)
        mean = ring.unflatten(codec.decode_sum(result.total) / denominator, self._params)
        self._updates = {d: None for d in ids}  # the base's bookkeeping: no per-device values are kept
        self._survivors = ids
        waited = self._waited_lists()
        forwarded = [dataclasses.replace(a, message=dataclasses.replace(
                         a.message, stats={**a.message.stats, "secagg_waited": waited}))
                     if waited and isinstance(a, SendToParent) and isinstance(a.message, CellUpdate) else a
                     for a in self._forward(mean, ids, [1.0] * n, 0.0, 0.0)]
        return [Note("secagg_unmasked", {"round": self.round, "survivors": n}), *self._waited_note(), *forwarded]

    def _waited_lists(self) -> dict[str, list[str]]:
        return {phase: list(ids) for phase, ids in self._waited.items()}

    def _waited_note(self) -> list[Action]:
        """The round's one line: which phase closed at its deadline without whom (none if nobody was waited for)."""
        return [Note("secagg_waited", {"round": self.round, "waited": self._waited_lists()})] if self._waited else []

    def _privatize(self, delta: Any) -> tuple[Any, dict[str, Any] | None]:
        """Distributed DP: the sum already carries the devices' noise; the edge adds none and reports the
        cell's one release (``NoisePlan.distributed_release``), charged like a trusted edge's."""
        plan = self._plan
        if plan is None:
            return delta, None
        assert self._task is not None
        ids = sorted(self._survivors)
        sigma, sensitivity, z = plan.distributed_release(self.cell, len(ids), len(ids))
        record = audit.release_record(plan=plan, node=self.cell, event="edge", round=self._task.round, step=0,
                                      sigma=sigma, sensitivity=sensitivity, z=z, protected=ids, reporters=len(ids))
        record["inputs"].update(distributed=True, min_survivors=plan.cells[self.cell].min_survivors,
                                survivors=len(ids))
        report = {"trusted": plan.cells[self.cell].trusted, "distributed": True, "steps": [ids],
                  "releases": [record], "clear": []}
        return delta, report

    def _abort(self, abort: Abort) -> list[Action]:
        """No cell update for this round: the cloud is told why instead (and, through it, the privacy ledger)."""
        self.aborts.append(abort)
        self._transition("abort")  # the next task starts afresh
        report = SecAggAborted(rollout=self.rollout, round=self.round, sender=self.cell, phase=abort.phase,
                               reason=abort.reason, have=abort.have, need=abort.need,
                               waited={p: tuple(ids) for p, ids in self._waited.items()})
        return [Note("secagg_abort", {"round": self.round, "phase": abort.phase, "reason": abort.reason,
                                      "have": abort.have, "need": abort.need}),
                *self._waited_note(), SendToParent(report)]

    def _close(self, now: float) -> list[Action]:  # the base's deadline path is replaced by tick()
        return self._advance(now)


class Cloud(_Cloud):
    """The rounds of a secure-aggregation rollout: ``fedtier.algorithms.cloud.Cloud`` plus the cells' abort reports.

    A cell that reports ``SecAggAborted`` for the open round has answered: it sends no update for it, so the round
    closes as soon as every cell updated or aborted (else at the deadline once a quorum of cells updated, as
    before). Once every cell answered nobody is left to wait for, so the quorum does not hold the round open: with
    fewer updates than the quorum, or none at all (every cell aborted: the model stays as it was, a new version
    of the same weights), the round closes and the next one opens, so that cells below ``s_min`` cost each round
    their phase deadlines and never the rollout. The closed round carries the aborts
    in ``metrics["secagg_aborts"]`` and, under a noise plan, in ``metrics["privacy"][cell]["secagg_abort"]`` for
    the ledger (``PrivacyLedger.rows_for_round``). A report that arrives after the round closed is refused as
    late: the ledger has charged the cell's planned release, as for any cell that did not report in time.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._aborted: dict[str, SecAggAborted] = {}

    def receive(self, message: Message, now: float) -> list[Action]:
        if isinstance(message, SecAggAborted):
            return self._on_abort(message, now)
        if isinstance(message, CellUpdate) and message.sender in self._aborted and message.round == self.round:
            raise UnexpectedMessageError(f"cell update from {message.sender!r}, whose secure aggregation of round "
                                         f"{message.round} aborted")
        opened = self.round
        actions = super().receive(message, now)
        return actions if self.round != opened else [*actions, *self._close_if_answered(now)]

    def _on_abort(self, message: SecAggAborted, now: float) -> list[Action]:
        duplicate = self._check_cell_message(message, "abort report", self._aborted)
        if duplicate:
            return duplicate
        if message.sender in self._updates:
            raise UnexpectedMessageError(f"abort report from {message.sender!r}, whose update of round "
                                         f"{message.round} arrived")
        self._aborted[message.sender] = message
        note = Note("cell_aborted", {"round": message.round, "cell": message.sender, "phase": message.phase,
                                     "reason": message.reason})
        return [note, *self._close_if_answered(now)]

    def _close_if_answered(self, now: float) -> list[Action]:
        """Close the round when every cell updated or aborted (whatever the quorum: no answer is left to come)."""
        if (self._state is not RoleState.COLLECTING or not self._aborted
                or set(self._updates) | set(self._aborted) != set(self._round_cells)):
            return []
        return self._close(now)

    def _open(self, now: float) -> list[Action]:
        self._aborted = {}
        return super()._open(now)

    def _close(self, now: float) -> list[Action]:
        aborts = {c: {"phase": m.phase, "reason": m.reason, "have": m.have, "need": m.need,
                      "waited": {p: list(ids) for p, ids in m.waited.items()}}
                  for c, m in sorted(self._aborted.items())}
        private = self._noise_plan() is not None
        actions = super()._close(now)
        if not aborts:
            return actions
        return [self._with_aborts(a, aborts, private) if isinstance(a, RoundClosed) else a for a in actions]

    @staticmethod
    def _with_aborts(closed: RoundClosed, aborts: dict[str, dict[str, Any]], private: bool) -> RoundClosed:
        metrics = {**closed.metrics, "secagg_aborts": aborts}
        if private:
            metrics["privacy"] = {**closed.metrics.get("privacy", {}),
                                  **{c: {"secagg_abort": {"phase": a["phase"], "reason": a["reason"]}}
                                     for c, a in aborts.items()}}
        return dataclasses.replace(closed, metrics=metrics)

    def resend(self, child: str, now: float) -> list[Action]:
        return [] if child in self._aborted else super().resend(child, now)

    def overdue(self, now: float) -> tuple[str, ...]:
        return tuple(c for c in super().overdue(now) if c not in self._aborted)

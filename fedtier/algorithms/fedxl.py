"""FeDXL: federated deep X-risk optimization — AUROC and partial AUROC with pairs across devices.

Z. Guo, R. Jin, J. Luo, T. Yang, "FeDXL: Provable Federated Learning for Deep X-Risk
Optimization", ICML 2023: Algorithm 1 (FeDXL1, linear outer function), Algorithm 2 (FeDXL2,
nonlinear outer function), Algorithm 3 (partial participation); losses in ``fedtier.algorithms.xrisk``.

Theory of operation
-------------------
A pairwise risk needs pairs whose two halves sit on different devices — a device of positives
only has no pair at all on its own. FeDXL splits every gradient term into an *active* factor
(the device's own data and current model) and a *passive* factor (other devices' scores, and for
FeDXL2 their inner-function estimates ``u``) taken from a pool the server merged from the
*previous* round's scores. Raw data never moves; only scalars ``h(w, z)`` do.

Round ``r`` (``K`` = ``local_steps``, ``B1`` = ``batch_size``, ``B2`` = ``batch_neg``):

1. cloud -> edge -> devices: ``w_r``, ``G_r`` (FeDXL2: the averaged momentum) and the pool ``P_{r-1}``
   — the positive scores (with their ``u``) and negative scores every participating device
   computed in round ``r-1``, concatenated by device (``XRiskCellTask``/``XRiskDeviceTask``;
   ``pool.round = r - 1``, refused otherwise: the staleness is exactly one round);
2. device ``i``: shuffle the pool (``H1`` and ``U`` with one permutation, ``H2`` with another, stream
   ``(seed, "xrisk-pool", rollout, i, r)``), then ``K`` times:
   a. score ``B1`` local positives and ``B2`` local negatives with the current local model (``ScoreRows``,
      rows from stream ``(seed, "xrisk-rows", rollout, i, r, k)``);
   b. take the next ``B2`` passive negatives and ``B1`` passive (positive, ``u``) pairs from the shuffled
      pool (cycling); FeDXL2 updates ``u`` of the sampled positives (Eq. 11) against the passive
      negatives; compute the step's coefficients (``xrisk.step_coefficients``, Eq. 5-6 / 12-13);
   c. one gradient of the weighted sum of scores (``ScoreGradient``: the bundle's ``weighted_score``
      training graph); FeDXL1: ``w <- w - lr g``; FeDXL2: ``G <- (1 - beta) G + beta g``, ``w <- w - lr G``;
   and upload ``w - w_r``, ``G`` (FeDXL2) and the round's active scores ``H1``, ``H2`` (and the updated
   ``u`` of those positives), optionally ``upload_scores`` of each chosen at random
   (``XRiskDeviceUpdate``, ``scores.round = r``);
3. edge: weighted *sums* of the changes and momenta with their total weight, the score lists
   concatenated in device order — never averaged (``XRiskCellUpdate``);
4. cloud: ``w_{r+1} = w_r + sum_c S_c / sum_c W_c``, ``G_{r+1}`` likewise, the pool ``P_r`` = the cells'
   lists concatenated in cell order; these go out in round ``r + 1``.

There is no pool before round 0, so round 0 only collects one (Alg. 1 l.3-4, Alg. 2 init): every
device scores ``K B1`` positives and ``K B2`` negatives with ``w_0`` and uploads them with a zero
change; training starts in round 1. A cloud resumed after a crash has lost the pool (it lives in
memory) and does the same once. With ``pairs = "local"`` (the paper's *Local Pair* baseline) a
device pairs its own active scores only, needs no pool and uploads no scores.

Partial participation (Alg. 3): with ``participation < 1`` the cloud samples that share of the
devices each training round (stream ``(seed, "xrisk-participants", rollout, r)``, at least one);
only they train, report and contribute scores; ``u`` changes only on them. The pool-collecting
round takes everyone.

A device that reports without scores (``scores`` empty) is accepted: it adds nothing to the pool;
one that does not report is handled by the deadline and quorum like any straggler. Score lists
are checked at the edge (lengths ``K B`` or 0 per class, or the configured ``upload_scores``; scores
in [0, 1]; ``u >= 1``; the round) and at the cloud (the round, the sources), and refused with a
typed reason (``bad_scores``, ``stale_scores``) the shells count.

Differential privacy: scores and ``u`` are data-dependent releases the noise plan does not cover,
so these roles refuse a task with a noise plan, and configs refuse ``[privacy]`` with fedxl
(docs/privacy.md).

Transitions: ``hier_qsgd.DEVICE_TRANSITIONS``, ``EDGE_TRANSITIONS`` and ``cloud.CLOUD_TRANSITIONS``
(data, checked by ``StateGuard._transition``). A device trains (TRAINING) through K pairs of ``scored``
and ``gradient_done`` (the pool-collecting round: one ``scored``) and is IDLE once it uploaded; a
task with a pool of the wrong round is refused (IDLE). The edge forwards once every member reported,
or at the deadline with a quorum; the cloud's cells are those with a sampled device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from fedtier.algorithms import aggregate, xrisk
from fedtier.algorithms.base import (
    Action,
    Dropped,
    GradientResult,
    LocalResult,
    Note,
    RoleState,
    RowScores,
    ScoreGradient,
    ScoreRows,
    SendToParent,
)
from fedtier.algorithms.cloud import Cloud as _Cloud
from fedtier.algorithms.common import (
    RoundSettings,
    check_int,
    check_like,
    check_lr_schedule,
    device_weights,
    scheduled_lr,
)
from fedtier.algorithms.hier_qsgd import _DeviceBase, _EdgeBase
from fedtier.errors import (
    LocalProtocolError,
    ScoreListError,
    StaleScoresError,
    UnexpectedMessageError,
)
from fedtier.rng import stream
from fedtier.wire.messages import (
    Message,
    ScorePool,
    TrainingFailed,
    XRiskCellTask,
    XRiskCellUpdate,
    XRiskDeviceTask,
    XRiskDeviceUpdate,
)

NAME = "fedxl"

__all__ = ["FedXLConfig", "Device", "Edge", "Cloud", "NAME", "PassivePool"]

PAIRS = ("global", "local")
POSITIVE, NEGATIVE = 1, 0
"""Class labels: 1 is the positive class (S1, the rare event), 0 the negative class (S2)."""
_U_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class FedXLConfig(RoundSettings):
    """FeDXL's settings (``RoundSettings`` plus):

    Attributes:
        objective: ``auroc`` (FeDXL1: squared hinge, linear f), ``psm`` (FeDXL1: pairwise sigmoid, linear f) or
            ``pauc`` (FeDXL2: KL-OPAUC).
        local_steps: K, steps per round (the communication interval).
        batch_neg: B2, negatives per step (0: ``batch_size``, which is B1, the positives per step).
        margin: m of the hinge ``(m - a + b)_+``.
        lam: lambda of KL-OPAUC.
        gamma: the moving-average rate of ``u`` (Eq. 11), in (0, 1].
        beta: the momentum rate of FeDXL2, ``G <- (1 - beta) G + beta g``, in (0, 1] (1: no momentum).
        pairs: ``global`` (FeDXL: passive scores from every device) or ``local`` (the Local Pair baseline).
        upload_scores: how many scores of each class a device uploads per round (a random subset of the
            ``K B`` it computed; 0: all of them). The paper needs at least ``ceil(K / N) B`` per list.
        participation: share of devices sampled per training round (Alg. 3); 1: everyone.
        lr_schedule: ``constant`` or ``step``: ``lr * lr_decay_factor ** (t // lr_decay_every)`` at local iteration
            ``t`` (counted from the first training round); the paper's (and its code's) schedule is
            ``step`` with the defaults, a tenth every 5,000 iterations.
        lr_decay_every: iterations between two decays (5,000 in the paper).
        lr_decay_factor: the decay's factor, in (0, 1] (0.1 in the paper).
    """

    ALGORITHM: ClassVar[str] = NAME

    objective: str = "auroc"
    local_steps: int = 32
    batch_neg: int = 0
    margin: float = 1.0
    lam: float = 1.0
    gamma: float = 0.1
    beta: float = 0.1
    pairs: str = "global"
    upload_scores: int = 0
    participation: float = 1.0
    lr_schedule: str = "constant"
    lr_decay_every: int = 5000
    lr_decay_factor: float = 0.1

    def __post_init__(self) -> None:
        RoundSettings.__post_init__(self)
        check_lr_schedule(self.lr_schedule, self.lr_decay_every, self.lr_decay_factor)
        xrisk.Objective(self.objective, self.margin, self.lam)  # validates objective, margin, lam
        check_int(self.local_steps, "local_steps", 1)
        check_int(self.batch_neg, "batch_neg", 0)
        check_int(self.upload_scores, "upload_scores", 0)
        for name in ("gamma", "beta", "participation"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise LocalProtocolError(f"{name} must be in (0, 1], got {value!r}")
        if self.pairs not in PAIRS:
            raise LocalProtocolError(f"pairs must be one of {PAIRS}, got {self.pairs!r}")
        if self.bits_device or self.bits_edge:
            raise LocalProtocolError("fedxl sends float32 (bits_device = bits_edge = 0)")

    @property
    def loss(self) -> xrisk.Objective:
        return xrisk.Objective(self.objective, self.margin, self.lam)

    @property
    def b1(self) -> int:
        return int(self.batch_size)

    @property
    def b2(self) -> int:
        return int(self.batch_neg or self.batch_size)

    @property
    def uses_pool(self) -> bool:
        return self.pairs == "global"

    def lr_at(self, round: int, step: int) -> float:
        """The learning rate of local step ``step`` of training round ``round``: the schedule's at iteration
        ``(round - first) K + step``, ``first`` the first training round (1 with a pool: round 0 collects it)."""
        first = 1 if self.uses_pool else 0
        return scheduled_lr(self.lr, self.lr_schedule, self.lr_decay_every, self.lr_decay_factor,
                            max(0, round - first) * self.local_steps + step)

    def to_dict(self) -> dict[str, Any]:
        out = RoundSettings.to_dict(self)
        if self.lr_schedule == "constant":  # settings added later: left out at their default, tasks stay byte for byte
            for key in ("lr_schedule", "lr_decay_every", "lr_decay_factor"):
                del out[key]
        return out

    def upload_count(self, computed: int) -> int:
        """How many of ``computed`` scores of one class a device uploads."""
        return computed if self.upload_scores == 0 else min(computed, self.upload_scores)


class PassivePool:
    """The passive buffers of one round: the pool shuffled once, then taken in order, cycling.

    ``H1`` (positive scores) and ``U`` share one permutation, so every passive ``u`` stays with the
    score of the same source sample (Alg. 2: "B_{i,1} and C_i with the same permutation"); ``H2`` has
    its own. Taking "the next" entries without replacement until a buffer is used up, then starting
    over, is Alg. 1 l.14's buffer.
    """

    def __init__(self, pool: ScorePool, gen: np.random.Generator) -> None:
        self._pos_perm = gen.permutation(len(pool.pos))
        self._neg_perm = gen.permutation(len(pool.neg))
        self.pos = np.asarray(pool.pos, np.float64)
        self.neg = np.asarray(pool.neg, np.float64)
        self.u = None if pool.u is None else np.asarray(pool.u, np.float64)
        self._pos_at = 0
        self._neg_at = 0

    @staticmethod
    def _take(perm: np.ndarray, at: int, count: int) -> tuple[np.ndarray, int]:
        if len(perm) == 0 or count == 0:
            return np.zeros(0, np.int64), at
        idx = perm[(at + np.arange(count)) % len(perm)]
        return idx, (at + count) % len(perm)

    def take_neg(self, count: int) -> np.ndarray:
        """The next ``count`` passive negative scores (none if the pool has none)."""
        idx, self._neg_at = self._take(self._neg_perm, self._neg_at, count)
        return self.neg[idx]

    def take_pos(self, count: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """The next ``count`` passive positives: ``(scores, their u or None, their pool indices)``."""
        idx, self._pos_at = self._take(self._pos_perm, self._pos_at, count)
        return self.pos[idx], (None if self.u is None else self.u[idx]), idx


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


class Device(_DeviceBase):
    """Runs K active/passive steps per round and uploads its model change, momentum and scores."""

    CONFIG: ClassVar[type[Any]] = FedXLConfig
    SUPPORTS_PRIVACY: ClassVar[bool] = False  # scores and u are releases the mechanism does not cover

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._u: dict[int, float] = {}
        """FeDXL2's persistent table: local positive row -> u (kept across rounds, never sent whole)."""
        self._pending = False
        """A step's gradient was requested and has not come back."""

    def _max_start_step(self, config: Any) -> int:
        return 0

    def receive(self, message: Message, now: float) -> list[Action]:
        if not isinstance(message, XRiskDeviceTask):
            raise UnexpectedMessageError(f"fedxl device does not accept {message.KIND}")
        answer = self._accept_task(message)
        if answer is not None:
            return answer
        c: FedXLConfig = self._config
        pool = message.pool
        self._collecting = c.uses_pool and pool.round < 0
        if c.uses_pool and not self._collecting:
            if pool.round != message.round - 1:
                self._transition("refuse")
                raise StaleScoresError(f"round {message.round} offers the scores of round {pool.round}; FeDXL's "
                                       f"passive pool is the previous round's ({message.round - 1})")
            if c.loss.compositional and pool.u is None:
                self._transition("refuse")
                raise ScoreListError("the pool of a pauc rollout carries no u values")
        self._passive = PassivePool(pool, stream(c.seed, "xrisk-pool", self.rollout, self.device_id, message.round))
        if c.loss.compositional:
            if message.momentum:
                check_like(self._params, message.momentum, "task momentum")
                self._momentum = aggregate.copy_tensors(message.momentum)
            else:
                self._momentum = {n: np.zeros_like(p) for n, p in self._params.items()}
        self._start = aggregate.copy_tensors(self._params)
        self._k = 0
        self._hist: dict[str, list[np.ndarray]] = {"pos": [], "neg": [], "u": []}
        self._values: list[float] = []
        self._pending = False
        self._transition("task")
        return [*self._evaluate_request(), self._score_request()]

    def _score_request(self) -> ScoreRows:
        c: FedXLConfig = self._config
        if self._collecting:  # the pool-collecting round: one pass of K B1 positives and K B2 negatives
            per_class = {POSITIVE: c.local_steps * c.b1, NEGATIVE: c.local_steps * c.b2}
        else:
            per_class = {POSITIVE: c.b1, NEGATIVE: c.b2}
        return ScoreRows(round=self._round, step=self._k, params=self._params, per_class=per_class,
                         stream=(c.seed, "xrisk-rows", self.rollout, self.device_id, self._round, self._k))

    def scored(self, round: int, step: int, result: RowScores) -> list[Action]:
        """The shell scored the step's rows: update ``u``, compute the coefficients, ask for the gradient."""
        self._transition("scored")
        if round != self._round:
            return [Dropped("superseded", f"scores/{round}/{step}", f"now at round {self._round}")]
        if self._pending or step != self._k:
            raise LocalProtocolError(f"scored() for step {step} while no scoring of it was requested")
        c: FedXLConfig = self._config
        obj = c.loss
        rows_pos = np.asarray(result.rows.get(POSITIVE, np.zeros(0, np.int64)), np.int64)
        rows_neg = np.asarray(result.rows.get(NEGATIVE, np.zeros(0, np.int64)), np.int64)
        s_pos = xrisk.sigmoid(result.outputs.get(POSITIVE, np.zeros(0)))
        s_neg = xrisk.sigmoid(result.outputs.get(NEGATIVE, np.zeros(0)))
        if len(s_pos) != len(rows_pos) or len(s_neg) != len(rows_neg):
            raise LocalProtocolError("scored(): outputs and rows differ in length")
        self._num_samples = result.num_samples
        if self._collecting:
            u_now = np.array([self._u.get(int(r), obj.u_init) for r in rows_pos.tolist()])
            return self._upload(s_pos, s_neg, u_now)
        if c.uses_pool:
            q_neg = self._passive.take_neg(c.b2)
            q_pos, q_u, _ = self._passive.take_pos(c.b1)
        else:  # Local Pair: the device's own active scores are the "passive" ones
            q_neg, q_pos, q_u = s_neg, s_pos, None
        if obj.compositional:
            g = xrisk.inner_estimates(obj, s_pos, q_neg)
            if len(g):
                u_now = xrisk.update_u(self._u, rows_pos, g, c.gamma, obj.u_init)
            else:  # no negative to pair with: u cannot be estimated this step
                u_now = np.array([self._u.get(int(r), obj.u_init) for r in rows_pos.tolist()])
            weight_pos = obj.outer_grad(u_now)
            if not c.uses_pool:
                q_u = u_now
            weight_passive = obj.outer_grad(q_u) if q_u is not None else np.ones(len(q_pos))
        else:
            u_now = np.zeros(0)
            weight_pos, weight_passive = np.ones(len(s_pos)), np.ones(len(q_pos))
        coef = xrisk.step_coefficients(obj, s_pos=s_pos, s_neg=s_neg, q_neg=q_neg, q_pos=q_pos,
                                       weight_pos=weight_pos, weight_passive=weight_passive)
        if coef.pairs:
            self._values.append(coef.value)
        self._hist["pos"].append(s_pos)
        self._hist["neg"].append(s_neg)
        if obj.compositional:
            self._hist["u"].append(u_now)
        rows = np.concatenate([rows_pos, rows_neg])
        weights = xrisk.score_weights(np.concatenate([coef.coef_pos, coef.coef_neg]), np.concatenate([s_pos, s_neg]))
        self._pending = True
        if not np.any(weights):  # no pair this step (a one-class device without partners): no gradient
            zero = {n: np.zeros_like(p) for n, p in self._params.items()}
            return self.gradient_done(self._round, self._k, GradientResult(grad=zero, loss=0.0,
                                                                           num_samples=result.num_samples))
        return [ScoreGradient(round=self._round, step=self._k, params=self._params, rows=rows,
                              weights=weights.astype(np.float32))]

    def gradient_done(self, round: int, step: int, result: GradientResult) -> list[Action]:
        """The gradient of the step's weighted scores: apply it (FeDXL2 through the momentum)."""
        self._transition("gradient_done")
        if round != self._round:
            return [Dropped("superseded", f"gradient/{round}/{step}", f"now at round {self._round}")]
        if not self._pending or step != self._k:
            raise LocalProtocolError(f"gradient_done() for step {step} while no gradient of it was requested")
        check_like(self._params, result.grad, "score gradient")
        c: FedXLConfig = self._config
        lr = np.float32(c.lr_at(round, step))
        if c.loss.compositional:
            beta = np.float32(c.beta)
            self._momentum = {n: ((np.float32(1) - beta) * self._momentum[n] + beta * np.asarray(result.grad[n],
                                                                                                np.float32))
                              for n in self._params}
            direction = self._momentum
        else:
            direction = {n: np.asarray(g, np.float32) for n, g in result.grad.items()}
        self._params = {n: (p - lr * direction[n]).astype(np.float32) for n, p in self._params.items()}
        self._pending = False
        self._k += 1
        if self._k < c.local_steps:
            return [self._score_request()]
        return self._upload(_concat(self._hist["pos"]), _concat(self._hist["neg"]),
                            _concat(self._hist["u"]) if c.loss.compositional else np.zeros(0))

    def _upload(self, pos: np.ndarray, neg: np.ndarray, u: np.ndarray) -> list[Action]:
        c: FedXLConfig = self._config
        compositional = c.loss.compositional
        if not c.uses_pool:
            pos, neg, u = np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros(0, np.float32)
        gen = stream(c.seed, "xrisk-upload", self.rollout, self.device_id, self._round)
        keep_pos = np.sort(gen.choice(len(pos), c.upload_count(len(pos)), replace=False)) if len(pos) else \
            np.zeros(0, np.int64)
        keep_neg = np.sort(gen.choice(len(neg), c.upload_count(len(neg)), replace=False)) if len(neg) else \
            np.zeros(0, np.int64)
        scores = ScorePool(round=self._round, pos=np.asarray(pos, np.float32)[keep_pos],
                           neg=np.asarray(neg, np.float32)[keep_neg],
                           u=np.asarray(u, np.float32)[keep_pos] if compositional and c.uses_pool else None,
                           sources=((self.device_id, len(keep_pos), len(keep_neg)),))
        momentum = ({n: np.asarray(g, np.float32) for n, g in self._momentum.items()} if compositional else {})
        delta = aggregate.subtract(self._params, self._start)
        update = XRiskDeviceUpdate(rollout=self.rollout, round=self._round, sender=self.device_id, step=0,
                                   delta=delta, num_samples=int(self._num_samples),
                                   train_loss=float(np.mean(self._values)) if self._values else 0.0,
                                   steps=0 if self._collecting else c.local_steps, q=0.0,
                                   evaluation=self._evaluation, momentum=momentum, scores=scores)
        self._uploaded(0)
        self._finish_round()
        return [SendToParent(update)]

    def trained(self, round: int, result: LocalResult) -> list[Action]:
        raise LocalProtocolError("fedxl devices run their steps as ScoreRows/ScoreGradient requests, not LocalTrain")


def check_scores(config: FedXLConfig, msg: XRiskDeviceUpdate, params: Mapping[str, np.ndarray]) -> None:
    """An edge's checks of a device's scores (module docstring); raises ``ScoreListError``/``StaleScoresError``."""
    scores = msg.scores
    if scores.round != msg.round:
        raise StaleScoresError(f"{msg.sender} sends scores of round {scores.round} with its update of round "
                               f"{msg.round}")
    if scores.sources != ((msg.sender, len(scores.pos), len(scores.neg)),):
        raise ScoreListError(f"{msg.sender}'s scores name sources {list(scores.sources)}, not itself alone")
    expected = {"positive": config.upload_count(config.local_steps * config.b1),
                "negative": config.upload_count(config.local_steps * config.b2)}
    if not config.uses_pool:
        expected = {"positive": 0, "negative": 0}
    for what, arr in (("positive", scores.pos), ("negative", scores.neg)):
        if len(arr) not in (0, expected[what]):
            raise ScoreListError(f"{msg.sender} sends {len(arr)} {what} scores; a round gives "
                                 f"{expected[what]} (or none, for a device without {what}s)")
        values = np.asarray(arr, np.float64)
        if len(values) and not (np.isfinite(values).all() and values.min() >= 0.0 and values.max() <= 1.0):
            raise ScoreListError(f"{msg.sender}'s {what} scores are not all in [0, 1]")
    wants_u = config.loss.compositional and config.uses_pool
    if wants_u != (scores.u is not None):
        raise ScoreListError(f"{msg.sender} {'omits' if wants_u else 'sends'} u values; a {config.objective} "
                             f"rollout with pairs = {config.pairs!r} {'needs' if wants_u else 'has'} none")
    if scores.u is not None and len(scores.u) and not (np.isfinite(scores.u).all()
                                                      and float(np.min(scores.u)) >= 1.0 - _U_TOLERANCE):
        raise ScoreListError(f"{msg.sender}'s u values are not all >= 1 (KL-OPAUC's inner function is >= 1)")
    if config.loss.compositional:
        check_like(params, msg.momentum, f"momentum from {msg.sender}")
    elif msg.momentum:
        raise ScoreListError(f"{msg.sender} sends a momentum; {config.objective} has none")


class Edge(_EdgeBase):
    """Relays the model and pool; sends the cell's weighted sums and its concatenated score lists."""

    CONFIG: ClassVar[type[Any]] = FedXLConfig
    SUPPORTS_PRIVACY: ClassVar[bool] = False

    def _device_task(self) -> XRiskDeviceTask:
        task = self._task
        assert isinstance(task, XRiskCellTask)
        return XRiskDeviceTask(rollout=self.rollout, round=task.round, sender=self.cell, step=0, params=self._params,
                               config=task.config, members=task.members, momentum=task.momentum, pool=task.pool)

    def receive(self, message: Message, now: float) -> list[Action]:
        if isinstance(message, XRiskCellTask):
            return self._on_task(message, now)
        if isinstance(message, XRiskDeviceUpdate):
            dropped = self._admit(message, 0)
            if dropped is not None:
                return dropped
            check_scores(self._config, message, self._params)
            return self._close(now) if self._accept(message, message.delta) else []
        if isinstance(message, TrainingFailed):
            return self._on_failed(message, now)
        raise UnexpectedMessageError(f"fedxl edge does not accept {message.KIND}")

    def _close(self, now: float) -> list[Action]:
        assert self._task is not None
        c: FedXLConfig = self._config
        ids = sorted(self._updates)
        updates = [self._updates[d] for d in ids]
        weights = device_weights(c.weighting, {d: self._updates[d].num_samples for d in ids}, ids)
        delta = _weighted_sum([u.delta for u in updates], weights)
        momentum = _weighted_sum([u.momentum for u in updates], weights) if c.loss.compositional else {}
        pool = merge([u.scores for u in updates], self._task.round)
        evaluation, evaluations = self._evaluations(ids)
        update = XRiskCellUpdate(rollout=self.rollout, round=self._task.round, sender=self.cell, delta=delta,
                                 weight=float(sum(weights)), reported=tuple(ids),
                                 mean_loss=sum(u.train_loss for u in updates) / len(ids), stats=evaluations, q=0.0,
                                 evaluation=evaluation, momentum=momentum, scores=pool)
        self._transition("forward")
        actions: list[Action] = [SendToParent(update)]
        missing = sorted(set(self._task.members) - set(ids))
        if missing:
            actions.insert(0, Note("cell_closed_with_stragglers", {"round": self._task.round, "missing": missing}))
        return actions


def _weighted_sum(items: list[Mapping[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    """``sum_i w_i x_i`` per tensor in float64 (in the order given), as float32."""
    out: dict[str, np.ndarray] = {}
    for name in items[0]:
        acc = np.zeros(np.shape(items[0][name]), np.float64)
        for tensors, w in zip(items, weights, strict=True):
            acc += float(w) * np.asarray(tensors[name], np.float64)
        out[name] = acc.astype(np.float32)
    return out


def merge(pools: list[ScorePool], round: int) -> ScorePool:
    """Score lists concatenated in the order given (never averaged), their sources kept in order."""
    with_u = [p for p in pools if p.u is not None]
    if with_u and len(with_u) != len(pools):
        raise ScoreListError("some score lists carry u values and others do not")
    return ScorePool(round=round, pos=_concat([np.asarray(p.pos, np.float32) for p in pools]),
                     neg=_concat([np.asarray(p.neg, np.float32) for p in pools]),
                     u=_concat([np.asarray(p.u, np.float32) for p in with_u]) if with_u else None,
                     sources=tuple(s for p in pools for s in p.sources))


class Cloud(_Cloud):
    """Averages models and momenta from the cells' sums, merges the pools, samples participants."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        config = self.config
        if not isinstance(config, FedXLConfig):
            raise LocalProtocolError(f"fedxl's cloud needs a FedXLConfig, got {type(config).__name__}")
        self.momentum: dict[str, np.ndarray] = (
            {n: np.zeros_like(p) for n, p in self.params.items()} if config.loss.compositional else {})
        self.pool = ScorePool(round=-1, u=np.zeros(0, np.float32) if config.loss.compositional else None)
        """The pool the next round sends down: the last closed round's merged scores (``round = -1``: none
        yet, after a start or a restart; that round then collects one)."""

    def _participants(self) -> dict[str, tuple[str, ...]]:
        c: FedXLConfig = self.config  # type: ignore[assignment]
        collecting = c.uses_pool and self.pool.round < 0
        if c.participation >= 1 or collecting:
            return dict(self.cells)
        devices = sorted(d for members in self.cells.values() for d in members)
        count = max(1, math.ceil(c.participation * len(devices) - 1e-9))
        gen = stream(c.seed, "xrisk-participants", self.rollout, self.round)
        chosen = set(np.asarray(devices)[np.sort(gen.choice(len(devices), count, replace=False))].tolist())
        out = {cell: tuple(d for d in members if d in chosen) for cell, members in self.cells.items()}
        return {cell: members for cell, members in out.items() if members}

    def _cell_task(self, cell: str) -> XRiskCellTask:
        return XRiskCellTask(rollout=self.rollout, round=self.round, sender=self.cloud_id, params=self.params,
                             members=self._round_cells[cell], config=self.config.to_dict(),
                             model_version=self.model_version, momentum=self.momentum, pool=self.pool)

    def receive(self, message: Message, now: float) -> list[Action]:
        if not isinstance(message, XRiskCellUpdate):
            raise UnexpectedMessageError(f"fedxl cloud does not accept {message.KIND}")
        if message.round == self.round and self._state is RoleState.COLLECTING:
            self._check(message)
        return super().receive(message, now)

    def _check(self, message: XRiskCellUpdate) -> None:
        c: FedXLConfig = self.config  # type: ignore[assignment]
        if message.scores.round != message.round:
            raise StaleScoresError(f"cell {message.sender} sends scores of round {message.scores.round} with its "
                                   f"update of round {message.round}")
        devices = [d for d, _, _ in message.scores.sources]
        if devices != sorted(message.reported):
            raise ScoreListError(f"cell {message.sender}'s score sources {devices} are not its reporting devices "
                                 f"{sorted(message.reported)} in order")
        if c.loss.compositional:
            check_like(self.params, message.momentum, f"momentum from {message.sender}")
            if c.uses_pool and message.scores.u is None:
                raise ScoreListError(f"cell {message.sender} sends no u values")

    def _aggregate(self, updates: Mapping[str, Any]) -> dict[str, Any]:
        """``w + sum_c S_c / sum_c W_c`` (and the momentum likewise) in float64; the pools concatenated."""
        c: FedXLConfig = self.config  # type: ignore[assignment]
        cells = sorted(updates)
        total = sum(float(updates[cell].weight) for cell in cells)
        delta = _weighted_sum([updates[cell].delta for cell in cells], [1.0 / total] * len(cells))
        if c.loss.compositional:
            self.momentum = _weighted_sum([updates[cell].momentum for cell in cells], [1.0 / total] * len(cells))
        self.pool = merge([updates[cell].scores for cell in cells], self.round)
        return aggregate.add(self.params, delta)

"""QHetFed: gradient aggregation inside each set, model aggregation across sets (seed 003).

S. M. Azimi-Abarghouyi, V. Fodor, "A Hierarchical Federated Learning Approach for the Internet
of Things", Sec. II-A, Algorithm 1, eqs. (4)–(10); digest ``papers/seed_003_qhetfed.md`` §2.1.

Theory of operation
-------------------
Global round ``t`` from ``w_t``; set ``l`` (an edge and its devices) holds the set model
``w^l`` — bit-identical on every device and on the edge, which verifies it by digest.

    i = 0 .. tau-1  (intra-set iterations, gradient aggregation)
        device n: g_n = grad F_n(w^l; batch from stream (seed, "batches", rollout, n, t, i))    (4)
                  upload Q1(g_n)                         DeviceGradient(step=i, sha(w^l))
        edge:     g = sum_n a_n Q1(g_n) / sum_n a_n                                             (5)
                  w^l <- w^l - mu g ;  broadcast CellStep(step=i, "gradient", g, sha(w^l))      (6)
        device n: w^l <- w^l - mu g   (the same float32 operation as the edge)
    device n: gamma local SGD steps from w^l, batches from streams (..., tau + j)              (7)-(8)
              upload Q1(Delta_n), Delta_n = -mu sum_j g_nj (summed in float64)  DeviceUpdate(step=tau)
    edge:     w^l_{t+1} = w^l + sum_n a_n Q1(Delta_n) / sum_n a_n                             (9)
              upload Q2(w^l_{t+1} - w_t) with weight N_l (or its samples)     CellUpdate
    cloud:    w_{t+1} = w_t + sum_l N_l Q2(.)_l / N          (fedtier.algorithms.cloud)       (10)

The local steps run as gradient requests and the change is summed in float64, so that with
``gamma = 1`` the upload is ``-mu g`` rounded once — and, QSGD being positively homogeneous
(``Q(-mu g) = -mu Q(g)`` with the same uniforms, digest §2.2), QHetFed(tau, gamma=1) follows
the trajectory of tau+1 gradient-aggregation steps to float tolerance, quantized or not.

Uniform device weights (1/N_l, N_l/N) are the paper's; ``weighting = "samples"`` is an option.
The downlink (aggregated gradients, global model) is exact float32, as the analysis assumes.

Transitions: ``hier_qsgd.DEVICE_TRANSITIONS`` and ``EDGE_TRANSITIONS`` (data, checked by
``StateGuard._transition``). A device computes a gradient of step ``i < tau`` in TRAINING and waits
for the set's average in WAITING; step ``tau``'s gamma local gradients are TRAINING too, and its
upload ends the round (IDLE). The edge collects every step (COLLECTING) and forwards after step tau.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from fedtier.algorithms import aggregate
from fedtier.algorithms.base import (
    Action,
    Broadcast,
    ComputeGradient,
    Dropped,
    GradientResult,
    LocalResult,
    SendToParent,
)
from fedtier.algorithms.cloud import Cloud
from fedtier.algorithms.common import RoundSettings, check_int, digest, quantize
from fedtier.algorithms.hier_qsgd import _DeviceBase, _EdgeBase
from fedtier.errors import LocalProtocolError, RemoteProtocolError, UnexpectedMessageError, WrongRoundError
from fedtier.wire.messages import CellStep, CellTask, DeviceGradient, DeviceTask, DeviceUpdate, Message, TrainingFailed

NAME = "qhetfed"

__all__ = ["QHetFedConfig", "Device", "Edge", "Cloud", "NAME", "DesyncError"]


class DesyncError(RemoteProtocolError):
    """A device's gradient was computed at a set model other than the edge's (digest differs)."""

    reason = "desync"


@dataclass(frozen=True, slots=True)
class QHetFedConfig(RoundSettings):
    """Per-rollout settings of QHetFed: ``RoundSettings`` (Table I: ``lr`` is mu, ``batch_size``
    is B, ``bits_device``/``bits_edge`` give s1, s2 = 2^(b-1) - 1) plus:

    Attributes:
        tau: intra-set gradient-aggregation iterations per global round (>= 0).
        gamma: local SGD steps before the model aggregation (>= 1).
    """

    ALGORITHM: ClassVar[str] = NAME

    tau: int = 12
    gamma: int = 3

    def __post_init__(self) -> None:
        RoundSettings.__post_init__(self)
        check_int(self.tau, "tau", 0)
        check_int(self.gamma, "gamma", 1)


class Device(_DeviceBase):
    """Uploads quantized gradients at the set model, applies the set's average, then gamma local steps."""

    CONFIG: ClassVar[type[Any]] = QHetFedConfig
    SUPPORTS_PRIVACY: ClassVar[bool] = False  # its gradient exchange is not covered by the mechanism yet

    def _max_start_step(self, config: Any) -> int:
        return int(config.tau)  # step tau = the local phase (a catch-up may start there)

    def receive(self, message: Message, now: float) -> list[Action]:
        if isinstance(message, DeviceTask):
            answer = self._accept_task(message)
            if answer is not None:
                return answer
            self._transition("task")  # TRAINING: the evaluation's answer arrives in that state
            first = self._begin()
            return [*self._evaluate_request(), first]
        if isinstance(message, CellStep):
            self._check_step(message, "gradient")
            self._params = aggregate.add(self._params, message.tensors_, scale=-self._config.lr)  # (6)
            if digest(self._params) != message.model_sha:
                return self._desync(message)
            self._step += 1
            self._transition("cell_step")
            return [self._begin()]
        raise UnexpectedMessageError(f"device does not accept {message.KIND}")

    def _gradient_request(self, params: Mapping[str, np.ndarray], stream_step: int) -> ComputeGradient:
        c = self._config
        return ComputeGradient(round=self._round, step=stream_step, params=params, batch_size=c.batch_size,
                               stream=(c.seed, "batches", self.rollout, self.device_id, self._round, stream_step))

    def _begin(self) -> ComputeGradient:
        """Next work at the current step (the device is TRAINING): a gradient (i < tau), or the first local
        step (i = tau)."""
        if self._step < self._config.tau:
            return self._gradient_request(self._params, self._step)
        self._local_params = self._params
        self._local_sum = {n: np.zeros(p.shape, np.float64) for n, p in self._params.items()}
        self._local_j = 0
        self._local_losses: list[float] = []
        return self._gradient_request(self._params, self._config.tau)

    def gradient_done(self, round: int, step: int, result: GradientResult) -> list[Action]:
        self._transition("gradient_done")
        if round != self._round:
            return [Dropped("superseded", f"gradient/{round}/{step}", f"now at round {self._round}")]
        c = self._config
        if self._step < c.tau:
            if step != self._step:
                raise LocalProtocolError(f"gradient for step {step}, requested step {self._step}")
            values, encodings, q = quantize(result.grad, c.bits_device, c.seed, "q1", self.rollout, self.device_id,
                                            self._round, self._step)
            msg = DeviceGradient(rollout=self.rollout, round=self._round, sender=self.device_id, step=self._step,
                                 grad=values, model_sha=digest(self._params), loss=result.loss,
                                 num_samples=result.num_samples, q=q)
            self._uploaded(self._step)
            self._transition("uploaded")
            return [SendToParent(msg, encodings)]
        # Local phase, (7)-(8): plain SGD, its change summed exactly.
        if step != c.tau + self._local_j:
            raise LocalProtocolError(f"gradient for step {step}, requested step {c.tau + self._local_j}")
        for name, g in result.grad.items():
            self._local_sum[name] += np.asarray(g, dtype=np.float64)
        self._local_losses.append(result.loss)
        self._local_j += 1
        if self._local_j < c.gamma:
            self._local_params = aggregate.add(self._local_params, result.grad, scale=-c.lr)
            return [self._gradient_request(self._local_params, c.tau + self._local_j)]
        change = {n: (-c.lr * s).astype(np.float32) for n, s in self._local_sum.items()}
        values, encodings, q = quantize(change, c.bits_device, c.seed, "q1", self.rollout, self.device_id,
                                        self._round, c.tau)
        update = DeviceUpdate(rollout=self.rollout, round=self._round, sender=self.device_id, step=c.tau,
                              delta=values, num_samples=result.num_samples,
                              train_loss=float(np.mean(self._local_losses)), steps=c.gamma, q=q,
                              evaluation=self._evaluation)
        self._uploaded(c.tau)
        self._finish_round()
        return [SendToParent(update, encodings)]

    def trained(self, round: int, result: LocalResult) -> list[Action]:
        raise LocalProtocolError("qhetfed devices run their local steps as gradient requests, not LocalTrain")


class Edge(_EdgeBase):
    """Averages its set's quantized gradients tau times, then their local changes once, and reports."""

    CONFIG: ClassVar[type[Any]] = QHetFedConfig
    SUPPORTS_PRIVACY: ClassVar[bool] = False
    STREAMS: ClassVar[bool] = True

    def _start(self, config: Any) -> None:
        self._w_t = self._params

    def receive(self, message: Message, now: float) -> list[Action]:
        if isinstance(message, CellTask):
            return self._on_task(message, now)
        if isinstance(message, DeviceGradient):
            if self._config is not None and message.step >= self._config.tau:
                raise WrongRoundError(f"gradient for step {message.step}; gradients have steps < tau")
            dropped = self._admit(message, self._step)
            if dropped is not None:
                return dropped
            if message.model_sha != digest(self._params):
                raise DesyncError(f"{message.sender} computed its gradient at another model than the set's")
            return self._close(now) if self._accept(message, message.grad) else []
        if isinstance(message, DeviceUpdate):
            if self._config is not None and message.step != self._config.tau:
                raise WrongRoundError(f"local change for step {message.step}; it belongs to step tau")
            dropped = self._admit(message, self._step)
            if dropped is not None:
                return dropped
            return self._close(now) if self._accept(message, message.delta) else []
        if isinstance(message, TrainingFailed):
            return self._on_failed(message, now)
        raise UnexpectedMessageError(f"edge does not accept {message.KIND}")

    def _close(self, now: float) -> list[Action]:
        assert self._task is not None
        c = self._config
        if self._step < c.tau:
            g, ids, _ = self._average("grad")                                        # (5)
            self._params = aggregate.add(self._params, g, scale=-c.lr)                # (6)
            msg = CellStep(rollout=self.rollout, round=self._task.round, sender=self.cell, step=self._step,
                           tensors_=g, kind="gradient", model_sha=digest(self._params), reported=tuple(ids))
            self._next_step(now)
            return [Broadcast(msg)]
        avg, ids, weights = self._average("delta")
        new_set_model = aggregate.add(self._params, avg)                              # (9)
        change = aggregate.subtract(new_set_model, self._w_t)
        mean_loss = sum(self._updates[d].train_loss for d in ids) / len(ids)
        device_q = sum(self._updates[d].q for d in ids) / len(ids)
        return self._forward(change, ids, weights, mean_loss, device_q)

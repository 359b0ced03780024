"""Pieces every hierarchical algorithm uses: quantizing an upload, checking tensors, quorum.

Quantization is part of the algorithm's mathematics (QHetFed's ``Q1``/``Q2``), so roles apply
it themselves — with the sender's own named RNG stream — and hand the wire values that are
already on the QSGD grid together with ``qsgd`` encodings that carry them losslessly.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping, TypeVar

import numpy as np

from fedtier.algorithms.server_opt import OptimizerSpec
from fedtier.algorithms.strategies import TIERS, parse_strategy
from fedtier.errors import LayoutMismatchError, LocalProtocolError, UnexpectedMessageError
from fedtier.privacy.plan import NoisePlan
from fedtier.rng import stream
from fedtier.wire import TensorEncoding, quant

Tensors = Mapping[str, np.ndarray]
WEIGHTINGS = ("uniform", "samples")
S = TypeVar("S", bound="RoundSettings")


def check_bits(value: Any, name: str) -> None:
    """0 (float32, no quantization) or a QSGD width ``quant.MIN_BITS..quant.MAX_BITS``."""
    if not (isinstance(value, int) and not isinstance(value, bool)
            and (value == 0 or quant.MIN_BITS <= value <= quant.MAX_BITS)):
        raise LocalProtocolError(f"{name} must be 0 (float32) or {quant.MIN_BITS}..{quant.MAX_BITS}, got {value!r}")


def check_int(value: Any, name: str, low: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise LocalProtocolError(f"{name} must be an int >= {low}, got {value!r}")


LR_SCHEDULES = ("constant", "step")
"""Learning-rate schedules: ``constant`` (``lr`` throughout) or ``step`` (``lr * factor ** (t // every)``)."""


def check_lr_schedule(schedule: Any, every: Any, factor: Any) -> None:
    """A schedule's settings: ``constant``, or ``step`` with ``every >= 1`` iterations and ``factor`` in (0, 1]."""
    if schedule not in LR_SCHEDULES:
        raise LocalProtocolError(f"lr_schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    check_int(every, "lr_decay_every", 0)
    if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor <= 1):
        raise LocalProtocolError(f"lr_decay_factor must be in (0, 1], got {factor!r}")
    if schedule == "step" and every < 1:
        raise LocalProtocolError("lr_schedule = 'step' needs lr_decay_every >= 1 (iterations between two decays)")


def scheduled_lr(lr: float, schedule: str, every: int, factor: float, iteration: int) -> float:
    """The learning rate of ``iteration`` (0-based local iterations since training began): ``lr`` for
    ``constant``; ``lr * factor ** (iteration // every)`` for ``step`` (e.g. halved every ``T0`` iterations).
    A pure function of the counters, so every node computes the same value without a clock."""
    if schedule == "constant":
        return float(lr)
    if iteration < 0:
        raise LocalProtocolError(f"iteration must be >= 0, got {iteration}")
    return float(lr) * float(factor) ** (iteration // every)


@dataclass(frozen=True, slots=True)
class RoundSettings:
    """Settings every hierarchical algorithm has; each algorithm's config adds its own.

    They travel inside every task (``to_dict``), so the cloud is the single source of truth
    and a device parses them with ``from_dict``.

    Attributes:
        batch_size: minibatch size (> 0).
        lr: SGD learning rate (>= 0; 0 leaves the model unchanged, useful in tests).
        weighting: "uniform" (every device counts 1, the papers' rule) or "samples".
        quorum: share of members (and of cells) enough once the deadline passed, in (0, 1].
        deadline_s: seconds before a step may close with a quorum.
        seed: rollout seed; names every RNG stream.
        bits_device: Q1, QSGD bit width of device uploads (0 = float32).
        bits_edge: Q2, QSGD bit width of the edge's upload (0 = float32).
        privacy: the rollout's noise plan (``fedtier.privacy.plan.NoisePlan.to_dict``), or
            ``None`` without differential privacy.
        federated_eval: devices with held-out rows evaluate each round's incoming global model
            on them and report it (never under a noise plan, whatever this says).
        strategy: how the tiers combine updates, or ``None`` for today's weighted means:
            ``{"edge": spec, "cloud": spec, "server_optimizer": spec, "edge_optimizer": spec}``, each part optional
            (``fedtier.algorithms.strategies.AggregatorSpec`` / ``server_opt.OptimizerSpec``
            as dicts). Left out of ``to_dict`` when ``None``, so tasks without one are
            byte-for-byte what they were before strategies existed.
        dp_clip: adaptive clipping (a plan with ``adaptive``): the round's clip bound C_t, moved by the cloud
            every round; ``noise_plan()`` applies it. Left out of ``to_dict`` when ``None``.
    """

    ALGORITHM: ClassVar[str] = ""

    batch_size: int = 32
    lr: float = 0.05
    weighting: str = "uniform"
    quorum: float = 1.0
    deadline_s: float = 60.0
    seed: int = 0
    bits_device: int = 0
    bits_edge: int = 0
    privacy: Mapping[str, Any] | None = None
    federated_eval: bool = True
    strategy: Mapping[str, Any] | None = None
    dp_clip: float | None = None

    def __post_init__(self) -> None:
        check_int(self.batch_size, "batch_size", 1)
        if not isinstance(self.federated_eval, bool):
            raise LocalProtocolError(f"federated_eval must be a bool, got {self.federated_eval!r}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise LocalProtocolError(f"lr must be finite and >= 0, got {self.lr!r}")
        if self.weighting not in WEIGHTINGS:
            raise LocalProtocolError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if not (0 < self.quorum <= 1):
            raise LocalProtocolError(f"quorum must be in (0, 1], got {self.quorum!r}")
        if not (self.deadline_s > 0):
            raise LocalProtocolError(f"deadline_s must be > 0, got {self.deadline_s!r}")
        check_bits(self.bits_device, "bits_device")
        check_bits(self.bits_edge, "bits_edge")
        if self.privacy is not None:
            if self.weighting != "uniform":
                raise LocalProtocolError("privacy needs weighting = 'uniform' (a device's reported sample count must "
                                         "not raise its weight, and so the sensitivity of its cell's mean)")
            try:
                plan = NoisePlan.from_dict(self.privacy)
            except UnexpectedMessageError as exc:
                raise LocalProtocolError(str(exc)) from None
            if self.dp_clip is not None and plan.adaptive is None:
                raise LocalProtocolError("dp_clip is the adaptive clip bound: the noise plan has no adaptive clipping")
        if self.dp_clip is not None and not (isinstance(self.dp_clip, (int, float)) and not isinstance(
                self.dp_clip, bool) and math.isfinite(self.dp_clip) and self.dp_clip > 0):
            raise LocalProtocolError(f"dp_clip must be finite and > 0, got {self.dp_clip!r}")
        if self.dp_clip is not None and self.privacy is None:
            raise LocalProtocolError("dp_clip is the adaptive clip bound of a noise plan, and there is none")
        if self.strategy is not None:
            check_strategy(self.strategy, private=self.privacy is not None)

    def noise_plan(self) -> NoisePlan | None:
        """The parsed noise plan (``None`` without differential privacy), at the round's clip bound."""
        if self.privacy is None:
            return None
        plan = NoisePlan.from_dict(self.privacy)
        return plan if self.dp_clip is None else plan.at_clip(float(self.dp_clip))

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.ALGORITHM, **{f.name: getattr(self, f.name) for f in fields(self)
                                                if not _omitted(f.name, getattr(self, f.name))}}

    @classmethod
    def from_dict(cls: type[S], config: Mapping[str, Any]) -> S:
        """Parse the ``config`` map of a task. Raises ``UnexpectedMessageError`` if invalid."""
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in config.items() if k in known})
        except (LocalProtocolError, TypeError) as exc:
            raise UnexpectedMessageError(f"invalid {cls.ALGORITHM} config in task: {exc}") from None


OMIT_AT_DEFAULT = {"strategy": None, "partial_work": False, "dp_clip": None, "roaming": False}
"""Settings added after tasks had a wire form: left out at their default, so such tasks stay byte for byte."""


def _omitted(name: str, value: Any) -> bool:
    return name in OMIT_AT_DEFAULT and value is OMIT_AT_DEFAULT[name]


def check_strategy(strategy: Mapping[str, Any], *, private: bool) -> None:
    """Validate a task's ``strategy`` map (without importing any custom rule: devices parse it too).

    Under a noise plan the edge must average: the plan calibrates the noise to the sensitivity of
    the cell's *mean* (2C/n); a median, a trimmed mean or a Krum choice has another one (Krum
    forwards one device's update: 2C). The cloud's rule and optimizer only post-process noised
    cell updates, which differential privacy allows.

    Raises:
        LocalProtocolError: naming the bad part.
    """
    if not isinstance(strategy, Mapping):
        raise LocalProtocolError(f"strategy must be a table, got {strategy!r}")
    unknown = set(strategy) - {*TIERS, "server_optimizer", "edge_optimizer"}
    if unknown:
        raise LocalProtocolError(f"unknown strategy keys {sorted(unknown)}; known: edge, cloud, server_optimizer, "
                                 "edge_optimizer")
    specs = parse_strategy(strategy)
    for key in ("server_optimizer", "edge_optimizer"):
        if key in strategy:
            OptimizerSpec.from_dict(strategy[key])
    if private and "edge_optimizer" in strategy:
        raise LocalProtocolError("under differential privacy the edge forwards its cell's (noised) mean; an edge "
                                 "optimizer would release another function of the clear updates")
    if private and specs["edge"].rule != "mean":
        raise LocalProtocolError(f"under differential privacy the edge must average (the noise is calibrated to the "
                                 f"sensitivity of the cell's mean); edge aggregator {specs['edge'].rule!r} has another")


def quantize(tensors: Tensors, bits: int, seed: int, *labels: Any
             ) -> tuple[dict[str, np.ndarray], dict[str, TensorEncoding], float]:
    """QSGD-quantize each tensor with its own stream ``(seed, *labels, name)``.

    Args:
        tensors: what to upload.
        bits: 2..8, or 0 for no quantization (float32 on the wire).
        seed, labels: name the sender's stream, e.g. ``(seed, "q1", rollout, device, round, step)``.

    Returns:
        ``(values, encodings, q)``: the quantized tensors, their wire encodings, and the
        measured relative variance of the whole upload (0 when ``bits == 0``).
    """
    if bits == 0:
        return {n: np.asarray(t, dtype=np.float32) for n, t in tensors.items()}, {}, 0.0
    values: dict[str, np.ndarray] = {}
    encodings: dict[str, TensorEncoding] = {}
    parts = []
    for name in sorted(tensors):
        qz = quant.qsgd(tensors[name], bits, stream(seed, *labels, name))
        values[name] = qz.values
        encodings[name] = TensorEncoding("qsgd", {"bits": bits, "norm": qz.norm})
        parts.append(qz)
    return values, encodings, quant.combined_q(parts)


def digest(tensors: Tensors) -> str:
    """sha256 of the tensors' names and float32 bytes, in name order: the set-model check value.

    Devices and their edge compute it over the model they hold after each intra-round step;
    equal digests mean bit-identical models.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(b"\0")
        h.update(np.ascontiguousarray(tensors[name], dtype=np.float32).tobytes())
    return h.hexdigest()


def check_like(reference: Tensors, tensors: Tensors, what: str) -> None:
    """Raise ``LayoutMismatchError`` unless ``tensors`` has ``reference``'s names and shapes."""
    if set(reference) != set(tensors):
        raise LayoutMismatchError(f"{what}: tensor names {sorted(tensors)} differ from the model's")
    shape_of = getattr(tensors, "shape_of", None)  # wire.DecodedTensors: without making deferred values
    for name, ref in reference.items():
        shape = shape_of(name) if shape_of is not None else tensors[name].shape
        if shape != ref.shape:
            raise LayoutMismatchError(f"{what}: {name} has shape {shape}, model {ref.shape}")


def quorum_count(quorum: float, members: int) -> int:
    """How many of ``members`` must report once the deadline has passed (at least 1)."""
    return max(1, math.ceil(quorum * members - 1e-9))


def device_weights(weighting: str, samples: Mapping[str, int], ids: list[str]) -> list[float]:
    """Per-device weights for an edge average: 1 each (``uniform``) or sample counts.

    All-zero sample counts fall back to uniform weights rather than dividing by zero.
    """
    if weighting == "uniform":
        return [1.0] * len(ids)
    weights = [float(samples[d]) for d in ids]
    return weights if sum(weights) > 0 else [1.0] * len(ids)

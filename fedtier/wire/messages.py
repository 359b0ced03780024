"""Typed messages of the hierarchy, one frozen dataclass per message type.

Each class knows its wire ``KIND`` and converts to and from ``wire.Envelope``;
``from_envelope`` validates every field and raises ``MalformedHeaderError`` (a
``DecodeError``) for a message that parsed but does not have the fields its type needs.

Idempotency keys are derived from what a message *is* — kind, rollout, round, step and
sender — not drawn at random. A device that crashes and resends its update from the outbox
sends the same key, and so does a QoS 1 redelivery, so receivers drop both as duplicates;
a replay of an old round carries an old round number and is rejected as a wrong round.

Tensor-carrying messages use ``eq=False`` (an array comparison is not one bool); tests
compare them with ``messages_equal``.

Body digests (``send_digest``): a message a child sends up (``UPWARD_KINDS``: device to edge, edge to
cloud) carries a CRC-32, everything else sha256, which nodes of every version read. Every node of this
version checks both, so the order of an upgrade is: the coordinator, then the edges, then the devices
(docs/protocol.md); ``FEDTIER_WIRE_DIGEST`` overrides the choice for every message a process sends.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping, TypeVar

import numpy as np

from fedtier import wire
from fedtier.errors import LocalProtocolError, MalformedHeaderError, ScoreListError, UnknownMessageTypeError
from fedtier.wire import Envelope, TensorEncoding

Tensors = Mapping[str, np.ndarray]


def make_key(kind: str, rollout: str, round: int, step: int, sender: str) -> str:
    """The idempotency key of a message: stable across resends and redeliveries."""
    return f"{kind}/{rollout}/{round}/{step}/{sender}"


UPWARD_KINDS = frozenset({
    "device_update", "device_gradient", "artifact_request", "hsgd_embeddings", "xrisk_device_update",
    "secagg_keys", "secagg_shares", "secagg_masked", "secagg_reveal",  # device (or HSGD's host) -> edge
    "cell_update", "xrisk_cell_update",  # edge -> cloud
})
"""Kinds sent up the hierarchy, to a node that is upgraded before its children (edges before their devices,
the coordinator before its edges): they carry the cheaper CRC-32. Kinds sent down keep sha256 until every
device reads CRC-32 (this version's do)."""

DIGEST_ENV = "FEDTIER_WIRE_DIGEST"
"""Environment variable: ``sha256`` makes this process send sha256 on everything (a device upgraded before its
edge), ``crc32`` CRC-32 on everything (a fleet whose every node runs this version or a later one)."""


def send_digest(kind: str) -> str:
    """The body digest a message of ``kind`` is sent with (module docstring)."""
    forced = os.environ.get(DIGEST_ENV)
    if forced:
        if forced not in wire.DIGESTS:
            raise LocalProtocolError(f"{DIGEST_ENV}={forced!r}: one of {', '.join(sorted(wire.DIGESTS))}")
        return forced
    return "crc32" if kind in UPWARD_KINDS else wire.SHA256


def _get(meta: Mapping[str, Any], key: str, typ: type | tuple[type, ...], *, default: Any = ...) -> Any:
    if key not in meta:
        if default is ...:
            raise MalformedHeaderError(f"message lacks field {key!r}")
        return default
    value = meta[key]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (typ is int or typ is float) and isinstance(value, bool):
        raise MalformedHeaderError(f"field {key!r} must be {typ.__name__}, got bool")
    if not isinstance(value, typ):
        raise MalformedHeaderError(f"field {key!r} has type {type(value).__name__}")
    if isinstance(value, float) and not np.isfinite(value):
        raise MalformedHeaderError(f"field {key!r} is not finite")
    return value


def _count(meta: Mapping[str, Any], key: str) -> int:
    value = _get(meta, key, int)
    if value < 0:
        raise MalformedHeaderError(f"field {key!r} is negative")
    return int(value)


def _nonneg(meta: Mapping[str, Any], key: str) -> float:
    value = _get(meta, key, float)
    if value < 0:
        raise MalformedHeaderError(f"field {key!r} is negative")
    return float(value)


def _str_list(meta: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = _get(meta, key, list)
    if not all(isinstance(v, str) for v in value):
        raise MalformedHeaderError(f"field {key!r} must be a list of strings")
    return tuple(value)


def _plain(value: Any, path: str = "config") -> Any:
    """Check that a config value is made of msgpack-safe plain types."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, path) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{path}.{k}") for k, v in value.items()}
    raise LocalProtocolError(f"{path}: {type(value).__name__} is not a plain value")


@dataclass(frozen=True, slots=True)
class EvalStats:
    """Federated evaluation of one model on held-out rows (devices' rows never trained on).

    ``loss`` is the mean loss over ``count`` rows; ``correct`` how many of them the model got
    right (``None`` for a loss without accuracy, ``mse``; fractional for multi-output ``bce``);
    ``devices`` how many devices' rows are summed (1 in a device update). Edges and the cloud
    combine them weighted by ``count`` (``fedtier.algorithms.aggregate.combine_evaluations``).
    ``auroc`` is one device's AUROC on its held-out rows of a binary task holding both classes
    (``fedtier.training.ranking``); a combination has none (AUROC is not a mean of per-row values).
    Each device's own stats also travel to the cloud, as rows (``to_row``) in a cell update's
    ``stats["evaluations"]`` (``CellUpdate.device_evaluations``).
    """

    loss: float
    count: int
    correct: float | None = None
    devices: int = 1
    auroc: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise LocalProtocolError(f"evaluation count must be an int >= 1, got {self.count!r}")
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise LocalProtocolError(f"evaluation devices must be an int >= 1, got {self.devices!r}")
        if not (isinstance(self.loss, (int, float)) and np.isfinite(self.loss) and self.loss >= 0):
            raise LocalProtocolError(f"evaluation loss must be finite and >= 0, got {self.loss!r}")
        if self.correct is not None and not (isinstance(self.correct, (int, float)) and np.isfinite(self.correct)
                                             and 0 <= self.correct <= self.count + 1e-6):
            raise LocalProtocolError(f"evaluation correct must be in [0, count], got {self.correct!r}")
        if self.auroc is not None and not (isinstance(self.auroc, (int, float)) and not isinstance(self.auroc, bool)
                                           and 0 <= self.auroc <= 1):
            raise LocalProtocolError(f"evaluation auroc must be in [0, 1], got {self.auroc!r}")
        if self.auroc is not None and self.devices != 1:
            raise LocalProtocolError("evaluation auroc is one device's: a combination of devices has none")

    @property
    def accuracy(self) -> float | None:
        return None if self.correct is None else float(self.correct) / self.count

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"loss": float(self.loss), "count": int(self.count), "devices": int(self.devices)}
        if self.correct is not None:
            meta["correct"] = float(self.correct)
        if self.auroc is not None:
            meta["auroc"] = float(self.auroc)
        return meta

    @classmethod
    def from_meta(cls, meta: Any) -> "EvalStats":
        """Parse a header's ``eval`` map; ``MalformedHeaderError`` if it is not one."""
        if not isinstance(meta, Mapping):
            raise MalformedHeaderError(f"field 'eval' has type {type(meta).__name__}")
        try:
            return cls(loss=_get(meta, "loss", float), count=_get(meta, "count", int),
                       correct=_get(meta, "correct", float, default=None), devices=_get(meta, "devices", int),
                       auroc=_get(meta, "auroc", float, default=None))
        except LocalProtocolError as exc:
            raise MalformedHeaderError(f"field 'eval': {exc}") from None

    def to_row(self) -> list[Any]:
        """One device's stats as a cell update carries them: ``[count, loss, correct, auroc]`` (``None`` for
        what it has not)."""
        return [int(self.count), float(self.loss), None if self.correct is None else float(self.correct),
                None if self.auroc is None else float(self.auroc)]

    @classmethod
    def from_row(cls, row: Any, device: str = "?") -> "EvalStats":
        """Parse ``to_row``'s list; ``MalformedHeaderError`` if it is not one."""
        where = f"stats.evaluations.{device}"
        if not isinstance(row, (list, tuple)) or len(row) != 4:
            raise MalformedHeaderError(f"field {where!r} must be [count, loss, correct, auroc]")
        count, loss, correct, auroc = row
        if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
                   for v in (loss, correct, auroc)) or loss is None:
            raise MalformedHeaderError(f"field {where!r} holds a value that is not a number")
        try:
            return cls(loss=float(loss), count=count, correct=None if correct is None else float(correct),
                       auroc=None if auroc is None else float(auroc))
        except LocalProtocolError as exc:
            raise MalformedHeaderError(f"field {where!r}: {exc}") from None


def _evaluation(meta: Mapping[str, Any]) -> EvalStats | None:
    return EvalStats.from_meta(meta["eval"]) if "eval" in meta else None


@dataclass(frozen=True, slots=True, eq=False)
class Message:
    """Fields every message has. Subclasses add theirs and set ``KIND``."""

    KIND: ClassVar[str] = ""
    TENSOR_FIELD: ClassVar[str | None] = None

    rollout: str
    round: int
    sender: str
    step: int = 0
    """Position within the round, for algorithms that exchange several messages per round
    (QHetFed's intra-set iterations, Hier-Local-QSGD's edge rounds). Part of the key."""

    @property
    def key(self) -> str:
        return make_key(self.KIND, self.rollout, self.round, self.step, self.sender)

    def _meta(self) -> dict[str, Any]:
        raise NotImplementedError

    def tensors(self) -> Tensors:
        return getattr(self, self.TENSOR_FIELD) if self.TENSOR_FIELD else {}

    def to_envelope(self, encodings: Mapping[str, TensorEncoding] | None = None) -> Envelope:
        return Envelope(
            type=self.KIND, rollout=self.rollout, round=self.round, step=self.step,
            sender=self.sender, key=self.key, meta=self._meta(), tensors=self.tensors(),
            encodings=dict(encodings or {}), digest=send_digest(self.KIND),
        )

    def encode(self, encodings: Mapping[str, TensorEncoding] | None = None) -> bytes:
        return wire.encode(self.to_envelope(encodings))

    @classmethod
    def from_envelope(cls, env: Envelope) -> "Message":
        raise NotImplementedError


@dataclass(frozen=True, slots=True, eq=False)
class CellTask(Message):
    """Cloud -> edge: start ``round`` of a cell with the global ``params``.

    ``members`` are the devices that take part (anyone else is an unknown sender);
    ``config`` is the algorithm's per-round settings (learning rate, local steps, quorum,
    deadline, ...), passed through to devices as ``DeviceTask.config``.
    """

    KIND: ClassVar[str] = "cell_task"
    TENSOR_FIELD: ClassVar[str | None] = "params"

    params: Tensors = field(default_factory=dict)
    members: tuple[str, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)
    model_version: int = 0

    def _meta(self) -> dict[str, Any]:
        return {"members": list(self.members), "config": _plain(self.config),
                "model_version": self.model_version}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "CellTask":
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, params=env.tensors,
                   members=_str_list(env.meta, "members"), config=_get(env.meta, "config", dict),
                   model_version=_get(env.meta, "model_version", int))


@dataclass(frozen=True, slots=True, eq=False)
class DeviceTask(Message):
    """Edge -> devices of its cell: train from ``params`` with ``config`` for ``round``.

    ``step`` > 0 is a catch-up task: a device that (re)joins mid-round gets the set model at
    the cell's current step and starts there.
    """

    KIND: ClassVar[str] = "device_task"
    TENSOR_FIELD: ClassVar[str | None] = "params"

    params: Tensors = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    members: tuple[str, ...] = ()

    def _meta(self) -> dict[str, Any]:
        return {"config": _plain(self.config), "members": list(self.members)}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "DeviceTask":
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, step=env.step, params=env.tensors,
                   config=_get(env.meta, "config", dict), members=_str_list(env.meta, "members"))


@dataclass(frozen=True, slots=True, eq=False)
class DeviceUpdate(Message):
    """Device -> edge: the model change of one round of local training, and its weight."""

    KIND: ClassVar[str] = "device_update"
    TENSOR_FIELD: ClassVar[str | None] = "delta"

    delta: Tensors = field(default_factory=dict)
    num_samples: int = 0
    train_loss: float = 0.0
    steps: int = 0
    q: float = 0.0
    """Measured relative variance of the quantization applied to ``delta`` (0 when exact)."""
    release: Mapping[str, Any] | None = None
    """The differential-privacy release record when the device added noise (``fedtier.privacy.audit``)."""
    evaluation: EvalStats | None = None
    """Federated evaluation of the global model this round started from, on the device's held-out
    rows (in the round's last upload; never under differential privacy)."""
    unclipped: bool | None = None
    """Adaptive clipping, to a trusted edge only: whether the update fitted the round's clip bound (the bit
    the edge counts, noises and releases; under an untrusted edge it travels noised in ``release``)."""

    def _meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"num_samples": self.num_samples, "train_loss": float(self.train_loss),
                                "steps": self.steps, "q": float(self.q)}
        if self.unclipped is not None:
            meta["unclipped"] = bool(self.unclipped)
        if self.release is not None:
            meta["release"] = _plain(self.release, "release")
        if self.evaluation is not None:
            meta["eval"] = self.evaluation.to_meta()
        return meta

    @classmethod
    def from_envelope(cls, env: Envelope) -> "DeviceUpdate":
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, step=env.step, delta=env.tensors,
                   num_samples=_count(env.meta, "num_samples"), train_loss=_get(env.meta, "train_loss", float),
                   steps=_get(env.meta, "steps", int), q=_nonneg(env.meta, "q"),
                   release=_get(env.meta, "release", dict, default=None), evaluation=_evaluation(env.meta),
                   unclipped=_get(env.meta, "unclipped", bool, default=None))


TRAINING_FAILURES = ("crash", "error", "non_finite")
"""Why a device reports ``training_failed`` (a bounded set: it is a metric label): ``crash`` — the agent died
while it computed the step, ``max_task_crashes`` times in a row (a native crash of the training runtime);
``error`` — the trainer raised; ``non_finite`` — the result held NaN or infinity."""


@dataclass(frozen=True, slots=True, eq=False)
class TrainingFailed(Message):
    """Device -> edge, in place of the upload of ``step``: the device could not compute it, and skips the rest of
    ``round`` (it takes the next round's task). The edge treats it as a member that will not come: it closes the
    step without it once everyone else reported, and counts it by ``reason`` (``TRAINING_FAILURES``)."""

    KIND: ClassVar[str] = "training_failed"

    reason: str = "error"

    def __post_init__(self) -> None:
        if self.reason not in TRAINING_FAILURES:
            raise LocalProtocolError(f"training failure reason must be one of {', '.join(TRAINING_FAILURES)}, "
                                     f"got {self.reason!r}")

    def _meta(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "TrainingFailed":
        reason = _get(env.meta, "reason", str)
        if reason not in TRAINING_FAILURES:
            raise MalformedHeaderError(f"training failure reason {reason!r} is not one of "
                                       f"{', '.join(TRAINING_FAILURES)}")
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, step=env.step, reason=reason)


@dataclass(frozen=True, slots=True, eq=False)
class CellUpdate(Message):
    """Edge -> cloud: the cell's aggregate of one round.

    ``weight`` is what the cloud weights this cell by (number of devices aggregated, or
    their samples, as the rollout's weighting says); ``reported`` lists the devices that
    made it in; ``stats`` carries the cell's traffic counters for the round.
    """

    KIND: ClassVar[str] = "cell_update"
    TENSOR_FIELD: ClassVar[str | None] = "delta"

    delta: Tensors = field(default_factory=dict)
    weight: float = 0.0
    reported: tuple[str, ...] = ()
    mean_loss: float = 0.0
    stats: Mapping[str, Any] = field(default_factory=dict)
    q: float = 0.0
    """Measured relative variance of the edge's own quantization of ``delta`` (Q2)."""
    privacy: Mapping[str, Any] | None = None
    """Under differential privacy: the cell's release records and clear hops (``fedtier.privacy.audit``)."""
    evaluation: EvalStats | None = None
    """The cell's devices' federated evaluations, combined (weighted by their held-out counts); each device's
    own are in ``stats["evaluations"]`` (``device_evaluations``)."""

    @property
    def device_evaluations(self) -> dict[str, EvalStats]:
        """Each reporting device's own federated evaluation, from ``stats["evaluations"]`` (``{device:
        EvalStats.to_row()}``; never under a noise plan); ``MalformedHeaderError`` if it is not such a map."""
        rows = self.stats.get("evaluations")
        if rows is None:
            return {}
        if not isinstance(rows, Mapping):
            raise MalformedHeaderError(f"field 'stats.evaluations' has type {type(rows).__name__}")
        return {str(d): EvalStats.from_row(row, str(d)) for d, row in sorted(rows.items())}

    def _meta(self) -> dict[str, Any]:
        meta = {"weight": float(self.weight), "reported": list(self.reported),
                "mean_loss": float(self.mean_loss), "stats": _plain(self.stats), "q": float(self.q)}
        if self.privacy is not None:
            meta["privacy"] = _plain(self.privacy, "privacy")
        if self.evaluation is not None:
            meta["eval"] = self.evaluation.to_meta()
        return meta

    @classmethod
    def from_envelope(cls, env: Envelope) -> "CellUpdate":
        weight = _get(env.meta, "weight", float)
        if weight <= 0:
            raise MalformedHeaderError("cell weight must be positive")
        update = cls(rollout=env.rollout, round=env.round, sender=env.sender, delta=env.tensors,
                     weight=weight, reported=_str_list(env.meta, "reported"),
                     mean_loss=_get(env.meta, "mean_loss", float), stats=_get(env.meta, "stats", dict),
                     q=_nonneg(env.meta, "q"), privacy=_get(env.meta, "privacy", dict, default=None),
                     evaluation=_evaluation(env.meta))
        _ = update.device_evaluations  # parsed once here: a malformed map fails the decoding
        return update


@dataclass(frozen=True, slots=True, eq=False)
class DeviceGradient(Message):
    """Device -> edge: one minibatch gradient at the set model (QHetFed's intra-set step ``step``).

    ``model_sha`` is the digest of the parameters the gradient was computed at, so the edge
    can check the device holds the set model (all devices of a set must stay identical).
    """

    KIND: ClassVar[str] = "device_gradient"
    TENSOR_FIELD: ClassVar[str | None] = "grad"

    grad: Tensors = field(default_factory=dict)
    model_sha: str = ""
    loss: float = 0.0
    num_samples: int = 0
    q: float = 0.0

    def _meta(self) -> dict[str, Any]:
        return {"model_sha": self.model_sha, "loss": float(self.loss), "num_samples": self.num_samples,
                "q": float(self.q)}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "DeviceGradient":
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, step=env.step, grad=env.tensors,
                   model_sha=_get(env.meta, "model_sha", str), loss=_get(env.meta, "loss", float),
                   num_samples=_count(env.meta, "num_samples"), q=_nonneg(env.meta, "q"))


@dataclass(frozen=True, slots=True, eq=False)
class CellStep(Message):
    """Edge -> devices: the cell's aggregate of intra-round step ``step``, to apply to the set model.

    ``kind`` says how: ``"gradient"`` (QHetFed, ``w <- w - lr * tensors``) or ``"delta"``
    (Hier-Local-QSGD, ``w <- w + tensors``). ``model_sha`` is the digest of the set model
    after applying it, which every device verifies against its own.
    """

    KIND: ClassVar[str] = "cell_step"
    TENSOR_FIELD: ClassVar[str | None] = "tensors_"

    tensors_: Tensors = field(default_factory=dict)
    kind: str = "gradient"
    model_sha: str = ""
    reported: tuple[str, ...] = ()

    def _meta(self) -> dict[str, Any]:
        return {"kind": self.kind, "model_sha": self.model_sha, "reported": list(self.reported)}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "CellStep":
        kind = _get(env.meta, "kind", str)
        if kind not in ("gradient", "delta"):
            raise MalformedHeaderError(f"cell step kind {kind!r} is neither 'gradient' nor 'delta'")
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, step=env.step, tensors_=env.tensors,
                   kind=kind, model_sha=_get(env.meta, "model_sha", str), reported=_str_list(env.meta, "reported"))


@dataclass(frozen=True, slots=True, eq=False)
class ArtifactRequest(Message):
    """Child -> parent: please send the artifact files with these sha256 digests."""

    KIND: ClassVar[str] = "artifact_request"

    digests: tuple[str, ...] = ()

    def _meta(self) -> dict[str, Any]:
        return {"digests": list(self.digests)}

    @property
    def key(self) -> str:
        # Requests are cheap and must not be deduplicated across restarts: a node that lost
        # its cache asks again. Key by content so one burst is still collapsed.
        return make_key(self.KIND, self.rollout, self.round, 0, f"{self.sender}:{','.join(self.digests)}")

    @classmethod
    def from_envelope(cls, env: Envelope) -> "ArtifactRequest":
        digests = _str_list(env.meta, "digests")
        if not all(len(d) == 64 and all(c in "0123456789abcdef" for c in d) for d in digests):
            raise MalformedHeaderError("digests must be lowercase hex sha256 strings")
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, digests=digests)


@dataclass(frozen=True, slots=True, eq=False)
class ArtifactBlob(Message):
    """Parent -> children: one artifact file; receivers verify ``sha256`` before storing it."""

    KIND: ClassVar[str] = "artifact"

    sha256: str = ""
    name: str = ""
    data: bytes = b""

    def _meta(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "name": self.name}

    def tensors(self) -> Tensors:
        return {"data": np.frombuffer(self.data, dtype=np.uint8)}

    def to_envelope(self, encodings: Mapping[str, TensorEncoding] | None = None) -> Envelope:
        return super(ArtifactBlob, self).to_envelope({"data": TensorEncoding("u8")})

    @property
    def key(self) -> str:
        return make_key(self.KIND, self.rollout, 0, 0, self.sha256)

    @classmethod
    def from_envelope(cls, env: Envelope) -> "ArtifactBlob":
        data = env.tensors.get("data")
        if data is None or data.dtype != np.uint8 or data.ndim != 1:
            raise MalformedHeaderError("artifact message needs one 1-D u8 tensor 'data'")
        return cls(rollout=env.rollout, round=env.round, sender=env.sender,
                   sha256=_get(env.meta, "sha256", str), name=_get(env.meta, "name", str),
                   data=data.tobytes())


@dataclass(frozen=True, slots=True, eq=False)
class CellPresence(Message):
    """Edge -> cloud: which of the cell's devices are online now, by the devices' own presence in the cell.

    Devices announce themselves under their cell (``topics.cell_status``), which only their edge follows
    and which does not cross a gateway's bridge; this summary does (it is on the edge's uplink). Sent when
    the set changes (at most every few seconds), when a rollout's manifest reaches the edge, and when the
    coordinator comes online. ``online`` lists device ids (never in a metric label); ``known`` is how many
    devices of the cell the edge has seen announce themselves, online or not. Not a round message: no
    round, step 0, and the newest one wins.
    """

    KIND: ClassVar[str] = "cell_presence"

    online: tuple[str, ...] = ()
    known: int = 0

    def _meta(self) -> dict[str, Any]:
        return {"online": list(self.online), "known": self.known}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "CellPresence":
        online = _str_list(env.meta, "online")
        known = _count(env.meta, "known")
        if len(set(online)) != len(online) or known < len(online):
            raise MalformedHeaderError("cell_presence lists a device twice, or more online than known")
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, online=online, known=known)


# --- FeDXL: X-risk scores travel with the model ---------------------------------------------------------
#
# "FeDXL: Provable Federated Learning for Deep X-Risk Optimization" (Guo, Jin, Luo, Yang, ICML 2023):
# devices upload, besides their model, the scores they computed in the round (positives and negatives)
# and, for the compositional objective, the inner-function estimates ``u`` of those positives; the
# cloud merges them into a pool it sends down with the next round's model (the passive parts). These
# four kinds extend the hierarchy's messages with those fields (new kinds: an older node rejects them
# as unknown instead of reading half of them). Their extra tensors are named under ``xrisk/`` so they
# cannot collide with the model's parameter names.

XRISK_PREFIX = "xrisk/"
POS_SCORES, NEG_SCORES, POS_U = "xrisk/pos_scores", "xrisk/neg_scores", "xrisk/pos_u"
MOMENTUM_PREFIX = "xrisk/G/"


@dataclass(frozen=True, slots=True, eq=False)
class ScorePool:
    """Scores of one round, concatenated by device (a device's upload, a cell's, or the merged pool).

    Attributes:
        round: the round the scores were computed in (``-1``: no scores yet).
        pos: positive scores ``h(w, z)``, float32.
        neg: negative scores.
        u: the positives' inner-function estimates, aligned with ``pos`` (compositional objective), or
            ``None``.
        sources: ``(device, positives, negatives)`` per contributing device, in the order their scores
            are concatenated (provenance: entry ``i`` of ``pos`` is the device whose running count
            passes ``i``). Sums must equal the lengths.
    """

    round: int = -1
    pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    neg: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    u: np.ndarray | None = None
    sources: tuple[tuple[str, int, int], ...] = ()

    def __post_init__(self) -> None:
        for name, arr in (("pos", self.pos), ("neg", self.neg), ("u", self.u)):
            if arr is not None and np.asarray(arr).ndim != 1:
                raise ScoreListError(f"score list {name} must be 1-D, got shape {np.shape(arr)}")
        if self.u is not None and len(self.u) != len(self.pos):
            raise ScoreListError(f"{len(self.u)} u values for {len(self.pos)} positive scores")
        if sum(p for _, p, _ in self.sources) != len(self.pos) or sum(n for _, _, n in self.sources) != len(self.neg):
            raise ScoreListError(f"sources count {sum(p for _, p, _ in self.sources)} positives and "
                                 f"{sum(n for _, _, n in self.sources)} negatives; the lists hold {len(self.pos)} "
                                 f"and {len(self.neg)}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ScorePool):
            return NotImplemented
        if (self.u is None) != (other.u is None):
            return False
        same_u = self.u is None or other.u is None or np.array_equal(self.u, other.u)
        return (self.round == other.round and self.sources == other.sources and np.array_equal(self.pos, other.pos)
                and np.array_equal(self.neg, other.neg) and same_u)

    __hash__ = None  # type: ignore[assignment]  # holds arrays

    def tensors(self) -> dict[str, np.ndarray]:
        out = {POS_SCORES: np.asarray(self.pos, np.float32), NEG_SCORES: np.asarray(self.neg, np.float32)}
        if self.u is not None:
            out[POS_U] = np.asarray(self.u, np.float32)
        return out

    def meta(self) -> dict[str, Any]:
        return {"round": int(self.round), "sources": [[d, int(p), int(n)] for d, p, n in self.sources]}

    @classmethod
    def parse(cls, meta: Any, tensors: Mapping[str, np.ndarray]) -> "ScorePool":
        """From a header's ``pool`` map and the envelope's tensors; ``ScoreListError`` or
        ``MalformedHeaderError`` if they do not fit together."""
        if not isinstance(meta, Mapping):
            raise MalformedHeaderError(f"field 'pool' has type {type(meta).__name__}")
        rnd = _get(meta, "round", int)
        raw = _get(meta, "sources", list)
        sources = []
        for item in raw:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item[1:])):
                raise MalformedHeaderError(f"pool source {item!r} is not [device, positives, negatives]")
            sources.append((item[0], int(item[1]), int(item[2])))
        if POS_SCORES not in tensors or NEG_SCORES not in tensors:
            raise MalformedHeaderError(f"a score pool needs tensors {POS_SCORES!r} and {NEG_SCORES!r}")
        return cls(round=rnd, pos=tensors[POS_SCORES], neg=tensors[NEG_SCORES], u=tensors.get(POS_U),
                   sources=tuple(sources))


def _with_xrisk(model: Tensors, momentum: Tensors, pool: ScorePool | None) -> dict[str, np.ndarray]:
    out = dict(model)
    out.update({f"{MOMENTUM_PREFIX}{n}": t for n, t in momentum.items()})
    if pool is not None:
        out.update(pool.tensors())
    return out


def _split_xrisk(tensors: Tensors) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(model tensors, momentum tensors by parameter name, score tensors)`` of an envelope."""
    model, momentum, scores = {}, {}, {}
    for name, arr in tensors.items():
        if name.startswith(MOMENTUM_PREFIX):
            momentum[name[len(MOMENTUM_PREFIX):]] = arr
        elif name.startswith(XRISK_PREFIX):
            scores[name] = arr
        else:
            model[name] = arr
    if momentum and set(momentum) != set(model):
        raise MalformedHeaderError("momentum tensors do not name the model's tensors")
    return model, momentum, scores


@dataclass(frozen=True, slots=True, eq=False)
class XRiskCellTask(CellTask):
    """Cloud -> edge (FeDXL): a ``cell_task`` plus the averaged momentum ``G`` (compositional objective;
    empty otherwise) and the merged score pool of the previous round (``pool.round = round - 1``)."""

    KIND: ClassVar[str] = "xrisk_cell_task"

    momentum: Tensors = field(default_factory=dict)
    pool: ScorePool = field(default_factory=ScorePool)

    def tensors(self) -> Tensors:
        return _with_xrisk(self.params, self.momentum, self.pool)

    def _meta(self) -> dict[str, Any]:
        return {**CellTask._meta(self), "pool": self.pool.meta()}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "XRiskCellTask":
        params, momentum, scores = _split_xrisk(env.tensors)
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, params=params,
                   members=_str_list(env.meta, "members"), config=_get(env.meta, "config", dict),
                   model_version=_get(env.meta, "model_version", int), momentum=momentum,
                   pool=ScorePool.parse(env.meta.get("pool"), scores))


@dataclass(frozen=True, slots=True, eq=False)
class XRiskDeviceTask(DeviceTask):
    """Edge -> devices (FeDXL): a ``device_task`` plus the cloud's momentum and score pool, relayed."""

    KIND: ClassVar[str] = "xrisk_device_task"

    momentum: Tensors = field(default_factory=dict)
    pool: ScorePool = field(default_factory=ScorePool)

    def tensors(self) -> Tensors:
        return _with_xrisk(self.params, self.momentum, self.pool)

    def _meta(self) -> dict[str, Any]:
        return {**DeviceTask._meta(self), "pool": self.pool.meta()}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "XRiskDeviceTask":
        params, momentum, scores = _split_xrisk(env.tensors)
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, step=env.step, params=params,
                   config=_get(env.meta, "config", dict), members=_str_list(env.meta, "members"),
                   momentum=momentum, pool=ScorePool.parse(env.meta.get("pool"), scores))


@dataclass(frozen=True, slots=True, eq=False)
class XRiskDeviceUpdate(DeviceUpdate):
    """Device -> edge (FeDXL): a ``device_update`` plus the device's momentum ``G`` (compositional
    objective) and the scores it computed this round (``scores.sources`` names only itself)."""

    KIND: ClassVar[str] = "xrisk_device_update"

    momentum: Tensors = field(default_factory=dict)
    scores: ScorePool = field(default_factory=ScorePool)

    def tensors(self) -> Tensors:
        return _with_xrisk(self.delta, self.momentum, self.scores)

    def _meta(self) -> dict[str, Any]:
        return {**DeviceUpdate._meta(self), "pool": self.scores.meta()}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "XRiskDeviceUpdate":
        delta, momentum, scores = _split_xrisk(env.tensors)
        base = DeviceUpdate.from_envelope(dataclasses.replace(env, tensors=delta))
        return cls(rollout=base.rollout, round=base.round, sender=base.sender, step=base.step, delta=base.delta,
                   num_samples=base.num_samples, train_loss=base.train_loss, steps=base.steps, q=base.q,
                   release=base.release, evaluation=base.evaluation, momentum=momentum,
                   scores=ScorePool.parse(env.meta.get("pool"), scores))


@dataclass(frozen=True, slots=True, eq=False)
class XRiskCellUpdate(CellUpdate):
    """Edge -> cloud (FeDXL): the cell's *weighted sums* of its devices' model changes (``delta``) and
    momenta (``momentum``) with their total weight (``weight``), so the cloud forms the exact global
    mean, and the devices' score lists concatenated (never averaged) with their sources."""

    KIND: ClassVar[str] = "xrisk_cell_update"

    momentum: Tensors = field(default_factory=dict)
    scores: ScorePool = field(default_factory=ScorePool)

    def tensors(self) -> Tensors:
        return _with_xrisk(self.delta, self.momentum, self.scores)

    def _meta(self) -> dict[str, Any]:
        return {**CellUpdate._meta(self), "pool": self.scores.meta()}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "XRiskCellUpdate":
        delta, momentum, scores = _split_xrisk(env.tensors)
        base = CellUpdate.from_envelope(dataclasses.replace(env, tensors=delta))
        return cls(rollout=base.rollout, round=base.round, sender=base.sender, delta=base.delta, weight=base.weight,
                   reported=base.reported, mean_loss=base.mean_loss, stats=base.stats, q=base.q,
                   privacy=base.privacy, evaluation=base.evaluation, momentum=momentum,
                   scores=ScorePool.parse(env.meta.get("pool"), scores))


# --- HSGD: embeddings cross between a cell's devices and its host (feature party) ------------------------
#
# "Communication-Efficient Hybrid Federated Learning for E-health with Horizontal and Vertical Data
# Partitioning" (Yu et al.): in every local interval (``step`` = the interval's index within the round)
# selected devices send their embedding zeta2 to the edge, the edge relays the rows to the host, the host
# answers with its rows Z1 and its head theta0, and the edge hands each device its own row and theta0.
# One layout, two kinds: ``hsgd_embeddings`` travels up (device -> edge, host -> edge), ``hsgd_partner``
# down (edge -> host, edge -> device), so the disclosure audit can tell releases from relays.

HSGD_ZETA = "hsgd/zeta"


@dataclass(frozen=True, slots=True, eq=False)
class Embeddings(Message):
    """Rows of an embedding matrix ``zeta`` (float32 ``(len(rows), width)``) named by sample id
    (HSGD: one sample per device, its id is the device's), plus model tensors when the host sends its
    head ``theta0`` with ``Z1`` (``params``, named ``theta0/...``)."""

    KIND: ClassVar[str] = "hsgd_embeddings"

    zeta: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    rows: tuple[str, ...] = ()
    params: Tensors = field(default_factory=dict)

    def tensors(self) -> Tensors:
        return {**self.params, HSGD_ZETA: self.zeta}

    def _meta(self) -> dict[str, Any]:
        return {"rows": list(self.rows)}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "Embeddings":
        tensors = dict(env.tensors)
        zeta = tensors.pop(HSGD_ZETA, None)
        if zeta is None or np.ndim(zeta) != 2:
            raise MalformedHeaderError(f"{env.type} needs a 2-D tensor {HSGD_ZETA!r}")
        rows = _str_list(env.meta, "rows")
        if len(rows) != zeta.shape[0]:
            raise MalformedHeaderError(f"{env.type} names {len(rows)} rows for {zeta.shape[0]} embedding rows")
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, step=env.step, zeta=zeta, rows=rows,
                   params=tensors)


@dataclass(frozen=True, slots=True, eq=False)
class PartnerEmbeddings(Embeddings):
    """Edge -> host (the selected devices' ``Z2``) or edge -> device (its row of ``Z1`` and ``theta0``)."""

    KIND: ClassVar[str] = "hsgd_partner"


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (CellTask, DeviceTask, DeviceUpdate, TrainingFailed, CellUpdate, DeviceGradient, CellStep,
                ArtifactRequest, ArtifactBlob, XRiskCellTask, XRiskDeviceTask, XRiskDeviceUpdate, XRiskCellUpdate,
                Embeddings, PartnerEmbeddings, CellPresence)
}

M = TypeVar("M", bound=Message)


def register_message(cls: type[M]) -> type[M]:
    """Class decorator for algorithm-specific message types (kinds are never reused)."""
    if cls.KIND in MESSAGE_TYPES and MESSAGE_TYPES[cls.KIND] is not cls:
        raise LocalProtocolError(f"message kind {cls.KIND!r} is already registered")
    MESSAGE_TYPES[cls.KIND] = cls
    return cls


def from_envelope(env: Envelope) -> Message:
    """Turn a decoded envelope into its typed message; unknown types are rejected."""
    cls = MESSAGE_TYPES.get(env.type)
    if cls is None:
        raise UnknownMessageTypeError(f"unknown message type {env.type!r}")
    msg = cls.from_envelope(env)
    if msg.step != env.step:
        raise MalformedHeaderError(f"{env.type} carries step {env.step}; this message type has step {msg.step}")
    if msg.key != env.key:
        raise MalformedHeaderError(f"idempotency key {env.key!r} does not match the message ({msg.key!r})")
    return msg


def decode_message(data: bytes, *, max_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """``wire.decode`` then ``from_envelope``: bytes from the wire to a typed message."""
    return from_envelope(wire.decode(data, max_bytes=max_bytes))


def messages_equal(a: Message, b: Message) -> bool:
    """Value equality for messages (test helper)."""
    if type(a) is not type(b):
        return False
    for f in fields(a):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if isinstance(va, Mapping) and va and isinstance(next(iter(va.values())), np.ndarray):
            if set(va) != set(vb) or not all(np.array_equal(va[k], vb[k]) for k in va):
                return False
        elif isinstance(va, Mapping):
            if dict(va) != dict(vb):
                return False
        elif isinstance(va, np.ndarray):
            if not (isinstance(vb, np.ndarray) and va.shape == vb.shape and np.array_equal(va, vb)):
                return False
        elif va != vb:
            return False
    return True

"""Secure aggregation's wire messages: four up (device -> edge), three down (edge -> one device), and
the edge's report of an aborted round to the cloud (``SecAggAborted``).

They travel on the cell's existing topics (the kind is the last topic level) and use the
ordinary envelope: keys, ciphertexts and shares are msgpack ``bin`` fields of the header
(no pickle), the masked vector is one ``u8`` tensor (the ring elements' little-endian uint64
bytes). Every field is validated on decode; a bad one raises ``MalformedHeaderError`` (or
``MalformedShareError`` for a share that cannot be one), which the shells count and drop.
All have ``step = 0``: the phase is the kind. The downward ones are addressed to one device (each
carries only what concerns it and its neighbours, so a device's download does not grow with the
cell), so their idempotency keys name the receiver too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import numpy as np

from fedtier.errors import MalformedHeaderError
from fedtier.secagg.protocol import PHASES, AdvertisedKeys
from fedtier.wire import Envelope, TensorEncoding
from fedtier.wire.messages import Message, Tensors, make_key, register_message

MAX_BLOB = 4096  # = fedtier.wire.envelope.MAX_BIN_BYTES
"""Largest key, ciphertext or share accepted (they are 32..250 bytes)."""
MASKED = "masked"


def _blob(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes) or not 0 < len(value) <= MAX_BLOB:
        raise MalformedHeaderError(f"{what} must be 1..{MAX_BLOB} bytes")
    return value


def _blob_map(meta: Mapping[str, Any], key: str) -> dict[str, bytes]:
    value = meta.get(key)
    if not isinstance(value, Mapping):
        raise MalformedHeaderError(f"field {key!r} must be a map of node id -> bytes")
    out: dict[str, bytes] = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise MalformedHeaderError(f"field {key!r} has a non-string key")
        out[k] = _blob(v, f"{key}[{k!r}]")
    return out


def _receiver(meta: Mapping[str, Any]) -> str:
    receiver = meta.get("receiver")
    if not isinstance(receiver, str) or not receiver:
        raise MalformedHeaderError("field 'receiver' must be a node id")
    return receiver


def _size(meta: Mapping[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MalformedHeaderError(f"field {key!r} must be a count")
    return value


def _ids(meta: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MalformedHeaderError(f"field {key!r} must be a list of node ids")
    return tuple(value)


@register_message
@dataclass(frozen=True, slots=True, eq=False)
class SecAggKeys(Message):
    """Device -> edge (phase keys): the device's two fresh public keys and its self-mask commitment."""

    KIND: ClassVar[str] = "secagg_keys"

    c_pk: bytes = b""
    s_pk: bytes = b""
    b_commit: bytes = b""

    def advertised(self) -> AdvertisedKeys:
        return AdvertisedKeys(self.c_pk, self.s_pk, self.b_commit)

    def _meta(self) -> dict[str, Any]:
        return {"c_pk": self.c_pk, "s_pk": self.s_pk, "b_commit": self.b_commit}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "SecAggKeys":
        return cls(rollout=env.rollout, round=env.round, sender=env.sender,
                   c_pk=_blob(env.meta.get("c_pk"), "c_pk"), s_pk=_blob(env.meta.get("s_pk"), "s_pk"),
                   b_commit=_blob(env.meta.get("b_commit"), "b_commit"))


@register_message
@dataclass(frozen=True, slots=True, eq=False)
class SecAggRoster(Message):
    """Edge -> one device: the keys of that device and of its neighbours in U1 (every device that
    advertised keys), and ``size`` = |U1|."""

    KIND: ClassVar[str] = "secagg_roster"

    receiver: str = ""
    keys: Mapping[str, AdvertisedKeys] = field(default_factory=dict)
    size: int = 0

    @property
    def key(self) -> str:
        return make_key(self.KIND, self.rollout, self.round, self.step, f"{self.sender}:{self.receiver}")

    def _meta(self) -> dict[str, Any]:
        return {"receiver": self.receiver, "size": self.size,
                "keys": {d: [k.c_pk, k.s_pk, k.b_commit] for d, k in self.keys.items()}}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "SecAggRoster":
        raw = env.meta.get("keys")
        if not isinstance(raw, Mapping):
            raise MalformedHeaderError("field 'keys' must be a map")
        keys: dict[str, AdvertisedKeys] = {}
        for d, triple in raw.items():
            if not isinstance(d, str) or not isinstance(triple, list) or len(triple) != 3:
                raise MalformedHeaderError("roster entries are node id -> [c_pk, s_pk, b_commit]")
            keys[d] = AdvertisedKeys(*(_blob(v, f"keys[{d!r}]") for v in triple))
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, receiver=_receiver(env.meta), keys=keys,
                   size=_size(env.meta, "size"))


@register_message
@dataclass(frozen=True, slots=True, eq=False)
class SecAggShares(Message):
    """Device -> edge (phase shares): for each neighbour, its encrypted shares of b and s_sk."""

    KIND: ClassVar[str] = "secagg_shares"

    shares: Mapping[str, bytes] = field(default_factory=dict)

    def _meta(self) -> dict[str, Any]:
        return {"shares": dict(self.shares)}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "SecAggShares":
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, shares=_blob_map(env.meta, "shares"))


@register_message
@dataclass(frozen=True, slots=True, eq=False)
class SecAggBundle(Message):
    """Edge -> one device: the ciphertexts its neighbours in U2 addressed to it (``sender -> ct``)."""

    KIND: ClassVar[str] = "secagg_bundle"

    receiver: str = ""
    shares: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return make_key(self.KIND, self.rollout, self.round, self.step, f"{self.sender}:{self.receiver}")

    def _meta(self) -> dict[str, Any]:
        return {"receiver": self.receiver, "shares": dict(self.shares)}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "SecAggBundle":
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, receiver=_receiver(env.meta),
                   shares=_blob_map(env.meta, "shares"))


@register_message
@dataclass(frozen=True, slots=True, eq=False)
class SecAggMasked(Message):
    """Device -> edge (phase masked): the masked input, ``length`` elements of Z_{2^bits}.

    On the wire each element takes ``width = ceil(bits / 8)`` little-endian bytes (the u8 tensor
    ``masked`` of ``length * width`` bytes; ``width`` in the header): 4 bytes per coordinate in a
    32-bit ring, as float32 would.
    """

    KIND: ClassVar[str] = "secagg_masked"

    masked: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    width: int = 8

    def tensors(self) -> Tensors:
        words = np.ascontiguousarray(self.masked, dtype="<u8").view(np.uint8).reshape(-1, 8)
        return {MASKED: np.ascontiguousarray(words[:, :self.width]).ravel()}

    def to_envelope(self, encodings: Mapping[str, TensorEncoding] | None = None) -> Envelope:
        return Message.to_envelope(self, {MASKED: TensorEncoding("u8")})

    def _meta(self) -> dict[str, Any]:
        return {"width": self.width}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "SecAggMasked":
        width = env.meta.get("width")
        if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= 8:
            raise MalformedHeaderError("field 'width' must be 1..8 bytes per element")
        raw = env.tensors.get(MASKED)
        if (raw is None or set(env.tensors) != {MASKED} or raw.dtype != np.uint8 or raw.ndim != 1
                or raw.size % width):
            raise MalformedHeaderError("a masked input is one u8 tensor 'masked' of whole elements")
        words = np.zeros((raw.size // width, 8), dtype=np.uint8)
        words[:, :width] = raw.reshape(-1, width)
        return cls(rollout=env.rollout, round=env.round, sender=env.sender,
                   masked=words.view("<u8").ravel().astype(np.uint64), width=width)


@register_message
@dataclass(frozen=True, slots=True, eq=False)
class SecAggUnmask(Message):
    """Edge -> one device: which of it and its neighbours are in U3 (whose inputs are in the sum) and
    which dropped (U2 \\ U3), and ``count`` = |U3|."""

    KIND: ClassVar[str] = "secagg_unmask"

    receiver: str = ""
    survivors: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    count: int = 0

    @property
    def key(self) -> str:
        return make_key(self.KIND, self.rollout, self.round, self.step, f"{self.sender}:{self.receiver}")

    def _meta(self) -> dict[str, Any]:
        return {"receiver": self.receiver, "survivors": list(self.survivors), "dropped": list(self.dropped),
                "count": self.count}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "SecAggUnmask":
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, receiver=_receiver(env.meta),
                   survivors=_ids(env.meta, "survivors"), dropped=_ids(env.meta, "dropped"),
                   count=_size(env.meta, "count"))


@register_message
@dataclass(frozen=True, slots=True, eq=False)
class SecAggReveal(Message):
    """Device -> edge (phase reveal): per neighbour, one Shamir share (of b if it survived, of s_sk if not)."""

    KIND: ClassVar[str] = "secagg_reveal"

    shares: Mapping[str, bytes] = field(default_factory=dict)

    def _meta(self) -> dict[str, Any]:
        return {"shares": dict(self.shares)}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "SecAggReveal":
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, shares=_blob_map(env.meta, "shares"))


_REASON = re.compile(r"[a-z][a-z0-9_]{0,63}")
_PHASE_NAMES = tuple(p.value for p in PHASES)


def _waited(meta: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    raw = meta.get("waited")
    if not isinstance(raw, Mapping) or not all(k in _PHASE_NAMES for k in raw):
        raise MalformedHeaderError(f"field 'waited' must map phases ({', '.join(_PHASE_NAMES)}) to node ids")
    return {phase: _ids(raw, phase) for phase in raw}


@register_message
@dataclass(frozen=True, slots=True, eq=False)
class SecAggAborted(Message):
    """Edge -> cloud: the cell's secure aggregation of ``round`` aborted in ``phase`` (typed ``reason``, ``have``
    of ``need``); no cell update comes for the round. ``waited``: per phase, the members it closed without at
    its deadline. An abort in a phase of ``protocol.UNREVEALED`` released nothing (the ledger charges nobody)."""

    KIND: ClassVar[str] = "secagg_aborted"

    phase: str = ""
    reason: str = ""
    have: int = 0
    need: int = 0
    waited: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def _meta(self) -> dict[str, Any]:
        return {"phase": self.phase, "reason": self.reason, "have": self.have, "need": self.need,
                "waited": {phase: list(ids) for phase, ids in self.waited.items()}}

    @classmethod
    def from_envelope(cls, env: Envelope) -> "SecAggAborted":
        phase, reason = env.meta.get("phase"), env.meta.get("reason")
        if phase not in _PHASE_NAMES:
            raise MalformedHeaderError(f"field 'phase' must be one of {', '.join(_PHASE_NAMES)}")
        if not isinstance(reason, str) or _REASON.fullmatch(reason) is None:
            raise MalformedHeaderError("field 'reason' must be a short lowercase identifier")
        return cls(rollout=env.rollout, round=env.round, sender=env.sender, phase=str(phase), reason=reason,
                   have=_size(env.meta, "have"), need=_size(env.meta, "need"), waited=_waited(env.meta))


UPWARD = (SecAggKeys, SecAggShares, SecAggMasked, SecAggReveal)
"""Device -> edge kinds (the edge shell routes them to the cell's role)."""
DOWNWARD = (SecAggRoster, SecAggBundle, SecAggUnmask)
"""Edge -> device kinds (the device shell routes them to the rollout's role)."""
TO_CLOUD = (SecAggAborted,)
"""Edge -> cloud kinds (the coordinator routes them to the rollout's role, as cell updates)."""

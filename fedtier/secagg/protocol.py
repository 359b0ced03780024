"""SecAgg+ in one cell, sans-I/O: a device session and an edge session per round.

Bell, Bonawitz, Gascón, Lepoint, Raykova, "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead" (CCS 2020), the semi-honest variant, over the cell's sharing graph (``graph``):

    phase   device i                                         edge
    keys    fresh X25519 pairs (c, s), self-mask seed b;      collects U1 (>= s_min), broadcasts the
            sends (c_pk, s_pk, sha256(b))                     roster {i: keys}
    shares  Shamir-shares b and s_sk among its neighbours     collects U2 (>= s_min); gives each
            in U1 (threshold t); each pair of shares          device the ciphertexts addressed to it
            encrypted to the neighbour (c keys, AEAD)
    masked  y_i = x_i + PRG(b_i) + sum_{j in N(i) & U2}       collects U3 (>= s_min); broadcasts U3
            sign(i, j) PRG(s_ij)   (mod 2^bits)               and the dropped U2 \\ U3
    reveal  for each neighbour j it holds shares of: b_j's    collects the shares; reconstructs b_j
            share if j in U3, s_sk_j's if j dropped, never    (j in U3) and s_sk_j (j dropped);
            both; refuses when |U3| < s_min                   sum = sum y - PRG(b) - orphan masks

``s_ij`` is HKDF(X25519(s_sk_i, s_pk_j)), the same at both ends; ``sign`` is +1 for the smaller id.
Pairwise masks of two survivors cancel in the sum; those of a survivor with a dropped device are
removed with the dropped device's reconstructed ``s_sk``. The edge holds only public keys,
ciphertexts it cannot open, masked vectors and, at the end, the sum.

Thresholds: ``t`` shares of a device's secrets reconstruct them; ``t`` is a strict majority (at
least) of the device's neighbours in the roster U1, who hold its shares, so an edge that tells some
neighbours "j survived" and others "j dropped" cannot collect ``t`` shares of both of j's secrets
from honest neighbours. ``s_min`` is
the fewest devices a sum may contain: a phase that closes with fewer aborts the cell's step
(``Abort``, a typed reason) and every honest device refuses to reveal for fewer.

Time is the shell's: the edge closes a phase when everyone it waits for answered or when the
phase's own deadline passes (``fedtier.algorithms.secure_fedavg``). A message of a phase that
has closed is refused as late (``LateMessageError``), one of a phase not open yet as
``WrongPhaseError``; either leaves the session as it was.

Everything here is deterministic given its inputs except the fresh keys, seeds and share
coefficients, which come from the OS CSPRNG (a device session's ``entropy``) and the encryption
nonces (always the OS CSPRNG).
"""

from __future__ import annotations

import enum
import hashlib
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from fedtier.errors import (
    LateMessageError,
    LocalProtocolError,
    MalformedShareError,
    UnknownSenderError,
    WrongPhaseError,
)
from fedtier.secagg import crypto, graph, shamir
from fedtier.secagg.ring import RingCodec

SECRET_BYTES = 32


class Phase(enum.Enum):
    KEYS = "keys"
    SHARES = "shares"
    MASKED = "masked"
    REVEAL = "reveal"
    DONE = "done"
    ABORTED = "aborted"


PHASES = (Phase.KEYS, Phase.SHARES, Phase.MASKED, Phase.REVEAL)
"""The phases that collect, in order (each closes at its own deadline: ``secure_fedavg``)."""
UNREVEALED = frozenset(p.value for p in PHASES[:3])
"""Phases whose abort leaves no sum to unmask, ever: no device has revealed a share (devices reveal
only after the masked phase closed with at least ``s_min`` inputs), and a device reveals once. A
cell that aborted in one of them released nothing; one that aborted while revealing may have (the
shares that arrived after the abort would unmask the sum for whoever holds them)."""


@dataclass(frozen=True, slots=True)
class SecAggParams:
    """What every member of the cell agrees on for a round (from the task's config).

    Attributes:
        min_survivors: s_min, the fewest inputs an accepted sum may contain (>= 1).
        degree: neighbours per device in the sharing graph (rounded up to even; the complete
            graph when the cell is smaller).
        threshold_fraction: t as a share of a device's neighbourhood, in (0.5, 1].
        codec: the ring encoding.
    """

    min_survivors: int
    degree: int
    threshold_fraction: float
    codec: RingCodec

    def __post_init__(self) -> None:
        if not (isinstance(self.min_survivors, int) and self.min_survivors >= 1):
            raise LocalProtocolError(f"secagg min_survivors must be an int >= 1, got {self.min_survivors!r}")
        if not (isinstance(self.degree, int) and self.degree >= 2):
            raise LocalProtocolError(f"secagg degree must be an int >= 2, got {self.degree!r}")
        if not (0.5 < self.threshold_fraction <= 1):
            raise LocalProtocolError(f"secagg threshold_fraction must be in (0.5, 1], got {self.threshold_fraction!r}")

    def threshold(self, neighbourhood: int) -> int:
        """t for a device whose shares ``neighbourhood`` neighbours hold: a strict majority at least."""
        return max(neighbourhood // 2 + 1, math.ceil(self.threshold_fraction * neighbourhood - 1e-9))


@dataclass(frozen=True, slots=True)
class AdvertisedKeys:
    c_pk: bytes
    s_pk: bytes
    b_commit: bytes


@dataclass(frozen=True, slots=True)
class Abort:
    """The cell's step could not complete securely; nothing about any input was released."""

    phase: str
    reason: str
    have: int
    need: int


@dataclass(frozen=True, slots=True)
class Unmasked:
    """The result: the sum of the survivors' encoded inputs (ring element) and who they are."""

    total: np.ndarray
    survivors: tuple[str, ...]


def context(rollout: str, round: int) -> bytes:
    return f"{rollout}/{round}".encode()


def _sign(i: str, j: str) -> int:
    return 1 if i < j else -1


def _pair_context(ctx: bytes, i: str, j: str) -> bytes:
    a, b = sorted((i, j))
    return ctx + b"/" + a.encode() + b"\0" + b.encode()


def _pack_ids(*ids: str) -> bytes:
    out = b""
    for i in ids:
        raw = i.encode()
        out += struct.pack(">H", len(raw)) + raw
    return out


def _plaintext(sender: str, receiver: str, b_share: shamir.Share, sk_share: shamir.Share) -> bytes:
    return _pack_ids(sender, receiver) + b_share.to_bytes() + sk_share.to_bytes()


def _parse_plaintext(data: bytes, sender: str, receiver: str) -> tuple[shamir.Share, shamir.Share]:
    head = _pack_ids(sender, receiver)
    size = 2 + shamir.SHARE_BYTES
    if not data.startswith(head) or len(data) != len(head) + 2 * size:
        raise MalformedShareError(f"share from {sender!r} is not addressed to {receiver!r}")
    body = data[len(head):]
    return shamir.Share.from_bytes(body[:size]), shamir.Share.from_bytes(body[size:])


class _Session:
    def __init__(self, members: Sequence[str], params: SecAggParams, seed: int, rollout: str, round: int) -> None:
        self.members = tuple(sorted(members))
        self.params = params
        self.context = context(rollout, round)
        self.graph = graph.neighbours(self.members, params.degree, seed, rollout, round)
        self.xs = {m: k + 1 for k, m in enumerate(self.members)}  # public Shamir points
        if len(self.members) > shamir.MAX_SHARES:
            raise LocalProtocolError(f"a cell of {len(self.members)} exceeds {shamir.MAX_SHARES} members")

    def mask_seed(self, private: bytes, own: str, peer: str, peer_public: bytes) -> bytes:
        return crypto.agree(private, peer_public, "mask", _pair_context(self.context, own, peer))

    def enc_key(self, private: bytes, own: str, peer: str, peer_public: bytes) -> bytes:
        return crypto.agree(private, peer_public, "enc", _pair_context(self.context, own, peer))

    def associated(self, sender: str, receiver: str) -> bytes:
        return self.context + b"/" + _pack_ids(sender, receiver)


class DeviceSession(_Session):
    """One device's side of one round. Call the phases in order; each at most once."""

    def __init__(self, device_id: str, members: Sequence[str], params: SecAggParams, seed: int, rollout: str,
                 round: int, entropy: Callable[[int], bytes] = os.urandom) -> None:
        """``entropy`` is where keys, seeds and share coefficients come from: the OS CSPRNG; tests
        that need reproducible draws pass a seeded source."""
        super().__init__(members, params, seed, rollout, round)
        if device_id not in self.members:
            raise LocalProtocolError(f"{device_id!r} is not a member of the round")
        self.device_id = device_id
        self.phase = Phase.KEYS
        self._entropy = entropy
        self._c_sk = crypto.new_private_key(entropy)
        self._s_sk = crypto.new_private_key(entropy)
        self._b = entropy(SECRET_BYTES)
        self._roster: dict[str, AdvertisedKeys] = {}
        self._held: dict[str, tuple[shamir.Share, shamir.Share]] = {}

    @property
    def neighbours(self) -> frozenset[str]:
        return self.graph[self.device_id]

    def advertise(self) -> AdvertisedKeys:
        self._expect(Phase.KEYS)
        self.phase = Phase.SHARES
        return AdvertisedKeys(crypto.public_key(self._c_sk), crypto.public_key(self._s_sk),
                              hashlib.sha256(self._b).digest())

    def share_keys(self, roster: Mapping[str, AdvertisedKeys], size: int | None = None) -> dict[str, bytes]:
        """Encrypted shares of ``b`` and ``s_sk`` for each neighbour in the roster U1.

        ``roster`` holds at least this device's and its neighbours' keys (the edge sends each device
        only those); ``size`` is |U1|, the whole roster's size (default: ``len(roster)``).
        """
        self._expect(Phase.SHARES)
        size = len(roster) if size is None else size
        own = roster.get(self.device_id)
        mine = AdvertisedKeys(crypto.public_key(self._c_sk), crypto.public_key(self._s_sk),
                              hashlib.sha256(self._b).digest())
        if own != mine:
            raise MalformedShareError("the roster does not carry this device's own keys")
        unknown = set(roster) - set(self.members)
        if unknown:
            raise UnknownSenderError(f"roster names non-members {sorted(unknown)}")
        if size < max(len(roster), self.params.min_survivors):
            raise MalformedShareError(f"roster of {size} is below min_survivors {self.params.min_survivors} "
                                      f"(or below the {len(roster)} keys it came with)")
        holders = sorted(self.neighbours & set(roster))
        if not holders:
            raise MalformedShareError("no neighbour in the roster to hold this device's shares")
        t = self.params.threshold(len(holders))
        xs = [self.xs[h] for h in holders]
        def randbelow(p: int) -> int:  # 640 random bits reduced mod a 521-bit prime: bias below 2^-119
            return int.from_bytes(self._entropy(80), "big") % p

        b_shares = shamir.split(self._b, xs, t, randbelow)
        sk_shares = shamir.split(self._s_sk, xs, t, randbelow)
        out: dict[str, bytes] = {}
        for holder, bs, ss in zip(holders, b_shares, sk_shares, strict=True):
            key = self.enc_key(self._c_sk, self.device_id, holder, roster[holder].c_pk)
            out[holder] = crypto.encrypt(key, _plaintext(self.device_id, holder, bs, ss),
                                         self.associated(self.device_id, holder))
        self._roster = dict(roster)
        self.phase = Phase.MASKED
        return out

    def masked_input(self, encoded: np.ndarray, received: Mapping[str, bytes]) -> np.ndarray:
        """``y = x + PRG(b) + sum_j sign PRG(s_ij)`` over the neighbours whose shares reached us (U2)."""
        self._expect(Phase.MASKED)
        codec = self.params.codec
        held: dict[str, tuple[shamir.Share, shamir.Share]] = {}
        for sender, ciphertext in received.items():
            if sender not in self.neighbours or sender not in self._roster:
                raise UnknownSenderError(f"shares from {sender!r}, not a neighbour in the roster")
            key = self.enc_key(self._c_sk, self.device_id, sender, self._roster[sender].c_pk)
            plain = crypto.decrypt(key, ciphertext, self.associated(sender, self.device_id))
            held[sender] = _parse_plaintext(plain, sender, self.device_id)
        x = np.asarray(encoded, dtype=np.uint64) & codec.mask
        y = codec.add(x, crypto.prg(self._b, x.size, codec.bits))
        for peer in sorted(held):
            seed = self.mask_seed(self._s_sk, self.device_id, peer, self._roster[peer].s_pk)
            m = crypto.prg(seed, x.size, codec.bits)
            y = codec.add(y, m) if _sign(self.device_id, peer) > 0 else codec.sub(y, m)
        self._held = held
        self.phase = Phase.REVEAL
        return y

    def unmask(self, survivors: Sequence[str], dropped: Sequence[str], count: int | None = None) -> dict[str, bytes]:
        """For each neighbour we hold shares of: b's share if it survived, s_sk's if it dropped.

        ``survivors`` and ``dropped`` need only cover this device and its neighbours (the edge sends
        each device only those); ``count`` is |U3| (default: ``len(survivors)``).
        """
        self._expect(Phase.REVEAL)
        alive, gone = set(survivors), set(dropped)
        count = len(alive) if count is None else count
        if alive & gone:
            raise MalformedShareError("a device is listed as both surviving and dropped")
        if self.device_id not in alive:
            raise MalformedShareError("this device is not among the survivors it is asked to unmask")
        if count < max(len(alive), self.params.min_survivors):
            raise MalformedShareError(f"{count} survivors is below min_survivors {self.params.min_survivors} "
                                      f"(or below the {len(alive)} listed)")
        if not alive <= set(self._roster) or not gone <= set(self._roster):
            raise UnknownSenderError("survivor lists name devices outside the roster")
        unclassified = set(self._held) - alive - gone
        if unclassified:
            raise MalformedShareError(f"neighbours {sorted(unclassified)} are neither survivors nor dropped")
        out = {j: (b.to_bytes() if j in alive else sk.to_bytes()) for j, (b, sk) in sorted(self._held.items())}
        self.phase = Phase.DONE
        return out

    def _expect(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise WrongPhaseError(f"device session is in phase {self.phase.value}, not {phase.value}")


@dataclass
class _EdgeInputs:
    keys: dict[str, AdvertisedKeys] = field(default_factory=dict)
    shares: dict[str, dict[str, bytes]] = field(default_factory=dict)
    masked: dict[str, None] = field(default_factory=dict)
    """Who sent a masked input (U3 so far); the inputs themselves are added into ``masked_sum`` as they arrive."""
    masked_sum: np.ndarray | None = None
    """The ring sum of the masked inputs received (still masked by every sender's self-mask)."""
    reveals: dict[str, dict[str, bytes]] = field(default_factory=dict)


class EdgeSession(_Session):
    """The edge's side of one round: collects each phase, closes it, finally unmasks the sum.

    ``receive_*`` validate and store (raising ``RemoteProtocolError`` subclasses, state unchanged);
    ``close_*`` end a phase with whoever answered, returning what to send or an ``Abort``.
    """

    def __init__(self, members: Sequence[str], params: SecAggParams, seed: int, rollout: str, round: int,
                 length: int) -> None:
        super().__init__(members, params, seed, rollout, round)
        self.length = length
        self.phase = Phase.KEYS
        self.inputs = _EdgeInputs()
        self.abort: Abort | None = None
        self._public: set[bytes] = set()

    @property
    def u1(self) -> tuple[str, ...]:
        return tuple(sorted(self.inputs.keys))

    @property
    def u2(self) -> tuple[str, ...]:
        return tuple(sorted(self.inputs.shares))

    @property
    def u3(self) -> tuple[str, ...]:
        return tuple(sorted(self.inputs.masked))

    def expected(self) -> tuple[str, ...]:
        """Who the current phase waits for."""
        return {Phase.KEYS: self.members, Phase.SHARES: self.u1, Phase.MASKED: self.u2,
                Phase.REVEAL: self.u3}.get(self.phase, ())

    def answered(self) -> tuple[str, ...]:
        table: Mapping[Phase, Mapping[str, object]] = {
            Phase.KEYS: self.inputs.keys, Phase.SHARES: self.inputs.shares,
            Phase.MASKED: self.inputs.masked, Phase.REVEAL: self.inputs.reveals}
        return tuple(sorted(table.get(self.phase, {})))

    def complete(self) -> bool:
        return self.phase in (Phase.KEYS, Phase.SHARES, Phase.MASKED, Phase.REVEAL) and \
            set(self.answered()) >= set(self.expected())

    # --- inputs ----------------------------------------------------------------------------------

    def _check(self, phase: Phase, sender: str) -> bool:
        """True if ``sender`` already answered this phase (a duplicate).

        Raises:
            LateMessageError: the phase has closed (at its deadline, or the round finished or aborted).
            WrongPhaseError: the phase has not opened yet.
        """
        if self.phase is not phase:
            if self.phase not in PHASES or PHASES.index(self.phase) > PHASES.index(phase):
                raise LateMessageError(f"{phase.value} message after that phase closed (the cell is in phase "
                                       f"{self.phase.value})")
            raise WrongPhaseError(f"{phase.value} message while the cell is in phase {self.phase.value}")
        if sender not in self.expected():
            raise UnknownSenderError(f"{sender!r} is not expected in phase {phase.value}")
        return sender in self.answered()

    def receive_keys(self, sender: str, keys: AdvertisedKeys) -> bool:
        if self._check(Phase.KEYS, sender):
            return False
        crypto.check_public_key(keys.c_pk)
        crypto.check_public_key(keys.s_pk)
        if len(keys.b_commit) != 32:
            raise MalformedShareError("self-mask commitment must be 32 bytes")
        if keys.c_pk in self._public or keys.s_pk in self._public or keys.c_pk == keys.s_pk:
            raise MalformedShareError("public key reused (by another device, or for both purposes)")
        self.inputs.keys[sender] = keys
        self._public.update((keys.c_pk, keys.s_pk))
        return True

    def receive_shares(self, sender: str, shares: Mapping[str, bytes]) -> bool:
        if self._check(Phase.SHARES, sender):
            return False
        expected = self.graph[sender] & set(self.u1)
        if set(shares) != expected:
            raise MalformedShareError(f"{sender!r} sent shares for {sorted(shares)}; its neighbours in the roster "
                                      f"are {sorted(expected)}")
        if not all(isinstance(c, bytes) and crypto.NONCE_BYTES + 16 < len(c) < 4096 for c in shares.values()):
            raise MalformedShareError(f"{sender!r} sent a ciphertext of impossible size")
        self.inputs.shares[sender] = dict(shares)
        return True

    def receive_masked(self, sender: str, masked: np.ndarray) -> bool:
        if self._check(Phase.MASKED, sender):
            return False
        y = np.asarray(masked)
        if y.dtype != np.uint64 or y.shape != (self.length,) or (y.size and int(y.max()) > int(self.params.codec.mask)):
            raise MalformedShareError(f"masked input of {sender!r} is not {self.length} ring elements")
        total = self.inputs.masked_sum
        self.inputs.masked_sum = y.copy() if total is None else self.params.codec.add(total, y)
        self.inputs.masked[sender] = None
        return True

    def receive_reveal(self, sender: str, shares: Mapping[str, bytes]) -> bool:
        if self._check(Phase.REVEAL, sender):
            return False
        expected = self.graph[sender] & set(self.u2)  # whose shares it holds
        if set(shares) != expected:
            raise MalformedShareError(f"{sender!r} revealed shares of {sorted(shares)}, expected {sorted(expected)}")
        for owner, data in shares.items():
            if shamir.Share.from_bytes(data).x != self.xs[sender]:
                raise MalformedShareError(f"{sender!r} revealed a share of {owner!r} at another holder's point")
        self.inputs.reveals[sender] = dict(shares)
        return True

    # --- closing phases ----------------------------------------------------------------------------

    def _enough(self, have: int, reason: str) -> Abort | None:
        need = self.params.min_survivors
        if have < need:
            self.abort = Abort(self.phase.value, reason, have, need)
            self.phase = Phase.ABORTED
            return self.abort
        return None

    def close_keys(self) -> Mapping[str, AdvertisedKeys] | Abort:
        self._expect_open(Phase.KEYS)
        abort = self._enough(len(self.inputs.keys), "too_few_keys")
        if abort:
            return abort
        self.phase = Phase.SHARES
        return dict(sorted(self.inputs.keys.items()))

    def close_shares(self) -> Mapping[str, Mapping[str, bytes]] | Abort:
        """The ciphertexts each member of U2 gets: ``{receiver: {sender: ciphertext}}``."""
        self._expect_open(Phase.SHARES)
        abort = self._enough(len(self.inputs.shares), "too_few_shares")
        if abort:
            return abort
        bundles: dict[str, dict[str, bytes]] = {r: {} for r in self.u2}
        for sender, per in self.inputs.shares.items():
            for receiver, ct in per.items():
                if receiver in bundles:
                    bundles[receiver][sender] = ct
        self.phase = Phase.MASKED
        return bundles

    def roster_for(self, device: str, roster: Mapping[str, AdvertisedKeys]) -> dict[str, AdvertisedKeys]:
        """The part of the roster ``device`` needs: its own and its neighbours' keys."""
        return {d: k for d, k in roster.items() if d == device or d in self.graph[device]}

    def survivors_for(self, device: str, survivors: Sequence[str], dropped: Sequence[str]
                      ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The part of the survivor lists ``device`` needs: itself and its neighbours."""
        near = self.graph[device] | {device}
        return tuple(d for d in survivors if d in near), tuple(d for d in dropped if d in near)

    def close_masked(self) -> tuple[tuple[str, ...], tuple[str, ...]] | Abort:
        """``(survivors U3, dropped U2 minus U3)``, which every survivor is told."""
        self._expect_open(Phase.MASKED)
        abort = self._enough(len(self.inputs.masked), "too_few_inputs")
        if abort:
            return abort
        self.phase = Phase.REVEAL
        return self.u3, tuple(sorted(set(self.u2) - set(self.u3)))

    def close_reveal(self) -> Unmasked | Abort:
        """Reconstruct the secrets that remove the masks, and unmask the sum of U3's inputs."""
        self._expect_open(Phase.REVEAL)
        codec = self.params.codec
        alive, gone = self.u3, tuple(sorted(set(self.u2) - set(self.u3)))
        total = np.zeros(self.length, dtype=np.uint64)
        if self.inputs.masked_sum is not None:  # the survivors' inputs, summed as they arrived (addition mod 2^b)
            total = codec.add(total, self.inputs.masked_sum)
        for owner in (*alive, *gone):
            shares = [shamir.Share.from_bytes(per[owner]) for per in self.inputs.reveals.values() if owner in per]
            t = self.params.threshold(len(self.graph[owner] & set(self.u1)))  # as the owner split them
            if len(shares) < t:
                self.abort = Abort(self.phase.value, "too_few_reveals", len(shares), t)
                self.phase = Phase.ABORTED
                return self.abort
            secret = shamir.combine(shares, SECRET_BYTES)
            keys = self.inputs.keys[owner]
            if owner in alive:
                if hashlib.sha256(secret).digest() != keys.b_commit:
                    return self._bad(owner)
                total = codec.sub(total, crypto.prg(secret, self.length, codec.bits))
            else:
                if crypto.public_key(secret) != keys.s_pk:
                    return self._bad(owner)
                for i in sorted(self.graph[owner] & set(alive)):
                    m = crypto.prg(self.mask_seed(secret, owner, i, self.inputs.keys[i].s_pk), self.length,
                                   codec.bits)
                    # survivor i added sign(i, owner) * m; take it back out
                    total = codec.sub(total, m) if _sign(i, owner) > 0 else codec.add(total, m)
        self.phase = Phase.DONE
        return Unmasked(total=total, survivors=alive)

    def _bad(self, owner: str) -> Abort:
        self.abort = Abort(self.phase.value, "bad_reconstruction", 0, 0)
        self.phase = Phase.ABORTED
        return self.abort

    def _expect_open(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise LocalProtocolError(f"closing phase {phase.value} while in {self.phase.value}")

"""The noise plan of a rollout: who adds noise, with which multiplier, at which events.

The coordinator computes it once at rollout start (``cloud_coordinator.privacy.calibrate``),
publishes it inside the signed manifest and inside every task, and every role reads its own
entry. Sigma is never shipped as a bare number: the plan carries noise *multipliers*
``z = sigma / sensitivity`` and the clip bound, and each injector computes the sensitivity of
what it actually releases — so an edge that closes with fewer reporters than planned adds
proportionally more noise, and the privacy the ledger charges (``z``) stays as planned.

Releases (two tiers: device -> cell edge -> cloud, ``tau = edge_rounds``):

* a device under an *untrusted* edge releases its clipped delta plus ``N(0, sigma^2 I)`` at
  every edge round: ``tau`` releases per global round, sensitivity ``2C``;
* a device under a *trusted* edge sends its clipped delta in clear (over TLS);
* a *trusted* edge releases its cell's change plus fresh noise once per round, towards the
  (untrusted) cloud. What one replaced record can move that change by — its sensitivity — is
  ``2C (1/n + tau - 1)`` (n reporters): the paper's Lemma 1 gives ``2C / n`` and leaves out
  that after an intra-round sync every member's trajectory depends on the changed record, so
  each later edge round can move the cell's mean by up to ``2C`` (digest §3.5 caveat 4); the
  two agree for ``tau = 1``. ``rdp`` mode calibrates the noise against the sound value;
  ``paper`` mode calibrates it against Lemma 1's ``2C / n`` (a reproduction of the paper),
  but the release is *charged* against the sound value in either mode — its record, the
  ledger and the budget use ``z = sigma / (2C (1/n + tau - 1))``;
* an *untrusted* edge forwards the exact mean of noised inputs (post-processing).

Device sampling (``sampling`` = ``poisson`` or ``fixed``, rate ``q``; ``edge_rounds`` must be 1).
The adjacency is user-level: one device's whole data. Amplification is claimed only where the
adversary does not learn who was sampled:

* a *trusted* edge samples its members in secret (its own CSPRNG) and releases the **sum** of its
  sampled devices' clipped deltas divided by a public, fixed denominator plus fresh noise —
  ``q n`` (the expected count) under Poisson sampling, so the release does not reveal how many
  were sampled; ``m = round(q n)`` under fixed-size sampling. Adding or removing one device moves
  the Poisson release by at most ``C / (q n)``; replacing one moves the fixed-size mean by at most
  ``2C / m``. The release is charged as a Poisson-sampled Gaussian (add/remove) or a Gaussian
  sampled without replacement (replace-one) with ``z = sigma / sensitivity``;
* a device under an *untrusted* edge gets no amplification: its edge and the cloud see whether it
  released. Each release is charged at full price, and the cloud samples it at most
  ``device_release_cap`` times, the count its noise is calibrated for.

Distributed DP (``[fedavg] secure_aggregation = true``; docs/privacy.md "Distributed DP"). No edge
sees a device's update, only its cell's sum (SecAgg+), so the cell's release is planned like a
trusted edge's — the same ``edge_z``, sensitivity and sampling — but its noise comes from the
devices: each adds ``N(0, sigma_d^2)`` with ``sigma_d^2 = sigma_sum^2 / s_min`` (``s_min``, the
fewest survivors the protocol accepts), so every sum the edge can unmask carries at least the
planned ``sigma_sum``. Under sampling every member takes part in the protocol and the sampled
ones alone add their clipped delta (the others contribute noise only): who was sampled stays
hidden from the edge as from a trusted edge's cloud, and the release is the same fixed-denominator
sum. Whatever the cell's trust label, its edge adds nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from fedtier.errors import UnexpectedMessageError

MODES = ("rdp", "paper")
SAMPLING = ("none", "poisson", "fixed")
DEVICE_COUNT_SENSITIVITY = 1.0
"""Adaptive clipping: a device's own centred bit ``b - 1/2`` moves by 1 when a record flips it (replace-one)."""
EDGE_COUNT_SENSITIVITY = 0.5
"""Adaptive clipping: a trusted edge's centred count over a Poisson sample moves by 1/2 when a device is added or
removed (add/remove adjacency, as its sampled update release)."""


def device_sensitivity(clip: float) -> float:
    """A device release: its delta clipped to ``clip``; a replaced record moves it by at most 2C."""
    return 2.0 * clip


def edge_sensitivity(clip: float, fan_in: int, edge_rounds: int) -> float:
    """A trusted server's release over devices weighted at most ``1/fan_in``: ``2C (1/n + tau - 1)``.

    The sound value (see the module docstring), whatever the calibration mode: what the ledger
    charges. Written ``2C/n + 2C (tau - 1)`` so that it is bit-identical to Lemma 1's ``2C/n`` for
    ``tau = 1``.
    """
    n = max(1, int(fan_in))
    return 2.0 * clip / n + 2.0 * clip * (edge_rounds - 1)


def calibrated_edge_sensitivity(mode: str, clip: float, fan_in: int, edge_rounds: int) -> float:
    """The sensitivity a trusted server's sigma is calibrated against: Lemma 1's ``2C/n`` in
    ``paper`` mode (a reproduction), the sound :func:`edge_sensitivity` in ``rdp`` mode."""
    if mode == "paper":
        return 2.0 * clip / max(1, int(fan_in))
    return edge_sensitivity(clip, fan_in, edge_rounds)


def release_cap(rounds: int, rate: float) -> int:
    """The most rounds the cloud samples one device for under an untrusted edge: the mean ``q T``
    plus three binomial standard deviations, at most ``T`` (``T`` without sampling)."""
    if rate >= 1.0:
        return int(rounds)
    mean = rate * rounds
    return int(min(rounds, math.ceil(mean + 3.0 * math.sqrt(mean * (1.0 - rate)))))


def fixed_sample_size(members: int, rate: float) -> int:
    """How many of a trusted cell's ``members`` a fixed-size sample takes: ``round(q n)``, at least 1."""
    return max(1, min(int(members), round(rate * members)))


def cloud_sample(members: tuple[str, ...] | list[str], *, rate: float, cap: int, seed: int, cell: str,
                 round: int) -> tuple[str, ...]:
    """The devices of an *untrusted* cell the cloud samples in ``round``: each member with
    probability ``rate`` (Poisson), except those already sampled ``cap`` times.

    Public randomness on purpose: under local DP the cloud and the edge see who released anyway,
    so nothing is gained by hiding it, and a deterministic function of (seed, cell, round) lets the
    cloud, the ledger and a restarted coordinator agree without storing anything. Counts are
    replayed from round 0 (cheap: rounds x members draws)."""
    ids = sorted(members)
    counts = dict.fromkeys(ids, 0)
    chosen: tuple[str, ...] = ()
    digest = int.from_bytes(hashlib.sha256(cell.encode()).digest()[:8], "little")
    for r in range(round + 1):
        u = np.random.default_rng([int(seed) & 0xFFFFFFFF, digest, r]).random(len(ids))
        chosen = tuple(d for d, x in zip(ids, u, strict=True) if x < rate and counts[d] < cap)
        for d in chosen:
            counts[d] += 1
    return chosen


@dataclass(frozen=True, slots=True)
class CellPlan:
    """One cell's part of the plan.

    Attributes:
        trusted: the edge's effective trust label.
        members: devices in the cell (the planned reporters).
        device_z: noise multiplier of each device release (0 when the edge is trusted: clear).
        edge_z: noise multiplier of the edge's release to the cloud (0 when untrusted: it adds nothing).
            Under distributed DP: the multiplier the cell's release must carry (the devices add it).
        min_survivors: s_min under distributed DP (secure aggregation): each device adds the share
            ``1 / s_min`` of the release's noise variance. 0: not distributed.
    """

    trusted: bool
    members: int
    device_z: float
    edge_z: float
    min_survivors: int = 0

    @property
    def distributed(self) -> bool:
        """Distributed DP: the devices add the cell's noise in shares, the edge only sums (SecAgg+)."""
        return self.min_survivors > 0

    @property
    def cell_releases(self) -> bool:
        """Whether the cell's aggregate is the release, planned and charged as a trusted edge's: a trusted
        edge adds the noise, or (distributed DP) its devices add shares of it. Who reported then stays
        inside the cell: no edge sees an individual update, and under sampling every member takes part."""
        return self.trusted or self.distributed

    @property
    def clear_to_edge(self) -> bool:
        """Whether devices send clear updates to the edge, which adds the noise: a trusted, not distributed
        cell (under distributed DP nothing clear travels)."""
        return self.trusted and not self.distributed

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"trusted": self.trusted, "members": self.members, "device_z": self.device_z,
                               "edge_z": self.edge_z}
        if self.distributed:
            out["min_survivors"] = self.min_survivors
        return out


@dataclass(frozen=True, slots=True)
class NoisePlan:
    """The resolved plan (see the module docstring).

    Attributes:
        mode: "rdp" (z solved with an RDP accountant for the real release counts) or "paper"
            (the paper's closed form, eq. 11: reproduction only).
        epsilon, delta: the per-device target.
        budget_epsilon: the rollout stops before any device would exceed it.
        clip: C, the L2 bound on each released model delta (since the last public model).
        edge_rounds: tau, device releases per global round under an untrusted edge.
        rounds: T, global rounds planned.
        require_tls: clear (un-noised) updates may travel only over TLS.
        cells: cell id -> ``CellPlan``.
        details: calibration inputs for people and the ledger (alpha, q, releases, ...).
        accountant: "rdp" or "pld" (dp-accounting's), for calibration and the ledger.
        sampling: "none", "poisson" or "fixed" device sampling per round (module docstring).
        sample_rate: q (1.0 without sampling).
        device_release_cap: the most rounds a device under an untrusted edge is sampled for.
        secure_noise: draw noise with ``NoiseSource.add(secure=True)`` (CSPRNG, sum of Gaussians).
        sample_seed: seeds the cloud's public sample of devices under untrusted edges (``cloud_sample``).
        adaptive: adaptive clipping (``fedtier.privacy.adaptive_clip``), or ``None``: ``{"quantile": gamma,
            "lr": eta_C, "count_share": s}``. ``clip`` is then the first round's C, and each round's C travels in
            its task (``RoundSettings.dp_clip``). Every release's planned ``z`` (what the ledger charges) pays for
            the update and its clipped-count bit together: the update gets the larger ``update_z(z) =
            z / sqrt(1 - s)``, the count the multiplier ``z / sqrt(s)`` (``count_stddev``), which compose to
            exactly one Gaussian at ``z``.
    """

    mode: str
    epsilon: float
    delta: float
    budget_epsilon: float
    clip: float
    edge_rounds: int
    rounds: int
    require_tls: bool
    cells: Mapping[str, CellPlan]
    details: Mapping[str, Any] = field(default_factory=dict)
    accountant: str = "rdp"
    sampling: str = "none"
    sample_rate: float = 1.0
    device_release_cap: int = 0  # 0: the rounds (no cap below T)
    secure_noise: bool = False
    sample_seed: int = 0  # the rollout's seed: the cloud's public sample of untrusted cells (cloud_sample)
    adaptive: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        """Refuse a plan no role could follow faithfully: the plan travels in the signed manifest and every
        role trusts it, so it is checked once, where it is made or read. The checks run in this order, so
        that a plan with several faults is reported by the same first one."""
        self._check_adaptive()
        self._check_schemes()
        self._check_bounds()
        for cell, p in self.cells.items():
            self._check_cell(cell, p)

    def _check_adaptive(self) -> None:
        """Adaptive clipping's parameters, and the Poisson sampling its clipped-count release is charged under."""
        if self.adaptive is None:
            return
        a = self.adaptive
        if set(a) != {"quantile", "lr", "count_share"} or not (
                0 < a["quantile"] < 1 and a["lr"] > 0 and 0 < a["count_share"] < 1):
            raise ValueError(f"adaptive clipping needs quantile and count_share in (0, 1) and lr > 0: {a}")
        if self.sampling != "poisson":
            raise ValueError("adaptive clipping runs with Poisson device sampling (add/remove adjacency)")

    def _check_schemes(self) -> None:
        """The named choices (calibration mode, accountant, sampling) and how sampling constrains the rest."""
        if self.mode not in MODES:
            raise ValueError(f"privacy mode must be one of {MODES}, got {self.mode!r}")
        if self.accountant not in ("rdp", "pld"):
            raise ValueError(f"privacy accountant must be rdp or pld, got {self.accountant!r}")
        if self.sampling not in SAMPLING or not 0 < self.sample_rate <= 1:
            raise ValueError(f"privacy sampling {self.sampling!r} at rate {self.sample_rate!r} is invalid")
        if self.sampling == "none" and self.sample_rate != 1.0:
            raise ValueError("a sample rate below 1 needs a sampling scheme")
        if self.sampling != "none" and self.edge_rounds != 1:
            raise ValueError("device sampling needs edge_rounds = 1")

    def _check_bounds(self) -> None:
        """The numbers the accountant and the injectors divide by or compare against."""
        if not (self.epsilon > 0 and 0 < self.delta < 1 and self.budget_epsilon > 0):
            raise ValueError("privacy epsilon and budget must be > 0 and delta in (0, 1)")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"privacy clip must be finite and > 0, got {self.clip!r}")
        if self.edge_rounds < 1 or self.rounds < 1:
            raise ValueError("privacy edge_rounds and rounds must be >= 1")

    def _check_cell(self, cell: str, p: CellPlan) -> None:
        """One cell's entry: every device is protected by noise somewhere on its path to the cloud."""
        if p.members < 1 or p.device_z < 0 or p.edge_z < 0 or p.min_survivors < 0:
            raise ValueError(f"privacy plan of cell {cell!r} is invalid: {p}")
        if p.distributed:
            self._check_distributed_cell(cell, p)
        if p.trusted and p.edge_z <= 0:
            raise ValueError(f"trusted cell {cell!r} must add noise towards the cloud (edge_z > 0)")
        if not p.trusted and p.device_z <= 0:
            raise ValueError(f"devices of untrusted cell {cell!r} must add noise (device_z > 0)")

    def _check_distributed_cell(self, cell: str, p: CellPlan) -> None:
        """Distributed DP: the devices' shares must add up to the cell's release even at ``s_min`` survivors."""
        if not (p.edge_z > 0 and p.device_z > 0 and p.min_survivors <= p.members):
            raise ValueError(f"distributed-DP cell {cell!r} needs edge_z > 0, device_z > 0 and "
                             f"min_survivors <= members: {p}")
        if self.edge_rounds != 1:
            raise ValueError("distributed DP (secure aggregation) needs edge_rounds = 1")

    # --- sensitivities and sigmas ---------------------------------------------------------------

    @property
    def device_sensitivity(self) -> float:
        return device_sensitivity(self.clip)

    @property
    def sampled(self) -> bool:
        return self.sampling != "none"

    def sampled_edge_sensitivity(self, members: int) -> float:
        """A sampling trusted edge's release over a cell of ``members``: ``C / (q n)`` (Poisson, add/remove,
        fixed denominator) or ``2C / round(q n)`` (fixed-size, replace-one). Independent of who reported."""
        if self.sampling == "poisson":
            return self.clip / (self.sample_rate * max(1, int(members)))
        return 2.0 * self.clip / fixed_sample_size(members, self.sample_rate)

    def edge_denominator(self, cell: str) -> float:
        """What a sampling trusted edge divides its sampled devices' sum by: ``q n`` or ``round(q n)``."""
        n = self.cells[cell].members
        return self.sample_rate * n if self.sampling == "poisson" else float(fixed_sample_size(n, self.sample_rate))

    def edge_event(self, cell: str) -> tuple[float, int]:
        """(q, population) of a trusted edge's release for the accountant: (1, 0) without sampling,
        (q, 0) for Poisson, (round(q n) / n, n) for fixed-size."""
        if self.sampling == "poisson":
            return self.sample_rate, 0
        if self.sampling == "fixed":
            n = self.cells[cell].members
            return fixed_sample_size(n, self.sample_rate) / n, n
        return 1.0, 0

    def untrusted_sample(self, cell: str, members: tuple[str, ...] | list[str], round: int) -> tuple[str, ...]:
        """Who of an untrusted ``cell`` releases in ``round``: everyone without sampling, else ``cloud_sample``."""
        if not self.sampled:
            return tuple(sorted(members))
        return cloud_sample(members, rate=self.sample_rate, cap=self.device_release_cap or self.rounds,
                            seed=self.sample_seed, cell=cell, round=round)

    def edge_sensitivity(self, reporters: int) -> float:
        """A trusted edge's release over ``reporters`` devices: the sound sensitivity, the one charged.
        Under sampling ``reporters`` is the cell's size (the fixed denominator's ``n``)."""
        if self.sampled:
            return self.sampled_edge_sensitivity(reporters)
        return edge_sensitivity(self.clip, reporters, self.edge_rounds)

    def calibrated_edge_sensitivity(self, reporters: int) -> float:
        """What a trusted edge's sigma is calibrated against (Lemma 1's ``2C/n`` in paper mode)."""
        if self.sampled:
            return self.sampled_edge_sensitivity(reporters)
        return calibrated_edge_sensitivity(self.mode, self.clip, reporters, self.edge_rounds)

    def update_z(self, z: float) -> float:
        """The multiplier a release's model update gets when its planned ``z`` also pays for a clipped-count bit
        (adaptive clipping): ``z / sqrt(1 - count_share)``; ``z`` itself otherwise."""
        return z if self.adaptive is None else z / math.sqrt(1.0 - float(self.adaptive["count_share"]))

    def count_stddev(self, z: float, sensitivity: float) -> float:
        """Adaptive clipping: the noise std of a centred count of ``sensitivity`` released with planned ``z``:
        multiplier ``z / sqrt(count_share)``, so that with ``update_z`` the pair costs exactly ``z``."""
        if self.adaptive is None:
            raise ValueError("the plan has no adaptive clipping")
        return sensitivity * z / math.sqrt(float(self.adaptive["count_share"]))

    def at_clip(self, clip: float) -> "NoisePlan":
        """The plan of a round whose clip bound is ``clip`` (adaptive clipping moves it every round)."""
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"privacy clip must be finite and > 0, got {clip!r}")
        return dataclasses.replace(self, clip=float(clip))

    def device_sigma(self, cell: str) -> float:
        return self.update_z(self.cells[cell].device_z) * self.device_sensitivity

    def release_denominator(self, cell: str, reporters: int) -> float:
        """What a cell's release divides its devices' sum by: the fixed ``edge_denominator`` under
        sampling, else the number of ``reporters`` (a mean)."""
        return self.edge_denominator(cell) if self.sampled else float(max(1, reporters))

    def distributed_device_z(self, cell: str, edge_z: float, min_survivors: int) -> float:
        """A device's multiplier under distributed DP: its sigma ``sigma_sum / sqrt(s_min)`` over the
        device sensitivity, where ``sigma_sum`` is the noise a trusted edge would put on the cell's sum
        (``edge_z`` times the sum's calibrated sensitivity)."""
        n = self.cells[cell].members
        sigma_sum = edge_z * self.calibrated_edge_sensitivity(n) * self.release_denominator(cell, n)
        return sigma_sum / math.sqrt(min_survivors) / self.device_sensitivity

    def distributed_release(self, cell: str, survivors: int, reporters: int) -> tuple[float, float, float]:
        """(sigma, sensitivity, z) of a distributed-DP cell's release when ``survivors`` devices' noise is in
        the unmasked sum and ``reporters`` is what the release divides by (``release_denominator``):
        ``sigma = sqrt(survivors) sigma_d / denominator``, the sound sensitivity as a trusted edge's."""
        denominator = self.release_denominator(cell, reporters)
        sigma = math.sqrt(survivors) * self.device_sigma(cell) / denominator
        sensitivity = self.edge_sensitivity(self.cells[cell].members if self.sampled else reporters)
        return sigma, sensitivity, sigma / sensitivity

    def ring_clip(self, cell: str, length: int) -> float:
        """An L2 bound a distributed-DP device's noisy update stays under except with probability
        ``exp(-50)`` (Gaussian norm concentration: ``P(||N(0, s^2 I_d)|| > s (sqrt(d) + t)) <= exp(-t^2/2)``,
        t = 10): the secure-aggregation ring is sized for it, so its clipping practically never acts on
        the noise (docs/privacy.md "Distributed DP")."""
        return self.clip + self.device_sigma(cell) * (math.sqrt(max(1, int(length))) + 10.0)

    def edge_sigma(self, cell: str, reporters: int | None = None) -> float:
        """The noise a trusted edge adds when ``reporters`` (default: every member) reported."""
        p = self.cells[cell]
        if self.sampled:  # a fixed denominator: who was sampled, and who reported, must not show in the noise
            reporters = None
        return self.update_z(p.edge_z) * self.calibrated_edge_sensitivity(p.members if reporters is None else reporters)

    def edge_charged_z(self, cell: str, reporters: int | None = None) -> float:
        """The multiplier a trusted edge's release is charged: ``edge_sigma / edge_sensitivity``.

        ``edge_z`` itself in rdp mode (exactly: the ratio of two identical sensitivities is 1);
        ``edge_z (1/n) / (1/n + tau - 1)`` in paper mode — the smaller, the more members reported.
        """
        p = self.cells[cell]
        n = p.members if reporters is None or self.sampled else reporters
        return p.edge_z * (self.calibrated_edge_sensitivity(n) / self.edge_sensitivity(n))

    # --- wire form ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        # JSON has no infinity: an unlimited budget travels as null.
        budget = None if math.isinf(self.budget_epsilon) else self.budget_epsilon
        return {"mode": self.mode, "epsilon": self.epsilon, "delta": self.delta, "budget_epsilon": budget,
                "clip": self.clip, "edge_rounds": self.edge_rounds, "rounds": self.rounds,
                "require_tls": self.require_tls, "cells": {c: p.to_dict() for c, p in sorted(self.cells.items())},
                "details": dict(self.details), "accountant": self.accountant, "sampling": self.sampling,
                "sample_rate": self.sample_rate, "device_release_cap": self.device_release_cap,
                "secure_noise": self.secure_noise, "sample_seed": self.sample_seed,
                **({"adaptive": dict(self.adaptive)} if self.adaptive is not None else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "NoisePlan":
        """Parse the plan from a task or manifest; ``UnexpectedMessageError`` if malformed."""
        try:
            cells = {str(c): CellPlan(trusted=bool(_typed(p["trusted"], bool)), members=int(_typed(p["members"], int)),
                                      device_z=float(_typed(p["device_z"], float)),
                                      edge_z=float(_typed(p["edge_z"], float)),
                                      min_survivors=int(_typed(p.get("min_survivors", 0), int)))
                     for c, p in dict(data["cells"]).items()}
            return cls(mode=str(data["mode"]), epsilon=float(_typed(data["epsilon"], float)),
                       delta=float(_typed(data["delta"], float)),
                       budget_epsilon=(math.inf if data["budget_epsilon"] is None
                                       else float(_typed(data["budget_epsilon"], float))),
                       clip=float(_typed(data["clip"], float)), edge_rounds=int(_typed(data["edge_rounds"], int)),
                       rounds=int(_typed(data["rounds"], int)), require_tls=bool(_typed(data["require_tls"], bool)),
                       cells=cells, details=dict(data.get("details", {})),
                       accountant=str(data.get("accountant", "rdp")), sampling=str(data.get("sampling", "none")),
                       sample_rate=float(_typed(data.get("sample_rate", 1.0), float)),
                       device_release_cap=int(_typed(data.get("device_release_cap", 0), int)),
                       secure_noise=bool(_typed(data.get("secure_noise", False), bool)),
                       sample_seed=int(_typed(data.get("sample_seed", 0), int)),
                       adaptive=_adaptive(data.get("adaptive")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UnexpectedMessageError(f"invalid privacy plan: {exc}") from None


def _adaptive(value: Any) -> dict[str, float] | None:
    if value is None:
        return None
    return {str(k): float(_typed(v, float)) for k, v in dict(value).items()}


def _typed(value: Any, typ: type) -> Any:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is not bool and isinstance(value, bool):
        raise TypeError(f"expected {typ.__name__}, got bool")
    if not isinstance(value, typ):
        raise TypeError(f"expected {typ.__name__}, got {type(value).__name__}")
    if isinstance(value, float) and math.isnan(value):
        raise ValueError("NaN in privacy plan")
    return value

"""Noise calibration: from a rollout config to its noise plan (digest §3.4, §3.5, §7).

``rdp`` (default): each tier's noise multiplier ``z`` is the smallest one for which the RDP
accountant (``accountant.noise_multiplier_for``) keeps its releases within the target
(epsilon, delta) — a device under an untrusted edge releases ``tau`` times per round,
``tau * T`` in all; a trusted edge once per round, ``T`` in all. No subsampling amplification
is claimed (ORT's minibatches are not Poisson samples).

``paper``: the paper's closed form (eq. 11 with Lemma 1's sensitivities), the same multiplier
for every tier, ``z = alpha * q * sqrt(K T ln(1/delta)) / epsilon`` with ``K`` the local steps
per round. It composes as if noise were added at every step and misapplies amplification
(digest §3.5), so it is a reproduction aid, not a guarantee: the ledger reports the RDP
epsilon of what was actually released either way — charged against the sound sensitivity
(a trusted cell's ``2C (1/n + tau - 1)``, not Lemma 1's ``2C/n``; ``fedtier.privacy.plan``).

With device sampling (``[privacy] device_sampling``, rate ``q``; docs/privacy.md "Sampling"),
a trusted edge's ``z`` is solved for ``T`` Poisson-sampled (or fixed-size sampled) Gaussian
releases — amplification, sound because the edge samples in secret and releases a
fixed-denominator sum — while a device under an untrusted edge gets none: its ``z`` is solved
for the most releases the cloud will sample it for (``plan.release_cap``). ``accountant``
picks dp-accounting's RDP or PLD accountant for both.

``plan_rows`` describes every node of a tree of any depth (intermediate servers included)
for ``fedtier privacy plan``; ``make_plan`` is the two-tier plan a rollout runs with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

from fedtier.rollout.config import RolloutConfig
from cloud_coordinator.privacy import accountant
from fedtier.errors import ConfigError
from fedtier.privacy.plan import (
    CellPlan,
    NoisePlan,
    calibrated_edge_sensitivity,
    device_sensitivity,
    edge_sensitivity,
    fixed_sample_size,
    release_cap,
)
from fedtier.privacy.trust import CLOUD, DEVICE, TrustNode


@dataclass(frozen=True)
class Multipliers:
    """Per-tier noise multipliers and the inputs they came from."""

    device_z: float
    edge_z: float
    details: dict[str, Any]


def schedule(cfg: RolloutConfig) -> tuple[int, int]:
    """(local steps per edge round, edge rounds per global round) of the configured algorithm."""
    section: Any = cfg.section
    return int(section.local_steps), int(getattr(section, "edge_rounds", 1))


def sampling_rate(cfg: RolloutConfig, device_samples: Mapping[str, int]) -> float:
    """Paper mode's q: as configured, else batch_size / the smallest device's sample count."""
    assert cfg.privacy is not None
    if cfg.privacy.sampling_rate is not None:
        return float(cfg.privacy.sampling_rate)
    smallest = min(device_samples.values()) if device_samples else 0
    batch = int(cfg.section.batch_size)
    return min(1.0, batch / smallest) if smallest > 0 else 1.0


def sample_rate(cfg: RolloutConfig) -> float:
    """q of device sampling (1.0 without)."""
    p = cfg.privacy
    assert p is not None
    if p.device_sampling == "none" or p.sample_rate is None:  # the config check requires one with the other
        return 1.0
    return float(p.sample_rate)


def edge_multiplier(cfg: RolloutConfig, members: int | None = None) -> float:
    """A trusted edge's z for T releases: amplified by sampling when there is any (sound: the edge samples in
    secret). Fixed-size sampling depends on the cell's size ``members``."""
    p = cfg.privacy
    assert p is not None
    q = sample_rate(cfg)
    if p.device_sampling == "fixed" and members is not None and fixed_sample_size(members, q) < members:
        m = fixed_sample_size(members, q)
        return accountant.noise_multiplier_for(p.epsilon, p.delta, cfg.rounds, sampling_rate=m / members,
                                               accounting=p.accountant, population=members)
    if p.device_sampling == "poisson":
        return accountant.noise_multiplier_for(p.epsilon, p.delta, cfg.rounds, sampling_rate=q,
                                               accounting=p.accountant)
    return accountant.noise_multiplier_for(p.epsilon, p.delta, cfg.rounds, accounting=p.accountant)


def multipliers(cfg: RolloutConfig, device_samples: Mapping[str, int]) -> Multipliers:
    """Solve (rdp) or compute (paper) the device and edge noise multipliers."""
    p = cfg.privacy
    if p is None:
        raise ConfigError("no [privacy] section", key="privacy")
    local_steps, tau = schedule(cfg)
    rounds = cfg.rounds
    q = sample_rate(cfg)
    cap = release_cap(rounds, q)
    details: dict[str, Any] = {"device_releases": tau * cap, "edge_releases": rounds,
                               "local_steps": local_steps, "edge_rounds": tau, "accountant": p.accountant}
    if p.device_sampling != "none":
        details.update(device_sampling=p.device_sampling, sample_rate=q, device_release_cap=cap)
    if p.calibration == "rdp":
        device_z = accountant.noise_multiplier_for(p.epsilon, p.delta, tau * cap, accounting=p.accountant)
        edge_z = edge_multiplier(cfg)
    else:
        q = sampling_rate(cfg, device_samples)
        device_z = edge_z = accountant.paper_noise_multiplier(
            alpha=p.alpha, sampling_rate=q, steps_per_round=local_steps * tau, rounds=rounds,
            epsilon=p.epsilon, delta=p.delta)
        details.update(alpha=p.alpha, sampling_rate=q, steps_per_round=local_steps * tau)
    details["epsilon_device_tier"] = accountant.epsilon([(device_z, tau * cap)], p.delta, accounting=p.accountant)
    edge_q = q if p.device_sampling == "poisson" else 1.0
    details["epsilon_edge_tier"] = accountant.epsilon([(edge_z, rounds, edge_q)], p.delta,
                                                      accounting=p.accountant)  # rdp; paper: see charged_z
    return Multipliers(device_z, edge_z, details)


def charged_edge_z(mode: str, edge_z: float, clip: float, fan_in: int, tau: int) -> float:
    """The multiplier a trusted server's release is charged: its sigma over the sound sensitivity."""
    return edge_z * (calibrated_edge_sensitivity(mode, clip, fan_in, tau) / edge_sensitivity(clip, fan_in, tau))


def make_plan(cfg: RolloutConfig, device_samples: Mapping[str, int]) -> NoisePlan:
    """The two-tier noise plan a rollout runs with (published in its manifest and tasks).

    Raises:
        ConfigError: no ``[privacy]`` section, or a topology with intermediate servers
            (rollouts run device -> cell -> cloud; ``fedtier privacy plan`` shows deeper trees).
    """
    p = cfg.privacy
    if p is None:
        raise ConfigError("no [privacy] section", key="privacy")
    tree = cfg.trust_tree()
    cells = cfg.topology.layout()
    deeper = sorted(n for n, e in tree.items() if e.kind == "server" and n not in cells)
    if deeper:
        raise ConfigError(f"intermediate servers {deeper} are for `fedtier privacy plan` only; rollouts run "
                          "device -> cell -> cloud", key="topology.parents")
    m = multipliers(cfg, device_samples)
    _, tau = schedule(cfg)

    def edge_z(members: int) -> float:
        return edge_multiplier(cfg, members) if p.device_sampling == "fixed" else m.edge_z

    s_min = distributed_min_survivors(cfg)
    if s_min:  # distributed DP: every cell's release is planned as a trusted edge's, its noise from the devices
        plans = {cell: CellPlan(trusted=tree[cell].trusted, members=len(members), device_z=1.0,
                                edge_z=edge_z(len(members)), min_survivors=s_min) for cell, members in cells.items()}
    else:
        plans = {cell: CellPlan(trusted=tree[cell].trusted, members=len(members),
                                device_z=0.0 if tree[cell].trusted else m.device_z,
                                edge_z=edge_z(len(members)) if tree[cell].trusted else 0.0)
                 for cell, members in cells.items()}
    budget = p.budget_epsilon if p.budget_epsilon is not None else p.epsilon
    details = dict(m.details)
    q = sample_rate(cfg)
    plan = _plan(cfg, plans, details, tau, q, budget)
    if s_min:  # each device's share of its cell's noise: sigma_sum / sqrt(s_min)
        plans = {c: replace(cp, device_z=plan.distributed_device_z(c, cp.edge_z, s_min)) for c, cp in plans.items()}
        details.update(distributed_min_survivors=s_min)
        details["epsilon_device_tier"] = 0.0  # no release of a device's own: only its cell's noised sum
        plan = _plan(cfg, plans, details, tau, q, budget)
    edge_tier = [c for c, cp in plans.items() if cp.cell_releases]
    if edge_tier:  # what the ledger will charge the edge tier: the worst such cell, sound sensitivity
        details["epsilon_edge_tier"] = max(
            accountant.epsilon([(plan.edge_charged_z(c), cfg.rounds, *plan.edge_event(c))], p.delta,
                               accounting=p.accountant) for c in edge_tier)
    return plan


def distributed_min_survivors(cfg: RolloutConfig) -> int:
    """s_min when the rollout runs distributed DP (``[fedavg] secure_aggregation`` under ``[privacy]``), else 0."""
    section: Any = cfg.section
    if cfg.privacy is None or not getattr(section, "secure_aggregation", False):
        return 0
    return int(section.secagg_min_survivors)


def _plan(cfg: RolloutConfig, plans: dict[str, CellPlan], details: dict[str, Any], tau: int, q: float,
          budget: float) -> NoisePlan:
    p = cfg.privacy
    assert p is not None
    return NoisePlan(mode=p.calibration, epsilon=p.epsilon, delta=p.delta, budget_epsilon=budget, clip=p.clip,
                     edge_rounds=tau, rounds=cfg.rounds, require_tls=p.require_tls, cells=plans, details=details,
                     accountant=p.accountant, sampling=p.device_sampling, sample_rate=q,
                     device_release_cap=release_cap(cfg.rounds, q) if p.device_sampling != "none" else 0,
                     secure_noise=p.secure_noise, sample_seed=int(cfg.seed),
                     adaptive={"quantile": p.clip_quantile, "lr": p.clip_lr, "count_share": p.clip_count_share}
                     if p.adaptive_clip else None)


@dataclass(frozen=True)
class PlanRow:
    """One node of ``fedtier privacy plan``'s table."""

    node: str
    kind: str
    layer: int
    parent: str | None
    declared: bool | None
    trusted: bool
    why: str
    injects: bool
    releases: int  # per rollout
    sensitivity: float
    z: float
    sigma: float
    protects: int  # devices whose data its noise covers
    distributed: bool = False  # distributed DP: a device adds a share of its cell's noise, its cell releases

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in self.__dict__.items()}


def plan_rows(cfg: RolloutConfig, device_samples: Mapping[str, int],
              tree: Mapping[str, TrustNode] | None = None) -> list[PlanRow]:
    """Every node of the (possibly deeper) tree: label, whether and how much noise it adds.

    A trusted server at any depth that forwards to an untrusted parent protects its whole
    subtree; its row shows the sound ``sensitivity = 2C (1/fan_in + tau - 1)`` and the charged
    ``z = sigma / sensitivity`` (what the ledger will charge), and ``sigma`` as calibrated (against
    ``2C / fan_in`` in paper mode). ``fan_in`` is the smallest product of child counts down to one
    of its devices.
    """
    p = cfg.privacy
    if p is None:
        raise ConfigError("no [privacy] section", key="privacy")
    tree = tree if tree is not None else cfg.trust_tree()
    m = multipliers(cfg, device_samples)
    _, tau = schedule(cfg)
    rows = []
    for node in sorted(tree.values(), key=lambda e: (e.layer, e.kind != CLOUD, e.node)):
        if node.injects and node.kind == DEVICE:
            releases, sens, z = int(m.details["device_releases"]), device_sensitivity(p.clip), m.device_z
            sigma = z * sens
        elif node.injects and p.device_sampling != "none":  # a sampling trusted edge: fixed denominator
            releases, z = cfg.rounds, (edge_multiplier(cfg, node.fan_in) if p.device_sampling == "fixed"
                                       else m.edge_z)
            q = sample_rate(cfg)
            sens = (p.clip / (q * node.fan_in) if p.device_sampling == "poisson"
                    else 2.0 * p.clip / fixed_sample_size(node.fan_in, q))
            sigma = z * sens
        elif node.injects:  # sigma as calibrated; sensitivity and z as the ledger charges them
            releases, sens = cfg.rounds, edge_sensitivity(p.clip, node.fan_in, tau)
            z = charged_edge_z(p.calibration, m.edge_z, p.clip, node.fan_in, tau)
            sigma = m.edge_z * calibrated_edge_sensitivity(p.calibration, p.clip, node.fan_in, tau)
        else:
            releases, sens, z, sigma = 0, 0.0, 0.0, 0.0
        rows.append(PlanRow(node=node.node, kind=node.kind, layer=node.layer, parent=node.parent,
                            declared=node.declared, trusted=node.trusted, why=node.why, injects=node.injects,
                            releases=releases, sensitivity=sens, z=z, sigma=sigma,
                            protects=node.devices if node.injects else 0))
    if distributed_min_survivors(cfg):
        rows = _distributed_rows(cfg, device_samples, rows)
    return rows


def _distributed_rows(cfg: RolloutConfig, device_samples: Mapping[str, int], rows: list[PlanRow]) -> list[PlanRow]:
    """Distributed DP (secure aggregation): devices add shares of their cell's noise and release nothing of
    their own; each cell's sum is the release (the injection point), charged as a trusted edge's release
    (``fedtier.privacy.plan``) with ``s_min`` survivors, the least noise the protocol accepts."""
    plan = make_plan(cfg, device_samples)
    s_min = distributed_min_survivors(cfg)
    out = []
    for row in rows:
        if row.kind == DEVICE and row.parent is not None and row.parent in plan.cells:
            out.append(replace(row, injects=False, distributed=True, releases=0, sensitivity=plan.device_sensitivity,
                               z=plan.cells[row.parent].device_z, sigma=plan.device_sigma(row.parent), protects=0,
                               why=f"adds a 1/{s_min} share of {row.parent}'s noise variance to its update; "
                                   "releases nothing alone (secure aggregation)"))
        elif row.node in plan.cells:
            n = plan.cells[row.node].members
            sigma, sens, z = plan.distributed_release(row.node, s_min, n)
            out.append(replace(row, injects=True, distributed=True, releases=cfg.rounds, sensitivity=sens, z=z,
                               sigma=sigma, protects=n,
                               why=f"sees only its cell's sum (secure aggregation): >= {s_min} devices' noise "
                                   "shares make it one release a round (distributed DP); the edge adds nothing"))
        else:
            out.append(row)
    return out

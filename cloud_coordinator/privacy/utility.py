"""Will the noise leave anything to learn? The signal-to-noise ratio of each tier's aggregate.

A rollout that noise destroys runs to the end without a word unless someone compares the noise
with the signal before it starts. Both are known from the noise plan alone:

* **signal**: every released delta is clipped to norm ``C``, so an edge round's cell mean moves
  the model by at most ``C``, a cell's change over a global round by at most ``tau C``, and so does
  the cloud's weighted average of cells. This is a *bound*: real updates are shorter and point in
  different directions, so the estimate is optimistic — when even it is small, no learning rate helps;
* **noise**: Gaussian, so its norm over the ``M`` parameters a cell releases is close to
  ``sqrt(M var)`` with ``var`` its per-coordinate variance: ``tau sigma_dev^2 / n`` for an untrusted
  cell's change (n devices each add ``sigma_dev`` at every edge round), ``sigma_edge^2`` for a
  trusted cell's release, and ``sum_c n_c^2 var_c / (sum_c n_c)^2`` for the cloud's average (cells
  weighted by their devices; HIST's cells update disjoint submodels, so there each cell's own).

Over ``T`` rounds the signal can add up coherently (``T``) while the noise adds up as a random walk
(``sqrt T``): the rollout's ratio is ``sqrt(T)`` times the per-round one. On the 12 private
configurations of the M2FDP study (docs/experiments.md; non-DP accuracy 0.853) accuracy rises with
it: 1.9-4.5 gave 0.54-0.69 (19 to 32 points lost), 6-10 gave 0.70-0.79, 24 gave 0.84; the rollout
that asked for this warning (2 devices, epsilon 8, digits) ran at 0.016 and ended at chance.
``warnings`` speaks below ``WARN_BELOW``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from fedtier.privacy.plan import NoisePlan

WARN_BELOW = 5.0
"""The rollout's signal-to-noise ratio below which ``warnings`` warns (expect a large accuracy loss)."""
USELESS_BELOW = 1.0
"""... and below which it says the model will likely not learn at all."""


@dataclass(frozen=True)
class Ratio:
    """Signal bound and expected noise norm of one aggregate, per global round."""

    signal: float
    noise: float
    cell: str | None = None  # which cell (the worst of its tier); None for the cloud's update

    @property
    def snr(self) -> float:
        return self.signal / self.noise if self.noise > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"signal": self.signal, "noise": self.noise, "snr": self.snr, "cell": self.cell}


@dataclass(frozen=True)
class Estimate:
    """Per tier (the worst cell of each), the cloud's update, and the whole rollout."""

    device: Ratio | None  # an untrusted cell's change in one round
    edge: Ratio | None  # a trusted cell's release in one round
    cloud: Ratio  # the global update in one round
    rounds: int
    edge_rounds: int
    dominant: str  # "device" or "edge": whose noise is most of the cloud's
    parameters: int

    @property
    def rollout_snr(self) -> float:
        return self.cloud.snr * math.sqrt(self.rounds)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device.to_dict() if self.device else None,
                "edge": self.edge.to_dict() if self.edge else None, "cloud": self.cloud.to_dict(),
                "rounds": self.rounds, "rollout_snr": self.rollout_snr, "dominant": self.dominant,
                "parameters": self.parameters}

    def warnings(self, epsilon: float) -> list[str]:
        """What to tell the operator before the rollout starts (empty when the noise leaves room)."""
        snr = self.rollout_snr
        if snr >= WARN_BELOW:
            return []
        verdict = ("the model will likely not learn at all" if snr < USELESS_BELOW
                   else "expect a large accuracy loss")
        head = (f"noise dominates: each round's global update carries noise of norm ~{self.cloud.noise:.3g} "
                f"against at most {self.cloud.signal:.3g} of clipped signal (signal-to-noise {self.cloud.snr:.2g} "
                f"per round, {snr:.2g} over {self.rounds} rounds) -- {verdict}")
        helps = []
        if self.dominant == "device":
            helps.append("more devices per untrusted cell (a cell mean's noise falls as 1/sqrt(n))")
            helps.append("trusted edges (topology.trusted: one noise per cell and round, divided by its size)")
        else:
            helps.append("larger trusted cells (their noise is divided by their size)")
            if self.edge_rounds > 1:
                helps.append(f"edge_rounds = 1 (a trusted cell that syncs {self.edge_rounds} times a round has "
                             f"sensitivity 2C (1/n + {self.edge_rounds - 1}), not 2C/n)")
        helps.append(f"a larger epsilon (now {epsilon:g})")
        helps.append("device sampling with trusted edges ([privacy] device_sampling: their noise is amplified)")
        return [f"{head}. What would help: {'; '.join(helps)}."]


def estimate(plan: NoisePlan, parameters: Mapping[str, int], *, cells_averaged: bool = True) -> Estimate:
    """The signal-to-noise ratios of ``plan``'s aggregates (see the module docstring).

    Args:
        plan: the rollout's noise plan (every member reporting).
        parameters: cell -> number of parameters its devices train and release.
        cells_averaged: the cloud averages the cells' changes (False for HIST's disjoint submodels).
    """
    tau, clip = plan.edge_rounds, plan.clip
    signal = tau * clip
    variance: dict[str, float] = {}
    for cell, p in plan.cells.items():
        if p.distributed:  # every member adds its share; the sum is divided by n (or the fixed q n)
            variance[cell] = p.members * plan.device_sigma(cell) ** 2 / plan.release_denominator(cell, p.members) ** 2
        elif p.trusted:
            variance[cell] = plan.edge_sigma(cell) ** 2
        else:
            # under device sampling an untrusted cell averages about q n devices a round
            reporting = max(1.0, plan.sample_rate * p.members) if plan.sampled else p.members
            variance[cell] = tau * plan.device_sigma(cell) ** 2 / reporting
    ratios = {c: Ratio(signal, math.sqrt(parameters[c] * v), c) for c, v in variance.items()}

    def worst(trusted: bool) -> Ratio | None:
        tier = [r for c, r in ratios.items() if plan.cells[c].cell_releases == trusted]
        return min(tier, key=lambda r: r.snr) if tier else None

    weights = {c: plan.cells[c].members for c in plan.cells}
    share = {c: weights[c] ** 2 * v for c, v in variance.items()}
    trusted_share = sum(s for c, s in share.items() if plan.cells[c].cell_releases)
    dominant = "edge" if trusted_share > sum(share.values()) - trusted_share else "device"
    if cells_averaged:
        m = max(parameters[c] for c in plan.cells)
        cloud = Ratio(signal, math.sqrt(m * sum(share.values())) / sum(weights.values()))
    else:
        cloud = min(ratios.values(), key=lambda r: r.snr)
        cloud = Ratio(cloud.signal, cloud.noise)
    return Estimate(device=worst(False), edge=worst(True), cloud=cloud, rounds=plan.rounds, edge_rounds=tau,
                    dominant=dominant, parameters=max(parameters.values()))


def parameters_per_cell(cfg: Any, num_features: int, num_classes: int) -> dict[str, int]:
    """How many parameters each cell's devices train (HIST: each cell's submodel), without building anything."""
    from fedtier.training.submodels import fixed_sizes, plan_for, submodel_arch
    from models.zoo import layout_of

    cells = sorted(cfg.topology.layout())
    arch = cfg.model.arch(num_features, num_classes)
    if not cfg.traits.submodels:
        return dict.fromkeys(cells, layout_of(arch).num_parameters)
    split = plan_for(arch, len(cells))
    return {c: layout_of(submodel_arch(split, sizes)).num_parameters
            for c, sizes in zip(cells, fixed_sizes(split, len(cells)), strict=True)}

"""The privacy ledger: one row per noisy release, one per clear hop, per-device epsilon, the budget stop.

Rows are written with the round that produced them, in the same SQLite transaction as the
model (``CoordinatorStore.commit_round``): there is never a model whose releases are not on
the ledger. A release row says who added noise (node, its parent and the parent's trust),
for whom (the protected devices), against which sensitivity and its inputs, with which sigma
and noise multiplier, under which calibration mode — and whether the cloud saw it.

Who a release is charged to never depends on which messages arrived either: a trusted cell's
release is charged to every member of the cell, whether or not it reported (its record lists
the reporters), so the offline recomputation lists the same devices as the live ledger, which
lists every member from the start.

Unseen releases are charged too. Once a round's tasks are out, a device under an untrusted
edge may release at every edge round even if its update never reaches the cloud (it was late,
the cell closed on a quorum — the untrusted edge saw it all the same), and a trusted edge
that missed the deadline may still send its noised aggregate. So at every close the ledger
charges each planned release of the round that has no record, at its planned multiplier,
with ``observed = 0``. A device's epsilon therefore never depends on which messages arrived.

One report takes a release off instead: a distributed-DP cell whose secure aggregation aborted
before any device revealed a share (``fedtier.secagg.protocol.UNREVEALED``: too few keys,
shares or masked inputs) says so to the cloud in time (``secure_fedavg.Cloud`` puts it in the
round's privacy reports), and nothing is charged for it: no sum of that round exists or can
ever be unmasked, since no device revealed and none reveals for a closed round. An abort while
revealing is charged as planned (the shares that did arrive may unmask the sum), and so is an
abort whose report came too late: the conservative side, as for any cell that did not report.

Every release is charged against its sound sensitivity, whatever the calibration mode: a trusted
cell's ``2C (1/n + tau - 1)`` also in paper mode, whose noise is calibrated against Lemma 1's
``2C/n`` (``fedtier.privacy.plan``); the audited record carries that multiplier, and ``planned``
(the budget check) uses it too.

Per-device epsilon comes from the plan's accountant (``accountant.Accountant``: dp-accounting's RDP, or
its PLD with ``[privacy] accountant = "pld"``) over the
multipliers of the releases that protect it; later forwarding of noised data (untrusted
edges, the cloud's broadcast) is post-processing and is not charged again. Before a round
opens, ``admit`` adds that round's planned releases to every device's account and refuses
the round if any device would exceed the budget: the rollout stops *before* the offending
release. ``recompute`` rebuilds every epsilon from the rows alone, for audits.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from cloud_coordinator.privacy.accountant import Accountant
from cloud_coordinator.store import CoordinatorStore
from fedtier.privacy import audit
from fedtier.privacy.plan import NoisePlan
from fedtier.secagg.protocol import UNREVEALED

log = logging.getLogger("fedtier.coordinator.privacy")

# Relative slack for the budget comparison: the calibration solves z to 1e-6 and composes the
# same releases, so an exactly-on-budget plan must not trip on float rounding.
BUDGET_SLACK = 1e-9


class PrivacyLedger:
    """Live ledger of one rollout; rebuilt from the store after a restart."""

    def __init__(self, *, store: CoordinatorStore, rollout: str, plan: NoisePlan,
                 cells: Mapping[str, Iterable[str]], cloud_id: str) -> None:
        self.store = store
        self.rollout = rollout
        self.plan = plan
        self.cells = {c: tuple(sorted(m)) for c, m in cells.items()}
        self.cloud_id = cloud_id
        self.accountant = Accountant(plan.delta, accounting=plan.accountant)
        for device in (d for members in self.cells.values() for d in members):
            self.accountant.add([device], 0.0, 0)  # every device listed, even before its first release
        self.last_charged = -1  # the last round whose rows are on the ledger
        for row in store.privacy_releases(rollout):
            _charge(self.accountant, row)
            self.last_charged = max(self.last_charged, int(row["round"]))

    # --- before a round ---------------------------------------------------------------------------

    def planned(self, device: str, rounds: int = 1) -> list[tuple[Any, ...]]:
        """The releases ``rounds`` global rounds make that protect ``device``: ``(z, count)``, or
        ``(z, count, q, population)`` for a trusted edge's sampled (amplified) releases."""
        cell = next(c for c, m in self.cells.items() if device in m)
        p = self.plan.cells[cell]
        if p.cell_releases:  # charged against the sound sensitivity, with every member reporting (the smallest z)
            q, population = self.plan.edge_event(cell)  # amplified by the edge's secret sampling, if any
            if q < 1.0:
                return [(self.plan.edge_charged_z(cell), rounds, q, population)]
            return [(self.plan.edge_charged_z(cell), rounds)]
        if self.plan.sampled:  # only the rounds the cloud samples this device in (public, capped)
            first = self.last_charged + 1
            rounds = sum(device in self.plan.untrusted_sample(cell, self.cells[cell], r)
                         for r in range(first, first + rounds))
        return [(p.device_z, self.plan.edge_rounds * rounds)]

    def admit(self, round: int) -> str | None:
        """``None`` if opening round ``round`` keeps every device within budget, else why not.

        Counts every round up to ``round`` whose rows are not on the ledger yet: the cloud opens
        the next round before the node has committed the previous one.
        """
        budget = self.plan.budget_epsilon
        pending = max(1, round - self.last_charged)
        worst, worst_eps = "", 0.0
        for members in self.cells.values():
            for device in members:
                eps = self.accountant.epsilon_with(device, self.planned(device, pending))
                if eps > worst_eps:
                    worst, worst_eps = device, eps
        if worst_eps > budget * (1 + BUDGET_SLACK):
            reason = (f"privacy budget: round {round} would take {worst} to epsilon {worst_eps:.4g} "
                      f"> budget {budget:.4g} (delta {self.plan.delta:g})")
            log.warning("rollout %s stops before round %d: %s", self.rollout, round, reason)
            return reason
        return None

    # --- when a round closes ----------------------------------------------------------------------

    def rows_for_round(self, round: int, reports: Mapping[str, Mapping[str, Any]]
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Release rows (observed and charged) and clear-hop rows of a closed round.

        Args:
            round: the round.
            reports: cell -> its update's privacy report (cells that did not report are absent).
        """
        releases: list[dict[str, Any]] = []
        clear: list[dict[str, Any]] = []
        for cell, members in sorted(self.cells.items()):
            p = self.plan.cells[cell]
            report = reports.get(cell) or {}
            seen = {(r["node"], int(r["step"])): r for r in report.get("releases", ())}
            if p.cell_releases:  # a trusted edge's release, or under distributed DP its devices' summed shares
                record = seen.get((cell, 0))
                if record is None and p.distributed and _released_nothing(report):
                    continue  # its secure aggregation aborted before any device revealed: nothing to charge
                if record is not None:
                    # Charged to every member, reported or not, like the planned release below: who is on the
                    # ledger (and a device's epsilon) never depends on which messages arrived.
                    releases.append(self._row(record, round, cell, self.cloud_id, observed=True, protected=members))
                else:
                    n = len(members)
                    planned = audit.release_record(plan=self.plan, node=cell, event="edge", round=round, step=0,
                                                   sigma=self.plan.edge_sigma(cell, n),
                                                   sensitivity=self.plan.edge_sensitivity(n), protected=members,
                                                   reporters=n, z=self.plan.edge_charged_z(cell, n),
                                                   calibrated_sensitivity=self.plan.calibrated_edge_sensitivity(n))
                    releases.append(self._row(planned, round, cell, self.cloud_id, observed=False))
                clear.extend({"round": round, "step": int(c["step"]), "sender": c["sender"],
                              "receiver": c["receiver"], "receiver_trusted": True}
                             for c in report.get("clear", ()))
                continue
            sens = self.plan.device_sensitivity
            for device in self.plan.untrusted_sample(cell, members, round):  # everyone, unless sampling
                for step in range(self.plan.edge_rounds):
                    record = seen.get((device, step))
                    observed = record is not None
                    if record is None:
                        record = audit.release_record(plan=self.plan, node=device, event="device", round=round,
                                                      step=step, sigma=p.device_z * sens, sensitivity=sens,
                                                      protected=[device], z=p.device_z)
                    releases.append(self._row(record, round, device, cell, observed=observed))
        return releases, clear

    def rows_for_releases(self, round: int, records: Iterable[Mapping[str, Any]], clear: Iterable[Mapping[str, Any]]
                          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Release and clear-hop rows of an asynchronous rollout's model version ``round`` (FedBuff): exactly the
        releases of the cell updates the cloud received since the version before, each charged once as it was
        made, nothing planned and nothing amplified (nobody samples in secret; a device's release cap bounds its
        epsilon by the plan's). A trusted edge may release several times in one version: its row's step is the
        cell update's counter (``update``), a device's its own upload counter."""
        rows = []
        for record in records:
            if record.get("event") == "edge":
                row = self._row(record, round, str(record["node"]), self.cloud_id, observed=True)
                row["step"] = int(record["update"])
            else:
                row = self._row(record, round, str(record["node"]), str(record["cell"]), observed=True)
            rows.append(row)
        hops = [{"round": round, "step": int(c["step"]), "sender": c["sender"], "receiver": c["receiver"],
                 "receiver_trusted": True} for c in clear]
        return rows, hops

    def _row(self, record: Mapping[str, Any], round: int, node: str, parent: str, *, observed: bool,
             protected: Iterable[str] = ()) -> dict[str, Any]:
        parent_trusted = parent in self.plan.cells and self.plan.cells[parent].trusted
        return {"round": round, "event": record.get("event", "device"), "step": int(record.get("step", 0)),
                "node": node, "parent": parent, "parent_trusted": parent_trusted,
                "protected": sorted({*(record.get("protected") or [node]), *protected}),
                "sensitivity": float(record["sensitivity"]), "inputs": dict(record.get("inputs") or {}),
                "sigma": float(record["sigma"]), "noise_multiplier": float(record["z"]), "mode": self.plan.mode,
                "observed": observed}

    def charge(self, releases: Iterable[Mapping[str, Any]]) -> None:
        """Add committed rows to the live accounts."""
        for row in releases:
            _charge(self.accountant, row)
            self.last_charged = max(self.last_charged, int(row["round"]))

    def epsilons(self) -> dict[str, float]:
        return self.accountant.epsilons()

    def summary(self) -> dict[str, Any]:
        """Per-round metrics: the live per-device epsilon and its spread."""
        eps = self.epsilons()
        values = list(eps.values()) or [0.0]
        return {"epsilon_max": max(values), "epsilon_min": min(values), "delta": self.plan.delta,
                "budget_epsilon": self.plan.budget_epsilon, "mode": self.plan.mode, "epsilon": eps}


def _released_nothing(report: Mapping[str, Any]) -> bool:
    """Whether a cell's report says its secure aggregation aborted before any share was revealed."""
    abort = report.get("secagg_abort")
    return isinstance(abort, Mapping) and abort.get("phase") in UNREVEALED


def recompute(store: CoordinatorStore, rollout: str, delta: float, accounting: str = "rdp") -> dict[str, float]:
    """Per-device epsilon from the ledger rows alone (offline audit of the live numbers), by ``accounting``."""
    acc = Accountant(delta, accounting=accounting)
    for row in store.privacy_releases(rollout):
        _charge(acc, row)
    return acc.epsilons()


def _charge(acc: Accountant, row: Mapping[str, Any]) -> None:
    """One ledger row into an accountant: a Gaussian, or a sampled one when the row's release was amplified."""
    q, population = audit.sampling_of(row)
    acc.add(row["protected"], row["noise_multiplier"], 1, sampling_rate=q, population=population)

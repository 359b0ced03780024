"""The coordinator's per-round and per-cell Prometheus series (names: docs/operations.md).

The node calls ``round_closed`` with the row it commits to the store (so a scrape and the store
agree), ``presence`` with every status message and ``set_online`` with what the edges' presence
summaries say; this module turns them into gauges, counters and the round-latency histogram on
the node's ``Metrics``.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

from fedtier.runtime.metrics import Metrics
from fedtier.runtime.node_base import REJECTED

ROUND = "fedtier_round"
ACCURACY = "fedtier_accuracy"
LOSS = "fedtier_loss"
ROUND_SECONDS = "fedtier_round_seconds"
DEVICES_REPORTING = "fedtier_devices_reporting"
DEVICES_ONLINE = "fedtier_devices_online"
DEVICES_KNOWN = "fedtier_devices_known"
DROPOUTS = "fedtier_dropouts_total"
QUORUM_MISSES = "fedtier_quorum_misses_total"
MODEL_VERSION = "fedtier_model_version"
EPSILON_CELL = "fedtier_epsilon_spent"
EPSILON_MAX = "fedtier_epsilon_spent_max"
EPSILON_BUDGET = "fedtier_epsilon_budget"
FEDERATED_ACCURACY_MIN = "fedtier_federated_accuracy_min"
QUORUM = "fedtier_quorum"
DEADLINE = "fedtier_round_deadline_timestamp_seconds"


class CoordinatorMetrics:
    """Per-cell series of one rollout: ``cells`` maps each cell to its devices."""

    def __init__(self, metrics: Metrics, cells: Mapping[str, Sequence[str]], *, quorum: float = 1.0,
                 deadline_s: float | None = None) -> None:
        self.metrics = metrics
        self.deadline_s = deadline_s
        self.cells = {c: tuple(d) for c, d in cells.items()}
        self.cell_of = {d: c for c, devices in self.cells.items() for d in devices}
        self.online: set[str] = set()
        for cell, devices in self.cells.items():
            metrics.set(DEVICES_KNOWN, len(devices), cell=cell)
            metrics.set(DEVICES_ONLINE, 0, cell=cell)
            metrics.inc(DROPOUTS, 0, cell=cell)
            metrics.inc(QUORUM_MISSES, 0, cell=cell)
        metrics.set(QUORUM, quorum)
        metrics.set(DEADLINE, math.inf)  # no round open yet

    def presence(self, device: str | None, payload: bytes) -> None:
        """A retained status document of ``device``: online/offline per cell (other nodes ignored)."""
        if device not in self.cell_of:
            return
        try:
            state = json.loads(payload.decode()).get("state") if payload else "offline"
        except (UnicodeDecodeError, ValueError, AttributeError, RecursionError):
            return  # the node base rejects and counts it
        self.set_online(device, state == "online")

    def set_online(self, device: str, online: bool) -> None:
        """``device`` is online or not: from its own presence (``presence``), or from its edge's summary of its
        cell (``cell_presence``, where the device's own presence does not reach the coordinator)."""
        if device not in self.cell_of:
            return
        if online:
            self.online.add(device)
        else:
            self.online.discard(device)
        cell = self.cell_of[device]
        self.metrics.set(DEVICES_ONLINE, sum(1 for d in self.cells[cell] if d in self.online), cell=cell)

    def round_opened(self, now: float) -> None:
        """A round opened at Unix time ``now``: its deadline passes ``deadline_s`` later."""
        if self.deadline_s is not None:
            self.metrics.set(DEADLINE, now + self.deadline_s)

    def no_round_open(self) -> None:
        """Between rounds, paused, stopped or finished: no deadline to miss."""
        self.metrics.set(DEADLINE, math.inf)

    def round_closed(self, row: Mapping[str, Any], reported: Mapping[str, Sequence[str]]) -> None:
        """Everything a closed round changes; ``row`` is the round's stored metrics."""
        m = self.metrics
        self.no_round_open()
        m.set(ROUND, row["round"])
        if row.get("accuracy") is not None:
            m.set(ACCURACY, row["accuracy"])
        if row.get("loss") is not None:
            m.set(LOSS, row["loss"])
        m.observe(ROUND_SECONDS, float(row.get("round_s", 0.0)))
        per_device = (row.get("federated") or {}).get("per_device") or {}
        worst = min((float(d["accuracy"]) for d in per_device.values() if d.get("accuracy") is not None), default=None)
        if worst is not None:  # the worst device's: never a series per device (device ids are no labels)
            m.set(FEDERATED_ACCURACY_MIN, worst)
        missing = set(row.get("missing", ()))
        epsilon = (row.get("privacy") or {}).get("epsilon") or {}
        for cell, devices in self.cells.items():
            m.set(DEVICES_REPORTING, len(reported.get(cell, ())), cell=cell)
            m.inc(DROPOUTS, sum(1 for d in devices if d in missing), cell=cell)
            if cell not in reported:
                m.inc(QUORUM_MISSES, cell=cell)
            if row.get("model_version") is not None:
                m.set(MODEL_VERSION, row["model_version"], cell=cell)
            if epsilon:
                m.set(EPSILON_CELL, max((float(epsilon.get(d, 0.0)) for d in devices), default=0.0), cell=cell)
        if epsilon:
            m.set(EPSILON_MAX, float(row["privacy"].get("epsilon_max", max(epsilon.values()))))
        budget = (row.get("privacy") or {}).get("budget_epsilon")
        if isinstance(budget, (int, float)) and math.isfinite(budget):
            m.set(EPSILON_BUDGET, float(budget))

    # --- what the dashboard asks a running coordinator (``observe.status.Live``) ---------------------

    def devices_online(self, cell: str) -> int | None:
        return int(self.metrics.get(DEVICES_ONLINE, cell=cell)) if cell in self.cells else None

    def rejects(self) -> dict[str, float]:
        """Messages rejected so far, by reason."""
        return {key.removeprefix("reason="): value
                for key, value in self.metrics.snapshot().get(REJECTED, {}).items() if value}

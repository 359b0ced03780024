"""The read side of a coordinator's store, as plain dataclasses: what `fedtier report` plots and the
dashboard shows.

It is built on ``cloud_coordinator.status`` — the functions behind ``fedtier rollout status``,
``rollout list`` and ``rollout models`` — and never reads the store's tables itself, so the
dashboard, the report and the operator's CLI show one truth: ``RolloutStatus.operator`` *is* the
document ``fedtier rollout status ROLLOUT --json`` prints, and devices online per cell come from the
same presence rows. What only a running coordinator knows (``Live``: the rejects by reason, from
its metrics) is added when one runs; offline (``fedtier report``) it is empty.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from cloud_coordinator import status as operator_status
from cloud_coordinator import store_backend
from cloud_coordinator.report import round_epsilon
from cloud_coordinator.store import CoordinatorStore

TIERS = ("device_up", "device_down", "edge_up", "cloud_down")
"""Bytes per tier and direction, as each round's metrics store them."""


@dataclass(frozen=True)
class RoundStatus:
    round: int
    closed: float
    """Unix time the round was committed."""
    accuracy: float | None
    loss: float | None
    epsilon: float | None
    """The ledger's largest per-device epsilon after the round (privacy only)."""
    devices_reported: int
    reported_per_cell: dict[str, int]
    missing: list[str]
    bytes: dict[str, int]
    """Bytes of the round per tier (``TIERS``)."""
    model_version: int | None
    round_s: float
    federated: dict[str, Any] | None = None
    """The devices' evaluation on their held-out rows of the model the round started from (federated
    evaluation): ``loss``, ``accuracy``, ``examples``, ``devices``, ``model_version``; ``per_device``
    ({device: {"accuracy", "loss", "examples", "auroc" (binary tasks, both classes held out)}}) when the
    round carries each device's own (its cells' edges forward it: ``CellUpdate.device_evaluations``)."""


@dataclass(frozen=True)
class CellStatus:
    cell: str
    devices_known: int
    devices_online: int
    """Devices whose last presence the coordinator recorded is ``online`` (as ``rollout status``)."""
    reported_last_round: int
    stragglers: list[str]
    """Devices of the cell missing from the last closed round."""


@dataclass(frozen=True)
class ModelVersionStatus:
    version: int
    round: int
    """The round that produced it (-1: the initial model)."""
    sha256: str
    created: float
    accuracy: float | None = None
    """The coordinator's test accuracy when the round that produced it closed."""
    cells: list[str] = field(default_factory=list)
    """Cells that serve this version (``rollout promote`` / ``rollback``)."""
    canary: str | None = None
    """This version's canary state (``canary_state``): ``canary``, ``promoted``, ``rejected`` (the
    reasons are in ``RolloutStatus.promotions``), ``rolled back to``, or ``None``."""


@dataclass(frozen=True)
class RolloutSummary:
    rollout: str
    status: str
    algorithm: str
    rounds_planned: int
    rounds_closed: int
    accuracy: float | None
    """After the last closed round."""
    created: float
    finished: float | None
    desired: str = ""
    """What the operator last asked (``running``, ``paused``, ``stopped``; an ended rollout: its status)."""


@dataclass(frozen=True)
class RolloutStatus:
    summary: RolloutSummary
    rounds: list[RoundStatus]
    cells: list[CellStatus]
    models: list[ModelVersionStatus]
    rejects: dict[str, float] = field(default_factory=dict)
    """Messages the coordinator rejected, by reason (live only)."""
    operator: dict[str, Any] = field(default_factory=dict)
    """The document of ``fedtier rollout status ROLLOUT --json``, word for word."""
    promotions: list[dict[str, Any]] = field(default_factory=list)
    """Every promotion (candidate, previous, canary cells, passed, reasons), oldest first."""
    live: bool = False
    """A coordinator of this process drives (or drove) the rollout: ``rejects`` are its counts."""

    @property
    def round_in_progress(self) -> int | None:
        """The open round (0-based), or ``None`` when the rollout is over."""
        open_round = self.operator.get("open_round")
        if open_round is not None:
            return int(open_round)
        s = self.summary
        if s.status != "running" or s.rounds_closed >= s.rounds_planned:
            return None
        return s.rounds_closed

    @property
    def progress(self) -> float:
        """Rounds closed over rounds planned, in [0, 1]."""
        s = self.summary
        return min(1.0, s.rounds_closed / s.rounds_planned) if s.rounds_planned else 1.0

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["round_in_progress"] = self.round_in_progress
        doc["progress"] = self.progress
        return _finite(doc)


class Live(Protocol):
    """What a running coordinator knows beyond its store."""

    def rejects(self) -> dict[str, float]: ...


class StoreStatus:
    """Status of the rollouts in the coordinator store at ``location`` (a SQLite path or a store URL;
    opened once, on first use: its reads take no write lock, so it is safe next to the
    coordinator's own connection)."""

    def __init__(self, location: Path | str, live: Live | None = None,
                 live_for: Callable[[str], Live | None] | None = None) -> None:
        self.location = location
        self.live = live
        """What a running coordinator knows, for every rollout (a process that runs one rollout)."""
        self.live_for = live_for
        """... or per rollout: ``None`` for one no coordinator of this process drives (ended, or elsewhere)."""
        self._store: CoordinatorStore | None = None
        self._opening = threading.Lock()

    def _open(self) -> CoordinatorStore:
        with self._opening:
            if self._store is None:
                url = store_backend.parse_url(self.location)
                if "rollouts" not in (store_backend.existing_tables(url) or set()):
                    raise FileNotFoundError(f"no coordinator store at {store_backend.display(url)}")
                self._store = CoordinatorStore(self.location, read_only=True)  # reads only: never migrates
            return self._store

    def rollouts(self) -> list[RolloutSummary]:
        return [RolloutSummary(rollout=r["rollout"], status=r["status"], algorithm=str(r["algorithm"]),
                               rounds_planned=r["rounds_planned"], rounds_closed=r["rounds_closed"],
                               accuracy=r["last_accuracy"], created=r["created"], finished=r["finished"],
                               desired=r["desired"])
                for r in operator_status.rollout_list(self._open())]

    def rollout(self, rollout: str) -> RolloutStatus:
        """Everything about one rollout; ``KeyError`` if the store does not have it."""
        store = self._open()
        if rollout not in {r["rollout"] for r in store.rollout_rows()}:
            raise KeyError(rollout)
        operator = operator_status.rollout_status(store, rollout)
        registry = operator_status.model_registry(store, rollout)
        promotions = store.promotions(rollout)
        rows = store.rounds(rollout)
        config = next(r["config"] for r in store.rollout_rows() if r["rollout"] == rollout)
        summary = RolloutSummary(rollout=rollout, status=operator["status"], algorithm=str(operator["algorithm"]),
                                 rounds_planned=operator["rounds_planned"], rounds_closed=operator["rounds_closed"],
                                 accuracy=operator["last_accuracy"], created=operator["created"],
                                 finished=operator["finished"], desired=operator["desired"])
        layout = cell_layout(config)
        rounds = [round_status(row, layout) for row in rows]
        last = rounds[-1] if rounds else None
        cells = [CellStatus(cell=cell, devices_known=len(devices),
                            devices_online=int(operator["cells"][cell]["devices_online"]),
                            reported_last_round=last.reported_per_cell.get(cell, 0) if last else 0,
                            stragglers=[d for d in devices if last and d in last.missing])
                 for cell, devices in layout.items()]
        latest = {p["candidate"]: p for p in promotions}  # the newest promotion of each candidate
        models = [ModelVersionStatus(version=m["version"], round=m["round"], sha256=m["sha256"], created=m["created"],
                                     accuracy=m["accuracy"], cells=m["cells"],
                                     canary=canary_state(latest.get(m["version"]), m["cells"]))
                  for m in registry]
        live = self.live_for(rollout) if self.live_for is not None else self.live
        rejects = live.rejects() if live is not None else {}
        return RolloutStatus(summary=summary, rounds=rounds, cells=cells, models=models, rejects=rejects,
                             operator=operator, promotions=promotions, live=live is not None)


def canary_state(promotion: Mapping[str, Any] | None, serving: Sequence[str]) -> str | None:
    """A version's canary state from its newest promotion (``cloud_coordinator.canary``):
    ``promoted`` (its gate passed), ``rejected`` (its gate failed), ``rolled back to`` (``rollout
    rollback`` chose it), ``canary`` (its canary cells serve it while the gate decides: no promotion
    is recorded yet); ``None`` when it was never promoted."""
    if promotion is None:
        return "canary" if serving else None
    if not promotion["canary"]:
        return "rolled back to"
    return "promoted" if promotion["passed"] else "rejected"


def cell_layout(config: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Cell -> devices, from a rollout's stored config: its ``[topology]`` alone (the rest may name
    files that have moved since), as the coordinator resolved it."""
    from fedtier.rollout.config import TopologyConfig

    return TopologyConfig.from_mapping(dict(config.get("topology") or {}), prefix="topology").layout()


def round_status(row: Mapping[str, Any], layout: Mapping[str, Sequence[str]]) -> RoundStatus:
    missing = [str(d) for d in row.get("missing") or ()]
    gone = set(missing)
    stored = row.get("bytes") or {}
    return RoundStatus(
        round=int(row["round"]), closed=float(row.get("closed", 0.0)), accuracy=row.get("accuracy"),
        loss=row.get("loss"), epsilon=round_epsilon(row), devices_reported=int(row.get("devices_reported", 0)),
        reported_per_cell={c: sum(1 for d in devices if d not in gone) for c, devices in layout.items()},
        missing=missing, bytes={t: int(stored.get(t, 0)) for t in TIERS},
        model_version=row.get("model_version"), round_s=float(row.get("round_s", 0.0)),
        federated=row.get("federated") if isinstance(row.get("federated"), dict) else None)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: ``None`` instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value

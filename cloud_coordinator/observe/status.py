"""The read side of a coordinator's store, as plain dataclasses: what `fedtier report` plots and the
dashboard shows.

One module reads the store (``rollouts``, ``rounds``, ``models``; the schema is the coordinator's,
never written here), so that both views agree and can be pointed at another status source in one
place. A running coordinator adds what only it knows (``Live``): devices online per cell and the
rejects by reason, from its metrics; offline (``fedtier report``) those are ``None``/empty.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

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


@dataclass(frozen=True)
class CellStatus:
    cell: str
    devices_known: int
    devices_online: int | None
    """``None`` when no coordinator is running to watch presence."""
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


@dataclass(frozen=True)
class RolloutStatus:
    summary: RolloutSummary
    rounds: list[RoundStatus]
    cells: list[CellStatus]
    models: list[ModelVersionStatus]
    rejects: dict[str, float] = field(default_factory=dict)
    """Messages the coordinator rejected, by reason (live only)."""

    @property
    def round_in_progress(self) -> int | None:
        """The open round (0-based), or ``None`` when the rollout is over."""
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

    def devices_online(self, cell: str) -> int | None: ...
    def rejects(self) -> dict[str, float]: ...


class StoreStatus:
    """Status of the rollouts in the coordinator store at ``path`` (opened per call: cheap, and
    safe next to the coordinator's own connection, SQLite in WAL mode)."""

    def __init__(self, path: Path | str, live: Live | None = None) -> None:
        self.path = Path(path)
        self.live = live

    def _open(self) -> CoordinatorStore:
        if not self.path.is_file():
            raise FileNotFoundError(f"no coordinator store at {self.path}")
        return CoordinatorStore(self.path)

    def rollouts(self) -> list[RolloutSummary]:
        store = self._open()
        try:
            with store.db.locked() as db:
                rows = db.execute("SELECT rollout, config, status, created, finished FROM rollouts "
                                  "ORDER BY created").fetchall()
            out = []
            for rollout, config, status, created, finished in rows:
                cfg = json.loads(config)
                rounds = store.rounds(rollout)
                out.append(RolloutSummary(rollout=rollout, status=status, algorithm=str(cfg.get("algorithm", "?")),
                                          rounds_planned=int(cfg.get("rounds", 0)), rounds_closed=len(rounds),
                                          accuracy=rounds[-1]["accuracy"] if rounds else None, created=created,
                                          finished=finished))
            return out
        finally:
            store.close()

    def rollout(self, rollout: str) -> RolloutStatus:
        """Everything about one rollout; ``KeyError`` if the store does not have it."""
        summary = next((s for s in self.rollouts() if s.rollout == rollout), None)
        if summary is None:
            raise KeyError(rollout)
        store = self._open()
        try:
            with store.db.locked() as db:
                config = json.loads(db.execute("SELECT config FROM rollouts WHERE rollout=?",
                                               (rollout,)).fetchone()[0])
                models = [ModelVersionStatus(version=v, round=r, sha256=sha, created=c) for v, r, sha, c in db.execute(
                    "SELECT version, round, sha256, created FROM models WHERE rollout=? ORDER BY version",
                    (rollout,)).fetchall()]
            rows = store.rounds(rollout)
        finally:
            store.close()
        layout = cell_layout(config)
        rounds = [round_status(row, layout) for row in rows]
        last = rounds[-1] if rounds else None
        cells = [CellStatus(cell=cell, devices_known=len(devices),
                            devices_online=self.live.devices_online(cell) if self.live is not None else None,
                            reported_last_round=last.reported_per_cell.get(cell, 0) if last else 0,
                            stragglers=[d for d in devices if last and d in last.missing])
                 for cell, devices in layout.items()]
        rejects = self.live.rejects() if self.live is not None else {}
        return RolloutStatus(summary=summary, rounds=rounds, cells=cells, models=models, rejects=rejects)


def cell_layout(config: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Cell -> devices, from a rollout's stored config: its ``[topology]`` alone (the rest may name
    files that have moved since), as the coordinator resolved it."""
    from cloud_coordinator.config import TopologyConfig

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
        model_version=row.get("model_version"), round_s=float(row.get("round_s", 0.0)))


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: ``None`` instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value

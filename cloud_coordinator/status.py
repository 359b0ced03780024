"""What an operator (and a dashboard) reads about rollouts and devices: plain data from the store.

Every function here reads only the coordinator's SQLite store — never the running process —
so ``fedtier rollout status`` works whether or not the coordinator runs, and gives the same
answer before and after it restarts (the store is the rollout's whole state). The results are
plain ``dict``/``list`` values of JSON types, for ``--json``, the rich tables, and whatever else
(metrics exporters, a report, a web page) wants to show them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from cloud_coordinator import store_backend as backend
from cloud_coordinator.store import CoordinatorStore
from fedtier.errors import ConfigError
from fedtier.rollout.config import store_url

def open_store(state_dir: Path | str, store: str | None = None, *, read_only: bool = False) -> CoordinatorStore:
    """The coordinator's store (``store``, else the SQLite file in ``state_dir``); it must exist: a
    coordinator or ``rollout create`` made it. Nothing is created where there is none; with
    ``read_only`` (commands that only read) nothing is migrated either (``CoordinatorStore``).

    Raises:
        ConfigError: no store there.
    """
    url = backend.parse_url(store_url(state_dir, store))
    if "rollouts" not in (backend.existing_tables(url) or set()):
        raise ConfigError(f"no coordinator store at {backend.display(url)}: `fedtier rollout create --config ...` "
                          "makes one (or pass --state-dir / set FEDTIER_STATE_DIR to the coordinator's state_dir, "
                          "or --store / FEDTIER_STORE to its store URL)", key="store" if store else "state_dir")
    return CoordinatorStore(url.render_as_string(hide_password=False), read_only=read_only)


def schema_notice(location: Path | str, where: str | None = None) -> str | None:
    """What a read-only command says about the store at ``location`` when a migration is due (``None``: none is),
    read without changing it; ``where`` is how the command named the store (``--state-dir DIR``)."""
    url = backend.parse_url(location)
    if "rollouts" not in (backend.existing_tables(url) or set()):
        return None
    engine = backend.make_engine(url, read_only=True)
    try:
        found = backend.read_schema(engine, url)
    finally:
        engine.dispose()
    return backend.migration_due(url, found, where) if 0 < found < backend.SCHEMA_VERSION else None


def _config(store: CoordinatorStore, rollout: str) -> dict[str, Any]:
    for row in store.rollout_rows():
        if row["rollout"] == rollout:
            return row
    known = ", ".join(r["rollout"] for r in store.rollout_rows()) or "none"
    raise ConfigError(f"no rollout {rollout!r} in this store (rollouts: {known})", key="rollout")


def cells_of(config: dict[str, Any]) -> dict[str, list[str]]:
    """The rollout's cells and their devices, from its stored config."""
    from fedtier.rollout.config import TopologyConfig

    topology = TopologyConfig.from_mapping(config.get("topology", {}), prefix="topology")
    return {c: list(m) for c, m in topology.layout().items()}


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _desired(row: dict[str, Any]) -> str:
    """What was asked of a rollout; an ended rollout asks nothing more (its status, then)."""
    if row["status"] in ("finished", "stopped") or not row["desired"]:
        return str(row["status"])
    return str(row["desired"])


def rollout_status(store: CoordinatorStore, rollout: str) -> dict[str, Any]:
    """The whole status of ``rollout``: lifecycle, open round, accuracy, epsilon, bytes, and per cell
    devices online/known, updates accepted and rejected by reason, devices that failed to train by reason
    (over all rounds) and those of the last round, stragglers, deployed version; per round, how the devices
    did on their own held-out rows (``federated_per_device``).

    Only state the coordinator stored (no clock is read), so it is stable across restarts.
    """
    row = _config(store, rollout)
    config = row["config"]
    cells = cells_of(config)
    rounds = store.rounds(rollout)
    presence = {p["node"]: p for p in store.presence()}
    open_round = store.open_round(rollout)
    deployed = store.deployments(rollout)
    models = store.models(rollout)
    last = rounds[-1] if rounds else {}
    privacy = last.get("privacy") or {}
    totals: dict[str, int] = {}
    for r in rounds:
        for tier, n in (r.get("bytes") or {}).items():
            totals[tier] = totals.get(tier, 0) + int(n)
    per_cell: dict[str, Any] = {}
    for cell, members in cells.items():
        online = sorted(d for d in members if presence.get(d, {}).get("state") == "online")
        accepted = 0
        rejected: dict[str, int] = {}
        failures: dict[str, int] = {}
        for r in rounds:
            info = (r.get("cells") or {}).get(cell)
            if info is None:  # a round closed before per-cell rows existed
                continue
            accepted += len(info.get("reported", []))
            for reason, n in (info.get("rejected") or {}).items():
                rejected[reason] = rejected.get(reason, 0) + int(n)
            for reason in (info.get("failed") or {}).values():
                failures[reason] = failures.get(reason, 0) + 1
        last_cell = (last.get("cells") or {}).get(cell, {})
        per_cell[cell] = {
            "devices_known": len(members),
            "devices_online": len(online),
            "offline": sorted(set(members) - set(online)),
            "edge": presence.get(cell, {}).get("state", "unknown"),
            "round_open": open_round is not None and cell in open_round["cells"],
            "updates_accepted": accepted,
            "updates_rejected": dict(sorted(rejected.items())),
            "training_failed": dict(sorted(failures.items())),
            "failed_last_round": dict(sorted((last_cell.get("failed") or {}).items())),
            "stragglers": list(last_cell.get("missing", [])),
            "deployed_version": deployed.get(cell),
        }
    return {
        "rollout": rollout,
        "algorithm": config.get("algorithm", "fedavg"),
        "status": row["status"],
        "desired": _desired(row),
        "created": row["created"],
        "finished": row["finished"],
        "rounds_planned": int(config.get("rounds", 0)),
        "rounds_closed": len(rounds),
        "open_round": None if open_round is None else open_round["round"],
        "model_version": models[-1]["version"] if models else None,
        "last_accuracy": _finite(last.get("accuracy")),
        "last_loss": _finite(last.get("loss")),
        "epsilon_spent": privacy.get("epsilon_max"),
        "epsilon_budget": _finite(privacy.get("budget_epsilon")),
        "bytes": dict(sorted(totals.items())),
        "cells": per_cell,
        "federated_per_device": federated_per_device(rounds),
    }


def federated_per_device(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round whose devices reported their own federated evaluation (``federated.per_device``): the spread
    across devices (``cloud_coordinator.report.device_spread``: min, median, max, the worst devices), the model
    version evaluated, and every device's own figures (``per_device``)."""
    from cloud_coordinator.report import device_spread

    out = []
    for r in rounds:
        federated = r.get("federated") or {}
        per_device = federated.get("per_device") or {}
        spread = device_spread(per_device)
        if spread is not None:
            out.append({"round": r["round"], "model_version": federated.get("model_version"), **spread,
                        "per_device": per_device})
    return out


def rollout_list(store: CoordinatorStore) -> list[dict[str, Any]]:
    """One line per rollout: id, algorithm, status, desired, rounds closed/planned, last accuracy, created,
    finished."""
    out = []
    for row in store.rollout_rows():
        rounds = store.rounds(row["rollout"])
        out.append({"rollout": row["rollout"], "algorithm": row["config"].get("algorithm", "fedavg"),
                    "status": row["status"], "desired": _desired(row),
                    "rounds_closed": len(rounds), "rounds_planned": int(row["config"].get("rounds", 0)),
                    "last_accuracy": _finite(rounds[-1].get("accuracy")) if rounds else None,
                    "created": row["created"], "finished": row["finished"]})
    return out


def device_inventory(store: CoordinatorStore, cell: str | None = None) -> list[dict[str, Any]]:
    """Every node the coordinator has seen (presence) or that a rollout names, one dict each.

    ``last_seen`` is the newest sign of life the coordinator recorded: a changed presence document,
    or the commit of a round the node's update made (a device that trains sends no presence while it
    is online, so its presence alone would freeze "last seen" at its connection).

    Fields: node, role, cell (a device's: where its presence last put it, else the cell its rollout names; a device
    of a roaming rollout moves), state (online/offline/unknown), since, last_seen, agent_version,
    trainer, instance, last_round (rollout, round it last contributed to), trained_version (the
    model version that round started from) and model_version (the version its cell serves:
    ``fedtier rollout promote`` / ``rollback``; None until one is promoted).
    """
    presence = {p["node"]: p for p in store.presence()}
    contributions = store.contributions()
    member_of: dict[str, tuple[str, str]] = {}  # device or edge -> (rollout, cell), the newest rollout naming it
    deployed: dict[tuple[str, str], int] = {}
    for row in store.rollout_rows():
        for c, members in cells_of(row["config"]).items():
            member_of[c] = (row["rollout"], c)  # the cell's edge
            for d in members:
                member_of[d] = (row["rollout"], c)
        for c, v in store.deployments(row["rollout"]).items():
            deployed[(row["rollout"], c)] = v
    nodes = sorted(set(presence) | set(member_of))
    closes: dict[str, dict[int, float]] = {}  # rollout -> round -> committed, for the contributions' rounds
    for made in contributions.values():
        if made["rollout"] not in closes:
            closes[made["rollout"]] = store.round_close_times(made["rollout"])
    out = []
    for node in nodes:
        doc = presence.get(node, {})
        rollout, node_cell = member_of.get(node, (None, doc.get("cell")))
        if isinstance(doc.get("cell"), str) and doc.get("role", "device") == "device":
            node_cell = doc["cell"]  # where it announced itself (or its edge listed it): a roaming device moves
        role = doc.get("role") or ("device" if node in member_of and member_of[node][1] != node else
                                   "edge" if node in member_of else None)
        if role == "cloud":
            continue
        if role == "edge" and node_cell is None:
            node_cell = node
        if cell is not None and node_cell != cell:
            continue
        contribution = contributions.get(node)
        seen = doc.get("last_seen")
        if contribution is not None:
            committed = closes.get(contribution["rollout"], {}).get(contribution["round"])
            if committed is not None and (seen is None or committed > seen):
                seen = committed
        out.append({
            "node": node, "role": role, "cell": node_cell, "rollout": rollout,
            "state": doc.get("state", "unknown"), "since": doc.get("since"), "last_seen": seen,
            "agent_version": doc.get("version"), "trainer": doc.get("trainer"), "instance": doc.get("instance"),
            "last_round": None if contribution is None else contribution["round"],
            "trained_version": None if contribution is None else contribution["model_version"],
            "model_version": deployed.get((rollout, node_cell)) if rollout and node_cell else None,
        })
    return out


def model_registry(store: CoordinatorStore, rollout: str) -> list[dict[str, Any]]:
    """The rollout's model versions (version, round, accuracy, sha256, created) and which cells serve each."""
    _config(store, rollout)
    deployed = store.deployments(rollout)
    return [{**{k: _finite(v) for k, v in m.items()},
             "cells": sorted(c for c, v in deployed.items() if v == m["version"])} for m in store.models(rollout)]

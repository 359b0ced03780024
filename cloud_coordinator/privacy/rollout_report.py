"""``fedtier privacy report`` without its command line: one rollout's report, gathered from the coordinator's
database, the metrics file beside it and, when given, the rollout config.

The database's ledger rows are what the report is computed from (``report.build``); the rollout's own round
metrics, then its metrics file, then the config fill in what the rows do not carry (delta, the budget, the
accountant, the planned rounds, why it stopped). A config that now disagrees with what the rollout ran with
is reported as a warning, never used. The store is opened only after checking that it is a coordinator
database with a privacy ledger: opening a store creates its tables, which must not happen to some other
database given by mistake.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fedtier.errors import ConfigError


class ReportError(Exception):
    """The report cannot be made from what was given (no such database or rollout, no ledger rows, no delta):
    the message says what to give instead, and the command shows it as a usage error."""


@dataclass(frozen=True)
class _Ledger:
    """What the report reads from the database, with the delta and accountant it is charged under."""

    status: Any
    releases: list[dict[str, Any]]
    clear: list[dict[str, Any]]
    rounds: list[dict[str, Any]]
    live: Mapping[str, Any]
    delta: float
    accounting: str
    recomputed: dict[str, float]
    by_accountant: dict[str, float]


def rollout_report(cfg: Any, *, config_path: Path | None, db_path: Path | None, rollout_id: str | None,
                   out_path: Path | None) -> dict[str, Any]:
    """The report of one rollout (``report.build``'s document with its plot written, ``plot`` naming it).

    Args:
        cfg: The loaded rollout config, or ``None`` (then ``db_path`` and ``rollout_id`` say where to look).
        config_path: The config's file, for messages.
        db_path: A coordinator database to read instead of the config's store.
        rollout_id: The rollout in it (default: the config's).
        out_path: Where to write the epsilon plot (default: ``privacy_epsilon.png`` beside the database).

    Raises:
        ReportError: Nothing says which rollout, or the database or rollout has no ledger to report.
    """
    from cloud_coordinator.privacy import report as rep

    location = _store_location(cfg, db_path)
    rollout = rollout_id or (cfg.rollout if cfg is not None else None)
    if rollout is None:
        raise ReportError(f"--db {db_path} needs --rollout ID (or --config naming the rollout)")
    store, db, migration_due = _open_store(location, f" (the store of {config_path})" if db_path is None else "")
    metrics_path = cfg.metrics_path if cfg is not None else Path(db_path or ".").parent / "metrics.json"
    metrics = _read_metrics(metrics_path, rollout)
    p = cfg.privacy if cfg is not None else None
    plan = metrics.get("noise_plan") or {}
    try:
        ledger = _read_ledger(store, rollout, db, plan, p)
    finally:
        store.close()
    budget = _budget(ledger.live, plan, p)
    modes = sorted({str(r["mode"]) for r in ledger.releases})
    rounds_planned = metrics.get("rounds_planned", cfg.rounds if cfg is not None else None)
    doc = rep.build(rollout=rollout, db=db, releases=ledger.releases, clear=ledger.clear, rounds=ledger.rounds,
                    recomputed=ledger.recomputed, delta=ledger.delta, budget=budget, mode=",".join(modes),
                    status=ledger.status, rounds_planned=rounds_planned, stopped=metrics.get("stopped"),
                    accounting=ledger.accounting, by_accountant=ledger.by_accountant)
    doc["warnings"] += _config_warnings(config_path, p, ledger.delta, budget)
    if metrics.get("_error"):
        doc["warnings"].append(metrics["_error"])
    out = out_path if out_path is not None else (cfg.state_dir if cfg is not None and db_path is None
                                                 else Path(db_path or ".").parent) / "privacy_epsilon.png"
    rep.plot_epsilon(doc["rounds"], out, budget=budget, delta=ledger.delta, mode=doc["mode"], rollout=rollout)
    doc["plot"] = str(out)
    doc["metrics_file"] = str(metrics_path) if metrics.get("_found") else None
    doc["migration_due"] = migration_due
    return doc


def _store_location(cfg: Any, db_path: Path | None) -> Any:
    """The database given by ``--db``, else the config's store."""
    if db_path is not None:
        return str(db_path)
    if cfg is not None:
        return cfg.store_location
    raise ReportError("say which rollout: --config ROLLOUT.toml, or --db PATH with --rollout ID")


def _read_ledger(store: Any, rollout: str, db: str, plan: Mapping[str, Any], p: Any) -> _Ledger:
    """The rollout's ledger rows and round metrics, and every device's epsilon recomputed from the rows: by the
    rollout's accountant, and the largest by each accountant (rdp and pld) for comparison."""
    from cloud_coordinator.privacy.ledger import recompute

    status = store.status(rollout)
    if status is None:
        raise ReportError(f"no rollout {rollout!r} in {db}")
    releases = store.privacy_releases(rollout)
    if not releases:
        raise ReportError(f"rollout {rollout!r} in {db} has no privacy-ledger rows: it ran without "
                          "[privacy], or no round has closed yet")
    clear, rounds = store.privacy_clear(rollout), store.rounds(rollout)
    # The rollout's own delta and budget (its round metrics, else its metrics file), else the config's.
    live = next((r["privacy"] for r in reversed(rounds) if r.get("privacy")), None) or {}
    delta = live.get("delta", plan.get("delta", p.delta if p is not None else None))
    if delta is None:
        raise ReportError(f"{db}: rollout {rollout!r} records no delta (no round metrics); give --config")
    delta = float(delta)
    accounting = str(plan.get("accountant") or (p.accountant if p is not None else "rdp"))
    recomputed = recompute(store, rollout, delta, accounting)
    by_accountant = {accounting: max(recomputed.values(), default=0.0)}
    for other in ("rdp", "pld"):
        if other != accounting:
            by_accountant[other] = max(recompute(store, rollout, delta, other).values(), default=0.0)
    return _Ledger(status=status, releases=releases, clear=clear, rounds=rounds, live=live, delta=delta,
                   accounting=accounting, recomputed=recomputed, by_accountant=by_accountant)


def _budget(live: Mapping[str, Any], plan: Mapping[str, Any], p: Any) -> float:
    """The budget the rollout ran with: its round metrics', else its noise plan's, else the config's (no budget
    given: the target epsilon); ``inf`` when none says (JSON carries an unlimited budget as null)."""
    if "budget_epsilon" in live:
        return math.inf if live["budget_epsilon"] is None else float(live["budget_epsilon"])
    if plan:
        return math.inf if plan.get("budget_epsilon") is None else float(plan["budget_epsilon"])
    if p is not None:
        return float(p.budget_epsilon if p.budget_epsilon is not None else p.epsilon)
    return math.inf


def _config_warnings(config_path: Path | None, p: Any, delta: float, budget: float) -> list[str]:
    """A config whose delta or budget changed since the rollout ran: the report keeps the rollout's."""
    from cloud_coordinator.privacy.report import agrees

    if p is None:
        return []
    warnings = []
    if not agrees(p.delta, float(delta), 1e-12):
        warnings.append(f"{config_path} now says delta {p.delta:g}; the rollout ran with {delta:g} "
                        "(this report uses the rollout's)")
    config_budget = float(p.budget_epsilon if p.budget_epsilon is not None else p.epsilon)
    if not (config_budget == budget or agrees(config_budget, budget, 1e-12)):
        warnings.append(f"{config_path} now says budget {config_budget:g}; the rollout ran with "
                        f"{budget:g} (this report uses the rollout's)")
    return warnings


def _open_store(location: str, where: str) -> tuple[Any, str, str | None]:
    """The coordinator's store at ``location`` (opened read-only), its name for messages, and the notice that a
    migration is due (``None`` if not), after checking that it is one: a report must neither create tables in
    some other database given by mistake nor migrate a store a coordinator of an older version may still run on."""
    from cloud_coordinator import store_backend as backend
    from cloud_coordinator.store import CoordinatorStore

    url = backend.parse_url(location)
    name = backend.display(url) if "://" in location else location
    try:
        tables = backend.existing_tables(url)
    except ConfigError as exc:
        raise ReportError(exc.message) from None
    if tables is None:
        raise ReportError(f"no coordinator database at {name}{where}: has the rollout run?")
    missing = {"rollouts", "rounds", "privacy_releases", "privacy_clear"} - tables
    if missing:
        raise ReportError(f"{name} is not a coordinator database with a privacy ledger "
                          f"(no table {', '.join(sorted(missing))})")
    store = CoordinatorStore(location, read_only=True)  # a report only reads: it never migrates the store
    due = (backend.migration_due(url, store.schema_found, f"--store {backend.display(url)}")
           if store.migration_due else None)
    return store, name, due


def _read_metrics(path: Path, rollout: str) -> dict[str, Any]:
    """The coordinator's metrics JSON of ``rollout`` (``{}`` if absent or of another rollout)."""
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"_error": f"metrics file {path} unreadable ({exc}); stop reason unknown"}
    if not isinstance(doc, dict) or doc.get("rollout") != rollout:
        return {}
    return {**doc, "_found": True}

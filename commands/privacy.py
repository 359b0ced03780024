"""``fedtier privacy``: a rollout's noise plan before it runs, and its privacy ledger after.

Thin commands over :mod:`cloud_coordinator.privacy` (``calibrate`` for the plan, ``ledger`` and
``report`` for the audit).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from cloud_coordinator.privacy.plan_view import plan_document, render_plan
from fedtier.errors import ConfigError

CONFIG_HELP = "Rollout config (the same file `fedtier simulate` and `fedtier coordinator run` take)."


@click.group()
def privacy() -> None:
    """Differential privacy (M2FDP): the noise plan before a rollout, the ledger's report after it.

    Devices under untrusted cells add Gaussian noise to every update they release; trusted
    cells (topology.trusted) receive clear updates over TLS and add the noise themselves
    when they forward to the cloud. Every epsilon shown is the RDP accountant's.
    """


# --- plan -----------------------------------------------------------------------------------------


@privacy.command("plan")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help=CONFIG_HELP + " It needs a [privacy] section.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the plan as JSON: the header, both tiers, and one entry per node of the tree.")
def plan(config_path: Path, as_json: bool) -> None:
    """Show the resolved noise plan of a rollout before it runs.

    For every node of the aggregation tree: its declared trust label, the effective one (a
    server with an untrusted child is untrusted; undeclared servers are untrusted), whether it
    adds noise, how many releases it makes, their sensitivity, noise multiplier z and sigma.
    The header gives each tier's epsilon from the RDP accountant and warns when it exceeds the
    budget, i.e. when the rollout would stop early. It estimates each tier's signal-to-noise
    ratio (the clipped signal's bound against the noise's norm) and warns, with what would help,
    when the noise would drown the model. Deeper trees (topology.parents) are shown too, although
    rollouts run device -> cell -> cloud.

    \b
        fedtier privacy plan --config experiments/digits_private.toml
    """
    try:
        cfg = _load(config_path)
        if cfg.privacy is None:
            raise click.UsageError(f"{config_path}: no [privacy] section: add one with at least `epsilon` and `clip` "
                                   "(see docs/configuration.md) to plan differential privacy")
        doc = plan_document(cfg, config_path)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        from cloud_coordinator.privacy.report import jsonable

        click.echo(json.dumps(jsonable(doc), indent=1))
    else:
        click.echo(render_plan(doc))


def _load(config_path: Path) -> Any:
    from fedtier.rollout.config import RolloutConfig
    from fedtier.runtime.config import load

    return load(RolloutConfig, config_path)


# --- report ---------------------------------------------------------------------------------------


@privacy.command("report")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help=CONFIG_HELP + " Its state_dir holds the coordinator's database (coordinator.db).")
@click.option("--db", "db_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A coordinator.db to read instead of <state_dir>/coordinator.db (then --rollout names the "
                   "rollout unless --config does).")
@click.option("--rollout", "rollout_id", default=None,
              help="Rollout id inside the database (default: the config's `rollout`).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the epsilon-vs-round PNG (default: privacy_epsilon.png next to the database).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON (per device, per tier, per round; infinite values as null).")
def report(config_path: Path | None, db_path: Path | None, rollout_id: str | None, out_path: Path | None,
           as_json: bool) -> None:
    """Audit a rollout's privacy ledger, from the coordinator's database.

    Recomputes every device's epsilon offline from the ledger rows (one row per noisy release,
    charged even when the cloud never saw it) and compares it with the live value the
    coordinator reported in the last round's metrics; summarises the device tier (devices under
    untrusted cells) and the edge tier (trusted cells); checks that every clear hop went to a
    trusted cell; says whether the rollout finished or the budget stopped it; shows each round's
    test accuracy beside its epsilon; and writes a plot of epsilon after each round (max and min
    over devices, and the budget).

    It reads the database `fedtier coordinator run` keeps in its state_dir (`fedtier simulate`
    keeps none), so run the rollout first:

    \b
        fedtier coordinator run --config coordinator.toml
        fedtier privacy report --config coordinator.toml
        fedtier privacy report --db fedtier-state/coordinator.db --rollout default --out eps.png
    """
    from cloud_coordinator.privacy import report as rep
    from cloud_coordinator.privacy.ledger import recompute

    try:
        cfg = _load(config_path) if config_path is not None else None
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if db_path is not None:
        location = str(db_path)
    elif cfg is not None:
        location = cfg.store_location
    else:
        raise click.UsageError("say which rollout: --config ROLLOUT.toml, or --db PATH with --rollout ID")
    rollout = rollout_id or (cfg.rollout if cfg is not None else None)
    if rollout is None:
        raise click.UsageError(f"--db {db_path} needs --rollout ID (or --config naming the rollout)")
    store, db = _open_store(location, f" (the store of {config_path})" if db_path is None else "")
    metrics_path = cfg.metrics_path if cfg is not None else Path(db_path or ".").parent / "metrics.json"
    metrics = _read_metrics(metrics_path, rollout)
    p = cfg.privacy if cfg is not None else None
    plan = metrics.get("noise_plan") or {}
    try:
        status = store.status(rollout)
        if status is None:
            raise click.UsageError(f"no rollout {rollout!r} in {db}")
        releases = store.privacy_releases(rollout)
        if not releases:
            raise click.UsageError(f"rollout {rollout!r} in {db} has no privacy-ledger rows: it ran without "
                                   "[privacy], or no round has closed yet")
        clear, rounds = store.privacy_clear(rollout), store.rounds(rollout)
        # The rollout's own delta and budget (its round metrics, else its metrics file), else the config's.
        live = next((r["privacy"] for r in reversed(rounds) if r.get("privacy")), None) or {}
        delta = live.get("delta", plan.get("delta", p.delta if p is not None else None))
        if delta is None:
            raise click.UsageError(f"{db}: rollout {rollout!r} records no delta (no round metrics); give --config")
        delta = float(delta)
        accounting = str(plan.get("accountant") or (p.accountant if p is not None else "rdp"))
        recomputed = recompute(store, rollout, delta, accounting)
        by_accountant = {accounting: max(recomputed.values(), default=0.0)}
        for other in ("rdp", "pld"):
            if other != accounting:
                by_accountant[other] = max(recompute(store, rollout, delta, other).values(), default=0.0)
    finally:
        store.close()
    if "budget_epsilon" in live:
        budget = math.inf if live["budget_epsilon"] is None else float(live["budget_epsilon"])
    elif plan:
        budget = math.inf if plan.get("budget_epsilon") is None else float(plan["budget_epsilon"])
    elif p is not None:
        budget = float(p.budget_epsilon if p.budget_epsilon is not None else p.epsilon)
    else:
        budget = math.inf
    modes = sorted({str(r["mode"]) for r in releases})
    rounds_planned = metrics.get("rounds_planned", cfg.rounds if cfg is not None else None)
    doc = rep.build(rollout=rollout, db=db, releases=releases, clear=clear, rounds=rounds, recomputed=recomputed,
                    delta=delta, budget=budget, mode=",".join(modes), status=status, rounds_planned=rounds_planned,
                    stopped=metrics.get("stopped"), accounting=accounting, by_accountant=by_accountant)
    if p is not None:
        if not rep.agrees(p.delta, float(delta), 1e-12):
            doc["warnings"].append(f"{config_path} now says delta {p.delta:g}; the rollout ran with {delta:g} "
                                   "(this report uses the rollout's)")
        config_budget = float(p.budget_epsilon if p.budget_epsilon is not None else p.epsilon)
        if not (config_budget == budget or rep.agrees(config_budget, budget, 1e-12)):
            doc["warnings"].append(f"{config_path} now says budget {config_budget:g}; the rollout ran with "
                                   f"{budget:g} (this report uses the rollout's)")
    if metrics.get("_error"):
        doc["warnings"].append(metrics["_error"])
    out = out_path if out_path is not None else (cfg.state_dir if cfg is not None and db_path is None
                                                 else Path(db_path or ".").parent) / "privacy_epsilon.png"
    rep.plot_epsilon(doc["rounds"], out, budget=budget, delta=delta, mode=doc["mode"], rollout=rollout)
    doc["plot"] = str(out)
    doc["metrics_file"] = str(metrics_path) if metrics.get("_found") else None
    if as_json:
        click.echo(json.dumps(rep.jsonable(doc), indent=1))
    else:
        click.echo(rep.render(doc))
        click.echo(f"\nplot: {out}")


def _open_store(location: str, where: str) -> tuple[Any, str]:
    """The coordinator's store at ``location`` and its name for messages, after checking (without
    writing) that it is one: opening a store creates its tables, which must not happen to some
    other database given by mistake."""
    from cloud_coordinator import store_backend as backend
    from cloud_coordinator.store import CoordinatorStore

    url = backend.parse_url(location)
    name = backend.display(url) if "://" in location else location
    try:
        tables = backend.existing_tables(url)
    except ConfigError as exc:
        raise click.UsageError(exc.message) from None
    if tables is None:
        raise click.UsageError(f"no coordinator database at {name}{where}: has the rollout run?")
    missing = {"rollouts", "rounds", "privacy_releases", "privacy_clear"} - tables
    if missing:
        raise click.UsageError(f"{name} is not a coordinator database with a privacy ledger "
                               f"(no table {', '.join(sorted(missing))})")
    store = CoordinatorStore(location, read_only=True)  # a report only reads: it never migrates the store
    if store.migration_due:
        click.echo(backend.migration_due(url, store.schema_found, f"--store {backend.display(url)}"), err=True)
    return store, name


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

"""``fedtier privacy``: a rollout's noise plan before it runs, and its privacy ledger after.

Thin commands over :mod:`cloud_coordinator.privacy` (``plan_view`` for the plan, ``rollout_report``
and ``report`` for the audit): options in, usage errors out.
"""

from __future__ import annotations

import json
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
    _convergence_note()


def _convergence_note() -> None:
    """dp-accounting's convergence warnings, summarised in one line on stderr (``accountant.convergence_note``)."""
    from cloud_coordinator.privacy.accountant import convergence_note

    note = convergence_note()
    if note is not None:
        click.echo(note, err=True)


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
    from cloud_coordinator.privacy.rollout_report import ReportError, rollout_report

    try:
        cfg = _load(config_path) if config_path is not None else None
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        doc = rollout_report(cfg, config_path=config_path, db_path=db_path, rollout_id=rollout_id, out_path=out_path)
    except ReportError as exc:
        raise click.UsageError(str(exc)) from None
    if doc.get("migration_due"):  # a report only reads: it never migrates the store, it says so
        click.echo(doc["migration_due"], err=True)
    if as_json:
        click.echo(json.dumps(rep.jsonable(doc), indent=1))
    else:
        click.echo(rep.render(doc))
        click.echo(f"\nplot: {doc['plot']}")
    _convergence_note()

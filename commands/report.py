"""``fedtier report``: plots and a markdown summary of a rollout, from the coordinator's store."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("rollout")
@click.option("--store", "store_path", metavar="PATH|URL", default=None,
              help="The coordinator's store: its SQLite file (<state_dir>/coordinator.db) or its URL "
                   "(postgresql://...).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The rollout config the coordinator ran (its state_dir holds the database).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for report.md and the PNGs (default: report-ROLLOUT).")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def report(rollout: str, store_path: str | None, config_path: Path | None, out: Path | None, as_json: bool) -> None:
    """Plot a rollout from the coordinator's store: accuracy and loss per round, bytes per tier
    (cumulative), accuracy against bytes, epsilon per round, devices reporting per round and cell;
    and report.md, a summary that links the plots. Works during a rollout too.

    \b
        fedtier report hand1 --config fleet/coordinator/hand1.toml --out report
        fedtier report t --store state/coordinator/coordinator.db
    """
    from cloud_coordinator.observe.plots import write_report
    from cloud_coordinator.observe.status import StoreStatus

    if (store_path is None) == (config_path is None):
        raise click.UsageError("give exactly one of --store and --config")
    if config_path is not None:
        from fedtier.rollout.config import RolloutConfig
        from fedtier.runtime.config import load

        store_path = load(RolloutConfig, config_path).store_location
    assert store_path is not None
    from cloud_coordinator.status import schema_notice

    notice = schema_notice(store_path, f"--config {config_path}" if config_path is not None else None)
    if notice:
        click.echo(notice, err=True)
    try:
        status = StoreStatus(store_path).rollout(rollout)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyError:
        known = ", ".join(s.rollout for s in StoreStatus(store_path).rollouts()) or "none"
        raise click.ClickException(f"no rollout {rollout!r} in {store_path} (it has: {known})") from None
    written = write_report(status, out or Path(f"report-{rollout}"))
    if as_json:
        click.echo(json.dumps({"rollout": rollout, "markdown": str(written.markdown),
                               "plots": {k: str(v) for k, v in written.plots.items()},
                               "rounds": len(status.rounds)}))
        return
    click.echo(f"wrote {written.markdown} and {len(written.plots)} plots ({status.summary.rounds_closed} rounds of "
               f"{status.summary.rounds_planned})")

"""``fedtier coordinator`` and ``fedtier simulate``: thin commands over library functions."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

LOG_LEVELS = ["debug", "info", "warning", "error"]


@click.group()
def coordinator() -> None:
    """Cloud coordinator: drives a rollout's rounds, aggregates cells, evaluates, keeps state."""


@coordinator.command("run")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Rollout config (same format as experiments/*.toml; see docs/configuration.md).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default=None, help="Override the config's log level.")
def coordinator_run(config_path: Path, log_level: str | None) -> None:
    """Run the rollout over MQTT until its last round closes (or SIGINT/SIGTERM).

    State (rounds, model versions, accepted updates of the open round) is in
    <state_dir>/coordinator.db: run the same command again to resume after a crash.
    """
    from cloud_coordinator.config import RolloutConfig
    from cloud_coordinator.run import run
    from fedtier.runtime import logs
    from fedtier.runtime.config import load

    cfg = load(RolloutConfig, config_path)
    logs.setup(log_level or cfg.log_level, node=cfg.cloud_id)
    raise SystemExit(run(cfg))


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Experiment config, e.g. experiments/digits_fedavg.toml.")
@click.option("--rounds", type=click.IntRange(1), default=None, help="Override the number of rounds.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write per-round metrics JSON here (default: the config's metrics_file).")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON instead of a table.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="warning", show_default=True)
def simulate(config_path: Path, rounds: int | None, output: Path | None, as_json: bool, log_level: str) -> None:
    """Run a rollout with every device, edge and the cloud in this process (in-memory transport).

    The same roles and node code as a real deployment; one shared ORT session per
    architecture. Writes per-round metrics (accuracy, loss, bytes per tier, epsilon under
    [privacy]) to JSON. On a terminal a live bar follows the rounds; piped, one line per round.

    \b
        fedtier simulate --config experiments/digits_fedavg.toml --rounds 5
    """
    import dataclasses

    from cloud_coordinator.config import RolloutConfig
    from cloud_coordinator.console import RoundProgress, make_console
    from cloud_coordinator.report import epsilon_spent, round_epsilon, round_line, summary
    from cloud_coordinator.simulate import simulate as run_simulation
    from fedtier.runtime import logs
    from fedtier.runtime.config import load

    logs.setup(log_level)
    cfg = load(RolloutConfig, config_path)
    if rounds is not None:
        cfg = dataclasses.replace(cfg, rounds=rounds)
    if output is not None:
        cfg = dataclasses.replace(cfg, metrics_file=output)
    started = time.perf_counter()
    with RoundProgress(make_console(stderr=True), cfg.rounds, enabled=not as_json) as progress:
        def on_round(row: dict) -> None:
            progress.line(round_line(row, cfg.rounds))
            progress.update(row["round"] + 1, accuracy=row.get("accuracy"), epsilon=round_epsilon(row))

        result = run_simulation(cfg, on_round=on_round)
    wall = time.perf_counter() - started
    if as_json:
        json.dump({"rollout": cfg.rollout, "rounds": result.rounds, "wall_s": wall,
                   "metrics_file": str(cfg.metrics_path)}, sys.stdout, indent=1, default=float)
        click.echo()
    else:
        facts = []
        if result.rounds and result.rounds[-1].get("privacy"):
            p = result.rounds[-1]["privacy"]
            spent = epsilon_spent(result.rounds[-1], ".4g").removeprefix("epsilon ")  # "8 of 8"
            facts.append(("epsilon (ledger)", f"{spent} at delta {p['delta']:g} (largest over devices)"))
        facts.append(("metrics", str(cfg.metrics_path)))
        make_console().print(summary(result.rounds, wall, f"simulation of {cfg.rollout} ({config_path})",
                                     facts=facts))

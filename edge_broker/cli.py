"""``fedtier edge``: the gateway's commands. Imports neither torch nor onnxruntime."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def edge() -> None:
    """Edge service: aggregates one cell's devices each round and forwards to the cloud."""


@edge.command("run")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="edge.toml (see docs/configuration.md).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None,
              help="Override the config's log level.")
def run_cmd(config_path: Path, log_level: str | None) -> None:
    """Run the edge of a cell until stopped (SIGINT/SIGTERM).

    Round state is kept in SQLite: a restarted edge resumes the open round of a rollout that
    is still running, with every update it had accepted. When a rollout ends the edge clears
    its cell's copy of the manifest and forgets the rollout.

    Exit codes: 0 stopped by a signal; 2 a bad config; 77 this node's certificate or the
    broker's ACL does not let it work (the log says which, and the fix).

    Example: fedtier edge run --config site/gateways/cell-a/edge.toml
    """
    from edge_broker.config import EdgeConfig
    from edge_broker.run import run
    from fedtier.runtime import logs
    from fedtier.runtime.config import load

    cfg = load(EdgeConfig, config_path)
    logs.setup(log_level or cfg.log_level, node=cfg.cell)
    raise SystemExit(run(cfg))


@edge.command("install-service")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True, path_type=Path), required=True,
              help="The edge config the service runs.")
@click.option("--print", "print_only", is_flag=True, help="Print the unit instead of writing it.")
@click.option("--unit-dir", type=click.Path(file_okay=False, path_type=Path), default="/etc/systemd/system",
              show_default=True, help="Where to write the unit file.")
@click.option("--user", default="fedtier", show_default=True,
              help="Run the service as this user (DynamicUser=yes: systemd allocates it unless a static "
                   "user of that name exists); root runs it as root, still sandboxed.")
def install_service_cmd(config_path: Path, print_only: bool, unit_dir: Path, user: str) -> None:
    """Write a systemd unit that runs this gateway's edge: restarted on failure (not on exit code 77,
    refused credentials), state in /var/lib/fedtier-edge (StateDirectory), SIGTERM to stop.

    Example: fedtier edge install-service --config /etc/fedtier/edge.toml --print
    """
    from fedtier.runtime.service_unit import unit

    service = unit(role="edge", node=config_path.stem, args=["edge", "run", "--config", str(config_path.absolute())],
                   state_dir="fedtier-edge", user=user)
    from fedtier.runtime.service_unit import install, readable_note

    if print_only:
        click.echo(service.text, nl=False)
        return
    path = install(service, unit_dir)
    click.echo(f"wrote {path}; now: systemctl daemon-reload && systemctl enable --now {service.name}")
    note = readable_note(service, [config_path])
    if note:
        click.echo(note)

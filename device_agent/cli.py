"""``fedtier agent``: the device agent's commands. Imports no torch."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def agent() -> None:
    """Device agent: trains locally with onnxruntime-training, talks MQTT to its cell's edge."""


@agent.command("run")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="device.toml (see docs/configuration.md).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None,
              help="Override the config's log level.")
def run_cmd(config_path: Path, log_level: str | None) -> None:
    """Run the agent until stopped (SIGINT/SIGTERM): fetch artifacts, train each round, upload.

    Updates are kept in an on-disk outbox until the broker acknowledges them, so a restart
    loses nothing; the agent reconnects with back-off when the broker is away.
    """
    from device_agent.config import DeviceConfig
    from device_agent.run import run
    from fedtier import logs
    from fedtier.config import load

    cfg = load(DeviceConfig, config_path)
    logs.setup(log_level or cfg.log_level, node=cfg.device_id)
    raise SystemExit(run(cfg))

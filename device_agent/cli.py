"""``fedtier agent``: the device agent's commands. Imports no torch."""

from __future__ import annotations

from pathlib import Path

import click


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``fedtier agent --version``: the version, and the training backend this machine would use."""
    if not value or ctx.resilient_parsing:
        return
    import platform

    from device_agent.trainers import describe_backend
    from fedtier import __version__

    click.echo(f"fedtier {__version__} (agent), Python {platform.python_version()} on "
               f"{platform.system()} {platform.machine()}")
    click.echo(f"trainer: {describe_backend('auto')}")
    ctx.exit()


@click.group()
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and the training backend 'auto' picks on this machine, then exit.")
def agent() -> None:
    """Device agent: trains locally, talks MQTT to its cell's edge.

    The training backend (device.toml `trainer`) is onnxruntime-training where it is
    installed, otherwise stock onnxruntime on the bundle's portable graph; `fedtier agent
    --version` shows which one this machine uses.
    """


@agent.command("run")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="device.toml (see docs/configuration.md).")
@click.option("--bundle", "bundle_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="An enrollment bundle from `fedtier provision device` (runs its device.toml).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None,
              help="Override the config's log level.")
def run_cmd(config_path: Path | None, bundle_dir: Path | None, log_level: str | None) -> None:
    """Run the agent until stopped (SIGINT/SIGTERM): fetch artifacts, train each round, upload.

    Updates are kept in an on-disk outbox until the broker acknowledges them, and the
    installed manifest and artifacts in the state directory, so a restart loses nothing and
    rejoins the rollout; the agent reconnects with back-off when the broker is away.

    Exit codes: 0 stopped by a signal; 2 a bad config; 77 this node's certificate or the
    broker's ACL does not let it work (the log says which, and the fix).

    Example: fedtier agent run --bundle site/devices/dev-0
    """
    from device_agent.config import DeviceConfig
    from device_agent.run import run
    from fedtier.runtime import logs
    from fedtier.runtime.config import load

    if (config_path is None) == (bundle_dir is None):
        raise click.UsageError("give either --config or --bundle")
    path = config_path if config_path is not None else Path(str(bundle_dir)) / "device.toml"
    cfg = load(DeviceConfig, path)
    logs.setup(log_level or cfg.log_level, node=cfg.device_id)
    raise SystemExit(run(cfg))


@agent.command("enroll")
@click.option("--name", required=True, help="This device's id (the certificate's CN; its MQTT client id).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for the new private key (mode 0600) and the certificate request.")
def enroll_cmd(name: str, out_dir: Path) -> None:
    """Create this device's private key and a certificate signing request (CSR).

    The key never leaves the device: send only the CSR to the operator, who returns a bundle
    (`fedtier provision sign`) to unpack into the same directory; then
    `fedtier agent run --bundle DIR`.
    """
    from device_agent.enroll import enroll

    csr = enroll(name, out_dir)
    click.echo(f"key: {out_dir / 'key.pem'} (keep it here)\nCSR: {csr} (send this to the operator)")


@agent.command("install-service")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="The device config the service runs (or --bundle).")
@click.option("--bundle", "bundle_dir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="The enrollment bundle the service runs (or --config).")
@click.option("--print", "print_only", is_flag=True, help="Print the unit instead of writing it.")
@click.option("--unit-dir", type=click.Path(file_okay=False, path_type=Path), default="/etc/systemd/system",
              show_default=True, help="Where to write the unit file.")
@click.option("--user", default="fedtier", show_default=True,
              help="Run the service as this user (DynamicUser=yes: systemd allocates it unless a static "
                   "user of that name exists); root runs it as root, still sandboxed.")
def install_service_cmd(config_path: Path | None, bundle_dir: Path | None, print_only: bool, unit_dir: Path,
                        user: str) -> None:
    """Write a systemd unit that runs this agent: restarted on failure (not on exit code 77,
    refused credentials), state in /var/lib/fedtier-agent (StateDirectory), SIGTERM to stop.

    \b
        fedtier agent install-service --bundle /etc/fedtier/dev-00 --print
        fedtier agent install-service --config /etc/fedtier/device.toml --user fedtier
    """
    from fedtier.runtime.service_unit import unit

    if (config_path is None) == (bundle_dir is None):
        raise click.UsageError("give exactly one of --config and --bundle")
    chosen = config_path if config_path is not None else bundle_dir
    assert chosen is not None
    source = ["--config" if config_path is not None else "--bundle", str(chosen.absolute())]
    node = chosen.stem
    service = unit(role="agent", node=node, args=["agent", "run", *source], state_dir="fedtier-agent", user=user)
    from fedtier.runtime.service_unit import install, readable_note

    if print_only:
        click.echo(service.text, nl=False)
        return
    path = install(service, unit_dir)
    click.echo(f"wrote {path}; now: systemctl daemon-reload && systemctl enable --now {service.name}")
    note = readable_note(service, [chosen])
    if note:
        click.echo(note)

"""``fedtier broker``: the embedded pure-Python MQTT broker (for machines without Mosquitto)."""

from __future__ import annotations

import click

from fedtier.embedded_broker.limits import DEFAULT_LIMITS


@click.group()
def broker() -> None:
    """Embedded MQTT broker (MQTT 3.1.1 and 5, QoS 0/1/2, retained, wills, sessions in memory).

    For demos and tests on machines without Mosquitto. Use Mosquitto (or another production
    broker) on real gateways: this one has no TLS and keeps nothing on disk (docs/broker.md).
    Without --password-file it lets every client in that can reach its port.
    """


@broker.command("run")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=1883, show_default=True,
              help="TCP port (0 = any free port).")
@click.option("--max-packet-size", type=click.IntRange(0), default=DEFAULT_LIMITS.max_packet_size,
              show_default=True, help="Largest packet accepted, bytes (0 = no limit).")
@click.option("--max-connections-per-address", type=click.IntRange(1),
              default=DEFAULT_LIMITS.max_connections_per_address, show_default=True,
              help="Open sockets per client address.")
@click.option("--acl-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Mosquitto-format ACL file (user/topic/pattern lines).")
@click.option("--password-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Mosquitto-format password file (mosquitto_passwd or 'fedtier broker passwd'): "
                   "only its users, with their passwords, may connect.")
@click.option("--max-keepalive", type=click.IntRange(1, 65535), default=DEFAULT_LIMITS.max_keepalive,
              show_default=True, help="Keep-alive (s) imposed on clients that ask for none.")
def run_cmd(host: str, port: int, max_packet_size: int, max_connections_per_address: int,
            acl_file: str | None, password_file: str | None, max_keepalive: int) -> None:
    """Serve until SIGINT/SIGTERM. The other limits keep their safe defaults; every limit is
    an option of "python -m fedtier.embedded_broker" (see its --help and docs/broker.md).

    Example: fedtier broker run --port 1883 --max-packet-size 262144
    """
    from fedtier.embedded_broker import main

    args = ["--host", host, "--port", str(port), "--max-packet-size", str(max_packet_size),
            "--max-connections-per-address", str(max_connections_per_address)]
    if max_connections_per_address > DEFAULT_LIMITS.max_connections:
        args += ["--max-connections", str(max_connections_per_address)]
    if acl_file:
        args += ["--acl-file", acl_file]
    if password_file:
        args += ["--password-file", password_file]
    if max_keepalive != DEFAULT_LIMITS.max_keepalive:
        args += ["--max-keepalive", str(max_keepalive)]
    raise SystemExit(main(args))


@broker.command("passwd")
@click.argument("password_file", type=click.Path(dir_okay=False))
@click.argument("username")
@click.option("--password", default=None,
              help="The password (default: asked for, twice, without echo).")
def passwd_cmd(password_file: str, username: str, password: str | None) -> None:
    """Add USERNAME to PASSWORD_FILE (created 0600 if missing) or change its password.

    Writes the $7$ (PBKDF2-SHA512) lines of Mosquitto 2.0's mosquitto_passwd, so the file also
    serves Mosquitto's password_file. Example: fedtier broker passwd broker.passwd edge-1
    """
    from fedtier.embedded_broker.passwords import set_password
    from fedtier.errors import ConfigError

    if password is None:
        password = click.prompt("Password", hide_input=True, confirmation_prompt=True)
    try:
        set_password(password_file, username, password)
    except (ConfigError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{username}: password set in {password_file}")



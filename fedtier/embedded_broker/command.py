"""``fedtier broker``: the embedded pure-Python MQTT broker (for machines without Mosquitto)."""

from __future__ import annotations

import click


@click.group()
def broker() -> None:
    """Embedded MQTT broker (MQTT 3.1.1 and 5, QoS 0/1, retained, wills, sessions in memory).

    For demos and tests on machines without Mosquitto. Use Mosquitto (or another production
    broker) on real gateways: this one keeps nothing on disk.
    """


@broker.command("run")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=1883, show_default=True,
              help="TCP port (0 = any free port).")
@click.option("--max-packet-size", type=click.IntRange(0), default=0, show_default=True,
              help="Largest packet accepted, bytes (0 = no limit).")
def run_cmd(host: str, port: int, max_packet_size: int) -> None:
    """Serve until SIGINT/SIGTERM."""
    from fedtier.embedded_broker import main

    args = ["--host", host, "--port", str(port)]
    if max_packet_size:
        args += ["--max-packet-size", str(max_packet_size)]
    raise SystemExit(main(args))

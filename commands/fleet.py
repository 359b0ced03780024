"""``fedtier fleet emulate``: many real device agents in one process against a real Mosquitto."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from types import FrameType

import click

from fedtier.runtime import logs


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@click.group()
def fleet() -> None:
    """A large fleet on this machine, to measure what one edge, one broker and one coordinator take."""


@fleet.command()
@click.option("--devices", type=click.IntRange(1), default=100, show_default=True,
              help="Device agents, each with its own MQTT client, identity and outbox, in worker processes.")
@click.option("--cells", type=click.IntRange(1), default=1, show_default=True, help="Cells (one edge each).")
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True)
@click.option("--broker", default=None, metavar="HOST:PORT",
              help="A running broker; default: start a Mosquitto for the run (its file limit raised).")
@click.option("--stagger-s", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Spread the devices' start over this many seconds.")
@click.option("--compute-delay-ms", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Simulated on-device compute time added to every local run.")
@click.option("--local-steps", type=click.IntRange(1), default=5, show_default=True)
@click.option("--algorithm", type=click.Choice(["fedavg", "fedbuff"]), default="fedavg", show_default=True,
              help="fedavg: synchronous rounds; fedbuff: asynchronous, each edge sends a cell update every half "
                   "cell of deltas and the cloud makes a model version of every cells' worth of them, every device "
                   "training once per version (a \"round\" is a version).")
@click.option("--loop", type=click.Choice(["mux", "threads"]), default="mux", show_default=True,
              help="How a worker process drives its devices: mux = all on one thread, sockets multiplexed (one "
                   "worker per core); threads = a node thread and a network thread per device.")
@click.option("--keepalive-s", type=click.IntRange(5, 3600), default=30, show_default=True,
              help="MQTT keep-alive of the emulated nodes (the default holds at 10,000 devices on 2 cores); raise "
                   "it if the broker drops them for silence (its log: \"Keep alive timeout\").")
@click.option("--stall-s", type=click.FloatRange(0), default=900.0, show_default=True,
              help="Stop when no update reaches an edge and no round closes for this long, and say where every "
                   "cell's edge and devices stand (0: wait for ever).")
@click.option("--device-state", type=click.Choice(["ram", "disk"]), default="ram", show_default=True,
              help="Where the emulated devices keep their outboxes and models: ram = a RAM disk (/dev/shm, each "
                   "board having its own flash), disk = in the workdir (their commits then queue with the edges').")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep configs, data and node state here (default: a temporary directory, removed).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              show_default=True)
def emulate(devices: int, cells: int, rounds: int, broker: str | None, stagger_s: float, compute_delay_ms: float,
            local_steps: int, algorithm: str, loop: str, keepalive_s: int, stall_s: float, device_state: str,
            workdir: Path | None, as_json: bool, log_level: str) -> None:
    """Run a rollout of DEVICES real device agents through a real Mosquitto, and time its rounds.

    The devices, edges and coordinator are the nodes `fedtier agent run`, `edge run` and
    `coordinator run` build: the devices in worker processes (by default each drives its
    devices on one thread, their sockets multiplexed; --loop threads gives each its own), the
    edges and the coordinator on threads of this process; the devices of a worker share one ORT
    session per model (docs/benchmarks.md, "Fleet emulator"). Prints each round's time, its
    slowest device's local run and the overhead beyond it, and where the round went: the edges'
    decoding and all their work, the coordinator's work, and the rest (the broker's deliveries, the
    devices' own decoding, encoding and outbox writes, waiting).

    \b
        fedtier fleet emulate --devices 100
        fedtier fleet emulate --devices 300 --cells 1 --rounds 3 --compute-delay-ms 50
        fedtier fleet emulate --devices 500 --cells 5 --broker 127.0.0.1:1883 --json
        fedtier fleet emulate --devices 10000 --cells 10
        fedtier fleet emulate --devices 1000 --cells 4 --algorithm fedbuff
    """
    from commands.console import make_console
    from local_fleet.emulator import EmulatorOptions, FleetEmulator

    logs.setup(log_level)
    console = make_console(stderr=True)
    # SIGTERM (a supervisor, `kill`) stops the emulation as Ctrl-C does: the emulator's clean-up stops its
    # worker processes and its Mosquitto (its workers also stop on their own if this process is killed)
    signal.signal(signal.SIGTERM, _interrupt)
    opts = EmulatorOptions(devices=devices, cells=cells, rounds=rounds, broker=broker, stagger_s=stagger_s,
                           compute_delay_ms=compute_delay_ms, local_steps=local_steps, algorithm=algorithm,
                           workdir=workdir,
                           loop=loop, keepalive_s=keepalive_s, stall_s=stall_s,
                           device_state=device_state)
    try:
        result = FleetEmulator(opts, progress=None if as_json else console.print).run()
    except RuntimeError as exc:  # a crash, a stall or an interruption: the message says where the cells stood
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    from rich.table import Table

    table = Table(title=f"{result.devices} devices in {result.cells} cell(s) through {result.broker}")
    for column in ("round", "devices", "round s", "all training s", "slowest device s", "median training s",
                   "overhead s", "edge decode s", "edge work s", "coordinator s", "rest s", "accuracy"):
        table.add_column(column, justify="right")
    for r in result.rounds:
        table.add_row(str(r.round), str(r.devices_reported), f"{r.round_s:.2f}", f"{r.training_s:.2f}",
                      f"{r.slowest_device_s:.2f}",
                      f"{r.median_device_s:.3f}", f"{r.overhead_s:.2f}", f"{r.edge_decode_s:.2f}",
                      f"{r.edge_work_s:.2f}", f"{r.coordinator_s:.2f}", f"{r.rest_s:.2f}",
                      "-" if r.accuracy is None else f"{r.accuracy:.4f}")
    make_console().print(table)
    click.echo(f"start-up {result.start_s:.1f} s, wall {result.wall_s:.1f} s, peak RSS {result.peak_rss_mb:.0f} MB, "
               f"{result.threads} threads at the end")
    for note in result.notes:
        click.echo(f"note: {note}")
    logging.getLogger("fedtier.fleet").debug("done")

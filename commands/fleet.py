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
@click.option("--deadline-s", type=click.FloatRange(0, min_open=True), default=120.0, show_default=True,
              help="fedavg: seconds before a round may close with --quorum of its devices.")
@click.option("--quorum", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
              help="fedavg: the share of a cell's devices (and of the cells) enough after the deadline; below 1 "
                   "under --availability, or each round waits for its last device's window.")
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
@click.option("--availability", type=click.Choice(["always", "diurnal", "file"]), default=None,
              help="Play the fleet's availability and speed traces in real time ([fleet], as `fedtier simulate` "
                   "does on a virtual clock): a device is connected only in its online windows and each local "
                   "training takes its trace's time. always = online all day; diurnal = one window a day per "
                   "device, --share-online of the day long; file = windows from --trace-file. Default: none (every "
                   "device online, no added time).")
@click.option("--share-online", type=float, default=None,
              help="diurnal: the share of the day each device is online, so the share of the fleet online at any "
                   "time, in (0, 1] (default 1).")
@click.option("--compute-s", type=float, default=None,
              help="The median device's local training, in seconds of the emulated day (default 60; scaled like the "
                   "day: with --day-s 120 one minute of the day is 83 ms).")
@click.option("--speed-sigma", type=float, default=None,
              help="Heavy-tailed speeds: a device trains compute_s * exp(sigma g), g ~ N(0, 1) per device "
                   "(default 1; 0: all equally fast).")
@click.option("--trace-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="file: JSON {\"period_s\": optional, \"devices\": {id: {\"windows\": [[start, end], ...], "
                   "\"speed\": optional}}}, seconds of the emulated day.")
@click.option("--day-s", type=float, default=120.0, show_default=True,
              help="Real seconds one emulated day (86,400 s of the traces) lasts.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep configs, data and node state here (default: a temporary directory, removed).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              show_default=True)
def emulate(devices: int, cells: int, rounds: int, broker: str | None, stagger_s: float, compute_delay_ms: float,
            local_steps: int, algorithm: str, deadline_s: float, quorum: float, loop: str, keepalive_s: int,
            stall_s: float, device_state: str,
            availability: str | None, share_online: float | None, compute_s: float | None,
            speed_sigma: float | None, trace_file: Path | None, day_s: float,
            workdir: Path | None, as_json: bool, log_level: str) -> None:
    """Run a rollout of DEVICES real device agents through a real Mosquitto, and time its rounds.

    The devices, edges and coordinator are the nodes `fedtier agent run`, `edge run` and
    `coordinator run` build: the devices in worker processes (by default each drives its
    devices on one thread, their sockets multiplexed; --loop threads gives each its own), the
    edges and the coordinator on threads of this process; the devices of a worker share one ORT
    session per model (docs/benchmarks.md, "Fleet emulator"). Prints each round's time, its
    slowest device's local run and the overhead beyond it, and where the round went: the edges'
    decoding and all their work, the coordinator's work, and the rest (the broker's deliveries, the
    devices' own decoding, encoding and outbox writes, waiting). With --availability the devices
    come and go as their traces say, a day lasting --day-s seconds, and the table says how many
    were online as each round closed.

    \b
        fedtier fleet emulate --devices 100
        fedtier fleet emulate --devices 300 --cells 1 --rounds 3 --compute-delay-ms 50
        fedtier fleet emulate --devices 500 --cells 5 --broker 127.0.0.1:1883 --json
        fedtier fleet emulate --devices 10000 --cells 10
        fedtier fleet emulate --devices 1000 --cells 4 --algorithm fedbuff
        fedtier fleet emulate --devices 200 --cells 2 --rounds 20 --availability diurnal --share-online 0.3 \\
            --day-s 120 --quorum 0.2 --deadline-s 5
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
                           deadline_s=deadline_s, quorum=quorum, workdir=workdir,
                           loop=loop, keepalive_s=keepalive_s, stall_s=stall_s,
                           device_state=device_state, availability=availability, share_online=share_online,
                           compute_s=compute_s, speed_sigma=speed_sigma, trace_file=trace_file, day_s=day_s)
    try:
        result = FleetEmulator(opts, progress=None if as_json else console.print).run()
    except RuntimeError as exc:  # a crash, a stall or an interruption: the message says where the cells stood
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    from rich.table import Table

    table = Table(title=f"{result.devices} devices in {result.cells} cell(s) through {result.broker}")
    traced = any(r.online is not None for r in result.rounds)
    for column in ("round", "devices", *(("online",) if traced else ()), "round s", "all training s",
                   "slowest device s", "median training s",
                   "overhead s", "edge decode s", "edge work s", "coordinator s", "rest s", "accuracy"):
        table.add_column(column, justify="right")
    for r in result.rounds:
        table.add_row(str(r.round), str(r.devices_reported), *((str(r.online),) if traced else ()),
                      f"{r.round_s:.2f}", f"{r.training_s:.2f}",
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

"""``fedtier demo``: the command a newcomer runs first."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command()
@click.option("--devices", type=click.IntRange(1, 500), default=12, show_default=True,
              help="Device agents to start (one OS process each).")
@click.option("--cells", type=click.IntRange(1, 26), default=2, show_default=True,
              help="Edge cells; devices are spread evenly over them (one edge process each).")
@click.option("--rounds", type=click.IntRange(1), default=30, show_default=True, help="Global rounds.")
@click.option("--broker", type=click.Choice(["auto", "mosquitto", "embedded"]), default="auto", show_default=True,
              help="auto = Mosquitto when it is on PATH, otherwise the embedded pure-Python broker.")
@click.option("--algorithm", type=click.Choice(["fedavg", "hier_qsgd", "qhetfed", "hist"]), default="fedavg",
              show_default=True,
              help="fedavg: hierarchical FedAvg; hier_qsgd: Hier-Local-QSGD (quantized, 2 edge rounds per round); "
                   "qhetfed: QHetFed (4 quantized gradient aggregations in each cell, then local steps); "
                   "hist: HIST (each cell trains its own slice of the hidden neurons, 2 edge rounds per round).")
@click.option("--local-steps", type=click.IntRange(1), default=None,
              help="Local SGD steps (QHetFed: gamma) [default: 20 fedavg, 10 hier_qsgd and qhetfed].")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Learning rate [default: 0.1; 0.2 for qhetfed].")
@click.option("--bits-device", type=click.IntRange(2, 8), default=4, show_default=True,
              help="QSGD bits of device uploads (hier_qsgd, qhetfed; hist sends float32 like the paper).")
@click.option("--bits-edge", type=click.IntRange(2, 8), default=8, show_default=True,
              help="QSGD bits of edge uploads to the cloud (hier_qsgd, qhetfed).")
@click.option("--alpha", type=click.FloatRange(min=0, min_open=True), default=0.5, show_default=True,
              help="Dirichlet concentration of the non-iid split (smaller = more skewed devices).")
@click.option("--max-packet-size", type=click.IntRange(0), default=0, show_default=True,
              help="Broker packet limit in bytes (0 = none); larger messages travel chunked.")
@click.option("--secure", is_flag=True,
              help="Provision a throwaway fleet first (CA, per-node certificates, signed manifests) and run "
                   "over Mosquitto with mutual TLS and per-role ACLs, as a production fleet would.")
@click.option("--trainer", type=click.Choice(["auto", "ort", "portable", "torch"]), default="auto", show_default=True,
              help="The agents' training backend: auto = onnxruntime-training where installed, else stock "
                   "onnxruntime on the bundle's portable graph; portable forces the latter (as on an aarch64 "
                   "board or Python 3.13).")
@click.option("--agent-python", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="Run the agents with this Python instead of this one, e.g. .venv-portable/bin/python "
                   "(stock onnxruntime, no torch; made by install.sh).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of data split, init and minibatches.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep configs, data, state and logs here (default: a temporary directory, "
                   "deleted after a successful run).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Give up after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (for machines).")
def demo(devices: int, cells: int, rounds: int, broker: str, algorithm: str, local_steps: int | None,
         lr: float | None, bits_device: int, bits_edge: int, alpha: float, max_packet_size: int, secure: bool,
         trainer: str, agent_python: Path | None, seed: int, workdir: Path | None, timeout_s: float,
         as_json: bool) -> None:
    """Train a model across a simulated fleet on this machine, over a real MQTT broker.

    Starts a broker on a free port, one coordinator, one edge per cell and one agent per
    device as separate processes (the real `fedtier ... run` commands), trains an MLP on
    scikit-learn's digits split non-iid across the devices with onnxruntime-training, shows
    each round's accuracy, and ends with a summary: accuracy per round, bytes per tier,
    wall time. Ctrl-C stops every process it started.
    """
    from cloud_coordinator.demo import Demo, DemoError, DemoOptions
    from cloud_coordinator.report import summary_table, totals

    tty = sys.stderr.isatty() and not as_json

    def say(line: str) -> None:
        if as_json:
            return
        click.echo(("\r\033[K" if tty else "") + line, err=True)

    def progress(line: str) -> None:
        if tty:
            click.echo("\r\033[K" + line, nl=False, err=True)

    opts = DemoOptions(devices=devices, cells=cells, rounds=rounds, broker=broker, algorithm=algorithm,
                       local_steps=local_steps, lr=lr, bits_device=bits_device, bits_edge=bits_edge, alpha=alpha,
                       max_packet_size=max_packet_size, seed=seed, workdir=workdir, timeout_s=timeout_s,
                       secure=secure, trainer=trainer, agent_python=agent_python)
    runner = Demo(opts, say, progress)
    try:
        result = runner.run()
    except KeyboardInterrupt:
        say(f"interrupted: stopped {len(runner.procs)} processes")
        raise SystemExit(130) from None
    except DemoError as exc:
        say("")
        raise click.ClickException(str(exc)) from None
    if tty:
        click.echo("\r\033[K", nl=False, err=True)
    if as_json:
        json.dump({"algorithm": algorithm, "rounds": result.rounds, "bytes": totals(result.rounds),
                   "wall_s": result.wall_s,
                   "broker": result.broker, "processes": result.processes, "secure": secure, "trainer": trainer,
                   "final_accuracy": result.rounds[-1]["accuracy"] if result.rounds else None},
                  sys.stdout, indent=1, default=float)
        click.echo()
        return
    click.echo(summary_table(result.rounds, result.wall_s,
                             f"fedtier demo: {algorithm}, {devices} devices, {cells} cells, {result.broker} broker"))

"""``fedtier demo``: the command a newcomer runs first."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import click

from commands.strategy_options import overrides, pop_values, strategy_options


@click.command()
@click.option("--devices", type=click.IntRange(1, 2000), default=None,
              help="Device agents to start [default: 12, one OS process each; 400 with --privacy, on threads of a "
                   "few worker processes (an emulated fleet); at most 500 processes].")
@click.option("--cells", type=click.IntRange(1, 26), default=2, show_default=True,
              help="Edge cells; devices are spread evenly over them (one edge process each).")
@click.option("--rounds", type=click.IntRange(1), default=30, show_default=True, help="Global rounds.")
@click.option("--broker", type=click.Choice(["auto", "mosquitto", "embedded"]), default="auto", show_default=True,
              help="auto = Mosquitto when it is on PATH, otherwise the embedded pure-Python broker.")
@click.option("--algorithm", type=click.Choice(["fedavg", "hier_qsgd", "qhetfed", "hist", "fedxl", "hsgd", "fedbuff"]),
              default="fedavg",
              show_default=True,
              help="fedavg: hierarchical FedAvg; hier_qsgd: Hier-Local-QSGD (quantized, 2 edge rounds per round); "
                   "qhetfed: QHetFed (4 quantized gradient aggregations in each cell, then local steps); "
                   "hist: HIST (each cell trains its own slice of the hidden neurons, 2 edge rounds per round); "
                   "fedxl: FeDXL (partial AUROC with pairs across devices, on a rare-event task where every device "
                   "holds one class; reports AUROC and pAUC per round); "
                   "hsgd: HSGD (a host holding one block of features per cell, one-sample devices holding the "
                   "other, embeddings exchanged through the edge; breast_cancer, AUC per round); "
                   "fedbuff: hierarchical FedBuff (asynchronous: every edge sends a cell update each 3 deltas, the "
                   "cloud makes a model version of every 2; --rounds counts versions).")
@click.option("--local-steps", type=click.IntRange(1), default=None,
              help="Local SGD steps (QHetFed: gamma) [default: 20 fedavg, 10 hier_qsgd and qhetfed, 16 fedxl].")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Learning rate [default: 0.1; 0.2 for qhetfed and hist; 0.5 for fedxl].")
@click.option("--bits-device", type=click.IntRange(2, 8), default=4, show_default=True,
              help="QSGD bits of device uploads (hier_qsgd, qhetfed; hist sends float32 like the paper).")
@click.option("--bits-edge", type=click.IntRange(2, 8), default=8, show_default=True,
              help="QSGD bits of edge uploads to the cloud (hier_qsgd, qhetfed).")
@click.option("--alpha", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Dirichlet concentration of the digits split (smaller = more skewed devices) [default: 0.5]; "
                   "with --algorithm hsgd the share of a cell's devices selected each interval, in (0, 1] "
                   "[default: 0.2].")
@click.option("--max-packet-size", type=click.IntRange(0), default=0, show_default=True,
              help="Broker packet limit in bytes (0 = fedtier's default, 1 MiB); larger messages "
                   "travel chunked.")
@click.option("--secure", is_flag=True,
              help="Provision a throwaway fleet first (CA, per-node certificates, signed manifests) and run "
                   "over Mosquitto with mutual TLS and per-role ACLs, as a production fleet would.")
@click.option("--secure-aggregation", "secure_aggregation", is_flag=True,
              help="fedavg with SecAgg+ in every cell: each edge learns only its cell's sum, never a device's "
                   "update (docs/secure_aggregation.md). With --privacy: distributed DP, the devices share the "
                   "noise a trusted edge would add (docs/privacy.md).")
@click.option("--privacy", is_flag=True,
              help="Differential privacy with trust labels (fedavg, hier_qsgd, hist): devices under untrusted "
                   "cells add Gaussian noise to every update, trusted cells add it towards the cloud; shows the "
                   "noise plan, the epsilon spent after every round and the ledger's final epsilon. A trusted "
                   "cell implies --secure when Mosquitto is installed (clear updates travel only over TLS).")
@click.option("--epsilon", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With --privacy: epsilon per device over the whole rollout, and the budget the rollout stops "
                   "at [default: 8].")
@click.option("--delta", type=click.FloatRange(min=0, max=1, min_open=True, max_open=True), default=None,
              help="With --privacy: delta of the (epsilon, delta) guarantee [default: 1e-5, far below 1/N for "
                   "digits' ~1,400 training records, and [privacy]'s default].")
@click.option("--clip", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With --privacy: C, the L2 bound of every released model delta [default: 1].")
@click.option("--trusted", "trusted", default=None, metavar="CELLS",
              help="With --privacy: comma-separated trusted cells, or 'none' [default: the first half of the "
                   "cells: cell-a of the default two].")
@click.option("--sample-rate", "sample_rate", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
              help="With --privacy: q, the share of its devices a trusted edge samples in secret each round "
                   "[default: the rate whose plan has the best signal-to-noise at --epsilon].")
@click.option("--processes", is_flag=True,
              help="With --privacy: the small fleet of one OS process per node (12 devices, half the cells "
                   "trusted, no sampling) instead of the private fleet of 400; its plan warns that it cannot learn "
                   "at that size. Implied by options only that fleet has (--secure, --secure-aggregation, "
                   "--keep-running, --dashboard, another --algorithm, ...).")
@click.option("--compare", is_flag=True,
              help="With --privacy: run the demo a second time without privacy (same seeds) and show both "
                   "accuracies.")
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
@click.option("--dashboard", is_flag=True,
              help="The coordinator also serves its read-only web dashboard on a free 127.0.0.1 port; the demo "
                   "prints the URL once it listens (open it while the rounds run; with --keep-running it stays up "
                   "with the fleet).")
@click.option("--keep-running", is_flag=True,
              help="Run the coordinator as `coordinator serve` and leave the whole fleet up after the last round "
                   "(restarting nodes or the broker when they die) for `fedtier rollout ...` / `fedtier devices "
                   "list`; Ctrl-C stops it.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (for machines).")
@strategy_options
def demo(devices: int | None, cells: int, rounds: int, broker: str, algorithm: str, local_steps: int | None,
         lr: float | None, bits_device: int, bits_edge: int, alpha: float | None, max_packet_size: int, secure: bool,
         secure_aggregation: bool, privacy: bool, epsilon: float | None, delta: float | None, clip: float | None,
         trusted: str | None, sample_rate: float | None, processes: bool, compare: bool, trainer: str,
         agent_python: Path | None, seed: int, workdir: Path | None,
         timeout_s: float, dashboard: bool, keep_running: bool, as_json: bool, **strategy: Any) -> None:
    """Train a model across a simulated fleet on this machine, over a real MQTT broker.

    Starts a broker on a free port, one coordinator, one edge per cell and one agent per
    device as separate processes (the real `fedtier ... run` commands), trains an MLP on
    scikit-learn's digits split non-iid across the devices with onnxruntime-training, shows
    each round's accuracy (a live bar on a terminal), and ends with a summary: accuracy per
    round, bytes per tier, wall time. Ctrl-C or SIGTERM stops every process it started. A node
    or the broker that dies is restarted (as a service manager would), and the demo says so.

    With --keep-running the fleet stays up after the last round: operate it with `fedtier
    rollout ...` and `fedtier devices list` (FEDTIER_STATE_DIR=<workdir>/coordinator).

    With --algorithm fedxl the task is binary with rare positives, every device holding one
    class, and each round also shows AUROC and partial AUROC (FPR <= 0.3, 0.5).

    With --privacy the demo runs a fleet where private learning works: 400 device agents (threads
    of a few worker processes, each its own MQTT client, over Mosquitto), every cell trusted, each
    trusted edge sampling its devices in secret at the rate the plan says is best, noise calibrated
    to --epsilon (default 8) by the accountant. It prints who adds noise where, the epsilon spent
    after each round, and the final epsilon and delta from the ledger; --compare runs the same fleet
    without privacy. --processes runs the small 12-process private demo instead (cell-a trusted,
    cell-b untrusted), whose plan warns that it will not learn at that size.

    With --algorithm hsgd every cell has a host (a feature party holding features 0-19 of
    breast_cancer for all its samples) and one-sample devices (features 20-29); the coordinator,
    edges, hosts and devices are the nodes `fedtier coordinator|edge|agent run` build, run as
    threads of this process, each with its own connection to the broker; --devices defaults to 100,
    --alpha is the share of devices selected per interval (default 0.2), --local-steps is
    P = Q (default 2), --lr defaults to 0.05.

    \b
        fedtier demo
        fedtier demo --algorithm fedxl
        fedtier demo --algorithm hsgd
        fedtier demo --algorithm fedbuff
        fedtier demo --privacy --compare
        fedtier demo --privacy --processes --compare
        fedtier demo --secure-aggregation
        fedtier demo --secure-aggregation --privacy --epsilon 8
        fedtier demo --keep-running --workdir /tmp/fleet
        fedtier demo --privacy --epsilon 4 --trusted cell-a,cell-b --workdir /tmp/dp-demo
        fedtier demo --dashboard --rounds 100
        fedtier demo --edge-aggregator median --attack sign_flip --attack-fraction 0.2
        fedtier demo --server-optimizer adam --server-lr 0.03 --proximal-mu 0.01 --partial-work
    """
    from fedtier import algorithms
    from local_fleet.demo import Demo, DemoError, DemoOptions, PrivacyDemo, Terminated, raise_on_termination

    if algorithms.describe(algorithm).split_model:  # hosts beside the devices: its own fleet of threads
        _hsgd_demo(devices=100 if devices is None else devices, cells=cells, rounds=rounds, broker=broker,
                   local_steps=local_steps, lr=lr,
                   alpha=alpha, privacy=privacy, seed=seed, timeout_s=timeout_s, as_json=as_json)
        return

    _check_privacy_options(privacy=privacy, epsilon=epsilon, delta=delta, clip=clip, trusted=trusted,
                           compare=compare, keep_running=keep_running, processes=processes, sample_rate=sample_rate)
    process_only = _process_only(secure=secure, secure_aggregation=secure_aggregation, keep_running=keep_running,
                                 dashboard=dashboard, agent_python=agent_python, algorithm=algorithm, broker=broker,
                                 trainer=trainer, strategy=overrides(pop_values(dict(strategy)), algorithm),
                                 max_packet_size=max_packet_size)
    if privacy and not processes and not process_only:
        _private_fleet_demo(devices=400 if devices is None else devices, cells=cells, rounds=rounds,
                            epsilon=epsilon, delta=delta, clip=clip, trusted=_cells(trusted), sample_rate=sample_rate,
                            local_steps=local_steps, lr=lr, alpha=alpha, seed=seed, workdir=workdir,
                            timeout_s=timeout_s, compare=compare, as_json=as_json)
        return
    if sample_rate is not None:
        raise click.UsageError("--sample-rate is the private fleet's: it does not go with "
                               f"{', '.join(process_only) or '--processes'}")
    devices = 12 if devices is None else devices
    if devices > 500:
        raise click.UsageError("--devices: at most 500 with one process each (the private fleet takes 2000)")
    dp = None
    if privacy:
        dp = PrivacyDemo(**{k: v for k, v in (("epsilon", epsilon), ("delta", delta), ("clip", clip)) if v is not None},
                         trusted=_cells(trusted))
    extra = overrides(pop_values(strategy), algorithm)
    opts = DemoOptions(devices=devices, cells=cells, rounds=rounds, broker=broker, algorithm=algorithm,
                       local_steps=local_steps, lr=lr, bits_device=bits_device, bits_edge=bits_edge,
                       alpha=0.5 if alpha is None else alpha,
                       max_packet_size=max_packet_size, seed=seed, workdir=workdir, timeout_s=timeout_s,
                       secure=secure, privacy=dp, trainer=trainer, agent_python=agent_python, dashboard=dashboard,
                       strategy=extra, secure_aggregation=secure_aggregation,
                       keep_running=keep_running)
    view = ConsoleView(enabled=not as_json)
    if privacy and process_only and not processes:
        view.say(f"{', '.join(process_only)}: the private demo runs on the fleet of one process per node "
                 "(as --processes)")
    try:
        runner = Demo(opts, view)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        with raise_on_termination():
            result = runner.run()
            baseline = None
            if compare:
                view.say("--compare: the same demo again without privacy (same seeds, same broker)")
                plain = dataclasses.replace(opts, privacy=None, secure=result.secure,
                                            workdir=workdir / "compare" if workdir is not None else None)
                runner = Demo(plain, view)
                baseline = runner.run()
    except KeyboardInterrupt:
        view.say(f"interrupted: stopped {len(runner.procs)} processes")
        raise SystemExit(130) from None
    except Terminated as exc:
        view.say(f"terminated ({exc}): stopped {len(runner.procs)} processes")
        raise SystemExit(128 + exc.signum) from None
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        json.dump(_document(opts, result, baseline), sys.stdout, indent=1, default=float)
        click.echo()
        return
    _print_summary(opts, result, baseline)


def _check_privacy_options(*, privacy: bool, epsilon: float | None, delta: float | None, clip: float | None,
                           trusted: str | None, compare: bool, keep_running: bool, processes: bool,
                           sample_rate: float | None) -> None:
    """Usage errors: an option of the private demo without --privacy, or two that do not go together."""
    privacy_only = {"--epsilon": epsilon, "--delta": delta, "--clip": clip, "--trusted": trusted,
                    "--compare": compare or None}
    given = [name for name, value in privacy_only.items() if value is not None]
    if keep_running and compare:
        raise click.UsageError("--keep-running leaves one fleet up: it does not go with --compare")
    if given and not privacy:
        raise click.UsageError(f"{', '.join(given)} only make sense with --privacy")
    if (processes or sample_rate is not None) and not privacy:
        raise click.UsageError(f"{'--processes' if processes else '--sample-rate'} only makes sense with --privacy")
    if sample_rate is not None and trusted is not None and not _cells(trusted):
        raise click.UsageError("--sample-rate: trusted edges sample; with --trusted none there is none")


def _process_only(*, secure: bool, secure_aggregation: bool, keep_running: bool, dashboard: bool,
                  agent_python: Path | None, algorithm: str, broker: str, trainer: str, strategy: dict[str, Any],
                  max_packet_size: int) -> list[str]:
    """The options given that only the fleet of one process per node has (the private fleet has none of them)."""
    from local_fleet.demo import mosquitto_path
    from local_fleet.private_demo import ALGORITHM

    given = {"--secure": secure, "--secure-aggregation": secure_aggregation, "--keep-running": keep_running,
             "--dashboard": dashboard, "--agent-python": agent_python is not None,
             f"--algorithm {algorithm}": algorithm != ALGORITHM, f"--broker {broker}": broker == "embedded",
             f"--trainer {trainer}": trainer != "auto", "--max-packet-size": bool(max_packet_size),
             "strategy options": bool(strategy),
             "no Mosquitto installed": mosquitto_path() is None}
    return [name for name, on in given.items() if on]


def _private_fleet_demo(*, devices: int, cells: int, rounds: int, epsilon: float | None, delta: float | None,
                        clip: float | None, trusted: tuple[str, ...] | None, sample_rate: float | None,
                        local_steps: int | None, lr: float | None, alpha: float | None, seed: int,
                        workdir: Path | None, timeout_s: float, compare: bool, as_json: bool) -> None:
    """``--privacy``: the private fleet (``local_fleet.private_demo``), summarised as the process demo is."""
    from local_fleet.demo import DemoOptions, DemoResult
    from local_fleet.private_demo import PrivateFleetOptions, run

    d = PrivateFleetOptions()
    opts = PrivateFleetOptions(devices=devices, cells=cells, rounds=rounds, trusted=trusted, sample_rate=sample_rate,
                               seed=seed, workdir=workdir, timeout_s=timeout_s,
                               epsilon=d.epsilon if epsilon is None else epsilon,
                               delta=d.delta if delta is None else delta, clip=d.clip if clip is None else clip,
                               local_steps=d.local_steps if local_steps is None else local_steps,
                               lr=d.lr if lr is None else lr, alpha=d.alpha if alpha is None else alpha)
    if devices < cells:
        raise click.UsageError(f"need at least one device per cell (devices={devices}, cells={cells})")
    view = ConsoleView(enabled=not as_json)
    try:
        res = run(opts, view, compare=compare)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except KeyboardInterrupt:
        view.say("interrupted: the fleet stopped")
        raise SystemExit(130) from None
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    shown = DemoOptions(devices=devices, cells=cells, rounds=rounds, alpha=opts.alpha, seed=seed)

    def result(fleet: Any, privacy: dict[str, Any] | None) -> DemoResult:
        return DemoResult(rounds=fleet.rounds, wall_s=fleet.wall_s, broker="mosquitto", workdir=fleet.workdir,
                          processes=0, privacy=privacy, stopped=privacy.get("stopped") if privacy else None,
                          extra={"fleet": fleet.notes})

    private = result(res.private, res.privacy)
    baseline = result(res.baseline, None) if res.baseline is not None else None
    if as_json:
        doc = _document(shown, private, baseline)
        doc["fleet"] = {"emulated": True, "notes": res.private.notes, "sample_rate": res.sample_rate}
        json.dump(doc, sys.stdout, indent=1, default=float)
        click.echo()
        return
    _print_summary(shown, private, baseline)


def _cells(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    return tuple(c.strip() for c in text.split(",") if c.strip())


class ConsoleView:
    """The demo's narration, round lines and (on a terminal) live bar, on stderr."""

    def __init__(self, *, enabled: bool) -> None:
        from commands.console import make_console

        self.enabled = enabled
        self.console = make_console(stderr=True)
        self.bar: Any = None

    def say(self, line: str) -> None:
        if self.enabled:
            self.console.print(line, soft_wrap=True)

    def rounds_started(self, total: int) -> None:
        from commands.console import RoundProgress

        self.bar = RoundProgress(self.console, total, enabled=self.enabled).__enter__()

    def round_closed(self, row: dict[str, Any], total: int) -> None:
        from cloud_coordinator.report import round_epsilon, round_line

        if self.bar is not None:
            self.bar.line(round_line(row, total))
            self.bar.update(row["round"] + 1, accuracy=row.get("accuracy"), epsilon=round_epsilon(row))

    def rounds_ended(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _document(opts: Any, result: Any, baseline: Any) -> dict[str, Any]:
    """What --json prints: the run, its privacy numbers (null without --privacy), the comparison."""
    from cloud_coordinator.privacy.report import jsonable
    from cloud_coordinator.report import totals

    doc: dict[str, Any] = {
        "algorithm": opts.algorithm, "rounds": result.rounds, "bytes": totals(result.rounds), "wall_s": result.wall_s,
        "broker": result.broker, "processes": result.processes, "secure": result.secure, "trainer": opts.trainer,
        "secure_aggregation": opts.secure_aggregation,
        "final_accuracy": result.rounds[-1]["accuracy"] if result.rounds else None,
        "final_ranking": ({k: result.rounds[-1].get(k) for k in ("auroc", "pauc_0.3", "pauc_0.5")}
                          if result.rounds and result.rounds[-1].get("auroc") is not None else None),
        "stopped": result.stopped, "privacy": jsonable(result.privacy) if result.privacy is not None else None,
        "dashboard": result.extra.get("dashboard"),
        "strategy": result.extra.get("strategy"), "attack": result.extra.get("attack"),
    }
    if baseline is not None:
        doc["compare"] = {"privacy": None, "wall_s": baseline.wall_s,
                          "final_accuracy": baseline.rounds[-1]["accuracy"] if baseline.rounds else None,
                          "accuracy": [r.get("accuracy") for r in baseline.rounds]}
    return doc


def _print_summary(opts: Any, result: Any, baseline: Any) -> None:
    from commands.console import make_console
    from cloud_coordinator.report import summary

    title = (f"fedtier demo: {opts.algorithm}, {opts.devices} devices, {opts.cells} cells, {result.broker} broker"
             + (", secure aggregation" if opts.secure_aggregation else "")
             + (", differential privacy" if result.privacy is not None else ""))
    facts: list[tuple[str, str]] = []
    attack = result.extra.get("attack")
    if attack is not None:
        title = f"ATTACK RUN: {title}"
        facts.append(("attack", f"{attack['note']}: {', '.join(attack['devices']) or 'none'}"))
    if result.extra.get("strategy"):
        facts.append(("strategy", json.dumps(result.extra["strategy"], sort_keys=True)))
    p = result.privacy
    if p is not None:
        labels = ", ".join(f"{cell} " + ("trusted (its edge adds noise)" if c["trusted"]
                                         else "untrusted (its devices add noise)") for cell, c in p["cells"].items())
        if opts.secure_aggregation:
            labels = ("distributed DP in every cell, whatever its label: its devices add shares of the noise and "
                      "its edge sees only their sum (secure aggregation)")
        multipliers = ", ".join(f"{tier} tier z {z:.3g}" for tier, z in p["noise_multiplier"].items())
        facts += [("epsilon (ledger)", f"{p['epsilon']:.4g} of {p['budget_epsilon']:g} at delta {p['delta']:g} "
                                       "(largest over devices, recomputed from the coordinator's ledger rows)"),
                  ("delta", f"{p['delta']:g}"),
                  ("trust labels", labels),
                  ("noise multiplier", multipliers)]
        if p.get("sample_rate") is not None:
            facts.append(("sampling", f"each trusted edge samples its devices in secret, q = {p['sample_rate']:g} "
                                      "per round (amplification; the rate the plan gives the best signal-to-noise "
                                      "unless --sample-rate)"))
        for note in result.extra.get("fleet", []):
            facts.append(("fleet", f"{opts.devices} device agents, emulated: {note}"))
        if not p["ledger_agrees"]:
            facts.append(("WARNING", f"the live epsilon {p['live_epsilon']} differs from the ledger's "
                                     f"{p['epsilon']:.6g}"))
    if result.stopped:
        facts.append(("stopped early", result.stopped))
    if baseline is not None and baseline.rounds:
        last = baseline.rounds[-1]["accuracy"]
        facts.append(("accuracy without privacy",
                      f"{last:.4f} after {len(baseline.rounds)} rounds (same seeds, {baseline.wall_s:.1f} s)"))
    make_console().print(summary(result.rounds, result.wall_s, title, facts=facts,
                                 compare=baseline.rounds if baseline is not None else None))


def _hsgd_demo(*, devices: int, cells: int, rounds: int, broker: str, local_steps: int | None, lr: float | None,
               alpha: float | None, privacy: bool, seed: int, timeout_s: float, as_json: bool) -> None:
    """``--algorithm hsgd``: the real nodes as threads of this process, over a real broker
    (``local_fleet.hsgd_demo``)."""
    from click.core import ParameterSource

    from local_fleet.hsgd_demo import HsgdDemoOptions, run_demo
    from fedtier.errors import LocalProtocolError

    if privacy:
        raise click.UsageError("hsgd does not run under --privacy: its embeddings (zeta2, Z1) and head theta0 are "
                               "data-dependent releases the noise plan does not cover (docs/hsgd.md)")
    ctx = click.get_current_context()

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) is not ParameterSource.DEFAULT

    opts = HsgdDemoOptions(devices=devices if given("devices") else 100, cells=cells, rounds=rounds,
                           interval=local_steps or 2, alpha=0.2 if alpha is None else alpha, lr=lr or 0.05,
                           broker=broker, seed=seed, timeout_s=timeout_s)
    if not 0 < opts.alpha <= 1:
        raise click.BadParameter("with hsgd, the share of devices selected per interval: in (0, 1]",
                                 param_hint="'--alpha'")
    view = ConsoleView(enabled=not as_json)
    try:
        doc = run_demo(opts, view.say)
    except LocalProtocolError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        json.dump(doc, sys.stdout, indent=1, default=float)
        click.echo()
        return
    from rich.table import Table

    table = Table("tier", "bytes", title=f"fedtier demo: hsgd, {doc['devices']} devices, {doc['cells']} cells, "
                                         f"{doc['broker']} broker, {doc['wall_s']:.1f} s", title_justify="left")
    labels = {"device_up": "devices -> edge (zeta2, theta2)",
              "device_down": "edge -> devices (artifacts once, theta2, Z1 rows, theta0)",
              "host_up": "hosts -> edge (Z1, theta0, update)", "host_down": "edge -> hosts (artifacts once, task, Z2)",
              "edge_up": "edges -> cloud", "edge_down": "cloud -> edges", "vertical": "of which embeddings"}
    for key, label in labels.items():
        table.add_row(label, f"{doc['bytes'].get(key, 0):,}")
    table.add_row("paper meter, eq. (19)", f"{doc['paper_bytes']:,}")
    view.console.print(table)
    view.say(f"final test AUC {doc['rounds'][-1]['auc']:.4f} after {len(doc['rounds'])} rounds")


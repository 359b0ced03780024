"""``fedtier coordinator`` and ``fedtier simulate``: thin commands over library functions."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from commands.strategy_options import overrides, pop_values, strategy_options

if TYPE_CHECKING:
    from fedtier.rollout.config import RolloutConfig

LOG_LEVELS = ["debug", "info", "warning", "error"]


@click.group()
def coordinator() -> None:
    """Cloud coordinator: drives a rollout's rounds, aggregates cells, evaluates, keeps state."""


@coordinator.command("run")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Rollout config (same format as experiments/*.toml; see docs/configuration.md).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default=None, help="Override the config's log level.")
@click.option("--http", "http", metavar="HOST:PORT", default=None,
              help="Also serve the read-only web dashboard and its JSON API (/api/) here, e.g. 127.0.0.1:8080; "
                   "off by default. A host beyond loopback exposes it without a login.")
@click.option("--store", "store_url", metavar="URL", default=None,
              help="Override the config's `store`: sqlite:///PATH or postgresql://USER@HOST:PORT/DB.")
@click.option("--exit-when-done", is_flag=True,
              help="With --http: exit when the rollout ends (default: keep serving the ended rollout's dashboard "
                   "until Ctrl-C).")
def coordinator_run(config_path: Path, log_level: str | None, http: str | None, store_url: str | None,
                    exit_when_done: bool) -> None:
    """Run the rollout over MQTT until its last round closes (or SIGINT/SIGTERM).

    State (rounds, model versions, accepted updates of the open round) is in the config's
    `store` (default <state_dir>/coordinator.db, SQLite; or PostgreSQL): run the same command
    again to resume after a crash. A second coordinator of the same rollout and store is
    refused, with the name of the one that runs it. When
    the rollout ends it prints a summary (accuracy per round, bytes per tier, where the
    metrics are, how to export the model) and clears the rollout's retained messages.

    With --http the dashboard listens from the start and, once the rollout has ended, keeps
    serving it (its final state, summary and plots) until Ctrl-C; --exit-when-done exits at once.

    Exit codes: 0 the rollout ended (or a signal stopped it); 2 a bad config, or a model that
    crashes, fails or gives NaN when trained for a few steps on a trainer the devices use (refused
    before connecting; docs/models.md); 77 this node's certificate or the broker's ACL does not
    let it work (the log says which).

    \b
    Example: fedtier coordinator run --config fleet/coordinator/hand1.toml
             fedtier coordinator run --config fleet/coordinator/hand1.toml --http 127.0.0.1:8080
    """
    from fedtier.rollout.config import RolloutConfig, store_url_check
    from cloud_coordinator.observe.web import parse_bind
    from cloud_coordinator.run import run
    from fedtier.runtime import logs
    from fedtier.runtime.config import load

    try:
        bind = parse_bind(http) if http is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--http") from None
    cfg = load(RolloutConfig, config_path)
    if store_url is not None:
        try:
            store_url_check(store_url)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--store") from None
        cfg = dataclasses.replace(cfg, store=store_url)
    logs.setup(log_level or cfg.log_level, node=cfg.cloud_id)
    started = time.perf_counter()

    def done(code: int) -> None:  # before the dashboard's linger: the summary when the rollout ends
        if code == 0:
            _print_summary(cfg, config_path, time.perf_counter() - started)

    raise SystemExit(run(cfg, http=bind, exit_when_done=exit_when_done, on_done=done))


@coordinator.command("serve")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), envvar="FEDTIER_STATE_DIR",
              default="fedtier-state", show_default=True,
              help="The state directory whose coordinator.db holds the rollouts (also $FEDTIER_STATE_DIR).")
@click.option("--store", "store_url", metavar="URL", envvar="FEDTIER_STORE", default=None,
              help="Serve this store instead of <state-dir>/coordinator.db, e.g. postgresql://fedtier@db:5432/fedtier "
                   "(also $FEDTIER_STORE). Chunks in transit stay in --state-dir.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
@click.option("--http", "http", metavar="HOST:PORT", envvar="FEDTIER_HTTP", default=None,
              help="Also serve the read-only web dashboard and its JSON API (/api/) of every rollout of the store, "
                   "running or ended, e.g. 127.0.0.1:8080 (also $FEDTIER_HTTP); off by default. It has no login: "
                   "beyond loopback, put a reverse proxy with authentication in front.")
def coordinator_serve(state_dir: Path, store_url: str | None, log_level: str, http: str | None) -> None:
    """Serve every rollout of a store, as a long-running service, until SIGINT/SIGTERM.

    Rollouts are created and steered with `fedtier rollout ...`, which writes into the same
    store; this process picks each change up within a second. A restart resumes every rollout
    where the store left it (a paused one stays paused). Exit codes as `coordinator run`.

    Two coordinators may serve one PostgreSQL store: each rollout is driven by one of them (a
    lock in the database); the other takes a rollout over if its coordinator stops.

    \b
    Example: fedtier coordinator serve --state-dir /var/lib/fedtier/coordinator
             fedtier coordinator serve --store postgresql://fedtier@db.internal:5432/fedtier
             fedtier coordinator serve --state-dir /var/lib/fedtier/coordinator --http 127.0.0.1:8080
    """
    from cloud_coordinator.observe.web import parse_bind
    from cloud_coordinator.service import serve
    from fedtier.runtime import logs

    try:
        bind = parse_bind(http) if http is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--http") from None
    logs.setup(log_level, node="cloud")
    raise SystemExit(serve(state_dir, store_url=store_url, http=bind))


@coordinator.command("migrate")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A rollout config whose store (its `store`, else <state_dir>/coordinator.db) to migrate.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), envvar="FEDTIER_STATE_DIR",
              default=None, help="The state directory whose coordinator.db to migrate (also $FEDTIER_STATE_DIR).")
@click.option("--store", "store_url", metavar="URL", envvar="FEDTIER_STORE", default=None,
              help="The store to migrate: sqlite:///PATH or postgresql://USER@HOST:PORT/DB (also $FEDTIER_STORE).")
def coordinator_migrate(config_path: Path | None, state_dir: Path | None, store_url: str | None) -> None:
    """Migrate a coordinator store written by an older fedtier to this version's schema.

    `coordinator run` and `serve` do the same when they open a store; commands that only read
    (`rollout status`, `rollout list`, `rollout models`, `rollout export`, `devices list`, `report`,
    `privacy report`, `coordinator export`) never do, and say when a migration is due. Stop the
    coordinators of the older version that use the store first: they would not understand it after.

    \b
    Example: fedtier coordinator migrate --state-dir fleet/coordinator/state
             fedtier coordinator migrate --config site/coordinator/hand1.toml
    """
    from cloud_coordinator import store_backend as backend
    from cloud_coordinator.status import open_store

    if config_path is not None:
        if state_dir is not None or store_url is not None:
            raise click.UsageError("give --config, or --state-dir / --store, not both")
        from fedtier.rollout.config import RolloutConfig
        from fedtier.runtime.config import load

        cfg = load(RolloutConfig, config_path)
        state_dir, store_url = cfg.state_dir, cfg.store
    reader = open_store(state_dir or Path("fedtier-state"), store_url, read_only=True)
    found, where = reader.schema_found, reader.where
    reader.close()
    if found == backend.SCHEMA_VERSION:
        click.echo(f"store {where} has schema version {found}, this fedtier's: nothing to migrate")
        return
    open_store(state_dir or Path("fedtier-state"), store_url).close()  # opening it to write migrates it
    click.echo(f"store {where}: migrated from schema version {found} to {backend.SCHEMA_VERSION}")


@coordinator.command("install-service")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default="/var/lib/fedtier-coordinator",
              show_default=True, help="The store the service serves (rollout configs' state_dir).")
@click.option("--print", "print_only", is_flag=True, help="Print the unit instead of writing it.")
@click.option("--unit-dir", type=click.Path(file_okay=False, path_type=Path), default="/etc/systemd/system",
              show_default=True, help="Where to write the unit file.")
@click.option("--user", default="fedtier", show_default=True,
              help="Run the service as this user (DynamicUser=yes: systemd allocates it unless a static "
                   "user of that name exists); root runs it as root, still sandboxed.")
@click.option("--http", "http", metavar="HOST:PORT", default=None,
              help="The service also serves its dashboard here (`coordinator serve --http`), e.g. 127.0.0.1:8080.")
def coordinator_install_service(state_dir: Path, print_only: bool, unit_dir: Path, user: str,
                                http: str | None) -> None:
    """Write a systemd unit running `fedtier coordinator serve` for a store: restarted on failure (not
    on exit code 77, refused credentials), StateDirectory=fedtier-coordinator, SIGTERM to stop.

    \b
    Example: fedtier coordinator install-service --print
             fedtier coordinator install-service --http 127.0.0.1:8080
    """
    from cloud_coordinator.observe.web import parse_bind
    from fedtier.runtime.service_unit import install, readable_note, unit

    if http is not None:
        try:
            parse_bind(http)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--http") from None
    state = state_dir.absolute()
    args = ["coordinator", "serve", "--state-dir", str(state), *(["--http", http] if http else [])]
    service = unit(role="coordinator", node="serve", args=args,
                   state_dir="fedtier-coordinator", user=user,
                   writable=[] if state == Path("/var/lib/fedtier-coordinator") else [str(state)])
    if print_only:
        click.echo(service.text, nl=False)
        return
    path = install(service, unit_dir)
    click.echo(f"wrote {path}; now: systemctl daemon-reload && systemctl enable --now {service.name}")
    note = readable_note(service, [])
    if note:
        click.echo(note)


def _print_summary(cfg: RolloutConfig, config_path: Path, wall_s: float) -> None:
    """The demo's summary, for a rollout that ended (nothing if it was interrupted)."""
    from commands.console import make_console
    from cloud_coordinator.report import epsilon_spent, summary

    try:
        doc = json.loads(cfg.metrics_path.read_text())
    except (OSError, ValueError):
        return
    if not doc.get("finished"):
        return
    rows = doc.get("rounds", [])
    facts: list[tuple[str, str]] = []
    if doc.get("stopped"):
        facts.append(("stopped early", str(doc["stopped"])))
    if rows and rows[-1].get("privacy"):
        spent = epsilon_spent(rows[-1], ".4g").removeprefix("epsilon ")
        facts.append(("epsilon (ledger)", f"{spent} at delta {rows[-1]['privacy']['delta']:g} (largest over "
                                          "devices; `fedtier privacy report` audits it)"))
    facts += [("metrics", str(cfg.metrics_path)),
              ("export the model", f"fedtier coordinator export --config {config_path} --out {cfg.rollout}.onnx")]
    make_console().print(summary(rows, wall_s, f"rollout {cfg.rollout}: {cfg.algorithm}, "
                                                f"{len(cfg.topology.layout())} cells", facts=facts))


@coordinator.command("export")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The rollout config the coordinator ran.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The ONNX file to write.")
@click.option("--version", type=click.IntRange(0), default=None,
              help="A model version (round r's model is version r + 1); default the newest.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def coordinator_export(config_path: Path, out: Path, version: int | None, as_json: bool) -> None:
    """Write the rollout's trained model as an inference ONNX file (input "input", float32 rows
    (batch, features) as in the data, also for a model whose example is (channels, length) or an
    image: the file reshapes them itself; output "logits"; HSGD's split model: inputs "x1" and "x2",
    the host's and a device's features). Prints the inputs' and outputs' names, shapes and types,
    and writes them beside the file as OUT.json (e.g. hand1.onnx.json).

    Reads the model version from the coordinator's state (<state_dir>/coordinator.db) and the model's
    graph from its artifacts, never the training data ([data] is not read); works during a rollout too
    (the newest closed round).

    Example: fedtier coordinator export --config fleet/coordinator/hand1.toml --out hand1.onnx
    """
    from cloud_coordinator.export import export_config, export_model
    from fedtier.runtime.config import read_toml

    from cloud_coordinator.status import schema_notice

    cfg = export_config(read_toml(config_path), source=str(config_path), base_dir=config_path.resolve().parent)
    notice = schema_notice(cfg.store_location, f"--config {config_path}")
    if notice:
        click.echo(notice, err=True)
    echo_export(export_model(cfg, out, version=version), as_json)


def echo_export(result: Any, as_json: bool) -> None:
    """What `coordinator export` and `rollout export` print: the file, its model version, its interface."""
    from models.inference import interface_lines

    if as_json:
        click.echo(json.dumps({"path": str(result.path), "rollout": result.rollout, "round": result.round,
                               "version": result.version, "sha256": result.sha256, "interface": result.interface,
                               "description": str(result.description)}))
        return
    click.echo(f"wrote {result.path}: rollout {result.rollout}, model version {result.version} (round {result.round})")
    for line in interface_lines(result.interface):
        click.echo(line)
    click.echo(f"  described in {result.description}")


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Experiment config, e.g. experiments/digits_fedavg.toml.")
@click.option("--rounds", type=click.IntRange(1), default=None, help="Override the number of rounds.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write per-round metrics JSON here (default: the config's metrics_file).")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON instead of a table.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="warning", show_default=True)
@click.option("--trainer", type=click.Choice(["ort", "portable"]), default=None,
              help="The devices' training backend (overrides [simulation] trainer, default ort): portable trains "
                   "from the bundle's standard-ONNX graph, as a board without onnxruntime-training does.")
@click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where the devices run: local (this process) or ray (sharded over Ray actors, the same model; "
                   "needs fedtier[ray]).")
@click.option("--address", default=None, metavar="ADDR",
              help="With --backend ray: an existing Ray cluster (e.g. ray://head:10001 or auto); default: start "
                   "a local Ray for this run.")
@click.option("--shards", type=click.IntRange(1), default=None,
              help="With --backend ray: how many actors share the devices [default: the CPUs Ray has].")
@strategy_options
def simulate(config_path: Path, rounds: int | None, output: Path | None, as_json: bool, log_level: str,
             trainer: str | None, backend: str, address: str | None, shards: int | None, **strategy: Any) -> None:
    """Run a rollout with every device, edge and the cloud in this process (in-memory transport).

    The same roles and node code as a real deployment; one shared ORT session per
    architecture. Writes per-round metrics (accuracy, loss, bytes per tier, epsilon under
    [privacy]) to JSON. On a terminal a live bar follows the rounds; piped, one line per round.

    \b
        fedtier simulate --config experiments/digits_fedavg.toml --rounds 5
        fedtier simulate --config experiments/digits_fedavg.toml --rounds 5 --trainer portable
        fedtier simulate --config experiments/digits_fedavg.toml --edge-aggregator median --attack sign_flip
        fedtier simulate --config experiments/digits_fedavg.toml --server-optimizer adam --server-lr 0.03
        fedtier simulate --config experiments/digits_fedavg.toml --backend ray --shards 2
    """
    import dataclasses

    from fedtier.rollout.config import RolloutConfig
    from commands.console import RoundProgress, make_console
    from cloud_coordinator.report import epsilon_spent, round_epsilon, round_line, summary
    from local_fleet.simulate import simulate as run_simulation
    from fedtier.errors import ConfigError
    from fedtier.runtime import logs
    from fedtier.runtime.config import load, merge_tables, read_toml

    logs.setup(log_level)
    if backend == "local" and (address is not None or shards is not None):
        raise click.UsageError("--address and --shards only make sense with --backend ray")
    cfg = load(RolloutConfig, config_path)
    extra = overrides(pop_values(strategy), cfg.algorithm)
    if extra:  # the options override the file; the merged config is validated like a file
        mapping = merge_tables(read_toml(config_path), extra)
        cfg = RolloutConfig.from_mapping(mapping, source=str(config_path), base_dir=config_path.resolve().parent)
    if rounds is not None:
        cfg = dataclasses.replace(cfg, rounds=rounds)
    if output is not None:
        cfg = dataclasses.replace(cfg, metrics_file=output)
    if trainer is not None:
        cfg = dataclasses.replace(cfg, simulation=dataclasses.replace(cfg.simulation, trainer=trainer))
    started = time.perf_counter()
    if cfg.attack is not None and not as_json:
        make_console(stderr=True).print(f"{cfg.attack.describe()}: {', '.join(cfg.attackers()) or 'none'}"
                                        " (a robustness test)", style="bold red")
    with RoundProgress(make_console(stderr=True), cfg.rounds, enabled=not as_json) as progress:
        def on_round(row: dict) -> None:
            progress.line(round_line(row, cfg.rounds))
            progress.update(row["round"] + 1, accuracy=row.get("accuracy"), epsilon=round_epsilon(row))

        try:
            result = run_simulation(cfg, on_round=on_round, backend=backend, address=address, shards=shards)
        except ConfigError as exc:
            if exc.key != "backend":
                raise
            raise click.UsageError(str(exc)) from None
    wall = time.perf_counter() - started
    if as_json:
        doc: dict = {"rollout": cfg.rollout, "rounds": result.rounds, "wall_s": wall,
                     "metrics_file": str(cfg.metrics_path)}
        if cfg.attack is not None:
            doc["attack"] = {"kind": cfg.attack.kind, "fraction": cfg.attack.fraction, "scale": cfg.attack.scale,
                             "devices": cfg.attackers(), "note": cfg.attack.describe()}
        json.dump(doc, sys.stdout, indent=1, default=float)
        click.echo()
    else:
        facts = []
        if result.rounds and result.rounds[-1].get("privacy"):
            p = result.rounds[-1]["privacy"]
            spent = epsilon_spent(result.rounds[-1], ".4g").removeprefix("epsilon ")  # "8 of 8"
            facts.append(("epsilon (ledger)", f"{spent} at delta {p['delta']:g} (largest over devices)"))
        facts.append(("metrics", str(cfg.metrics_path)))
        title = f"simulation of {cfg.rollout} ({config_path})"
        if cfg.attack is not None:
            facts.append(("attack", f"{cfg.attack.describe()}: {', '.join(cfg.attackers()) or 'none'}"))
            title = f"ATTACK RUN: {title}"
        make_console().print(summary(result.rounds, wall, title, facts=facts))

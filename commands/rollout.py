"""``fedtier rollout`` and ``fedtier devices``: operate rollouts through the coordinator's store.

Commands that change something write the desired state (or a deployment) into the store; the
running coordinator (``fedtier coordinator serve``, or ``coordinator run`` for its one rollout)
polls it and acts. Commands that read come straight from the store (``cloud_coordinator.status``)
and work whether or not the coordinator runs. The store is ``--store URL`` (``$FEDTIER_STORE``:
a rollout config's ``store``, e.g. PostgreSQL), else the SQLite file in ``--state-dir`` (default
``$FEDTIER_STATE_DIR``, else ``fedtier-state``: the default ``state_dir`` of a rollout config).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import click

from fedtier.errors import ConfigError

STATE_DIR_ENV = "FEDTIER_STATE_DIR"
STORE_ENV = "FEDTIER_STORE"


@dataclass(frozen=True)
class StoreRef:
    """Where a command finds the coordinator's store: ``--store URL``, else ``--state-dir``'s SQLite file."""

    state_dir: Path
    url: str | None = None

    def __str__(self) -> str:
        return str(self.state_dir) if self.url is None else _display_store(self.url)

    def option(self) -> str:
        """The option that names this store on a command line."""
        return f"--state-dir {self.state_dir}" if self.url is None else f"--store {_display_store(self.url)}"


def state_dir_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--state-dir`` and ``--store``, passed to ``command`` as one ``state_dir: StoreRef``."""

    @click.option("--state-dir", "state_dir_path", type=click.Path(file_okay=False, path_type=Path),
                  envvar=STATE_DIR_ENV, default="fedtier-state", show_default=True,
                  help=f"The coordinator's state directory (its coordinator.db); also ${STATE_DIR_ENV}.")
    @click.option("--store", "store_url", metavar="URL", envvar=STORE_ENV, default=None,
                  help="The coordinator's store when it is not <state-dir>/coordinator.db, e.g. "
                       f"postgresql://fedtier@db:5432/fedtier (a rollout config's `store`); also ${STORE_ENV}.")
    @functools.wraps(command)
    def wrapper(*args: Any, state_dir_path: Path, store_url: str | None, **kwargs: Any) -> Any:
        return command(*args, state_dir=StoreRef(state_dir_path, store_url), **kwargs)

    return wrapper


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON (for machines) instead of a table.")


def _store(where: StoreRef, *, read_only: bool = False) -> Any:
    """The store a command works on; a command that only reads (``read_only``) never migrates it and says so
    on stderr when a migration is due."""
    from cloud_coordinator.status import open_store

    store = open_store(where.state_dir, where.url, read_only=read_only)
    if read_only and store.migration_due:
        from cloud_coordinator.store_backend import migration_due

        click.echo(migration_due(store.url, store.schema_found, where.option()), err=True)
    return store


def _echo_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=1, sort_keys=True, default=str)
    click.echo()


def _when(stamp: float | None) -> str:
    return "-" if stamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def _num(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


@click.group()
def rollout() -> None:
    """Operate rollouts: create, start, pause, resume, stop, status, models, export, promote, rollback.

    The CLI talks to the coordinator through its SQLite store (<state_dir>/coordinator.db): it
    writes what you ask, `fedtier coordinator serve` picks it up within a second; reads need no
    running coordinator. See docs/operations.md.

    \b
        fedtier rollout create --config rollout.toml --start
        fedtier rollout status hand1 --watch
    """


# --- lifecycle -----------------------------------------------------------------------------------


def _display_store(url: str) -> str:
    from cloud_coordinator.store_backend import display, parse_url

    return display(parse_url(url))


def plan_of(cfg: Any) -> dict[str, Any]:
    """What ``rollout create`` prints: cells, devices, algorithm, rounds, privacy summary."""
    cells = cfg.topology.layout()
    plan: dict[str, Any] = {
        "rollout": cfg.rollout, "algorithm": cfg.algorithm, "rounds": cfg.rounds,
        "model": cfg.model.kind, "dataset": cfg.data.dataset,
        "cells": {c: list(m) for c, m in cells.items()}, "devices": sum(len(m) for m in cells.values()),
        "deadline_s": cfg.deadline_s, "quorum": cfg.section.quorum,
        "broker": f"{cfg.broker.host}:{cfg.broker.port}", "state_dir": str(cfg.state_dir),
        "store": _display_store(cfg.store_location), "privacy": None,
    }
    if cfg.traits.split_model:  # a host per cell beside its devices
        plan["model"] = "split"
        plan["hosts"] = cfg.hsgd_hosts()
    if cfg.privacy is not None:
        p = cfg.privacy
        plan["privacy"] = {"epsilon": p.epsilon, "delta": p.delta, "clip": p.clip, "calibration": p.calibration,
                           "budget_epsilon": p.budget_epsilon if p.budget_epsilon is not None else p.epsilon,
                           "trusted_cells": sorted(cfg.topology.trusted)}
    return plan


SHARED_KEYS = ("broker", "cloud_id", "state_dir", "store", "signing_key")
"""Settings every rollout of one store shares: one coordinator process, one connection, one key."""


@rollout.command("create")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The rollout config (docs/configuration.md). Its store (or state_dir) names the store.")
@click.option("--start", "start_now", is_flag=True, help="Start it at once (else `fedtier rollout start ID`).")
@json_option
def rollout_create(config_path: Path, start_now: bool, as_json: bool) -> None:
    """Validate a rollout config, admit its model, register it in the coordinator's store and print its plan.

    Everything that can be checked before a round is checked now (keys, values, the signing
    key, the topology, the data against the model). The model's artifacts are built into the
    artifact store and admitted: trained for a few steps in a child process on every trainer
    path a device may use; a model that crashes, fails or gives NaN there is refused (exit 2,
    naming the trainer and the op) and nothing is stored (docs/models.md). Every rollout of one
    store shares [broker], cloud_id, state_dir, store and signing_key. Its metrics file defaults
    to <state_dir>/metrics-<rollout>.json.

    Example: fedtier rollout create --config fleet/configs/coordinator.toml --start
    """
    import dataclasses

    from fedtier.rollout.config import RolloutConfig
    from cloud_coordinator.admission import STEPS, TRAINER_PATHS, paths_for
    from cloud_coordinator.rollout import prepare
    from cloud_coordinator.run import validate
    from cloud_coordinator.store import CoordinatorStore
    from fedtier.runtime.config import load

    cfg = load(RolloutConfig, config_path)
    validate(cfg)
    if cfg.metrics_file is None:
        cfg = dataclasses.replace(cfg, metrics_file=cfg.state_dir / f"metrics-{cfg.rollout}.json")
    prepared = prepare(cfg)  # builds and admits the model before anything is stored (ModelRefused: exit 2)
    bundles = [b for b in (prepared.bundle, prepared.split, *prepared.cell_bundles.values()) if b is not None]
    admitted = sorted({p for b in bundles for p in paths_for(b, TRAINER_PATHS)})
    plain = cfg.to_dict()
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    store = CoordinatorStore(cfg.store_location)
    try:
        for row in store.rollout_rows():
            for key in SHARED_KEYS:
                if row["config"].get(key) != json.loads(json.dumps(plain.get(key), default=str)):
                    raise ConfigError(f"every rollout of {store.where} shares {key} (one coordinator serves them); "
                                      f"rollout {row['rollout']} has {row['config'].get(key)!r}", key=key,
                                      source=str(config_path))
        if not store.create_rollout(cfg.rollout, plain):
            raise ConfigError(f"the store already has a rollout {cfg.rollout!r} (rollout ids are not reused)",
                              key="rollout", source=str(config_path))
        if start_now:
            store.set_desired(cfg.rollout, "running")
    finally:
        store.close()
    plan = plan_of(cfg)
    if as_json:
        _echo_json({**plan, "started": start_now})
        return
    lines = [f"rollout {cfg.rollout}: {cfg.algorithm}, {cfg.rounds} rounds, model {plan['model']}, "
             f"data {cfg.data.dataset}",
             f"  {len(plan['cells'])} cells, {plan['devices']} devices; deadline {plan['deadline_s']:g} s, "
             f"quorum {plan['quorum']:g}; broker {plan['broker']}"]
    hosts = plan.get("hosts", {})
    lines += [f"  {c}: {', '.join(m)}" + (f"; host {hosts[c]}" if c in hosts else "") for c, m in plan["cells"].items()]
    if plan["privacy"]:
        p = plan["privacy"]
        lines.append(f"  privacy: epsilon {p['epsilon']:g} at delta {p['delta']:g}, clip {p['clip']:g}, "
                     f"{p['calibration']}; trusted cells: {', '.join(p['trusted_cells']) or 'none'} "
                     f"(`fedtier privacy plan --config {config_path}` for the noise plan)")
    else:
        lines.append("  privacy: off")
    where = f"--store {cfg.store}" if cfg.store else f"--state-dir {cfg.state_dir}"
    lines.append(f"  model admitted: {STEPS} training steps on {', '.join(admitted)} ({len(bundles)} "
                 f"bundle{'s' if len(bundles) != 1 else ''})")
    lines.append(f"  store: {plan['store']}")
    lines.append("  started: the coordinator opens round 0 within a second" if start_now else
                 f"  next: fedtier rollout start {cfg.rollout} {where}")
    click.echo("\n".join(lines))


TRANSITIONS: dict[str, tuple[tuple[str, ...], str, str]] = {
    # command: (statuses it applies to, desired state it writes, what happens)
    "start": (("created",), "running", "the coordinator opens round 0 within a second"),
    "pause": (("created", "running"), "paused", "the open round finishes; no new round opens"),
    "resume": (("paused", "running"), "running", "the next round opens within a second"),
    "stop": (("created", "running", "paused"), "stopped", "the open round is abandoned; the rollout ends"),
}


def _transition(state_dir: StoreRef, rollout_id: str, command: str, as_json: bool) -> None:
    from cloud_coordinator.status import rollout_list

    allowed, desired, effect = TRANSITIONS[command]
    store = _store(state_dir)
    try:
        rows = {r["rollout"]: r for r in rollout_list(store)}
        if rollout_id not in rows:
            raise ConfigError(f"no rollout {rollout_id!r} in {state_dir} (rollouts: {', '.join(rows) or 'none'})",
                              key="rollout")
        row = rows[rollout_id]
        current = row["desired"] if row["status"] not in ("finished", "stopped") else row["status"]
        if current not in allowed:
            raise ConfigError(f"rollout {rollout_id} is {current}: `{command}` applies to "
                              f"{' or '.join(allowed)} rollouts", key="rollout")
        store.set_desired(rollout_id, desired)
    finally:
        store.close()
    if as_json:
        _echo_json({"rollout": rollout_id, "desired": desired, "was": current})
    else:
        click.echo(f"rollout {rollout_id}: {current} -> {desired}: {effect}")


def _lifecycle(command: str, example: str) -> Callable[..., None]:
    @rollout.command(command, help=f"{command.capitalize()} a rollout: {TRANSITIONS[command][2]}.\n\n"
                                   f"Example: {example}")
    @click.argument("rollout_id", metavar="ROLLOUT")
    @state_dir_option
    @json_option
    def cmd(rollout_id: str, state_dir: StoreRef, as_json: bool) -> None:
        _transition(state_dir, rollout_id, command, as_json)

    return cmd


for _cmd in ("start", "pause", "resume", "stop"):
    _lifecycle(_cmd, f"fedtier rollout {_cmd} hand1 --state-dir fleet/coordinator")


# --- reads ---------------------------------------------------------------------------------------


@rollout.command("list")
@state_dir_option
@json_option
def rollout_list_cmd(state_dir: StoreRef, as_json: bool) -> None:
    """List the rollouts of the store: status, desired state, rounds, last accuracy.

    Example: fedtier rollout list --state-dir fleet/coordinator --json
    """
    from rich.table import Table

    from commands.console import make_console
    from cloud_coordinator.status import rollout_list

    store = _store(state_dir, read_only=True)
    try:
        rows = rollout_list(store)
    finally:
        store.close()
    if as_json:
        _echo_json(rows)
        return
    table = Table(title=f"rollouts in {state_dir}")
    for col in ("rollout", "algorithm", "status", "desired", "rounds", "accuracy", "created"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["rollout"], r["algorithm"], r["status"], r["desired"],
                      f"{r['rounds_closed']}/{r['rounds_planned']}", _num(r["last_accuracy"]), _when(r["created"]))
    make_console().print(table)


def status_table(doc: dict[str, Any]) -> Any:
    """The rich rendering of ``rollout_status``."""
    from rich.console import Group
    from rich.table import Table

    open_round = doc["open_round"]
    head = (f"rollout {doc['rollout']}: {doc['algorithm']}, {doc['status']}"
            + (f" (asked: {doc['desired']})" if doc["desired"] != doc["status"] else "")
            + f"; rounds closed {doc['rounds_closed']}/{doc['rounds_planned']}; "
            + ("no round open" if open_round is None else f"round {open_round} open")
            + f"; model version {doc['model_version']}; last accuracy {_num(doc['last_accuracy'])}")
    if doc["epsilon_spent"] is not None:
        budget = doc["epsilon_budget"]
        head += f"; epsilon {doc['epsilon_spent']:.3g} of {'inf' if budget is None else format(budget, 'g')}"
    table = Table(title=head, title_justify="left")
    for col in ("cell", "edge", "online/known", "round open", "accepted", "rejected", "failed", "stragglers",
                "serving"):
        table.add_column(col)
    for cell, c in doc["cells"].items():
        rejected = ", ".join(f"{k} {v}" for k, v in c["updates_rejected"].items()) or "-"
        failed = ", ".join(f"{k} {v}" for k, v in c.get("training_failed", {}).items()) or "-"
        table.add_row(cell, c["edge"], f"{c['devices_online']}/{c['devices_known']}", "yes" if c["round_open"] else "-",
                      str(c["updates_accepted"]), rejected, failed, ", ".join(c["stragglers"]) or "-",
                      "-" if c["deployed_version"] is None else f"v{c['deployed_version']}")
    tiers = ", ".join(f"{k} {v:,}" for k, v in doc["bytes"].items() if not k.endswith("_f32")) or "-"
    parts: list[Any] = [table, f"bytes per tier: {tiers}"]
    spread = per_device_table(doc.get("federated_per_device") or [])
    if spread is not None:
        parts.append(spread)
    return Group(*parts)


PER_DEVICE_ROUNDS = 10
"""``rollout status`` shows the spread of the devices' own evaluation for this many newest rounds (``--json``:
every round, every device)."""


def per_device_table(rounds: list[dict[str, Any]]) -> Any:
    """The devices' own federated evaluation per round (``cloud_coordinator.status.federated_per_device``): min,
    median and max across devices, and the worst devices; ``None`` when no round carries it."""
    from rich.table import Table

    if not rounds:
        return None
    shown = rounds[-PER_DEVICE_ROUNDS:]
    metric = shown[-1]["metric"]
    title = (f"federated evaluation per device: {metric} on each device's own held-out rows of the model the round "
             "started from" + (f" (last {len(shown)} of {len(rounds)} rounds; --json has all)"
                               if len(shown) < len(rounds) else ""))
    table = Table(title=title, title_justify="left")
    for col in ("round", "model", "devices", f"min {metric}", "median", "max", "worst devices"):
        table.add_column(col)
    for r in shown:
        key = r["metric"]
        worst = ", ".join(f"{w['device']} {_num(w.get(key))}" for w in r["worst"])
        table.add_row(str(r["round"]), "-" if r["model_version"] is None else f"v{r['model_version']}",
                      str(r["devices"]), _num(r["min"]), _num(r["median"]), _num(r["max"]), worst)
    return table


@rollout.command("status")
@click.argument("rollout_id", metavar="ROLLOUT")
@state_dir_option
@json_option
@click.option("--watch", is_flag=True, help="Refresh in place until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(0.1), default=1.0, show_default=True, help="--watch refresh (s).")
def rollout_status_cmd(rollout_id: str, state_dir: StoreRef, as_json: bool, watch: bool, interval: float) -> None:
    """A rollout's status: per cell devices online/known, round open, updates accepted and rejected by
    reason, devices that failed to train by reason, stragglers of the last round, served version; last
    accuracy, epsilon spent, bytes per tier; per round, the devices' accuracy on their own held-out rows
    (min, median, max, the worst 3; --json: every device of every round).

    \b
        fedtier rollout status hand1 --state-dir fleet/coordinator
        fedtier rollout status hand1 --watch
        fedtier rollout status hand1 --json
    """
    from commands.console import make_console
    from cloud_coordinator.status import rollout_status

    store = _store(state_dir, read_only=True)
    try:
        if as_json:
            _echo_json(rollout_status(store, rollout_id))
            return
        console = make_console()
        if not watch:
            console.print(status_table(rollout_status(store, rollout_id)))
            return
        from rich.live import Live

        with Live(status_table(rollout_status(store, rollout_id)), console=console, auto_refresh=False) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(status_table(rollout_status(store, rollout_id)), refresh=True)
            except KeyboardInterrupt:
                pass
    finally:
        store.close()


@rollout.command("models")
@click.argument("rollout_id", metavar="ROLLOUT")
@state_dir_option
@json_option
def rollout_models(rollout_id: str, state_dir: StoreRef, as_json: bool) -> None:
    """The version registry: each model version's round, test accuracy, sha256, when, cells serving it.

    Version 0 is the initial model; round r's model is version r + 1.

    Example: fedtier rollout models hand1 --state-dir fleet/coordinator
    """
    from rich.table import Table

    from commands.console import make_console
    from cloud_coordinator.status import model_registry

    store = _store(state_dir, read_only=True)
    try:
        rows = model_registry(store, rollout_id)
    finally:
        store.close()
    if as_json:
        _echo_json(rows)
        return
    table = Table(title=f"model versions of {rollout_id}")
    for col in ("version", "round", "accuracy", "sha256", "created", "serving"):
        table.add_column(col)
    for m in rows:
        table.add_row(str(m["version"]), "initial" if m["round"] < 0 else str(m["round"]), _num(m["accuracy"]),
                      m["sha256"][:16], _when(m["created"]), ", ".join(m["cells"]) or "-")
    make_console().print(table)


@rollout.command("export")
@click.argument("rollout_id", metavar="ROLLOUT")
@click.option("--version", type=click.IntRange(0), default=None, help="Model version (default the newest).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="ONNX file to write.")
@state_dir_option
@json_option
def rollout_export(rollout_id: str, version: int | None, out: Path, state_dir: StoreRef, as_json: bool) -> None:
    """Write a model version as an inference ONNX file (input "input": float32 rows (batch, features),
    as in the data; output "logits"; HSGD's split model: inputs "x1", the host's features, and "x2", a
    device's) that onnxruntime.InferenceSession runs, and its interface beside it as OUT.json. Same as
    `fedtier coordinator export`, by rollout id.

    Example: fedtier rollout export hand1 --version 3 --out hand1-v3.onnx
    """
    from cloud_coordinator.export import export_config, export_model

    store = _store(state_dir, read_only=True)
    try:
        rows = {r["rollout"]: r for r in store.rollout_rows()}
    finally:
        store.close()
    if rollout_id not in rows:
        raise ConfigError(f"no rollout {rollout_id!r} in {state_dir}", key="rollout")
    row = rows[rollout_id]
    cfg = export_config(row["config"], source=f"rollout {rollout_id} (stored config)")
    from commands.coordinator import echo_export

    echo_export(export_model(cfg, out, version=version), as_json)


@rollout.command("promote")
@click.argument("rollout_id", metavar="ROLLOUT")
@click.option("--canary", required=True, help="Comma-separated cells that get the new version first.")
@click.option("--version", type=click.IntRange(0), default=None, help="The version to promote (default the newest).")
@click.option("--margin", type=click.FloatRange(0), default=0.01, show_default=True,
              help="Largest accuracy drop from the previous version the gate accepts.")
@click.option("--observe", "observe_s", type=click.FloatRange(0), default=5.0, show_default=True,
              help="Seconds the canary's agents must stay healthy (online) before the rest follows.")
@state_dir_option
@json_option
def rollout_promote(rollout_id: str, canary: str, version: int | None, margin: float, observe_s: float,
                    state_dir: StoreRef, as_json: bool) -> None:
    """Serve a new model version: canary cells first, then — if the health gate passes (finite
    parameters, accuracy not below the previous version by more than --margin, every canary agent
    and edge online) — every cell. A failed gate leaves every cell on the previous version and says
    why (exit code 1).

    Example: fedtier rollout promote hand1 --canary cell-0 --margin 0.02
    """
    from cloud_coordinator.canary import promote

    store = _store(state_dir)
    try:
        result = promote(store, rollout_id, [c.strip() for c in canary.split(",") if c.strip()], version=version,
                         margin=margin, observe_s=observe_s)
    finally:
        store.close()
    if as_json:
        _echo_json(result.to_dict())
    elif result.passed:
        click.echo(f"version {result.candidate} passed the gate on {', '.join(result.canary)}: every cell serves it "
                   f"(was {result.previous if result.previous is not None else 'none'})")
    else:
        click.echo(f"version {result.candidate} NOT promoted; every cell stays on version "
                   f"{result.previous if result.previous is not None else 'none'}:")
        for reason in result.reasons:
            click.echo(f"  - {reason}")
    if not result.passed:
        raise SystemExit(1)


@rollout.command("rollback")
@click.argument("rollout_id", metavar="ROLLOUT")
@click.option("--to", "version", type=click.IntRange(0), required=True, help="The version every cell serves again.")
@state_dir_option
@json_option
def rollout_rollback(rollout_id: str, version: int, state_dir: StoreRef, as_json: bool) -> None:
    """Every cell serves an earlier model version again (no gate: going back is the safe direction).

    Example: fedtier rollout rollback hand1 --to 3
    """
    from cloud_coordinator.canary import rollback

    store = _store(state_dir)
    try:
        deployed = rollback(store, rollout_id, version)
    finally:
        store.close()
    if as_json:
        _echo_json({"rollout": rollout_id, "version": version, "deployed": deployed})
    else:
        click.echo(f"rollout {rollout_id}: every cell serves version {version} ({', '.join(deployed)})")


# --- devices -------------------------------------------------------------------------------------


@click.group()
def devices() -> None:
    """The device inventory, from every node's retained presence as the coordinator saw it."""


@devices.command("list")
@click.option("--cell", default=None, help="Only this cell's nodes.")
@state_dir_option
@json_option
def devices_list(cell: str | None, state_dir: StoreRef, as_json: bool) -> None:
    """Every device and edge: online or not, since / last seen, agent version, trainer backend, last
    round contributed (and the model version it trained from), the model version its cell serves.

    \b
        fedtier devices list --state-dir fleet/coordinator
        fedtier devices list --cell cell-0 --json
    """
    from rich.table import Table

    from commands.console import make_console
    from cloud_coordinator.status import device_inventory

    store = _store(state_dir, read_only=True)
    try:
        rows = device_inventory(store, cell)
    finally:
        store.close()
    if as_json:
        _echo_json(rows)
        return
    table = Table(title=f"devices ({state_dir})")
    for col in ("node", "role", "cell", "state", "last seen", "version", "trainer", "last round", "trained from",
                "serving"):
        table.add_column(col)
    for d in rows:
        table.add_row(d["node"], d["role"] or "-", d["cell"] or "-", d["state"], _when(d["last_seen"]),
                      d["agent_version"] or "-", d["trainer"] or "-",
                      "-" if d["last_round"] is None else f"{d['rollout']} r{d['last_round']}",
                      "-" if d["trained_version"] is None else f"v{d['trained_version']}",
                      "-" if d["model_version"] is None else f"v{d['model_version']}")
    make_console().print(table)

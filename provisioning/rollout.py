"""``fedtier provision fleet``: every node a rollout's topology names, provisioned in one step.

From a rollout config (its ``[topology]`` names the cells and devices, its ``[broker]`` is
where the coordinator connects) this writes, under ``OUT``::

    OUT/
      ca/                  the fleet directory: CA, manifest-signing key, CRL, inventory (created if
                           absent; --fleet for another)
      coordinator/         the coordinator's bundle, and <rollout>.toml: the rollout config merged
                           with the bundle's settings (TLS, signing key, state directory), ready
                           for `fedtier coordinator run --config OUT/coordinator/<rollout>.toml`
      gateways/<cell>/     each edge's bundle (edge.toml)
      devices/<device>/    each device's bundle (device.toml; its data goes into data/: the shard of
                           its name with --shards DIR, its share of a built-in dataset with --sample-data)
      brokers/<name>/      each broker's Mosquitto config: mosquitto.conf, fedtier.acl,
                           broker.pem, broker.key, ca.pem, crl.pem
      fleet.json           what was written (what ``--json`` prints)

Brokers, in the two layouts a fleet uses (mixed is fine too):

* **one shared broker** (default): ``brokers/shared`` at the rollout's ``[broker]`` serves the
  coordinator, every edge (one connection each, for both of its sides) and every device;
* **a broker per gateway** (``--cell-broker CELL=HOST:PORT``): ``brokers/CELL`` on that cell's
  gateway serves its devices and its edge; ``brokers/cloud`` at the rollout's ``[broker]``
  serves the coordinator and the edges' cloud side;
* **gateway brokers bridged to the cloud's** (``--cell-broker ... --bridge``): as above, but each
  gateway's broker carries its edge's cloud side over a Mosquitto bridge (the gateway's
  certificate, only that cell's edge topics; ``provisioning.broker_bridge``), so the edge
  connects to its local broker alone.

Every ACL comes from the one writer, :func:`provisioning.broker_config.broker_acl`, with each
device bound to its own cell by name (to every cell of the rollout under ``[topology] roaming``);
every broker maps the certificate's name to the MQTT username and client id.

Running it again keeps what still holds — the CA, each bundle whose certificate is active and
was issued for the same cell and brokers, each broker certificate valid for its host — and
issues what is new (a second rollout with the same topology issues nothing). Every node it issues
or reissues a key and certificate is named with the reason (``FleetResult.reasons``). Configs and ACLs
are rewritten. Nodes that left the topology are listed, not revoked (``provision revoke``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import json
import logging
import os
import shutil
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedtier.errors import ConfigError
from fedtier.runtime.config import Section, dumps_toml, load, read_toml
from fedtier.security import pki
from provisioning import ca
from provisioning.broker_bridge import Bridge
from provisioning.broker_config import (
    _check_server_identity,
    _prepare_key_for,
    _user,
    broker_acl,
    current_user,
    mosquitto_conf,
)
from provisioning.bundles import (
    CONFIG_NAMES,
    _format_endpoint,
    issue_broker,
    issue_coordinator,
    issue_device,
    issue_gateway,
)
from provisioning.errors import FleetNotFoundError
from provisioning.fleet import CertRecord, Fleet

log = logging.getLogger("fedtier.provisioning")

Endpoint = tuple[str, int]
SHARED, CLOUD = "shared", "cloud"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class BrokerPlan:
    """One broker of the fleet and who connects to it."""

    name: str
    endpoint: Endpoint
    cell_side: tuple[str, ...]
    cloud_side: tuple[str, ...]
    coordinator: bool
    bridge_to: Endpoint | None = None

    def serves(self) -> str:
        parts = ["the coordinator"] if self.coordinator else []
        if self.cell_side:
            parts.append(f"cell{'s' if len(self.cell_side) > 1 else ''} {', '.join(self.cell_side)} "
                         "(devices and edge)")
        others = [c for c in self.cloud_side if c not in self.cell_side]
        if others:
            parts.append(f"the cloud side of edge{'s' if len(others) > 1 else ''} {', '.join(others)}")
        if self.bridge_to is not None:
            parts.append(f"bridged to the cloud broker {_format_endpoint(*self.bridge_to)}")
        return "; ".join(parts)


@dataclass
class FleetResult:
    """What ``provision_fleet`` wrote (``to_json`` is ``fleet.json``)."""

    out: Path
    fleet: Path
    rollout: str
    rollout_config: Path
    coordinator: Path
    gateways: dict[str, Path]
    devices: dict[str, Path]
    brokers: dict[str, dict[str, Any]]
    issued: list[str] = field(default_factory=list)
    """Every node given a new key and certificate by this run ("device dev-01"), ..."""
    reasons: dict[str, str] = field(default_factory=dict)
    """... and why, by the same label ("new: ...", "its broker changed (...)", ...)."""
    kept: list[str] = field(default_factory=list)
    departed: list[str] = field(default_factory=list)
    data: dict[str, int] = field(default_factory=dict)
    held_out: dict[str, int] = field(default_factory=dict)
    shards: Path | None = None
    run_as: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"out": str(self.out), "fleet": str(self.fleet), "rollout": self.rollout,
                "rollout_config": str(self.rollout_config), "coordinator": str(self.coordinator),
                "gateways": {c: str(p) for c, p in self.gateways.items()},
                "devices": {d: str(p) for d, p in self.devices.items()}, "brokers": self.brokers,
                "issued": self.issued, "reasons": self.reasons, "kept": self.kept, "departed": self.departed,
                "data": self.data,
                "held_out": self.held_out, "shards": None if self.shards is None else str(self.shards),
                "broker_user": self.run_as}


def plan_brokers(cells: Sequence[str], cloud: Endpoint, cell_brokers: Mapping[str, Endpoint], *,
                 bridge: bool = False) -> list[BrokerPlan]:
    """The brokers of a fleet: one shared broker, or a cloud broker plus one per listed gateway.

    With ``bridge``, each gateway's broker is bridged to the cloud broker
    (``provisioning.broker_bridge``): the edge's cloud side is on its local broker too.

    Raises:
        ConfigError: a ``--cell-broker`` names a cell the topology does not have, or two brokers
            share an address.
    """
    if bridge and not cell_brokers:
        raise ConfigError("--bridge bridges gateway brokers to the cloud broker: give each gateway's broker "
                          "with --cell-broker CELL=HOST:PORT")
    unknown = sorted(set(cell_brokers) - set(cells))
    if unknown:
        raise ConfigError(f"--cell-broker names {', '.join(unknown)}, which the rollout's topology does not have "
                          f"(cells: {', '.join(cells)})")
    addresses = [cloud, *cell_brokers.values()]
    if len(set(addresses)) != len(addresses):
        raise ConfigError("two brokers share an address: give each --cell-broker its own host:port, different "
                          "from the rollout's [broker]")
    on_cloud = tuple(c for c in cells if c not in cell_brokers)
    plans = [BrokerPlan(SHARED if not cell_brokers else CLOUD, cloud, on_cloud, tuple(cells), True)]
    plans += [BrokerPlan(cell, endpoint, (cell,), (cell,) if bridge else (), False, cloud if bridge else None)
              for cell, endpoint in sorted(cell_brokers.items())]
    return plans


def _hosts(host: str) -> list[str]:
    """The names a broker certificate must list: the host, and its loopback twin for local trials."""
    if host in LOOPBACK:
        return sorted({host, "127.0.0.1", "localhost"})
    return [host]


def _bind(host: str) -> str:
    try:
        return "127.0.0.1" if ipaddress.ip_address(host).is_loopback else "0.0.0.0"
    except ValueError:
        return "127.0.0.1" if host == "localhost" else "0.0.0.0"


# --- bundles: keep what holds, issue what is new -------------------------------------------------


def _why_issue(fleet: Fleet, kind: str, name: str, directory: Path, *, cell: str | None, broker: Endpoint,
               cloud_broker: Endpoint | None = None, parent: str | None = None) -> str | None:
    """Why this node needs a new identity (key and certificate), in words; ``None`` when the bundle in
    ``directory`` is still its current identity for these brokers (it is kept)."""
    found = fleet.find(name, kind=kind)
    if not found:
        return "new: the fleet has issued it nothing yet"
    files = [directory / "cert.pem", directory / "key.pem", directory / CONFIG_NAMES[kind]]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        return f"its bundle in {directory} lacks {', '.join(absent)}"
    record: CertRecord = found[-1]
    try:
        cert = pki.load_certificate(files[0])
        key = pki.load_private_key(files[1])
    except ConfigError as exc:
        return f"its bundle does not load ({exc})"
    if cert.serial_number != record.serial:
        return f"its bundle's certificate is not the last one the fleet issued it (serial {record.serial:x})"
    if record.revoked:
        return "its certificate was revoked"
    if record.not_after - ca.utcnow() <= dt.timedelta(days=1):
        return f"its certificate expires {record.not_after:%Y-%m-%d %H:%M} UTC, within a day"
    if not pki.same_public_key(key.public_key(), cert.public_key()):  # type: ignore[arg-type]
        return "its key is not its certificate's"
    if record.cell != cell:
        return f"its cell changed ({record.cell} -> {cell})"
    if record.broker != _format_endpoint(*broker):
        return f"its broker changed ({record.broker} -> {_format_endpoint(*broker)})"
    if kind == "gateway":
        wanted = _format_endpoint(*(cloud_broker or broker))
        if record.cloud_broker != wanted:
            return f"its cloud broker changed ({record.cloud_broker} -> {wanted})"
        if record.parent != parent:
            return f"its coordinator changed ({record.parent} -> {parent})"
    return None


def _record(result: FleetResult, label: str, reason: str | None) -> None:
    """``label`` was issued for ``reason``, or kept (``None``)."""
    if reason is None:
        result.kept.append(label)
    else:
        result.issued.append(label)
        result.reasons[label] = reason


def _broker_dir(fleet: Fleet, plan: BrokerPlan, directory: Path, *, cloud_id: str, devices: Mapping[str, str],
                run_as: str, days: float | None, result: FleetResult,
                gateway_bundle: Path | None = None, roaming: bool = False) -> dict[str, Any]:
    """Write one broker's directory: its certificate (kept if still valid), CA, CRL, ACL, config."""
    directory.mkdir(parents=True, exist_ok=True)
    host, port = plan.endpoint
    hosts = _hosts(host)
    cert, key = directory / "broker.pem", directory / "broker.key"
    problem = (_check_server_identity(fleet, cert, key, hosts) if cert.is_file() and key.is_file()
               else f"new: no broker.pem and broker.key in {directory} yet")
    if problem:
        issue_broker(fleet, f"broker-{plan.name}", hosts, directory, days=days, force=True)
    _record(result, f"broker {plan.name}", problem)
    ca_copy, crl_copy = directory / "ca.pem", directory / "crl.pem"
    shutil.copyfile(fleet.ca_cert_path, ca_copy)
    shutil.copyfile(fleet.crl_path, crl_copy)
    key_used = _prepare_key_for(run_as, key, directory)
    header = (f"fedtier ACL of broker {plan.name} ({host}:{port}), written by `fedtier provision fleet`.\n"
              f"Serves {plan.serves()}.\n"
              "Clients authenticate with fleet certificates; the CN is the username and the client id.\n"
              "Anything not granted here is denied. Mosquitto re-reads this file on SIGHUP.")
    acl_text = broker_acl(cell_side=plan.cell_side, cloud_side=plan.cloud_side,
                          cloud_id=cloud_id if plan.coordinator else None, devices=devices, header=header,
                          roaming=roaming)
    acl = directory / "fedtier.acl"
    pki.write_atomic(acl, acl_text.encode(), 0o644, overwrite=True)
    bridge = None
    if plan.bridge_to is not None and gateway_bundle is not None:
        # The bridge presents the gateway's certificate; copies keep the broker directory whole.
        bridge_cert, bridge_key = directory / "bridge.pem", directory / "bridge.key"
        shutil.copyfile(gateway_bundle / "cert.pem", bridge_cert)
        pki.write_atomic(bridge_key, (gateway_bundle / "key.pem").read_bytes(), pki.PRIVATE_MODE, overwrite=True)
        bridge = Bridge(cell=plan.name, remote=plan.bridge_to, cafile=ca_copy, certfile=bridge_cert,
                        keyfile=_prepare_key_for(run_as, bridge_key, directory, "bridge.key"), cloud_id=cloud_id)
    conf = directory / "mosquitto.conf"
    text = mosquitto_conf(port=port, bind=_bind(host), cafile=ca_copy, certfile=cert, keyfile=key_used,
                          crlfile=crl_copy, acl_file=acl, run_as=run_as, bridge=bridge)
    pki.write_atomic(conf, text.encode(), 0o644, overwrite=True)
    return {"dir": str(directory), "conf": str(conf), "host": host, "port": port, "serves": plan.serves(),
            "command": ["mosquitto", "-c", str(conf)]}


# --- the coordinator's rollout file ----------------------------------------------------------------


def _path_fields(cls: type[Section]) -> dict[str, Any]:
    """Field name -> ``"path"``, ``"paths"`` or a nested Section class, for every path-valued field."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        for arg in args:
            if arg is Path:
                out[f.name] = "path"
            elif typing.get_origin(arg) is tuple and typing.get_args(arg)[:1] == (Path,):
                out[f.name] = "paths"
            elif isinstance(arg, type) and issubclass(arg, Section):
                out[f.name] = arg
    return out


def rebase_paths(cls: type[Section], table: Mapping[str, Any], base: Path) -> dict[str, Any]:
    """``table`` (raw TOML of section ``cls``) with every relative path made absolute against ``base``.

    A config's relative paths are relative to the file's own directory; a copy of it written
    elsewhere keeps meaning the same files this way. That covers ``Path`` fields and the strings
    a section names files with (``Section.rebase_strings``: ``[model] factory = "mymodel.py:make"``,
    a ``sqlite:///`` store).
    """
    kinds = _path_fields(cls)
    out = dict(cls.rebase_strings(table, base))

    def absolute(value: Any) -> Any:
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            return os.path.normpath(base / value)
        return value

    for key, kind in kinds.items():
        if key not in out:
            continue
        if kind == "path":
            out[key] = absolute(out[key])
        elif kind == "paths" and isinstance(out[key], list):
            out[key] = [absolute(v) for v in out[key]]
        elif isinstance(kind, type) and isinstance(out[key], Mapping):
            out[key] = rebase_paths(kind, out[key], base)
    return out


def merged_rollout(source: Path, coordinator_dir: Path, *, signing_key: Path, cloud: Endpoint,
                   cloud_id: str) -> dict[str, Any]:
    """The user's rollout config with the coordinator bundle's settings, to live in ``coordinator_dir``.

    TLS files are the bundle's (relative to it); the signing key is the fleet's; the state
    and the metrics live in the coordinator's directory unless the config says otherwise —
    every rollout of this coordinator shares its state (one manifest version counter) and
    writes its own metrics file.
    """
    from fedtier.rollout.config import RolloutConfig

    raw = rebase_paths(RolloutConfig, read_toml(source), source.resolve().parent)
    rollout = str(raw.get("rollout", "default"))
    host, port = cloud
    broker = {k: v for k, v in dict(raw.get("broker", {})).items() if k not in ("host", "port")}
    broker.update({"host": host, "port": port, "tls_ca": "ca.pem", "tls_cert": "cert.pem", "tls_key": "key.pem"})
    merged = {**raw, "cloud_id": cloud_id, "signing_key": str(signing_key), "broker": broker}
    merged.setdefault("state_dir", "state")
    merged.setdefault("metrics_file", f"metrics/{rollout}.json")
    return merged


# --- the whole fleet -----------------------------------------------------------------------------


def provision_fleet(rollout_path: str | Path, out: str | Path, *, fleet_dir: str | Path | None = None,
                    cell_brokers: Mapping[str, Endpoint] | None = None, run_as: str | None = None,
                    sample_data: bool = False, days: float | None = None, bridge: bool = False,
                    shards: str | Path | None = None) -> FleetResult:
    """Provision every node of a rollout's topology (see the module docstring).

    Args:
        rollout_path: the rollout config (``rollout.toml``).
        out: the output directory.
        fleet_dir: the fleet (CA, signing key) to issue from; created if it holds none.
            Default ``OUT/ca``.
        cell_brokers: cell -> the broker on its gateway; other cells use the rollout's broker.
        run_as: the user Mosquitto switches to when started as root (the brokers' ``user``);
            default the user running this. The broker keys are made readable by that user
            where this process can (see ``provisioning.broker_config``).
        sample_data: write each device's share of the rollout's built-in dataset into its
            bundle's ``data/`` (for trials; real devices bring their own data).
        shards: the directory ``fedtier data split`` wrote: each device's bundle gets the shard of
            its own name as its ``data/`` (``fleet_data.shards.place_shards``); every device needs
            one and every shard a device, or nothing is written.
        days: validity of newly issued node certificates.
        bridge: bridge each ``cell_brokers`` broker to the rollout's broker; those edges then
            connect to their gateway's broker alone (``provisioning.broker_bridge``).

    Returns:
        What was written.

    Raises:
        ConfigError: the rollout config does not load, a ``--cell-broker`` is wrong, or the shards'
            names are not the topology's devices.
        NameConflictError, InvalidNameError: a node name the fleet cannot issue.
        ProvisioningError: ``run_as`` is not a user of this machine.
    """
    from fedtier.rollout.config import RolloutConfig

    source = Path(rollout_path).expanduser().resolve()
    cfg = load(RolloutConfig, source)
    out = Path(out).expanduser().resolve()
    cells = cfg.topology.layout()
    cloud = (cfg.broker.host, cfg.broker.port)
    cell_brokers = dict(cell_brokers or {})
    plans = plan_brokers(list(cells), cloud, cell_brokers, bridge=bridge)
    split_dir = _check_shards(shards, sample_data, cells)  # before anything is written
    run_as = run_as or current_user()
    _user(run_as)
    fleet = _open_fleet(Path(fleet_dir).expanduser().resolve() if fleet_dir else out / "ca")
    result = FleetResult(out=out, fleet=fleet.root, rollout=cfg.rollout, rollout_config=Path(),
                         coordinator=out / "coordinator", gateways={}, devices={}, brokers={}, run_as=run_as)
    _issue_nodes(fleet, cfg, cells, cloud, cell_brokers, bridge=bridge, days=days, result=result)
    membership = {d: c for c, ds in cells.items() for d in ds}
    result.departed = sorted(d for d in fleet.active_devices() if d not in membership)
    for plan in plans:
        result.brokers[plan.name] = _broker_dir(fleet, plan, out / "brokers" / plan.name, cloud_id=cfg.cloud_id,
                                                devices=membership, run_as=run_as, days=None, result=result,
                                                gateway_bundle=result.gateways.get(plan.name),
                                                roaming=cfg.topology.roaming)
    result.rollout_config = _write_rollout_file(source, cfg, result.coordinator, fleet, cloud)
    _write_device_data(cfg, result, sample_data=sample_data, split_dir=split_dir)
    pki.write_atomic(out / "fleet.json", (json.dumps(result.to_json(), indent=1) + "\n").encode(), 0o644,
                     overwrite=True)
    log.info("provisioned rollout %s in %s: %d issued, %d kept", cfg.rollout, out, len(result.issued),
             len(result.kept))
    return result


def _check_shards(shards: str | Path | None, sample_data: bool, cells: Mapping[str, Sequence[str]]) -> Path | None:
    """The split's directory, its shards matched to the topology's devices (refused before anything is written)."""
    if shards is None:
        return None
    from fleet_data.shards import match_shards, shards_in

    if sample_data:
        raise ConfigError("--shards puts your shards in the bundles, --sample-data a built-in dataset: give one",
                          key="--shards")
    split_dir = Path(shards).expanduser().resolve()
    match_shards(shards_in(split_dir), [d for ds in cells.values() for d in ds], split_dir)
    return split_dir


def _open_fleet(fleet_root: Path) -> Fleet:
    """The fleet to issue from; created where there is none (never over a damaged one: its CA stays)."""
    try:
        return Fleet(fleet_root)
    except FleetNotFoundError:
        if (fleet_root / "ca.key").exists() or (fleet_root / "inventory.json").exists():
            raise
        fleet = Fleet.init(fleet_root)
        log.info("created the fleet's CA and signing key in %s", fleet_root)
        return fleet


def _issue_nodes(fleet: Fleet, cfg: Any, cells: Mapping[str, Sequence[str]], cloud: Endpoint,
                 cell_brokers: Mapping[str, Endpoint], *, bridge: bool, days: float | None,
                 result: FleetResult) -> None:
    """A bundle for the coordinator, each gateway and each device, (re)issued only where ``_why_issue`` says why."""
    cell_endpoint = {cell: cell_brokers.get(cell, cloud) for cell in cells}
    # Where each edge finds the coordinator: its own broker when that one is bridged.
    edge_cloud = {cell: cell_endpoint[cell] if bridge else cloud for cell in cells}
    reason = _why_issue(fleet, "coordinator", cfg.cloud_id, result.coordinator, cell=None, broker=cloud)
    if reason:
        issue_coordinator(fleet, cloud, result.coordinator, cloud_id=cfg.cloud_id, days=days, force=True)
    _record(result, f"coordinator {cfg.cloud_id}", reason)
    for cell, members in cells.items():
        directory = result.out / "gateways" / cell
        reason = _why_issue(fleet, "gateway", cell, directory, cell=cell, broker=cell_endpoint[cell],
                            cloud_broker=edge_cloud[cell], parent=cfg.cloud_id)
        if reason:
            issue_gateway(fleet, cell, cell_endpoint[cell], directory, cloud_broker=edge_cloud[cell],
                          cloud_id=cfg.cloud_id, days=days, force=True)
        _record(result, f"gateway {cell}", reason)
        result.gateways[cell] = directory
        for device in members:
            directory = result.out / "devices" / device
            reason = _why_issue(fleet, "device", device, directory, cell=cell, broker=cell_endpoint[cell])
            if reason:
                issue_device(fleet, device, cell, cell_endpoint[cell], directory, data_dir="data", days=days,
                             force=True)
            _record(result, f"device {device}", reason)
            result.devices[device] = directory


def _write_rollout_file(source: Path, cfg: Any, coordinator_dir: Path, fleet: Fleet, cloud: Endpoint) -> Path:
    """The coordinator's copy of the rollout file, merged with its bundle; checked to load."""
    from fedtier.rollout.config import RolloutConfig

    merged = merged_rollout(source, coordinator_dir, signing_key=fleet.signing_key_path, cloud=cloud,
                            cloud_id=cfg.cloud_id)
    target = coordinator_dir / f"{cfg.rollout}.toml"
    header = (f"# Rollout {cfg.rollout}: {source}, merged with the coordinator's bundle by `fedtier provision fleet`.\n"
              "# Run: fedtier coordinator run --config THIS_FILE\n")
    pki.write_atomic(target, (header + dumps_toml(merged)).encode(), 0o644, overwrite=True)
    load(RolloutConfig, target)  # a file that is written is a file that loads
    return target


def _write_device_data(cfg: Any, result: FleetResult, *, sample_data: bool, split_dir: Path | None) -> None:
    """Each device's ``data/``: a share of the built-in dataset (``--sample-data``) or its own shard (``--shards``)."""
    if sample_data:
        from fleet_data.shards import write_device_data

        result.data = write_device_data(cfg, {d: p / "data" for d, p in result.devices.items()})
    if split_dir is not None:
        from fleet_data.shards import place_shards

        placed = place_shards(split_dir, {d: p / "data" for d, p in result.devices.items()})
        result.shards = split_dir
        result.data = {d: rows for d, (rows, _) in placed.items()}
        result.held_out = {d: held for d, (_, held) in placed.items()}

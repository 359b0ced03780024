"""``fedtier provision``: the fleet's PKI, enrollment bundles and broker configs.

Thin commands over :mod:`provisioning.fleet`, :mod:`provisioning.bundles` and
:mod:`provisioning.broker_config`: each parses its options, calls one library function and
prints what was written — paths, serials and key ids, never key material. Library errors
become click errors naming the option at fault (exit code 2 for usage errors, 1 otherwise).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import click

from fedtier.errors import ConfigError
from provisioning.errors import (BundleExistsError, CsrError, FleetExistsError, FleetNotFoundError,
                                 InvalidNameError, NameConflictError, ProvisioningError, UnknownNodeError)

FLEET_HELP = "The fleet directory (from `fedtier provision init`); or set FEDTIER_FLEET."


def fleet_option(f: Any) -> Any:
    return click.option("--fleet", "fleet_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
                        envvar="FEDTIER_FLEET", show_envvar=True, help=FLEET_HELP)(f)


def _endpoint(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, int] | None:
    from provisioning.bundles import parse_endpoint

    if value is None:
        return None
    try:
        return parse_endpoint(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def broker_option(f: Any) -> Any:
    return click.option("--broker", type=str, required=True, callback=_endpoint, metavar="HOST:PORT",
                        help="The broker this node connects to (port defaults to 8883).")(f)


DAYS = click.option("--days", type=click.FloatRange(min=0, min_open=True), default=None,
                    help="Certificate validity in days (default: 365 for nodes, 825 for brokers).")
FORCE_BUNDLE = click.option("--force", is_flag=True, help="Overwrite files of an existing bundle in --out.")


@contextlib.contextmanager
def _errors(name_hint: str = "NAME", out_hint: str = "--out") -> Iterator[None]:
    """Library errors -> click errors that name the option at fault."""
    try:
        yield
    except FleetExistsError as exc:
        raise click.UsageError(f"{exc}") from None
    except FleetNotFoundError as exc:
        raise click.BadParameter(str(exc), param_hint="--fleet") from None
    except (InvalidNameError, NameConflictError, UnknownNodeError) as exc:
        raise click.BadParameter(str(exc), param_hint=name_hint) from None
    except CsrError as exc:
        raise click.BadParameter(str(exc), param_hint="CSR") from None
    except BundleExistsError as exc:
        raise click.BadParameter(str(exc), param_hint=out_hint) from None
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    except ProvisioningError as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _echo_bundle(bundle: Any) -> None:
    r = bundle.record
    click.echo(f"issued {r.kind} certificate for {r.name}" + (f" (cell {r.cell})" if r.cell else "")
               + f": serial {r.serial_hex}, expires {r.not_after:%Y-%m-%d}")
    click.echo(f"bundle:  {bundle.path}")
    click.echo(f"config:  {bundle.config}")
    click.echo(f"cert:    {bundle.cert}")
    if bundle.key is not None:
        click.echo(f"key:     {bundle.key} (mode 0600; key id {r.key_id})")
    else:
        click.echo(f"key:     none — the device keeps its own key.pem (key id {r.key_id})")
    click.echo(f"trusted manifest keys: {', '.join(bundle.trusted_key_ids)}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def provision() -> None:
    """Fleet PKI: CA, node certificates, enrollment bundles, revocation, broker configs.

    For a whole rollout at once: `provision fleet --rollout rollout.toml --out DIR` (every
    node of its topology, the brokers' configs and a ready rollout file). Node by node: start
    with `provision init --fleet DIR`, then issue a bundle per node (`device`, `gateway`,
    `coordinator`, or `sign` for a device's own CSR), a server certificate per broker
    (`broker`) and its Mosquitto config (`broker-config`). Keep the fleet directory on the
    operator's machine: it holds the CA key and the manifest-signing key.
    """


@provision.command("init", short_help="Create a fleet: CA, manifest-signing key, empty CRL.")
@fleet_option
@click.option("--force", is_flag=True, help="Replace an existing fleet's CA and signing key (invalidates every "
                                            "certificate and every device's trusted key).")
@click.option("--ca-days", type=click.IntRange(min=1), default=3650, show_default=True, help="CA validity in days.")
def init_cmd(fleet_dir: Path, force: bool, ca_days: int) -> None:
    """Create a fleet: CA (ECDSA P-256), manifest-signing key (Ed25519), empty CRL.

    Writes ca.key and signing.key (mode 0600), ca.pem, signing.pub, crl.pem and
    inventory.json in --fleet. Refuses to overwrite an existing fleet without --force.
    """
    from provisioning.fleet import Fleet

    with _errors():
        fleet = Fleet.init(fleet_dir, force=force, ca_days=ca_days)
        kid = fleet.signing_key_id
    click.echo(f"fleet:       {fleet.root}")
    click.echo(f"CA:          {fleet.ca_cert_path} (key {fleet.ca_key_path}, mode 0600)")
    click.echo(f"signing key: {fleet.signing_key_path} (mode 0600), public {fleet.signing_pub_path}, key id {kid}")
    click.echo(f"CRL:         {fleet.crl_path}")


@provision.command("broker", short_help="Issue a broker's TLS server certificate and key.")
@click.argument("name")
@fleet_option
@click.option("--host", "hosts", multiple=True, required=True,
              help="A host name or IP address clients use to reach the broker (repeat for several); "
                   "goes into the certificate's subjectAltName.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for broker.pem, broker.key (mode 0600) and ca.pem.")
@DAYS
@click.option("--force", is_flag=True, help="Overwrite an existing broker.pem/broker.key in --out.")
def broker_cmd(name: str, fleet_dir: Path, hosts: tuple[str, ...], out: Path, days: float | None,
               force: bool) -> None:
    """Issue a broker's TLS server certificate + key (EKU serverAuth, SAN = every --host).

    Then run `provision broker-config --out` on the same directory.
    """
    from provisioning.bundles import issue_broker

    with _errors():
        ident = issue_broker(fleet_dir, name, hosts, out, days=days, force=force)
    click.echo(f"issued broker certificate for {name}: serial {ident.record.serial_hex}, hosts {', '.join(hosts)}, "
               f"expires {ident.record.not_after:%Y-%m-%d}")
    click.echo(f"cert: {ident.cert}\nkey:  {ident.key} (mode 0600)\nCA:   {ident.ca}")


@provision.command("device", short_help="Issue a device's certificate and enrollment bundle.")
@click.argument("name")
@click.option("--cell", required=True, help="The cell the device belongs to.")
@fleet_option
@broker_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The bundle directory to write (copy it to the device).")
@click.option("--data-dir", default="data", show_default=True,
              help="The device's data directory (relative to the bundle, or absolute).")
@DAYS
@FORCE_BUNDLE
def device_cmd(name: str, cell: str, fleet_dir: Path, broker: tuple[str, int], out: Path, data_dir: str,
               days: float | None, force: bool) -> None:
    """Issue a device's key + certificate and write its enrollment bundle (device.toml).

    The bundle holds the device's private key (key.pem, mode 0600): move it to the device
    over a trusted channel. To keep the key on the device instead, use `fedtier agent
    enroll` there and `provision sign` here.
    """
    from provisioning.bundles import issue_device

    with _errors():
        bundle = issue_device(fleet_dir, name, cell, broker, out, data_dir=data_dir, days=days, force=force)
    _echo_bundle(bundle)
    click.echo(f"run on the device: fedtier agent run --bundle {bundle.path}")


@provision.command("gateway", short_help="Issue a cell's edge certificate and bundle.")
@click.argument("cell")
@fleet_option
@broker_option
@click.option("--cloud-broker", type=str, default=None, callback=_endpoint, metavar="HOST:PORT",
              help="The coordinator's broker (default: the same as --broker; such a shared broker needs the "
                   "coordinator's ACL rules too: write its config with `provision fleet`).")
@click.option("--cloud-id", default="cloud", show_default=True, help="The coordinator whose tasks the edge accepts.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The bundle directory to write (copy it to the gateway).")
@DAYS
@FORCE_BUNDLE
def gateway_cmd(cell: str, fleet_dir: Path, broker: tuple[str, int], cloud_broker: tuple[str, int] | None,
                cloud_id: str, out: Path, days: float | None, force: bool) -> None:
    """Issue the edge's key + certificate for CELL (node id = cell id) and its bundle (edge.toml).

    The same certificate authenticates both of the edge's connections: to the cell broker
    (--broker) and to the cloud broker (--cloud-broker).
    """
    from provisioning.bundles import issue_gateway

    with _errors(name_hint="CELL"):
        bundle = issue_gateway(fleet_dir, cell, broker, out, cloud_broker=cloud_broker, cloud_id=cloud_id,
                               days=days, force=force)
    _echo_bundle(bundle)
    click.echo(f"run on the gateway: fedtier edge run --config {bundle.config}")


@provision.command("coordinator", short_help="Issue the coordinator's certificate and config.")
@fleet_option
@broker_option
@click.option("--cloud-id", default="cloud", show_default=True, help="The coordinator's node id (certificate CN).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The bundle directory to write.")
@DAYS
@FORCE_BUNDLE
def coordinator_cmd(fleet_dir: Path, broker: tuple[str, int], cloud_id: str, out: Path, days: float | None,
                    force: bool) -> None:
    """Issue the coordinator's key + certificate and a coordinator.toml fragment.

    coordinator.toml holds cloud_id, signing_key (the absolute path of the fleet's
    signing.key — never copied) and [broker]: merge it into your rollout config.
    """
    from provisioning.bundles import issue_coordinator

    with _errors(name_hint="--cloud-id"):
        bundle = issue_coordinator(fleet_dir, broker, out, cloud_id=cloud_id, days=days, force=force)
    _echo_bundle(bundle)


@provision.command("sign", short_help="Sign a device's CSR (from `fedtier agent enroll`).")
@click.argument("csr", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--cell", required=True, help="The cell the device belongs to.")
@fleet_option
@broker_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The bundle directory to write (no key.pem: unpack it next to the device's key).")
@click.option("--data-dir", default="data", show_default=True,
              help="The device's data directory (relative to the bundle, or absolute).")
@DAYS
@FORCE_BUNDLE
def sign_cmd(csr: Path, cell: str, fleet_dir: Path, broker: tuple[str, int], out: Path, data_dir: str,
             days: float | None, force: bool) -> None:
    """Sign a device's CSR (from `fedtier agent enroll`) and write a bundle without key.pem.

    The CSR's signature is verified and its CN (the device id) must be a valid fedtier id.
    The device's private key never leaves the device.
    """
    from provisioning.bundles import sign_csr

    with _errors(name_hint="CSR"):
        bundle = sign_csr(fleet_dir, csr, cell, broker, out, data_dir=data_dir, days=days, force=force)
    _echo_bundle(bundle)
    click.echo(f"copy {bundle.path} next to the device's key.pem, then: fedtier agent run --bundle DIR")


@provision.command("revoke", short_help="Revoke a node's certificates; rewrite the CRL.")
@click.argument("name")
@fleet_option
@click.option("--serial", default=None, help="Revoke only this certificate (hex serial, see `provision list`).")
@click.option("--kind", type=click.Choice(["device", "gateway", "coordinator", "broker"]), default=None,
              help="Only certificates of this kind (a broker may share a name with its cell).")
def revoke_cmd(name: str, fleet_dir: Path, serial: str | None, kind: str | None) -> None:
    """Revoke NAME's certificates and rewrite the fleet's crl.pem.

    Brokers enforce their copy of the CRL: copy crl.pem to each broker's config directory
    (`provision crl --publish DIR`) and send Mosquitto SIGHUP (or restart it; a restart
    also drops revoked clients that are still connected).
    """
    from provisioning.fleet import Fleet

    try:
        serial_int = int(serial, 16) if serial is not None else None
    except ValueError:
        raise click.BadParameter(f"not a hex serial: {serial!r}", param_hint="--serial") from None
    with _errors():
        fleet = Fleet(fleet_dir)
        revoked = fleet.revoke(name, serial=serial_int, kind=kind)
    if not revoked:
        click.echo(f"{name}: nothing to revoke (already revoked)")
    for r in revoked:
        click.echo(f"revoked {r.kind} {r.name}: serial {r.serial_hex}")
    click.echo(f"CRL: {fleet.crl_path} — copy it to the brokers and SIGHUP Mosquitto")


@provision.command("rotate", short_help="Re-issue a node's key and certificate.")
@click.argument("name")
@fleet_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The new bundle directory (--force to overwrite the old bundle in place).")
@click.option("--revoke-old", is_flag=True, help="Revoke NAME's earlier certificates once the new one is issued.")
@click.option("--csr", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A device's new CSR (keeps its key on the device) instead of a key generated here.")
@click.option("--kind", type=click.Choice(["device", "gateway", "coordinator", "broker"]), default=None,
              help="Disambiguate a broker and a node with the same name.")
@DAYS
@FORCE_BUNDLE
def rotate_cmd(name: str, fleet_dir: Path, out: Path, revoke_old: bool, csr: Path | None, kind: str | None,
               days: float | None, force: bool) -> None:
    """Issue a new key + certificate for NAME with the kind, cell and broker of its last one."""
    from provisioning.bundles import Bundle, rotate

    with _errors():
        result = rotate(fleet_dir, name, out, revoke_old=revoke_old, csr=csr, kind=kind, days=days, force=force)
    if isinstance(result, Bundle):
        _echo_bundle(result)
    else:
        click.echo(f"issued broker certificate for {name}: serial {result.record.serial_hex}")
        click.echo(f"cert: {result.cert}\nkey:  {result.key} (mode 0600)")
    if revoke_old:
        click.echo("earlier certificates revoked; copy crl.pem to the brokers and SIGHUP Mosquitto")


@provision.command("list", short_help="List issued certificates (expiry, revocation).")
@fleet_option
@click.option("--json", "as_json", is_flag=True, help="Print the inventory as JSON.")
@click.option("--expiring-days", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Flag active certificates that expire within this many days.")
def list_cmd(fleet_dir: Path, as_json: bool, expiring_days: float) -> None:
    """List every issued certificate: name, kind, cell, serial, expiry, revoked, expiring soon."""
    from provisioning.fleet import Fleet

    with _errors():
        fleet = Fleet(fleet_dir)
        rows = fleet.listing(expiring_days=expiring_days)
        crl_next = fleet.crl().next_update_utc
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    header = f"{'NAME':<20} {'KIND':<11} {'CELL':<12} {'SERIAL':<41} {'NOT AFTER':<20} STATUS"
    click.echo(header)
    for row in rows:
        status = "revoked" if row["revoked"] else "expired" if row["expired"] else \
            "EXPIRING" if row["expiring"] else "active"
        click.echo(f"{row['name']:<20} {row['kind']:<11} {row['cell'] or '-':<12} {row['serial']:<41} "
                   f"{row['not_after']:<20} {status}")
    if crl_next is not None:
        click.echo(f"CRL valid until {crl_next:%Y-%m-%d} (renew with `fedtier provision crl`)", err=True)


@provision.command("crl", short_help="Re-sign the CRL; optionally copy it to brokers.")
@fleet_option
@click.option("--days", type=click.FloatRange(min=0, min_open=True), default=365.0, show_default=True,
              help="Validity of the new CRL (brokers refuse every client once it expires).")
@click.option("--publish", "broker_dirs", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="Copy the CRL into this broker config directory (repeatable); then SIGHUP Mosquitto.")
def crl_cmd(fleet_dir: Path, days: float, broker_dirs: tuple[Path, ...]) -> None:
    """Re-sign the fleet's CRL with a fresh validity, and optionally copy it to broker directories."""
    from provisioning.broker_config import publish_crl
    from provisioning.fleet import Fleet

    with _errors():
        fleet = Fleet(fleet_dir)
        path = fleet.write_crl(days=days)
        copies = publish_crl(fleet, broker_dirs)
    click.echo(f"CRL: {path} (valid until {fleet.crl().next_update_utc:%Y-%m-%d})")
    for copy in copies:
        click.echo(f"copied to {copy}")


@provision.command("broker-config", short_help="Write a cell broker's Mosquitto config (TLS, ACL).")
@click.option("--cell", required=True, help="The cell whose gateway runs this broker.")
@fleet_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for mosquitto.conf, fedtier.acl, ca.pem and crl.pem (copy it to the gateway).")
@click.option("--port", type=click.IntRange(1, 65535), default=8883, show_default=True, help="TLS listener port.")
@click.option("--bind", default="0.0.0.0", show_default=True, help="TLS listener address.")
@click.option("--cert", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The broker's certificate (default OUT/broker.pem, from `provision broker --out OUT`).")
@click.option("--key", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The broker's private key (default OUT/broker.key).")
@click.option("--run-as", default=None,
              help="User Mosquitto switches to when started as root; the key is copied to OUT and, if "
                   "this runs as root, handed to that user (mode stays 0600).")
@click.option("--members-only", is_flag=True,
              help="Grant device rights only to devices of CELL in the inventory (regenerate + SIGHUP "
                   "after enrolling more), instead of to any fleet device.")
@click.option("--roaming", is_flag=True,
              help="With --members-only: every device of the inventory, whatever its cell, may act in this cell, each "
                   "by name (a rollout with [topology] roaming = true).")
@click.option("--bridge-to", default=None, metavar="HOST:PORT",
              help="Bridge this broker to the cloud broker there (mutual TLS with the gateway's certificate; only "
                   "this cell's edge topics cross); the edge then connects to this broker alone.")
@click.option("--bridge-cert", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The gateway's certificate (its bundle's cert.pem), presented by the bridge.")
@click.option("--bridge-key", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The gateway's private key (its bundle's key.pem).")
@click.option("--cloud-id", default="cloud", show_default=True,
              help="The coordinator's id, whose presence the bridge brings in.")
@click.option("--force", is_flag=True, help="Overwrite an existing mosquitto.conf/fedtier.acl in --out.")
def broker_config_cmd(cell: str, fleet_dir: Path, out: Path, port: int, bind: str, cert: Path | None,
                      key: Path | None, run_as: str | None, members_only: bool, roaming: bool, bridge_to: str | None,
                      bridge_cert: Path | None, bridge_key: Path | None, cloud_id: str, force: bool) -> None:
    """Write a Mosquitto 2.0 config (mutual TLS, CRL, ACL) for the broker of one cell.

    Clients must present a fleet certificate; its CN is the MQTT username and client id.
    Devices may publish only under their own id in this cell and read this cell's downlink;
    the gateway account (user CELL) reads the uplink and writes the downlink. This ACL has no
    rules for the coordinator: for a broker the coordinator uses too, use `provision fleet`.
    With --bridge-to, this broker also carries the edge's cloud side to the cloud broker over a
    Mosquitto bridge; point the edge's [cloud_broker] at this broker (same as [cell_broker]).

    Example: fedtier provision broker-config --cell cell-a --fleet ca --out gw-a

    Example: fedtier provision broker-config --cell cell-a --fleet ca --out gw-a --bridge-to cloud.example:8883
    --bridge-cert gateways/cell-a/cert.pem --bridge-key gateways/cell-a/key.pem
    """
    from provisioning.broker_config import write_cell_broker_config
    from provisioning.bundles import parse_endpoint

    if (cert is None) != (key is None):
        raise click.UsageError("--cert and --key go together")
    if roaming and not members_only:
        raise click.UsageError("--roaming goes with --members-only (without it any fleet device may act in the cell "
                               "already)")
    remote = None
    if bridge_to is not None:
        if bridge_cert is None or bridge_key is None:
            raise click.UsageError("--bridge-to needs --bridge-cert and --bridge-key (the gateway bundle's cert.pem "
                                   "and key.pem: the bridge authenticates as the gateway)")
        try:
            remote = parse_endpoint(bridge_to)
        except ValueError as exc:
            raise click.BadParameter(f"{bridge_to!r}: {exc}", param_hint="--bridge-to") from None
    elif bridge_cert is not None or bridge_key is not None:
        raise click.UsageError("--bridge-cert and --bridge-key go with --bridge-to")
    with _errors(name_hint="--cell"):
        setup = write_cell_broker_config(fleet_dir, cell, out, port=port, bind=bind, cert=cert, key=key,
                                         run_as=run_as, members_only=members_only, roaming=roaming, force=force,
                                         bridge_to=remote, bridge_cert=bridge_cert, bridge_key=bridge_key,
                                         cloud_id=cloud_id)
    click.echo(f"config: {setup.conf}\nACL:    {setup.acl}\nCRL:    {setup.crl}")
    click.echo(f"run:    {' '.join(setup.command())}")
    if run_as is None:
        click.echo("note: started as root, Mosquitto switches to user `mosquitto`, which must be able to read "
                   f"{setup.key} (see --run-as)", err=True)


def _cell_broker(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, tuple[str, int]]:
    from provisioning.bundles import parse_endpoint

    out: dict[str, tuple[str, int]] = {}
    for value in values:
        cell, sep, endpoint = value.partition("=")
        if not sep or not cell:
            raise click.BadParameter(f"expected CELL=HOST:PORT, got {value!r}", ctx=ctx, param=param)
        try:
            out[cell] = parse_endpoint(endpoint)
        except ValueError as exc:
            raise click.BadParameter(f"{value!r}: {exc}", ctx=ctx, param=param) from None
    return out


@provision.command("fleet", short_help="Provision every node of a rollout: bundles, brokers, rollout file.")
@click.option("--rollout", "rollout_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The rollout config: its [topology] names the nodes, its [broker] the coordinator's broker.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Where bundles, broker configs and the coordinator's rollout file go.")
@click.option("--fleet", "fleet_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              envvar="FEDTIER_FLEET", show_envvar=True,
              help="The fleet (CA, signing key) to issue from; created if it holds none. [default: OUT/ca]")
@click.option("--cell-broker", "cell_brokers", multiple=True, callback=_cell_broker, metavar="CELL=HOST:PORT",
              help="CELL's gateway runs its own broker there (repeatable); other cells use the rollout's broker.")
@click.option("--bridge", is_flag=True,
              help="Bridge each --cell-broker to the rollout's broker (TLS with the gateway's certificate, only "
                   "that cell's edge topics); its edge then connects to its gateway's broker alone.")
@click.option("--broker-user", default=None,
              help="The user Mosquitto switches to when started as root. [default: the user running this]")
@click.option("--sample-data", is_flag=True,
              help="Write each device's share of the rollout's built-in dataset into its bundle's data/ "
                   "(for a trial; real devices bring their own data).")
@click.option("--shards", "shards", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="The --out of `fedtier data split`: each device's bundle gets the shard of its own name as its "
                   "data/ (replacing what was there). Every device needs a shard and every shard a device; names "
                   "are matched exactly (dev-00, dev-01, ... as the split names them), never guessed.")
@DAYS
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON (also in OUT/fleet.json).")
def fleet_cmd(rollout_path: Path, out: Path, fleet_dir: Path | None, cell_brokers: dict[str, tuple[str, int]],
              bridge: bool, broker_user: str | None, sample_data: bool, shards: Path | None, days: float | None,
              as_json: bool) -> None:
    """Provision every node a rollout's topology names, in one step.

    Writes a bundle per device, gateway and the coordinator, a Mosquitto config per broker
    (mutual TLS, CRL, an ACL that grants each node its own topics and binds the client id to
    the certificate), and OUT/coordinator/<rollout>.toml: the rollout config merged with the
    coordinator's bundle, ready to run. One shared broker by default, at the rollout's
    [broker]; --cell-broker for gateways with their own, --bridge to bridge those to the
    cloud's broker. Running it again keeps the CA and every identity that still holds (a
    second rollout of the same fleet issues nothing).

    Example: fedtier provision fleet --rollout rollout.toml --out fleet --sample-data

    Example: fedtier data split --input data.csv --devices 3 --out shards, then
    fedtier provision fleet --rollout rollout.toml --out fleet --shards shards

    Example: fedtier provision fleet --rollout rollout.toml --out fleet --cell-broker cell-a=gw-a:8883 --bridge
    """
    from provisioning.rollout import provision_fleet

    with _errors(name_hint="--rollout"):
        result = provision_fleet(rollout_path, out, fleet_dir=fleet_dir, cell_brokers=cell_brokers,
                                 run_as=broker_user, sample_data=sample_data, days=days, bridge=bridge,
                                 shards=shards)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=1))
        return
    click.echo(f"rollout {result.rollout}: {len(result.devices)} devices in {len(result.gateways)} cells, "
               f"{len(result.brokers)} broker(s); issued {len(result.issued)}, kept {len(result.kept)} "
               f"(fleet {result.fleet})")
    for label in result.issued:
        reason = result.reasons.get(label, "")
        verb = "issued" if reason.startswith("new") else "reissued (a new key and certificate; install this bundle)"
        click.echo(f"  {verb} {label}: {reason}")
    click.echo("\nrun, each on its box (paths as written here; copy each directory to the same path there):")
    for name, broker in result.brokers.items():
        click.echo(f"  broker {name} ({broker['host']}:{broker['port']}; {broker['serves']}):")
        click.echo(f"      mosquitto -c {broker['conf']}")
    click.echo(f"  coordinator:  fedtier coordinator run --config {result.rollout_config}")
    for cell, path in result.gateways.items():
        click.echo(f"  gateway {cell}:  fedtier edge run --config {path / 'edge.toml'}")
    for device, path in result.devices.items():
        click.echo(f"  device {device}:  fedtier agent run --bundle {path}")
    if result.shards is not None:
        click.echo(f"\nshards of {result.shards}, each in the bundle of its device (data/):")
        for device, rows in result.data.items():
            click.echo(f"  {device}: {rows} training rows, {result.held_out.get(device, 0)} held out for federated "
                       f"evaluation -> {result.devices[device] / 'data'}")
    elif result.data:
        click.echo(f"\nsample data: {sum(result.data.values())} samples over {len(result.data)} devices "
                   "(each bundle's data/train.npz)")
    else:
        click.echo("\neach device reads its training data from its bundle's data/ directory (.npz with x, y; or .csv)")
    if result.departed:
        click.echo(f"\nnot in this topology but holding active certificates: {', '.join(result.departed)} "
                   "(fedtier provision revoke NAME to cut them off)")
    click.echo(f"\nMosquitto started as root switches to user {result.run_as!r} (--broker-user), which must be able "
               "to read its broker.key (mode 0600) and reach its directory; on another host, give the key to that "
               "user there (chown USER broker.key).", err=True)

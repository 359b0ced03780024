"""Mosquitto 2.0 configurations (mutual TLS + ACL) that fit fedtier's topic tree.

One ACL writer, ``broker_acl``, for every shape of broker, given who connects to it:

* the broker on one cell's gateway (``write_cell_broker_config``, ``cell_acl``): its devices and
  the edge's cell side;
* one broker for every cell *and* the cloud (``combined_broker_config``, ``combined_acl``; what
  ``fedtier demo --secure`` runs and what ``fedtier provision fleet`` writes for a shared
  broker): devices, every edge (both sides, over one connection) and the coordinator;
* the cloud's broker when gateways run their own (``fedtier provision fleet --cell-broker``):
  the coordinator and every edge's cloud side.

Authentication is the client certificate alone: ``require_certificate true`` and
``use_identity_as_username true`` make the certificate's CN (= node id) the MQTT username,
and ``allow_anonymous false`` refuses anything else. ``use_username_as_clientid true`` then
replaces whatever client id a client asks for with that username, so a device's certificate
cannot connect under another node's id (it would take over that node's session); two clients
with the *same* certificate (a copied bundle) keep disconnecting each other, which their logs
report (verified with 2.0.11: a device connecting as ``d1`` with ``d0``'s certificate becomes
``d0``, and ``d1`` stays connected). A node therefore opens one connection per broker: an
edge whose cell and cloud brokers are the same broker uses one connection for both sides.
The CRL (``crlfile``) is checked for every client certificate; Mosquitto 2.0.11 re-reads it
on SIGHUP (verified), and refuses *every* client once its nextUpdate has passed (verified) —
refresh it with ``fedtier provision crl``.

Authorisation is the ACL file, keyed by username (``%u``: the CN, vouched for by the CA).
Rules, checked against :mod:`fedtier.transport.topics`:

=============  ========================================================================
who            may
=============  ========================================================================
every client   write and read ``ft/v1/status/<own id>`` (presence and last will; reading
               its own presence tells a node that another client uses its identity)
device         write ``ft/v1/+/cell/<cell>/up/<own id>/#``; read ``ft/v1/+/cell/<cell>/down/#``;
               write and read ``ft/v1/status/<cell>/<own id>`` (its presence, in its cell)
gateway        cell side: read ``ft/v1/+/cell/<cell>/up/#`` and ``ft/v1/status/<cell>/+`` (its
(user <cell>)  devices' presence, no other cell's); write ``ft/v1/+/cell/<cell>/down/#``. Cloud
               side: read ``ft/v1/+/manifest``, ``ft/v1/+/cloud/down/<cell>/#``, ``ft/v1/status/+``
               (edges' and the coordinator's presence); write ``ft/v1/+/edge/<cell>/up/#``
               (its cell updates and its presence summary, ``cell_presence``), ``ft/v1/status/<cell>``
coordinator    write ``ft/v1/+/manifest``, ``ft/v1/+/cloud/down/#``, ``ft/v1/status/<id>``;
(user <id>)    read ``ft/v1/+/edge/+/up/#``, ``ft/v1/status/#``
=============  ========================================================================

ACL pitfalls this module avoids (verified with Mosquitto 2.0.11): ``topic`` lines *before*
any ``user`` line apply only to anonymous clients, so rules for everyone are ``pattern``
lines; and ``pattern`` lines apply to the ``user`` accounts too (harmless here: a gateway
could only publish as a device named like itself in its own cell, which it may anyway).

On a per-cell broker the device rules are patterns by default: any fleet device that
reaches this gateway may join the cell (Mosquitto warns at start-up that the downlink
pattern has no ``%u``; that is expected). With ``devices`` given (``--members-only``, and
always on a broker that serves several cells, where a pattern cannot tell cells apart), each
device gets its own ``user`` block for its own cell only: regenerate and SIGHUP after
enrolling devices.

A rollout with ``[topology] roaming = true`` lets its devices contribute through any of its cells:
``broker_acl(..., roaming=True)`` (what ``fedtier provision fleet`` writes for such a rollout) gives
every device of ``devices`` its ``user`` block in each cell the broker serves, not in its own cell
alone; on a gateway's broker with patterns (the default) any fleet device may act in the cell already.

Known limit of Mosquitto's ``acl_file`` (2.0.11, verified; the source marks it "FIXME"):
SUBSCRIBE is never checked: a device may subscribe to another cell's downlink and gets
SUBACK "Granted", but the read rule is applied to every message at delivery, retained ones
included, so nothing is delivered. Only a plugin (e.g. dynamic security) can refuse the
subscription itself.

``persistence false``: sessions and queued QoS 1 messages live in the broker's memory only.
fedtier nodes keep their own outboxes and re-subscribe on every connect, so a broker
restart loses in-flight copies, not data. To keep broker queues across restarts set
``persistence true`` with a ``persistence_location`` writable by the ``user`` below.

Privileges: started as root, Mosquitto switches to ``user`` (default ``mosquitto``) before
loading the TLS key, so a 0600 root-owned key makes it exit with "Unable to load server key
file" (verified with 2.0.11). Either write ``user root`` (works, with a warning; what the
combined/demo config does when run as root: it uses the current user), or give ``run_as``
for a dedicated user: the key is copied into the config directory and, when generating as
root, chowned to that user (still mode 0600; verified that Mosquitto then starts).
"""

from __future__ import annotations

import datetime as dt
import getpass
import logging
import os
import pwd
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from fedtier.errors import ConfigError
from fedtier.security import pki
from fedtier.transport import topics
from provisioning import ca
from provisioning.broker_bridge import Bridge, check_bridge_identity, mosquitto_bridge
from provisioning.broker_limits import limits_for, mosquitto_global_limits, mosquitto_listener_limits
from provisioning.bundles import issue_broker
from provisioning.errors import BundleExistsError, NameConflictError, ProvisioningError
from provisioning.fleet import Fleet, open_fleet

log = logging.getLogger("fedtier.provisioning")

P = topics.PREFIX
Rule = tuple[str, str]
"""``(access, topic filter)``; access is ``read`` or ``write``."""


# --- the rules (data; rendered below) --------------------------------------------------------------


def every_client_patterns() -> list[Rule]:
    """``pattern`` rules for every authenticated client: its own presence topic (write and read)."""
    return [("write", f"{P}/status/%u"), ("read", f"{P}/status/%u")]


def device_patterns(cell: str) -> list[Rule]:
    """``pattern`` rules letting any client act as a device of ``cell`` under its own id."""
    ca.check_node_name(cell, "cell")
    return [("write", f"{P}/+/cell/{cell}/up/%u/#"), ("read", f"{P}/+/cell/{cell}/down/#"),
            ("write", f"{P}/status/{cell}/%u"), ("read", f"{P}/status/{cell}/%u")]


def device_rules(device: str, cell: str) -> list[Rule]:
    """``topic`` rules for one device bound to its cell (under ``user <device>``)."""
    ca.check_node_name(device, "device")
    ca.check_node_name(cell, "cell")
    return [("write", f"{P}/+/cell/{cell}/up/{device}/#"), ("read", f"{P}/+/cell/{cell}/down/#"),
            ("write", f"{P}/status/{cell}/{device}"), ("read", f"{P}/status/{cell}/{device}")]


def gateway_cell_rules(cell: str) -> list[Rule]:
    """The edge of ``cell`` on its cell broker: devices' uplink in, downlink out, its devices' presence in."""
    ca.check_node_name(cell, "cell")
    return [("read", f"{P}/+/cell/{cell}/up/#"), ("write", f"{P}/+/cell/{cell}/down/#"),
            ("read", f"{P}/status/{cell}/+")]


def gateway_cloud_rules(cell: str) -> list[Rule]:
    """The edge of ``cell`` on the cloud broker: manifests and its tasks in, its uplink out; the presence
    of edges and of the coordinator (one level: no device's)."""
    ca.check_node_name(cell, "cell")
    return [("read", f"{P}/+/manifest"), ("read", f"{P}/+/cloud/down/{cell}/#"),
            ("write", f"{P}/+/edge/{cell}/up/#"), ("write", f"{P}/status/{cell}"), ("read", f"{P}/status/+")]


def coordinator_rules(cloud_id: str) -> list[Rule]:
    """The coordinator on the cloud broker: manifests and tasks out, every edge's uplink in."""
    ca.check_node_name(cloud_id, "cloud id")
    return [("write", f"{P}/+/manifest"), ("write", f"{P}/+/cloud/down/#"), ("read", f"{P}/+/edge/+/up/#"),
            ("read", f"{P}/status/#"), ("write", f"{P}/status/{cloud_id}")]


def _render(header: str, patterns: list[Rule], users: list[tuple[str, list[Rule]]]) -> str:
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines.append("")
    lines.append("# Every client (pattern lines apply to all users; %u = certificate CN).")
    lines.extend(f"pattern {access} {topic}" for access, topic in patterns)
    for user, rules in users:
        lines.append("")
        lines.append(f"user {user}")
        lines.extend(f"topic {access} {topic}" for access, topic in rules)
    return "\n".join(lines) + "\n"


def _check_devices(devices: Mapping[str, str], reserved: Mapping[str, str]) -> None:
    for device, cell in devices.items():
        ca.check_node_name(device, "device")
        ca.check_node_name(cell, "cell")
        if device in reserved:
            raise NameConflictError(f"device {device!r} has the name of {reserved[device]}: "
                                    "it would get that account's ACL rights")


def broker_acl(*, cell_side: Sequence[str] = (), cloud_side: Sequence[str] = (), cloud_id: str | None = None,
               devices: Mapping[str, str] | None = None, header: str = "", roaming: bool = False) -> str:
    """The ACL of one broker, from who connects to it: the one ACL writer of every broker shape.

    Args:
        cell_side: cells whose devices and edge (its cell side) use this broker.
        cloud_side: cells whose edge uses this broker towards the coordinator.
        cloud_id: the coordinator's id, if the coordinator connects here.
        devices: device id -> cell; each device of a ``cell_side`` cell gets its own ``user``
            block for its own cell. ``None``: a ``pattern`` lets any fleet device act in the
            cell — only possible when the broker serves one cell.
        header: comment lines at the top of the file.
        roaming: every device of ``devices`` may act in every ``cell_side`` cell (a rollout whose devices
            contribute through any of its cells), not in its own alone.

    Returns:
        The ACL file text.

    Raises:
        NameConflictError: two roles share a name (a device named like a cell or the
            coordinator, or the coordinator named like a cell).
        ValueError: no one connects, or device patterns for several cells.
    """
    cell_side, cloud_side = list(dict.fromkeys(cell_side)), list(dict.fromkeys(cloud_side))
    for cell in (*cell_side, *cloud_side):
        ca.check_node_name(cell, "cell")
    if not (cell_side or cloud_side or cloud_id):
        raise ValueError("a broker ACL for no one")
    reserved = {c: f"the gateway of cell {c}" for c in (*cell_side, *cloud_side)}
    if cloud_id is not None:
        ca.check_node_name(cloud_id, "cloud id")
        if cloud_id in reserved:
            raise NameConflictError(f"the coordinator {cloud_id!r} cannot share its name with a cell")
        reserved[cloud_id] = "the coordinator"
    patterns = every_client_patterns()
    users: list[tuple[str, list[Rule]]] = []
    if cloud_id is not None:
        users.append((cloud_id, coordinator_rules(cloud_id)))
    for cell in dict.fromkeys([*cell_side, *cloud_side]):
        rules = gateway_cell_rules(cell) if cell in cell_side else []
        users.append((cell, rules + (gateway_cloud_rules(cell) if cell in cloud_side else [])))
    if devices is None:
        if len(cell_side) > 1:
            raise ValueError("a broker of several cells binds each device to its cell: give `devices`")
        patterns += [r for cell in cell_side for r in device_patterns(cell)]
    else:
        members = dict(devices) if roaming and cell_side else {d: c for d, c in devices.items() if c in cell_side}
        _check_devices(members, reserved)
        cells_of = {d: cell_side if roaming else [c] for d, c in members.items()}
        users += [(d, [r for c in cells_of[d] for r in device_rules(d, c)]) for d in sorted(members)]
    return _render(header or "fedtier ACL (generated by fedtier provisioning).", patterns, users)


_ACL_FOOTER = ("Clients authenticate with fleet certificates; the CN is the username (and the client id).\n"
               "Anything not granted here is denied. Mosquitto re-reads this file on SIGHUP.")


def cell_acl(cell: str, *, devices: Mapping[str, str] | None = None, roaming: bool = False) -> str:
    """The ACL of one cell's broker.

    Args:
        cell: the cell id (= the gateway's username).
        devices: device id -> cell; if given, only these devices of ``cell`` get device rights
            (one ``user`` block each). ``None``: any fleet device may act in this cell.
        roaming: every device of ``devices`` may act in this cell, whatever cell it is enrolled in (a rollout with
            ``[topology] roaming``).

    Returns:
        The ACL file text.

    Raises:
        NameConflictError: a device is named like the cell.
    """
    ca.check_node_name(cell, "cell")
    header = f"fedtier ACL for the broker of cell {cell} (generated by `fedtier provision`).\n" + _ACL_FOOTER
    return broker_acl(cell_side=[cell], devices=devices, header=header, roaming=roaming)


def combined_acl(cells: Sequence[str], cloud_id: str, devices: Mapping[str, str]) -> str:
    """The ACL of one broker serving every cell and the cloud.

    Args:
        cells: the cell ids (each one a gateway username, with cell- and cloud-side rights).
        cloud_id: the coordinator's username.
        devices: device id -> cell; each device is bound to its own cell. Devices of cells
            not in ``cells`` are left out.

    Returns:
        The ACL file text.

    Raises:
        NameConflictError: two roles share a name (a device named like a cell or the
            coordinator, or the coordinator named like a cell).
    """
    header = ("fedtier ACL for a shared broker: every cell and the cloud on one Mosquitto\n"
              "(generated by `fedtier provision fleet` / `fedtier demo --secure`).\n" + _ACL_FOOTER)
    return broker_acl(cell_side=cells, cloud_side=cells, cloud_id=cloud_id, devices=devices, header=header)


# --- mosquitto.conf ----------------------------------------------------------------------------------


def mosquitto_conf(*, port: int, bind: str, cafile: Path, certfile: Path, keyfile: Path, crlfile: Path,
                   acl_file: Path, run_as: str | None = None, max_packet_size: int | None = None,
                   bridge: Bridge | None = None) -> str:
    """A Mosquitto 2.0 configuration with one mutual-TLS listener.

    Args:
        port, bind: the listener.
        cafile: the fleet CA (verifies client certificates).
        certfile, keyfile: the broker's server certificate and key.
        crlfile: the fleet CRL.
        acl_file: the ACL (``cell_acl``/``combined_acl``).
        run_as: the ``user`` Mosquitto switches to when started as root (see module docstring);
            ``None`` leaves Mosquitto's default (``mosquitto``).
        max_packet_size: the broker's packet limit (fedtier reads it from CONNACK); ``None``:
            the default of ``provisioning.broker_limits`` (1 MiB), with the other limits there.
        bridge: a bridge from this (gateway) broker to the cloud broker
            (``provisioning.broker_bridge``), or ``None``.

    Returns:
        The configuration text (absolute paths: Mosquitto resolves relative ones against
        its working directory, not the config's).
    """
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be 1..65535, got {port}")
    user = ("# Started as root, Mosquitto switches to this user before reading the key files.\n"
            f"user {run_as}\n") if run_as else (
            "# No `user`: started as root, Mosquitto switches to `mosquitto`, which must be able to\n"
            "# read keyfile (see --run-as).\n")
    limits = limits_for(max_packet_size)
    limit = "\n".join(mosquitto_global_limits(limits)) + "\n"
    listener_limit = "\n".join(mosquitto_listener_limits(limits)) + "\n"
    return f"""# fedtier Mosquitto configuration (generated by fedtier provisioning; Mosquitto 2.0).
per_listener_settings false
# Only clients with a certificate from the fleet CA get in; the CN is their username and client id.
allow_anonymous false
# Sessions and queued messages live in memory only: fedtier nodes keep their own outboxes
# and re-subscribe on connect. Set true (+ persistence_location) to keep queues over restarts.
persistence false
log_dest stdout
{user}acl_file {acl_file}
{limit}
listener {port} {bind}
{listener_limit}cafile {cafile}
certfile {certfile}
keyfile {keyfile}
# Revoked certificates. Reloaded on SIGHUP; an expired CRL locks every client out.
crlfile {crlfile}
require_certificate true
use_identity_as_username true
# The client id is the certificate's name too: no certificate can take over another node's session.
use_username_as_clientid true
# Minimum version (TLS 1.2 and 1.3 are accepted).
tls_version tlsv1.2
""" + (mosquitto_bridge(bridge) if bridge is not None else "")


@dataclass(frozen=True)
class BrokerSetup:
    """A written broker configuration.

    Attributes:
        directory: where the files are.
        conf: ``mosquitto.conf``.
        acl: ``fedtier.acl``.
        port, bind: the TLS listener.
        ca, cert, key, crl: the files ``conf`` points at.
        run_as: the ``user`` line (``None``: Mosquitto's default).
        devices: device -> cell granted by per-device ``user`` blocks (``None``: patterns).
    """

    directory: Path
    conf: Path
    acl: Path
    port: int
    bind: str
    ca: Path
    cert: Path
    key: Path
    crl: Path
    run_as: str | None
    devices: dict[str, str] | None

    def command(self, binary: str = "mosquitto") -> list[str]:
        """The command line that runs this broker in the foreground."""
        return [binary, "-c", str(self.conf)]


def current_user() -> str:
    """The name of the effective user (what the combined config writes as ``user``)."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # pragma: no cover - a uid without a passwd entry
        return getpass.getuser()


def _check_server_identity(fleet: Fleet, cert_path: Path, key_path: Path, hosts: Sequence[str] = ()) -> str | None:
    """Why ``cert_path``/``key_path`` are not a usable broker identity of this fleet, or ``None``."""
    try:
        cert = pki.load_certificate(cert_path)
        key = pki.load_private_key(key_path)
    except ConfigError as exc:
        return str(exc)
    if not ca.verify_issued_by(cert, fleet.ca_cert):
        return f"{cert_path} was not issued by the fleet CA {fleet.ca_cert_path}"
    if not pki.same_public_key(key.public_key(), cert.public_key()):  # type: ignore[arg-type]
        return f"{key_path} does not belong to {cert_path}"
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return f"{cert_path} has no extended key usage"
    if ExtendedKeyUsageOID.SERVER_AUTH not in eku:
        return f"{cert_path} is not a server certificate (EKU serverAuth)"
    if cert.not_valid_after_utc - ca.utcnow() < dt.timedelta(days=1):
        return f"{cert_path} expires within a day"
    if hosts:
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return f"{cert_path} has no subjectAltName"
        have = set(san.get_values_for_type(x509.DNSName)) | {str(a) for a in san.get_values_for_type(x509.IPAddress)}
        missing = [h for h in hosts if h not in have]
        if missing:
            return f"{cert_path} does not cover {', '.join(missing)}"
    return None


def _user(run_as: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(run_as)
    except KeyError:
        raise ProvisioningError(f"no such user {run_as!r} (for Mosquitto's `user`)") from None


def _prepare_key_for(run_as: str | None, key_src: Path, out: Path, name: str = "broker.key") -> Path:
    """The key path the config should use, readable by ``run_as`` (see module docstring)."""
    if run_as is None or run_as == current_user():
        return key_src
    entry = _user(run_as)
    target = out / name
    if key_src.resolve() != target.resolve():
        pki.write_atomic(target, key_src.read_bytes(), pki.PRIVATE_MODE, overwrite=True)
    if os.geteuid() == 0:
        # Only the owner changes; the file is 0600 from creation, so no one else can read it.
        os.chown(target, entry.pw_uid, entry.pw_gid)
        for parent in target.parents:
            st = parent.stat()
            if not st.st_mode & stat.S_IXOTH and st.st_uid != entry.pw_uid:
                log.warning("%s is not searchable by %s: Mosquitto will not reach %s", parent, run_as, target)
                break
    else:
        log.warning("not root: cannot hand %s to %s; make sure %s can read it", target, run_as, run_as)
    return target


def write_cell_broker_config(fleet: Fleet | str | Path, cell: str, out: str | Path, *, port: int = 8883,
                             bind: str = "0.0.0.0", cert: str | Path | None = None, key: str | Path | None = None,
                             run_as: str | None = None, members_only: bool = False, roaming: bool = False,
                             max_packet_size: int | None = None, force: bool = False,
                             bridge_to: tuple[str, int] | None = None, bridge_cert: str | Path | None = None,
                             bridge_key: str | Path | None = None, cloud_id: str = "cloud") -> BrokerSetup:
    """Write ``mosquitto.conf`` + ``fedtier.acl`` (+ ca.pem, crl.pem) for the broker of ``cell``.

    Args:
        fleet: the fleet (or its directory).
        cell: the cell id.
        out: the output directory (what gets copied to the gateway).
        port, bind: the TLS listener.
        cert, key: the broker's server certificate and key (default ``out/broker.pem`` and
            ``out/broker.key``, as written by ``provision broker ... --out``).
        run_as: Mosquitto's ``user``; the key is copied into ``out`` and, when run as root,
            chowned to that user.
        members_only: bind devices to this cell by name (only devices of ``cell`` in the
            inventory get rights) instead of letting any fleet device act in the cell.
        roaming: with ``members_only``, every device of the inventory gets rights in this cell, each by name (a
            rollout with ``[topology] roaming``, whose devices contribute through any of its cells).
        max_packet_size: optional broker packet limit.
        force: overwrite an existing ``mosquitto.conf``/``fedtier.acl``.
        bridge_to: the cloud broker ``(host, port)`` to bridge this broker to
            (``provisioning.broker_bridge``); the gateway account then gets both the cell and
            the cloud side here, and the edge connects to this broker alone.
        bridge_cert, bridge_key: the gateway's client certificate and key, which the bridge
            presents to the cloud broker (required with ``bridge_to``).
        cloud_id: the coordinator's id (its presence is bridged in).

    Returns:
        The written setup.

    Raises:
        BundleExistsError: the config exists and ``force`` is false.
        ProvisioningError: the broker certificate/key are missing, not from this fleet, not a
            server certificate, or do not match; ``run_as`` is not a user; or the bridge's
            certificate is not the gateway's.
    """
    fleet = open_fleet(fleet)
    ca.check_node_name(cell, "cell id")
    out = Path(out).expanduser().resolve()
    conf, acl = out / "mosquitto.conf", out / "fedtier.acl"
    if not force and (conf.exists() or acl.exists()):
        raise BundleExistsError(f"{out} already has a broker config; refusing to overwrite (use --force)")
    cert_path = Path(cert).expanduser().resolve() if cert else out / "broker.pem"
    key_path = Path(key).expanduser().resolve() if key else out / "broker.key"
    if not cert_path.is_file() or not key_path.is_file():
        raise ProvisioningError(f"no broker certificate/key at {cert_path} / {key_path}: issue them with "
                                f"`fedtier provision broker NAME --fleet {fleet.root} --host HOST --out {out}`")
    problem = _check_server_identity(fleet, cert_path, key_path)
    if problem:
        raise ProvisioningError(problem)
    if run_as is not None:
        _user(run_as)
    bridge_identity: tuple[Path, Path] | None = None
    if bridge_to is not None:
        if bridge_cert is None or bridge_key is None:
            raise ProvisioningError("a bridge authenticates as the gateway: give its certificate and key "
                                    "(--bridge-cert GATEWAY/cert.pem --bridge-key GATEWAY/key.pem)")
        bridge_identity = (Path(bridge_cert).expanduser().resolve(), Path(bridge_key).expanduser().resolve())
        problem = check_bridge_identity(fleet, cell, *bridge_identity)
        if problem:
            raise ProvisioningError(problem)
    out.mkdir(parents=True, exist_ok=True)
    ca_copy, crl_copy = out / "ca.pem", out / "crl.pem"
    if ca_copy.resolve() != fleet.ca_cert_path:
        shutil.copyfile(fleet.ca_cert_path, ca_copy)
    shutil.copyfile(fleet.crl_path, crl_copy)
    key_used = _prepare_key_for(run_as, key_path, out)
    devices = fleet.active_devices(None if roaming else [cell]) if members_only else None
    bridge = None
    if bridge_to is not None and bridge_identity is not None:
        bridge = Bridge(cell=cell, remote=bridge_to, cafile=ca_copy, certfile=bridge_identity[0],
                        keyfile=_prepare_key_for(run_as, bridge_identity[1], out, "bridge.key"), cloud_id=cloud_id)
        header = (f"fedtier ACL for the broker of cell {cell}, bridged to the cloud broker {bridge_to[0]}:"
                  f"{bridge_to[1]} (generated by `fedtier provision`).\n" + _ACL_FOOTER)
        acl_text = broker_acl(cell_side=[cell], cloud_side=[cell], devices=devices, header=header, roaming=roaming)
    else:
        acl_text = cell_acl(cell, devices=devices, roaming=roaming)
    pki.write_atomic(acl, acl_text.encode(), 0o644, overwrite=True)
    text = mosquitto_conf(port=port, bind=bind, cafile=ca_copy, certfile=cert_path, keyfile=key_used,
                          crlfile=crl_copy, acl_file=acl, run_as=run_as, max_packet_size=max_packet_size,
                          bridge=bridge)
    pki.write_atomic(conf, text.encode(), 0o644, overwrite=True)
    log.info("wrote broker config for cell %s in %s", cell, out)
    return BrokerSetup(directory=out, conf=conf, acl=acl, port=port, bind=bind, ca=ca_copy, cert=cert_path,
                       key=key_used, crl=crl_copy, run_as=run_as, devices=devices)


def combined_broker_config(cells: Sequence[str], cloud_id: str, *, fleet: Fleet | str | Path, out: str | Path,
                           port: int = 8883, bind: str = "127.0.0.1",
                           hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                           devices: Mapping[str, str] | None = None, run_as: str | None = None,
                           broker_name: str = "combined-broker",
                           max_packet_size: int | None = None) -> BrokerSetup:
    """One Mosquitto for every cell and the cloud, with mutual TLS and a per-role ACL.

    The broker runs next to the fleet directory (the demo), so it reads the fleet's live
    ``ca.pem`` and ``crl.pem``: after ``Fleet.revoke`` a SIGHUP is enough. The server
    certificate in ``out`` is reused while it is valid for ``hosts``, else a new one is issued.

    Args:
        cells: the cell ids (gateway usernames).
        cloud_id: the coordinator's id (its username).
        fleet: the fleet (or its directory).
        out: where ``mosquitto.conf``, ``fedtier.acl``, ``broker.pem`` and ``broker.key`` go.
        port, bind: the TLS listener.
        hosts: names/addresses clients dial (the server certificate's SAN).
        devices: device id -> cell to grant (default: every active device of ``cells`` in the
            fleet inventory). Each device may act only in its own cell.
        run_as: Mosquitto's ``user`` (default the current user, so a root-run demo can read
            its 0600 key; other users are handled as in ``write_cell_broker_config``).
        broker_name: CN of the server certificate if one is issued.
        max_packet_size: optional broker packet limit.

    Returns:
        The written setup (``setup.command(binary)`` runs it).

    Raises:
        NameConflictError: a device, a cell and the coordinator share a name.
        InvalidNameError: a bad id.
    """
    fleet = open_fleet(fleet)
    for cell in cells:
        ca.check_node_name(cell, "cell id")
    ca.check_node_name(cloud_id, "cloud id")
    if run_as is not None:
        _user(run_as)
    out = Path(out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    granted = dict(devices) if devices is not None else fleet.active_devices(list(cells))
    acl_text = combined_acl(list(cells), cloud_id, granted)  # checks names before anything is issued
    cert_path, key_path = out / "broker.pem", out / "broker.key"
    problem = (_check_server_identity(fleet, cert_path, key_path, hosts)
               if cert_path.exists() and key_path.exists() else "missing")
    if problem:
        if problem != "missing":
            log.info("issuing a new broker certificate: %s", problem)
        issue_broker(fleet, broker_name, hosts, out, force=True)
    run_as = run_as or current_user()
    key_used = _prepare_key_for(run_as, key_path, out)
    acl = out / "fedtier.acl"
    pki.write_atomic(acl, acl_text.encode(), 0o644, overwrite=True)
    conf = out / "mosquitto.conf"
    text = mosquitto_conf(port=port, bind=bind, cafile=fleet.ca_cert_path, certfile=cert_path, keyfile=key_used,
                          crlfile=fleet.crl_path, acl_file=acl, run_as=run_as, max_packet_size=max_packet_size)
    pki.write_atomic(conf, text.encode(), 0o644, overwrite=True)
    members = {d: c for d, c in granted.items() if c in cells}
    log.info("wrote combined broker config in %s (%d cells, %d devices)", out, len(cells), len(members))
    return BrokerSetup(directory=out, conf=conf, acl=acl, port=port, bind=bind, ca=fleet.ca_cert_path,
                       cert=cert_path, key=key_used, crl=fleet.crl_path, run_as=run_as, devices=members)


def publish_crl(fleet: Fleet | str | Path, broker_dirs: Sequence[str | Path]) -> list[Path]:
    """Copy the fleet's ``crl.pem`` into broker config directories (then SIGHUP each Mosquitto).

    Returns:
        The written copies.
    """
    fleet = open_fleet(fleet)
    written = []
    for directory in broker_dirs:
        target = Path(directory).expanduser().resolve() / "crl.pem"
        if target != fleet.crl_path:
            pki.write_atomic(target, fleet.crl_path.read_bytes(), 0o644, overwrite=True)
        written.append(target)
    return written

"""Enrollment bundles: everything one node needs to join the fleet, in one self-contained directory.

Layout (all paths in the config are relative to the bundle, so it works wherever it is
copied)::

    BUNDLE/
      cert.pem                    the node's certificate (CN = node id, EKU clientAuth)
      key.pem                     its private key, mode 0600 — absent in the CSR flow, where
                                  the key was made on the device and never left it
      ca.pem                      the fleet CA (verifies the broker; the broker verifies us)
      trusted_keys/<key_id>.pub   manifest-signing public key(s) the node accepts
      device.toml | edge.toml | coordinator.toml
      README.txt                  what this is and how to run it (no secrets)

* ``device.toml`` loads with ``device_agent.config.DeviceConfig`` (``fedtier agent run --bundle BUNDLE``);
* ``edge.toml`` loads with ``edge_broker.config.EdgeConfig`` (``fedtier edge run --config BUNDLE/edge.toml``);
* ``coordinator.toml`` loads with ``fedtier.rollout.config.RolloutConfig``; it is a
  *fragment* (``cloud_id``, ``signing_key``, ``[broker]``) to merge into the operator's
  rollout config. ``signing_key`` is the absolute path of the fleet's ``signing.key``:
  the signing key is never copied into a bundle.

Every config is validated by loading it back with its real config class before the
function returns, so a bundle that is written is a bundle that loads.

Transport security of a bundle is the operator's job: it contains a private key (except in
the CSR flow). Move it over an authenticated channel and delete the operator's copy.
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from cryptography import x509

from fedtier.errors import ConfigError
from fedtier.runtime.config import BrokerConfig, dumps_toml, load
from fedtier.security import pki
from provisioning import ca
from provisioning.errors import BundleExistsError, CsrError
from provisioning.fleet import CertRecord, Fleet, open_fleet

log = logging.getLogger("fedtier.provisioning")

CONFIG_NAMES = {"device": "device.toml", "gateway": "edge.toml", "coordinator": "coordinator.toml"}
"""The config file each kind of bundle carries."""


@dataclass(frozen=True)
class Bundle:
    """What ``issue_*``/``sign_csr``/``rotate`` wrote.

    Attributes:
        path: the bundle directory.
        config: its config file.
        cert: ``cert.pem``.
        key: ``key.pem``, or ``None`` in the CSR flow (the device holds the key).
        record: the inventory record of the new certificate.
        trusted_key_ids: ids of the manifest-signing keys written to ``trusted_keys/``.
    """

    path: Path
    config: Path
    cert: Path
    key: Path | None
    record: CertRecord
    trusted_key_ids: tuple[str, ...]


@dataclass(frozen=True)
class BrokerIdentity:
    """A broker's server certificate and key (``provision broker``)."""

    cert: Path
    key: Path
    ca: Path
    record: CertRecord


def parse_endpoint(text: str, *, default_port: int = 8883) -> tuple[str, int]:
    """``host:port`` (``[v6addr]:port`` for IPv6) -> ``(host, port)``; the port is optional.

    Raises:
        ValueError: an empty host or a port outside 1..65535.
    """
    text = text.strip()
    host, port_text = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"unbalanced brackets in {text!r}")
        host, rest = text[1:end], text[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(f"expected [host]:port, got {text!r}")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif text.count(":") > 1:  # a bare IPv6 address without a port
        ipaddress.ip_address(text)
    if not host:
        raise ValueError(f"no host in {text!r}")
    port = default_port
    if port_text:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"bad port in {text!r}")
        port = int(port_text)
    return host, port


def _format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _broker_table(endpoint: tuple[str, int]) -> dict[str, Any]:
    host, port = endpoint
    return {"host": host, "port": port, "protocol": 5, "tls_ca": "ca.pem", "tls_cert": "cert.pem",
            "tls_key": "key.pem"}


def _check_free(out: Path, names: Sequence[str], force: bool) -> None:
    if force:
        return
    existing = [n for n in names if (out / n).exists()]
    if existing:
        raise BundleExistsError(f"{out} already has {', '.join(existing)}; refusing to overwrite "
                                "(use another directory, or --force)")


def _write_trusted_keys(fleet: Fleet, out: Path) -> tuple[list[str], tuple[str, ...]]:
    keys = fleet.trusted_keys()
    directory = out / "trusted_keys"
    directory.mkdir(parents=True, exist_ok=True)
    rel = []
    for kid, key in sorted(keys.items()):
        pki.write_public_pem(directory / f"{kid}.pub", key)
        rel.append(f"trusted_keys/{kid}.pub")
    return rel, tuple(sorted(keys))


def _write_readme(out: Path, kind: str, record: CertRecord, key_present: bool, extra: str = "") -> None:
    run = {"device": "fedtier agent run --bundle THIS_DIRECTORY",
           "gateway": "fedtier edge run --config THIS_DIRECTORY/edge.toml",
           "coordinator": "merge coordinator.toml into your rollout config, then "
                          "fedtier coordinator run --config ROLLOUT.toml"}[kind]
    key_line = ("key.pem      this node's private key (mode 0600): keep it here, never copy it elsewhere"
                if key_present else
                "key.pem      NOT included: it was generated on the device (fedtier agent enroll) and must "
                "be placed next to these files")
    text = f"""fedtier enrollment bundle: {kind} {record.name}{f" (cell {record.cell})" if record.cell else ""}

certificate serial {record.serial_hex}, valid until {record.not_after:%Y-%m-%d %H:%M UTC}

cert.pem     this node's certificate (CN = {record.name})
{key_line}
ca.pem       the fleet CA
trusted_keys/  manifest-signing public keys this node accepts
{CONFIG_NAMES[kind]}  the node's configuration (paths relative to this directory)
{extra}
Run: {run}
"""
    pki.write_atomic(out / "README.txt", text.encode(), 0o644, overwrite=True)


def _validate(kind: str, path: Path) -> None:
    """Load ``path`` with the real config class of ``kind`` (the bundle must load as written)."""
    if kind == "device":
        from device_agent.config import DeviceConfig

        load(DeviceConfig, path)
    elif kind == "gateway":
        from edge_broker.config import EdgeConfig

        load(EdgeConfig, path)
    else:
        from fedtier.rollout.config import RolloutConfig

        load(RolloutConfig, path)


def _node_config(kind: str, record: CertRecord, broker: tuple[str, int], cloud_broker: tuple[str, int] | None,
                 trusted: list[str], *, data_dir: str, fleet: Fleet) -> dict[str, Any]:
    if kind == "device":
        return {"device_id": record.name, "cell": record.cell, "data_dir": data_dir, "state_dir": "state",
                "trusted_keys": trusted, "broker": _broker_table(broker)}
    if kind == "gateway":
        return {"cell": record.name, "state_dir": "state", "parent": record.parent or "cloud",
                "trusted_keys": trusted, "cell_broker": _broker_table(broker),
                "cloud_broker": _broker_table(cloud_broker or broker)}
    return {"cloud_id": record.name, "signing_key": str(fleet.signing_key_path),
            "broker": _broker_table(broker)}


def _write_bundle(fleet: Fleet, kind: str, out: Path, record: CertRecord, cert: x509.Certificate,
                  broker: tuple[str, int], cloud_broker: tuple[str, int] | None, *, data_dir: str,
                  key_path: Path | None) -> Bundle:
    pki.write_certificate(out / "cert.pem", cert)
    shutil.copyfile(fleet.ca_cert_path, out / "ca.pem")
    trusted, ids = _write_trusted_keys(fleet, out)
    config_path = out / CONFIG_NAMES[kind]
    data = _node_config(kind, record, broker, cloud_broker, trusted, data_dir=data_dir, fleet=fleet)
    pki.write_atomic(config_path, dumps_toml(data).encode(), 0o644, overwrite=True)
    device_key = out / "key.pem"
    if key_path is not None or device_key.is_file():
        _validate(kind, config_path)
        if key_path is None:  # CSR flow, unpacked next to the device's key: check they belong together
            key = pki.load_private_key(device_key)
            if not pki.same_public_key(key.public_key(), cert.public_key()):  # type: ignore[arg-type]
                raise CsrError(f"{device_key} does not match the certificate issued for the CSR")
    else:
        # CSR flow on the operator's side: key.pem is on the device. Validate everything else
        # (the same config without the client-certificate pair, which must exist on disk).
        _validate_without_key(kind, data, config_path)
    note = "" if kind != "coordinator" else (
        f"coordinator.toml is a fragment: its signing_key points at {fleet.signing_key_path} (not copied).\n")
    _write_readme(out, kind, record, key_path is not None or device_key.is_file(), note)
    return Bundle(path=out, config=config_path, cert=out / "cert.pem", key=key_path, record=record,
                  trusted_key_ids=ids)


def _validate_without_key(kind: str, data: dict[str, Any], config_path: Path) -> None:
    stripped = dict(data)
    for table in ("broker", "cell_broker", "cloud_broker"):
        if table in stripped:
            stripped[table] = {k: v for k, v in stripped[table].items() if k not in ("tls_cert", "tls_key")}
    if kind == "device":
        from device_agent.config import DeviceConfig

        DeviceConfig.from_mapping(stripped, source=str(config_path), base_dir=config_path.parent)
    elif kind == "gateway":
        from edge_broker.config import EdgeConfig

        EdgeConfig.from_mapping(stripped, source=str(config_path), base_dir=config_path.parent)
    else:
        BrokerConfig.from_mapping(stripped["broker"], source=str(config_path), base_dir=config_path.parent)


BUNDLE_FILES = ("cert.pem", "key.pem", "ca.pem", "README.txt")


def _issue_with_new_key(fleet: Fleet, kind: str, name: str, out: Path, *, cell: str | None,
                        broker: tuple[str, int], cloud_broker: tuple[str, int] | None, data_dir: str,
                        parent: str | None, days: float | None, force: bool) -> Bundle:
    out = Path(out).expanduser().resolve()
    _check_free(out, (*BUNDLE_FILES, CONFIG_NAMES[kind]), force)
    ca.check_node_name(name)
    if cell is not None:
        ca.check_node_name(cell, "cell id")
    key = pki.generate_tls_key()
    out.mkdir(parents=True, exist_ok=True)
    # The key is written before the certificate exists: if writing fails, nothing is issued.
    key_path = pki.write_private_key(out / "key.pem", key, overwrite=force)
    try:
        record, cert = fleet.issue(name, kind, key.public_key(), cell=cell, days=days,
                                   broker=_format_endpoint(*broker),
                                   cloud_broker=_format_endpoint(*cloud_broker) if cloud_broker else None,
                                   data_dir=data_dir if kind == "device" else None, parent=parent)
    except Exception:
        key_path.unlink(missing_ok=True)
        raise
    bundle = _write_bundle(fleet, kind, out, record, cert, broker, cloud_broker, data_dir=data_dir,
                           key_path=key_path)
    log.info("wrote %s bundle %s (serial %s)", kind, out, record.serial_hex)
    return bundle


def issue_device(fleet: Fleet | str | Path, name: str, cell: str, broker: tuple[str, int], out: str | Path, *,
                 data_dir: str = "data", days: float | None = None, force: bool = False) -> Bundle:
    """A new key + certificate for device ``name`` of ``cell``, as a bundle with ``device.toml``.

    Args:
        fleet: the fleet (or its directory).
        name: the device id (CN, MQTT client id and username).
        cell: its cell.
        broker: the cell broker ``(host, port)`` the device connects to.
        out: the bundle directory (created).
        data_dir: the device's data directory, relative to the bundle (or absolute).
        days: certificate validity (default ``ca.NODE_DAYS``).
        force: overwrite an existing bundle's files.

    Returns:
        The bundle.

    Raises:
        BundleExistsError: ``out`` already holds bundle files and ``force`` is false.
        InvalidNameError, NameConflictError: a bad or aliasing name (see ``Fleet.issue``).
    """
    return _issue_with_new_key(open_fleet(fleet), "device", name, Path(out), cell=cell, broker=broker,
                               cloud_broker=None, data_dir=data_dir, parent=None, days=days, force=force)


def issue_gateway(fleet: Fleet | str | Path, cell: str, broker: tuple[str, int], out: str | Path, *,
                  cloud_broker: tuple[str, int] | None = None, cloud_id: str = "cloud",
                  days: float | None = None, force: bool = False) -> Bundle:
    """A new key + certificate for the edge of ``cell`` (node id = cell id), with ``edge.toml``.

    Args:
        fleet: the fleet (or its directory).
        cell: the cell id (= the gateway's node id: one edge per cell).
        broker: the cell broker ``(host, port)`` (usually Mosquitto on the gateway itself).
        out: the bundle directory.
        cloud_broker: the coordinator's broker (default: the same broker, a combined setup).
        cloud_id: the coordinator whose tasks the edge accepts (``parent``).
        days, force: as for ``issue_device``.

    Returns:
        The bundle.

    Raises:
        BundleExistsError, InvalidNameError, NameConflictError: as for ``issue_device``.
    """
    ca.check_node_name(cloud_id, "cloud id")
    return _issue_with_new_key(open_fleet(fleet), "gateway", cell, Path(out), cell=cell, broker=broker,
                               cloud_broker=cloud_broker, data_dir="", parent=cloud_id, days=days, force=force)


def issue_coordinator(fleet: Fleet | str | Path, broker: tuple[str, int], out: str | Path, *,
                      cloud_id: str = "cloud", days: float | None = None, force: bool = False) -> Bundle:
    """A new key + certificate for the coordinator (CN = ``cloud_id``) and a ``coordinator.toml`` fragment.

    Args:
        fleet: the fleet (or its directory).
        broker: the cloud broker ``(host, port)``.
        out: the bundle directory.
        cloud_id: the coordinator's node id (the rollout config's ``cloud_id``).
        days, force: as for ``issue_device``.

    Returns:
        The bundle; ``coordinator.toml`` holds ``cloud_id``, ``signing_key`` (absolute path of
        the fleet's key, not a copy) and ``[broker]``.

    Raises:
        BundleExistsError, InvalidNameError, NameConflictError: as for ``issue_device``.
    """
    return _issue_with_new_key(open_fleet(fleet), "coordinator", cloud_id, Path(out), cell=None, broker=broker,
                               cloud_broker=None, data_dir="", parent=None, days=days, force=force)


def sign_csr(fleet: Fleet | str | Path, csr: x509.CertificateSigningRequest | str | Path, cell: str,
             broker: tuple[str, int], out: str | Path, *, data_dir: str = "data", days: float | None = None,
             force: bool = False) -> Bundle:
    """Issue a device certificate for a CSR made on the device; write a bundle *without* key.pem.

    The operator never sees the device's key: the device ran ``fedtier agent enroll`` (key.pem
    + CSR, in its own directory), the operator returns this bundle, which is unpacked next to
    key.pem. If ``out`` already holds the matching key.pem (e.g. the enroll directory), the
    config is fully validated and the key is checked against the certificate.

    Args:
        fleet: the fleet (or its directory).
        csr: the CSR (object or PEM file).
        cell: the device's cell.
        broker, out, data_dir, days, force: as for ``issue_device``.

    Returns:
        The bundle (``key`` is ``None``).

    Raises:
        ConfigError: the CSR file is unreadable or not PEM.
        CsrError: forged/altered signature or a non-P-256 key.
        InvalidNameError: the CN is not a valid fedtier id.
        BundleExistsError, NameConflictError: as for ``issue_device``.
    """
    fleet = open_fleet(fleet)
    request = csr if isinstance(csr, x509.CertificateSigningRequest) else pki.load_csr(csr)
    name = ca.check_csr(request)
    out = Path(out).expanduser().resolve()
    _check_free(out, ("cert.pem", "ca.pem", "README.txt", "device.toml"), force)
    out.mkdir(parents=True, exist_ok=True)
    record, cert = fleet.issue(name, "device", request.public_key(), cell=cell, days=days,  # type: ignore[arg-type]
                               broker=_format_endpoint(*broker), data_dir=data_dir, from_csr=True)
    bundle = _write_bundle(fleet, "device", out, record, cert, broker, None, data_dir=data_dir, key_path=None)
    log.info("signed CSR of %s: bundle %s (serial %s, no key.pem)", name, out, record.serial_hex)
    return bundle


def issue_broker(fleet: Fleet | str | Path, name: str, hosts: Sequence[str], out: str | Path, *,
                 days: float | None = None, force: bool = False) -> BrokerIdentity:
    """A broker's server key + certificate (EKU serverAuth, SAN = ``hosts``) in ``out``.

    Writes ``broker.pem``, ``broker.key`` (0600) and ``ca.pem``; ``broker-config`` picks them
    up from the same directory.

    Args:
        fleet: the fleet (or its directory).
        name: the broker's name (CN; informational).
        hosts: every host name / IP address clients dial.
        out: the output directory.
        days: validity (default ``ca.BROKER_DAYS``).
        force: overwrite existing files.

    Returns:
        The paths and the inventory record.

    Raises:
        BundleExistsError: files exist and ``force`` is false.
        ValueError: no hosts.
    """
    fleet = open_fleet(fleet)
    out = Path(out).expanduser().resolve()
    _check_free(out, ("broker.pem", "broker.key"), force)
    ca.check_node_name(name, "broker name")
    ca.subject_alt_names(hosts)  # fail before anything is written
    key = pki.generate_tls_key()
    out.mkdir(parents=True, exist_ok=True)
    key_path = pki.write_private_key(out / "broker.key", key, overwrite=force)
    try:
        record, cert = fleet.issue(name, "broker", key.public_key(), hosts=hosts, days=days)
    except Exception:
        key_path.unlink(missing_ok=True)
        raise
    cert_path = pki.write_certificate(out / "broker.pem", cert)
    shutil.copyfile(fleet.ca_cert_path, out / "ca.pem")
    log.info("issued broker certificate %s for %s", record.serial_hex, ", ".join(hosts))
    return BrokerIdentity(cert=cert_path, key=key_path, ca=out / "ca.pem", record=record)


def rotate(fleet: Fleet | str | Path, name: str, out: str | Path, *, revoke_old: bool = False,
           csr: x509.CertificateSigningRequest | str | Path | None = None, kind: str | None = None,
           days: float | None = None, force: bool = False) -> Bundle | BrokerIdentity:
    """A new key + certificate for an existing node, with the kind/cell/broker of its last one.

    Args:
        fleet: the fleet (or its directory).
        name: the node (or broker) name.
        out: the new bundle directory (``force`` to overwrite the old bundle in place).
        revoke_old: revoke every earlier certificate of ``name`` (and rewrite the CRL) once
            the new one is issued. Leave it off to let the node switch over first.
        csr: a device CSR to sign instead of generating a key here (keeps the key on the
            device). Its CN must be ``name``.
        kind: disambiguate a broker and a node with the same name.
        days: validity (default: the kind's default).
        force: overwrite files in ``out``.

    Returns:
        The new bundle (``BrokerIdentity`` for a broker).

    Raises:
        UnknownNodeError: nothing was issued to ``name``.
        CsrError: the CSR's CN is not ``name`` (or it fails ``ca.check_csr``).
        ValueError: a CSR for a non-device.
    """
    fleet = open_fleet(fleet)
    old = fleet.latest(name, kind=kind)
    previous = [r for r in fleet.find(name, kind=old.kind) if not r.revoked]
    result: Bundle | BrokerIdentity
    if old.kind == "broker":
        result = issue_broker(fleet, name, old.hosts, out, days=days, force=force)
    else:
        broker = parse_endpoint(old.broker or "127.0.0.1:8883")
        if csr is not None:
            if old.kind != "device":
                raise ValueError("only devices enroll with a CSR")
            request = csr if isinstance(csr, x509.CertificateSigningRequest) else pki.load_csr(csr)
            if ca.check_csr(request) != name:
                raise CsrError(f"the CSR is for {pki.cert_common_name(request)!r}, not {name!r}")
            result = sign_csr(fleet, request, old.cell or "", broker, out, data_dir=old.data_dir or "data",
                              days=days, force=force)
        elif old.kind == "device":
            if old.from_csr:
                log.warning("%s enrolled with a CSR; rotating without --csr generates its new key here, "
                            "on the operator's machine", name)
            result = issue_device(fleet, name, old.cell or "", broker, out, data_dir=old.data_dir or "data",
                                  days=days, force=force)
        elif old.kind == "gateway":
            cloud = parse_endpoint(old.cloud_broker) if old.cloud_broker else None
            result = issue_gateway(fleet, name, broker, out, cloud_broker=cloud, cloud_id=old.parent or "cloud",
                                   days=days, force=force)
        else:
            result = issue_coordinator(fleet, broker, out, cloud_id=name, days=days, force=force)
    if revoke_old:
        for r in previous:
            fleet.revoke(name, serial=r.serial)
    return result


def check_bundle_key(bundle_dir: str | Path) -> None:
    """Check that ``key.pem`` in a bundle matches ``cert.pem`` (e.g. after unpacking a CSR bundle).

    Raises:
        ConfigError: a file is missing or unreadable, or the key does not match.
    """
    bundle_dir = Path(bundle_dir)
    cert = pki.load_certificate(bundle_dir / "cert.pem")
    key = pki.load_private_key(bundle_dir / "key.pem")
    if not pki.same_public_key(key.public_key(), cert.public_key()):  # type: ignore[arg-type]
        raise ConfigError("key.pem does not belong to cert.pem", source=str(bundle_dir))

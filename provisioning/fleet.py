"""The fleet directory: the CA, the manifest-signing key, the CRL and an inventory of every certificate.

Layout (created by ``Fleet.init``; the directory itself is mode 0700)::

    FLEET/
      ca.key            fleet CA private key (ECDSA P-256, mode 0600) — the crown jewels
      ca.pem            fleet CA certificate (every node and broker trusts it)
      signing.key       coordinator's manifest-signing key (Ed25519, mode 0600)
      signing.pub       its public half; bundles carry it as trusted_keys/<key_id>.pub
      trusted_keys/     optional extra *.pub (e.g. the next signing key, during a rotation)
      crl.pem           CRL signed by the CA (empty after init; brokers point crlfile at a copy)
      inventory.json    every issued certificate (serial, name, kind, cell, validity, revoked)
      issued/<serial>.pem  a copy of every issued certificate (public; for audit)

Threat model: whoever reads ``ca.key`` can mint any identity, and whoever reads
``signing.key`` can push any model to every device. Keep the fleet directory on the
operator's machine (ideally offline), never on a gateway. Nothing here ever prints or copies
a private key: bundles carry the *node's* key (generated for it, or kept on the device in
the CSR flow), the coordinator bundle refers to ``signing.key`` by path.

Names are MQTT usernames, and the broker's ACL grants topics by username, so the inventory
refuses a name that would alias another role: a device cannot be called like a cell (it
would get that gateway's rights) or like the coordinator, and one device cannot hold
active certificates in two cells.

Concurrent ``provision`` commands on one fleet are serialised by an ``flock`` on
``FLEET/.lock`` around every read-modify-write of the inventory.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from fedtier.errors import ConfigError
from fedtier.security import pki
from provisioning import ca
from provisioning.errors import FleetExistsError, FleetNotFoundError, NameConflictError, UnknownNodeError

try:  # POSIX only; on other platforms the lock is a no-op
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("fedtier.provisioning")

NODE_KINDS = ("device", "gateway", "coordinator")
"""Kinds of client identity (EKU clientAuth; CN = node id = MQTT username)."""
KINDS = (*NODE_KINDS, "broker")
"""All kinds of issued certificates; brokers hold server certificates (EKU serverAuth)."""
INVENTORY_VERSION = 1


def _iso(when: dt.datetime) -> str:
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)


@dataclass(frozen=True)
class CertRecord:
    """One issued certificate, as the inventory remembers it.

    ``broker``/``cloud_broker`` (``host:port``), ``data_dir`` and ``parent`` are what the
    bundle was made with, so ``rotate`` can issue an identical bundle with a fresh key.
    """

    serial: int
    name: str
    kind: str
    cell: str | None
    not_before: dt.datetime
    not_after: dt.datetime
    issued_at: dt.datetime
    key_id: str
    from_csr: bool = False
    revoked: bool = False
    revoked_at: dt.datetime | None = None
    broker: str | None = None
    cloud_broker: str | None = None
    data_dir: str | None = None
    parent: str | None = None
    hosts: tuple[str, ...] = field(default_factory=tuple)

    @property
    def serial_hex(self) -> str:
        """The serial as lowercase hex (how the CLI shows it and ``--serial`` takes it)."""
        return format(self.serial, "x")

    def expired(self, now: dt.datetime | None = None) -> bool:
        """Whether the certificate is past its notAfter."""
        return (now or ca.utcnow()) >= self.not_after

    def expiring(self, within_days: float, now: dt.datetime | None = None) -> bool:
        """Active (not revoked) and expiring within ``within_days`` (or already expired)."""
        now = now or ca.utcnow()
        return not self.revoked and self.not_after - now <= dt.timedelta(days=within_days)

    def to_json(self) -> dict[str, Any]:
        """The inventory's JSON form (times as ISO 8601 UTC, the serial as hex)."""
        return {"serial": self.serial_hex, "name": self.name, "kind": self.kind, "cell": self.cell,
                "not_before": _iso(self.not_before), "not_after": _iso(self.not_after),
                "issued_at": _iso(self.issued_at), "key_id": self.key_id, "from_csr": self.from_csr,
                "revoked": self.revoked, "revoked_at": _iso(self.revoked_at) if self.revoked_at else None,
                "broker": self.broker, "cloud_broker": self.cloud_broker, "data_dir": self.data_dir,
                "parent": self.parent, "hosts": list(self.hosts)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "CertRecord":
        """Inverse of ``to_json``.

        Raises:
            KeyError, ValueError: a malformed record.
        """
        return cls(serial=int(doc["serial"], 16), name=doc["name"], kind=doc["kind"], cell=doc.get("cell"),
                   not_before=_parse_time(doc["not_before"]), not_after=_parse_time(doc["not_after"]),
                   issued_at=_parse_time(doc["issued_at"]), key_id=doc["key_id"],
                   from_csr=bool(doc.get("from_csr", False)), revoked=bool(doc.get("revoked", False)),
                   revoked_at=_parse_time(doc["revoked_at"]) if doc.get("revoked_at") else None,
                   broker=doc.get("broker"), cloud_broker=doc.get("cloud_broker"), data_dir=doc.get("data_dir"),
                   parent=doc.get("parent"), hosts=tuple(doc.get("hosts") or ()))


class Fleet:
    """An existing fleet directory (see the module docstring). Create one with ``Fleet.init``."""

    def __init__(self, root: str | Path) -> None:
        """Open the fleet at ``root``.

        Raises:
            FleetNotFoundError: ``root`` has no ``ca.pem``/``ca.key``/``inventory.json``.
        """
        self.root = Path(root).expanduser().resolve()
        missing = [p.name for p in (self.ca_cert_path, self.ca_key_path, self.inventory_path) if not p.is_file()]
        if missing:
            raise FleetNotFoundError(f"{self.root} is not a fleet directory (missing {', '.join(missing)}); "
                                     "create one with `fedtier provision init`")
        self._ca_cert: x509.Certificate | None = None

    # --- paths -------------------------------------------------------------------------------

    @property
    def ca_key_path(self) -> Path:
        return self.root / "ca.key"

    @property
    def ca_cert_path(self) -> Path:
        return self.root / "ca.pem"

    @property
    def signing_key_path(self) -> Path:
        return self.root / "signing.key"

    @property
    def signing_pub_path(self) -> Path:
        return self.root / "signing.pub"

    @property
    def crl_path(self) -> Path:
        return self.root / "crl.pem"

    @property
    def inventory_path(self) -> Path:
        return self.root / "inventory.json"

    @property
    def issued_dir(self) -> Path:
        return self.root / "issued"

    @property
    def extra_trusted_dir(self) -> Path:
        return self.root / "trusted_keys"

    # --- creation ----------------------------------------------------------------------------

    @classmethod
    def init(cls, root: str | Path, *, force: bool = False, ca_days: int = ca.CA_DAYS,
             ca_name: str = "fedtier fleet CA") -> "Fleet":
        """Create a fleet: CA key + certificate, manifest-signing key pair, empty CRL, inventory.

        Args:
            root: the fleet directory (created, mode 0700, if missing).
            force: replace an existing fleet. Every certificate it issued stops being
                trusted by brokers that get the new ``ca.pem``; every device that trusts the
                old signing key rejects manifests signed with the new one.
            ca_days: CA validity.
            ca_name: the CA's CN.

        Returns:
            The new fleet.

        Raises:
            FleetExistsError: ``root`` already holds a CA or signing key and ``force`` is false.
        """
        root = Path(root).expanduser().resolve()
        names = ("ca.key", "ca.pem", "signing.key", "signing.pub", "inventory.json")
        existing = [n for n in names if (root / n).exists()]
        if existing and not force:
            raise FleetExistsError(f"{root} already holds a fleet ({', '.join(existing)}); refusing to overwrite "
                                   "its CA and signing key (use --force to replace them: every issued "
                                   "certificate and every device's trusted key becomes invalid)")
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        ca_key, ca_cert = ca.create_ca(ca_name, days=ca_days)
        signing = pki.generate_signing_key()
        pki.write_private_key(root / "ca.key", ca_key, overwrite=force)
        pki.write_certificate(root / "ca.pem", ca_cert)
        pki.write_private_key(root / "signing.key", signing, overwrite=force)
        pki.write_public_pem(root / "signing.pub", signing.public_key())
        empty = {"version": INVENTORY_VERSION, "crl_number": 0, "certificates": []}
        pki.write_atomic(root / "inventory.json", (json.dumps(empty, indent=2) + "\n").encode(), 0o644,
                         overwrite=True)
        fleet = cls(root)
        fleet.write_crl()  # brokers with crlfile refuse everyone until a CRL exists
        log.info("created fleet %s (CA %s, signing key id %s)", root, pki.key_id(ca_key.public_key()),
                 pki.key_id(signing.public_key()))
        return fleet

    # --- keys ----------------------------------------------------------------------------------

    @property
    def ca_cert(self) -> x509.Certificate:
        """The fleet CA certificate."""
        if self._ca_cert is None:
            self._ca_cert = pki.load_certificate(self.ca_cert_path)
        return self._ca_cert

    def _ca_key(self) -> ec.EllipticCurvePrivateKey:
        key = pki.load_private_key(self.ca_key_path)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError("the fleet CA key must be an ECDSA key", source=str(self.ca_key_path))
        return key

    def trusted_keys(self) -> dict[str, ed25519.Ed25519PublicKey]:
        """Key id -> manifest-signing public key: ``signing.pub`` plus ``trusted_keys/*.pub``.

        Raises:
            ConfigError: a key file is unreadable or not Ed25519.
        """
        keys: dict[str, ed25519.Ed25519PublicKey] = {}
        paths = [self.signing_pub_path]
        if self.extra_trusted_dir.is_dir():
            paths.extend(sorted(self.extra_trusted_dir.glob("*.pub")))
        for path in paths:
            key = pki.load_public_key(path)
            if not isinstance(key, ed25519.Ed25519PublicKey):
                raise ConfigError("manifest signing keys must be Ed25519", source=str(path))
            keys[pki.key_id(key)] = key
        return keys

    @property
    def signing_key_id(self) -> str:
        """Key id of the fleet's current manifest-signing key."""
        key = pki.load_public_key(self.signing_pub_path)
        return pki.key_id(key)

    # --- inventory -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if fcntl is None:  # pragma: no cover
            yield
            return
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _load_inventory(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.inventory_path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"unreadable inventory: {exc}", source=str(self.inventory_path)) from None
        if not isinstance(doc, dict) or doc.get("version") != INVENTORY_VERSION:
            raise ConfigError(f"unsupported inventory (expected version {INVENTORY_VERSION})",
                              source=str(self.inventory_path))
        return doc

    def _save_inventory(self, doc: dict[str, Any]) -> None:
        data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
        pki.write_atomic(self.inventory_path, data, 0o644, overwrite=True)

    def records(self) -> list[CertRecord]:
        """Every certificate issued by this fleet, oldest first.

        Raises:
            ConfigError: the inventory is unreadable or malformed.
        """
        doc = self._load_inventory()
        try:
            return [CertRecord.from_json(r) for r in doc["certificates"]]
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError(f"malformed inventory record: {exc}", source=str(self.inventory_path)) from None

    def find(self, name: str, *, kind: str | None = None) -> list[CertRecord]:
        """The certificates issued to ``name`` (optionally of one kind), oldest first."""
        return [r for r in self.records() if r.name == name and (kind is None or r.kind == kind)]

    def latest(self, name: str, *, kind: str | None = None) -> CertRecord:
        """The most recently issued certificate of ``name``.

        Raises:
            UnknownNodeError: nothing was issued to ``name``.
        """
        found = self.find(name, kind=kind)
        if not found:
            raise UnknownNodeError(f"no certificate was issued to {name!r}"
                                   + (f" as {kind}" if kind else "") + " by this fleet")
        return found[-1]

    def active_devices(self, cells: Sequence[str] | None = None) -> dict[str, str]:
        """Device id -> cell for every device holding a valid, unrevoked certificate.

        Args:
            cells: only devices of these cells (default all).
        """
        now = ca.utcnow()
        out: dict[str, str] = {}
        for r in self.records():
            if r.kind == "device" and not r.revoked and not r.expired(now) and r.cell is not None:
                if cells is None or r.cell in cells:
                    out[r.name] = r.cell
        return out

    def _check_name(self, records: list[CertRecord], name: str, kind: str, cell: str | None) -> None:
        """Refuse a name that would alias another role's MQTT username (see module docstring)."""
        if kind == "broker":
            return  # server certificates cannot log in as clients: a namespace of their own
        now = ca.utcnow()
        for r in records:
            if r.kind == "broker":
                continue
            if r.name == name and r.kind != kind:
                raise NameConflictError(f"{name!r} is already a {r.kind}; a {kind} cannot use the same name "
                                        "(it would share that MQTT username and its ACL rights)")
            if kind == "device" and r.name == name and r.cell != cell and not r.revoked and not r.expired(now):
                raise NameConflictError(f"device {name!r} holds an active certificate in cell {r.cell!r} "
                                        f"(serial {r.serial_hex}); revoke it before moving it to {cell!r}")
            if kind in ("device", "coordinator") and r.cell == name:
                raise NameConflictError(f"{name!r} is a cell id; a {kind} cannot use it "
                                        "(it would get that cell's gateway rights)")
            if kind == "device" and r.name == cell and r.kind in ("device", "coordinator"):
                raise NameConflictError(f"{cell!r} is a {r.kind}; it cannot also be a cell id")

    def issue(self, name: str, kind: str, public_key: pki.PublicKey, *, cell: str | None = None,
              days: float | None = None, not_before: dt.datetime | None = None,
              not_after: dt.datetime | None = None, hosts: Sequence[str] = (), broker: str | None = None,
              cloud_broker: str | None = None, data_dir: str | None = None, parent: str | None = None,
              from_csr: bool = False) -> tuple[CertRecord, x509.Certificate]:
        """Issue a certificate for ``public_key`` and record it in the inventory.

        Args:
            name: the node id (CN). For a gateway it must equal ``cell``.
            kind: ``device``, ``gateway``, ``coordinator`` (client certificates) or ``broker``
                (server certificate; ``hosts`` go into the SAN).
            public_key: the subject's ECDSA P-256 public key.
            cell: the device's (or gateway's) cell.
            days: validity (default ``ca.NODE_DAYS``, ``ca.BROKER_DAYS`` for brokers).
            not_before, not_after: an explicit validity window instead of ``days``.
            hosts: broker host names / IP addresses.
            broker, cloud_broker, data_dir, parent: remembered for ``rotate``.
            from_csr: the key was generated on the device (its key never came here).

        Returns:
            ``(record, certificate)``; the certificate is also stored under ``issued/``.

        Raises:
            InvalidNameError: ``name`` or ``cell`` is not a valid fedtier id.
            NameConflictError: ``name`` aliases another role (see module docstring).
            CsrError: the key is not ECDSA P-256.
            ValueError: bad kind, gateway name != cell, or an empty validity window.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
        ca.check_node_name(name, "broker name" if kind == "broker" else f"{kind} id")
        if cell is not None:
            ca.check_node_name(cell, "cell id")
        if kind == "device" and cell is None:
            raise ValueError("a device needs a cell")
        if kind == "gateway" and cell != name:
            raise ValueError("a gateway's node id is its cell id")
        ca_key = self._ca_key()
        with self._locked():
            doc = self._load_inventory()
            records = [CertRecord.from_json(r) for r in doc["certificates"]]
            self._check_name(records, name, kind, cell)
            if kind == "broker":
                cert = ca.issue_server_certificate(ca_key, self.ca_cert, public_key, name, hosts,
                                                   days=days or ca.BROKER_DAYS, not_before=not_before,
                                                   not_after=not_after)
            else:
                cert = ca.issue_node_certificate(ca_key, self.ca_cert, public_key, name,
                                                 days=days or ca.NODE_DAYS, not_before=not_before,
                                                 not_after=not_after)
            record = CertRecord(serial=cert.serial_number, name=name, kind=kind, cell=cell,
                                not_before=cert.not_valid_before_utc, not_after=cert.not_valid_after_utc,
                                issued_at=ca.utcnow(), key_id=pki.key_id(public_key), from_csr=from_csr,
                                broker=broker, cloud_broker=cloud_broker, data_dir=data_dir, parent=parent,
                                hosts=tuple(hosts))
            pki.write_certificate(self.issued_dir / f"{record.serial_hex}.pem", cert, overwrite=False)
            doc["certificates"].append(record.to_json())
            self._save_inventory(doc)
        log.info("issued %s certificate for %s (serial %s, expires %s)", kind, name, record.serial_hex,
                 _iso(record.not_after))
        return record, cert

    def revoke(self, name: str | None = None, *, serial: int | None = None, kind: str | None = None,
               now: dt.datetime | None = None) -> list[CertRecord]:
        """Revoke every unrevoked certificate of ``name`` (or just ``serial``) and rewrite the CRL.

        Brokers enforce revocation from *their copy* of the CRL: copy ``crl.pem`` to every
        broker's config directory and send Mosquitto SIGHUP (2.0 re-reads ``crlfile`` on
        reload; verified with 2.0.11) or restart it. Clients already connected stay connected
        until they reconnect — restart the broker to drop them at once.

        Args:
            name: the node (or broker) name.
            serial: revoke only this serial (must belong to ``name`` if both are given).
            kind: only certificates of this kind (e.g. a broker named like its cell).
            now: revocation time (default now).

        Returns:
            The records newly revoked (empty if all were already revoked).

        Raises:
            UnknownNodeError: no certificate matches.
            ValueError: neither ``name`` nor ``serial`` given.
        """
        if name is None and serial is None:
            raise ValueError("give a name or a serial to revoke")
        now = now or ca.utcnow()
        changed: list[CertRecord] = []
        with self._locked():
            doc = self._load_inventory()
            records = [CertRecord.from_json(r) for r in doc["certificates"]]
            matches = [i for i, r in enumerate(records)
                       if (name is None or r.name == name) and (serial is None or r.serial == serial)
                       and (kind is None or r.kind == kind)]
            if not matches:
                what = f"{name!r}" if name is not None else ""
                what += f" serial {serial:x}" if serial is not None else ""
                raise UnknownNodeError(f"no certificate {what.strip()} was issued by this fleet")
            for i in matches:
                if not records[i].revoked:
                    records[i] = replace(records[i], revoked=True, revoked_at=now)
                    changed.append(records[i])
            doc["certificates"] = [r.to_json() for r in records]
            self._save_inventory(doc)
            self._write_crl_locked(doc, now)
        for r in changed:
            log.info("revoked %s %s (serial %s)", r.kind, r.name, r.serial_hex)
        return changed

    def write_crl(self, *, now: dt.datetime | None = None, days: float = ca.CRL_DAYS) -> Path:
        """(Re)write ``crl.pem`` from the inventory with a fresh nextUpdate and a new CRL number.

        Run it (``fedtier provision crl``) well before the CRL's nextUpdate: an expired CRL
        makes Mosquitto refuse every client.

        Returns:
            The CRL path.
        """
        with self._locked():
            doc = self._load_inventory()
            path = self._write_crl_locked(doc, now or ca.utcnow(), days)
        return path

    def _write_crl_locked(self, doc: dict[str, Any], now: dt.datetime, days: float = ca.CRL_DAYS) -> Path:
        revoked = [(r.serial, r.revoked_at or now) for r in (CertRecord.from_json(d) for d in doc["certificates"])
                   if r.revoked]
        doc["crl_number"] = int(doc.get("crl_number", 0)) + 1
        crl = ca.make_crl(self._ca_key(), self.ca_cert, revoked, crl_number=doc["crl_number"], days=days, now=now)
        pki.write_atomic(self.crl_path, crl.public_bytes(serialization.Encoding.PEM), 0o644, overwrite=True)
        self._save_inventory(doc)
        return self.crl_path

    def crl(self) -> x509.CertificateRevocationList:
        """The current CRL.

        Raises:
            ConfigError: ``crl.pem`` is missing or invalid.
        """
        try:
            return x509.load_pem_x509_crl(self.crl_path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"unreadable CRL: {exc}", source=str(self.crl_path)) from None

    def listing(self, *, expiring_days: float = 30.0, now: dt.datetime | None = None) -> list[dict[str, Any]]:
        """The inventory as plain rows for display or JSON (no key material, ever).

        Each row: serial, name, kind, cell, not_before, not_after, revoked, expired, and
        ``expiring`` (active and expiring within ``expiring_days``).
        """
        now = now or ca.utcnow()
        rows = []
        for r in self.records():
            rows.append({"serial": r.serial_hex, "name": r.name, "kind": r.kind, "cell": r.cell,
                         "not_before": _iso(r.not_before), "not_after": _iso(r.not_after),
                         "revoked": r.revoked, "expired": r.expired(now),
                         "expiring": r.expiring(expiring_days, now), "from_csr": r.from_csr})
        return rows


def open_fleet(fleet: "Fleet | str | Path") -> Fleet:
    """``fleet`` itself, or the fleet opened at that path."""
    return fleet if isinstance(fleet, Fleet) else Fleet(fleet)

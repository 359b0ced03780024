"""The fleet certificate authority: one self-signed ECDSA P-256 CA that issues every identity.

Pure functions over ``cryptography`` objects; the fleet directory (files, inventory, serial
bookkeeping) is :mod:`provisioning.fleet`.

What an issued certificate lets its holder do is decided by its extensions, so they are
strict:

* **nodes** (device, gateway, coordinator): ``CN = node id``, EKU ``clientAuth`` only,
  ``CA:false``. The broker maps the CN to the MQTT username (``use_identity_as_username``)
  and the ACL grants topics by username, so the CN *is* the authorisation: it must be a
  valid fedtier id (no ``+``, ``#`` or ``/`` that could widen an ACL pattern).
* **brokers**: EKU ``serverAuth`` only, with a subjectAltName listing every host name and
  IP address clients dial (TLS clients check the SAN, not the CN). OpenSSL checks the
  purpose on both sides, so a broker certificate cannot log in as a client and a node
  certificate cannot impersonate a broker.
* **the CA**: ``CA:true, pathlen:0`` (it signs leaves only), key usage certSign + cRLSign.

Every leaf's ``notBefore`` is backdated a few minutes: a device whose clock runs slightly
behind would otherwise reject (or be rejected with) a certificate issued seconds ago.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from typing import Iterable, Sequence

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedtier.errors import LocalProtocolError
from fedtier.security import pki
from fedtier.transport.topics import check_id
from provisioning.errors import CsrError, InvalidNameError

CA_DAYS = 3650
"""Fleet CA lifetime (about 10 years): re-keying a CA means re-enrolling every node."""
NODE_DAYS = 365
"""Default lifetime of a node (device, gateway, coordinator) certificate."""
BROKER_DAYS = 825
"""Default lifetime of a broker's server certificate."""
CRL_DAYS = 365
"""How long a CRL stays valid. With ``crlfile`` set, Mosquitto (OpenSSL ``CRL_CHECK``)
refuses *every* client once the CRL's nextUpdate has passed, so it must be regenerated
(``fedtier provision crl``) and redistributed before then."""
CLOCK_SKEW = dt.timedelta(minutes=5)
"""How far ``notBefore`` is backdated."""


def utcnow() -> dt.datetime:
    """The current time, timezone-aware UTC."""
    return dt.datetime.now(dt.timezone.utc)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def create_ca(common_name: str = "fedtier fleet CA", *, days: int = CA_DAYS,
              key: ec.EllipticCurvePrivateKey | None = None,
              now: dt.datetime | None = None) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new self-signed fleet CA.

    Args:
        common_name: the CA's subject CN (informational).
        days: validity from now.
        key: the CA key; default a fresh ECDSA P-256 key.
        now: issue time (default the current time).

    Returns:
        ``(ca_key, ca_cert)``.
    """
    key = key or pki.generate_tls_key()
    now = now or utcnow()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def validity(days: float, *, now: dt.datetime | None = None) -> tuple[dt.datetime, dt.datetime]:
    """``(not_before, not_after)`` for a certificate valid ``days`` from now (backdated by the skew)."""
    if days <= 0:
        raise ValueError(f"validity must be positive, got {days} days")
    now = now or utcnow()
    return now - CLOCK_SKEW, now + dt.timedelta(days=days)


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, public_key: pki.PublicKey,
          common_name: str, eku: x509.ObjectIdentifier, not_before: dt.datetime, not_after: dt.datetime,
          serial: int | None, san: x509.SubjectAlternativeName | None) -> x509.Certificate:
    if not_after <= not_before:
        raise ValueError("not_after must be later than not_before")
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(public_key.curve, ec.SECP256R1):
        raise CsrError("TLS identities must be ECDSA P-256 keys (accepted by every broker and IoT cloud)")
    builder = (x509.CertificateBuilder()
               .subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(public_key)
               .serial_number(serial if serial is not None else x509.random_serial_number())
               .not_valid_before(not_before).not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def check_node_name(name: str, what: str = "node id") -> str:
    """``name`` if it is a valid fedtier id (it becomes a CN, an MQTT username and ACL ``%u``).

    Raises:
        InvalidNameError: the id has characters outside ``[A-Za-z0-9_.-]``, is empty, too
            long, or ``.``/``..``.
    """
    try:
        return check_id(name, what)
    except LocalProtocolError as exc:
        raise InvalidNameError(str(exc)) from None


def issue_node_certificate(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
                           public_key: pki.PublicKey, node_id: str, *, days: float = NODE_DAYS,
                           not_before: dt.datetime | None = None, not_after: dt.datetime | None = None,
                           serial: int | None = None) -> x509.Certificate:
    """A client certificate (EKU clientAuth) for a device, gateway or coordinator.

    Args:
        ca_key, ca_cert: the fleet CA.
        public_key: the node's ECDSA P-256 public key (from its CSR or a key generated here).
        node_id: the node id; becomes the CN (= MQTT client id and username).
        days: validity from now, unless ``not_before``/``not_after`` are given.
        not_before, not_after: an explicit validity window (e.g. an already expired one, for
            tests of the broker's rejection).
        serial: the serial number (default: 159 random bits, RFC 5280 §4.1.2.2).

    Returns:
        The signed certificate.

    Raises:
        InvalidNameError: ``node_id`` is not a valid fedtier id.
        CsrError: the key is not ECDSA P-256.
        ValueError: an empty validity window.
    """
    check_node_name(node_id)
    nb, na = validity(days)
    return _leaf(ca_key, ca_cert, public_key, node_id, ExtendedKeyUsageOID.CLIENT_AUTH,
                 not_before or nb, not_after or na, serial, None)


def subject_alt_names(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    """A SAN with each host as an IP address if it parses as one, else as a DNS name.

    Raises:
        ValueError: no hosts, or an empty host name.
    """
    if not hosts:
        raise ValueError("a broker certificate needs at least one host name or IP address")
    names: list[x509.GeneralName] = []
    for host in hosts:
        host = host.strip()
        if not host:
            raise ValueError("empty host name")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue_server_certificate(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
                             public_key: pki.PublicKey, name: str, hosts: Sequence[str], *,
                             days: float = BROKER_DAYS, not_before: dt.datetime | None = None,
                             not_after: dt.datetime | None = None, serial: int | None = None) -> x509.Certificate:
    """A broker's server certificate (EKU serverAuth, SAN = ``hosts``).

    Args:
        ca_key, ca_cert: the fleet CA.
        public_key: the broker's ECDSA P-256 public key.
        name: the broker's name (CN; informational — clients verify the SAN).
        hosts: every name or IP address clients use to reach the broker.
        days, not_before, not_after, serial: as for ``issue_node_certificate``.

    Returns:
        The signed certificate.

    Raises:
        InvalidNameError: ``name`` is not a valid fedtier id.
        ValueError: no hosts, or an empty validity window.
    """
    check_node_name(name, "broker name")
    nb, na = validity(days)
    return _leaf(ca_key, ca_cert, public_key, name, ExtendedKeyUsageOID.SERVER_AUTH,
                 not_before or nb, not_after or na, serial, subject_alt_names(hosts))


def check_csr(csr: x509.CertificateSigningRequest) -> str:
    """Verify a CSR before anything is issued for it; return its CN (the node id).

    A CSR proves possession of the private key (its self-signature) and names the node. A
    forged or altered CSR, a CN that is not a fedtier id (which would widen an ACL ``%u``
    pattern), or a key other than ECDSA P-256 is refused.

    Raises:
        CsrError: bad signature, missing/multiple CN, or wrong key type.
        InvalidNameError: the CN is not a valid fedtier id.
    """
    if not pki.csr_signature_valid(csr):
        raise CsrError("the CSR's signature does not verify (forged or altered request)")
    try:
        cn = pki.cert_common_name(csr)
    except ValueError as exc:
        raise CsrError(f"the CSR's subject: {exc}") from None
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise CsrError("TLS identities must be ECDSA P-256 keys (accepted by every broker and IoT cloud)")
    return check_node_name(cn)


def make_crl(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
             revoked: Iterable[tuple[int, dt.datetime]], *, crl_number: int, days: float = CRL_DAYS,
             now: dt.datetime | None = None) -> x509.CertificateRevocationList:
    """An X.509 v2 CRL signed by the CA listing ``revoked`` ``(serial, revocation time)`` pairs.

    Args:
        ca_key, ca_cert: the fleet CA.
        revoked: serials and when they were revoked (may be empty: an empty CRL is still
            required, since a broker with ``crlfile`` rejects everyone without a CRL).
        crl_number: monotonically increasing CRL number (RFC 5280 §5.2.3).
        days: nextUpdate from now (see ``CRL_DAYS``).
        now: thisUpdate (default now).

    Returns:
        The signed CRL.
    """
    now = now or utcnow()
    builder = (x509.CertificateRevocationListBuilder()
               .issuer_name(ca_cert.subject)
               .last_update(now - CLOCK_SKEW)
               .next_update(now + dt.timedelta(days=days))
               .add_extension(x509.CRLNumber(crl_number), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    for serial, when in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build())
    return builder.sign(ca_key, hashes.SHA256())


def verify_issued_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> bool:
    """Whether ``cert`` carries a valid signature of ``ca_cert``'s key (issuer name matches)."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True

"""fedtier.security.pki (key files, CSRs, key ids), provisioning.ca (certificates, CSR checks, CRLs), enroll()."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID

from device_agent.enroll import enroll
from fedtier.errors import ConfigError
from fedtier.security import pki
from provisioning import ca
from provisioning.errors import CsrError, InvalidNameError


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(scope="module")
def fleet_ca() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    return ca.create_ca("test CA")


# --- key files -------------------------------------------------------------------------------------


def test_private_keys_are_created_0600_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = pki.write_private_key(tmp_path / "k.pem", pki.generate_tls_key())
    finally:
        os.umask(old)
    assert mode(path) == 0o600
    assert b"PRIVATE KEY" in path.read_bytes()
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file is left behind"


def test_a_private_key_is_never_silently_overwritten(tmp_path: Path) -> None:
    path = pki.write_private_key(tmp_path / "k.pem", pki.generate_tls_key())
    before = path.read_bytes()
    with pytest.raises(FileExistsError):
        pki.write_private_key(path, pki.generate_tls_key())
    assert path.read_bytes() == before
    pki.write_private_key(path, pki.generate_signing_key(), overwrite=True)
    assert path.read_bytes() != before and mode(path) == 0o600


def test_public_files_are_0644_and_round_trip(tmp_path: Path) -> None:
    key = pki.generate_signing_key()
    pub = pki.write_public_pem(tmp_path / "s.pub", key)  # a private key's public half
    assert mode(pub) == 0o644 and b"PRIVATE" not in pub.read_bytes()
    loaded = pki.load_public_key(pub)
    assert pki.same_public_key(loaded, key.public_key())
    assert pki.key_id(loaded) == pki.key_id(key.public_key())


def test_loading_garbage_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a pem")
    for loader in (pki.load_private_key, pki.load_public_key, pki.load_certificate, pki.load_csr):
        with pytest.raises(ConfigError, match="bad.pem"):
            loader(bad)
    with pytest.raises(ConfigError, match="missing.pem"):
        pki.load_private_key(tmp_path / "missing.pem")
    pub = pki.write_public_pem(tmp_path / "p.pem", pki.generate_tls_key())
    with pytest.raises(ConfigError, match="p.pem"):
        pki.load_private_key(pub)


def test_key_id_is_sha256_of_the_raw_public_key() -> None:
    key = pki.generate_signing_key().public_key()
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert pki.key_id(key) == hashlib.sha256(raw).hexdigest()[:16]
    ec_key = pki.generate_tls_key().public_key()
    point = ec_key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    assert pki.key_id(ec_key) == hashlib.sha256(point).hexdigest()[:16]


def test_key_types_follow_the_conventions() -> None:
    assert isinstance(pki.generate_tls_key().curve, ec.SECP256R1)
    assert isinstance(pki.generate_signing_key(), ed25519.Ed25519PrivateKey)


# --- CA and certificates ------------------------------------------------------------------------------


def test_the_ca_is_a_self_signed_p256_ca(fleet_ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]) -> None:
    _, cert = fleet_ca
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign
    assert ca.verify_issued_by(cert, cert)
    assert cert.not_valid_after_utc - cert.not_valid_before_utc > dt.timedelta(days=3600)


def test_a_node_certificate_has_cn_clientauth_validity_and_chains(
        fleet_ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]) -> None:
    ca_key, ca_cert = fleet_ca
    key = pki.generate_tls_key()
    cert = ca.issue_node_certificate(ca_key, ca_cert, key.public_key(), "dev-01", days=30)
    assert pki.cert_common_name(cert) == "dev-01"
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    lifetime = cert.not_valid_after_utc - ca.utcnow()
    assert dt.timedelta(days=29, hours=23) < lifetime <= dt.timedelta(days=30)
    assert cert.not_valid_before_utc < ca.utcnow()  # backdated for clock skew
    assert ca.verify_issued_by(cert, ca_cert)
    other_key, other_ca = ca.create_ca("other")
    assert not ca.verify_issued_by(cert, other_ca)
    assert pki.same_public_key(cert.public_key(), key.public_key())  # type: ignore[arg-type]


def test_an_explicit_validity_window_can_lie_in_the_past(
        fleet_ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]) -> None:
    ca_key, ca_cert = fleet_ca
    now = ca.utcnow()
    cert = ca.issue_node_certificate(ca_key, ca_cert, pki.generate_tls_key().public_key(), "old",
                                     not_before=now - dt.timedelta(days=10), not_after=now - dt.timedelta(days=1))
    assert cert.not_valid_after_utc < now
    with pytest.raises(ValueError):
        ca.issue_node_certificate(ca_key, ca_cert, pki.generate_tls_key().public_key(), "x",
                                  not_before=now, not_after=now - dt.timedelta(days=1))


def test_a_broker_certificate_has_serverauth_and_ip_and_dns_sans(
        fleet_ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]) -> None:
    ca_key, ca_cert = fleet_ca
    cert = ca.issue_server_certificate(ca_key, ca_cert, pki.generate_tls_key().public_key(), "gw0",
                                       ["192.168.1.5", "gw0.local", "::1"])
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["gw0.local"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["192.168.1.5", "::1"]
    with pytest.raises(ValueError):
        ca.issue_server_certificate(ca_key, ca_cert, pki.generate_tls_key().public_key(), "gw0", [])


@pytest.mark.parametrize("name", ["", "a/b", "dev+1", "#", "..", "x" * 65, "dev 1", "dev\n"])
def test_a_name_that_could_widen_an_acl_is_refused(
        fleet_ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], name: str) -> None:
    ca_key, ca_cert = fleet_ca
    with pytest.raises(InvalidNameError):
        ca.issue_node_certificate(ca_key, ca_cert, pki.generate_tls_key().public_key(), name)


def test_tls_identities_must_be_p256(fleet_ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]) -> None:
    ca_key, ca_cert = fleet_ca
    with pytest.raises(CsrError):
        ca.issue_node_certificate(ca_key, ca_cert, pki.generate_signing_key().public_key(), "dev1")


# --- CSRs ------------------------------------------------------------------------------------------------


def test_a_valid_csr_yields_its_cn() -> None:
    key = pki.generate_tls_key()
    csr = pki.make_csr(key, "dev-7")
    assert ca.check_csr(csr) == "dev-7"
    assert pki.same_public_key(csr.public_key(), key.public_key())  # type: ignore[arg-type]


def test_a_forged_csr_is_refused() -> None:
    der = pki.make_csr(pki.generate_tls_key(), "dev-7").public_bytes(serialization.Encoding.DER)
    forged = x509.load_der_x509_csr(der.replace(b"dev-7", b"dev-8"))  # same length, signature now wrong
    assert pki.cert_common_name(forged) == "dev-8"
    with pytest.raises(CsrError, match="signature"):
        ca.check_csr(forged)


def test_a_csr_for_an_invalid_id_or_another_key_type_is_refused() -> None:
    with pytest.raises(InvalidNameError):
        ca.check_csr(pki.make_csr(pki.generate_tls_key(), "dev/7"))
    with pytest.raises(CsrError, match="P-256"):
        ca.check_csr(pki.make_csr(pki.generate_signing_key(), "dev7"))


# --- CRLs ------------------------------------------------------------------------------------------------


def test_a_crl_is_signed_by_the_ca_and_lists_the_serials(
        fleet_ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]) -> None:
    ca_key, ca_cert = fleet_ca
    now = ca.utcnow()
    crl = ca.make_crl(ca_key, ca_cert, [(1234, now), (99, now)], crl_number=3)
    assert crl.is_signature_valid(ca_cert.public_key())  # type: ignore[arg-type]
    assert {r.serial_number for r in crl} == {1234, 99}
    assert crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number == 3
    assert crl.next_update_utc is not None and crl.next_update_utc > now + dt.timedelta(days=300)
    empty = ca.make_crl(ca_key, ca_cert, [], crl_number=1)
    assert len(empty) == 0 and empty.is_signature_valid(ca_cert.public_key())  # type: ignore[arg-type]


# --- device enrollment -------------------------------------------------------------------------------


def test_enroll_makes_a_0600_key_and_a_csr_for_it(tmp_path: Path) -> None:
    csr_path = enroll("dev-3", tmp_path / "id")
    key_path = tmp_path / "id" / "key.pem"
    assert mode(key_path) == 0o600
    csr = pki.load_csr(csr_path)
    assert b"PRIVATE" not in csr_path.read_bytes()
    assert ca.check_csr(csr) == "dev-3"
    assert pki.same_public_key(csr.public_key(), pki.load_private_key(key_path).public_key())  # type: ignore[arg-type]


def test_enroll_never_replaces_a_key(tmp_path: Path) -> None:
    enroll("dev-3", tmp_path)
    before = (tmp_path / "key.pem").read_bytes()
    with pytest.raises(ConfigError, match="already exists"):
        enroll("dev-3", tmp_path)
    csr = pki.load_csr(enroll("dev-3", tmp_path, reuse_key=True))
    assert (tmp_path / "key.pem").read_bytes() == before
    assert pki.same_public_key(csr.public_key(), pki.load_private_key(tmp_path / "key.pem").public_key())  # type: ignore[arg-type]


def test_enroll_refuses_an_invalid_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid device id"):
        enroll("dev/3", tmp_path)
    assert not (tmp_path / "key.pem").exists()

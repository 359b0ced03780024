"""Keys, CSRs and certificates for every role, on ``cryptography`` only (field notes §3.5).

Conventions (shared by the fleet tooling in ``provisioning`` and by the device's own
enrollment in ``device_agent.enroll``):

* **TLS identities are ECDSA P-256.** It is the one curve every target accepts (Mosquitto
  with OpenSSL 1.1 and 3.x, AWS IoT, Mender); the certificate's CN is the node id, which is
  also the MQTT client id and, with ``use_identity_as_username``, the MQTT username the
  broker's ACL patterns (``%u``) substitute.
* **Manifest signing keys are Ed25519** (small, fast, deterministic signatures).
* **Key id** = the first 16 hex characters of sha256 over the *raw* public key bytes (the
  32 raw bytes of an Ed25519 key; the uncompressed X9.62 point of an EC key), so the same
  id names a key whatever file format it travels in (``fedtier.security.signing`` uses the same rule).

Threat model for key files: a private key is written once, by the process that generated
it, into a file that is created with mode 0600 (``os.open(..., 0o600)``), never chmod-ed
after the fact: a chmod after writing leaves a window in which another local user can open
the file and keep the descriptor. The file appears under its final name only when it is
complete (written to a temporary name, then linked/renamed), so a crash never leaves a
truncated key behind, and an existing key is never silently replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Union

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

from fedtier.errors import ConfigError

log = logging.getLogger("fedtier.security.pki")

PrivateKey = Union[ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey]
"""The private key types fedtier generates and loads."""
PublicKey = Union[ec.EllipticCurvePublicKey, ed25519.Ed25519PublicKey]
"""The public key types fedtier generates and loads."""

PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644


# --- generation ------------------------------------------------------------------------------


def generate_tls_key() -> ec.EllipticCurvePrivateKey:
    """A fresh ECDSA P-256 key for a TLS identity (device, gateway, coordinator, broker, CA).

    Returns:
        The private key (in memory only; write it with ``write_private_key``).
    """
    return ec.generate_private_key(ec.SECP256R1())


def generate_signing_key() -> ed25519.Ed25519PrivateKey:
    """A fresh Ed25519 key for signing rollout manifests.

    Returns:
        The private key (in memory only; write it with ``write_private_key``).
    """
    return ed25519.Ed25519PrivateKey.generate()


# --- writing -----------------------------------------------------------------------------------


def write_atomic(path: str | Path, data: bytes, mode: int, *, overwrite: bool) -> Path:
    """Write ``data`` to ``path`` created with ``mode``; the file appears complete or not at all.

    The temporary file is created with ``O_CREAT | O_EXCL`` and the final mode from the start
    (the umask can only narrow it), so the bytes are never readable by anyone the mode does
    not allow; it is flushed and fsync-ed, then replaces ``path`` (``overwrite``) or is
    hard-linked to it, which fails atomically if ``path`` exists — no check-then-create race.

    Args:
        path: destination file (its directory is created if missing).
        data: the complete contents.
        mode: permission bits, e.g. 0o600 for private keys.
        overwrite: replace an existing file.

    Returns:
        ``path``.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false.
    """
    path = Path(path)
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} exists (refusing to overwrite)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise FileExistsError(f"{path} exists (refusing to overwrite)") from None
            except OSError:  # a filesystem without hard links: exclusive create is the fallback
                _write_exclusive(path, data, mode)
            os.unlink(tmp)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def _write_exclusive(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _private_key_pem(key: PrivateKey) -> bytes:
    """Unencrypted PKCS#8 PEM of ``key`` (what Mosquitto, OpenSSL and paho load)."""
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_private_key(path: str | Path, key: PrivateKey, *, overwrite: bool = False) -> Path:
    """Write ``key`` as unencrypted PKCS#8 PEM to a file created with mode 0600.

    Args:
        path: destination file.
        key: an ECDSA or Ed25519 private key.
        overwrite: replace an existing file (atomically: readers see the old or the new key).

    Returns:
        ``path``.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false.
    """
    written = write_atomic(Path(path), _private_key_pem(key), PRIVATE_MODE, overwrite=overwrite)
    log.debug("wrote private key %s (mode 0600)", written)
    return written


def public_key_pem(key: PublicKey | PrivateKey) -> bytes:
    """SubjectPublicKeyInfo PEM of a public key (or of a private key's public half)."""
    public = key.public_key() if isinstance(key, (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey)) else key
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def write_public_pem(path: str | Path, key: PublicKey | PrivateKey, *, overwrite: bool = True) -> Path:
    """Write a public key (given directly or as a private key's public half) as PEM, mode 0644.

    Args:
        path: destination file.
        key: the public key, or a private key whose public half is written (never the secret).
        overwrite: replace an existing file.

    Returns:
        ``path``.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false.
    """
    return write_atomic(Path(path), public_key_pem(key), PUBLIC_MODE, overwrite=overwrite)


def write_certificate(path: str | Path, cert: x509.Certificate, *, overwrite: bool = True) -> Path:
    """Write a certificate as PEM, mode 0644 (certificates are public).

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false.
    """
    return write_atomic(Path(path), cert.public_bytes(serialization.Encoding.PEM), PUBLIC_MODE, overwrite=overwrite)


def write_csr(path: str | Path, csr: x509.CertificateSigningRequest, *, overwrite: bool = True) -> Path:
    """Write a CSR as PEM, mode 0644 (a CSR holds only the public key and the name).

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false.
    """
    return write_atomic(Path(path), csr.public_bytes(serialization.Encoding.PEM), PUBLIC_MODE, overwrite=overwrite)


# --- loading -------------------------------------------------------------------------------------


def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror or exc}", source=str(path)) from None


def load_private_key(path: str | Path) -> PrivateKey:
    """Load an unencrypted PEM private key (ECDSA or Ed25519).

    A key file readable by group or others is loaded but logged as a warning: it may have
    been copied around with the wrong mode.

    Raises:
        ConfigError: naming the file, if it is unreadable, not a PEM private key, encrypted,
            or of another key type.
    """
    data = _read(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"not a valid unencrypted PEM private key ({exc})", source=str(path)) from None
    if not isinstance(key, (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey)):
        raise ConfigError(f"unsupported private key type {type(key).__name__} (use ECDSA P-256 or Ed25519)",
                          source=str(path))
    with contextlib.suppress(OSError):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            log.warning("private key %s has mode %04o; it should be 0600", path, mode)
    return key


def load_public_key(path: str | Path) -> PublicKey:
    """Load a PEM public key (ECDSA or Ed25519).

    Raises:
        ConfigError: naming the file, if it is unreadable, not a PEM public key, or of
            another key type.
    """
    data = _read(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"not a valid PEM public key ({exc})", source=str(path)) from None
    if not isinstance(key, (ec.EllipticCurvePublicKey, ed25519.Ed25519PublicKey)):
        raise ConfigError(f"unsupported public key type {type(key).__name__}", source=str(path))
    return key


def load_certificate(path: str | Path) -> x509.Certificate:
    """Load a PEM X.509 certificate (the first one if the file holds a chain).

    Raises:
        ConfigError: naming the file, if it is unreadable or not a PEM certificate.
    """
    data = _read(path, "certificate")
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise ConfigError(f"not a valid PEM certificate ({exc})", source=str(path)) from None


def load_csr(path: str | Path) -> x509.CertificateSigningRequest:
    """Load a PEM certificate signing request (its signature is *not* checked here).

    Raises:
        ConfigError: naming the file, if it is unreadable or not a PEM CSR.
    """
    data = _read(path, "certificate signing request")
    try:
        return x509.load_pem_x509_csr(data)
    except ValueError as exc:
        raise ConfigError(f"not a valid PEM certificate signing request ({exc})", source=str(path)) from None


# --- names and ids -----------------------------------------------------------------------------


def make_csr(key: PrivateKey, common_name: str) -> x509.CertificateSigningRequest:
    """A CSR for ``common_name`` signed with ``key`` (proof that the requester holds the key).

    Args:
        key: the requester's private key; ECDSA is signed with SHA-256, Ed25519 with no
            separate hash (as Ed25519 requires).
        common_name: the node id (= MQTT client id and username).

    Returns:
        The signed CSR.
    """
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return builder.sign(key, None)
    return builder.sign(key, hashes.SHA256())


def csr_signature_valid(csr: x509.CertificateSigningRequest) -> bool:
    """Whether the CSR is signed by the private key of the public key it carries."""
    try:
        return bool(csr.is_signature_valid)
    except (InvalidSignature, ValueError, UnsupportedAlgorithm):
        return False


def raw_public_bytes(public_key: PublicKey) -> bytes:
    """The raw public key: 32 bytes for Ed25519, the uncompressed X9.62 point for EC."""
    if isinstance(public_key, ed25519.Ed25519PublicKey):
        return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return public_key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)


def key_id(public_key: PublicKey) -> str:
    """sha256 of the raw public key bytes, first 16 hex characters (field notes §3.5).

    Args:
        public_key: an Ed25519 or EC public key.

    Returns:
        16 lowercase hex characters, e.g. the file name ``trusted_keys/<key_id>.pub``.
    """
    return hashlib.sha256(raw_public_bytes(public_key)).hexdigest()[:16]


def cert_common_name(cert: x509.Certificate | x509.CertificateSigningRequest) -> str:
    """The single subject CN of a certificate or CSR.

    Raises:
        ValueError: the subject has no CN or several (fedtier identities have exactly one).
    """
    values = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(values) != 1:
        raise ValueError(f"expected exactly one subject CN, found {len(values)}")
    value = values[0].value
    return value if isinstance(value, str) else value.decode()


def same_public_key(a: PublicKey, b: PublicKey) -> bool:
    """Whether two public keys are the same key (compared by their raw bytes)."""
    if isinstance(a, ed25519.Ed25519PublicKey) != isinstance(b, ed25519.Ed25519PublicKey):
        return False
    return raw_public_bytes(a) == raw_public_bytes(b)

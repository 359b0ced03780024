"""Device-side enrollment: make this device's TLS key and a certificate signing request.

The private key is generated on the device and never leaves it (field notes §3.5): the
operator receives only the CSR (public key + name, signed with the key as proof of
possession), signs it with ``fedtier provision sign``, and returns a bundle without a key
(cert.pem, ca.pem, trusted_keys/, device.toml pointing at ``key.pem``) to unpack into the
same directory. The key file is created with mode 0600 from the start.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from fedtier.errors import ConfigError
from fedtier.security import pki
from fedtier.transport.topics import is_id

log = logging.getLogger("fedtier.agent")

KEY_NAME = "key.pem"


def enroll(name: str, out_dir: Path, *, reuse_key: bool = False) -> Path:
    """Create ``out_dir/key.pem`` (ECDSA P-256, mode 0600) and ``out_dir/<name>.csr`` for ``name``.

    Args:
        name: this device's id; becomes the certificate's CN, the MQTT client id and username.
        out_dir: the device's identity directory (created if missing).
        reuse_key: if ``key.pem`` already exists, make a new CSR for it instead of refusing
            (e.g. the CSR was lost). A new key always needs a new directory: an existing key
            is never overwritten.

    Returns:
        The CSR path (send this file to the operator; it holds no secret).

    Raises:
        ConfigError: ``name`` is not a valid fedtier id, ``key.pem`` exists (and not
            ``reuse_key``), or an existing key is unreadable or not ECDSA P-256.
    """
    if not is_id(name):
        raise ConfigError(f"invalid device id {name!r}: use 1-64 of A-Z a-z 0-9 _ . -", key="name")
    out_dir = Path(out_dir)
    key_path = out_dir / KEY_NAME
    if key_path.exists():
        if not reuse_key:
            raise ConfigError("a private key already exists here; refusing to replace it (a new key needs "
                              "a new directory)", source=str(key_path))
        key = pki.load_private_key(key_path)
        if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
            raise ConfigError("the device key must be ECDSA P-256", source=str(key_path))
    else:
        key = pki.generate_tls_key()
        try:
            pki.write_private_key(key_path, key)
        except FileExistsError:  # created concurrently: never overwrite a key
            raise ConfigError("a private key already exists here", source=str(key_path)) from None
    csr_path = pki.write_csr(out_dir / f"{name}.csr", pki.make_csr(key, name), overwrite=True)
    log.info("device %s: key %s (mode 0600), CSR %s, key id %s", name, key_path, csr_path,
             pki.key_id(key.public_key()))
    return csr_path

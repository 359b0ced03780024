"""Signed rollout manifests (Ed25519): the coordinator signs, edges and devices verify.

A signed manifest on the wire is canonical JSON::

    {"manifest": {...}, "signature": {"alg": "ed25519", "key_id": "<16 hex>", "sig": "<base64>"}}

where ``sig`` signs the manifest's own canonical bytes (``Manifest.encode()``). Verification
tries the key named by ``key_id`` among the node's trusted keys — several may be trusted at
once, so signing keys can be rotated. The manifest lists every artifact's sha256 and size, so
a verified manifest pins the exact bytes onnxruntime will load; ``fedtier.runtime.node_base`` adds the
version (no rollback, no replay) and expiry checks, which need the node's state and clock.

Only an Ed25519 key's holder can produce a manifest a node accepts: not the broker, not an edge
(honest-but-curious edges relay manifests but cannot alter them), not a stolen device.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from fedtier.errors import ConfigError, ManifestError, ManifestSignatureError, UnknownSigningKeyError
from fedtier.security.manifest import Manifest
from fedtier.training.layout import canonical_json

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# cryptography (and fedtier.security.pki, which imports it) load when a key is first loaded or a
# signature checked: an agent of an unsigned fleet never needs them, and they cost it about 6 MB
# (docs/benchmarks.md, "Agent footprint").

ALGORITHM = "ed25519"


def load_trusted_keys(paths: Iterable[Path]) -> dict[str, Ed25519PublicKey]:
    """Key id -> public key for each PEM file; ``ConfigError`` naming a file that is not one."""
    paths = list(paths)
    if not paths:  # an unsigned fleet: nothing to load, and no reason to load cryptography
        return {}
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from fedtier.security.pki import key_id

    keys: dict[str, Ed25519PublicKey] = {}
    for path in paths:
        try:
            key = serialization.load_pem_public_key(Path(path).read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"not a readable PEM public key: {exc}", source=str(path)) from None
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError("manifest signing keys must be Ed25519", source=str(path))
        keys[key_id(key)] = key
    return keys


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"not a readable PEM private key: {exc}", source=str(path)) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError("the manifest signing key must be Ed25519", source=str(path))
    return key


def sign(manifest: Manifest, key: Ed25519PrivateKey) -> bytes:
    """The signed form of ``manifest`` (what the coordinator publishes)."""
    from fedtier.security.pki import key_id

    signature = key.sign(manifest.encode())
    return canonical_json({"manifest": manifest.to_json(),
                           "signature": {"alg": ALGORITHM, "key_id": key_id(key.public_key()),
                                         "sig": base64.b64encode(signature).decode()}})


def open_manifest(data: bytes, trusted: Mapping[str, Ed25519PublicKey]) -> Manifest:
    """Parse a (signed) manifest, verifying its signature when ``trusted`` is not empty.

    Args:
        data: what arrived on a manifest topic.
        trusted: key id -> Ed25519 public key. Empty: signatures are not checked (a fleet
            without provisioning); unsigned manifests are then accepted too.

    Raises:
        ManifestError: not a manifest at all.
        ManifestSignatureError: unsigned while keys are trusted, or the signature is wrong.
        UnknownSigningKeyError: signed by a key id that is not trusted.
    """
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ManifestError(f"manifest is not JSON: {type(exc).__name__}") from None
    if isinstance(doc, dict) and "signature" in doc:
        signature, body = doc.get("signature"), doc.get("manifest")
        if not isinstance(signature, dict) or not isinstance(body, dict):
            raise ManifestError("signed manifest lacks 'manifest' or 'signature' objects")
        signed_bytes = canonical_json(body)
        if trusted:
            _verify(signed_bytes, signature, trusted)
        return Manifest.decode(signed_bytes)
    if trusted:
        raise ManifestSignatureError("manifest is not signed, but this node only accepts signed manifests")
    return Manifest.decode(data)


def _verify(signed_bytes: bytes, signature: Mapping[str, Any], trusted: Mapping[str, Ed25519PublicKey]) -> None:
    if signature.get("alg") != ALGORITHM:
        raise ManifestSignatureError(f"unsupported signature algorithm {signature.get('alg')!r}")
    from cryptography.exceptions import InvalidSignature

    kid = signature.get("key_id")
    if not isinstance(kid, str) or kid not in trusted:
        raise UnknownSigningKeyError(f"manifest signed by key {kid!r}, which is not trusted")
    try:
        raw = base64.b64decode(str(signature.get("sig", "")), validate=True)
        trusted[kid].verify(raw, signed_bytes)
    except (binascii.Error, ValueError, InvalidSignature):
        raise ManifestSignatureError(f"signature by key {kid} does not verify") from None


class ManifestGate:
    """What a node checks before it acts on a manifest, in the order of field notes §3.5:
    signature (a trusted key), then version (newer than installed: no rollback, no replay),
    then expiry. The artifact digests are checked by whoever downloads the files.

    Without trusted keys (an unprovisioned fleet) none of this is enforced: unsigned version and
    expiry fields prove nothing, and a coordinator restarted with fresh state legitimately
    counts versions from 1 again.
    """

    def __init__(self, trusted: Mapping[str, Ed25519PublicKey], installed_version: int = 0,
                 clock: Any = None) -> None:
        import time

        self.trusted = dict(trusted)
        self.installed_version = installed_version
        self.clock = clock or time.time
        self._installed_bytes: dict[str, bytes] = {}

    @property
    def enforcing(self) -> bool:
        return bool(self.trusted)

    def check(self, data: bytes) -> Manifest | None:
        """The manifest if it should be acted on; ``None`` for a redelivery of the installed one.

        Raises:
            ManifestError, ManifestSignatureError, UnknownSigningKeyError, StaleManifestError,
            ExpiredManifestError: why it is refused (all ``RemoteProtocolError``).
        """
        from fedtier.errors import ExpiredManifestError, StaleManifestError

        manifest = open_manifest(data, self.trusted)
        if self._installed_bytes.get(manifest.rollout) == data:
            return None
        if not self.enforcing:
            return manifest
        if manifest.version <= self.installed_version:
            raise StaleManifestError(f"manifest version {manifest.version} of {manifest.rollout} is not newer than "
                                     f"the installed {self.installed_version}")
        if manifest.expires is None or manifest.expires <= self.clock():
            raise ExpiredManifestError(f"manifest version {manifest.version} of {manifest.rollout} has expired")
        return manifest

    def installed(self, manifest: Manifest, data: bytes) -> None:
        """Record that ``manifest`` is now the node's current one (after its artifacts check out)."""
        self.installed_version = max(self.installed_version, manifest.version)
        self._installed_bytes[manifest.rollout] = data

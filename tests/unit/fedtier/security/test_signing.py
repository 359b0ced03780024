"""Manifest signatures and the gate every node applies: signature, version, expiry."""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedtier.errors import (
    ExpiredManifestError,
    ManifestSignatureError,
    StaleManifestError,
    UnknownSigningKeyError,
)
from fedtier.security.manifest import Manifest
from fedtier.security.pki import key_id
from fedtier.security.signing import ManifestGate, open_manifest, sign

KEY, OTHER = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
TRUSTED = {key_id(KEY.public_key()): KEY.public_key()}
BUNDLE = {"files": {"checkpoint": {"filename": "checkpoint", "sha256": "a" * 64, "size": 3}}}
NOW = 1_000_000.0


def manifest(version: int = 1, expires: float | None = NOW + 100, **kw: object) -> Manifest:
    return Manifest(rollout="r", version=version, algorithm="fedavg", bundle=BUNDLE, cells=("c",), rounds=2,
                    created=NOW, expires=expires, **kw)  # type: ignore[arg-type]


def test_a_signed_manifest_opens_with_the_trusted_key() -> None:
    m = manifest()
    assert open_manifest(sign(m, KEY), TRUSTED) == m


def test_a_tampered_manifest_or_signature_fails() -> None:
    doc = json.loads(sign(manifest(), KEY))
    doc["manifest"]["rounds"] = 99
    with pytest.raises(ManifestSignatureError):
        open_manifest(json.dumps(doc).encode(), TRUSTED)
    doc = json.loads(sign(manifest(), KEY))
    doc["signature"]["sig"] = base64.b64encode(b"\0" * 64).decode()
    with pytest.raises(ManifestSignatureError):
        open_manifest(json.dumps(doc).encode(), TRUSTED)
    doc["signature"]["sig"] = "not base64!"
    with pytest.raises(ManifestSignatureError):
        open_manifest(json.dumps(doc).encode(), TRUSTED)


def test_unknown_keys_and_unsigned_manifests_are_refused_when_keys_are_trusted() -> None:
    with pytest.raises(UnknownSigningKeyError):
        open_manifest(sign(manifest(), OTHER), TRUSTED)
    with pytest.raises(ManifestSignatureError, match="not signed"):
        open_manifest(manifest().encode(), TRUSTED)
    assert open_manifest(manifest().encode(), {}) == manifest()  # an unprovisioned fleet


def test_several_trusted_keys_allow_rotating_the_signing_key() -> None:
    both = {**TRUSTED, key_id(OTHER.public_key()): OTHER.public_key()}
    assert open_manifest(sign(manifest(), OTHER), both).version == 1


def test_the_gate_refuses_rollbacks_replays_and_expired_manifests() -> None:
    gate = ManifestGate(TRUSTED, installed_version=0, clock=lambda: NOW)
    v2 = sign(manifest(2), KEY)
    m = gate.check(v2)
    assert m is not None and m.version == 2
    gate.installed(m, v2)
    assert gate.check(v2) is None  # the same retained manifest again: nothing to do
    with pytest.raises(StaleManifestError):
        gate.check(sign(manifest(1), KEY))
    with pytest.raises(StaleManifestError):
        gate.check(sign(dataclasses.replace(manifest(2), rounds=5), KEY))  # same version, other content
    with pytest.raises(ExpiredManifestError):
        gate.check(sign(manifest(3, expires=NOW - 1), KEY))
    with pytest.raises(ExpiredManifestError):
        gate.check(sign(manifest(3, expires=None), KEY))


def test_without_trusted_keys_the_gate_enforces_nothing() -> None:
    gate = ManifestGate({}, installed_version=7, clock=lambda: NOW)
    assert gate.check(manifest(1, expires=NOW - 10).encode()) is not None

"""The cryptographic primitives of secure aggregation, all from ``cryptography``.

* **Key agreement**: X25519. Each device makes two fresh key pairs per round: ``c`` to encrypt
  the shares it sends to its neighbours, ``s`` to agree on the pairwise mask seed with each.
* **Key derivation**: HKDF-SHA256 of the X25519 shared secret, with an ``info`` that binds the
  purpose ("enc" or "mask") and the context (rollout, round, the two ids), so a key is never
  used for two things or in two rounds.
* **Authenticated encryption**: ChaCha20-Poly1305 with a random 96-bit nonce; the associated
  data binds sender, receiver and context, so the edge cannot move a ciphertext between pairs.
* **PRG**: the ChaCha20 keystream under a 32-byte seed, read as little-endian uint64 words and
  reduced to the ring (a power of two: reduction is a mask, with no bias).

``cryptography`` is imported when a primitive is first used, not with this module: every agent
imports the secure-aggregation messages (to decode them), and cryptography would cost the ones
that never run secure aggregation about 6 MB (docs/benchmarks.md, "Agent footprint").
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from fedtier.errors import MalformedShareError

KEY_BYTES = 32
NONCE_BYTES = 12


def new_private_key(entropy: Callable[[int], bytes] = os.urandom) -> bytes:
    """32 raw bytes of a fresh X25519 private key (from the OS CSPRNG unless a test seeds ``entropy``)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    key = X25519PrivateKey.from_private_bytes(entropy(KEY_BYTES))  # clamped by X25519 itself
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def public_key(private: bytes) -> bytes:
    """The raw 32-byte public key of a raw private key."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def check_public_key(data: bytes) -> bytes:
    """``data`` if it is a 32-byte X25519 public key, else ``MalformedShareError``."""
    if not isinstance(data, (bytes, bytearray)) or len(data) != KEY_BYTES:
        raise MalformedShareError(f"a public key is {KEY_BYTES} bytes")
    return bytes(data)


def agree(private: bytes, peer_public: bytes, purpose: str, context: bytes) -> bytes:
    """A 32-byte key both ends derive: HKDF(X25519(private, peer_public), info=purpose|context)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    try:
        shared = X25519PrivateKey.from_private_bytes(private).exchange(
            X25519PublicKey.from_public_bytes(check_public_key(peer_public)))
    except ValueError as exc:  # an all-zero shared secret: a low-order (malicious) public key
        raise MalformedShareError(f"key agreement failed: {exc}") from None
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=b"fedtier-secagg/" + purpose.encode() + b"/" + context).derive(shared)


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """nonce || ChaCha20-Poly1305(key, nonce, plaintext, associated)."""
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, ciphertext: bytes, associated: bytes) -> bytes:
    """The plaintext; ``MalformedShareError`` if it was altered, misrouted or is not ours."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    if len(ciphertext) < NONCE_BYTES + 16:
        raise MalformedShareError("ciphertext too short")
    try:
        return ChaCha20Poly1305(key).decrypt(ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:], associated)
    except InvalidTag:
        raise MalformedShareError("share ciphertext does not authenticate") from None


def prg(seed: bytes, size: int, bits: int) -> np.ndarray:
    """``size`` pseudo-random elements of Z_{2^bits} (uint64) expanded from a 32-byte ``seed``."""
    if len(seed) != KEY_BYTES:
        raise ValueError("a PRG seed is 32 bytes")
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    encryptor = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor()
    words = np.frombuffer(encryptor.update(b"\0" * (8 * size)), dtype="<u8").astype(np.uint64)
    return words & np.uint64((1 << bits) - 1) if bits < 64 else words

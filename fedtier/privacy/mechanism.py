"""The Gaussian mechanism on an upload: clip -> add noise (then the caller quantizes).

Order matters (digest §8 check 10): clipping bounds the sensitivity, the noise is calibrated to
it, and quantization comes last because post-processing cannot weaken differential privacy.

Clipping acts on the *model delta since the last public model* — what a device uploads — not
on per-example gradients, which onnxruntime-training does not expose; a delta with L2 norm
at most C moves by at most 2C when one training record is replaced, whatever the optimizer.

Noise comes from ``NoiseSource``: a generator seeded from the operating system's CSPRNG
(``secrets``) when the node starts. The seed is never written anywhere, so nobody — not an
edge, not the coordinator, not a later reader of the node's disk — can subtract the noise.
Each release draws from its own stream, named by what is released (rollout, node, round,
step, tensor), so the noise of one release does not depend on the order of earlier ones — and
a stream is drawn at most once: ``add`` refuses labels it has already used, because the same
noise on a second, different input would make the difference of the two releases exact (the
roles never release a (round, step) twice; this is the defence behind them). A restarted node
draws a fresh seed, so nothing it releases can share noise with what it released before.
A fixed seed exists for reproducible *simulations* only.

``secure=True`` (``[privacy] secure_noise``) hardens the draw against floating-point attacks on
the Gaussian sampler (Mironov 2012 for Laplace; Holohan & Braghin 2021 for Gaussian samplers):
the stream's bytes come from ChaCha20 keyed by HMAC-SHA256(secret seed, labels) — a CSPRNG
instead of PCG64 — and, as Opacus' secure mode does, each coordinate is the sum of four
independent Gaussians of std ``sigma`` divided by 2 (still std ``sigma``), which smooths the
gaps a single float sample leaves in the tails. Its cost is measured in
``benchmarks/bench_secure_noise.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from typing import Any, Mapping

import numpy as np

from fedtier.errors import PrivacyViolationError

Tensors = Mapping[str, np.ndarray]


def l2_norm(tensors: Tensors) -> float:
    """The L2 norm of all tensors together (float64)."""
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(t, dtype=np.float64)))) for t in tensors.values()))


def clip(tensors: Tensors, bound: float) -> tuple[dict[str, np.ndarray], float]:
    """Scale ``tensors`` so their joint L2 norm is at most ``bound``.

    Returns the tensors and the factor applied (1.0: returned unchanged, bit for bit — a
    clean update under a trusted edge is exactly what training produced).
    """
    if not bound > 0:
        raise ValueError(f"clip bound must be > 0, got {bound!r}")
    norm = l2_norm(tensors)
    if not math.isfinite(norm):
        raise ValueError("cannot clip a non-finite update")
    if norm <= bound:
        return {n: np.asarray(t, dtype=np.float32) for n, t in tensors.items()}, 1.0
    factor = bound / norm
    return {n: (np.asarray(t, dtype=np.float64) * factor).astype(np.float32) for n, t in tensors.items()}, factor


class NoiseSource:
    """Gaussian noise from a secret seed: one independent stream per labelled release."""

    def __init__(self, seed: int | None = None) -> None:
        """
        Args:
            seed: ``None`` (every real node): 128 bits from the OS CSPRNG, kept in memory only.
                An int: reproducible noise, for simulations and tests — never in deployment.
        """
        self._entropy = secrets.randbits(128) if seed is None else int(seed)
        self.reproducible = seed is not None
        self._drawn: set[bytes] = set()  # digests of the label tuples ``add`` has used

    def generator(self, *labels: Any) -> np.random.Generator:
        digest = hashlib.sha256(repr(labels).encode()).digest()
        key = [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]
        return np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(self._entropy, spawn_key=key)))

    def secure_normal(self, shape: tuple[int, ...], *labels: Any) -> np.ndarray:
        """Standard normals of ``shape`` from a CSPRNG stream (ChaCha20 keyed by HMAC(seed, labels)), each the sum
        of four Box-Muller Gaussians divided by 2 (Opacus' secure mode): see the module docstring."""
        count = int(np.prod(shape, dtype=np.int64))
        key = hmac.new(self._entropy.to_bytes(32, "little", signed=True), repr(labels).encode(),
                       hashlib.sha256).digest()
        # 4 Gaussians per value, 2 per Box-Muller pair of uniforms: 4 uniforms (8 bytes each) per value.
        need = 4 * count
        # Imported here: only secure_noise needs it, and cryptography costs an agent 6 MB (docs/benchmarks.md).
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        stream = Cipher(algorithms.ChaCha20(key, b"\x00" * 16), mode=None).encryptor()
        raw = np.frombuffer(stream.update(b"\x00" * (8 * need)), dtype="<u8")
        uniforms = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)  # (0, 1)
        u1, u2 = uniforms[0::2], uniforms[1::2]
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = 2.0 * np.pi * u2
        normals = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])  # 4 * count
        return (normals.reshape(4, count).sum(axis=0) / 2.0).reshape(shape)

    def add(self, tensors: Tensors, sigma: float, *labels: Any, secure: bool = False) -> dict[str, np.ndarray]:
        """``tensors + N(0, sigma^2 I)``, each tensor from stream ``(*labels, name)``; float32 out.
        ``secure``: draw with :meth:`secure_normal` (CSPRNG, sum of Gaussians) instead of PCG64.

        Raises:
            PrivacyViolationError: ``labels`` were drawn before (the same noise twice); nothing is drawn.
        """
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"noise sigma must be finite and >= 0, got {sigma!r}")
        used = hashlib.sha256(repr(labels).encode()).digest()
        if used in self._drawn:
            raise PrivacyViolationError(f"noise stream {labels!r} was already drawn: a second release of it would "
                                        "reuse its noise")
        self._drawn.add(used)
        out: dict[str, np.ndarray] = {}
        for name in sorted(tensors):
            t = np.asarray(tensors[name], dtype=np.float64)
            if secure:
                noise = self.secure_normal(t.shape, *labels, name) * sigma
            else:
                noise = self.generator(*labels, name).standard_normal(t.shape) * sigma
            out[name] = (t + noise).astype(np.float32)
        return out

    def __repr__(self) -> str:  # never show the seed
        return f"NoiseSource(reproducible={self.reproducible})"

"""Shamir secret sharing over the prime field GF(2^521 - 1).

Why this field: the secrets secure aggregation shares are 32-byte values (an X25519 private
key and a self-mask seed), and a byte string is shared as one field element, so the prime
must exceed 2^256. The Mersenne prime 2^521 - 1 is the smallest well-known prime that does
(no primality certificate to carry around) and reduction modulo it is cheap; a share is 66
bytes. Any ``threshold`` shares give the secret back (Lagrange interpolation at 0); fewer
give a value that is uniformly distributed over the field whatever the secret was, so
``combine`` on ``threshold - 1`` shares returns garbage, not an error: there is nothing to
detect. Callers that must know (the edge reconstructing a mask key) check the result against
a public value (the advertised public key).

Coefficients come from ``secrets`` (the OS CSPRNG) unless a test passes its own ``randbelow``.
"""

from __future__ import annotations

import secrets as _secrets
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from fedtier.errors import LocalProtocolError, MalformedShareError

PRIME = (1 << 521) - 1
"""The field's modulus, the Mersenne prime M521."""
SHARE_BYTES = 66
"""A share's value on the wire: big-endian, ``ceil(521 / 8)`` bytes."""
MAX_SECRET_BYTES = 65
"""Secrets up to 520 bits fit below ``PRIME`` whatever their bytes are."""
MAX_SHARES = 65535


@dataclass(frozen=True, slots=True)
class Share:
    """One point ``(x, y)`` of the sharing polynomial; ``x`` in 1..65535 (0 would be the secret)."""

    x: int
    y: int

    def to_bytes(self) -> bytes:
        return self.x.to_bytes(2, "big") + self.y.to_bytes(SHARE_BYTES, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> "Share":
        """Parse a share from the wire; ``MalformedShareError`` unless it is a valid point."""
        if not isinstance(data, (bytes, bytearray)) or len(data) != 2 + SHARE_BYTES:
            raise MalformedShareError(f"a share is {2 + SHARE_BYTES} bytes, got {len(data) if data else 0}")
        x = int.from_bytes(data[:2], "big")
        y = int.from_bytes(data[2:], "big")
        if x == 0 or y >= PRIME:
            raise MalformedShareError("share point outside the field")
        return cls(x, y)


def split(secret: bytes, xs: Sequence[int], threshold: int,
          randbelow: Callable[[int], int] = _secrets.randbelow) -> list[Share]:
    """Share ``secret`` at the points ``xs`` so that any ``threshold`` of them recover it.

    Args:
        secret: up to ``MAX_SECRET_BYTES`` bytes (read as a big-endian integer).
        xs: distinct evaluation points in 1..65535 (one per holder).
        threshold: shares needed, 1..len(xs).
        randbelow: source of the random coefficients (default: the OS CSPRNG).
    """
    if len(secret) > MAX_SECRET_BYTES:
        raise LocalProtocolError(f"secret of {len(secret)} bytes; at most {MAX_SECRET_BYTES} fit the field")
    if not 1 <= threshold <= len(xs):
        raise LocalProtocolError(f"threshold {threshold} must be in 1..{len(xs)} (the number of shares)")
    if len(set(xs)) != len(xs) or not all(isinstance(x, int) and 0 < x <= MAX_SHARES for x in xs):
        raise LocalProtocolError("share points must be distinct ints in 1..65535")
    coefficients = [int.from_bytes(secret, "big")] + [randbelow(PRIME) for _ in range(threshold - 1)]
    return [Share(x, _evaluate(coefficients, x)) for x in xs]


def combine(shares: Iterable[Share], length: int) -> bytes:
    """The secret (``length`` bytes) the polynomial through ``shares`` has at 0.

    With at least the threshold of shares of one sharing this is the secret; with fewer it is an
    unrelated value (``MalformedShareError`` only if it does not even fit ``length`` bytes).
    """
    points = list(shares)
    xs = [s.x for s in points]
    if not points or len(set(xs)) != len(xs):
        raise MalformedShareError("need at least one share and distinct share points")
    value = 0
    for i, si in enumerate(points):
        num, den = 1, 1
        for j, sj in enumerate(points):
            if i != j:
                num = num * (-sj.x) % PRIME
                den = den * (si.x - sj.x) % PRIME
        value = (value + si.y * num * pow(den, -1, PRIME)) % PRIME
    if value >= 1 << (8 * length):
        raise MalformedShareError(f"shares do not combine to a {length}-byte secret")
    return value.to_bytes(length, "big")


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    acc = 0
    for c in reversed(coefficients):
        acc = (acc * x + c) % PRIME
    return acc

"""Shamir sharing over GF(2^521 - 1): any t shares recover, t - 1 do not, shares parse strictly."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedtier.errors import LocalProtocolError, MalformedShareError
from fedtier.secagg import shamir


def test_prime_is_m521_and_a_32_byte_secret_fits() -> None:
    assert shamir.PRIME == 2**521 - 1
    assert pow(3, shamir.PRIME - 1, shamir.PRIME) == 1  # Fermat witness (M521 is a known Mersenne prime)
    assert (1 << 256) < shamir.PRIME


def test_every_subset_of_threshold_size_recovers_the_secret() -> None:
    secret = os.urandom(32)
    shares = shamir.split(secret, list(range(1, 7)), 3)
    for subset in itertools.combinations(shares, 3):
        assert shamir.combine(subset, 32) == secret
    assert shamir.combine(shares, 32) == secret  # more than t also works


def test_fewer_than_threshold_give_garbage() -> None:
    secret = os.urandom(32)
    shares = shamir.split(secret, list(range(1, 7)), 4)
    for subset in itertools.combinations(shares, 3):
        try:
            assert shamir.combine(subset, 32) != secret
        except MalformedShareError:
            pass  # the interpolated value does not even fit 32 bytes


def test_t_minus_one_shares_are_consistent_with_any_secret() -> None:
    """Information-theoretic hiding: for t - 1 fixed shares and *any* candidate secret there is a
    degree t - 1 polynomial through them; we build it and check it reproduces the shares."""
    shares = shamir.split(b"\x01" * 32, [1, 2, 3, 4, 5], 3)
    seen = shares[:2]
    other = b"\x02" * 32
    # The polynomial through (0, other) and the two seen shares interpolates them exactly.
    full = [shamir.Share(0, int.from_bytes(other, "big"))] + seen
    for s in seen:
        assert _interpolate(full, s.x) == s.y


def _interpolate(points: list[shamir.Share], x: int) -> int:
    p = shamir.PRIME
    value = 0
    for i, si in enumerate(points):
        num, den = 1, 1
        for j, sj in enumerate(points):
            if i != j:
                num = num * (x - sj.x) % p
                den = den * (si.x - sj.x) % p
        value = (value + si.y * num * pow(den, -1, p)) % p
    return value


@settings(max_examples=40, deadline=None)
@given(secret=st.binary(min_size=0, max_size=32), n=st.integers(1, 9), data=st.data())
def test_property_any_t_of_n_recover(secret: bytes, n: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, n))
    xs = data.draw(st.lists(st.integers(1, 65535), min_size=n, max_size=n, unique=True))
    shares = shamir.split(secret, xs, t)
    subset = data.draw(st.permutations(shares)).__getitem__(slice(0, t))
    assert shamir.combine(subset, 32) == secret.rjust(32, b"\0")


def test_share_bytes_round_trip_and_strict_parsing() -> None:
    share = shamir.split(os.urandom(32), [7, 9], 2)[0]
    assert shamir.Share.from_bytes(share.to_bytes()) == share
    with pytest.raises(MalformedShareError):
        shamir.Share.from_bytes(share.to_bytes()[:-1])
    with pytest.raises(MalformedShareError):
        shamir.Share.from_bytes(b"\0\0" + share.to_bytes()[2:])  # x = 0 is the secret's point
    with pytest.raises(MalformedShareError):
        shamir.Share.from_bytes(b"\0\1" + b"\xff" * shamir.SHARE_BYTES)  # y >= p


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(LocalProtocolError):
        shamir.split(b"x", [1, 2], 3)
    with pytest.raises(LocalProtocolError):
        shamir.split(b"x", [1, 1], 2)
    with pytest.raises(LocalProtocolError):
        shamir.split(b"x" * 66, [1, 2], 2)
    with pytest.raises(MalformedShareError):
        shamir.combine([], 32)

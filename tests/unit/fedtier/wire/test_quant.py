"""QSGD: unbiased, the exact relative variance, and a lossless, compact, strictly checked codec."""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedtier import wire
from fedtier.errors import LocalProtocolError, NonFiniteTensorError, TensorSpecError
from fedtier.rng import stream
from fedtier.wire import quant

R = 10_000


def draws(x: np.ndarray, bits: int, n: int = R, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([quant.qsgd(x, bits, rng).values.astype(np.float64) for _ in range(n)])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_unbiased_within_four_standard_errors(bits: int) -> None:
    # Prepare: one Gaussian vector, 10,000 independent quantizations.
    x = np.random.default_rng(1).normal(size=100).astype(np.float32)
    s, norm = quant.levels(bits), float(np.linalg.norm(x.astype(np.float64)))
    frac = np.abs(x) / norm * s % 1.0
    # Execute
    mean = draws(x, bits).mean(axis=0)
    # Assert: per coordinate, |mean - x| < 4 standard errors of the mean (Var = ‖x‖² v(1-v)/s²).
    se = np.sqrt(norm**2 * frac * (1 - frac) / s**2 / R)
    random = frac > 1e-9
    assert np.all(np.abs(mean - x)[random] < 4 * se[random])
    np.testing.assert_allclose(mean[~random], x[~random], rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits,d", [(2, 10), (3, 100), (4, 1000), (8, 1000)])
def test_relative_variance_matches_q_exact_and_the_bound(bits: int, d: int) -> None:
    x = np.random.default_rng(2).normal(size=d).astype(np.float32)
    q = quant.q_exact(x, bits)
    errors = draws(x, bits, n=R if d <= 100 else 2000) - x.astype(np.float64)
    empirical = float(np.mean(np.sum(errors**2, axis=1)) / np.sum(x.astype(np.float64) ** 2))
    assert abs(empirical - q) <= 0.02 * q
    assert q < quant.variance_bound(d, bits)


def test_q_exact_is_what_qsgd_reports() -> None:
    x = np.random.default_rng(3).normal(size=50)
    assert quant.qsgd(x, 3, np.random.default_rng(0)).q_exact == pytest.approx(quant.q_exact(x, 3), rel=1e-12)


def test_zero_one_hot_scale_and_grid() -> None:
    rng = np.random.default_rng(4)
    assert not quant.qsgd(np.zeros(7), 4, rng).values.any()
    one_hot = np.zeros(9, np.float32)
    one_hot[3] = -2.5
    assert np.array_equal(quant.qsgd(one_hot, 3, rng).values, one_hot)  # every a_i is a multiple of 1/s
    x = np.random.default_rng(5).normal(size=64).astype(np.float32)
    a = quant.qsgd(x, 4, np.random.default_rng(9))
    b = quant.qsgd(np.float32(3.0) * x, 4, np.random.default_rng(9))  # Q(cx) = cQ(x), same uniforms
    np.testing.assert_allclose(b.values, 3.0 * a.values, rtol=1e-6)
    s = quant.levels(4)
    k = a.values.astype(np.float64) * s / float(a.norm)
    np.testing.assert_allclose(k, np.rint(k), atol=1e-4)
    assert np.all(np.abs(a.values) <= a.norm * (1 + 1e-6))
    assert np.all((np.sign(a.values) == 0) | (np.sign(a.values) == np.sign(x)))


def test_streams_of_different_senders_are_independent() -> None:
    x = np.random.default_rng(6).normal(size=200)
    a = quant.qsgd(x, 2, stream(0, "q1", "r", "dev-0", 0, 0, "w")).values
    b = quant.qsgd(x, 2, stream(0, "q1", "r", "dev-1", 0, 0, "w")).values
    c = quant.qsgd(x, 2, stream(0, "q1", "r", "dev-0", 0, 0, "w")).values
    assert not np.array_equal(a, b) and np.array_equal(a, c)


# --- the wire encoding ----------------------------------------------------------------------------


def encode_q(values: np.ndarray, qz: quant.Quantized) -> bytes:
    env = wire.Envelope(type="t", rollout="r", round=0, sender="s", key="k", tensors={"g": values},
                        encodings={"g": wire.TensorEncoding("qsgd", {"bits": qz.bits, "norm": qz.norm})})
    return wire.encode(env)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("d", [1, 7, 1000, 12345])
def test_encoded_size_is_codes_plus_norm_with_a_small_header(bits: int, d: int) -> None:
    x = np.random.default_rng(d).normal(size=d).astype(np.float32)
    qz = quant.qsgd(x, bits, np.random.default_rng(0))
    enc = wire.ENCODINGS["qsgd"].encode(qz.values, {"bits": bits, "norm": qz.norm})
    assert len(enc.data) == math.ceil(d * bits / 8) + 4
    spec = {"n": "gradient.fc0.weight", "e": "qsgd", "sh": [d], "nb": len(enc.data), **enc.spec}
    assert len(msgpack.packb(spec, use_bin_type=True)) <= 64


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(bits=st.integers(2, 8), shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
       seed=st.integers(0, 2**32 - 1))
def test_decode_of_encode_is_q_exactly(bits: int, shape: list[int], seed: int) -> None:
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    qz = quant.qsgd(x, bits, np.random.default_rng(seed))
    back = wire.decode(encode_q(qz.values, qz)).tensors["g"]
    assert back.shape == tuple(shape) and back.dtype == np.float32
    assert np.array_equal(back, qz.values)


def test_encoding_refuses_values_off_the_grid() -> None:
    x = np.random.default_rng(7).normal(size=10).astype(np.float32)
    qz = quant.qsgd(x, 4, np.random.default_rng(0))
    with pytest.raises(LocalProtocolError, match="not on the QSGD grid"):
        encode_q(x, qz)


def _tamper(payload: bytes, *, spec: dict | None = None, body: bytes | None = None) -> bytes:
    import hashlib

    _, _, hlen = struct.unpack_from(">4sBI", payload, 0)
    header = msgpack.unpackb(payload[9:9 + hlen], raw=False)
    data = payload[9 + hlen:] if body is None else body
    if spec:
        header["ts"][0].update(spec)
    header["sha"] = hashlib.sha256(data).digest()
    packed = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">4sBI", b"FTEN", 1, len(packed)) + packed + data


@pytest.fixture
def valid() -> tuple[bytes, bytes]:
    x = np.random.default_rng(8).normal(size=13).astype(np.float32)
    qz = quant.qsgd(x, 3, np.random.default_rng(0))
    payload = encode_q(qz.values, qz)
    _, _, hlen = struct.unpack_from(">4sBI", payload, 0)
    return payload, payload[9 + hlen:]


@pytest.mark.parametrize("bits", [1, 9, 0, -3, "4", True, None])
def test_bits_out_of_range_are_rejected(valid, bits) -> None:
    payload, _ = valid
    with pytest.raises(TensorSpecError, match="bits"):
        wire.decode(_tamper(payload, spec={"b": bits}))


def test_code_length_mismatch_is_rejected(valid) -> None:
    payload, body = valid
    with pytest.raises(TensorSpecError):
        wire.decode(_tamper(payload, spec={"nb": len(body) + 1}, body=body + b"\x00"))
    with pytest.raises(TensorSpecError):
        wire.decode(_tamper(payload, spec={"b": 4}))  # same bytes read at another width: wrong length


@pytest.mark.parametrize("norm,error", [(-1.0, TensorSpecError), (float("nan"), NonFiniteTensorError),
                                        (float("inf"), NonFiniteTensorError)])
def test_bad_norms_are_rejected(valid, norm: float, error: type) -> None:
    payload, body = valid
    with pytest.raises(error):
        wire.decode(_tamper(payload, body=struct.pack("<f", norm) + body[4:]))


def test_unused_codes_and_padding_are_rejected(valid) -> None:
    payload, body = valid
    codes = bytearray(body[4:])
    codes[0] |= 0b11100000  # code 7 at 3 bits: above 2s = 6
    with pytest.raises(TensorSpecError, match="code above"):
        wire.decode(_tamper(payload, body=body[:4] + bytes(codes)))
    codes = bytearray(body[4:])
    codes[-1] |= 0b00000001  # 13 values x 3 bits = 39 bits: bit 40 is padding
    with pytest.raises(TensorSpecError, match="padding"):
        wire.decode(_tamper(payload, body=body[:4] + bytes(codes)))


def _unpack_reference(data: bytes, bits: int, numel: int) -> np.ndarray:
    """The straightforward bit-matrix decoding the vectorized ``unpack`` must equal."""
    all_bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    matrix = all_bits[: numel * bits].reshape(numel, bits).astype(np.int64)
    return (matrix @ (1 << np.arange(bits - 1, -1, -1)) - quant.levels(bits)).astype(np.int16)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(2, 8), numel=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_unpack_equals_the_bit_matrix_decoding_and_inverts_pack(bits: int, numel: int, seed: int) -> None:
    s = quant.levels(bits)
    k = np.random.default_rng(seed).integers(-s, s + 1, size=numel).astype(np.int16)
    data = quant.pack(k, bits)
    got = quant.unpack(data, bits, numel)
    assert got.dtype == np.int16
    assert np.array_equal(got, k) and np.array_equal(got, _unpack_reference(data, bits, numel))
    if (numel * bits) % 8:  # a set padding bit is refused on every path
        bad = bytearray(data)
        bad[-1] |= 1
        with pytest.raises(ValueError, match="padding"):
            quant.unpack(bytes(bad), bits, numel)


@settings(max_examples=80, deadline=None)
@given(bits=st.integers(2, 8), numel=st.sampled_from([0, 1, 2, 3, 5, 8, 13, 64, 8191, 8193, 2 * 8192 * 4 + 3]),
       seed=st.integers(0, 2**16), norm=st.sampled_from([0.0, 1e-30, 0.37, 1.0, 123.25, 3e37]))
def test_decode_values_is_dequantize_of_unpack_bit_for_bit(bits: int, numel: int, seed: int, norm: float) -> None:
    s = quant.levels(bits)
    k = np.random.default_rng(seed).integers(-s, s + 1, size=numel).astype(np.int16)
    data = quant.pack(k, bits)

    values, finite = quant.decode_values(data, np.float32(norm), bits, numel)

    with np.errstate(over="ignore"):  # 3e37 * s overflows for the wider codes
        want = quant.dequantize(np.float32(norm), quant.unpack(data, bits, numel), s)
    assert values.dtype == np.float32 and values.shape == (numel,)
    assert np.array_equal(values.view(np.uint32), want.view(np.uint32))  # the same bits, zeros' signs too
    if finite:
        assert np.isfinite(values).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_decode_values_refuses_the_unused_code_in_every_slot_and_bad_padding(bits: int) -> None:
    s, per = quant.levels(bits), 8 // bits
    numel = 3 * per - 1 if per > 1 else 3  # the last byte has one padding slot (none at 8 bits)
    data = quant.pack(np.zeros(numel, np.int16), bits)
    for slot in range(numel):
        bad = bytearray(data)
        shift = bits * (per - 1 - slot % per)
        bad[slot // per] |= ((1 << bits) - 1) << shift  # code 2^bits - 1 = 2s + 1
        with pytest.raises(ValueError, match="code above"):
            quant.decode_values(bytes(bad), np.float32(1.0), bits, numel)
    if per > 1:
        padded = bytearray(data)
        padded[-1] |= 1
        with pytest.raises(ValueError, match="padding"):
            quant.decode_values(bytes(padded), np.float32(1.0), bits, numel)
    with pytest.raises(ValueError, match="code bytes"):
        quant.decode_values(data + b"\x00", np.float32(1.0), bits, numel)
    assert s > 0


def test_a_norm_that_overflows_the_used_levels_is_non_finite_on_the_wire() -> None:
    with np.errstate(over="ignore"):
        assert not np.isfinite(quant.dequantize(np.float32(3e38), np.array([7], np.int16), 7)).all()  # 3e38 * 7
    codes = quant.pack(np.array([0, 7, -7, 1], np.int16), 4)

    values, finite = quant.decode_values(codes, np.float32(3e38), 4, 4)

    assert not finite and not np.isfinite(values).all()

"""fedtier.wire: the row codecs of HSGD's vertical path, ``qrows`` (QSGD scaled by each row's largest
magnitude) and ``topk`` (each row's k largest entries).

What they must do beyond a round trip: encoding is a pure function of the values, so an edge that
decodes rows and re-encodes them (stacking the devices' rows, slicing the host's) sends the same bytes
with no second loss; the bytes are what ``quant.qrows_size`` / ``quant.topk_size`` say (the meter's
sizes); and whatever bytes arrive, decoding returns a tensor or raises a typed ``DecodeError``.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedtier import wire
from fedtier.errors import DecodeError, LocalProtocolError, NonFiniteTensorError, TensorSpecError
from fedtier.wire import Envelope, TensorEncoding, quant

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
PREFIX = struct.Struct(">4sBI")


def envelope(tensors: dict[str, np.ndarray], encodings: dict[str, TensorEncoding]) -> bytes:
    return wire.encode(Envelope(type="hsgd_partner", rollout="r", round=0, sender="cell", key="k", tensors=tensors,
                                encodings=encodings))


def sealed(specs: list[dict[str, Any]], body: bytes) -> bytes:
    header = {"t": "x", "ro": "r", "r": 0, "st": 0, "s": "s", "k": "k", "sha": hashlib.sha256(body).digest(),
              "m": {}, "ts": specs}
    packed = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(b"FTEN", 1, len(packed)) + packed + body


def body_bytes(data: bytes) -> int:
    return sum(spec["nb"] for spec in wire.peek_header(data)["ts"])


# --- qrows -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 5, 7, 8])
@pytest.mark.parametrize("shape", [(1, 8), (5, 8), (3, 1), (7,), (), (0, 4), (2, 3, 4)])
def test_qrows_round_trip_and_size(bits: int, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(bits)
    x = rng.normal(size=shape).astype(np.float32)
    q = quant.qrows(x, bits, rng)

    data = envelope({"z": q}, {"z": TensorEncoding("qrows", {"bits": bits})})
    out = wire.decode(data).tensors["z"]

    assert np.array_equal(out, q) and out.shape == q.shape
    assert body_bytes(data) == quant.qrows_size(shape, bits)


@pytest.mark.parametrize("bits", [2, 7])
def test_qrows_is_unbiased_and_puts_each_rows_largest_entry_on_its_scale(bits: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 6))
    draws = np.array([quant.qrows(x, bits, rng) for _ in range(4000)])

    s = quant.levels(bits)
    spread = np.abs(x).max(axis=1, keepdims=True) / s  # one level: the largest error of one draw
    assert np.all(np.abs(draws.mean(axis=0) - x) <= 4 * spread / np.sqrt(len(draws)) + 1e-6)
    assert np.all(np.abs(draws).max(axis=2) == np.float32(np.abs(x).max(axis=1)))


def test_a_zero_row_stays_zero_and_costs_its_scale() -> None:
    x = np.zeros((2, 5), np.float32)
    x[1, 2] = -3.0
    q = quant.qrows(x, 7, np.random.default_rng(0))

    assert np.array_equal(q, x)
    assert quant.qrows_levels(q, 7)[0].tolist() == [0.0, 3.0]


@pytest.mark.parametrize("bits", [3, 7])
def test_an_edge_re_encodes_relayed_rows_into_the_same_bytes(bits: int) -> None:
    """Devices quantize their rows; the edge stacks them into Z2, and slices the host's Z1 row by row."""
    rng = np.random.default_rng(bits)
    enc = TensorEncoding("qrows", {"bits": bits})
    device_rows = [wire.decode(envelope({"z": quant.qrows(rng.normal(size=(1, 8)), bits, rng)}, {"z": enc}))
                   for _ in range(4)]
    z2 = np.concatenate([d.tensors["z"] for d in device_rows])
    relayed = wire.decode(envelope({"z": z2}, {"z": enc})).tensors["z"]
    assert np.array_equal(relayed, z2)
    assert body_bytes(envelope({"z": z2}, {"z": enc})) == sum(body_bytes(envelope({"z": d.tensors["z"]}, {"z": enc}))
                                                             for d in device_rows)

    z1 = wire.decode(envelope({"z": quant.qrows(rng.normal(size=(4, 8)), bits, rng)}, {"z": enc})).tensors["z"]
    for i in range(4):
        assert np.array_equal(wire.decode(envelope({"z": z1[i:i + 1]}, {"z": enc})).tensors["z"], z1[i:i + 1])


def test_qrows_encoding_refuses_values_off_the_grid() -> None:
    with pytest.raises(LocalProtocolError, match="qrows grid"):
        envelope({"z": np.array([[0.3, 1.0, 0.123]], np.float32)}, {"z": TensorEncoding("qrows", {"bits": 2})})
    assert not quant.on_qrows_grid(np.array([[0.3, 1.0, 0.123]], np.float32), 7)
    assert quant.on_qrows_grid(quant.qrows(np.array([[0.3, 1.0, 0.123]]), 7, np.random.default_rng(0)), 7)


@pytest.mark.parametrize(("scales", "levels", "error"), [
    ([float("nan")], [1, 0], NonFiniteTensorError),
    ([float("inf")], [1, 0], NonFiniteTensorError),
    ([-1.0], [1, 0], TensorSpecError),
    ([1e-41], [1, 0], TensorSpecError),      # subnormal scale
    ([1.0], [0, 0], TensorSpecError),        # positive scale, no entry on the top level
    ([0.0], [1, 0], TensorSpecError),        # zero scale with a non-zero level
])
def test_qrows_decoding_refuses_bad_scales_and_non_canonical_rows(scales: list[float], levels: list[int],
                                                                  error: type) -> None:
    bits = 2  # s = 1: levels -1, 0, 1 are codes 0, 1, 2
    body = np.array(scales, "<f4").tobytes() + quant.pack(np.array(levels, np.int16), bits)
    spec = {"n": "z", "e": "qrows", "sh": [1, 2], "nb": len(body), "b": bits}

    with pytest.raises(error):
        wire.decode(sealed([spec], body))


@pytest.mark.parametrize("bits", [1, 9, "7", True, None])
def test_qrows_bits_out_of_range_are_refused(bits: Any) -> None:
    body = np.array([1.0], "<f4").tobytes() + b"\xff"
    with pytest.raises(TensorSpecError):
        wire.decode(sealed([{"n": "z", "e": "qrows", "sh": [1, 2], "nb": len(body), "b": bits}], body))


# --- topk ------------------------------------------------------------------------------------------


def test_topk_keeps_each_rows_largest_magnitudes_deterministically() -> None:
    x = np.array([[0.1, -3.0, 2.0, 0.5], [1.0, 1.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)

    out = quant.topk_rows(x, 2)

    assert out.tolist() == [[0.0, -3.0, 2.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert quant.topk_count(8, 7) == 2 and quant.topk_count(32, 7) == 7 and quant.topk_count(3, 2) == 1
    assert quant.is_topk(out, 2) and not quant.is_topk(x, 2)


@pytest.mark.parametrize("k", [0, 1, 2, 8])
@pytest.mark.parametrize("shape", [(1, 8), (5, 8), (8,), (0, 8), (2, 2, 4)])
def test_topk_round_trip_size_and_relay(k: int, shape: tuple[int, ...]) -> None:
    width = quant.rows_of(shape)[1]
    k = min(k, width)
    rng = np.random.default_rng(k)
    x = quant.topk_rows(rng.normal(size=shape).astype(np.float32), k)
    enc = TensorEncoding("topk", {"k": k})

    data = envelope({"z": x}, {"z": enc})
    out = wire.decode(data).tensors["z"]

    assert np.array_equal(out, x) and out.shape == x.shape
    assert body_bytes(data) == quant.topk_size(shape, k)
    assert envelope({"z": out}, {"z": enc}) == data  # a relay re-encodes into the same bytes


def test_topk_pads_rows_with_fewer_non_zeros_and_refuses_dense_ones() -> None:
    x = np.array([[0.0, 0.0, 5.0, 0.0]], np.float32)
    idx, vals = quant.topk_entries(x, 2)
    assert idx.tolist() == [[0, 2]] and vals.tolist() == [[0.0, 5.0]]

    with pytest.raises(LocalProtocolError, match="sparsify"):
        envelope({"z": np.ones((1, 4), np.float32)}, {"z": TensorEncoding("topk", {"k": 2})})


def _topk_spec(body: bytes, **changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"n": "z", "e": "topk", "sh": [1, 4], "nb": len(body), "k": 2}
    spec.update(changes)
    return spec


@pytest.mark.parametrize(("indices", "k", "shape"), [
    ([1, 1], 2, [1, 4]),       # repeated index
    ([2, 1], 2, [1, 4]),       # not increasing
    ([0, 4], 2, [1, 4]),       # out of range
    ([0, 1], 5, [1, 4]),       # k above the width
    ([0, 1], -1, [1, 4]),
    ([0, 1], "2", [1, 4]),
])
def test_topk_decoding_refuses_bad_indices_and_counts(indices: list[int], k: Any, shape: list[int]) -> None:
    body = np.array(indices, "<u2").tobytes() + np.array([1.0, 2.0], "<f4").tobytes()

    with pytest.raises(TensorSpecError):
        wire.decode(sealed([_topk_spec(body, k=k, sh=shape)], body))


def test_topk_non_finite_values_and_huge_expansions_are_refused() -> None:
    body = np.array([0, 1], "<u2").tobytes() + np.array([1.0, np.nan], "<f4").tobytes()
    with pytest.raises(NonFiniteTensorError):
        wire.decode(sealed([_topk_spec(body)], body))

    tiny = np.array([0], "<u4").tobytes() + np.array([1.0], "<f4").tobytes()
    with pytest.raises(TensorSpecError, match="expand"):  # 8 bytes must not become a 2**31-wide array
        wire.decode(sealed([_topk_spec(tiny, sh=[1, 2**31], k=1)], tiny))


# --- fuzz: a tensor or a DecodeError ---------------------------------------------------------------


@SETTINGS
@given(encoding=st.sampled_from(["qrows", "topk"]), shape=st.lists(st.integers(0, 6), max_size=3),
       param=st.integers(-1, 9), body=st.binary(max_size=96))
def test_fuzz_row_codec_bodies(encoding: str, shape: list[int], param: int, body: bytes) -> None:
    key = "b" if encoding == "qrows" else "k"
    spec = {"n": "z", "e": encoding, "sh": shape, "nb": len(body), key: param}
    try:
        env = wire.decode(sealed([spec], body))
    except DecodeError:
        return
    z = env.tensors["z"]
    assert z.shape == tuple(shape) and np.isfinite(z).all()
    # whatever decodes re-encodes into the same bytes: an edge can always relay it
    params = {"bits": param} if encoding == "qrows" else {"k": param}
    assert envelope({"z": z}, {"z": TensorEncoding(encoding, params)}).endswith(body)

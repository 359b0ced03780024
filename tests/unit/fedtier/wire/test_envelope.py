"""fedtier.wire: the envelope codec.

Two kinds of test: round trips (``decode(encode(env))`` gives ``env`` back, for every
encoding and for empty and 0-d tensors), and rejections (each malformed input raises the
*specific* ``DecodeError`` subclass). The fuzz tests check h11's invariant: whatever bytes
arrive, ``decode`` either returns an envelope or raises a ``DecodeError`` — never anything
else, because the shells only catch ``RemoteProtocolError``.

Malformed envelopes are crafted by hand from the layout documented in the module
docstring (4-byte magic, 1-byte version, 4-byte big-endian header length, msgpack header,
body), so these tests check the documented format rather than the encoder's own helpers.
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
from hypothesis.extra import numpy as hnp

from fedtier import wire
from fedtier.errors import (
    BadMagicError,
    DecodeError,
    LocalProtocolError,
    MalformedHeaderError,
    NonFiniteTensorError,
    OversizeError,
    ShaMismatchError,
    TensorSpecError,
    TruncatedError,
    UnsupportedVersionError,
)
from fedtier.wire import Envelope, TensorEncoding

# Deterministic: a fixed derandomized search and no example database.
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(SETTINGS, max_examples=150)

PREFIX = struct.Struct(">4sBI")  # magic, version, header length (module docstring)


# --- helpers --------------------------------------------------------------------------------


def make_env(**overrides: Any) -> Envelope:
    """A small valid envelope with one f32, one f16 and one u8 tensor."""
    fields: dict[str, Any] = dict(
        type="device_update", rollout="r1", round=3, sender="dev-1", key="device_update/r1/3/0/dev-1",
        step=0, meta={"num_samples": 12, "train_loss": 0.5},
        tensors={"w": np.array([[1.0, -2.0], [0.5, 4.0]], dtype=np.float32),
                 "h": np.array([0.25, -1.5, 3.0], dtype=np.float32),
                 "blob": np.array([0, 1, 255], dtype=np.uint8)},
        encodings={"h": TensorEncoding("f16"), "blob": TensorEncoding("u8")},
    )
    fields.update(overrides)
    return Envelope(**fields)


def split_raw(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(header map, body) of an encoded envelope, read with the documented layout."""
    _, _, hlen = PREFIX.unpack_from(data, 0)
    header = msgpack.unpackb(data[PREFIX.size:PREFIX.size + hlen], raw=False)
    return header, data[PREFIX.size + hlen:]


def seal(header: dict[str, Any], body: bytes, *, fix_sha: bool = True, magic: bytes = b"FTEN",
         version: int = 1) -> bytes:
    """Build envelope bytes from a header map and a body; by default the sha is recomputed so
    that only the check under test can reject the result."""
    header = dict(header)
    if fix_sha:
        header["sha"] = hashlib.sha256(body).digest()
    packed = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(magic, version, len(packed)) + packed + body


def base_header(**changes: Any) -> dict[str, Any]:
    """A minimal valid header with no tensors."""
    header: dict[str, Any] = {"t": "x", "ro": "r", "r": 0, "st": 0, "s": "s", "k": "k",
                              "sha": hashlib.sha256(b"").digest(), "m": {}, "ts": []}
    header.update(changes)
    return header


def decode_or_decode_error(data: bytes) -> None:
    """h11's fuzz invariant: a valid envelope or a DecodeError; anything else propagates."""
    try:
        env = wire.decode(data)
    except DecodeError:
        return
    assert isinstance(env, Envelope)


# --- round trips ----------------------------------------------------------------------------


def test_round_trip_of_a_small_envelope() -> None:
    # Prepare
    env = make_env(meta={"n": 1, "loss": 0.5, "ids": ["a", "b"], "cfg": {"lr": 0.1}, "none": None})

    # Execute
    out = wire.decode(wire.encode(env))

    # Assert
    assert wire.envelopes_equal(out, env)
    np.testing.assert_array_equal(out.tensors["w"], [[1.0, -2.0], [0.5, 4.0]])
    np.testing.assert_array_equal(out.tensors["h"], [0.25, -1.5, 3.0])
    np.testing.assert_array_equal(out.tensors["blob"], [0, 1, 255])
    assert out.tensors["w"].dtype == np.float32
    assert out.tensors["h"].dtype == np.float32  # f16 widens to float32 on decode
    assert out.tensors["blob"].dtype == np.uint8
    assert [s["e"] for s in out.tensor_specs] == ["f32", "f16", "u8"]


def test_tensor_order_and_spec_byte_lengths_follow_the_layout() -> None:
    env = make_env()

    header, body = split_raw(wire.encode(env))

    assert [s["n"] for s in header["ts"]] == ["w", "h", "blob"]
    assert [s["nb"] for s in header["ts"]] == [16, 6, 3]
    assert [s["sh"] for s in header["ts"]] == [[2, 2], [3], [3]]
    assert len(body) == 16 + 6 + 3
    assert header["sha"] == hashlib.sha256(body).digest()
    # f32 is little-endian IEEE: the first 4 body bytes are 1.0.
    assert body[:4] == struct.pack("<f", 1.0)


@pytest.mark.parametrize("encoding", ["f32", "f16", "u8"])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (0, 2, 5), (1,), (2, 3)])
def test_round_trip_of_empty_and_0d_tensors(encoding: str, shape: tuple[int, ...]) -> None:
    # Prepare: values every encoding represents exactly.
    dtype = np.uint8 if encoding == "u8" else np.float32
    arr = (np.arange(int(np.prod(shape)), dtype=np.float64) % 7).astype(dtype).reshape(shape)
    env = make_env(tensors={"t": arr}, encodings={"t": TensorEncoding(encoding)})

    # Execute
    out = wire.decode(wire.encode(env))

    # Assert
    assert out.tensors["t"].shape == shape
    np.testing.assert_array_equal(out.tensors["t"], arr)
    assert wire.envelopes_equal(out, env)


def test_non_contiguous_input_is_encoded_by_value() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3).T  # Fortran-ordered view

    out = wire.decode(wire.encode(make_env(tensors={"t": arr}, encodings={})))

    np.testing.assert_array_equal(out.tensors["t"], [[0, 3], [1, 4], [2, 5]])


def test_chunk_fields_round_trip() -> None:
    env = make_env(chunk_index=2, chunk_count=5)

    out = wire.decode(wire.encode(env))

    assert (out.chunk_index, out.chunk_count) == (2, 5)
    assert wire.envelopes_equal(out, env)


def test_decoded_arrays_are_read_only() -> None:
    env = make_env(tensors={"w": np.ones((2, 2), np.float32), "z": np.float32(3.0) * np.ones(()),
                            "b": np.arange(3, dtype=np.uint8)},
                   encodings={"b": TensorEncoding("u8")})

    out = wire.decode(wire.encode(env))

    for name, arr in out.tensors.items():
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError):
            arr[...] = 0


def _aligned_f32_message(values: np.ndarray) -> bytes:
    """An envelope of one f32 tensor whose body starts 4-aligned inside the ``bytes`` (found by the sender
    id's length, which moves the body)."""
    for pad in range(8):
        data = wire.encode(make_env(sender="d" + "x" * pad, tensors={"w": values}))
        body_address = np.frombuffer(data, np.uint8).ctypes.data + data.index(values.tobytes())
        if body_address % 4 == 0:
            return data
    raise AssertionError("no sender length gave an aligned body")


def test_f32_tensors_of_an_immutable_message_are_views_and_of_a_mutable_one_copies() -> None:
    values = np.arange(1000, dtype=np.float32) / 7
    data = _aligned_f32_message(values)

    shared = wire.decode(data).tensors["w"]
    mutable = bytearray(data)
    copied = wire.decode(mutable).tensors["w"]
    mutable[-4:] = np.float32(-1).tobytes()  # the sender's buffer changes after decoding

    assert np.shares_memory(shared, np.frombuffer(data, np.uint8)) and not shared.flags.writeable
    assert np.array_equal(shared, values) and np.array_equal(copied, values)  # the copy kept its value
    assert not np.shares_memory(copied, np.frombuffer(mutable, np.uint8))
    # a body that starts unaligned inside the message is copied into an aligned array
    for pad in range(4):
        arr = wire.decode(wire.encode(make_env(sender="d" + "x" * pad, tensors={"w": values}))).tensors["w"]
        assert arr.flags.aligned and np.array_equal(arr, values)


def test_envelopes_equal_notices_differences() -> None:
    a = make_env()
    assert wire.envelopes_equal(a, make_env())
    assert not wire.envelopes_equal(a, make_env(round=4))
    assert not wire.envelopes_equal(a, make_env(meta={}))
    assert not wire.envelopes_equal(a, make_env(tensors={**a.tensors, "w": np.zeros((2, 2), np.float32)}))
    assert not wire.envelopes_equal(a, make_env(tensors={"w": a.tensors["w"]}))


_meta_values = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                         st.floats(allow_nan=False), st.text(max_size=10))


@st.composite
def envelopes(draw: st.DrawFn) -> Envelope:
    names = draw(st.lists(st.text("abcxyz_.", min_size=1, max_size=4), max_size=4, unique=True))
    tensors: dict[str, np.ndarray] = {}
    encodings: dict[str, TensorEncoding] = {}
    for name in names:
        enc = draw(st.sampled_from(["f32", "f16", "u8"]))
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
        if enc == "u8":
            arr = draw(hnp.arrays(np.uint8, shape))
        else:
            # f16 values are drawn from the float16 grid, so both encodings are exact.
            width = 16 if enc == "f16" else 32
            arr = draw(hnp.arrays(np.float32, shape,
                                  elements=st.floats(width=width, allow_nan=False, allow_infinity=False)))
        tensors[name] = arr
        encodings[name] = TensorEncoding(enc)
    chunk = draw(st.one_of(st.none(), st.integers(1, 1000).flatmap(
        lambda cn: st.tuples(st.integers(0, cn - 1), st.just(cn)))))
    return Envelope(
        type=draw(st.text(min_size=1, max_size=12)), rollout=draw(st.text(max_size=12)),
        round=draw(st.integers(0, 2**63)), step=draw(st.integers(0, 2**32)),
        sender=draw(st.text(max_size=12)), key=draw(st.text(max_size=30)),
        meta=draw(st.dictionaries(st.text(max_size=5), _meta_values, max_size=4)),
        tensors=tensors, encodings=encodings,
        chunk_index=None if chunk is None else chunk[0], chunk_count=None if chunk is None else chunk[1],
    )


@SETTINGS
@given(envelopes())
def test_round_trip_property(env: Envelope) -> None:
    out = wire.decode(wire.encode(env))

    assert wire.envelopes_equal(out, env)
    for name, arr in out.tensors.items():
        assert arr.shape == np.shape(env.tensors[name])
        assert arr.dtype == (np.uint8 if env.encodings[name].name == "u8" else np.float32)
        assert not arr.flags.writeable


@SETTINGS
@given(envelopes())
def test_peek_header_agrees_with_decode(env: Envelope) -> None:
    data = wire.encode(env)

    header = wire.peek_header(data)

    assert (header["t"], header["ro"], header["r"], header["st"], header["s"], header["k"]) == (
        env.type, env.rollout, env.round, env.step, env.sender, env.key)


# --- what encode refuses --------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["f32", "f16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encode_refuses_non_finite_tensors(encoding: str, bad: float) -> None:
    env = make_env(tensors={"t": np.array([1.0, bad], np.float32)}, encodings={"t": TensorEncoding(encoding)})

    with pytest.raises(LocalProtocolError, match="non-finite"):
        wire.encode(env)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_encode_refuses_values_that_overflow_f16() -> None:
    """70000 is finite but above float16's max (65504): as f16 it becomes +inf on the wire,
    which every receiver rejects as ``NonFiniteTensorError``. The sender must refuse it
    (``LocalProtocolError``), as it refuses inf itself, instead of emitting a poisoned message."""
    env = make_env(tensors={"t": np.array([1.0, 70000.0], np.float32)}, encodings={"t": TensorEncoding("f16")})

    with pytest.raises(LocalProtocolError):
        wire.encode(env)


def test_encode_refuses_too_many_dims_and_unknown_encodings() -> None:
    with pytest.raises(LocalProtocolError):
        wire.encode(make_env(tensors={"t": np.zeros((1,) * 9, np.float32)}, encodings={}))
    with pytest.raises(LocalProtocolError):
        TensorEncoding("bf16")


@pytest.mark.parametrize("changes", [{"type": ""}, {"round": -1}, {"step": -1}, {"round": 1.0}])
def test_envelope_constructor_validates(changes: dict[str, Any]) -> None:
    with pytest.raises(LocalProtocolError):
        make_env(**changes)


def test_encode_refuses_unserializable_meta() -> None:
    with pytest.raises(LocalProtocolError):
        wire.encode(make_env(meta={"x": object()}))


# --- decode rejections, one subclass each ---------------------------------------------------


def test_control_a_hand_sealed_envelope_decodes() -> None:
    """The crafting helpers themselves produce valid envelopes (so the rejections below are
    caused by the one thing each test changes)."""
    header, body = split_raw(wire.encode(make_env()))

    out = wire.decode(seal(header, body))

    assert wire.envelopes_equal(out, make_env())


def test_bad_magic() -> None:
    data = wire.encode(make_env())

    with pytest.raises(BadMagicError):
        wire.decode(b"XTEN" + data[4:])


@pytest.mark.parametrize("version", [0, 2, 255])
def test_unsupported_version(version: int) -> None:
    data = bytearray(wire.encode(make_env()))
    data[4] = version

    with pytest.raises(UnsupportedVersionError):
        wire.decode(bytes(data))


@pytest.mark.parametrize("cut", [0, 1, 4, 8])
def test_truncated_prefix(cut: int) -> None:
    data = wire.encode(make_env())

    with pytest.raises(TruncatedError):
        wire.decode(data[:cut])


def test_truncated_header() -> None:
    data = wire.encode(make_env())
    _, _, hlen = PREFIX.unpack_from(data, 0)

    for cut in (PREFIX.size, PREFIX.size + 1, PREFIX.size + hlen - 1):
        with pytest.raises(TruncatedError):
            wire.decode(data[:cut])


def test_truncated_body_with_matching_sha() -> None:
    """The body ends inside a tensor, but the sha covers exactly what arrived (so only the
    length check can catch it)."""
    header, body = split_raw(wire.encode(make_env()))

    with pytest.raises(TruncatedError):
        wire.decode(seal(header, body[:-1]))


def test_truncated_body_without_resealing_is_a_sha_mismatch() -> None:
    data = wire.encode(make_env())

    with pytest.raises(ShaMismatchError):
        wire.decode(data[:-1])


@pytest.mark.parametrize("position", [0, 5, -1])
def test_sha_mismatch_when_a_body_byte_flips(position: int) -> None:
    header, body = split_raw(wire.encode(make_env()))
    flipped = bytearray(body)
    flipped[position] ^= 0x01

    with pytest.raises(ShaMismatchError):
        wire.decode(seal(header, bytes(flipped), fix_sha=False))


@pytest.mark.parametrize("raw_header", [
    b"\xc1",                                  # a byte msgpack never uses
    b"\x92\x01\x02",                          # a list, not a map
    b"\x81\xa1t",                             # a map cut short inside
    msgpack.packb(base_header()) + b"\x00",   # extra data after the map
    b"\xd4\x01\x00",                          # an extension type
])
def test_malformed_msgpack_header(raw_header: bytes) -> None:
    data = PREFIX.pack(b"FTEN", 1, len(raw_header)) + raw_header

    with pytest.raises(MalformedHeaderError):
        wire.decode(data)


def test_header_length_above_the_limit_is_malformed() -> None:
    data = PREFIX.pack(b"FTEN", 1, wire.MAX_HEADER_BYTES + 1) + b"\x80"

    with pytest.raises(MalformedHeaderError):
        wire.decode(data)


def test_a_cell_of_20000_devices_has_tasks_and_updates_that_decode() -> None:
    """A cell task lists its members (and under roaming the rollout's devices), a cell update its reporters and each
    one's evaluation: containers as long as the header allows. With msgpack's fixed limits (16,384 items, 4,096
    keys) a cell of 20,000 devices could neither get a task nor send an update: a round waited for it for ever."""
    from fedtier.wire.messages import CellTask, CellUpdate, decode_message

    ids = tuple(f"dev-{i:05d}" for i in range(20_000))
    task = CellTask(rollout="r", round=0, sender="cloud", params={"w": np.zeros(4, np.float32)}, members=ids,
                    config={"roster": list(ids)})
    update = CellUpdate(rollout="r", round=0, sender="cell-a", delta={"w": np.zeros(4, np.float32)}, weight=1.0,
                        reported=ids, stats={"evaluations": {d: [5, 0.5, 3, None] for d in ids}})
    assert decode_message(task.encode()).members == ids
    assert len(decode_message(update.encode()).device_evaluations) == len(ids)


def test_a_container_longer_than_its_header_is_refused_before_it_is_built() -> None:
    """What bounds a header's containers is its length: an array claiming more items than bytes is malformed."""
    raw = b"\x81\xa1t\xdd\x7f\xff\xff\xff"  # {"t": an array of 2^31 - 1 items}, none of them present
    data = PREFIX.pack(b"FTEN", 1, len(raw)) + raw
    with pytest.raises(MalformedHeaderError):
        wire.decode(data)


@pytest.mark.parametrize("key", ["t", "ro", "r", "st", "s", "k", "sha", "m", "ts"])
def test_missing_header_key(key: str) -> None:
    header = base_header()
    del header[key]

    with pytest.raises(MalformedHeaderError, match=repr(key)):
        wire.decode(seal(header, b"", fix_sha=False))


@pytest.mark.parametrize("changes", [
    {"t": 1}, {"ro": None}, {"s": b"dev"}, {"k": 5},
    {"r": "1"}, {"r": True}, {"r": 1.0}, {"r": -1}, {"st": -1}, {"st": False},
    {"sha": "x" * 32}, {"sha": b"\x00" * 31},
    {"m": []}, {"ts": {}}, {"ts": [1]}, {"ts": ["spec"]},
    {"ci": 0}, {"cn": 1}, {"ci": 1, "cn": 1}, {"ci": -1, "cn": 2}, {"ci": "0", "cn": 2}, {"ci": True, "cn": 2},
])
def test_mistyped_header_key(changes: dict[str, Any]) -> None:
    with pytest.raises(MalformedHeaderError):
        wire.decode(seal(base_header(**changes), b"", fix_sha="sha" not in changes))


def test_empty_message_type_is_a_malformed_header() -> None:
    """A header with ``t: ""`` is a peer fault. ``decode`` must raise a ``DecodeError``
    subclass, not let ``Envelope.__post_init__``'s ``LocalProtocolError`` escape (the shells
    only catch ``RemoteProtocolError``)."""
    with pytest.raises(MalformedHeaderError):
        wire.decode(seal(base_header(t=""), b""))


def spec(**changes: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"n": "w", "e": "f32", "sh": [2], "nb": 8}
    s.update(changes)
    return {k: v for k, v in s.items() if v is not ...}


@pytest.mark.parametrize("bad_spec", [
    spec(nb=4),                 # nbytes inconsistent with shape
    spec(nb=12),
    spec(sh=[3]),
    spec(e="f64"),              # unknown encoding
    spec(e=None),
    spec(sh=[-2]),              # negative dim
    spec(sh=[2, -1]),
    spec(sh=[True, 2], nb=8),   # bool is not a dim
    spec(sh=[2.0]),
    spec(sh="2"),
    spec(sh=[1] * 9, nb=4),     # more dims than MAX_NDIM
    spec(nb=-8),
    spec(nb=True),
    spec(nb="8"),
    spec(n=""),
    spec(n=...),
    spec(n=3),
])
def test_tensor_spec_errors(bad_spec: dict[str, Any]) -> None:
    body = np.array([1.0, 2.0], "<f4").tobytes()

    with pytest.raises(TensorSpecError):
        wire.decode(seal(base_header(ts=[bad_spec]), body))


def test_duplicate_tensor_name() -> None:
    body = np.array([1.0, 2.0, 3.0, 4.0], "<f4").tobytes()

    with pytest.raises(TensorSpecError):
        wire.decode(seal(base_header(ts=[spec(), spec()]), body))


def test_body_longer_than_its_tensors() -> None:
    header, body = split_raw(wire.encode(make_env()))

    with pytest.raises(TensorSpecError):
        wire.decode(seal(header, body + b"\x00"))


def test_body_shorter_than_a_spec_says() -> None:
    body = np.array([1.0], "<f4").tobytes()

    with pytest.raises(TruncatedError):
        wire.decode(seal(base_header(ts=[spec()]), body))


def test_zero_size_tensor_with_huge_dims_is_a_tensor_spec_error() -> None:
    """Shape ``[0, 2**64-1]`` has zero elements, so ``nb=0`` passes the length check, but
    numpy cannot build such an array and raises ``ValueError``, which escapes ``decode``."""
    with pytest.raises(TensorSpecError):
        wire.decode(seal(base_header(ts=[spec(e="u8", sh=[0, 2**64 - 1], nb=0)]), b""))


def test_too_many_tensors_is_a_decode_error() -> None:
    """4097 empty tensors fit in the header (its array limit is 4 x MAX_TENSORS), but
    ``Envelope`` refuses them with ``LocalProtocolError``, which escapes ``decode``."""
    specs = [{"n": f"t{i}", "e": "u8", "sh": [0], "nb": 0} for i in range(wire.MAX_TENSORS + 1)]

    with pytest.raises(DecodeError):
        wire.decode(seal(base_header(ts=specs), b""))


@pytest.mark.parametrize(("encoding", "bad_bytes"), [
    ("f32", struct.pack("<f", float("nan"))),
    ("f32", struct.pack("<f", float("inf"))),
    ("f32", struct.pack("<f", float("-inf"))),
    ("f16", b"\x00\x7e"),  # quiet NaN
    ("f16", b"\x01\x7c"),  # signalling NaN
    ("f16", b"\x00\x7c"),  # +inf
    ("f16", b"\x00\xfc"),  # -inf
])
def test_non_finite_values_are_rejected(encoding: str, bad_bytes: bytes) -> None:
    # Prepare: a valid envelope; then replace the last element's bytes and re-seal the sha,
    # so the sha check passes and only the NaN/inf check can catch it.
    env = make_env(tensors={"t": np.array([1.0, 2.0], np.float32)}, encodings={"t": TensorEncoding(encoding)})
    header, body = split_raw(wire.encode(env))
    assert wire.decode(seal(header, body)).tensors["t"].tolist() == [1.0, 2.0]
    patched = body[:-len(bad_bytes)] + bad_bytes

    # Execute / Assert
    with pytest.raises(NonFiniteTensorError):
        wire.decode(seal(header, patched))


def test_u8_bytes_that_look_like_nan_are_not_rejected() -> None:
    env = make_env(tensors={"t": np.frombuffer(b"\x00\x00\xc0\x7f", np.uint8)}, encodings={"t": TensorEncoding("u8")})

    out = wire.decode(wire.encode(env))

    assert out.tensors["t"].tobytes() == b"\x00\x00\xc0\x7f"


def test_oversize() -> None:
    data = wire.encode(make_env())

    assert wire.envelopes_equal(wire.decode(data, max_bytes=len(data)), make_env())
    with pytest.raises(OversizeError):
        wire.decode(data, max_bytes=len(data) - 1)


@pytest.mark.parametrize("value", ["FTEN", 42, None, [1, 2]])
def test_non_bytes_input_is_a_decode_error(value: Any) -> None:
    with pytest.raises(DecodeError):
        wire.decode(value)


def test_bytearray_and_memoryview_inputs_decode() -> None:
    data = wire.encode(make_env())

    assert wire.envelopes_equal(wire.decode(bytearray(data)), make_env())
    assert wire.envelopes_equal(wire.decode(memoryview(data)), make_env())


# --- fuzz: DecodeError and nothing else (h11's afl invariant) -------------------------------

VALID = wire.encode(make_env(chunk_index=0, chunk_count=2))


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    decode_or_decode_error(data)


@FUZZ
@given(st.integers(0, 2**32 - 1), st.binary(max_size=200))
def test_fuzz_bytes_after_a_valid_prefix(hlen: int, rest: bytes) -> None:
    decode_or_decode_error(PREFIX.pack(b"FTEN", 1, hlen) + rest)


@FUZZ
@given(st.integers(0, len(VALID)))
def test_fuzz_truncations_of_a_valid_envelope(cut: int) -> None:
    data = VALID[:cut]

    if cut == len(VALID):
        assert wire.decode(data).chunk_index == 0
    else:
        with pytest.raises(DecodeError):
            wire.decode(data)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)), min_size=1, max_size=4))
def test_fuzz_byte_flips_of_a_valid_envelope(flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for position, xor in flips:
        data[position] ^= xor

    decode_or_decode_error(bytes(data))


_msgpack_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                             st.text(max_size=8), st.binary(max_size=40))
# Boundary values first, then scalars on their own as well as inside containers (st.recursive
# alone mostly draws containers).
_edge_values = st.sampled_from(["", 0, -1, True, False, None, b"", b"\x00" * 32, [], {}, 2**64 - 1, -(2**63),
                                float("nan"), float("inf")])
_msgpack_values = _edge_values | _msgpack_scalars | st.recursive(
    _msgpack_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=4), children,
                                                                                max_size=4)),
    max_leaves=10,
)
_HEADER, _BODY = split_raw(VALID)


HOSTILE = settings(SETTINGS, max_examples=40)


@pytest.mark.parametrize("key", sorted(_HEADER) + ["ci", "cn", "extra"])
@HOSTILE
@given(value=_msgpack_values, reseal=st.booleans())
def test_fuzz_hostile_header_values(key: str, value: Any, reseal: bool) -> None:
    """A well-formed msgpack header in which one value is replaced by arbitrary msgpack data."""
    header = {**_HEADER, key: value}

    decode_or_decode_error(seal(header, _BODY, fix_sha=reseal and key != "sha"))


@pytest.mark.parametrize("field", ["n", "e", "sh", "nb", "bits"])
@HOSTILE
@given(index=st.integers(0, len(_HEADER["ts"]) - 1),
       value=st.one_of(_msgpack_values, st.lists(st.integers(-4, 2**64 - 1), max_size=4)))
def test_fuzz_hostile_tensor_specs(field: str, index: int, value: Any) -> None:
    header = dict(_HEADER)
    header["ts"] = [dict(s) for s in _HEADER["ts"]]
    header["ts"][index][field] = value

    decode_or_decode_error(seal(header, _BODY))

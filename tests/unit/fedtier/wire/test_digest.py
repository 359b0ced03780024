"""The body digest: sha256 (``sha``, what every sender before ``dg`` sent) or the one ``dg`` names (``dv``).

Old and new nodes interoperate: a header without ``dg`` is read exactly as before; a receiver of this version
checks CRC-32 as well; an unknown digest name and a digest that does not match are typed rejections
(``unknown_digest``, ``sha_mismatch``), never anything else. Which digest a message is sent with:
``messages.send_digest`` (uplink CRC-32, downlink sha256, ``FEDTIER_WIRE_DIGEST`` to force one).
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_envelope import PREFIX, SETTINGS, decode_or_decode_error, make_env, split_raw

from fedtier import wire
from fedtier.errors import (
    DecodeError,
    LocalProtocolError,
    MalformedHeaderError,
    NonFiniteTensorError,
    ShaMismatchError,
    UnknownDigestError,
)
from fedtier.wire import envelope, messages
from fedtier.wire.messages import CellStep, CellTask, CellUpdate, DeviceTask, DeviceUpdate

import msgpack


def join(header: dict[str, Any], body: bytes) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(b"FTEN", 1, len(packed)) + packed + body


def test_a_crc32_envelope_round_trips_and_carries_4_bytes_instead_of_32() -> None:
    env = make_env(digest="crc32")
    data = wire.encode(env)
    header, body = split_raw(data)

    assert header["dg"] == "crc32" and header["dv"] == zlib.crc32(body).to_bytes(4, "big") and "sha" not in header
    back = wire.decode(data)
    assert wire.envelopes_equal(back, env) and back.digest == "crc32"
    # "sha" + 32 bytes (4 + 34 bytes of msgpack) against "dg" "crc32" "dv" + 4 bytes (3 + 6 + 3 + 6), give or
    # take the padding that aligns the body
    assert 20 - 3 <= len(wire.encode(make_env())) - len(data) <= 20 + 3


def test_a_header_without_dg_is_the_sha256_header_old_nodes_send_and_read() -> None:
    data = wire.encode(make_env())
    header, body = split_raw(data)

    assert "dg" not in header and "dv" not in header and header["sha"] == hashlib.sha256(body).digest()
    assert wire.decode(data).digest == "sha256"


def test_sha256_named_explicitly_is_read_too() -> None:
    header, body = split_raw(wire.encode(make_env()))
    del header["sha"]
    header.update(dg="sha256", dv=hashlib.sha256(body).digest())

    assert wire.decode(join(header, body)).digest == "sha256"


@pytest.mark.parametrize("name", ["md5", "", "CRC32", "x" * 200])
def test_an_unknown_digest_name_is_a_typed_rejection(name: str) -> None:
    header, body = split_raw(wire.encode(make_env(digest="crc32")))
    header["dg"] = name

    with pytest.raises(UnknownDigestError) as err:
        wire.decode(join(header, body))
    assert err.value.reason == "unknown_digest" and len(str(err.value)) < 200


@pytest.mark.parametrize("digest", ["crc32", "sha256"])
@pytest.mark.parametrize("position", [0, 1, -1])
def test_a_changed_body_byte_is_a_digest_mismatch(digest: str, position: int) -> None:
    data = bytearray(wire.encode(make_env(digest=digest)))
    data[position if position < 0 else len(data) - 20 + position] ^= 0x40

    with pytest.raises(ShaMismatchError, match=digest):
        wire.decode(bytes(data))


@pytest.mark.parametrize("changes", [{"dv": b"\x00" * 3}, {"dv": b"\x00" * 32}, {"dv": "abcd"}, {"dv": None},
                                     {"dg": 7}, {"dg": None}, {"dg": b"crc32"}])
def test_a_bad_digest_value_or_name_type_is_malformed(changes: dict[str, Any]) -> None:
    header, body = split_raw(wire.encode(make_env(digest="crc32")))
    header.update(changes)

    with pytest.raises(MalformedHeaderError):
        wire.decode(join(header, body))


def test_a_crc32_header_without_its_value_is_malformed_even_with_a_sha() -> None:
    header, body = split_raw(wire.encode(make_env(digest="crc32")))
    del header["dv"]
    header["sha"] = hashlib.sha256(body).digest()

    with pytest.raises(MalformedHeaderError, match="dv"):
        wire.decode(join(header, body))


@settings(SETTINGS, max_examples=100)
@given(name=st.one_of(st.sampled_from(["crc32", "sha256"]), st.text(max_size=8), st.binary(max_size=8),
                      st.integers(-(2**63), 2**63 - 1), st.none()),
       value=st.one_of(st.binary(max_size=40), st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), st.none()))
def test_fuzz_hostile_digest_fields_give_an_envelope_or_a_decode_error(name: Any, value: Any) -> None:
    header, body = split_raw(wire.encode(make_env(digest="crc32")))
    header.update(dg=name, dv=value)

    decode_or_decode_error(join(header, body))


def test_an_unknown_digest_is_refused_when_sending() -> None:
    with pytest.raises(LocalProtocolError, match="unknown digest"):
        make_env(digest="md5")


# --- which digest a message is sent with -----------------------------------------------------------

UP = DeviceUpdate(rollout="r", round=0, sender="d", delta={"w": np.ones(3, np.float32)}, num_samples=1)
DOWN = DeviceTask(rollout="r", round=0, sender="c", params={"w": np.ones(3, np.float32)}, config={}, members=("d",))


def test_uplink_messages_go_with_crc32_and_downlink_ones_with_sha256(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(messages.DIGEST_ENV, raising=False)

    assert wire.decode(UP.encode()).digest == "crc32"
    assert wire.decode(DOWN.encode()).digest == "sha256"
    assert {DeviceUpdate.KIND, CellUpdate.KIND} <= messages.UPWARD_KINDS
    assert not {CellTask.KIND, DeviceTask.KIND, CellStep.KIND} & messages.UPWARD_KINDS
    # every upward kind is a registered message type (a misspelt name would silently send sha256)
    from fedtier.secagg import messages as _secagg  # noqa: F401  (registers the secure aggregation kinds)

    assert messages.UPWARD_KINDS <= set(messages.MESSAGE_TYPES)


@pytest.mark.parametrize("forced", ["sha256", "crc32"])
def test_the_environment_forces_one_digest_on_everything(monkeypatch: pytest.MonkeyPatch, forced: str) -> None:
    monkeypatch.setenv(messages.DIGEST_ENV, forced)

    assert wire.decode(UP.encode()).digest == forced and wire.decode(DOWN.encode()).digest == forced
    assert messages.messages_equal(messages.decode_message(UP.encode()), UP)


def test_an_unknown_forced_digest_is_a_local_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(messages.DIGEST_ENV, "md5")

    with pytest.raises(LocalProtocolError, match=messages.DIGEST_ENV):
        UP.encode()


# --- the finiteness check that replaced a boolean array per tensor ------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 1000, 4099, 100_003])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_anywhere_is_refused(size: int, bad: float) -> None:
    base = np.random.default_rng(size).normal(size=size).astype(np.float32)
    for position in sorted({0, size // 2, size - 1, min(size - 1, 13)}):
        values = base.copy()
        values[position] = bad
        header, body = split_raw(wire.encode(make_env(tensors={"w": base}, encodings={}, digest="crc32")))
        body = bytes(body[:4 * position]) + np.float32(bad).tobytes() + bytes(body[4 * position + 4:])
        header["dv"] = zlib.crc32(body).to_bytes(4, "big")

        with pytest.raises(NonFiniteTensorError):
            wire.decode(join(header, body))


def test_finite_values_whose_squares_overflow_are_accepted() -> None:
    values = np.array([3e38, -3e38, 1e20, 1.0], np.float32)

    back = wire.decode(wire.encode(make_env(tensors={"w": values}, encodings={})))
    assert np.array_equal(back.tensors["w"], values)


def test_every_decode_error_is_still_a_decode_error() -> None:
    assert issubclass(UnknownDigestError, DecodeError) and envelope.DIGESTS["crc32"].size == 4


@settings(SETTINGS, max_examples=120)
@given(sender=st.text(st.characters(min_codepoint=48, max_codepoint=122), min_size=1, max_size=40),
       digest=st.sampled_from(["crc32", "sha256"]), chunk=st.booleans(), meta=st.integers(0, 2**40))
def test_every_body_starts_4_aligned_so_f32_tensors_decode_as_views(sender: str, digest: str, chunk: bool,
                                                                     meta: int) -> None:
    env = make_env(sender=sender, digest=digest, meta={"x": meta}, tensors={"w": np.ones(3, np.float32)},
                   encodings={}, **({"chunk_index": 0, "chunk_count": 1} if chunk else {}))
    data = wire.encode(env)
    _, _, hlen = PREFIX.unpack_from(data, 0)

    assert (PREFIX.size + hlen) % envelope.BODY_ALIGN == 0
    header, _ = split_raw(data)
    assert header.get("pd", b"") == bytes(len(header.get("pd", b""))) and len(header.get("pd", b"")) < 4
    decoded = wire.decode(data).tensors["w"]
    assert np.shares_memory(decoded, np.frombuffer(data, np.uint8)) and np.array_equal(decoded, np.ones(3))

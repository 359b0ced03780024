"""Secure aggregation's wire messages: bytes round trips, strict decoding, typed rejects."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from fedtier import wire
from fedtier.errors import DecodeError, MalformedHeaderError
from fedtier.secagg.messages import (
    SecAggAborted,
    SecAggBundle,
    SecAggKeys,
    SecAggMasked,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
)
from fedtier.secagg.protocol import AdvertisedKeys
from fedtier.wire.messages import Message, decode_message

K = AdvertisedKeys(b"c" * 32, b"s" * 32, b"h" * 32)
EXAMPLES: list[Message] = [
    SecAggKeys(rollout="r", round=1, sender="d1", c_pk=K.c_pk, s_pk=K.s_pk, b_commit=K.b_commit),
    SecAggRoster(rollout="r", round=1, sender="e", receiver="d1", keys={"d1": K, "d2": K}, size=5),
    SecAggShares(rollout="r", round=1, sender="d1", shares={"d2": b"x" * 180}),
    SecAggBundle(rollout="r", round=1, sender="e", receiver="d2", shares={"d1": b"x" * 180}),
    SecAggMasked(rollout="r", round=1, sender="d1", masked=np.array([0, 1, 2**47 + 5], dtype=np.uint64), width=6),
    SecAggMasked(rollout="r", round=1, sender="d1", masked=np.array([2**64 - 1, 7], dtype=np.uint64)),
    SecAggUnmask(rollout="r", round=1, sender="e", receiver="d1", survivors=("d1", "d2"), dropped=("d3",), count=4),
    SecAggReveal(rollout="r", round=1, sender="d1", shares={"d2": b"y" * 68}),
    SecAggAborted(rollout="r", round=1, sender="e", phase="masked", reason="too_few_inputs", have=3, need=4,
                  waited={"keys": ("d1",), "masked": ("d2", "d3")}),
]


def fields_of(msg: Message) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        out[f.name] = v.tolist() if isinstance(v, np.ndarray) else v
    return out


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.KIND)
def test_round_trip_through_bytes(msg: Message) -> None:
    out = decode_message(msg.encode())
    assert type(out) is type(msg) and fields_of(out) == fields_of(msg) and out.key == msg.key


def test_messages_to_different_devices_have_different_keys() -> None:
    for cls in (SecAggBundle, SecAggRoster, SecAggUnmask):
        a = cls(rollout="r", round=1, sender="e", receiver="d1")
        assert a.key != dataclasses.replace(a, receiver="d2").key


def reencode(msg: Message, **meta: Any) -> bytes:
    env = msg.to_envelope()
    return wire.encode(dataclasses.replace(env, meta={**env.meta, **meta}))


@pytest.mark.parametrize("msg,meta", [
    (EXAMPLES[0], {"c_pk": "not bytes"}),
    (EXAMPLES[0], {"s_pk": b""}),
    (EXAMPLES[1], {"keys": {"d1": [b"a", b"b"]}}),
    (EXAMPLES[2], {"shares": {"d2": 5}}),
    (EXAMPLES[2], {"shares": [b"x"]}),
    (EXAMPLES[3], {"receiver": ""}),
    (EXAMPLES[6], {"survivors": "d1"}),
    (EXAMPLES[6], {"count": -1}),
    (EXAMPLES[1], {"size": True}),
    (EXAMPLES[1], {"receiver": 3}),
    (EXAMPLES[7], {"shares": {"d2": b"y" * 5000}}),
    (EXAMPLES[8], {"phase": "training"}),
    (EXAMPLES[8], {"reason": "Too few!"}),
    (EXAMPLES[8], {"have": -1}),
    (EXAMPLES[8], {"waited": {"later": ["d1"]}}),
    (EXAMPLES[8], {"waited": {"keys": "d1"}}),
], ids=lambda v: v.KIND if isinstance(v, Message) else "")
def test_malformed_fields_are_typed_rejects(msg: Message, meta: dict[str, Any]) -> None:
    with pytest.raises(DecodeError) as info:
        decode_message(reencode(msg, **meta))
    assert info.value.reason in ("malformed_header",)


def test_masked_input_must_be_whole_elements_of_its_width() -> None:
    env = EXAMPLES[4].to_envelope()
    assert env.tensors["masked"].size == 3 * 6  # 6 bytes per element of a 48-bit ring
    bad = dataclasses.replace(env, tensors={"masked": np.zeros(7, np.uint8)})
    with pytest.raises(MalformedHeaderError):
        decode_message(wire.encode(bad))
    with pytest.raises(MalformedHeaderError):
        decode_message(reencode(EXAMPLES[4], width=9))

"""fedtier.security.manifest: canonical JSON round trip and validation of what arrives.

A manifest arrives from the broker (retained), so ``Manifest.decode`` is a way in from the
wire like ``wire.decode``: anything malformed must raise ``ManifestError`` (a
``DecodeError``) and nothing else.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedtier.errors import DecodeError, ManifestError
from fedtier.security.manifest import MANIFEST_SCHEMA, Manifest

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

SHA_A, SHA_B = "a" * 64, "0123456789abcdef" * 4
BUNDLE = {"bundle_id": "b1", "files": {
    "training_model": {"filename": "training_model.onnx", "sha256": SHA_A, "size": 1200},
    "checkpoint": {"filename": "checkpoint", "sha256": SHA_B, "size": 64},
}}


def make(**changes: Any) -> Manifest:
    fields: dict[str, Any] = dict(rollout="r1", version=2, algorithm="fedavg", bundle=BUNDLE,
                                  cells=("c1", "c2"), rounds=10, created=1700000000.5,
                                  expires=1700003600.0, extra={"note": "ünïcode", "k": [1, 2]})
    fields.update(changes)
    return Manifest(**fields)


def raw(**changes: Any) -> bytes:
    """The JSON of a valid manifest with some fields changed (``...`` deletes one)."""
    obj = json.loads(make().encode())
    obj.update(changes)
    return json.dumps({k: v for k, v in obj.items() if v is not ...}).encode()


# --- round trip and canonical form ---------------------------------------------------------------


def test_round_trip() -> None:
    m = make()

    out = Manifest.decode(m.encode())

    assert out == m
    assert out.cells == ("c1", "c2") and isinstance(out.cells, tuple)


def test_round_trip_with_optional_fields_absent() -> None:
    m = make(expires=None, extra={})

    assert Manifest.decode(m.encode()) == m
    assert Manifest.decode(raw(expires=..., extra=...)) == m


def test_canonical_bytes_sorted_keys_no_whitespace() -> None:
    data = make().encode()

    obj = json.loads(data)
    assert data == json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert obj["schema"] == MANIFEST_SCHEMA
    assert b" " not in data.replace("ünïcode".encode(), b"")
    assert "ünïcode".encode() in data  # UTF-8, not \\u escapes


def test_canonical_bytes_are_stable() -> None:
    # Same content built with dicts in another insertion order gives the same bytes.
    reordered_bundle = {"files": dict(reversed(list(BUNDLE["files"].items()))), "bundle_id": "b1"}
    a = make()
    b = make(bundle=reordered_bundle, cells=("c2", "c1"),
             extra={"k": [1, 2], "note": "ünïcode"})

    assert a.encode() == b.encode()  # cells are written sorted
    assert Manifest.decode(a.encode()).encode() == a.encode()


def test_artifact_digests() -> None:
    m = make()

    assert m.artifact_digests == {"training_model.onnx": SHA_A, "checkpoint": SHA_B}


def test_manifest_size_does_not_grow_with_the_fleet() -> None:
    # Devices are not listed: a manifest for 10 cells is as small as ever.
    assert len(make(cells=tuple(f"cell-{i}" for i in range(10))).encode()) < 1024


def test_int_created_is_read_as_float() -> None:
    out = Manifest.decode(raw(created=5))

    assert out.created == 5.0 and isinstance(out.created, float)


# --- malformed input ------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"null", b"[]", b'"manifest"', b"42", b"{}"],
                         ids=["empty", "cut", "not-utf8", "null", "list", "string", "number", "no-schema"])
def test_not_a_json_object(data: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.decode(data)


@pytest.mark.parametrize("changes", [
    {"schema": 2}, {"schema": "1"}, {"schema": ...},
    {"rollout": ...}, {"rollout": 5}, {"rollout": "r/1"}, {"rollout": "+"}, {"rollout": ""}, {"rollout": ".."},
    {"cells": ...}, {"cells": []}, {"cells": ["c/1"]}, {"cells": ["#"]}, {"cells": [1]}, {"cells": "c1"},
    {"cells": {"c1": ["d1"]}}, {"cells": ["c1", "c1"]},
    {"bundle": ...}, {"bundle": []}, {"bundle": {}}, {"bundle": {"files": []}},
    {"bundle": {"files": {"m": {"filename": "m.onnx", "size": 1}}}},
    {"bundle": {"files": {"m": {"sha256": SHA_A, "size": 1}}}},
    {"bundle": {"files": {"m": {"filename": "m.onnx", "sha256": SHA_A}}}},
    {"bundle": {"files": {"m": {"filename": "m.onnx", "sha256": SHA_A, "size": "1"}}}},
    {"bundle": {"files": {"m": "m.onnx"}}},
    {"version": ...}, {"version": "2"}, {"version": 2.0}, {"version": True}, {"version": -1},
    {"rounds": 0}, {"rounds": -3}, {"rounds": 1.5}, {"rounds": ...}, {"rounds": False},
    {"created": ...}, {"created": "now"}, {"created": True}, {"created": float("nan")}, {"created": float("inf")},
    {"expires": "never"}, {"expires": [1]},
    {"algorithm": ...}, {"algorithm": 5},
])
def test_malformed_fields(changes: dict[str, Any]) -> None:
    with pytest.raises(ManifestError):
        Manifest.decode(raw(**changes))


def test_manifest_error_is_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        Manifest.decode(b"nope")


@pytest.mark.parametrize("changes", [
    {"cells": "c1c2"},             # a string must not be iterated as characters
    {"extra": [1, 2]},             # accepted, and then the manifest cannot be encoded again
    {"extra": "x"},
    {"expires": True},             # bool where a number is wanted (rejected for 'created')
    {"created": 10**400},          # float() of a huge JSON int raises OverflowError
    {"expires": 10**400},
], ids=["members-string", "extra-list", "extra-string", "expires-bool", "created-huge-int", "expires-huge-int"])
def test_malformed_fields_that_slip_through(changes: dict[str, Any]) -> None:
    with pytest.raises(ManifestError):
        Manifest.decode(raw(**changes))


def test_deeply_nested_json_is_a_manifest_error() -> None:
    """``json.loads`` raises RecursionError on deep nesting; a peer must not crash the node."""
    data = b'{"schema":1,"extra":' + b"[" * 100_000 + b"]" * 100_000 + b"}"

    with pytest.raises(ManifestError):
        Manifest.decode(data)


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
              st.text(max_size=6)),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(st.text(max_size=4), children,
                                                                                max_size=3)),
    max_leaves=8,
)
_FIELDS = ["schema", "rollout", "version", "algorithm", "bundle", "cells", "rounds", "created", "expires", "extra"]


@SETTINGS
@given(st.dictionaries(st.sampled_from(_FIELDS), _json, min_size=1, max_size=3))
def test_fuzz_fields_give_a_manifest_or_manifest_error(changes: dict[str, Any]) -> None:
    try:
        m = Manifest.decode(raw(**changes))
    except ManifestError:
        return
    # Whatever is accepted must be a manifest the node can use and relay.
    assert Manifest.decode(m.encode()) == m


@SETTINGS
@given(st.binary(max_size=100))
def test_fuzz_bytes_give_a_manifest_or_manifest_error(data: bytes) -> None:
    try:
        Manifest.decode(data)
    except ManifestError:
        pass


def test_equal_bytes_decode_to_one_shared_manifest_and_errors_are_not_kept() -> None:
    """The simulator's devices share one parse of the manifest they all receive (it lists every cell)."""
    data = Manifest(rollout="r", version=1, algorithm="fedavg", cells=("c1", "c2"), rounds=3, created=0.0,
                    bundle={"files": {"f": {"filename": "f", "sha256": "0" * 64, "size": 1}}}).encode()

    first, again = Manifest.decode(data), Manifest.decode(bytes(bytearray(data)))  # equal, not the same object

    assert first is again and first.cells == ("c1", "c2")
    for _ in range(2):  # a bad manifest is refused every time, not remembered as something else
        with pytest.raises(ManifestError):
            Manifest.decode(b"{}")

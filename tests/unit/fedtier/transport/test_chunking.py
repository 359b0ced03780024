"""fedtier.transport.chunking: split messages over the broker's limit and put them back together.

The contract tests run against both chunk stores (memory and SQLite); the SQLite-only tests
check that what a node had received survives a restart.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedtier import wire
from fedtier.errors import ChunkError, LocalProtocolError, OversizeError, ShaMismatchError
from fedtier.transport import chunking
from fedtier.transport.chunking import MemoryChunkStore, Reassembler, SqliteChunkStore
from fedtier.wire import Envelope, TensorEncoding

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

TOPIC = "ft/v1/r1/cell/c1/up/d1/device_update"
MAX = 1024


def payload(size: int, *, key: str = "device_update/r1/1/0/d1", fill: int | None = None) -> bytes:
    """A valid envelope of roughly ``size`` bytes (its u8 tensor holds pseudo-random bytes)."""
    rng = np.random.default_rng(size)
    data = (np.full(size, fill, np.uint8) if fill is not None else rng.integers(0, 256, size, dtype=np.uint8))
    env = Envelope(type="device_update", rollout="r1", round=1, sender="d1", key=key,
                   tensors={"data": data}, encodings={"data": TensorEncoding("u8")})
    return wire.encode(env)


def chunk_envs(data: bytes, max_size: int = MAX) -> list[Envelope]:
    return [wire.decode(c) for c in chunking.split(data, max_size)]


def whole(result: tuple[str, bytes, int] | None) -> tuple[str, bytes] | None:
    """(whole_key, payload) of a completion; ``add`` also reports the wire bytes."""
    return None if result is None else (result[0], result[1])


StoreFactory = Callable[[], chunking.ChunkStore]


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    opened: list[SqliteChunkStore] = []

    def factory() -> chunking.ChunkStore:
        if request.param == "memory":
            return MemoryChunkStore()
        store = SqliteChunkStore(str(tmp_path / f"chunks{len(opened)}.db"))
        opened.append(store)
        return store

    yield factory
    for s in opened:
        s.close()


# --- split -----------------------------------------------------------------------------------


def test_split_returns_the_payload_itself_when_it_fits() -> None:
    data = payload(100)

    assert chunking.split(data, len(data)) == [data]
    assert chunking.split(data, 10 * len(data)) == [data]


def test_split_chunks_are_envelopes_that_fit_and_concatenate_to_the_payload() -> None:
    # Prepare
    data = payload(5000)

    # Execute
    chunks = chunking.split(data, MAX)

    # Assert
    assert len(chunks) > 1
    assert all(len(c) <= MAX for c in chunks)
    envs = [wire.decode(c) for c in chunks]
    assert all(chunking.is_chunk(e) for e in envs)
    assert [e.chunk_index for e in envs] == list(range(len(chunks)))
    assert {e.chunk_count for e in envs} == {len(chunks)}
    infos = [chunking.chunk_info(e) for e in envs]
    assert b"".join(i.data for i in infos) == data
    assert {i.total_sha for i in infos} == {hashlib.sha256(data).hexdigest()}
    assert {i.total_len for i in infos} == {len(data)}
    assert {i.whole_key for i in infos} == {"device_update/r1/1/0/d1"}
    assert not chunking.is_chunk(wire.decode(data))


@pytest.mark.parametrize("max_size", [0, 100, 300, 400])
def test_split_refuses_a_max_size_with_no_room_for_data(max_size: int) -> None:
    with pytest.raises(LocalProtocolError):
        chunking.split(payload(5000), max_size)


@SETTINGS
@given(size=st.integers(0, 6000), max_size=st.integers(600, 3000),
       key=st.text("abcdefghij/_#.-0123456789", min_size=1, max_size=200))
def test_split_property_every_chunk_fits_and_reassembles(size: int, max_size: int, key: str) -> None:
    data = payload(size, key=key)

    chunks = chunking.split(data, max_size)

    assert all(len(c) <= max_size for c in chunks)
    if len(data) <= max_size:
        assert chunks == [data]
        return
    reassembler = Reassembler()
    results = [reassembler.add(TOPIC, wire.decode(c), 0.0, wire_len=len(c)) for c in chunks]
    assert results[:-1] == [None] * (len(chunks) - 1)
    assert results[-1] == (key, data, sum(len(c) for c in chunks))


# --- reassembly ------------------------------------------------------------------------------


_DATA = payload(4000)
_ENVS = chunk_envs(_DATA)


@SETTINGS
@given(order=st.permutations(range(len(_ENVS))),
       dups=st.lists(st.integers(0, len(_ENVS) - 1), max_size=6),
       positions=st.lists(st.integers(0, 100), max_size=6))
def test_reassembly_in_any_order_with_duplicates(order: list[int], dups: list[int], positions: list[int]) -> None:
    # Prepare: a permutation with redeliveries inserted anywhere.
    sequence = list(order)
    for d, p in zip(dups, positions, strict=False):
        sequence.insert(p % (len(sequence) + 1), d)
    reassembler = Reassembler()

    # Execute
    results = [whole(reassembler.add(TOPIC, _ENVS[i], 0.0)) for i in sequence]

    # Assert: exactly one completion, when the last missing chunk arrived, with the exact bytes.
    done = [(n, r) for n, r in enumerate(results) if r is not None]
    assert len(done) == 1
    first_complete = max(sequence.index(i) for i in range(len(_ENVS)))
    assert done[0] == (first_complete, ("device_update/r1/1/0/d1", _DATA))


def test_reassembly_with_each_store(make_store: StoreFactory) -> None:
    reassembler = Reassembler(make_store())

    results = [whole(reassembler.add(TOPIC, e, 1.0)) for e in reversed(_ENVS)]

    assert results[-1] == ("device_update/r1/1/0/d1", _DATA)
    assert reassembler.store.complete_keys() == ["device_update/r1/1/0/d1"]
    reassembler.done("device_update/r1/1/0/d1")
    assert reassembler.store.complete_keys() == []
    assert reassembler.store.pending_bytes() == 0


def test_completion_reports_the_wire_bytes_of_all_chunks(make_store: StoreFactory) -> None:
    chunks = chunking.split(_DATA, MAX)
    reassembler = Reassembler(make_store())

    results = [reassembler.add(TOPIC, wire.decode(c), 0.0, wire_len=len(c)) for c in chunks]

    assert results[-1] is not None
    assert results[-1][2] == sum(len(c) for c in chunks)


def test_two_messages_interleaved(make_store: StoreFactory) -> None:
    other = payload(3000, key="device_update/r1/1/0/d2")
    a, b = _ENVS, chunk_envs(other)
    reassembler = Reassembler(make_store())
    out = []

    for i in range(max(len(a), len(b))):
        for envs in (a, b):
            if i < len(envs):
                r = whole(reassembler.add(TOPIC, envs[i], 0.0))
                if r is not None:
                    out.append(r)

    assert sorted(out) == sorted([("device_update/r1/1/0/d1", _DATA), ("device_update/r1/1/0/d2", other)])


def test_chunk_with_a_different_count_is_rejected(make_store: StoreFactory) -> None:
    # Same message split at two sizes: same key, sha and length, different counts.
    coarse = chunk_envs(_DATA, 2048)
    assert len(coarse) != len(_ENVS)
    reassembler = Reassembler(make_store())
    reassembler.add(TOPIC, _ENVS[0], 0.0)

    with pytest.raises(ChunkError):
        reassembler.add(TOPIC, coarse[1], 0.0)


def test_chunk_with_a_different_sha_is_rejected(make_store: StoreFactory) -> None:
    # Another message of the same length under the same key (e.g. a recomputed update).
    impostor = payload(4000, fill=7)
    assert len(impostor) == len(_DATA) and impostor != _DATA
    reassembler = Reassembler(make_store())
    reassembler.add(TOPIC, _ENVS[0], 0.0)

    with pytest.raises(ChunkError):
        reassembler.add(TOPIC, chunk_envs(impostor)[1], 0.0)


def test_chunk_on_another_topic_is_rejected(make_store: StoreFactory) -> None:
    reassembler = Reassembler(make_store())
    reassembler.add(TOPIC, _ENVS[0], 0.0)

    with pytest.raises(ChunkError):
        reassembler.add("ft/v1/r1/cell/c1/up/d2/device_update", _ENVS[1], 0.0)


@pytest.mark.parametrize("meta_change", [{"wk": 5}, {"tlen": 0}, {"tlen": True}, {"tsha": "abc"}, {"wk": ...}])
def test_invalid_chunk_fields_are_rejected(meta_change: dict[str, object]) -> None:
    env = _ENVS[0]
    meta = {k: v for k, v in {**env.meta, **meta_change}.items() if v is not ...}
    bad = wire.decode(wire.encode(dataclasses.replace(env, meta=meta)))

    with pytest.raises(ChunkError):
        Reassembler().add(TOPIC, bad, 0.0)


def test_chunk_whose_key_does_not_match_its_index_is_rejected() -> None:
    env = _ENVS[0]
    bad = wire.decode(wire.encode(dataclasses.replace(env, key=env.key.replace("#0/", "#1/"))))

    with pytest.raises(ChunkError):
        Reassembler().add(TOPIC, bad, 0.0)


def test_chunk_without_u8_data_is_rejected() -> None:
    env = _ENVS[0]
    bad = wire.decode(wire.encode(dataclasses.replace(env, tensors={"data": np.zeros(4, np.float32)},
                                                      encodings={})))

    with pytest.raises(ChunkError):
        Reassembler().add(TOPIC, bad, 0.0)


def test_tampered_chunk_data_is_caught_at_completion(make_store: StoreFactory) -> None:
    # Prepare: chunk 1 with one byte flipped, re-encoded so that its own envelope is valid.
    env = _ENVS[1]
    data = bytearray(env.tensors["data"].tobytes())
    data[10] ^= 0xFF
    tampered = wire.decode(wire.encode(dataclasses.replace(
        env, tensors={"data": np.frombuffer(bytes(data), np.uint8)}, encodings={"data": TensorEncoding("u8")})))
    store = make_store()
    reassembler = Reassembler(store)
    envs = list(_ENVS)
    envs[1] = tampered

    # Execute / Assert
    for e in envs[:-1]:
        assert reassembler.add(TOPIC, e, 0.0) is None
    with pytest.raises(ShaMismatchError):
        reassembler.add(TOPIC, envs[-1], 0.0)
    assert store.parts("device_update/r1/1/0/d1") == []  # the bad set is dropped
    # ... so a correct redelivery afterwards succeeds.
    results = [whole(reassembler.add(TOPIC, e, 0.0)) for e in _ENVS]
    assert results[-1] == ("device_update/r1/1/0/d1", _DATA)


def test_oversize_message(make_store: StoreFactory) -> None:
    reassembler = Reassembler(make_store(), max_message_bytes=len(_DATA) - 1)

    with pytest.raises(OversizeError):
        reassembler.add(TOPIC, _ENVS[0], 0.0)
    assert reassembler.store.pending_bytes() == 0


def test_exactly_max_message_bytes_is_accepted() -> None:
    reassembler = Reassembler(max_message_bytes=len(_DATA))

    results = [reassembler.add(TOPIC, e, 0.0) for e in _ENVS]

    assert results[-1] is not None


def test_oversize_pending_bytes(make_store: StoreFactory) -> None:
    # Prepare: room for the first two chunks only.
    sizes = [len(chunking.chunk_info(e).data) for e in _ENVS]
    reassembler = Reassembler(make_store(), max_pending_bytes=sizes[0] + sizes[1])
    reassembler.add(TOPIC, _ENVS[0], 0.0)
    reassembler.add(TOPIC, _ENVS[1], 0.0)

    with pytest.raises(OversizeError):
        reassembler.add(TOPIC, _ENVS[2], 0.0)
    assert reassembler.store.pending_bytes() == sizes[0] + sizes[1]


def test_expire_drops_stale_partials_only(make_store: StoreFactory) -> None:
    # Prepare: an old partial (t=0) and a fresh one (t=50), TTL 10.
    other = chunk_envs(payload(3000, key="device_update/r1/1/0/d2"))
    reassembler = Reassembler(make_store(), ttl_s=10.0)
    reassembler.add(TOPIC, _ENVS[0], 0.0)
    reassembler.add(TOPIC, other[0], 50.0)

    # Execute / Assert
    assert reassembler.expire(9.0) == []
    assert reassembler.expire(55.0) == ["device_update/r1/1/0/d1"]
    assert [p.index for _, p in reassembler.store.parts("device_update/r1/1/0/d2")] == [0]
    assert reassembler.store.parts("device_update/r1/1/0/d1") == []
    assert reassembler.expire(100.0) == ["device_update/r1/1/0/d2"]
    assert reassembler.store.pending_bytes() == 0


def test_expire_keeps_complete_messages_that_are_not_done(make_store: StoreFactory) -> None:
    """``expire`` is documented to drop *partial* messages. A complete message waiting for
    ``done`` (e.g. found by ``complete()`` after a restart) has been acknowledged to the
    broker, so dropping it loses it for good."""
    reassembler = Reassembler(make_store(), ttl_s=10.0)
    for e in _ENVS:
        reassembler.add(TOPIC, e, 0.0)

    dropped = reassembler.expire(100.0)

    assert dropped == []
    assert [k for _, k, _ in reassembler.complete()] == ["device_update/r1/1/0/d1"]


def test_redelivery_after_done_starts_a_new_partial() -> None:
    reassembler = Reassembler()
    for e in _ENVS:
        reassembler.add(TOPIC, e, 0.0)
    reassembler.done("device_update/r1/1/0/d1")

    assert reassembler.add(TOPIC, _ENVS[0], 1.0) is None
    assert [p.index for _, p in reassembler.store.parts("device_update/r1/1/0/d1")] == [0]


# --- SQLite durability -----------------------------------------------------------------------


def test_sqlite_partial_chunks_survive_a_restart(tmp_path: Path) -> None:
    db = str(tmp_path / "chunks.db")
    store = SqliteChunkStore(db)
    first = Reassembler(store)
    for e in _ENVS[:2]:
        assert first.add(TOPIC, e, 0.0) is None
    store.close()

    store2 = SqliteChunkStore(db)
    second = Reassembler(store2)
    results = [whole(second.add(TOPIC, e, 1.0)) for e in _ENVS[2:]]
    store2.close()

    assert results[-1] == ("device_update/r1/1/0/d1", _DATA)


def test_sqlite_complete_but_not_done_is_found_after_a_restart(tmp_path: Path) -> None:
    # Prepare: all chunks received (and acknowledged), then a crash before ``done``.
    db = str(tmp_path / "chunks.db")
    store = SqliteChunkStore(db)
    before = Reassembler(store)
    for e in _ENVS:
        before.add(TOPIC, e, 0.0)
    store.close()

    # Execute: restart.
    store2 = SqliteChunkStore(db)
    after = Reassembler(store2)
    pending = after.complete()

    # Assert
    assert pending == [(TOPIC, "device_update/r1/1/0/d1", _DATA)]
    after.done("device_update/r1/1/0/d1")
    assert after.complete() == []
    store2.close()
    store3 = SqliteChunkStore(db)
    assert Reassembler(store3).complete() == []
    assert store3.pending_bytes() == 0
    store3.close()


def test_complete_skips_partials_and_corrupt_sets(make_store: StoreFactory) -> None:
    # Prepare: one complete message, one partial, and one complete set whose bytes are wrong
    # (put straight into the store, as a crash mid-write or a disk fault might leave it).
    store = make_store()
    reassembler = Reassembler(store)
    for e in _ENVS:
        reassembler.add(TOPIC, e, 0.0)
    reassembler.add(TOPIC, chunk_envs(payload(3000, key="device_update/r1/1/0/d2"))[0], 0.0)
    for env in chunk_envs(payload(2000, key="device_update/r1/1/0/d3")):
        info = chunking.chunk_info(env)
        store.put(TOPIC, dataclasses.replace(info, data=b"x" * len(info.data)), 0.0)
    assert "device_update/r1/1/0/d3" in store.complete_keys()

    # Execute
    pending = reassembler.complete()

    # Assert
    assert [(t, k) for t, k, _ in pending] == [(TOPIC, "device_update/r1/1/0/d1")]


def test_store_pending_bytes_counts_chunk_data(make_store: StoreFactory) -> None:
    store = make_store()
    reassembler = Reassembler(store)
    sizes = [len(chunking.chunk_info(e).data) for e in _ENVS]

    reassembler.add(TOPIC, _ENVS[0], 0.0)
    reassembler.add(TOPIC, _ENVS[0], 0.0)  # a duplicate is not stored twice
    reassembler.add(TOPIC, _ENVS[2], 0.0)

    assert store.pending_bytes() == sizes[0] + sizes[2]

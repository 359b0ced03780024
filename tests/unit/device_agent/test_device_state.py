"""The simulator's ``MemoryDeviceState`` keeps ``DeviceState``'s contract: the same answers to every query after
any sequence of operations (outbox, progress that never moves back, the newest upload and its bytes, manifests,
the local work in progress and what failed)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from device_agent.state import DeviceState, MemoryDeviceState

ROLLOUTS = st.sampled_from(["r1", "r2"])
KEYS = st.sampled_from([f"k{i}" for i in range(5)])
OPERATIONS = st.one_of(
    st.tuples(st.just("put_update"), KEYS, st.sampled_from(["t/a", "t/b"]), st.binary(max_size=8), ROLLOUTS,
              st.integers(-1, 4), st.floats(0, 3, allow_nan=False),
              st.none() | st.tuples(st.integers(0, 4), st.integers(0, 3))),
    st.tuples(st.just("delete"), KEYS),
    st.tuples(st.just("retopic"), KEYS, st.sampled_from(["t/a", "t/c"])),
    st.tuples(st.just("set_manifest_version"), st.integers(0, 9)),
    st.tuples(st.just("save_manifest"), ROLLOUTS, st.integers(0, 9), st.binary(max_size=8)),
    st.tuples(st.just("forget_manifest"), ROLLOUTS),
    st.tuples(st.just("begin_work"), ROLLOUTS, st.integers(0, 2), st.integers(0, 1), st.integers(1, 3)),
    st.tuples(st.just("fail_work"), ROLLOUTS, st.integers(0, 2), st.integers(0, 1),
              st.sampled_from(["crash", "error", "non_finite"])),
    st.tuples(st.just("end_work"), ROLLOUTS, st.integers(0, 2), st.integers(0, 1)),
)


def answers(state: Any) -> tuple[Any, ...]:
    return (state.pending(), {r: state.last_round(r) for r in ("r1", "r2")},
            {r: state.last_sent(r) for r in ("r1", "r2")}, state.manifest_version(),
            sorted(state.installed_manifests().items()), state.open_work(),
            {(r, i, j): state.uploads(r, i, j) for r in ("r1", "r2") for i in range(5) for j in range(4)})


@settings(max_examples=150, deadline=None)
@given(st.lists(OPERATIONS, max_size=25))
def test_memory_state_answers_as_the_sqlite_state(operations: list[tuple[Any, ...]]) -> None:
    disk, memory = DeviceState(":memory:"), MemoryDeviceState()
    try:
        for name, *args in operations:
            if name == "put_update":
                key, topic, payload, rollout, round_, now, sent = args
                for state in (disk, memory):
                    state.put_update(key, topic, payload, rollout, round_, now, sent=sent)
            else:
                results = [getattr(state, name)(*args) for state in (disk, memory)]
                assert results[0] == results[1], (name, args)
            # (the outbox's order among equal timestamps is insertion order in both)
            assert answers(memory) == answers(disk)
    finally:
        disk.close()


def test_only_the_newest_steps_uploads_are_kept_beyond_the_acknowledgement() -> None:
    for state in (DeviceState(":memory:"), MemoryDeviceState()):
        state.put_update("u0", "t/u", b"step0", "r1", -1, 1.0, sent=(0, 0))
        state.delete("u0")  # acknowledged by the broker: out of the outbox, still kept
        assert state.pending() == [] and state.uploads("r1", 0, 0) == [("u0", "t/u", b"step0")]
        state.put_update("e1", "t/e", b"emb", "r1", -1, 2.0, sent=(0, 1))
        state.put_update("u1", "t/u", b"step1", "r1", 0, 3.0, sent=(0, 1))
        assert state.uploads("r1", 0, 0) == []
        assert state.uploads("r1", 0, 1) == [("e1", "t/e", b"emb"), ("u1", "t/u", b"step1")]
        state.put_update("old", "t/u", b"late", "r1", 0, 4.0, sent=(0, 0))  # an older step is not kept
        assert state.uploads("r1", 0, 0) == []
        state.forget_manifest("r1")
        assert state.uploads("r1", 0, 1) == []
    assert MemoryDeviceState(keep_uploads=False).uploads("r1", 0, 0) == []


def test_work_started_as_often_as_the_limit_without_finishing_is_failed_and_stays_failed() -> None:
    for state in (DeviceState(":memory:"), MemoryDeviceState()):
        assert state.begin_work("r1", 3, 0, 2) is None  # started; the agent dies in it
        assert state.open_work() == [("r1", 3, 0, 1, None)]
        assert state.begin_work("r1", 3, 0, 2) is None  # started again after a restart; dies again
        assert state.begin_work("r1", 3, 0, 2) == "crash"  # not a third time
        assert state.begin_work("r1", 3, 0, 2) == "crash"  # and a repeated request gets the same answer
        state.end_work("r1", 3, 0)
        assert state.open_work() == [("r1", 3, 0, 2, "crash")]  # a failure is not cleared by the end of the work
        assert state.begin_work("r1", 4, 0, 2) is None  # the next round's work replaces it
        state.end_work("r1", 4, 0)
        assert state.open_work() == []
        state.fail_work("r1", 5, 1, "error")
        assert state.begin_work("r1", 5, 1, 2) == "error"
        state.forget_manifest("r1")  # the rollout ended
        assert state.open_work() == []

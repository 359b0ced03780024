"""fedtier.rng (named deterministic streams) and fedtier.training.batching (epoch-wise minibatches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedtier.rng import seed_words, stream
from fedtier.training.batching import minibatch_indices

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def draws(seed: int, *labels: str | int) -> list[int]:
    return stream(seed, *labels).integers(0, 2**62, size=8).tolist()


# --- rng ------------------------------------------------------------------------------------


def test_same_labels_give_identical_streams() -> None:
    a, b = stream(7, "dev-1", 3, "batches"), stream(7, "dev-1", 3, "batches")

    assert a is not b
    np.testing.assert_array_equal(a.random(100), b.random(100))
    assert a.permutation(50).tolist() == b.permutation(50).tolist()


@pytest.mark.parametrize(("left", "right"), [
    ((7, "dev-1", 3), (7, "dev-2", 3)),    # another device
    ((7, "dev-1", 3), (7, "dev-1", 4)),    # another round
    ((7, "dev-1", 3), (8, "dev-1", 3)),    # another seed
    ((7, "dev-1", 3), (7, "dev-1", 3, "x")),
    ((7, "a", "b"), (7, "b", "a")),        # order of labels matters
    ((7, "ab", "c"), (7, "a", "bc")),      # label boundaries matter
    ((7,), (7, "")),
])
def test_different_labels_give_different_streams(left: tuple, right: tuple) -> None:
    assert draws(*left) != draws(*right)


def test_seed_words_are_eight_32_bit_words() -> None:
    words = seed_words(7, "dev-1", 3)

    assert len(words) == 8
    assert all(0 <= w < 2**32 for w in words)
    assert words == seed_words(7, "dev-1", 3)


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 3), st.text("abcd-1", max_size=4), st.integers(0, 3)),
                min_size=2, max_size=8, unique=True))
def test_distinct_label_sets_give_distinct_streams(labels: list[tuple[int, str, int]]) -> None:
    outs = {tuple(draws(seed, dev, rnd)) for seed, dev, rnd in labels}

    assert len(outs) == len(labels)


_SCRIPT = ("import json; from fedtier.rng import stream, seed_words; "
           "print(json.dumps([seed_words(7, 'dev-1', 3), stream(7, 'dev-1', 3).integers(0, 2**62, 4).tolist(), "
           "stream(0, 'cell', 'c1', 12).permutation(10).tolist()]))")


def test_streams_do_not_depend_on_pythonhashseed() -> None:
    # Execute: the same program under two hash seeds (and in this process).
    outs = []
    for hash_seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                              timeout=60, check=True)
        outs.append(json.loads(proc.stdout))

    # Assert
    here = [seed_words(7, "dev-1", 3), stream(7, "dev-1", 3).integers(0, 2**62, 4).tolist(),
            stream(0, "cell", "c1", 12).permutation(10).tolist()]
    assert outs[0] == outs[1] == here


# --- batching ---------------------------------------------------------------------------------


def test_batches_by_hand() -> None:
    # n=4, b=2, 4 steps = two epochs of two batches, each epoch a permutation.
    batches = minibatch_indices(4, 2, 4, stream(1, "d"))

    assert [len(b) for b in batches] == [2, 2, 2, 2]
    assert sorted(np.concatenate(batches[:2]).tolist()) == [0, 1, 2, 3]
    assert sorted(np.concatenate(batches[2:]).tolist()) == [0, 1, 2, 3]


def test_batch_size_is_capped_at_n() -> None:
    batches = minibatch_indices(3, 10, 4, stream(1, "d"))

    assert [sorted(b.tolist()) for b in batches] == [[0, 1, 2]] * 4


def test_zero_steps_gives_no_batches() -> None:
    assert minibatch_indices(5, 2, 0, stream(1, "d")) == []


@pytest.mark.parametrize(("n", "b", "steps"), [(0, 1, 1), (0, 4, 0), (-1, 1, 1), (5, 0, 1), (5, -1, 1),
                                                 (5, 2, -1)])
def test_invalid_arguments(n: int, b: int, steps: int) -> None:
    with pytest.raises(ValueError):
        minibatch_indices(n, b, steps, stream(1, "d"))


@SETTINGS
@given(n=st.integers(1, 40), b=st.integers(1, 50), epochs=st.integers(1, 4))
def test_every_index_exactly_once_per_epoch_when_batches_tile_the_data(n: int, b: int, epochs: int) -> None:
    # Prepare: a batch size that divides n (after capping at n).
    b = min(b, n)
    while n % b:
        b -= 1
    per_epoch = n // b

    # Execute
    batches = minibatch_indices(n, b, per_epoch * epochs, stream(3, "dev", n, b))

    # Assert
    assert all(len(batch) == b for batch in batches)
    for e in range(epochs):
        epoch = np.concatenate(batches[e * per_epoch:(e + 1) * per_epoch])
        assert sorted(epoch.tolist()) == list(range(n))


@SETTINGS
@given(n=st.integers(1, 40), b=st.integers(1, 50), steps=st.integers(0, 40))
def test_batches_are_min_b_n_distinct_in_range_indices(n: int, b: int, steps: int) -> None:
    """Within an epoch no index repeats. When ``min(b, n)`` does not divide ``n`` the last
    ``n % b`` indices of each epoch's permutation are skipped (drop-last), and the next epoch
    starts from a fresh permutation."""
    batches = minibatch_indices(n, b, steps, stream(3, "dev", n, b, steps))

    size = min(b, n)
    per_epoch = n // size
    assert len(batches) == steps
    for batch in batches:
        assert len(batch) == size
        assert len(set(batch.tolist())) == size
        assert all(0 <= i < n for i in batch.tolist())
    for start in range(0, steps, per_epoch):
        epoch = np.concatenate(batches[start:start + per_epoch]).tolist()
        assert len(epoch) == len(set(epoch))


def test_same_stream_same_batches_other_stream_other_batches() -> None:
    a = minibatch_indices(100, 8, 20, stream(5, "dev-1", 2))
    b = minibatch_indices(100, 8, 20, stream(5, "dev-1", 2))
    c = minibatch_indices(100, 8, 20, stream(5, "dev-2", 2))

    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]

"""fedtier.transport.topics: builders, ``parse``, id validation and MQTT filter matching."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedtier.errors import LocalProtocolError
from fedtier.transport import topics
from fedtier.transport.topic_filters import SubscriptionTree, topic_matches
from fedtier.transport.topics import Topic

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

ID_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-"
ids = st.text(ID_CHARS, min_size=1, max_size=64).filter(lambda s: s not in (".", ".."))
# Message kinds; "manifest" is reserved for the manifest channels (cell_down(..., "manifest")
# would be the cell_manifest topic).
kinds = st.sampled_from(["cell_task", "device_task", "device_update", "cell_update", "artifact_request",
                         "artifact", "chunk"])


def rebuild(t: Topic) -> str:
    """The builder call that produced a parsed topic."""
    assert t.rollout is not None or t.channel == "status"
    if t.channel == "manifest":
        return topics.manifest(t.rollout)  # type: ignore[arg-type]
    if t.channel == "cloud_down":
        return topics.cloud_down(t.rollout, t.cell, t.kind)  # type: ignore[arg-type]
    if t.channel == "edge_up":
        return topics.edge_up(t.rollout, t.cell, t.kind)  # type: ignore[arg-type]
    if t.channel == "cell_manifest":
        return topics.cell_manifest(t.rollout, t.cell)  # type: ignore[arg-type]
    if t.channel == "cell_down":
        return topics.cell_down(t.rollout, t.cell, t.kind, t.device)  # type: ignore[arg-type]
    if t.channel == "cell_up":
        return topics.cell_up(t.rollout, t.cell, t.device, t.kind)  # type: ignore[arg-type]
    if t.channel == "status" and t.cell is not None:
        return topics.cell_status(t.cell, t.device)  # type: ignore[arg-type]
    if t.channel == "status":
        return topics.status(t.device)  # type: ignore[arg-type]
    raise AssertionError(t.channel)


# --- builders and parse agree ------------------------------------------------------------------


def test_builders_produce_the_documented_tree() -> None:
    assert topics.manifest("r1") == "ft/v1/r1/manifest"
    assert topics.cloud_down("r1", "c1", "cell_task") == "ft/v1/r1/cloud/down/c1/cell_task"
    assert topics.edge_up("r1", "c1", "cell_update") == "ft/v1/r1/edge/c1/up/cell_update"
    assert topics.cell_manifest("r1", "c1") == "ft/v1/r1/cell/c1/down/manifest"
    assert topics.cell_down("r1", "c1", "device_task") == "ft/v1/r1/cell/c1/down/device_task"
    assert topics.cell_down("r1", "c1", "device_task", "d7") == "ft/v1/r1/cell/c1/down/device_task/d7"
    assert topics.cell_up("r1", "c1", "d7", "device_update") == "ft/v1/r1/cell/c1/up/d7/device_update"
    assert topics.status("edge-1") == "ft/v1/status/edge-1"
    assert topics.cell_status("c1", "d7") == "ft/v1/status/c1/d7"


@pytest.mark.parametrize(("topic", "expected"), [
    ("ft/v1/r1/manifest", Topic("manifest", "r1", None, "manifest")),
    ("ft/v1/r1/cloud/down/c1/cell_task", Topic("cloud_down", "r1", "c1", "cell_task")),
    ("ft/v1/r1/edge/c1/up/cell_update", Topic("edge_up", "r1", "c1", "cell_update")),
    ("ft/v1/r1/cell/c1/down/manifest", Topic("cell_manifest", "r1", "c1", "manifest")),
    ("ft/v1/r1/cell/c1/down/device_task", Topic("cell_down", "r1", "c1", "device_task")),
    ("ft/v1/r1/cell/c1/down/device_task/d7", Topic("cell_down", "r1", "c1", "device_task", device="d7")),
    ("ft/v1/r1/cell/c1/up/d7/device_update", Topic("cell_up", "r1", "c1", "device_update", device="d7")),
    ("ft/v1/status/edge-1", Topic("status", None, None, None, device="edge-1")),
    ("ft/v1/status/c1/d7", Topic("status", None, "c1", None, device="d7")),
])
def test_parse_each_channel(topic: str, expected: Topic) -> None:
    parsed = topics.parse(topic)

    assert parsed == expected
    assert parsed is not None and rebuild(parsed) == topic


def test_origin_names_the_sender_of_uplinks_only() -> None:
    assert topics.parse("ft/v1/r1/cell/c1/up/d7/device_update").origin == "d7"  # type: ignore[union-attr]
    assert topics.parse("ft/v1/r1/edge/c1/up/cell_update").origin == "c1"  # type: ignore[union-attr]
    assert topics.parse("ft/v1/r1/cloud/down/c1/cell_task").origin is None  # type: ignore[union-attr]
    assert topics.parse("ft/v1/r1/cell/c1/down/device_task/d7").origin is None  # type: ignore[union-attr]


@SETTINGS
@given(rollout=ids, cell=ids, device=ids, kind=kinds)
def test_builders_and_parse_round_trip(rollout: str, cell: str, device: str, kind: str) -> None:
    cases = {
        topics.manifest(rollout): Topic("manifest", rollout, None, "manifest"),
        topics.cloud_down(rollout, cell, kind): Topic("cloud_down", rollout, cell, kind),
        topics.edge_up(rollout, cell, kind): Topic("edge_up", rollout, cell, kind),
        topics.cell_manifest(rollout, cell): Topic("cell_manifest", rollout, cell, "manifest"),
        topics.cell_down(rollout, cell, kind): Topic("cell_down", rollout, cell, kind),
        topics.cell_down(rollout, cell, kind, device): Topic("cell_down", rollout, cell, kind, device),
        topics.cell_up(rollout, cell, device, kind): Topic("cell_up", rollout, cell, kind, device),
        topics.status(device): Topic("status", None, None, None, device),
        topics.cell_status(cell, device): Topic("status", None, cell, None, device),
    }
    for topic, expected in cases.items():
        assert topics.parse(topic) == expected, topic


# Topics assembled from tree words, ids, hostile ids and wildcards.
_levels = st.one_of(
    st.sampled_from(["ft", "v1", "v2", "manifest", "cloud", "down", "up", "edge", "cell", "status", "r1", "c1",
                     "d1", "device_task", "", "+", "#", ".", "..", "a b", "x$"]),
    st.text(ID_CHARS, min_size=1, max_size=3),
)
_topics = st.lists(_levels, min_size=0, max_size=6).map(lambda ls: "/".join(["ft", "v1", *ls]))


@SETTINGS
@given(_topics)
def test_parse_accepts_only_what_a_builder_produces(topic: str) -> None:
    """If ``parse`` accepts a topic, the builders reproduce it exactly (so the ids in it are
    ids ``check_id`` accepts)."""
    parsed = topics.parse(topic)

    if parsed is not None:
        assert rebuild(parsed) == topic


@pytest.mark.parametrize("topic", [
    "", "ft", "ft/v1", "ft/v1/r1", "ft/v2/r1/manifest", "fx/v1/r1/manifest", "/ft/v1/r1/manifest",
    "ft/v1/r1/manifest/extra", "ft/v1/r1/unknown", "ft/v1/r1/cloud/down/c1", "ft/v1/r1/cloud/up/c1/k",
    "ft/v1/r1/edge/c1/down/k", "ft/v1/r1/edge/c1/up", "ft/v1/r1/cell/c1/sideways/k",
    "ft/v1/r1/cell/c1/up/d1", "ft/v1/r1/cell/c1/up/d1/k/extra", "ft/v1/r1/cell/c1/down/k/d1/extra",
    "ft/v1/a+b/manifest", "ft/v1/#/manifest", "ft/v1/a b/manifest", "ft/v1//manifest",
    "ft/v1/status", "ft/v1/status/a/b/c", "ft/v1/status/a+/b", "ft/v1/status/$SYS", "ft/v1/r1/cell/c+1/up/d1/k",
    "ft/v1/r1/cell/c1/up/d#1/k", "$SYS/broker/clients", "ft/v1/" + "x" * 65 + "/manifest",
])
def test_parse_returns_none_for_foreign_topics(topic: str) -> None:
    assert topics.parse(topic) is None


@pytest.mark.parametrize("topic", ["ft/v1/../manifest", "ft/v1/./manifest", "ft/v1/status/..",
                                   "ft/v1/r1/cell/../up/d1/device_update",
                                   "ft/v1/r1/cell/c1/up/../device_update"])
def test_parse_rejects_dot_ids_like_check_id(topic: str) -> None:
    """``check_id`` refuses "." and ".."; ``parse`` must not attribute a message to such an
    id either (it matches ``_ID`` directly and skips that rule)."""
    assert topics.parse(topic) is None


# --- id validation ------------------------------------------------------------------------------

BAD_IDS = ["", "a/b", "a+b", "+", "#", "a#", "$SYS", "$x", "a b", " ", "a\tb", "x" * 65, ".", "..",
           "dév", "a:b", "a\x00b", "a\nb"]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_check_id_rejects(bad: str) -> None:
    with pytest.raises(LocalProtocolError):
        topics.check_id(bad)


@pytest.mark.parametrize("bad", ["abc\n", "d1\n"])
def test_check_id_rejects_a_trailing_newline(bad: str) -> None:
    """``_ID`` is matched with ``^...$``, and ``$`` also matches before a final newline, so
    ``"abc\\n"`` passes and a newline reaches topics, ACL patterns and file names."""
    with pytest.raises(LocalProtocolError):
        topics.check_id(bad)
    assert topics.parse(f"ft/v1/{bad}/manifest") is None


@pytest.mark.parametrize("value", [None, 5, b"abc"])
def test_check_id_rejects_non_strings(value: object) -> None:
    with pytest.raises(LocalProtocolError):
        topics.check_id(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("good", ["a", "x" * 64, "edge-1", "d_1.2", "...", "-", "A9"])
def test_check_id_accepts(good: str) -> None:
    assert topics.check_id(good) == good


def test_check_id_names_what_was_wrong() -> None:
    with pytest.raises(LocalProtocolError, match="invalid device 'a/b'"):
        topics.check_id("a/b", "device")


@pytest.mark.parametrize("bad", ["a/b", "+", "#", "", ".."])
def test_every_builder_checks_every_id(bad: str) -> None:
    calls = [
        lambda: topics.manifest(bad),
        lambda: topics.cloud_down(bad, "c1", "k"), lambda: topics.cloud_down("r1", bad, "k"),
        lambda: topics.edge_up(bad, "c1", "k"), lambda: topics.edge_up("r1", bad, "k"),
        lambda: topics.cell_manifest(bad, "c1"), lambda: topics.cell_manifest("r1", bad),
        lambda: topics.cell_down(bad, "c1", "k"), lambda: topics.cell_down("r1", bad, "k"),
        lambda: topics.cell_down("r1", "c1", "k", bad),
        lambda: topics.cell_up(bad, "c1", "d1", "k"), lambda: topics.cell_up("r1", bad, "d1", "k"),
        lambda: topics.cell_up("r1", "c1", bad, "k"),
        lambda: topics.status(bad),
        lambda: topics.cloud_down_filter(bad), lambda: topics.cell_down_filter(bad),
        lambda: topics.cell_up_filter(bad),
    ]
    for call in calls:
        with pytest.raises(LocalProtocolError):
            call()


# --- matches ------------------------------------------------------------------------------------


def reference_matches(topic_filter: str, topic: str) -> bool:
    """MQTT 5 §4.7, written as a regex: ``+`` is one level, a trailing ``#`` is the parent
    level and everything below it, and a leading wildcard never matches a ``$`` topic."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    if topic_filter == "#":
        return True
    levels = topic_filter.split("/")
    multi = levels[-1] == "#"
    if multi:
        levels = levels[:-1]
    pattern = "/".join("[^/]*" if lv == "+" else re.escape(lv) for lv in levels)
    if multi:
        pattern += "(/.*)?"
    return re.fullmatch(pattern, topic, flags=re.DOTALL) is not None


@pytest.mark.parametrize(("topic_filter", "topic", "expected"), [
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/#", "sport", True),
    ("#", "sport/tennis", True),
    ("#", "/", True),
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+", "", True),
    ("sport", "sport/", False),
    ("sport/tennis", "sport/Tennis", False),
    ("#", "$SYS/broker", False),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("$SYS/#", "$SYS/broker", True),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("ft/v1/+/manifest", "ft/v1/r1/manifest", True),
    ("ft/v1/+/manifest", "ft/v1/r1/cell/c1/down/manifest", False),
])
def test_matches_mqtt_spec_examples(topic_filter: str, topic: str, expected: bool) -> None:
    assert topic_matches(topic_filter, topic) is expected
    assert reference_matches(topic_filter, topic) is expected


_words = st.sampled_from(["a", "b", "", "$SYS", "$x", "ft", "v1"])
_topic_levels = st.lists(_words, min_size=1, max_size=5)
_filter_levels = st.lists(st.one_of(_words, st.just("+")), min_size=0, max_size=5)
_filters = st.tuples(_filter_levels, st.booleans()).map(
    lambda fl: "/".join(fl[0] + ["#"]) if fl[1] else "/".join(fl[0])).filter(bool)


@SETTINGS
@given(topic_filter=_filters, topic=_topic_levels.map("/".join))
def test_matches_agrees_with_the_reference(topic_filter: str, topic: str) -> None:
    assert topic_matches(topic_filter, topic) is reference_matches(topic_filter, topic)


@SETTINGS
@given(filters=st.lists(_filters, min_size=1, max_size=6, unique=True), topic=_topic_levels.map("/".join))
def test_subscription_tree_matches_exactly_the_filters_that_match(filters: list[str], topic: str) -> None:
    # Prepare: one subscriber per filter.
    tree: SubscriptionTree[str] = SubscriptionTree()
    for i, f in enumerate(filters):
        tree.add(f, f"c{i}", f)
    # Execute / Assert: the trie agrees with the flat reference, filter by filter.
    assert sorted(v for _, v in tree.match(topic)) == sorted(f for f in filters if reference_matches(f, topic))


@SETTINGS
@given(levels=_topic_levels)
def test_a_topic_matches_itself_and_hash(levels: list[str]) -> None:
    topic = "/".join(levels)
    assert topic_matches(topic, topic)
    assert topic_matches("#", topic) is (not topic.startswith("$"))


@SETTINGS
@given(rollout=ids, cell=ids, other=ids, device=ids, kind=kinds)
def test_subscription_filters_select_their_channel(rollout: str, cell: str, other: str, device: str,
                                                   kind: str) -> None:
    # Prepare
    m = topic_matches

    # Assert: each filter takes its own channel for its own cell and nothing else.
    assert m(topics.ALL_MANIFESTS, topics.manifest(rollout))
    assert not m(topics.ALL_MANIFESTS, topics.cell_manifest(rollout, cell))
    assert m(topics.ALL_STATUS, topics.status(device))
    assert not m(topics.ALL_STATUS, topics.cell_status(cell, device))  # a device's presence is under its cell
    assert m(topics.cell_status_filter(cell), topics.cell_status(cell, device))
    assert not m(topics.cell_status_filter(cell), topics.status(device))
    assert m(topics.ALL_CELL_STATUS, topics.cell_status(cell, device))
    assert not m(topics.ALL_CELL_STATUS, topics.status(device))
    assert m(topics.cloud_down_filter(cell), topics.cloud_down(rollout, cell, kind))
    assert m(topics.edge_up_filter(), topics.edge_up(rollout, cell, kind))
    assert not m(topics.edge_up_filter(), topics.cloud_down(rollout, cell, kind))
    assert m(topics.cell_down_filter(cell), topics.cell_down(rollout, cell, kind))
    assert m(topics.cell_down_filter(cell), topics.cell_down(rollout, cell, kind, device))
    assert m(topics.cell_down_filter(cell), topics.cell_manifest(rollout, cell))
    assert not m(topics.cell_down_filter(cell), topics.cell_up(rollout, cell, device, kind))
    assert m(topics.cell_up_filter(cell), topics.cell_up(rollout, cell, device, kind))
    assert not m(topics.cell_up_filter(cell), topics.cell_down(rollout, cell, kind, device))
    def device_reads(topic: str, reader: str = device) -> bool:
        return any(m(f, topic) for f in topics.device_down_filters(cell, reader))

    assert device_reads(topics.cell_down(rollout, cell, kind)) and device_reads(topics.cell_manifest(rollout, cell))
    assert device_reads(topics.cell_down(rollout, cell, kind, device))
    assert not device_reads(topics.cell_up(rollout, cell, device, kind))
    if other != device:  # another device's own messages (the files it asked for) never reach this one
        assert not device_reads(topics.cell_down(rollout, cell, kind, other))
    if other != cell:
        assert not any(m(f, topics.cell_down(rollout, other, kind)) for f in topics.device_down_filters(cell, device))
        assert not m(topics.cloud_down_filter(cell), topics.cloud_down(rollout, other, kind))
        assert not m(topics.cell_down_filter(cell), topics.cell_down(rollout, other, kind))
        assert not m(topics.cell_up_filter(cell), topics.cell_up(rollout, other, device, kind))
        assert not m(topics.cell_status_filter(cell), topics.cell_status(other, device))

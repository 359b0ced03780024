"""Trust closure and noise placement (M2FDP digest §8 check 1, check 5)."""

from __future__ import annotations

import pytest

from fedtier.errors import ConfigError
from fedtier.privacy.trust import injection_points, resolve

CELLS = {"edge-a": ("a1", "a2", "a3"), "edge-b": ("b1", "b2", "b3")}


def test_two_tiers_trusted_and_untrusted_edges() -> None:
    tree = resolve(cloud="cloud", cells=CELLS, declared={"edge-a": True, "edge-b": False})
    assert not tree["cloud"].trusted and not tree["cloud"].injects
    assert tree["edge-a"].trusted and tree["edge-a"].injects  # trusted, forwards to the untrusted cloud
    assert not tree["edge-b"].trusted and not tree["edge-b"].injects  # untrusted: adds nothing
    assert [d for d in CELLS["edge-a"] if tree[d].injects] == []  # clear to a trusted edge
    assert all(tree[d].injects for d in CELLS["edge-b"])  # devices under an untrusted edge add noise
    assert tree["edge-a"].fan_in == 3 and tree["edge-a"].devices == 3


def test_three_layers_closure_makes_a_declared_trusted_server_untrusted() -> None:
    # region-1 is declared trusted but one of its children (edge-b) is untrusted (undeclared):
    # by closure region-1 is untrusted, so edge-a (trusted) injects when forwarding to it.
    cells = {"edge-a": ("a1", "a2"), "edge-b": ("b1", "b2"), "edge-c": ("c1", "c2"), "edge-d": ("d1", "d2", "d3")}
    parents = {"edge-a": "region-1", "edge-b": "region-1", "edge-c": "region-2", "edge-d": "region-2"}
    declared = {"region-1": True, "edge-a": True, "region-2": True, "edge-c": True, "edge-d": True}
    tree = resolve(cloud="cloud", cells=cells, parents=parents, declared=declared)
    assert not tree["region-1"].trusted and "closure" in tree["region-1"].why
    assert tree["region-2"].trusted  # all of its children are trusted
    assert not tree["cloud"].trusted
    injecting = sorted(n for n, e in tree.items() if e.injects)
    # exactly: devices under untrusted leaf edges (edge-b), trusted servers whose parent is untrusted
    assert injecting == ["b1", "b2", "edge-a", "region-2"]
    assert tree["region-2"].layer == 1 and tree["edge-c"].layer == 2 and tree["c1"].layer == 3
    # region-2's aggregate weights a device by 1/2 * 1/|cell|: the smallest path product is 2 * 2
    assert tree["region-2"].fan_in == 4 and tree["region-2"].devices == 5


def test_exactly_one_injection_on_every_path() -> None:
    cells = {"edge-a": ("a1",), "edge-b": ("b1",), "edge-c": ("c1",)}
    parents = {"edge-a": "r", "edge-b": "r"}
    for declared in ({}, {"edge-a": True}, {"edge-a": True, "edge-b": True, "r": True},
                     {"edge-a": True, "edge-b": True}, {"edge-c": True}):
        tree = resolve(cloud="cloud", cells=cells, parents=parents, declared=declared)
        for device in ("a1", "b1", "c1"):
            assert len(injection_points(tree, device)) == 1, (declared, device)


def test_nothing_is_injected_inside_a_trusted_subtree() -> None:
    # check 5: a local aggregation that stays inside trusted nodes carries no noise — only the hop
    # into the untrusted parent does, once.
    tree = resolve(cloud="cloud", cells={"e": ("d1", "d2")}, parents={"e": "r"}, declared={"e": True, "r": True})
    assert [n for n, e in tree.items() if e.injects] == ["r"]


def test_undeclared_servers_are_untrusted() -> None:
    tree = resolve(cloud="cloud", cells=CELLS)
    assert not tree["edge-a"].trusted and tree["edge-a"].why.startswith("not declared")
    assert all(tree[d].injects for m in CELLS.values() for d in m)


@pytest.mark.parametrize(("kwargs", "key", "words"), [
    ({"declared": {"cloud": True}}, "topology.trusted.cloud", "never trusted"),
    ({"declared": {"a1": True}}, "topology.trusted.a1", "devices carry no trust label"),
    ({"declared": {"nowhere": True}}, "topology.trusted.nowhere", "no server"),
    ({"parents": {"edge-a": "r", "r": "edge-a"}}, "topology.parents", "cycle"),
    ({"parents": {"edge-a": "a2"}}, "topology.parents.edge-a", "is a device"),
    ({"parents": {"edge-a": "r", "edge-b": "r"}, "declared": {"r": True, "edge-b": False}},
     "topology.trusted.r", "declared untrusted"),
])
def test_invalid_trust_declarations_name_the_key(kwargs: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve(cloud="cloud", cells=CELLS, **kwargs)
    assert err.value.key is not None and err.value.key.startswith(key)
    assert words in str(err.value)

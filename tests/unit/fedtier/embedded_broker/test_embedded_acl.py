"""The embedded broker's reading of Mosquitto's acl_file format (decisions as Mosquitto 2.0 makes them;
tests/integration/broker_behaviour/test_broker_acl.py checks both brokers on the wire)."""

from __future__ import annotations

import pytest

from fedtier.embedded_broker.acl import Access, AccessList
from fedtier.errors import ConfigError
from provisioning.broker_config import cell_acl

R, W = Access.READ, Access.WRITE


def test_sections_patterns_and_deny() -> None:
    acl = AccessList.parse("""
# anonymous
topic read pub/#
user alice
topic alice/#
topic deny alice/secret/#
pattern write own/%u/%c
""")
    assert acl.allows(None, "x", "pub/a", R) and not acl.allows(None, "x", "pub/a", W)
    assert not acl.allows("alice", "x", "pub/a", R)  # a named user does not get anonymous rules
    assert acl.allows("alice", "x", "alice/a", R) and acl.allows("alice", "x", "alice/a", W)
    assert not acl.allows("alice", "x", "alice/secret/plan", R)
    assert acl.allows("bob", "c1", "own/bob/c1", W) and not acl.allows("bob", "c1", "own/bob/c2", W)
    assert not acl.allows(None, "c1", "own/None/c1", W)  # %u needs a user name
    assert not acl.allows("b+", "c1", "own/b+/c1", W)  # wildcards in names get nothing from patterns


def test_dollar_topics_are_not_matched_by_leading_wildcards() -> None:
    acl = AccessList.parse("topic read #\ntopic read $SYS/#\n")
    assert acl.allows(None, "c", "a/b", R) and acl.allows(None, "c", "$SYS/x", R)
    assert not AccessList.parse("topic read #\n").allows(None, "c", "$SYS/x", R)


@pytest.mark.parametrize("text, where", [("topic read a/#/b\n", "acl:1"), ("user\n", "acl:1"),
                                         ("# ok\nrule read a\n", "acl:2"), ("topic read \n", "acl:1")])
def test_errors_name_the_line(text: str, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        AccessList.parse(text)
    assert where in str(info.value) and info.value.key == "acl_file"


def test_fedtiers_generated_cell_acl_parses_and_decides() -> None:
    acl = AccessList.parse(cell_acl("cell-a"))
    up = "ft/v1/r/cell/cell-a/up"
    assert acl.allows("dev-1", "dev-1", f"{up}/dev-1/update", W)
    assert not acl.allows("dev-1", "dev-1", f"{up}/dev-2/update", W)
    assert acl.allows("cell-a", "cell-a", f"{up}/dev-1/update", R)
    assert acl.allows("dev-1", "dev-1", "ft/v1/status/dev-1", W)
    assert not acl.allows("dev-1", "dev-1", "ft/v1/status/cell-a", W)

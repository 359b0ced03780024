"""Topic access control in the format of Mosquitto's ``acl_file`` (the subset fedtier writes).

``provisioning.broker_config`` renders fedtier's ACLs for Mosquitto; the embedded broker reads
the same file with ``--acl-file`` and applies it the way Mosquitto 2.0 does, so a node refused
by one broker is refused by the other (tests/integration/broker_behaviour checks both):

* ``topic [read|write|readwrite|deny] FILTER`` lines before any ``user`` line apply to clients
  without a user name; after ``user NAME`` they apply to that user name only;
* ``pattern [read|write|readwrite|deny] FILTER`` lines apply to every client, with ``%u``
  replaced by its user name and ``%c`` by its client id (a pattern naming ``%u`` never
  matches a client without a user name; a user name or client id containing ``+`` or ``#``
  gets nothing from patterns);
* ``deny`` rules are checked first; anything not granted is refused;
* write is checked on PUBLISH (and on a will when it is published); read on delivery,
  retained messages included; SUBSCRIBE itself is granted, as Mosquitto's ``acl_file`` does.

Unlike Mosquitto, the embedded broker has no TLS and no password file: the user name is
whatever the client claims. Its ACL therefore guards against mistakes (a node configured to
publish where it should not), not against an attacker; ``fedtier demo --secure`` needs
Mosquitto (docs/broker.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from fedtier.embedded_broker.topics import is_valid_topic_filter, topic_matches
from fedtier.errors import ConfigError


class Access(enum.IntFlag):
    """What a rule grants. ``NONE`` is a ``deny`` rule."""

    NONE = 0
    READ = 1
    WRITE = 2
    READWRITE = 3


_ACCESS_WORDS = {"read": Access.READ, "write": Access.WRITE, "readwrite": Access.READWRITE,
                 "deny": Access.NONE}


@dataclass(frozen=True, slots=True)
class AclRule:
    access: Access
    topic_filter: str


@dataclass(slots=True)
class AccessList:
    """A parsed ACL. Empty lists grant nothing (an ACL file, once given, denies by default)."""

    anonymous: list[AclRule] = field(default_factory=list)
    users: dict[str, list[AclRule]] = field(default_factory=dict)
    patterns: list[AclRule] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str, source: str = "acl") -> AccessList:
        """Parse ``acl_file`` text. Raises :class:`ConfigError` naming the line for anything
        this subset does not understand."""
        acl = cls()
        current: list[AclRule] = acl.anonymous
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            keyword, _, rest = line.partition(" ")
            rest = rest.strip()
            where = f"{source}:{number}"
            if keyword == "user":
                if not rest:
                    raise ConfigError(f"{where}: `user` needs a name", key="acl_file")
                current = acl.users.setdefault(rest, [])
            elif keyword in ("topic", "pattern"):
                rule = _parse_rule(rest, where)
                (acl.patterns if keyword == "pattern" else current).append(rule)
            else:
                raise ConfigError(f"{where}: unknown ACL keyword {keyword!r} "
                                  "(expected user, topic or pattern)", key="acl_file")
        return acl

    @classmethod
    def load(cls, path: str | Path) -> AccessList:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read ACL file {path}: {exc}", key="acl_file") from exc
        return cls.parse(text, str(path))

    def allows(self, username: str | None, client_id: str, topic: str, access: Access) -> bool:
        """Whether the client may ``access`` (READ or WRITE) ``topic``, as Mosquitto 2.0 decides."""
        rules = self.anonymous if username is None else self.users.get(username, [])
        if any(r.access == Access.NONE and topic_matches(r.topic_filter, topic) for r in rules):
            return False
        if any(r.access & access and topic_matches(r.topic_filter, topic) for r in rules):
            return True
        if not self.patterns:
            return False
        if (username is not None and _has_wildcard(username)) or _has_wildcard(client_id):
            return False
        expanded = [(r.access, f) for r in self.patterns
                    if (f := _expand(r.topic_filter, username, client_id)) is not None]
        if any(a == Access.NONE and topic_matches(f, topic) for a, f in expanded):
            return False
        return any(a & access and topic_matches(f, topic) for a, f in expanded)


def _parse_rule(rest: str, where: str) -> AclRule:
    word, _, topic_filter = rest.partition(" ")
    if word in _ACCESS_WORDS:
        access = _ACCESS_WORDS[word]
        topic_filter = topic_filter.strip()
    else:  # no access word: readwrite, the whole rest is the filter
        access, topic_filter = Access.READWRITE, rest
    if not topic_filter or not is_valid_topic_filter(topic_filter.replace("%u", "u").replace("%c", "c")):
        raise ConfigError(f"{where}: invalid topic filter {topic_filter!r}", key="acl_file")
    return AclRule(access, topic_filter)


def _has_wildcard(name: str) -> bool:
    return "+" in name or "#" in name


def _expand(topic_filter: str, username: str | None, client_id: str) -> str | None:
    if "%u" in topic_filter:
        if username is None:
            return None
        topic_filter = topic_filter.replace("%u", username)
    return topic_filter.replace("%c", client_id)

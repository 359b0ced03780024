"""MQTT topic names, topic filters and a subscription tree (MQTT 5 §4.7), shared by fedtier.

Pure data structures, no I/O. The tree indexes subscriptions by filter level so a publish
costs time proportional to the topic depth and the matching subscriptions, not to the number
of subscriptions — a fleet where every device subscribes to its own topics would otherwise
make routing quadratic. The embedded broker and the in-memory transport both route with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


def is_valid_topic_name(topic: str) -> bool:
    """A topic name to publish to: non-empty and without wildcards (§4.7.3, [MQTT-3.3.2-2])."""
    return bool(topic) and "+" not in topic and "#" not in topic


def is_valid_topic_filter(topic_filter: str) -> bool:
    """A filter to subscribe with (§4.7.1).

    ``#`` must be a whole level and the last one; ``+`` must be a whole level. The empty
    filter is invalid ([MQTT-4.7.3-1]); empty *levels* (``a//b``, ``/a``) are fine.
    """
    if not topic_filter:
        return False
    levels = topic_filter.split("/")
    for index, level in enumerate(levels):
        if "#" in level and (level != "#" or index != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Does a (valid) filter match a (valid) topic name? Reference semantics of the tree.

    A leading wildcard never matches a topic starting with ``$`` ([MQTT-4.7.2-1]), so ``#``
    does not see ``$SYS/...``; ``sport/#`` also matches ``sport`` itself (§4.7.1.2).
    """
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    filter_levels = topic_filter.split("/")
    topic_levels = topic.split("/")
    for index, level in enumerate(filter_levels):
        if level == "#":
            return True
        if index >= len(topic_levels):
            return False
        if level != "+" and level != topic_levels[index]:
            return False
    return len(filter_levels) == len(topic_levels)


class _Node(Generic[V]):
    __slots__ = ("children", "subscribers")

    def __init__(self) -> None:
        self.children: dict[str, _Node[V]] = {}
        self.subscribers: dict[str, V] = {}


class SubscriptionTree(Generic[V]):
    """Subscriptions keyed by (filter, client id), matched against topic names.

    Each client has at most one value per filter; adding again replaces it (as a repeated
    SUBSCRIBE replaces the subscription, [MQTT-3.8.4-3]). Traversal is iterative: a topic of
    thousands of empty levels must not hit Python's recursion limit.
    """

    def __init__(self) -> None:
        self._root: _Node[V] = _Node()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, topic_filter: str, client_id: str, value: V) -> None:
        node = self._root
        for level in topic_filter.split("/"):
            node = node.children.setdefault(level, _Node())
        if client_id not in node.subscribers:
            self._count += 1
        node.subscribers[client_id] = value

    def remove(self, topic_filter: str, client_id: str) -> bool:
        """Remove one subscription; prune branches left empty. True if it existed."""
        path: list[tuple[_Node[V], str]] = []
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                return False
            path.append((node, level))
            node = child
        if node.subscribers.pop(client_id, None) is None:
            return False
        self._count -= 1
        for parent, level in reversed(path):
            child = parent.children[level]
            if child.subscribers or child.children:
                break
            del parent.children[level]
        return True

    def match(self, topic: str) -> Iterator[tuple[str, V]]:
        """Yield ``(client_id, value)`` for every subscription matching ``topic``.

        A client with several matching filters is yielded once per filter; the caller merges.
        """
        levels = topic.split("/")
        depth = len(levels)
        dollar = topic.startswith("$")
        stack: list[tuple[_Node[V], int]] = [(self._root, 0)]
        while stack:
            node, index = stack.pop()
            wildcards_allowed = not (dollar and index == 0)  # [MQTT-4.7.2-1]
            if wildcards_allowed:
                multi = node.children.get("#")
                if multi is not None:  # '#' also matches the parent level (§4.7.1.2)
                    yield from multi.subscribers.items()
            if index == depth:
                yield from node.subscribers.items()
                continue
            exact = node.children.get(levels[index])
            if exact is not None:
                stack.append((exact, index + 1))
            if wildcards_allowed:
                single = node.children.get("+")
                if single is not None:
                    stack.append((single, index + 1))

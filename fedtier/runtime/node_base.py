"""Plumbing shared by the three runtime shells: decode, check, reject-and-count, run loop.

A shell's ``handle(inbound, now)`` calls ``decode_inbound`` which returns a typed message
or ``None`` after logging and counting a rejection. Rejections are never fatal: one bad
peer must not stop a round (STYLE: "On RemoteProtocolError the shell drops the message,
logs it and counts it. Any other exception is a bug and crashes loudly.").

Every rejection is counted (``fedtier_rejected_total{reason}``); the log is thinned so that a
peer sending garbage cannot flood it (``NodeBase.reject``): one WARNING line per reason and
sender a minute, with how many were left out since, at most ``REJECT_LOG_BUDGET`` such lines a
minute in all; a message the node had already received (a redelivery after a reconnect or a
restart) is logged at DEBUG.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Protocol, Sequence

from fedtier.algorithms.base import Action, Dropped, Note
from fedtier.errors import RemoteProtocolError, SenderMismatchError, UnexpectedMessageError
from fedtier.runtime.metrics import Metrics
from fedtier.transport import topics
from fedtier.transport.base import Inbound
from fedtier.transport.diagnosis import Throttle
from fedtier.wire import messages
from fedtier.wire.messages import Message

REJECTED = "fedtier_rejected_total"
DROPPED = "fedtier_dropped_total"
ACCEPTED = "fedtier_accepted_total"
STRAGGLERS = "fedtier_stragglers_total"
"""Messages for a round the node had already closed (rejected as ``late``), by the tier they came up."""
IDENTITY_CONFLICTS = "fedtier_identity_conflicts_total"
"""Times a child's presence showed two clients taking turns under its id (a copied bundle), labelled
by that id (``identity``); the ``node`` label stays the exporting node's. Bounded: only identities
that had a conflict get a series."""
EXPECTED_DROPS = ("duplicate",)
"""Drop reasons that a healthy fleet produces (QoS 1 redeliveries, resends after a restart): DEBUG, not INFO."""
ROUTINE_NOTES = ("cell_updates_counted",)
"""Notes a role makes in normal operation, many times a rollout: logged at DEBUG, not INFO."""
REJECT_LOG_INTERVAL_S = 60.0
"""A rejection's reason and sender are logged at WARNING at most once per this many seconds (``NodeBase.reject``)."""
REJECT_LOG_BUDGET = 20
"""WARNING lines about rejected messages a node writes per ``REJECT_LOG_INTERVAL_S`` at most, over every reason
and sender: many senders at once (a spray of invented ids) cannot flood the log either."""
SEEN_KEYS = 4096
"""Idempotency keys of received messages a node remembers (the newest) to tell a redelivery from a new message."""


class Node(Protocol):
    def handle(self, inbound: Inbound, now: float) -> None: ...
    def tick(self, now: float) -> None: ...


class NodeBase:
    """Rejection accounting and message validation for a node with id ``node_id``."""

    def __init__(self, node_id: str, metrics: Metrics, logger: logging.Logger,
                 max_message_bytes: int) -> None:
        self.node_id = node_id
        self.metrics = metrics
        metrics.inc(STRAGGLERS, 0)  # exported from the start: a scrape tells "none yet" from "not counted"
        self.log = logger
        self.max_message_bytes = max_message_bytes
        self._presence: dict[str, float] = {}
        self._instances: dict[str, list[str]] = {}
        self._conflict_log = Throttle()
        self._reject_log = Throttle(REJECT_LOG_INTERVAL_S, budget=REJECT_LOG_BUDGET)
        self._seen: OrderedDict[str, None] = OrderedDict()
        """Keys of the messages that passed ``decode_inbound`` (an LRU of ``SEEN_KEYS``)."""
        self._decoded: tuple[Inbound | None, bool] = (None, False)
        """The inbound ``decode_inbound`` passed last, and whether its key was seen before it."""
        self.overdue_interval_s = 60.0
        """How often a round past its deadline is reported again while it waits."""
        self._overdue: dict[tuple[object, ...], float] = {}
        self.busy_s: dict[str, float] = {"decode": 0.0, "handle": 0.0, "tick": 0.0}
        """Seconds of this node's thread spent decoding messages, handling them (decoding included) and ticking
        (``run_loop``): where a round's time goes (the fleet benchmark's breakdown)."""
        self.presence_docs: dict[str, dict[str, Any]] = {}
        """The last online presence document of each node (optional fields such as a device's
        ``trainer`` are there for logs and operators; the protocol needs only ``state``/``since``)."""
        self._cell_scoped: set[str] = set()
        """Nodes whose presence has come on a cell's presence topic (``stale_presence``)."""

    def reject(self, inbound: Inbound, exc: RemoteProtocolError) -> None:
        """Count a rejected message by its typed reason, and log it, thinned (module docstring).

        A message whose idempotency key this node had already received on its sender's own topic
        is a redelivery (QoS 1 after a reconnect, a resend from a restarted node's store, a broker
        restart's recovery): the first copy was handled or reported, so this one is logged at
        DEBUG. Otherwise each (reason, sender) is logged at WARNING at most once a minute, with
        the number left out since; the rest at DEBUG.
        """
        self.metrics.inc(REJECTED, reason=exc.reason)
        if exc.reason == "late":
            self.metrics.inc(STRAGGLERS)
        if self._decoded[0] is inbound and self._decoded[1]:
            self.log.debug("rejected message on %s again (a redelivery): %s: %s", inbound.topic, exc.reason, exc)
            return
        skipped = self._reject_log((exc.reason, sender_of(inbound.topic)))
        if skipped is None:
            if self._reject_log.exhausted:
                self.log.warning("rejected messages of more than %d reasons and senders this minute: the rest of "
                                 "this minute's are counted (%s) and logged at DEBUG only", REJECT_LOG_BUDGET,
                                 REJECTED)
            self.log.debug("rejected message on %s: %s: %s", inbound.topic, exc.reason, exc)
            return
        more = f" ({skipped} more since)" if skipped else ""
        self.log.warning("rejected message on %s: %s: %s%s", inbound.topic, exc.reason, exc, more)

    def parse_topic(self, inbound: Inbound) -> topics.Topic | None:
        """The parsed topic, or ``None`` after rejecting a topic outside the fedtier tree."""
        parsed = topics.parse(inbound.topic)
        if parsed is None:
            self.reject(inbound, UnexpectedMessageError(f"topic {inbound.topic!r} is not in the fedtier tree"))
        return parsed

    def came_online(self, inbound: Inbound, parsed: topics.Topic) -> str | None:
        """The node id if this presence message is a *new* online event, else ``None``.

        Retained presence is redelivered on every (re)subscription; the ``since`` stamp a node
        sets at each connect tells a reconnection from a repeat, so a parent resends the open
        task once per reconnection, not once per redelivery.
        """
        node = parsed.device
        try:
            doc = json.loads(inbound.payload.decode()) if inbound.payload else {}
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            self.reject(inbound, UnexpectedMessageError(f"status of {node} is not JSON"))
            return None
        if node is None or not isinstance(doc, dict) or doc.get("state") != "online":
            return None
        since = doc.get("since")
        stamp = float(since) if isinstance(since, (int, float)) and math.isfinite(since) else 0.0
        if self._presence.get(node) == stamp:
            return None
        self._presence[node] = stamp
        instance = doc.get("instance")
        if isinstance(instance, str):
            self._track_instance(node, instance)
        self.presence_docs[node] = doc
        return node

    def stale_presence(self, parsed: topics.Topic) -> bool:
        """Whether a presence message is an upgraded device's old document, to be ignored.

        Agents before cell-scoped presence announced themselves on ``ft/v1/status/<device>``; once one of them
        runs a newer version, that topic keeps its last (retained) document while the device announces itself
        on ``ft/v1/status/<cell>/<device>``. A reader of both (the coordinator on a shared broker) takes the
        cell's topic as the truth once it has seen the device there.
        """
        if parsed.device is None:
            return False
        if parsed.cell is not None:
            self._cell_scoped.add(parsed.device)
            return False
        return parsed.device in self._cell_scoped

    def _track_instance(self, node: str, instance: str) -> None:
        """Two clients under one id take turns (A, B, A...): each connect takes the other's session.

        A restart shows a new instance once (A, B, B...); only an instance that comes back after
        another one appeared means two live processes share the identity.
        """
        seen = self._instances.setdefault(node, [])
        if seen and seen[-1] == instance:
            return
        if instance in seen:
            others = sorted(set(seen) - {instance})
            self.metrics.inc(IDENTITY_CONFLICTS, identity=node)
            skipped = self._conflict_log(node)
            if skipped is not None:
                more = f" ({skipped} more since the last report)" if skipped else ""
                self.log.error("two clients use the identity %s (instances %s and %s take turns): a copied bundle? "
                               "each disconnects the other whenever it connects; stop one, and give the second "
                               "board its own identity (fedtier provision device)%s", node, instance,
                               ", ".join(others), more)
            seen.remove(instance)
        seen.append(instance)
        del seen[:-4]

    def report_overdue(self, what: str, key: tuple[object, ...], waiting: Sequence[str], now: float) -> None:
        """Log (at WARNING) who a round past its deadline waits for: once, then every ``overdue_interval_s``.

        Args:
            what: the round as a person reads it ("round 3 of rollout r").
            key: identifies the round (and step): a new key is reported at once.
            waiting: the members (devices, or cells) that have not reported.
            now: the node's clock.
        """
        if not waiting:
            return
        last = self._overdue.get(key)
        if last is not None and now - last < self.overdue_interval_s:
            return
        if last is None:
            self._overdue = {k: v for k, v in self._overdue.items() if k[:1] != key[:1]}  # older rounds
        self._overdue[key] = now
        self.log.warning("%s is past its deadline and still waits for %s (a quorum below 1.0 closes a round "
                         "without them at the deadline): check that they run and reach their broker",
                         what, listed(waiting))

    def decode_inbound(self, inbound: Inbound, parsed: topics.Topic) -> Message | None:
        """Decode an envelope-carrying message and check it against the topic it came on.

        The topic's origin segment (a device id under ``cell/+/up``, a cell id under
        ``edge/+/up``) is what the broker's ACL vouches for; a sender field that differs
        from it is a spoofing attempt or a bug, rejected as ``sender_mismatch``.
        """
        if inbound.error is not None:
            self.reject(inbound, inbound.error)
            return None
        started = time.perf_counter()
        try:
            msg = messages.decode_message(inbound.payload, max_bytes=self.max_message_bytes)
            self.busy_s["decode"] += time.perf_counter() - started
            if parsed.rollout is not None and msg.rollout != parsed.rollout:
                raise UnexpectedMessageError(f"message for rollout {msg.rollout!r} on a topic of {parsed.rollout!r}")
            if parsed.kind is not None and msg.KIND != parsed.kind:
                raise UnexpectedMessageError(f"{msg.KIND} message on a {parsed.kind} topic")
            origin = parsed.origin
            if origin is not None and msg.sender != origin:
                raise SenderMismatchError(f"sender {msg.sender!r} published on the topic of {origin!r}")
        except RemoteProtocolError as exc:
            self.reject(inbound, exc)
            return None
        self._remember(inbound, msg.key)
        return msg

    def _remember(self, inbound: Inbound, key: str) -> None:
        """Note that ``inbound`` (its checks passed) carries ``key``, and whether that key came before."""
        seen = key in self._seen
        self._decoded = (inbound, seen)
        self._seen[key] = None
        if seen:
            self._seen.move_to_end(key)
        elif len(self._seen) > SEEN_KEYS:
            self._seen.popitem(last=False)

    def diagnostics(self, actions: Sequence[Action]) -> None:
        """Log ``Dropped`` and ``Note`` actions (the role's diagnostics) and count drops."""
        for action in actions:
            if isinstance(action, Dropped):
                self.metrics.inc(DROPPED, reason=action.reason)
                level = logging.DEBUG if action.reason in EXPECTED_DROPS else logging.INFO
                self.log.log(level, "dropped %s: %s %s", action.key, action.reason, action.detail)
            elif isinstance(action, Note):
                self.log.log(logging.DEBUG if action.event in ROUTINE_NOTES else logging.INFO, "%s %s", action.event,
                             " ".join(f"{k}={v}" for k, v in action.fields.items()))


MAX_BATCH = 256
"""Messages a node with a ``batch()`` (the edge) handles per commit, at most."""


def run_loop(node: Node, inbox: "queue.Queue[Inbound]", stop: threading.Event, *, tick_s: float = 0.1,
             clock: Callable[[], float] = time.monotonic) -> None:
    """The one thread that touches a node: process inbound messages in order, tick deadlines.

    ``confirm()`` (the MQTT acknowledgement) runs only after ``handle`` returned, so a crash
    while handling leaves the message with the broker for redelivery. A node with ``batch()``
    (the edge, whose store makes every accepted update durable) handles the messages already
    waiting together inside it, and they are confirmed only after the batch committed.
    """
    next_tick = clock()
    while not stop.is_set():
        try:
            inbound = inbox.get(timeout=tick_s)
        except queue.Empty:
            inbound = None
        now = clock()
        busy = getattr(node, "busy_s", None)
        if inbound is not None:
            batch = [inbound]
            grouped = getattr(node, "batch", None)
            if grouped is None:
                node.handle(inbound, now)
            else:  # the messages already waiting, handled together and made durable with one commit
                while len(batch) < MAX_BATCH:
                    try:
                        batch.append(inbox.get_nowait())
                    except queue.Empty:
                        break
                with grouped():
                    for item in batch:
                        node.handle(item, now)
            for item in batch:
                item.confirm()
            if busy is not None:
                busy["handle"] += clock() - now
        if now >= next_tick:
            started = clock()
            node.tick(now)
            next_tick = now + tick_s
            if busy is not None:
                busy["tick"] += clock() - started


def sender_of(topic: str) -> str:
    """Who a topic attributes a message to, for ``NodeBase.reject``'s log: the node id of an uplink (what
    the broker's ACL vouches for), else the topic's channel (``cloud_down``, ``status``...), else ``other``."""
    parsed = topics.parse(topic)
    if parsed is None:
        return "other"
    return parsed.origin or parsed.channel


def listed(names: Sequence[str], limit: int = 20) -> str:
    """``names`` for a log line: all of them up to ``limit``, else the first ``limit`` and how many more
    (a cell of 1,000 devices must not write a 10 kB line)."""
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more ({len(names)} in all)"

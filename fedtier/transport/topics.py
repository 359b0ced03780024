"""The MQTT topic tree (DESIGN §5). Every topic fedtier uses is built and parsed here.

::

    ft/v1/{rollout}/manifest                              cloud -> edges (retained)
    ft/v1/{rollout}/cloud/down/{cell}/{kind}              cloud -> edge of {cell}
    ft/v1/{rollout}/edge/{cell}/up/{kind}                 edge -> cloud
    ft/v1/{rollout}/cell/{cell}/down/manifest             edge -> devices (retained)
    ft/v1/{rollout}/cell/{cell}/down/{kind}[/{device}]    edge -> devices (or one device)
    ft/v1/{rollout}/cell/{cell}/up/{device}/{kind}        device -> edge
    ft/v1/status/{node}                                   presence of an edge or the cloud, retained + last will
    ft/v1/status/{cell}/{device}                          presence of a device in its cell, retained + last will

A device's presence is under its cell so that only its own edge follows it (a shared broker does
not hand every device's connects to every edge); an edge summarises it for the coordinator
(``cell_presence`` on its uplink), which is what crosses a gateway's bridge. Agents before that
announced themselves on ``ft/v1/status/{device}``; edges no longer follow that topic.

The id segments ({rollout}, {cell}, {device}) are restricted to ``[A-Za-z0-9_.-]`` so that
no id can smuggle a wildcard or a level separator into a topic, and so that an ACL
pattern on the device segment (``%u`` = certificate CN) is exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fedtier.errors import LocalProtocolError

PREFIX = "ft/v1"
_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")


def is_id(value: object) -> bool:
    """Whether ``value`` is a valid id: fullmatch (a trailing newline is not allowed), not . or .."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None and value not in (".", "..")


def check_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is a valid node/cell/rollout id, else raise ``LocalProtocolError``."""
    if not is_id(value):
        raise LocalProtocolError(f"invalid {what} {value!r}: use 1-64 of A-Z a-z 0-9 _ . -")
    return value


def check_kind(kind: str) -> str:
    """A message kind used as a topic level: lowercase identifier; ``manifest`` is reserved."""
    if not isinstance(kind, str) or _KIND.fullmatch(kind) is None or kind == "manifest":
        raise LocalProtocolError(f"invalid topic kind {kind!r}")
    return kind


def manifest(rollout: str) -> str:
    return f"{PREFIX}/{check_id(rollout, 'rollout')}/manifest"


def cloud_down(rollout: str, cell: str, kind: str) -> str:
    return f"{PREFIX}/{check_id(rollout, 'rollout')}/cloud/down/{check_id(cell, 'cell')}/{check_kind(kind)}"


def edge_up(rollout: str, cell: str, kind: str) -> str:
    if kind == "#":  # a subscription filter for every kind
        return f"{PREFIX}/{check_id(rollout, 'rollout')}/edge/{check_id(cell, 'cell')}/up/#"
    return f"{PREFIX}/{check_id(rollout, 'rollout')}/edge/{check_id(cell, 'cell')}/up/{check_kind(kind)}"


def cell_manifest(rollout: str, cell: str) -> str:
    return f"{PREFIX}/{check_id(rollout, 'rollout')}/cell/{check_id(cell, 'cell')}/down/manifest"


def cell_down(rollout: str, cell: str, kind: str, device: str | None = None) -> str:
    base = f"{PREFIX}/{check_id(rollout, 'rollout')}/cell/{check_id(cell, 'cell')}/down/{check_kind(kind)}"
    return base if device is None else f"{base}/{check_id(device, 'device')}"


def cell_up(rollout: str, cell: str, device: str, kind: str) -> str:
    return (f"{PREFIX}/{check_id(rollout, 'rollout')}/cell/{check_id(cell, 'cell')}/up/"
            f"{check_id(device, 'device')}/{check_kind(kind)}")


def status(node: str) -> str:
    """The presence topic of an edge or the coordinator (and of agents older than cell-scoped presence)."""
    return f"{PREFIX}/status/{check_id(node, 'node')}"


def cell_status(cell: str, device: str) -> str:
    """The presence topic of a device (or host) of ``cell``: followed by that cell's edge alone."""
    return f"{PREFIX}/status/{check_id(cell, 'cell')}/{check_id(device, 'device')}"


# Subscription filters -------------------------------------------------------------------

ALL_MANIFESTS = f"{PREFIX}/+/manifest"
ALL_STATUS = f"{PREFIX}/status/+"
"""Presence of every edge and of the coordinator (one level: devices' presence is under their cell)."""
ALL_CELL_STATUS = f"{PREFIX}/status/+/+"
"""Presence of every device of every cell: the coordinator's view on a shared broker (never an edge's)."""


def cell_status_filter(cell: str) -> str:
    """What an edge subscribes to on its cell broker for presence: its own cell's devices."""
    return f"{PREFIX}/status/{check_id(cell, 'cell')}/+"


def cloud_down_filter(cell: str) -> str:
    """What an edge subscribes to on the cloud broker."""
    return f"{PREFIX}/+/cloud/down/{check_id(cell, 'cell')}/#"


def edge_up_filter() -> str:
    """What the coordinator subscribes to: every cell's uplink, every rollout."""
    return f"{PREFIX}/+/edge/+/up/#"


def cell_down_filter(cell: str) -> str:
    """A cell's whole downlink, every rollout: the broadcasts and every device's own messages."""
    return f"{PREFIX}/+/cell/{check_id(cell, 'cell')}/down/#"


def device_down_filters(cell: str, device: str) -> tuple[str, str]:
    """What a device subscribes to: its cell's broadcasts and the messages addressed to it, every rollout.

    Not the cell's whole downlink (``cell_down_filter``): there, every device would also receive every
    other device's own messages (the files each asked for, catch-ups), which in a cell of thousands of
    devices costs each of them thousands of deliveries it drops."""
    base = f"{PREFIX}/+/cell/{check_id(cell, 'cell')}/down/+"
    return base, f"{base}/{check_id(device, 'device')}"


def cell_up_filter(cell: str) -> str:
    """What an edge subscribes to on its cell broker: every device of the cell."""
    return f"{PREFIX}/+/cell/{check_id(cell, 'cell')}/up/+/#"


@dataclass(frozen=True, slots=True)
class Topic:
    """A parsed fedtier topic. ``origin`` is the node the topic attributes the message to."""

    channel: str  # manifest | cloud_down | edge_up | cell_manifest | cell_down | cell_up | status
    # (status: ``device`` is the node; ``cell`` is set on a device's cell-scoped presence topic)
    rollout: str | None
    cell: str | None
    kind: str | None
    device: str | None = None

    @property
    def origin(self) -> str | None:
        if self.channel == "cell_up":
            return self.device
        if self.channel == "edge_up":
            return self.cell
        return None


def parse(topic: str) -> Topic | None:
    """Parse a topic of the tree above; ``None`` for anything else (the caller rejects it)."""
    parts = topic.split("/")
    if len(parts) < 3 or parts[0] != "ft" or parts[1] != "v1":
        return None
    rest = parts[2:]
    if rest[0] == "status" and len(rest) in (2, 3):  # (no rollout topic has one or two levels after its id)
        return _parse_status(rest[1:])
    if not is_id(rest[0]):
        return None
    rollout = rest[0]
    tail = rest[1:]
    if tail == ["manifest"]:
        return Topic("manifest", rollout, None, "manifest")
    if len(tail) == 4 and tail[0] == "cloud" and tail[1] == "down" and is_id(tail[2]):
        return Topic("cloud_down", rollout, tail[2], tail[3])
    if len(tail) == 4 and tail[0] == "edge" and tail[2] == "up" and is_id(tail[1]):
        return Topic("edge_up", rollout, tail[1], tail[3])
    if len(tail) >= 4 and tail[0] == "cell" and is_id(tail[1]):
        return _parse_cell(rollout, tail[1], tail[2:])
    return None


def _parse_status(ids: list[str]) -> Topic | None:
    """``status/{node}`` or ``status/{cell}/{device}`` (a device's presence in its cell)."""
    if not all(is_id(i) for i in ids):
        return None
    if len(ids) == 1:
        return Topic("status", None, None, None, device=ids[0])
    return Topic("status", None, ids[0], None, device=ids[1])


def _parse_cell(rollout: str, cell: str, tail: list[str]) -> Topic | None:
    """The levels after ``{rollout}/cell/{cell}/``."""
    if tail[0] == "down":
        if tail[1:] == ["manifest"]:
            return Topic("cell_manifest", rollout, cell, "manifest")
        if len(tail) == 2:
            return Topic("cell_down", rollout, cell, tail[1])
        if len(tail) == 3 and is_id(tail[2]):
            return Topic("cell_down", rollout, cell, tail[1], device=tail[2])
    if tail[0] == "up" and len(tail) == 3 and is_id(tail[1]):
        return Topic("cell_up", rollout, cell, tail[2], device=tail[1])
    return None

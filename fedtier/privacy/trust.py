"""Trust labels of the aggregation tree and where noise goes (M2FDP, seed 004 §1.3–§1.4).

Every server (an edge, or an intermediate aggregator at any depth) may be declared
``trusted`` — "my children may send me un-noised models". The *effective* label follows
the paper's closure rule: a server with an untrusted child is untrusted, so trusted nodes
always form whole bottom subtrees. The cloud is never trusted. Undeclared servers are
untrusted: forgetting a label must cost utility, never privacy.

Noise is injected exactly once per device-to-cloud path, where a message first crosses into
an untrusted node (digest §7):

    injects(v) = (v is a device or v is trusted) and parent(v) is untrusted

so a device adds noise when its edge is untrusted, a trusted server when it forwards to an
untrusted parent, and untrusted servers add nothing (their inputs already carry noise).

The sensitivity of a trusted server's aggregate shrinks with the uniform weights on the way
up: a device's weight in node ``v``'s aggregate is the product of ``1/|children|`` along its
path, so ``v``'s sensitivity is ``2C / fan_in(v)`` with ``fan_in(v)`` the smallest such
product of child counts over the devices below ``v`` (the paper's ``prod s_l``, exact per node).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from fedtier.errors import ConfigError

DEVICE, SERVER, CLOUD = "device", "server", "cloud"


@dataclass(frozen=True, slots=True)
class TrustNode:
    """One node of the resolved tree.

    Attributes:
        node: its id.
        kind: "device", "server" or "cloud".
        parent: its parent's id (``None`` for the cloud).
        layer: 0 for the cloud, 1 for its children, ... (devices have the largest layer on their path).
        declared: the label in the config (``None``: not declared; devices and the cloud have none).
        trusted: the effective label (devices: ``False`` — they are data owners, not aggregators).
        injects: whether this node adds fresh noise to what it sends its parent.
        fan_in: the smallest product of child counts from this node down to one of its devices
            (1 for a device); a trusted server's sensitivity is ``2C / fan_in``.
        devices: number of devices below (1 for a device).
        why: how the effective label came about, for people reading a plan.
    """

    node: str
    kind: str
    parent: str | None
    layer: int
    declared: bool | None
    trusted: bool
    injects: bool
    fan_in: int
    devices: int
    why: str


def resolve(*, cloud: str, cells: Mapping[str, tuple[str, ...]], parents: Mapping[str, str] | None = None,
            declared: Mapping[str, bool] | None = None, key: str = "topology") -> dict[str, TrustNode]:
    """Resolve effective trust labels and noise placement for a tree of any depth.

    Args:
        cloud: the cloud's id (the root).
        cells: edge (leaf server) -> its devices.
        parents: server -> parent server, for servers not directly under the cloud; servers
            named only here are intermediate aggregators.
        declared: server -> declared ``trusted`` label.
        key: config prefix for error messages (``topology``).

    Returns:
        node id -> ``TrustNode`` for the cloud, every server and every device.

    Raises:
        ConfigError: naming the offending key — a label on the cloud (never trusted) or on a
            device or an unknown node; a parent that is not a server; a cycle; or a server
            declared trusted above a server explicitly declared untrusted (a contradiction:
            the closure rule would silently overrule one of the two declarations).
    """
    parents = dict(parents or {})
    declared = dict(declared or {})
    devices = {d: cell for cell, members in cells.items() for d in members}
    servers = set(cells) | set(parents) | {p for p in parents.values() if p != cloud}
    _check_parents(cloud, parents, devices, servers, key)
    _check_declared(cloud, declared, devices, servers, key)
    parent_of: dict[str, str] = {s: parents.get(s, cloud) for s in servers}
    parent_of.update(devices)
    children: dict[str, list[str]] = {cloud: [], **{s: [] for s in servers}}
    for node, parent in parent_of.items():
        children[parent].append(node)
    _check_reaches_cloud(cloud, servers, parent_of, children, key)
    labeler = _Labeler(cloud=cloud, devices=devices, parent_of=parent_of, children=children, declared=declared,
                       key=key)
    labeler.visit(cloud, 0)
    return _place_noise(labeler.out)


def _check_parents(cloud: str, parents: Mapping[str, str], devices: Mapping[str, str], servers: set[str],
                   key: str) -> None:
    """``topology.parents`` links servers to servers (or the cloud): never the cloud or a device as a child,
    never a device or an unknown node as a parent."""
    for node in parents:
        if node == cloud:
            raise ConfigError("the cloud has no parent", key=f"{key}.parents.{node}")
        if node in devices:
            raise ConfigError("devices belong to their cell (topology.members), not to a parent server",
                              key=f"{key}.parents.{node}")
    for node, parent in parents.items():
        if parent != cloud and parent not in servers:
            raise ConfigError(f"parent {parent!r} is not a server of this topology", key=f"{key}.parents.{node}")
        if parent in devices:
            raise ConfigError(f"parent {parent!r} is a device", key=f"{key}.parents.{node}")


def _check_declared(cloud: str, declared: Mapping[str, bool], devices: Mapping[str, str], servers: set[str],
                    key: str) -> None:
    """Labels go on servers only: the cloud may be declared untrusted (it is anyway), never trusted."""
    for node, label in declared.items():
        if node == cloud:
            if label:
                raise ConfigError("the cloud is never trusted (it sees every cell's aggregate)",
                                  key=f"{key}.trusted.{node}")
            continue
        if node in devices:
            raise ConfigError("devices carry no trust label (they own the data; they add noise when their edge "
                              "is untrusted)", key=f"{key}.trusted.{node}")
        if node not in servers:
            raise ConfigError(f"no server {node!r} in the topology", key=f"{key}.trusted.{node}")


def _check_reaches_cloud(cloud: str, servers: set[str], parent_of: Mapping[str, str],
                         children: Mapping[str, list[str]], key: str) -> None:
    """Every server reaches the cloud without a cycle and has devices below it: a tree, and no empty branch."""
    for node in servers:
        seen, cur = {node}, parent_of[node]
        while cur != cloud:
            if cur in seen:
                raise ConfigError(f"parents form a cycle through {cur!r}", key=f"{key}.parents.{node}")
            seen.add(cur)
            cur = parent_of[cur]
        if not children[node]:
            raise ConfigError(f"server {node!r} has no devices below it", key=f"{key}.parents.{node}")


@dataclass
class _Labeler:
    """The checked tree, labelled bottom-up: a server's effective label depends on its children's, so each
    node is resolved after its subtree. ``out`` collects the nodes in that (post-)order."""

    cloud: str
    devices: Mapping[str, str]
    parent_of: Mapping[str, str]
    children: Mapping[str, list[str]]
    declared: Mapping[str, bool]
    key: str
    out: dict[str, TrustNode] = field(default_factory=dict)

    def visit(self, node: str, layer: int) -> TrustNode:
        kids = sorted(self.children.get(node, ()))
        resolved = [self.visit(k, layer + 1) for k in kids]
        if node in self.devices:
            entry = TrustNode(node, DEVICE, self.devices[node], layer, None, False, False, 1, 1, "device")
        else:
            entry = self._aggregator(node, layer, kids, resolved)
        self.out[node] = entry
        return entry

    def _aggregator(self, node: str, layer: int, kids: list[str], resolved: list[TrustNode]) -> TrustNode:
        """The cloud or a server, from its resolved children: its fan-in, device count and effective label."""
        fan_in = len(kids) * min(r.fan_in for r in resolved) if resolved else 1
        count = sum(r.devices for r in resolved)
        label = self.declared.get(node)
        if node == self.cloud:
            return TrustNode(node, CLOUD, None, layer, label, False, False, fan_in, count,
                             "the cloud is never trusted")
        trusted, why = self._effective(node, label, resolved)
        return TrustNode(node, SERVER, self.parent_of[node], layer, label, trusted, False, fan_in, count, why)

    def _effective(self, node: str, label: bool | None, resolved: list[TrustNode]) -> tuple[bool, str]:
        """The closure rule: a server declared trusted is untrusted if a child server is; when that child was
        itself declared untrusted, the two declarations contradict each other and the config is refused."""
        if label is None:
            return False, "not declared (untrusted by default)"
        if not label:
            return False, "declared untrusted"
        untrusted_kids = [r.node for r in resolved if r.kind == SERVER and not r.trusted]
        if not untrusted_kids:
            return True, "declared trusted"
        contradicted = [k for k in untrusted_kids if self.declared.get(k) is False]
        if contradicted:
            raise ConfigError(f"declared trusted, but its child {contradicted[0]!r} is declared untrusted; "
                              "a server with an untrusted child is untrusted (closure rule) — remove one "
                              "of the two labels", key=f"{self.key}.trusted.{node}")
        return False, f"declared trusted; untrusted by closure (child {untrusted_kids[0]!r} is)"


def _place_noise(out: dict[str, TrustNode]) -> dict[str, TrustNode]:
    """Mark where noise goes: a device or a trusted server whose parent is untrusted (module docstring)."""
    for node, entry in list(out.items()):
        if entry.parent is None:
            continue
        parent_trusted = out[entry.parent].trusted
        injects = (entry.kind == DEVICE or entry.trusted) and not parent_trusted
        if injects:
            out[node] = dataclasses.replace(entry, injects=True)
    return out


def injection_points(tree: Mapping[str, TrustNode], device: str) -> list[str]:
    """The nodes on ``device``'s path to the cloud that add fresh noise (exactly one, by construction)."""
    path, node = [], tree[device]
    while True:
        if node.injects:
            path.append(node.node)
        if node.parent is None:
            return path
        node = tree[node.parent]

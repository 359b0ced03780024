"""Where an emulated fleet stands, for a run that stopped making progress (``fedtier fleet emulate``).

A large emulated fleet that stalls (a round that never closes) is a bug in fedtier, in the broker or in
the emulation; which one shows in where the devices and edges are. The emulator asks every worker
process for a count of its devices by state, and reads its edges' state itself, and puts both in its
error. Reading another thread's node without a lock can be one message behind, which is fine here.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedtier.algorithms.base import DeviceRole, EdgeRole


def device_state(node: Any, rollout: str) -> str:
    """One device's state in a word or three: where a device that holds up a round is stuck."""
    if not node.tx.connected:
        return "disconnected"
    if rollout in node.incoming:
        return "fetching artifacts"
    if rollout not in node.trainers:
        return "task waits for artifacts" if rollout in node._pending_task else "no manifest"
    role: DeviceRole | None = node.roles.get(rollout)
    if role is None:
        return "installed, no task"
    round_, step = role.position
    return f"{role.state.value}, round {round_} step {step}"


def describe_devices(nodes: list[Any], rollout: str) -> dict[str, dict[str, int]]:
    """Cell -> device state -> how many devices of this process are in it (plus ``outbox`` messages)."""
    cells: dict[str, Counter[str]] = {}
    for node in nodes:
        counts = cells.setdefault(node.cell, Counter())
        try:
            counts[device_state(node, rollout)] += 1
            counts["outbox"] += len(node.state.pending())
        except Exception as exc:  # noqa: BLE001 - a diagnosis must not fail on the node it describes
            counts[f"unreadable: {type(exc).__name__}"] += 1
    return {cell: dict(counts) for cell, counts in sorted(cells.items())}


def merge(reports: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """The workers' ``describe_devices`` answers summed per cell and state."""
    total: dict[str, Counter[str]] = {}
    for report in reports:
        for cell, counts in report.items():
            total.setdefault(cell, Counter()).update(counts)
    return {cell: dict(sorted(counts.items())) for cell, counts in sorted(total.items())}


def describe_edge(edge: Any, inbox: Any, rollout: str) -> dict[str, Any]:
    """An edge's open round, the updates it holds, its inbox backlog and its connections."""
    role: EdgeRole | None = edge.roles.get(rollout)
    out: dict[str, Any] = {"inbox": inbox.qsize(), "connected": edge.cell_tx.connected and edge.cloud_tx.connected}
    if role is None:
        out["round"] = None
        return out
    out.update(round=role.round, step=role.step, state=role.state.value,
               members=len(role.members), reported=len(role.reported))
    return out


def render(edges: dict[str, dict[str, Any]], devices: dict[str, dict[str, int]]) -> str:
    """The report as lines, one per cell."""
    lines = []
    for cell in sorted(set(edges) | set(devices)):
        e = edges.get(cell, {})
        head = (f"{cell}: edge round {e.get('round')} step {e.get('step')} {e.get('state', '')}, "
                f"{e.get('reported', 0)} of {e.get('members', 0)} updates held, inbox {e.get('inbox', 0)}, "
                f"{'connected' if e.get('connected', True) else 'DISCONNECTED'}")
        states = ", ".join(f"{n} {state}" for state, n in devices.get(cell, {}).items())
        lines.append(f"{head}; devices: {states or 'no answer from the workers'}")
    return "\n".join(lines)

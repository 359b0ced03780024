"""Which model version each cell serves: promotion through canary cells with a health gate, and rollback.

Training makes a new model version every round; serving one is a separate, deliberate step. A
promotion first moves the *canary* cells to the candidate version, then checks the health gate:

* the candidate's parameters are all finite (no NaN or infinity);
* its accuracy on the central test set is not below the previous version's by more than
  ``margin`` (both as the coordinator evaluated them when their rounds closed);
* the agents' health: every device of the canary cells, and their edges, are online (their
  retained presence), checked throughout ``observe_s`` seconds.

If the gate passes, every cell moves to the candidate; if it fails, the canary cells go back to the
previous version, nothing else moved, and the reasons are returned and recorded (``promotions``).
Deployments live in the coordinator's store (``deployments``); the device inventory shows each
device's served version from there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from cloud_coordinator.status import cells_of
from cloud_coordinator.store import CoordinatorStore
from fedtier.errors import ConfigError


@dataclass(frozen=True)
class Promotion:
    """What ``promote`` did."""

    rollout: str
    candidate: int
    previous: int | None
    canary: tuple[str, ...]
    passed: bool
    reasons: tuple[str, ...] = ()
    deployed: dict[str, int | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"rollout": self.rollout, "candidate": self.candidate, "previous": self.previous,
                "canary": list(self.canary), "passed": self.passed, "reasons": list(self.reasons),
                "deployed": dict(self.deployed)}


def _rollout_cells(store: CoordinatorStore, rollout: str) -> dict[str, list[str]]:
    for row in store.rollout_rows():
        if row["rollout"] == rollout:
            return cells_of(row["config"])
    raise ConfigError(f"no rollout {rollout!r} in this store", key="rollout")


def _version(store: CoordinatorStore, rollout: str, version: int) -> dict[str, Any]:
    for m in store.models(rollout):
        if m["version"] == version:
            return m
    raise ConfigError(f"rollout {rollout!r} has no model version {version} (`fedtier rollout models {rollout}`)",
                      key="version")


def health_problems(store: CoordinatorStore, cells: dict[str, list[str]], canary: Sequence[str]) -> list[str]:
    """Why the canary cells' agents are not healthy now (empty: healthy)."""
    presence = {p["node"]: p for p in store.presence()}
    problems = []
    for cell in canary:
        if presence.get(cell, {}).get("state") != "online":
            problems.append(f"edge {cell} is not online")
        offline = [d for d in cells[cell] if presence.get(d, {}).get("state") != "online"]
        if offline:
            problems.append(f"cell {cell}: devices not online: {', '.join(offline)}")
    return problems


def promote(store: CoordinatorStore, rollout: str, canary: Sequence[str], *, version: int | None = None,
            margin: float = 0.01, observe_s: float = 0.0, sleep: Callable[[float], None] = time.sleep) -> Promotion:
    """Promote ``version`` (default the newest) through ``canary`` cells (see the module docstring).

    Raises:
        ConfigError: an unknown rollout, cell or version, or a negative margin.
    """
    if margin < 0:
        raise ConfigError("the accuracy margin must be >= 0", key="margin")
    cells = _rollout_cells(store, rollout)
    unknown = [c for c in canary if c not in cells]
    if unknown or not canary:
        raise ConfigError(f"canary cells must be cells of {rollout} ({', '.join(cells)}); got {list(canary)}",
                          key="canary")
    models = store.models(rollout)
    if not models:
        raise ConfigError(f"rollout {rollout!r} has no model version yet", key="version")
    candidate = _version(store, rollout, models[-1]["version"] if version is None else version)
    deployed = store.deployments(rollout)
    served = [deployed[c] for c in cells if c in deployed]
    previous = max(set(served), key=served.count) if served else None  # what most of the fleet serves
    store.set_deployment(rollout, canary, candidate["version"])
    reasons: list[str] = []
    model = store.model(rollout, candidate["version"])
    assert model is not None
    bad = sorted(n for n, p in model.params.items() if not np.all(np.isfinite(p)))
    if bad:
        reasons.append(f"version {candidate['version']} has non-finite parameters: {', '.join(bad)}")
    if previous is not None:
        before = _version(store, rollout, previous)["accuracy"]
        after = candidate["accuracy"]
        if after is None or (isinstance(after, float) and math.isnan(after)):
            if before is not None:
                reasons.append(f"version {candidate['version']} has no test accuracy to compare with version "
                               f"{previous}'s {before:.4f}")
        elif before is not None and after < before - margin:
            reasons.append(f"accuracy {after:.4f} of version {candidate['version']} is below version {previous}'s "
                           f"{before:.4f} by more than the margin {margin:g}")
    waited = 0.0
    while True:
        problems = health_problems(store, cells, canary)
        if problems or waited >= observe_s:
            break
        step = min(1.0, observe_s - waited)
        sleep(step)
        waited += step
    reasons += problems
    passed = not reasons
    if passed:
        store.set_deployment(rollout, list(cells), candidate["version"])
    else:
        _restore(store, rollout, canary, deployed)
    store.add_promotion(rollout, candidate["version"], previous, canary, passed, reasons)
    return Promotion(rollout=rollout, candidate=candidate["version"], previous=previous, canary=tuple(canary),
                     passed=passed, reasons=tuple(reasons), deployed={c: store.deployments(rollout).get(c)
                                                                    for c in cells})


def _restore(store: CoordinatorStore, rollout: str, cells: Sequence[str], before: dict[str, int]) -> None:
    """Put ``cells`` back on what they served before (no deployment at all if they served nothing)."""
    for cell in cells:
        if cell in before:
            store.set_deployment(rollout, [cell], before[cell])
        else:
            store.clear_deployment(rollout, cell)


def rollback(store: CoordinatorStore, rollout: str, version: int) -> dict[str, int | None]:
    """Every cell of ``rollout`` serves ``version`` again. Returns cell -> served version."""
    cells = _rollout_cells(store, rollout)
    _version(store, rollout, version)
    store.set_deployment(rollout, list(cells), version)
    store.add_promotion(rollout, version, None, [], True, [f"rollback to version {version}"])
    return {c: store.deployments(rollout).get(c) for c in cells}

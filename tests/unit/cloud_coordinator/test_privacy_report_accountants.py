"""``privacy report`` shows the ledger's epsilon under both accountants (issue 17 Part B.2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_coordinator.privacy import report as rep
from cloud_coordinator.privacy.accountant import Accountant, epsilon


def _rows() -> list[dict]:
    rows = []
    for rnd in range(6):
        rows.append({"round": rnd, "event": "edge", "step": 0, "node": "cell-a", "parent": "cloud",
                     "parent_trusted": False, "protected": ["d0", "d1"], "sensitivity": 1.0, "inputs": {},
                     "sigma": 2.0, "noise_multiplier": 2.0, "mode": "rdp", "observed": True})
        rows.append({"round": rnd, "event": "device", "step": 0, "node": "d2", "parent": "cell-b",
                     "parent_trusted": False, "protected": ["d2"], "sensitivity": 2.0, "inputs": {},
                     "sigma": 6.0, "noise_multiplier": 3.0, "mode": "rdp", "observed": True})
    return rows


@pytest.mark.parametrize("accounting", ["rdp", "pld"])
def test_report_uses_the_rollouts_accountant_and_shows_both(accounting: str) -> None:
    rows, delta = _rows(), 1e-5
    by = {}
    for kind in ("rdp", "pld"):
        acc = Accountant(delta, accounting=kind)
        for r in rows:
            acc.add(r["protected"], r["noise_multiplier"], 1)
        by[kind] = max(acc.epsilons().values())
    assert by["pld"] < by["rdp"]  # PLD is the tighter of the two on the same releases
    assert by["rdp"] == pytest.approx(epsilon([(2.0, 6)], delta))
    recomputed = {d: epsilon([(2.0, 6)] if d != "d2" else [(3.0, 6)], delta, accounting=accounting)
                  for d in ("d0", "d1", "d2")}
    doc = rep.build(rollout="r", db=Path("x.db"), releases=rows, clear=[], rounds=[], recomputed=recomputed,
                    delta=delta, budget=100.0, mode="rdp", status="finished", rounds_planned=6, stopped=None,
                    accounting=accounting, by_accountant=by)
    assert doc["accountant"] == accounting
    assert doc["rounds"][-1]["epsilon_max"] == pytest.approx(by[accounting])  # the series uses it too
    text = rep.render(doc)
    assert f"from the {accounting.upper()} accountant" in text
    assert f"PLD {rep.fmt(by['pld'])}" in text and f"RDP {rep.fmt(by['rdp'])}" in text

"""``privacy report`` with device sampling: an untrusted-cell device the cloud never samples released nothing
and is charged nothing, so the report says "yes" for it and for every round (issue 33, item 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cloud_coordinator.privacy import report as rep
from cloud_coordinator.privacy.accountant import Accountant

DELTA = 1e-5
DEVICES = ("d0", "d1", "d2", "d3", "d4")  # d0, d1 under trusted cell-a; d2..d4 under untrusted cell-b


def _ledger(rounds: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Accountant]:
    """Rows and live round metrics as the coordinator writes them: cell-a's sampled (amplified) edge release
    charged to both members, and in cell-b only the sampled device releases (d2 on even rounds, d3 on odd
    ones, d4 never). The live accountant lists every member from the start, like ``PrivacyLedger``."""
    live = Accountant(DELTA)
    for d in DEVICES:
        live.add([d], 0.0, 0)
    rows: list[dict[str, Any]] = []
    metrics: list[dict[str, Any]] = []
    for rnd in range(rounds):
        new = [{"round": rnd, "event": "edge", "step": 0, "node": "cell-a", "parent": "cloud",
                "parent_trusted": False, "protected": ["d0", "d1"], "sensitivity": 1.0,
                "inputs": {"sample_rate": 0.5, "population": 2}, "sigma": 1.5, "noise_multiplier": 1.5,
                "mode": "rdp", "observed": True},
               {"round": rnd, "event": "device", "step": 0, "node": "d2" if rnd % 2 == 0 else "d3",
                "parent": "cell-b", "parent_trusted": False, "protected": ["d2" if rnd % 2 == 0 else "d3"],
                "sensitivity": 2.0, "inputs": {}, "sigma": 8.0, "noise_multiplier": 4.0, "mode": "rdp",
                "observed": True}]
        for row in new:
            q, population = 0.5 if row["event"] == "edge" else 1.0, 2 if row["event"] == "edge" else 0
            live.add(row["protected"], row["noise_multiplier"], 1, sampling_rate=q, population=population)
        rows += new
        eps = live.epsilons()
        metrics.append({"round": rnd, "accuracy": 0.5, "privacy": {
            "epsilon_max": max(eps.values()), "epsilon_min": min(eps.values()), "delta": DELTA,
            "epsilon": dict(eps)}})
    return rows, metrics, live


def _build(rows: list[dict[str, Any]], metrics: list[dict[str, Any]], recomputed: dict[str, float]) -> dict:
    return rep.build(rollout="r", db=Path("x.db"), releases=rows, clear=[], rounds=metrics, recomputed=recomputed,
                     delta=DELTA, budget=100.0, mode="rdp", status="finished", rounds_planned=len(metrics),
                     stopped=None)


def _recompute(rows: list[dict[str, Any]]) -> dict[str, float]:
    """What ``ledger.recompute`` returns: only the devices some row protects."""
    acc = Accountant(DELTA)
    for row in rows:
        q = float(row["inputs"].get("sample_rate", 1.0))
        acc.add(row["protected"], row["noise_multiplier"], 1, sampling_rate=q,
                population=int(row["inputs"].get("population", 0)))
    return acc.epsilons()


def test_a_never_sampled_device_and_every_round_match() -> None:
    # Prepare
    rows, metrics, live = _ledger(6)
    recomputed = _recompute(rows)
    assert "d4" not in recomputed and live.epsilons()["d4"] == 0.0  # the case: no row, listed live at 0
    # Execute
    doc = _build(rows, metrics, recomputed)
    text = rep.render(doc)
    # Assert
    d4 = next(d for d in doc["devices"] if d["device"] == "d4")
    assert d4["agrees"] and d4["epsilon"] == 0.0 and d4["releases"] == 0
    assert all(p["agrees"] for p in doc["rounds"]), [p for p in doc["rounds"] if not p["agrees"]]
    assert all(p["epsilon_min"] == 0.0 for p in doc["rounds"])  # d4 is at 0 after every round, as live says
    assert "MISMATCH" not in text and doc["warnings"] == []


@pytest.mark.parametrize("live_eps", [0.5, None])
def test_a_device_without_rows_still_mismatches_when_live_charged_it(live_eps: float | None) -> None:
    # Prepare: live says d4 spent epsilon (or says nothing about a device the rows list), the rows never charged it
    rows, metrics, _ = _ledger(3)
    recomputed = _recompute(rows)
    if live_eps is None:
        for m in metrics:
            del m["privacy"]["epsilon"]["d2"]
    else:
        metrics[-1]["privacy"]["epsilon"]["d4"] = live_eps
    # Execute
    doc = _build(rows, metrics, recomputed)
    # Assert
    bad = {d["device"] for d in doc["devices"] if not d["agrees"]}
    assert bad == ({"d4"} if live_eps is not None else {"d2"})
    assert "MISMATCH" in rep.render(doc)

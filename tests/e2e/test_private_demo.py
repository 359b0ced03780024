"""``fedtier demo --privacy``: the private fleet learns, and its ledger's epsilon is dp-accounting's (issue 33).

A short variant of the default (100 device agents instead of 400, 6 rounds instead of 30, the sampling rate
given instead of chosen from four plans) so that it fits CI; the default's own numbers are in docs/privacy.md.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections import defaultdict
from contextlib import closing
from pathlib import Path

import dp_accounting
import pytest
from conftest import mosquitto_binary, require
from dp_accounting import rdp

pytestmark = pytest.mark.slow


def _dp_accounting_epsilons(db: Path, delta: float) -> dict[str, float]:
    """Every device's epsilon from the ledger rows, composed by dp-accounting's RDP accountant directly: each row
    a Gaussian of its noise multiplier, Poisson-sampled at its recorded rate when its release was amplified."""
    releases: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with closing(sqlite3.connect(db)) as con:
        for protected, z, inputs in con.execute("SELECT protected, noise_multiplier, inputs FROM privacy_releases"):
            q = float(json.loads(inputs or "{}").get("sample_rate", 1.0))
            for device in json.loads(protected):
                releases[device].append((float(z), q))
    # devices of one cell share their releases (sampled in secret, every member is charged the amplified one):
    # each distinct history is composed once, which is most of this test's time otherwise
    by_history: dict[tuple[tuple[float, float], ...], float] = {}
    for history in map(tuple, releases.values()):
        if history not in by_history:
            events: list[dp_accounting.DpEvent] = []
            for z, q in history:
                event: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(z)
                events.append(dp_accounting.PoissonSampledDpEvent(q, event) if q < 1.0 else event)
            acc = rdp.RdpAccountant()
            acc.compose(dp_accounting.ComposedDpEvent(events))
            by_history[history] = float(acc.get_epsilon(delta))
    return {device: by_history[tuple(history)] for device, history in releases.items()}


def test_the_private_fleet_learns_and_its_ledger_is_dp_accountings(tmp_path: Path) -> None:
    require(mosquitto_binary() is not None, "Mosquitto")
    workdir = tmp_path / "dp"
    proc = subprocess.run([sys.executable, "-m", "fedtier", "demo", "--privacy", "--devices", "100", "--rounds", "6",
                           "--sample-rate", "0.5", "--json", "--workdir", str(workdir)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    p = result["privacy"]
    # every cell trusted, its edge sampling in secret: the noise sits at the edges, amplified
    assert all(c["trusted"] and c["noise_by"] == "edge" for c in p["cells"].values()) and len(p["cells"]) == 2
    assert p["sample_rate"] == 0.5 and result["fleet"]["emulated"] is True
    assert len(result["rounds"]) == 6 and result["stopped"] is None
    eps = p["epsilon_per_round"]
    assert all(a < b for a, b in zip(eps, eps[1:], strict=False)) and eps[-1] <= 8.0 * (1 + 1e-9)
    # it learns: ten classes, chance is 0.1
    assert result["final_accuracy"] >= 0.6, [r["accuracy"] for r in result["rounds"]]
    # the ledger's epsilon is what dp-accounting composes from the same rows, and the live one agrees
    db = workdir / "private" / "coordinator" / "coordinator.db"
    reference = _dp_accounting_epsilons(db, p["delta"])
    assert len(reference) == 100
    assert p["epsilon"] == pytest.approx(max(reference.values()), rel=1e-9)
    assert p["ledger_agrees"] and 7.9 < p["epsilon"] <= 8.0 * (1 + 1e-9)
    # and `privacy report` on the kept run finds nothing to flag
    report = subprocess.run([sys.executable, "-m", "fedtier", "privacy", "report", "--json", "--config",
                             str(workdir / "private" / "configs" / "coordinator.toml")],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    audit = json.loads(report.stdout)
    assert audit["warnings"] == [] and audit["epsilon_max"] == pytest.approx(p["epsilon"], rel=1e-12)
    assert all(d["agrees"] for d in audit["devices"]) and all(r["agrees"] for r in audit["rounds"])
    assert sum(1 for line in report.stderr.splitlines() if "converge" in line) <= 1

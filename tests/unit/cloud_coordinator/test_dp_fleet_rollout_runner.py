"""experiments/dp_fleet_rollout.py end to end at a tiny size: 2 trusted cells of 10 devices, 2 rounds.

The full grid (1,000 and 10,000 devices, epsilon 1/4/8 and non-private, 3 seeds) is in
docs/experiments.md. Here the runner's own functions run one private and one non-private rollout
through the simulator; the epsilon it reports must be the ledger's (the live metrics the coordinator
wrote, and dp-accounting's RDP accountant over the releases the plan charges), the accuracy the
metrics', and the config it keeps must be one ``fedtier simulate --config`` loads.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def runner() -> object:
    sys.path.insert(0, str(ROOT / "experiments"))
    import dp_fleet_rollout

    return dp_fleet_rollout


def tiny_spec() -> dict:
    spec = tomllib.loads((ROOT / "experiments" / "dp_fleet_rollout.toml").read_text())
    spec.update(rounds=2, seeds=[0], fleets=[[2, 10]])
    return spec


def test_the_runner_reports_the_ledgers_epsilon(runner: object, tmp_path: Path, artifact_store: Path) -> None:
    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent
    from dp_accounting.rdp import RdpAccountant

    from fedtier.rollout.config import RolloutConfig
    from fedtier.runtime.config import load

    spec = tiny_spec()
    mapping = runner.rollout_mapping(spec, 2, 10, 4.0, 0)  # type: ignore[attr-defined]
    mapping["artifact_store"] = str(artifact_store)
    out = runner.run_rollout(mapping, tmp_path / "private")  # type: ignore[attr-defined]

    metrics = json.loads((tmp_path / "private" / "metrics.json").read_text())
    rows = metrics["rounds"] if isinstance(metrics, dict) else metrics
    assert out["rounds"] == len(rows) == 2
    assert out["accuracy"] == rows[-1]["accuracy"]
    assert out["epsilon"] == pytest.approx(rows[-1]["privacy"]["epsilon_max"], rel=1e-9)  # the live ledger
    assert out["ledger_devices"] == 20 and out["releases"] == 2 * 2  # every device charged; a release per cell-round
    # dp-accounting's own RDP accountant over what the plan charges: a Poisson-sampled Gaussian per round.
    event = PoissonSampledDpEvent(spec["sample_rate"], GaussianDpEvent(out["edge_z"]))
    expected = RdpAccountant().compose(event, 2).get_epsilon(spec["delta"])
    assert out["epsilon"] == pytest.approx(expected, rel=1e-6)
    assert 3.0 < out["epsilon"] <= 4.0 + 1e-6  # calibrated to the target, within it

    kept = load(RolloutConfig, tmp_path / "private" / "rollout.toml")  # what `fedtier simulate --config` reads
    assert kept.privacy is not None and kept.privacy.sample_rate == spec["sample_rate"]
    assert all(kept.topology.trusted.values()) and len(kept.topology.trusted) == 2


def test_the_non_private_rollout_learns(runner: object, tmp_path: Path, artifact_store: Path) -> None:
    mapping = runner.rollout_mapping(tiny_spec(), 2, 10, None, 0)  # type: ignore[attr-defined]
    mapping["artifact_store"] = str(artifact_store)
    assert "privacy" not in mapping
    out = runner.run_rollout(mapping, tmp_path / "plain")  # type: ignore[attr-defined]
    assert "epsilon" not in out
    assert out["accuracy"] > 0.3  # 10 classes: chance is 0.1 (seed 0 measured 0.55)

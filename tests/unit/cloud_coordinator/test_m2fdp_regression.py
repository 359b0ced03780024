"""A reduced run of experiments/m2fdp.py: trusting edges buys utility under differential privacy.

The full study (3 seeds, two calibrations, the network-size study) is in docs/experiments.md;
this is its first row — paper calibration at epsilon 6, 10 cells x 5 devices, 20 rounds — for
one seed, through the same simulator, ORT devices, DP roles and ledger (seed 0 measured:
non-DP 0.853 > p=1 0.702 > p=0.5 0.595 > p=0 0.559).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_more_trusted_edges_give_a_better_private_model(tmp_path: Path, artifact_store: Path) -> None:
    sys.path.insert(0, str(ROOT / "experiments"))
    import m2fdp as runner

    spec = tomllib.loads((ROOT / "experiments" / "m2fdp.toml").read_text())
    accuracy = {}
    for p in (None, 0.0, 0.5, 1.0):
        mapping = runner.rollout_mapping(spec, study=None if p is None else "paper", seed=0, p=p or 0.0,
                                         schedule="paper")
        mapping.update(state_dir=str(tmp_path / str(p)), artifact_store=str(artifact_store))
        out = runner.run_one(mapping)
        accuracy[p] = out["final"]
        if p is not None:
            assert out["epsilon_max"] > 6.0  # the paper's closed form: the RDP ledger reports more
    assert accuracy[None] - accuracy[1.0] > 0.05, accuracy
    assert accuracy[1.0] - accuracy[0.5] > 0.02, accuracy
    assert accuracy[0.5] - accuracy[0.0] > 0.02, accuracy
    assert 0.5 <= accuracy[0.0] <= 0.65, accuracy

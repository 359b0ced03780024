"""``fedtier demo --privacy``'s private fleet before it starts: the rollout it writes and the sampling rate it takes
from the plan (issue 33)."""

from __future__ import annotations

from pathlib import Path

import pytest

from local_fleet.private_demo import PrivateFleetOptions, choose_sample_rate, plan_of, rollout_mapping


def test_every_cell_is_trusted_and_samples_in_secret_and_compare_has_no_privacy(tmp_path: Path) -> None:
    opts = PrivateFleetOptions(devices=40, cells=2, rounds=10)
    private = rollout_mapping(opts, tmp_path, sample_rate=0.25)
    assert private["topology"]["trusted"] == {"cell-a": True, "cell-b": True}
    assert private["privacy"]["device_sampling"] == "poisson" and private["privacy"]["sample_rate"] == 0.25
    assert private["model"]["hidden"] == []  # linear softmax: fewer parameters, less noise norm
    assert "device_sampling" not in rollout_mapping(opts, tmp_path, sample_rate=1.0)["privacy"]
    plain = rollout_mapping(opts, tmp_path, private=False)
    assert "privacy" not in plain and "trusted" not in plain["topology"]
    assert {k: v for k, v in plain.items() if k not in ("privacy", "topology")} == \
        {k: v for k, v in private.items() if k not in ("privacy", "topology")}  # same task, seeds and schedule
    with pytest.raises(ValueError, match="cell-z"):
        rollout_mapping(PrivateFleetOptions(devices=40, trusted=("cell-z",)), tmp_path)


def test_the_sampling_rate_is_the_plans_best_signal_to_noise(tmp_path: Path) -> None:
    opts = PrivateFleetOptions(devices=100, cells=2, rounds=10)
    q, snr = choose_sample_rate(opts, tmp_path, rates=(0.1, 0.5))
    for rate in (0.1, 0.5):  # each number is the plan's own estimate at that rate
        doc = plan_of(rollout_mapping(opts, tmp_path, sample_rate=rate), tmp_path)
        assert snr[rate] == pytest.approx(doc["signal_to_noise"]["rollout_snr"], rel=1e-12)
        assert doc["tiers"]["edge"]["epsilon"] == pytest.approx(8.0, rel=0.01)  # both calibrated to the target
    assert snr[q] == max(snr.values()) and snr[0.1] != snr[0.5]

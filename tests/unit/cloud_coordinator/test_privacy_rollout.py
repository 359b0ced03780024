"""M2FDP through the real shells (simulator): plan, ledger, budget stop, offline recompute, variance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from cloud_coordinator.privacy import accountant
from cloud_coordinator.privacy.ledger import recompute
from local_fleet.simulate import simulate
from cloud_coordinator.store import CoordinatorStore
from fedtier.errors import ConfigError

PRIVATE = {"topology": {"cells": 2, "devices_per_cell": 2, "trusted": {"cell-a": True}},
           "fedavg": {"local_steps": 3, "edge_rounds": 2, "lr": 0.1, "batch_size": 16}}


def private(small_rollout, tmp_path: Path, **privacy: object):
    return small_rollout(rounds=5, metrics_file=str(tmp_path / "m.json"),
                         privacy={"epsilon": 6.0, "clip": 1.0, "require_tls": False, "noise_seed": 11, **privacy},
                         **PRIVATE)


def test_a_private_rollout_charges_every_planned_release(small_rollout, tmp_path: Path) -> None:
    cfg = private(small_rollout, tmp_path)
    result = simulate(cfg, workdir=tmp_path / "w")
    assert len(result.rounds) == 5
    store = CoordinatorStore(tmp_path / "w" / "coordinator.db")
    rows = store.privacy_releases(cfg.rollout)
    clear = store.privacy_clear(cfg.rollout)
    store.close()
    # Per round: 2 devices x 2 edge rounds under the untrusted cell-b, 1 release by trusted cell-a.
    assert len(rows) == 5 * (2 * 2 + 1) and all(r["observed"] for r in rows)
    assert {r["node"] for r in rows if r["event"] == "edge"} == {"cell-a"}
    assert all(r["parent"] == "cloud" and not r["parent_trusted"] for r in rows if r["event"] == "edge")
    assert all(r["parent"] == "cell-b" and not r["parent_trusted"] for r in rows if r["event"] == "device")
    # Clear hops only into the trusted cell: 2 devices x 2 edge rounds x 5 rounds.
    assert len(clear) == 20 and all(c["receiver"] == "cell-a" and c["receiver_trusted"] for c in clear)
    # rdp calibration: each device ends exactly at (not above) its target epsilon.
    live = result.rounds[-1]["privacy"]["epsilon"]
    assert max(live.values()) <= 6.0 and min(live.values()) == pytest.approx(6.0, rel=1e-4)
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["noise_plan"]["cells"]["cell-a"]["trusted"] is True and "stopped" not in doc


def test_a_rollout_over_budget_stops_before_the_offending_release(small_rollout, tmp_path: Path) -> None:
    # Calibrated for 5 rounds at epsilon 6, but allowed only 4: it must stop with round 3 closed
    # and round 3's releases never made (no tasks), and say why.
    cfg = private(small_rollout, tmp_path, budget_epsilon=4.0)
    result = simulate(cfg, workdir=tmp_path / "w")
    closed = [r["round"] for r in result.rounds]
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["finished"] is True and "privacy budget" in doc["stopped"]
    assert closed == list(range(len(closed))) and 0 < len(closed) < 5
    live = result.rounds[-1]["privacy"]["epsilon"]
    assert max(live.values()) <= 4.0
    # One more round of the plan would have crossed the budget for some device.
    plan = doc["noise_plan"]
    z_dev, z_edge = plan["cells"]["cell-b"]["device_z"], plan["cells"]["cell-a"]["edge_z"]
    n = len(closed) + 1
    worst = max(accountant.epsilon([(z_dev, 2 * n)], 1e-5), accountant.epsilon([(z_edge, n)], 1e-5))
    assert worst > 4.0
    store = CoordinatorStore(tmp_path / "w" / "coordinator.db")
    assert {r["round"] for r in store.privacy_releases(cfg.rollout)} == set(closed)  # nothing of the stopped round
    assert store.status(cfg.rollout) == "stopped"
    # The ledger, recomputed offline from its rows alone, gives the live numbers.
    offline = recompute(store, cfg.rollout, 1e-5)
    store.close()
    assert offline.keys() == live.keys()
    for device, eps in live.items():
        assert offline[device] == pytest.approx(eps, rel=1e-12)


def test_a_device_that_misses_a_round_is_charged_anyway(small_rollout, tmp_path: Path, store_url: str) -> None:
    # The planned releases are charged whether or not the cloud sees them (an untrusted edge may
    # have), so every device's epsilon is the plan's, observed or not.
    cfg = private(small_rollout, tmp_path)
    from cloud_coordinator.privacy.ledger import PrivacyLedger
    from cloud_coordinator.rollout import prepare

    prepared = prepare(cfg)
    assert prepared.noise_plan is not None
    store = CoordinatorStore(store_url)  # the ledger on SQLite and on PostgreSQL
    ledger = PrivacyLedger(store=store, rollout="t", plan=prepared.noise_plan, cells=prepared.cells,
                           cloud_id="cloud")
    releases, clear = ledger.rows_for_round(0, {})  # nobody reported
    assert len(releases) == 2 * 2 + 1 and not any(r["observed"] for r in releases) and clear == []
    store.ensure_rollout("t", cfg.to_dict(), b"")
    store.commit_round("t", 0, 1, prepared.initial_params, None, None, {}, releases=releases, clear=clear)
    ledger.charge(releases)
    eps = ledger.epsilons()
    z_dev = prepared.noise_plan.cells["cell-b"].device_z
    assert eps[prepared.cells["cell-b"][0]] == pytest.approx(accountant.epsilon([(z_dev, 2)], 1e-5))
    offline = recompute(store, "t", 1e-5)  # the audit, from the stored rows alone
    store.close()
    assert offline.keys() == eps.keys() and all(offline[d] == pytest.approx(e, rel=1e-12) for d, e in eps.items())


def test_learning_rate_zero_global_update_variance_through_the_shells(small_rollout, tmp_path: Path) -> None:
    # 10 cells x 5 devices, half trusted, one round, lr = 0: the global update is pure noise with
    # variance (1/N1) [p sigma_edge^2 + (1-p) tau sigma_dev^2 / s1] (digest §2.3), here with ORT devices.
    trusted = {f"cell-{chr(ord('a') + i)}": True for i in range(5)}
    cfg = small_rollout(rounds=1, model={"hidden": [80]}, topology={"cells": 10, "devices_per_cell": 5,
                                                                    "trusted": trusted},
                        data={"partition": "iid"},
                        fedavg={"local_steps": 1, "edge_rounds": 2, "lr": 0.0, "batch_size": 8},
                        privacy={"epsilon": 4.0, "clip": 0.1, "require_tls": False, "noise_seed": 5})
    result = simulate(cfg)
    plan = result.prepared.noise_plan
    assert plan is not None
    start = result.prepared.initial_params
    update = np.concatenate([(result.params[n].astype(np.float64) - start[n]).ravel() for n in start])
    sigma_dev = plan.device_sigma("cell-j")
    sigma_edge = plan.edge_sigma("cell-a")
    expected = (0.5 * sigma_edge ** 2 + 0.5 * 2 * sigma_dev ** 2 / 5) / 10
    assert update.size > 5000
    assert update.var() == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize(("privacy", "key"), [
    ({"epsilon": 0.0, "clip": 1.0}, "privacy.epsilon"),
    ({"epsilon": -1.0, "clip": 1.0}, "privacy.epsilon"),
    ({"epsilon": 1.0, "clip": 1.0, "delta": 0.0}, "privacy.delta"),
    ({"epsilon": 1.0, "clip": 1.0, "delta": 1.0}, "privacy.delta"),
    ({"epsilon": 1.0, "clip": 0.0}, "privacy.clip"),
    ({"epsilon": 1.0, "clip": -2.0}, "privacy.clip"),
    ({"epsilon": 1.0, "clip": 1.0, "calibration": "exact"}, "privacy.calibration"),
])
def test_invalid_privacy_configs_name_the_key(small_rollout, privacy: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        small_rollout(privacy=privacy)
    assert err.value.key == key


def test_a_trusted_server_over_a_declared_untrusted_one_is_refused(small_rollout) -> None:
    with pytest.raises(ConfigError) as err:
        small_rollout(topology={"trusted": {"region": True, "cell-a": False}, "parents": {"cell-a": "region"}},
                      privacy={"epsilon": 1.0, "clip": 1.0})
    assert err.value.key == "topology.trusted.region"


def test_privacy_needs_uniform_weights_and_a_covered_algorithm(small_rollout) -> None:
    with pytest.raises(ConfigError) as err:
        small_rollout(fedavg={"weighting": "samples"}, privacy={"epsilon": 1.0, "clip": 1.0})
    assert err.value.key == "fedavg.weighting"
    with pytest.raises(ConfigError) as err:
        small_rollout(algorithm="qhetfed", privacy={"epsilon": 1.0, "clip": 1.0})
    assert err.value.key == "privacy"


def test_paper_mode_uses_the_closed_form_for_both_tiers(small_rollout, tmp_path: Path) -> None:
    from cloud_coordinator.privacy.calibrate import make_plan

    cfg = private(small_rollout, tmp_path, calibration="paper", alpha=1.0, sampling_rate=0.05, budget_epsilon=math.inf)
    plan = make_plan(cfg, {"dev-00": 100})
    z = accountant.paper_noise_multiplier(alpha=1.0, sampling_rate=0.05, steps_per_round=3 * 2, rounds=5,
                                          epsilon=6.0, delta=1e-5)
    assert plan.cells["cell-b"].device_z == pytest.approx(z) and plan.cells["cell-a"].edge_z == pytest.approx(z)
    assert plan.edge_sigma("cell-a") == pytest.approx(plan.device_sigma("cell-b") / 2)  # sigma_dev / s
    assert math.isinf(plan.budget_epsilon)
    assert plan.details["epsilon_device_tier"] > 6.0  # the closed form is not a guarantee (digest §3.5)


def test_paper_mode_charges_and_stops_on_the_sound_sensitivity(small_rollout, tmp_path: Path) -> None:
    # Issue 17 A2: one trusted cell of 4 devices syncing twice a round (tau = 2), paper calibration. The noise is
    # the paper's (sigma = z 2C/4) but the ledger charges it against 2C (1/4 + 1): multiplier z / 5. With z = 3.6
    # (alpha 1, q 1, K 6, T 3, epsilon 4), 3 rounds at z would be epsilon 2.08 (what the ledger charged before);
    # at z / 5 one round is 6.93 and two are 10.5, so a budget of 8 stops the rollout after its first round.
    cfg = small_rollout(rounds=3, metrics_file=str(tmp_path / "m.json"),
                        topology={"cells": 1, "devices_per_cell": 4, "trusted": {"cell-a": True}},
                        fedavg={"local_steps": 3, "edge_rounds": 2, "lr": 0.1, "batch_size": 16},
                        privacy={"epsilon": 4.0, "clip": 1.0, "calibration": "paper", "alpha": 1.0,
                                 "sampling_rate": 1.0, "budget_epsilon": 8.0, "require_tls": False,
                                 "noise_seed": 3})
    z = accountant.paper_noise_multiplier(alpha=1.0, sampling_rate=1.0, steps_per_round=6, rounds=3, epsilon=4.0,
                                          delta=1e-5)
    assert accountant.epsilon([(z, 3)], 1e-5) < 8.0 < accountant.epsilon([(z / 5, 2)], 1e-5)
    result = simulate(cfg, workdir=tmp_path / "w")
    assert [r["round"] for r in result.rounds] == [0]
    doc = json.loads((tmp_path / "m.json").read_text())
    assert "privacy budget" in doc["stopped"]
    store = CoordinatorStore(tmp_path / "w" / "coordinator.db")
    (row,) = store.privacy_releases(cfg.rollout)
    store.close()
    assert row["sigma"] == pytest.approx(z * 2 * 1.0 / 4, rel=1e-9)
    assert row["sensitivity"] == pytest.approx(2 * 1.0 * (1 / 4 + 1), rel=1e-12)
    assert row["noise_multiplier"] == pytest.approx(z / 5, rel=1e-9)
    live = result.rounds[-1]["privacy"]["epsilon"]
    assert set(live) == {"dev-00", "dev-01", "dev-02", "dev-03"}
    assert max(live.values()) == pytest.approx(accountant.epsilon([(z / 5, 1)], 1e-5), rel=1e-9)


def test_the_budget_check_uses_the_sound_multiplier_in_paper_mode() -> None:
    from cloud_coordinator.privacy.ledger import PrivacyLedger
    from fedtier.privacy.plan import CellPlan, NoisePlan

    z = 3.6
    plan = NoisePlan(mode="paper", epsilon=4.0, delta=1e-5, budget_epsilon=8.0, clip=1.0, edge_rounds=2, rounds=3,
                     require_tls=False, cells={"cell-a": CellPlan(trusted=True, members=4, device_z=0.0, edge_z=z)})
    store = CoordinatorStore(":memory:")
    ledger = PrivacyLedger(store=store, rollout="t", plan=plan, cells={"cell-a": ("d0", "d1", "d2", "d3")},
                           cloud_id="cloud")
    assert ledger.planned("d0") == [(pytest.approx(z / 5, rel=1e-12), 1)]
    assert ledger.admit(0) is None and ledger.admit(1) is not None  # 2 rounds at z/5: 10.5 > 8


def test_the_round_line_shows_the_epsilon_spent_and_the_start_warns_of_noise(small_rollout, tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    # Issue 17 A6: the coordinator's round line (its log, and fedtier simulate's console line) shows the epsilon
    # spent so far, and a rollout the noise will drown is said to be so when it starts.
    import logging

    from cloud_coordinator.report import epsilon_spent, round_line

    cfg = private(small_rollout, tmp_path)
    with caplog.at_level(logging.INFO, logger="fedtier.coordinator"):
        result = simulate(cfg)
    spent = [r["privacy"]["epsilon_max"] for r in result.rounds]
    closed = [rec.getMessage() for rec in caplog.records if "closed:" in rec.getMessage()]
    assert len(closed) == 5
    for line, eps in zip(closed, spent, strict=True):
        assert f"epsilon {eps:.3g} of 6" in line, line
    assert any("noise dominates" in rec.getMessage() and rec.levelno == logging.WARNING for rec in caplog.records)
    assert f"epsilon {spent[0]:.3g} of 6" in round_line(result.rounds[0], 5)
    assert epsilon_spent(result.rounds[-1], ".4g") == f"epsilon {spent[-1]:.4g} of 6"


def test_signal_to_noise_of_a_mixed_plan() -> None:
    # cell-a trusted (4 devices), cell-b untrusted (2), tau = 2, M = 100 parameters: per-coordinate variance
    # sigma_edge^2 for cell-a's release, 2 sigma_dev^2 / 2 for cell-b's change, and the cloud weighs cells by
    # their devices: (16 sigma_edge^2 + 4 sigma_dev^2) / 6^2.
    import math

    from cloud_coordinator.privacy import utility
    from fedtier.privacy.plan import CellPlan, NoisePlan

    plan = NoisePlan(mode="rdp", epsilon=4.0, delta=1e-5, budget_epsilon=4.0, clip=0.5, edge_rounds=2, rounds=9,
                     require_tls=False, cells={"cell-a": CellPlan(True, 4, 0.0, 3.0),
                                               "cell-b": CellPlan(False, 2, 2.0, 0.0)})
    s_edge, s_dev = plan.edge_sigma("cell-a"), plan.device_sigma("cell-b")
    assert s_edge == pytest.approx(3.0 * 2 * 0.5 * (1 / 4 + 1)) and s_dev == pytest.approx(2.0 * 2 * 0.5)
    est = utility.estimate(plan, {"cell-a": 100, "cell-b": 100})
    assert est.edge is not None and est.device is not None
    assert est.edge.signal == est.cloud.signal == 2 * 0.5
    assert est.edge.noise == pytest.approx(math.sqrt(100) * s_edge)
    assert est.device.noise == pytest.approx(math.sqrt(100 * 2 * s_dev ** 2 / 2))
    assert est.cloud.noise == pytest.approx(math.sqrt(100 * (16 * s_edge ** 2 + 4 * s_dev ** 2)) / 6)
    assert est.rollout_snr == pytest.approx(3 * est.cloud.snr) and est.dominant == "edge"
    # HIST: cells update disjoint submodels, so the global update is as noisy as the worst cell's.
    hist = utility.estimate(plan, {"cell-a": 100, "cell-b": 100}, cells_averaged=False)
    assert hist.cloud.snr == pytest.approx(min(est.edge.snr, est.device.snr))


@pytest.mark.parametrize("phase,charged", [("keys", False), ("shares", False), ("masked", False), ("reveal", True)])
def test_a_secure_cell_abort_charges_nobody_only_if_no_share_was_revealed(small_rollout, tmp_path: Path,
                                                                        phase: str, charged: bool) -> None:
    # Distributed DP: a cell whose secure aggregation aborted before the reveal phase has no sum, ever; one that
    # aborted while revealing may have handed out enough shares for it, so it is charged as planned.
    from cloud_coordinator.privacy.ledger import PrivacyLedger
    from cloud_coordinator.rollout import prepare

    cfg = small_rollout(rounds=2, topology={"cells": 2, "devices_per_cell": 3},
                        fedavg={"secure_aggregation": True, "secagg_min_survivors": 3},
                        privacy={"epsilon": 6.0, "clip": 1.0, "require_tls": False})
    prepared = prepare(cfg)
    assert prepared.noise_plan is not None and prepared.noise_plan.cells["cell-a"].distributed
    store = CoordinatorStore(tmp_path / "c.db")
    try:
        ledger = PrivacyLedger(store=store, rollout="t", plan=prepared.noise_plan, cells=prepared.cells,
                               cloud_id="cloud")
        releases, _ = ledger.rows_for_round(0, {"cell-a": {"secagg_abort": {"phase": phase, "reason": "x"}}})
    finally:
        store.close()
    assert sorted(r["node"] for r in releases) == (["cell-a", "cell-b"] if charged else ["cell-b"])
    assert not any(r["observed"] for r in releases)


def test_an_abort_report_of_a_cell_without_secure_aggregation_changes_nothing(small_rollout, tmp_path: Path) -> None:
    from cloud_coordinator.privacy.ledger import PrivacyLedger
    from cloud_coordinator.rollout import prepare

    prepared = prepare(private(small_rollout, tmp_path))
    store = CoordinatorStore(tmp_path / "c.db")
    try:
        ledger = PrivacyLedger(store=store, rollout="t", plan=prepared.noise_plan, cells=prepared.cells,
                               cloud_id="cloud")
        releases, _ = ledger.rows_for_round(0, {"cell-a": {"secagg_abort": {"phase": "keys", "reason": "x"}}})
    finally:
        store.close()
    assert "cell-a" in {r["node"] for r in releases}  # a trusted edge's release: charged as planned

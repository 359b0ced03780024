"""Device sampling in the config, the calibration and the plan (issue 17 Part B.1)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fedtier.rollout.config import RolloutConfig
from cloud_coordinator.privacy import accountant, calibrate
from fedtier.errors import ConfigError
from fedtier.privacy.plan import NoisePlan, release_cap


def _cfg(**privacy: object) -> RolloutConfig:
    data = {"rounds": 40, "topology": {"cells": 2, "devices_per_cell": 50, "trusted": {"cell-a": True}},
            "fedavg": {"edge_rounds": 1},
            "privacy": {"epsilon": 4.0, "clip": 1.0, "delta": 1e-6, **privacy}}
    return RolloutConfig.from_mapping(data)


def test_config_keys_are_validated_with_the_key_named() -> None:
    with pytest.raises(ConfigError, match="sample_rate"):
        _cfg(device_sampling="poisson")
    with pytest.raises(ConfigError, match="sample_rate"):
        _cfg(sample_rate=0.1)
    with pytest.raises(ConfigError, match="accountant"):
        _cfg(device_sampling="fixed", sample_rate=0.1, accountant="pld")
    with pytest.raises(ConfigError, match="device_sampling"):
        RolloutConfig.from_mapping({"topology": {"cells": 1, "devices_per_cell": 4}, "fedavg": {"edge_rounds": 2},
                                 "privacy": {"epsilon": 4.0, "clip": 1.0, "device_sampling": "poisson",
                                             "sample_rate": 0.2}})
    with pytest.raises(ConfigError, match="sample_rate"):
        _cfg(device_sampling="poisson", sample_rate=1.5)
    with pytest.raises(ConfigError, match="device_sampling"):
        _cfg(device_sampling="everyone", sample_rate=0.1)


@pytest.mark.parametrize("acct", ["rdp", "pld"])
def test_poisson_plan_amplifies_the_trusted_edge_only(acct: str) -> None:
    cfg = _cfg(device_sampling="poisson", sample_rate=0.1, accountant=acct)
    plan = calibrate.make_plan(cfg, {})
    assert plan.sampling == "poisson" and plan.sample_rate == 0.1 and plan.accountant == acct
    a, b = plan.cells["cell-a"], plan.cells["cell-b"]
    # trusted: z solved for 40 Poisson-sampled releases, the ledger's charge reaches the target
    eps_edge = accountant.epsilon([(plan.edge_charged_z("cell-a"), 40, *plan.edge_event("cell-a"))], 1e-6,
                                  accounting=acct)
    assert eps_edge == pytest.approx(4.0, rel=0.01) and eps_edge <= 4.0
    # fixed denominator q n: sigma = z C / (q n), whoever reported
    assert plan.edge_sigma("cell-a") == pytest.approx(a.edge_z * 1.0 / (0.1 * 50))
    assert plan.edge_sigma("cell-a", 3) == plan.edge_sigma("cell-a", 50)
    assert plan.edge_denominator("cell-a") == pytest.approx(5.0)
    # untrusted: no amplification, z for the release cap at full price
    cap = release_cap(40, 0.1)
    assert plan.device_release_cap == cap and 4 <= cap < 40
    assert accountant.epsilon([(b.device_z, cap)], 1e-6, accounting=acct) == pytest.approx(4.0, rel=0.01)
    unsampled = calibrate.make_plan(_cfg(accountant=acct), {})
    assert b.device_z < unsampled.cells["cell-b"].device_z  # fewer releases per device
    assert a.edge_z < unsampled.cells["cell-a"].edge_z  # amplification
    # the plan survives its wire form
    assert NoisePlan.from_dict(plan.to_dict()) == plan


def test_fixed_size_plan_is_replace_one() -> None:
    plan = calibrate.make_plan(_cfg(device_sampling="fixed", sample_rate=0.2), {})
    q, n = plan.edge_event("cell-a")
    assert (q, n) == (10 / 50, 50)
    assert plan.edge_sensitivity(50) == pytest.approx(2.0 / 10)
    eps = accountant.epsilon([(plan.cells["cell-a"].edge_z, 40, q, n)], 1e-6)
    assert eps == pytest.approx(4.0, rel=0.01) and eps <= 4.0


def test_pld_calibrates_less_noise_than_rdp() -> None:
    rdp_plan = calibrate.make_plan(_cfg(device_sampling="poisson", sample_rate=0.1), {})
    pld_plan = calibrate.make_plan(_cfg(device_sampling="poisson", sample_rate=0.1, accountant="pld"), {})
    assert pld_plan.cells["cell-a"].edge_z < rdp_plan.cells["cell-a"].edge_z
    assert pld_plan.cells["cell-b"].device_z < rdp_plan.cells["cell-b"].device_z


def test_release_cap() -> None:
    assert release_cap(40, 1.0) == 40
    assert release_cap(100, 0.1) == 19  # 10 + 3 sqrt(9) = 19
    assert release_cap(10, 0.9) == 10


def test_sampling_overrides_cover_every_participation_field() -> None:
    """Every upward field that reveals who took part (or a device's dataset size) says what a sampling rollout
    sends instead: amplification holds only while the cloud cannot tell who was sampled."""
    from fedtier.privacy import disclosure

    for kind, fields in disclosure.UPWARD.items():
        for path, field in fields.items():
            reveals = field.disclosure == disclosure.PUBLIC and (
                "participation" in field.why or "reported" in field.why or "sample count" in field.why)
            if reveals and kind in ("cell_update", "device_update") and not path.startswith("m.release."):
                assert path in disclosure.SAMPLED.get(kind, {}), (kind, path)
    for kind, fields in disclosure.SAMPLED.items():
        for path in fields:
            assert path in disclosure.UPWARD[kind], (kind, path)  # overrides name real fields


def test_rollouts_refuse_device_sampling_with_hist(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cloud_coordinator.rollout import prepare

    cfg = RolloutConfig.from_mapping({
        "rounds": 2, "state_dir": str(tmp_path), "topology": {"cells": 1, "devices_per_cell": 2},
        "algorithm": "hist", "hist": {"edge_rounds": 1},
        "privacy": {"epsilon": 4.0, "clip": 1.0, "device_sampling": "poisson", "sample_rate": 0.5}})
    with pytest.raises(ConfigError, match="device_sampling"):
        prepare(cfg)


def test_privacy_plan_cli_shows_sampling_and_amplification(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from click.testing import CliRunner

    from commands.privacy import privacy as main

    path = tmp_path / "s.toml"
    path.write_text('rounds = 20\n[topology]\ncells = 2\ndevices_per_cell = 40\ntrusted = { cell-a = true }\n'
                    '[fedavg]\nedge_rounds = 1\n[privacy]\nepsilon = 4.0\nclip = 1.0\ndelta = 1e-6\n'
                    'device_sampling = "poisson"\nsample_rate = 0.2\n')
    out = CliRunner().invoke(main, ["plan", "--config", str(path), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)  # the accountant's note, if any, is on stderr
    edge, device = doc["tiers"]["edge"], doc["tiers"]["device"]
    assert edge["amplified"] and not device["amplified"]
    assert edge["epsilon"] == pytest.approx(4.0, rel=0.01) and edge["rounds_within_budget"] == 20
    assert device["releases_per_device"] == release_cap(20, 0.2) < 20
    assert device["epsilon"] == pytest.approx(4.0, rel=0.01) and device["rounds_within_budget"] == 20
    assert edge["sensitivity_min"] == pytest.approx(1.0 / (0.2 * 40))
    text = CliRunner().invoke(main, ["plan", "--config", str(path)]).output
    assert "amplified" in text and "fixed-denominator" in text


def test_a_rollout_with_trusted_cells_samples_and_charges_the_amplified_release(small_rollout, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cloud_coordinator.privacy.ledger import recompute
    from local_fleet.simulate import simulate
    from cloud_coordinator.store import CoordinatorStore

    cfg = small_rollout(rounds=4, topology={"cells": 2, "devices_per_cell": 3,
                                            "trusted": {"cell-a": True, "cell-b": True}},
                        fedavg={"local_steps": 2, "edge_rounds": 1},
                        privacy={"epsilon": 6.0, "clip": 1.0, "require_tls": False, "noise_seed": 5,
                                 "device_sampling": "poisson", "sample_rate": 0.5})
    result = simulate(cfg, workdir=tmp_path / "w")
    assert len(result.rounds) == 4
    last = result.rounds[-1]
    assert last["devices_reported"] == 6  # the cloud sees every member, never the sample
    assert last["bytes"]["device_up"] == 0  # byte counts would count the sampled devices' messages
    store = CoordinatorStore(tmp_path / "w" / "coordinator.db")
    rows = store.privacy_releases(cfg.rollout)
    recomputed = recompute(store, cfg.rollout, 1e-5)
    store.close()
    assert len(rows) == 4 * 2 and all(r["inputs"]["sample_rate"] == 0.5 for r in rows)
    z = rows[0]["noise_multiplier"]
    expected = accountant.epsilon([(z, 4, 0.5)], 1e-5)  # charged as Poisson-sampled Gaussians
    assert expected == pytest.approx(6.0, rel=1e-3) and expected <= 6.0
    assert last["privacy"]["epsilon_max"] == pytest.approx(expected)
    assert max(recomputed.values()) == pytest.approx(expected)


def test_the_cloud_samples_untrusted_cells_publicly_within_the_cap(small_rollout, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cloud_coordinator.privacy.ledger import recompute
    from local_fleet.simulate import simulate
    from cloud_coordinator.store import CoordinatorStore
    from fedtier.privacy.plan import cloud_sample

    rounds, q = 6, 0.5
    cfg = small_rollout(rounds=rounds, topology={"cells": 2, "devices_per_cell": 3, "trusted": {"cell-a": True}},
                        fedavg={"local_steps": 2, "edge_rounds": 1},
                        privacy={"epsilon": 6.0, "clip": 1.0, "require_tls": False, "noise_seed": 5,
                                 "device_sampling": "poisson", "sample_rate": q})
    result = simulate(cfg, workdir=tmp_path / "w")
    assert len(result.rounds) == rounds
    store = CoordinatorStore(tmp_path / "w" / "coordinator.db")
    rows = store.privacy_releases(cfg.rollout)
    recomputed = recompute(store, cfg.rollout, 1e-5)
    store.close()
    cap = release_cap(rounds, q)
    members = ("dev-03", "dev-04", "dev-05")
    device_rows = [r for r in rows if r["event"] == "device"]
    for r in range(rounds):  # charged exactly for the public sample of each round
        chosen = cloud_sample(members, rate=q, cap=cap, seed=cfg.seed, cell="cell-b", round=r)
        assert sorted(x["node"] for x in device_rows if x["round"] == r) == list(chosen)
    counts = {d: sum(1 for x in device_rows if x["node"] == d) for d in members}
    assert max(counts.values()) <= cap and sum(counts.values()) < rounds * len(members)
    live = result.rounds[-1]["privacy"]["epsilon"]
    assert all(v <= 6.0 * (1 + 1e-9) for v in live.values())
    assert live == pytest.approx(recomputed)


def test_plan_with_sampling_summarises_the_accountants_convergence_warnings_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """dp-accounting logs "failed to converge" per order and evaluation when it calibrates sampled releases (dozens
    per plan); `privacy plan` keeps them off the log and says so in one line (issue 33)."""
    from click.testing import CliRunner

    from cloud_coordinator.privacy import accountant
    from fedtier.cli import cli

    # the accountant caches its answers: a plan another test computed in this process would raise no warning
    accountant._composed_epsilon.cache_clear()
    accountant.noise_multiplier_for.cache_clear()
    config = tmp_path / "sampled.toml"
    config.write_text('rollout = "s"\nrounds = 40\n[topology]\ncells = 2\ndevices_per_cell = 50\n'
                      'trusted = { cell-a = true }\n[fedavg]\nedge_rounds = 1\n[privacy]\nepsilon = 4.0\n'
                      'clip = 1.0\ndelta = 1e-6\ndevice_sampling = "poisson"\nsample_rate = 0.1\n')
    with caplog.at_level(logging.WARNING):
        result = CliRunner().invoke(cli, ["privacy", "plan", "--config", str(config)])
    assert result.exit_code == 0, result.output
    converge = [line for line in result.output.splitlines() if "converge" in line]
    assert len(converge) == 1 and "still a valid upper bound" in converge[0], converge
    assert int(converge[0].split("converge ")[1].split(" time")[0]) > 1  # the case: many warnings, one line
    assert not [r for r in caplog.records if "failed to converge" in r.getMessage()]

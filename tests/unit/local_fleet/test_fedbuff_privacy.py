"""FedBuff under differential privacy: every release clipped and noised by the trust plan, charged per release,
a device's uploads capped by the releases its noise pays for, and no sampling amplification."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_coordinator.rollout import prepare
from fedtier.errors import ConfigError
from local_fleet.simulate import simulate
from local_fleet.trace_rollout import Ledger


def private(small_rollout, **privacy: object):  # type: ignore[no-untyped-def]
    return small_rollout(rounds=12, algorithm="fedbuff",
                         topology={"cells": 2, "devices_per_cell": 3, "trusted": {"cell-a": True}},
                         fedbuff={"local_steps": 5, "lr": 0.1, "batch_size": 16, "k_edge": 2, "k_cloud": 1},
                         fleet={"availability": "always", "compute_s": 60},
                         privacy={"epsilon": 8.0, "delta": 1e-5, "clip": 1.0, "require_tls": False, "noise_seed": 0,
                                  **privacy})


def test_every_release_is_noised_by_the_trust_plan_and_charged(small_rollout) -> None:
    # Prepare: cell-a trusted (its edge noises each cell update), cell-b untrusted (its devices noise each upload).
    cfg = private(small_rollout)
    prepared = prepare(cfg)
    plan = prepared.noise_plan
    assert plan is not None
    # Execute
    result = simulate(cfg, prepared=prepared)
    # Assert: every release that reached the cloud is on the ledger, each at the plan's noise for its tier.
    last = result.rounds[-1]["privacy"]
    releases = last["releases"]
    assert releases > 0
    import json

    doc = json.loads(cfg.metrics_path.read_text())
    assert doc["privacy"]["releases"] >= releases
    assert 0 < doc["privacy"]["epsilon_max"] <= plan.epsilon * 1.0001


def test_the_ledger_charges_each_release_to_whom_it_protects_at_full_price(small_rollout) -> None:
    prepared = prepare(private(small_rollout))
    ledger = Ledger(prepared)
    z = 1.5
    edge = {"node": "cell-a", "event": "edge", "z": z, "protected": ["dev-00", "dev-01"]}
    device = {"node": "dev-03", "event": "device", "z": z, "protected": ["dev-03"]}
    row = ledger.charge([edge, device, edge])
    assert row["releases"] == 3 and row["max_releases_per_device"] == 2
    from dp_accounting import GaussianDpEvent
    from dp_accounting.rdp import RdpAccountant

    twice = RdpAccountant()
    twice.compose(GaussianDpEvent(noise_multiplier=z), 2)  # no sampling: two full-price Gaussians
    assert row["epsilon_max"] == pytest.approx(twice.get_epsilon(1e-5), rel=1e-9)


def test_a_device_stops_contributing_at_its_release_cap(small_rollout) -> None:
    # Prepare: the rollout's plan, paying for 2 releases per device; dev-03 is in the untrusted cell-b.
    import dataclasses

    from fedtier.algorithms import fedbuff
    from fedtier.algorithms.base import LocalResult, SendToParent
    from fedtier.wire.messages import DeviceTask

    prepared = prepare(private(small_rollout))
    assert prepared.noise_plan is not None
    plan = dataclasses.replace(prepared.noise_plan, rounds=2)
    config = dataclasses.replace(prepared.algorithm_config(), privacy=plan.to_dict()).to_dict()
    device = fedbuff.Device(device_id="dev-03", cell="cell-b", rollout="t")
    params = dict(prepared.initial_params)
    big = {n: np.full_like(p, 10.0) for n, p in params.items()}  # far outside the clip bound C = 1
    sent = []
    # Execute: three tasks in a row
    for version in range(3):
        out = device.receive(DeviceTask(rollout="t", round=version, sender="cell-b", params=params, config=config,
                                        members=("dev-03",)), 0.0)
        if out and out[0].__class__.__name__ == "LocalTrain":
            [up] = device.trained(version, LocalResult(delta=big, num_samples=5, mean_loss=1.0, steps=5))
            assert isinstance(up, SendToParent)
            sent.append(up.message)
        else:
            refused = out
    # Assert: two noised releases, each with its record at the plan's device noise; the third task refused.
    assert len(sent) == 2 and [a.reason for a in refused] == ["release_budget"]
    for msg in sent:
        assert msg.release["sigma"] == pytest.approx(plan.device_sigma("cell-b"))
        assert msg.release["protected"] == ["dev-03"] and msg.num_samples == 0
        norm = np.sqrt(sum(float(np.sum(np.square(t.astype(np.float64)))) for t in msg.delta.values()))
        assert norm < 10.0 * np.sqrt(sum(t.size for t in big.values()))  # clipped (to 1) then noised


def test_a_trusted_cell_sends_clipped_deltas_in_clear_and_noises_each_cell_update(small_rollout) -> None:
    from fedtier.algorithms import fedbuff
    from fedtier.algorithms.base import LocalResult, SendToParent
    from fedtier.privacy.mechanism import NoiseSource
    from fedtier.wire.messages import CellTask, DeviceTask

    prepared = prepare(private(small_rollout))
    plan = prepared.noise_plan
    assert plan is not None
    config = prepared.algorithm_config()
    params = dict(prepared.initial_params)
    big = {n: np.full_like(p, 10.0) for n, p in params.items()}
    edge = fedbuff.Edge(cell="cell-a", rollout="t", noise=NoiseSource(1))
    edge.receive(CellTask(rollout="t", round=0, sender="cloud", params=params, members=prepared.cells["cell-a"],
                          config=config.to_dict(), model_version=0), 0.0)
    ups = []
    for d in prepared.cells["cell-a"][:2]:
        device = fedbuff.Device(device_id=d, cell="cell-a", rollout="t")
        device.receive(DeviceTask(rollout="t", round=0, sender="cell-a", params=params, config=config.to_dict(),
                                  members=(d,)), 0.0)
        [up] = device.trained(0, LocalResult(delta=big, num_samples=5, mean_loss=1.0, steps=5))
        assert up.message.release is None  # clear to its trusted edge ...
        norm = np.sqrt(sum(float(np.sum(np.square(t.astype(np.float64)))) for t in up.message.delta.values()))
        assert norm == pytest.approx(plan.clip, rel=1e-5)  # ... clipped to C
        ups.append(up.message)
    out = edge.receive(ups[0], 0.0) + edge.receive(ups[1], 0.0)
    [cell] = [a.message for a in out if isinstance(a, SendToParent)]
    [release] = cell.privacy["releases"]
    assert release["event"] == "edge" and release["protected"] == sorted(prepared.cells["cell-a"][:2])
    assert release["sigma"] == pytest.approx(plan.edge_sigma("cell-a", 2)) and "sample_rate" not in release["inputs"]


def test_device_sampling_is_refused_for_fedbuff(small_rollout) -> None:
    with pytest.raises(ConfigError, match="sampl"):
        prepare(private(small_rollout, device_sampling="poisson", sample_rate=0.5))


def test_privacy_noise_changes_the_model(small_rollout) -> None:
    clear = simulate(small_rollout(rounds=4, algorithm="fedbuff",
                                   topology={"cells": 2, "devices_per_cell": 3},
                                   fedbuff={"local_steps": 5, "lr": 0.1, "batch_size": 16, "k_edge": 2, "k_cloud": 1},
                                   fleet={"availability": "always", "compute_s": 60}))
    noisy = simulate(private(small_rollout))
    assert any(not np.allclose(clear.params[n], noisy.params[n]) for n in clear.params)

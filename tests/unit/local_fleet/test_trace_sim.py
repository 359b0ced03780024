"""The trace simulator: virtual time, offline devices, outboxes; synchronous roles under it unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from fedtier.algorithms import fedavg, fedbuff
from fedtier.algorithms.base import LocalResult, LocalTrain
from fedtier.rollout.availability import ALWAYS, DeviceTrace
from local_fleet.trace_sim import TraceSimulation

CELLS = {"cell-a": ("dev-0", "dev-1"), "cell-b": ("dev-2", "dev-3")}
PARAMS = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}


def step_compute(device: str, request: LocalTrain) -> LocalResult:
    """Device dev-i moves every parameter by 0.01 (i + 1): a known, distinct delta."""
    k = int(device.split("-")[-1]) + 1
    return LocalResult(delta={n: np.full_like(p, 0.01 * k) for n, p in request.params.items()}, num_samples=10,
                       mean_loss=1.0, steps=request.steps)


def sim(module, config, traces, rounds=3, **kw) -> TraceSimulation:  # type: ignore[no-untyped-def]
    return TraceSimulation(module=module, cells=CELLS, initial_params=PARAMS, config=config, rounds=rounds,
                           traces=traces, compute=step_compute, noise_seed=1, **kw)


def test_synchronous_rounds_take_the_slowest_devices_time() -> None:
    # Prepare: every device online; dev-3 takes 90 s, the others 60 s.
    traces = {d: DeviceTrace(ALWAYS, 90.0 if d == "dev-3" else 60.0) for m in CELLS.values() for d in m}
    # Execute
    run = sim(fedavg, fedavg.FedAvgConfig(local_steps=1, deadline_s=600), traces).run()
    # Assert: each round waits for dev-3 (nobody is late), and the model is the flat mean 0.025 per round.
    assert run.finished and [r["time_s"] for r in run.rows] == [90.0, 180.0, 270.0]
    assert [r["devices_reported"] for r in run.rows] == [4, 4, 4]
    np.testing.assert_allclose(run.params["b"], 3 * 0.025, rtol=0, atol=1e-6)
    assert run.bytes["device_up"] > 0 and run.bytes["device_down"] > run.bytes["edge_up"] > 0


def test_an_offline_device_is_simply_not_reporting_and_the_deadline_closes_the_round() -> None:
    # Prepare: dev-3 is never online; quorum 1/2 in each cell, deadline 120 s.
    traces = {d: DeviceTrace(ALWAYS, 60.0) for m in CELLS.values() for d in m}
    traces["dev-3"] = DeviceTrace((), 60.0)
    config = fedavg.FedAvgConfig(local_steps=1, deadline_s=120, quorum=0.5)
    # Execute
    run = sim(fedavg, config, traces, tick_s=10.0).run()
    # Assert: cell-b closes at the deadline without dev-3; the mean is over 3 devices: (1 + 2 + 3) / 3 * 0.01.
    assert run.finished and [r["devices_reported"] for r in run.rows] == [3, 3, 3]
    assert all(120.0 <= r["round_s"] <= 130.0 for r in run.rows)
    np.testing.assert_allclose(run.params["w"], 3 * 0.02, rtol=0, atol=1e-6)
    assert run.dropped.get("offline", 0) >= 3  # each round's task to dev-3 was lost


def test_an_upload_made_offline_waits_in_the_outbox_for_the_next_window() -> None:
    # Prepare: dev-0 is online [0, 30) every 100 s and trains for 60 s; the others are always there.
    traces = {d: DeviceTrace(ALWAYS, 10.0) for m in CELLS.values() for d in m}
    traces["dev-0"] = DeviceTrace(((0.0, 30.0),), 60.0, period_s=100.0)
    # Execute
    run = sim(fedavg, fedavg.FedAvgConfig(local_steps=1, deadline_s=1000), traces, rounds=1).run()
    # Assert: its update left its outbox when it came back at t = 100, which closed the round.
    assert run.rows[0]["time_s"] == 100.0 and run.rows[0]["devices_reported"] == 4


def test_fedbuff_under_traces_is_deterministic_and_counts_its_versions() -> None:
    traces = {d: DeviceTrace(((0.0, 400.0),), 30.0 + 10 * i, period_s=1000.0)
              for i, d in enumerate(d for m in CELLS.values() for d in m)}
    config = fedbuff.FedBuffConfig(local_steps=1, k_edge=2, k_cloud=1)
    a = sim(fedbuff, config, traces, rounds=6).run()
    b = sim(fedbuff, config, traces, rounds=6).run()
    assert a.finished and [r["model_version"] for r in a.rows] == [1, 2, 3, 4, 5, 6]
    for name in PARAMS:
        assert np.array_equal(a.params[name], b.params[name])
    assert a.rows == b.rows


@pytest.mark.parametrize("horizon", [50.0])
def test_the_horizon_stops_a_run_that_cannot_finish(horizon: float) -> None:
    traces = {d: DeviceTrace((), 60.0) for m in CELLS.values() for d in m}  # nobody ever online
    run = sim(fedavg, fedavg.FedAvgConfig(local_steps=1), traces).run(horizon_s=horizon)
    assert not run.finished and run.rows == [] and run.now <= horizon

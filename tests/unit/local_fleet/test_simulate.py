"""The in-process simulator: learns, is deterministic, chunking-transparent, and resumable."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from local_fleet.simulate import simulate


def test_simulation_learns_and_writes_metrics(small_rollout, tmp_path: Path) -> None:
    cfg = small_rollout(rounds=4, fedavg={"local_steps": 20, "lr": 0.2}, metrics_file=str(tmp_path / "m.json"))
    result = simulate(cfg)
    acc = [r["accuracy"] for r in result.rounds]
    assert len(acc) == 4 and acc[-1] > 0.6 and acc[-1] > acc[0]
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["finished"] is True and [r["round"] for r in doc["rounds"]] == [0, 1, 2, 3]
    row = doc["rounds"][0]
    # Per tier: each of 4 devices downloads the task and uploads an update; 2 cells talk to the cloud.
    assert row["devices_reported"] == 4
    assert row["bytes"]["device_up"] > 0 and row["bytes"]["device_down"] >= row["bytes"]["device_up"]
    assert row["bytes"]["edge_up"] > 0 and row["bytes"]["cloud_down"] > 0


def test_same_config_same_model(small_rollout) -> None:
    a = simulate(small_rollout(rounds=2))
    b = simulate(small_rollout(rounds=2))
    for name in a.params:
        assert np.array_equal(a.params[name], b.params[name])


def test_a_different_seed_gives_a_different_model(small_rollout) -> None:
    a = simulate(small_rollout(rounds=1, seed=1))
    b = simulate(small_rollout(rounds=1, seed=2))
    assert any(not np.array_equal(a.params[n], b.params[n]) for n in a.params)


def test_chunked_messages_give_the_same_model_and_cost_more_bytes(small_rollout) -> None:
    plain = simulate(small_rollout(rounds=2))
    chunked = simulate(small_rollout(rounds=2, simulation={"max_payload": 4096}))
    for name in plain.params:
        assert np.array_equal(plain.params[name], chunked.params[name])
    assert chunked.rounds[0]["bytes"]["device_up"] > plain.rounds[0]["bytes"]["device_up"]


def test_a_crashed_simulation_resumes_after_its_last_committed_round(small_rollout, tmp_path: Path) -> None:
    class Crash(Exception):
        pass

    def crash_after_round_1(row: dict) -> None:
        if row["round"] == 1:
            raise Crash

    cfg = small_rollout(rounds=4)
    with pytest.raises(Crash):
        simulate(cfg, workdir=tmp_path / "run", on_round=crash_after_round_1)
    resumed = simulate(cfg, workdir=tmp_path / "run")
    uninterrupted = simulate(cfg)
    assert [r["round"] for r in resumed.rounds] == [0, 1, 2, 3]
    for name in uninterrupted.params:
        np.testing.assert_allclose(resumed.params[name], uninterrupted.params[name], rtol=0, atol=1e-6)


def test_cnn1d_on_sensor_like_windows(small_rollout) -> None:
    cfg = small_rollout(rounds=3, model={"kind": "cnn1d", "channels": 4, "filters": [8], "kernel": 3},
                        data={"dataset": "synthetic", "features": 32, "classes": 3, "samples": 600,
                              "separation": 6.0},
                        fedavg={"local_steps": 20, "lr": 0.2})
    result = simulate(cfg)
    assert result.prepared.arch.input_shape == (4, 8)
    accuracy = [r["accuracy"] for r in result.rounds]
    assert accuracy[-1] > 0.6 and accuracy[-1] > accuracy[0], accuracy


def test_hist_with_one_cell_is_hierarchical_fedavg_through_the_whole_stack(small_rollout) -> None:
    common = {"topology": {"cells": 1, "devices_per_cell": 3}, "model": {"hidden": [16]}, "rounds": 2}
    steps = {"local_steps": 5, "edge_rounds": 2, "lr": 0.1, "batch_size": 16}
    hist = simulate(small_rollout(algorithm="hist", hist=steps, **common))
    fedavg = simulate(small_rollout(algorithm="fedavg", fedavg=steps, **common))
    assert hist.prepared.manifest.cell_bundles  # its own (here: full-width) submodel bundle
    for name in fedavg.params:
        np.testing.assert_allclose(hist.params[name], fedavg.params[name], rtol=0, atol=1e-6)


def test_hist_sends_each_device_a_submodel_and_the_cloud_about_one_model(small_rollout) -> None:
    result = simulate(small_rollout(algorithm="hist", rounds=1, model={"hidden": [30]},
                                    topology={"cells": 3, "devices_per_cell": 2},
                                    hist={"local_steps": 5, "edge_rounds": 2, "lr": 0.1}))
    sizes = {c: sum(np.prod(p["shape"]) for p in b["layout"]) for c, b in result.prepared.manifest.cell_bundles.items()}
    full = sum(int(np.prod(p.shape)) for p in result.params.values())
    assert set(sizes.values()) == {64 * 10 + 10 + 10 * 10 + 10}  # a third of the 30 hidden neurons
    assert sum(sizes.values()) == full + 2 * 10


def test_devices_on_the_portable_backend_reach_the_same_model(small_rollout) -> None:
    """[simulation] trainer = "portable": the built-in MLP and HIST's submodel bundles, like ort's devices."""
    for overrides in ({}, {"algorithm": "hist", "topology": {"cells": 2, "devices_per_cell": 2},
                           "hist": {"local_steps": 5, "edge_rounds": 2, "lr": 0.1}}):
        ort = simulate(small_rollout(rounds=2, **overrides))
        portable = simulate(small_rollout(rounds=2, simulation={"trainer": "portable"}, **overrides))
        for name in ort.params:
            np.testing.assert_allclose(portable.params[name], ort.params[name], rtol=0, atol=1e-5)
        assert [r["accuracy"] for r in portable.rounds] == pytest.approx([r["accuracy"] for r in ort.rounds], abs=1e-6)


def test_a_rollout_without_portable_graph_is_refused_before_it_starts(
        small_rollout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every simulated device would refuse it: say so, naming the key and the op, instead of stalling."""
    import models.portable as portable_mod
    from fedtier.errors import ConfigError

    monkeypatch.delitem(portable_mod.LOWERINGS, ("com.microsoft", "ReluGrad"))
    cfg = small_rollout(rounds=1, artifact_store=str(tmp_path / "store"), simulation={"trainer": "portable"})
    with pytest.raises(ConfigError, match=r"portable backend.*no lowering to standard ONNX \(ReluGrad\)") as caught:
        simulate(cfg)
    assert caught.value.key == "simulation.trainer"


def _simulate_on(broker_cls, cfg, monkeypatch):  # type: ignore[no-untyped-def]
    import local_fleet.simulate as sim

    brokers = []

    def make(**kw):  # type: ignore[no-untyped-def]
        brokers.append(broker_cls(**kw))
        return brokers[-1]

    monkeypatch.setattr(sim, "MemoryBroker", make)
    return sim.simulate(cfg), brokers[0]


def test_updates_reach_their_edge_at_once_so_few_wait_and_the_model_is_unchanged(small_rollout, monkeypatch) -> None:
    """In plain FIFO order every device gets its task before the first update reaches an edge, so a round's
    updates all wait at once (issue 32: 2.4 GB at 100,000 devices). Delivered as the devices publish them, at
    most one waits, and every node receives the same messages in the same order: the model is bit-identical."""
    import functools

    from fedtier.transport.memory import MemoryBroker

    cells, per_cell = 3, 8
    cfg = small_rollout(rounds=2, topology={"cells": cells, "devices_per_cell": per_cell})
    fifo, fifo_broker = _simulate_on(functools.partial(MemoryBroker, eager_leaves=False), cfg, monkeypatch)
    eager, eager_broker = _simulate_on(MemoryBroker, cfg, monkeypatch)
    for name in fifo.params:
        assert np.array_equal(fifo.params[name], eager.params[name])
    assert [r["accuracy"] for r in fifo.rounds] == [r["accuracy"] for r in eager.rounds]
    assert [r["bytes"] for r in fifo.rounds] == [r["bytes"] for r in eager.rounds]
    sent = fifo.rounds[0]["bytes"]
    update = sent["device_up"] / (cells * per_cell)  # one device's update, bytes
    assert fifo_broker.peak_queued_bytes >= cells * per_cell * update  # all of a round's updates wait at once
    # At most one update waits, beside the round's messages to the edges and each edge's one task (one payload,
    # fanned out to its devices): O(cells); twice the devices per cell add less than an update (names in tasks).
    _, half = _simulate_on(MemoryBroker, small_rollout(rounds=2, topology={"cells": cells, "devices_per_cell": 4}),
                           monkeypatch)
    assert eager_broker.peak_queued_bytes < half.peak_queued_bytes + update
    assert eager_broker.peak_queued_bytes < fifo_broker.peak_queued_bytes - cells * per_cell * update / 2

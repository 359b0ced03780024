"""Secure aggregation through a real Mosquitto: the SecAgg+ phases over the cells' topics give the
simulator's model, and the edges only ever receive secure-aggregation messages from devices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fleet_threads import ThreadFleet

from local_fleet.simulate import simulate
from cloud_coordinator.store import CoordinatorStore
from fedtier.runtime.config import load
from fedtier.runtime.node_base import ACCEPTED, REJECTED

pytestmark = pytest.mark.broker

SECURE = {"fedavg": {"local_steps": 20, "lr": 0.2, "secure_aggregation": True, "secagg_min_survivors": 2,
                     "secagg_clip": 100.0}}


def _run_fleet(cfg: Any, mosquitto: Any, tmp_path: Path) -> tuple[dict, Any, ThreadFleet, Any]:
    """``cfg``'s fleet on threads through the test's Mosquitto, run to the end: (its config as plain data, the
    fleet's paths, the fleet, the coordinator node)."""
    from local_fleet.configs import write_fleet

    plain = cfg.to_dict()
    plain.pop("broker", None)
    plain["state_dir"] = str(tmp_path / "fleet" / "coordinator")
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    fleet = ThreadFleet(paths)
    try:
        fleet.start_all()
        cloud = fleet.wait_finished(timeout=120)
    finally:
        fleet.stop()
    return plain, paths, fleet, cloud


def test_secure_rounds_over_mosquitto(mosquitto, small_rollout, tmp_path: Path) -> None:
    from fedtier.rollout.config import RolloutConfig

    plain, paths, fleet, cloud = _run_fleet(small_rollout(rounds=3, **SECURE), mosquitto, tmp_path)
    edges = {name: fleet.nodes[name].node for name in paths.edges}
    assert edges, sorted(fleet.nodes)
    for name, running in fleet.nodes.items():
        assert running.node.metrics.total(REJECTED) == 0, (name, running.node.metrics.snapshot())
    for name, edge in edges.items():
        # what the edge accepted from its devices: the four SecAgg+ kinds, never a device_update
        assert edge.metrics.get(ACCEPTED, kind="device_update") == 0, name
        for kind in ("secagg_keys", "secagg_shares", "secagg_masked", "secagg_reveal"):
            assert edge.metrics.get(ACCEPTED, kind=kind) == 2 * 3, (name, kind)  # 2 devices x 3 rounds
    history = cloud.history
    assert [r["round"] for r in history] == [0, 1, 2]
    assert all(r["devices_reported"] == 4 and r["missing"] == [] for r in history)
    assert history[-1]["accuracy"] > 0.6

    cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    over_mqtt = store.latest_model(cfg.rollout)
    store.close()
    simulated = simulate(RolloutConfig.from_mapping({**plain, "state_dir": str(tmp_path / "sim")}))
    assert over_mqtt is not None and over_mqtt.round == 2
    for name, value in simulated.params.items():  # same stochastic rounding streams: the same sums
        np.testing.assert_allclose(over_mqtt.params[name], value, rtol=0, atol=1e-5)


def test_an_offline_device_is_a_dropout_and_its_cell_still_closes(mosquitto, small_rollout, tmp_path: Path) -> None:
    """One device of a 3-device cell never comes online: the keys phase closes at its deadline with
    the other two (s_min = 2), and every round's model holds the five devices that took part."""
    from local_fleet.configs import write_fleet

    cfg = small_rollout(rounds=2, topology={"cells": 2, "devices_per_cell": 3},
                        fedavg={**SECURE["fedavg"], "deadline_s": 2.0})
    plain = cfg.to_dict()
    plain.pop("broker", None)
    plain["state_dir"] = str(tmp_path / "fleet" / "coordinator")
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    offline = sorted(paths.devices)[0]
    fleet = ThreadFleet(paths)
    try:
        for device in paths.devices:
            if device != offline:
                fleet.start_device(device)
        for cell in paths.edges:
            fleet.start_edge(cell)
        fleet.start_coordinator()
        cloud = fleet.wait_finished(timeout=120)
    finally:
        fleet.stop()
    for name, running in fleet.nodes.items():
        assert running.node.metrics.total(REJECTED) == 0, (name, running.node.metrics.snapshot())
    history = cloud.history
    assert [r["round"] for r in history] == [0, 1]
    assert all(r["devices_reported"] == 5 for r in history), history
    assert all(offline in r["missing"] for r in history)


def test_distributed_dp_over_mosquitto_puts_each_cells_release_on_the_ledger(mosquitto, small_rollout,
                                                                             tmp_path: Path) -> None:
    """[privacy] with secure aggregation: the devices add their noise shares, the edges only unmask sums, and
    the coordinator's ledger holds one distributed release per cell and round, charged to every member. A cell
    labelled trusted runs the same way: nothing clear travels, so plain MQTT is accepted (require_tls stays on)."""
    from fedtier.rollout.config import RolloutConfig

    cfg = small_rollout(rounds=2, topology={"cells": 2, "devices_per_cell": 3, "trusted": {"cell-a": True}},
                        privacy={"epsilon": 8.0, "clip": 1.0},
                        fedavg={**SECURE["fedavg"], "weighting": "uniform"})
    _, paths, fleet, cloud = _run_fleet(cfg, mosquitto, tmp_path)
    for name, running in fleet.nodes.items():
        assert running.node.metrics.total(REJECTED) == 0, (name, running.node.metrics.snapshot())
    assert [r["round"] for r in cloud.history] == [0, 1]

    cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    try:
        rows = store.privacy_releases(cfg.rollout)
    finally:
        store.close()
    assert {(r["round"], r["node"]) for r in rows} == {(r, c) for r in (0, 1) for c in ("cell-a", "cell-b")}
    assert all(r["event"] == "edge" and r["observed"] and r["inputs"]["distributed"] for r in rows)
    assert all(r["inputs"]["survivors"] == 3 and len(r["protected"]) == 3 for r in rows)
    assert max(cloud.history[-1]["privacy"]["epsilon"].values()) <= 8.0 + 1e-6


def _run_without(cfg: Any, offline: set[str], mosquitto: Any, tmp_path: Path) -> tuple[Any, ThreadFleet, Any]:
    """``cfg``'s fleet through the test's Mosquitto with the ``offline`` devices never started, run to the end:
    (the fleet's paths, the fleet, the coordinator node)."""
    from local_fleet.configs import write_fleet

    plain = cfg.to_dict()
    plain.pop("broker", None)
    plain["state_dir"] = str(tmp_path / "fleet" / "coordinator")
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    fleet = ThreadFleet(paths)
    try:
        for device in paths.devices:
            if device not in offline:
                fleet.start_device(device)
        for cell in paths.edges:
            fleet.start_edge(cell)
        fleet.start_coordinator()
        cloud = fleet.wait_finished(timeout=240)
    finally:
        fleet.stop()
    return paths, fleet, cloud


def test_a_cell_of_six_with_one_silent_device_delivers_every_round(mosquitto, small_rollout, tmp_path: Path) -> None:
    """Issue 31: 2 cells of 6, s_min 4, cell quorum 0.5, and one device of cell-a never comes online. Each
    SecAgg+ phase has its own deadline inside the round's (keys: 0.6 deadline_s), so cell-a's update reaches
    the coordinator before the round's deadline: 11 devices in every round. (With the keys phase waiting out
    deadline_s, cell-a's update always came late and the cell missed 4 rounds of 4.)"""
    from edge_broker.service import SECAGG_ABORTS, SECAGG_WAITED

    cfg = small_rollout(rounds=4, topology={"cells": 2, "devices_per_cell": 6},
                        fedavg={**SECURE["fedavg"], "secagg_min_survivors": 4, "quorum": 0.5, "deadline_s": 8.0})
    silent = cfg.topology.layout()["cell-a"][0]
    paths, fleet, cloud = _run_without(cfg, {silent}, mosquitto, tmp_path)
    history = cloud.history
    assert [r["round"] for r in history] == [0, 1, 2, 3]
    assert [r["devices_reported"] for r in history] == [11, 11, 11, 11], history
    assert all(r["missing"] == [silent] for r in history)
    assert all(r["cells"]["cell-a"]["secagg"] == {"waited": {"keys": [silent]}} for r in history)
    assert all(r["round_s"] < 8.0 for r in history[1:])  # the first round also waits for the fleet to start
    edge = fleet.nodes["cell-a"].node
    assert edge.metrics.get(SECAGG_WAITED, phase="keys") == 4 and edge.metrics.total(SECAGG_ABORTS) == 0
    for name, running in fleet.nodes.items():
        assert running.node.metrics.total(REJECTED) == 0, (name, running.node.metrics.snapshot())


def test_a_cell_below_s_min_aborts_every_round_and_charges_no_device(mosquitto, small_rollout, tmp_path: Path) -> None:
    """Distributed DP, cells of 3 with s_min 3, and one device of cell-b never comes online: cell-b's keys
    phase closes with 2 < 3 at its own deadline and the cell aborts each round, reporting it to the coordinator,
    which closes the round with cell-a at once (its cells all answered, a quorum updated) and charges cell-b's
    devices nothing: no sum of theirs ever existed."""
    from fedtier.rollout.config import RolloutConfig

    cfg = small_rollout(rounds=2, topology={"cells": 2, "devices_per_cell": 3}, privacy={"epsilon": 8.0, "clip": 1.0},
                        fedavg={**SECURE["fedavg"], "secagg_min_survivors": 3, "quorum": 0.5, "deadline_s": 6.0})
    silent = cfg.topology.layout()["cell-b"][0]
    paths, fleet, cloud = _run_without(cfg, {silent}, mosquitto, tmp_path)
    history = cloud.history
    assert [r["round"] for r in history] == [0, 1]
    assert all(r["cells"]["cell-b"]["reported"] == [] and r["devices_reported"] == 3 for r in history)
    assert all(r["cells"]["cell-b"]["secagg"]["aborted"]["reason"] == "too_few_keys" for r in history)
    assert all(r["round_s"] < 6.0 for r in history[1:])
    epsilon = history[-1]["privacy"]["epsilon"]
    assert all(epsilon[d] == 0.0 for d in cfg.topology.layout()["cell-b"])
    assert all(epsilon[d] > 0.0 for d in cfg.topology.layout()["cell-a"])
    cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    try:
        rows = store.privacy_releases(cfg.rollout)
    finally:
        store.close()
    assert sorted((r["round"], r["node"]) for r in rows) == [(0, "cell-a"), (1, "cell-a")]


def test_a_rollout_whose_only_cell_aborts_every_round_ends_with_the_initial_model(mosquitto, small_rollout,
                                                                                 tmp_path: Path) -> None:
    """One cell of 3 with s_min 3 and distributed DP, one device never comes online: every round the cell aborts
    at its keys deadline and no cell has an update. Each round closes once the abort is in (every cell answered),
    so the rollout ends, with the weights it started with, and charges nobody; it waited for ever before."""
    from fedtier.rollout.config import RolloutConfig

    cfg = small_rollout(rounds=2, topology={"cells": 1, "devices_per_cell": 3}, privacy={"epsilon": 8.0, "clip": 1.0},
                        fedavg={**SECURE["fedavg"], "secagg_min_survivors": 3, "deadline_s": 5.0})
    silent = cfg.topology.layout()["cell-a"][0]
    paths, fleet, cloud = _run_without(cfg, {silent}, mosquitto, tmp_path)
    history = cloud.history
    assert [r["round"] for r in history] == [0, 1] and all(r["devices_reported"] == 0 for r in history)
    assert all(r["cells"]["cell-a"]["secagg"]["aborted"]["reason"] == "too_few_keys" for r in history)
    assert all(r["round_s"] < 5.0 for r in history[1:])  # the keys deadline (0.6 x 5 s), not the round's, nor more
    assert all(e == 0.0 for e in history[-1]["privacy"]["epsilon"].values())
    cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    try:
        first, last = store.model(cfg.rollout, 0), store.latest_model(cfg.rollout)
        rows = store.privacy_releases(cfg.rollout)
    finally:
        store.close()
    assert first is not None and last is not None and last.version == 2
    assert all(np.array_equal(last.params[k], first.params[k]) for k in first.params)
    assert rows == []
    for name, running in fleet.nodes.items():
        assert running.node.metrics.total(REJECTED) == 0, (name, running.node.metrics.snapshot())

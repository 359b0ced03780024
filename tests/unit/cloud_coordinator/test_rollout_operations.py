"""The operator's view of a store: lifecycle commands, status, the canary gate (no broker needed);
each against SQLite and against a real PostgreSQL server (the ``store_url`` fixture)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cloud_coordinator.canary import promote, rollback
from cloud_coordinator.status import device_inventory, rollout_status
from cloud_coordinator.store import CoordinatorStore
from fedtier.cli import cli

CONFIG = {"rollout": "r", "rounds": 4, "topology": {"members": {"cell-a": ["d0", "d1"], "cell-b": ["d2"]}}}
PARAMS = {"w": np.ones((2, 2), np.float32)}


def _store(url: str) -> CoordinatorStore:
    store = CoordinatorStore(url)
    assert store.create_rollout("r", CONFIG) and not store.create_rollout("r", CONFIG)
    store.save_initial_model("r", PARAMS)
    for rnd, acc in enumerate([0.5, 0.8, 0.7]):
        params = {"w": PARAMS["w"] * (rnd + 2)}
        store.commit_round("r", rnd, rnd + 1, params, acc, 1.0, {"cells": {}})
    for node, cell in (("d0", "cell-a"), ("d1", "cell-a"), ("d2", "cell-b"), ("cell-a", "cell-a"),
                       ("cell-b", "cell-b")):
        store.record_presence(node, {"node": node, "cell": cell, "state": "online", "since": 1.0,
                                     "role": "edge" if node.startswith("cell") else "device"}, 10.0)
    return store


def test_lifecycle_commands_write_the_desired_state_and_refuse_what_does_not_apply(store_url: str,
                                                                                   tmp_path: Path) -> None:
    _store(store_url).close()
    run = lambda *a: CliRunner().invoke(cli, [*a, "--store", store_url, "--json"])  # noqa: E731
    assert run("rollout", "pause", "r").exit_code == 0
    assert run("rollout", "start", "r").exit_code == 2  # paused, not created
    assert json.loads(run("rollout", "resume", "r").output) == {"rollout": "r", "desired": "running", "was": "paused"}
    assert run("rollout", "stop", "r").exit_code == 0
    assert run("rollout", "status", "nope").exit_code == 2
    assert json.loads(run("rollout", "list").output)[0]["desired"] == "stopped"
    missing = CliRunner().invoke(cli, ["rollout", "list", "--state-dir", str(tmp_path / "none")])
    assert missing.exit_code == 2 and "no coordinator store at" in missing.output
    assert not (tmp_path / "none").exists()  # reading never creates a store


def test_redelivered_presence_is_not_a_new_sighting(store_url: str) -> None:
    store = _store(store_url)
    assert not store.record_presence("d0", {"node": "d0", "cell": "cell-a", "state": "online", "since": 1.0,
                                            "role": "device"}, 99.0)
    assert {d["node"]: d["last_seen"] for d in device_inventory(store)}["d0"] == 10.0
    assert store.record_presence("d0", {"node": "d0", "cell": "cell-a", "state": "offline", "since": 1.0,
                                        "role": "device"}, 20.0)
    status = rollout_status(store, "r")
    assert status["cells"]["cell-a"]["devices_online"] == 1 and status["cells"]["cell-a"]["offline"] == ["d0"]
    assert status["rounds_closed"] == 3 and status["last_accuracy"] == 0.7 and status["model_version"] == 3


def test_a_candidate_with_nan_or_worse_accuracy_is_not_promoted_and_the_canary_returns(store_url: str) -> None:
    store = _store(store_url)
    first = promote(store, "r", ["cell-a"], version=2, observe_s=0)
    assert first.passed and first.deployed == {"cell-a": 2, "cell-b": 2}
    worse = promote(store, "r", ["cell-a"], version=3, margin=0.05, observe_s=0)  # 0.7 < 0.8 - 0.05
    assert not worse.passed and "accuracy" in worse.reasons[0] and worse.deployed == {"cell-a": 2, "cell-b": 2}
    assert promote(store, "r", ["cell-a"], version=3, margin=0.2, observe_s=0).passed
    store.commit_round("r", 3, 4, {"w": np.ones((2, 2), np.float32)}, 0.9, 1.0, {})
    stored = store.model  # the wire refuses to encode NaN, so a store never holds one: simulate a corrupt version
    store.model = lambda rollout, version: dataclasses.replace(  # type: ignore[method-assign]
        stored(rollout, version), params={"w": np.full((2, 2), np.nan, np.float32)})
    nan = promote(store, "r", ["cell-b"], observe_s=0)
    store.model = stored  # type: ignore[method-assign]
    assert not nan.passed and "non-finite" in nan.reasons[0] and set(nan.deployed.values()) == {3}
    store.record_presence("d2", {"node": "d2", "cell": "cell-b", "state": "offline", "since": 1.0}, 30.0)
    rollback(store, "r", 1)
    unhealthy = promote(store, "r", ["cell-b"], version=2, observe_s=0)
    assert not unhealthy.passed and unhealthy.reasons == ("cell cell-b: devices not online: d2",)
    assert {d["node"]: d["model_version"] for d in device_inventory(store) if d["role"] == "device"} == \
        {"d0": 1, "d1": 1, "d2": 1}
    assert [p["passed"] for p in store.promotions("r")] == [True, False, True, False, True, False]


def test_status_watch_refreshes_in_place_until_ctrl_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import commands.rollout as rollout_cli

    _store(str(tmp_path / "coordinator.db")).close()
    sleeps = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(rollout_cli.time, "sleep", sleep)
    result = CliRunner().invoke(cli, ["rollout", "status", "r", "--watch", "--interval", "0.5",
                                      "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert sleeps == [0.5, 0.5, 0.5] and "rounds closed 3/4" in result.output and "cell-a" in result.output


def test_status_sums_bytes_per_tier_and_reports_the_ledgers_epsilon(store_url: str) -> None:
    store = _store(store_url)
    store.commit_round("r", 3, 4, PARAMS, 0.9, 0.5, {
        "bytes": {"device_up": 100, "edge_up": 40}, "privacy": {"epsilon_max": 1.5, "budget_epsilon": 8.0},
        "cells": {"cell-a": {"reported": ["d0"], "missing": ["d1"], "rejected": {"late": 2}},
                  "cell-b": {"reported": ["d2"], "missing": [], "rejected": {}}}})
    store.set_open_round("r", 4, ["cell-a"])
    status = rollout_status(store, "r")
    assert status["bytes"] == {"device_up": 100, "edge_up": 40}
    assert status["epsilon_spent"] == 1.5 and status["epsilon_budget"] == 8.0 and status["open_round"] == 4
    a, b = status["cells"]["cell-a"], status["cells"]["cell-b"]
    assert a["round_open"] and not b["round_open"]
    assert a["updates_accepted"] == 1 and a["updates_rejected"] == {"late": 2} and a["stragglers"] == ["d1"]
    assert b["updates_accepted"] == 1 and b["stragglers"] == []
    assert json.loads(json.dumps(status)) == status  # plain JSON types (--json, dashboards)


def test_status_counts_the_devices_that_failed_to_train_per_cell_and_names_the_last_rounds(
        store_url: str, tmp_path: Path) -> None:
    store = _store(store_url)
    for round, failed in ((3, {"d1": "crash"}), (4, {"d1": "crash", "d0": "error"})):
        store.commit_round("r", round, round + 1, PARAMS, 0.9, 0.5, {"cells": {
            "cell-a": {"reported": sorted({"d0", "d1"} - set(failed)), "missing": sorted(failed), "rejected": {},
                       "failed": failed},
            "cell-b": {"reported": ["d2"], "missing": [], "rejected": {}}}})
    status = rollout_status(store, "r")
    a, b = status["cells"]["cell-a"], status["cells"]["cell-b"]
    assert a["training_failed"] == {"crash": 2, "error": 1} and a["failed_last_round"] == {"d0": "error", "d1": "crash"}
    assert b["training_failed"] == {} and b["failed_last_round"] == {}
    store.close()
    if store_url.startswith("sqlite"):
        result = CliRunner().invoke(cli, ["rollout", "status", "r", "--state-dir", str(tmp_path)])
        assert result.exit_code == 0 and "crash 2, error 1" in result.output, result.output


def test_a_training_device_is_last_seen_when_its_update_made_a_round(store_url: str) -> None:
    """An online device sends no presence while it trains: the rounds its updates made are sightings too."""
    store = _store(store_url)
    store.record_contributions("r", 2, 2, ["d0"])
    closed = {r["round"]: r["closed"] for r in store.rounds("r")}

    seen = {d["node"]: d["last_seen"] for d in device_inventory(store)}

    assert closed[2] > 10.0  # committed now, after the presence recorded at t = 10
    assert seen["d0"] == closed[2] and seen["d1"] == 10.0  # d1 made no round: its presence

"""The coordinator's per-cell series: presence, dropouts, quorum misses, epsilon, model versions."""

from __future__ import annotations

import json

import pytest

from cloud_coordinator.observe.prom import CoordinatorMetrics
from fedtier.runtime.metrics import Metrics

CELLS = {"cell-a": ("d1", "d2"), "cell-b": ("d3", "d4")}


def _online(state: str) -> bytes:
    return json.dumps({"state": state, "since": 1.0}).encode()


def test_devices_online_follow_presence_per_cell() -> None:
    m = Metrics(node="cloud", role="cloud")
    observed = CoordinatorMetrics(m, CELLS)

    observed.presence("d1", _online("online"))
    observed.presence("d2", _online("online"))
    observed.presence("d3", _online("online"))
    observed.presence("d2", _online("offline"))
    observed.presence("d3", b"")  # retained presence cleared
    observed.presence("cell-a", _online("online"))  # an edge: not a device of any cell
    observed.presence("d4", b"{not json")

    assert m.get("fedtier_devices_online", cell="cell-a") == 1 == observed.devices_online("cell-a")
    assert m.get("fedtier_devices_online", cell="cell-b") == 0
    assert m.get("fedtier_devices_known", cell="cell-b") == 2
    assert observed.devices_online("cell-z") is None


def test_a_round_closed_without_a_cell_and_a_device() -> None:
    m = Metrics(node="cloud", role="cloud")
    observed = CoordinatorMetrics(m, CELLS)
    row = {"round": 4, "accuracy": 0.75, "loss": 0.5, "round_s": 3.0, "model_version": 5,
           "missing": ["d2", "d3", "d4"],
           "privacy": {"epsilon_max": 2.5, "epsilon": {"d1": 2.5, "d2": 1.0, "d3": 0.5, "d4": 0.25}}}

    observed.round_closed(row, {"cell-a": ("d1",)})  # cell-b missed the round; d2 dropped out of cell-a
    observed.round_closed({**row, "round": 5, "missing": [], "privacy": None}, {"cell-a": ("d1", "d2"),
                                                                                "cell-b": ("d3", "d4")})

    assert m.get("fedtier_dropouts_total", cell="cell-a") == 1
    assert m.get("fedtier_dropouts_total", cell="cell-b") == 2
    assert m.get("fedtier_quorum_misses_total", cell="cell-a") == 0
    assert m.get("fedtier_quorum_misses_total", cell="cell-b") == 1
    assert m.get("fedtier_devices_reporting", cell="cell-b") == 2  # the last round's
    assert m.get("fedtier_epsilon_spent", cell="cell-a") == 2.5
    assert m.get("fedtier_epsilon_spent", cell="cell-b") == 0.5
    assert m.get("fedtier_epsilon_spent_max") == 2.5
    assert m.get("fedtier_model_version", cell="cell-b") == 5
    assert m.get("fedtier_round") == 5 and m.get("fedtier_accuracy") == 0.75
    assert m.get("fedtier_round_seconds") == 2
    assert m.snapshot()["fedtier_round_seconds_sum"][""] == pytest.approx(6.0)


def test_rejects_by_reason() -> None:
    m = Metrics(node="cloud", role="cloud")
    observed = CoordinatorMetrics(m, CELLS)
    m.inc("fedtier_rejected_total", reason="sha_mismatch")
    m.inc("fedtier_rejected_total", 2, reason="late")

    assert observed.rejects() == {"sha_mismatch": 1.0, "late": 2.0}


def test_the_open_rounds_deadline_the_quorum_and_the_epsilon_budget() -> None:
    m = Metrics(node="cloud", role="cloud")
    observed = CoordinatorMetrics(m, CELLS, quorum=0.5, deadline_s=60.0)
    before = m.get("fedtier_round_deadline_timestamp_seconds")

    observed.round_opened(1000.0)
    opened = m.get("fedtier_round_deadline_timestamp_seconds")
    observed.round_closed({"round": 0, "missing": [], "privacy": {"epsilon_max": 1.5, "budget_epsilon": 8.0,
                                                                   "epsilon": {"d1": 1.5}}}, {"cell-a": ("d1",)})

    assert before == float("inf") and opened == 1060.0
    assert m.get("fedtier_round_deadline_timestamp_seconds") == float("inf")  # closed: nothing open to be late
    assert m.get("fedtier_quorum") == 0.5 and m.get("fedtier_epsilon_budget") == 8.0


def test_the_service_exports_each_hosted_rollout_on_its_port_with_a_rollout_label(small_rollout, tmp_path) -> None:
    """``coordinator serve``: one scrape carries the service's series and each hosted rollout's, until the
    rollout is no longer hosted."""
    from types import SimpleNamespace

    from cloud_coordinator.service import CoordinatorService
    from cloud_coordinator.store import CoordinatorStore

    store = CoordinatorStore(tmp_path / "coordinator.db")
    store.create_rollout("a", small_rollout(rollout="a").to_dict())
    nodes: dict[str, SimpleNamespace] = {}

    def make_node(cfg):  # type: ignore[no-untyped-def]
        metrics = Metrics(node="cloud", role="cloud", rollout=cfg.rollout)
        metrics.set("fedtier_round", 4)
        metrics.inc("fedtier_stragglers_total", 0)  # as every node declares it, the service too
        nodes[cfg.rollout] = SimpleNamespace(metrics=metrics, presence=None, done=False, start=lambda now: None,
                                             tick=lambda now: None)
        return nodes[cfg.rollout]

    tx = SimpleNamespace(subscribe=lambda topic: None)
    service = CoordinatorService(store=store, transport=tx, cloud_id="cloud",  # type: ignore[arg-type]
                                 make_node=make_node)
    try:
        service.start(0.0)
        hosted = service.metrics.render()
        nodes["a"].done = True
        service.tick(1.0)
        gone = service.metrics.render()
    finally:
        store.close()

    assert 'fedtier_round{node="cloud",role="cloud",rollout="a"} 4.0' in hosted
    assert hosted.count("# TYPE fedtier_stragglers_total counter") == 1  # the service's and the node's, one family
    assert "fedtier_round{" not in gone

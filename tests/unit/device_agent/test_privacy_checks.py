"""The shells' privacy guards: the signed plan wins over the task's, clear models only over TLS,
and a trusted edge never publishes an un-noised aggregate (defence in depth behind the role)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from device_agent.node import DeviceNode
from edge_broker.service import EdgeNode
from fedtier.errors import PrivacyViolationError, UnexpectedMessageError
from fedtier.privacy import audit
from fedtier.privacy.plan import CellPlan, NoisePlan
from fedtier.runtime.metrics import Metrics
from fedtier.runtime.node_base import REJECTED
from fedtier.wire.messages import CellTask, CellUpdate, DeviceTask


def plan(require_tls: bool = True) -> dict[str, Any]:
    return NoisePlan(mode="rdp", epsilon=1.0, delta=1e-5, budget_epsilon=math.inf, clip=1.0, edge_rounds=1,
                     rounds=3, require_tls=require_tls,
                     cells={"cell-a": CellPlan(True, 2, 0.0, 3.0), "cell-b": CellPlan(False, 2, 4.0, 0.0)}).to_dict()


def device(cell: str, secure: bool, manifest_plan: dict[str, Any] | None) -> Any:
    return SimpleNamespace(manifests={"r": SimpleNamespace(extra={"privacy": manifest_plan} if manifest_plan else {})},
                           tx=SimpleNamespace(secure=secure), cell=cell)


def task(privacy: dict[str, Any] | None) -> DeviceTask:
    return DeviceTask(rollout="r", round=0, sender="cell-a", config={"privacy": privacy} if privacy else {})


def test_a_device_of_a_trusted_cell_sends_clear_updates_only_over_tls() -> None:
    p = plan()
    DeviceNode._check_privacy(device("cell-a", True, p), task(p))  # TLS: fine
    with pytest.raises(PrivacyViolationError, match="no TLS"):
        DeviceNode._check_privacy(device("cell-a", False, p), task(p))
    DeviceNode._check_privacy(device("cell-b", False, p), task(p))  # noised updates may travel in clear
    lab = plan(require_tls=False)
    DeviceNode._check_privacy(device("cell-a", False, lab), task(lab))  # explicitly allowed (lab setup)


def test_the_signed_manifests_plan_wins_over_the_task() -> None:
    p = plan()
    weakened = {**p, "cells": {**p["cells"], "cell-b": {**p["cells"]["cell-b"], "trusted": True,
                                                        "device_z": 0.0, "edge_z": 1.0}}}
    with pytest.raises(UnexpectedMessageError, match="differs from the rollout manifest"):
        DeviceNode._check_privacy(device("cell-b", True, p), task(weakened))
    with pytest.raises(UnexpectedMessageError):  # a task that drops the plan altogether
        DeviceNode._check_privacy(device("cell-b", True, p), task(None))


def edge(cell: str, secure: bool) -> Any:
    return SimpleNamespace(cell=cell, cell_tx=SimpleNamespace(secure=secure), roles={}, metrics=Metrics(node=cell))


def test_a_trusted_edge_takes_clear_inputs_only_over_tls() -> None:
    cell_task = CellTask(rollout="r", round=0, sender="cloud", config={"privacy": plan()})
    EdgeNode._check_clear_inputs(edge("cell-a", True), cell_task)
    with pytest.raises(PrivacyViolationError, match="no TLS"):
        EdgeNode._check_clear_inputs(edge("cell-a", False), cell_task)
    EdgeNode._check_clear_inputs(edge("cell-b", False), cell_task)


def test_a_trusted_edge_never_publishes_an_aggregate_without_its_noise() -> None:
    node = edge("cell-a", True)
    node.roles["r"] = SimpleNamespace(noise_plan=NoisePlan.from_dict(plan()))
    delta = {"w": np.zeros(3, np.float32)}
    clear = CellUpdate(rollout="r", round=0, sender="cell-a", delta=delta, weight=2.0, reported=("a", "b"),
                       privacy={"trusted": True, "steps": [["a", "b"]], "releases": [], "clear": []})
    assert EdgeNode._refuse_clear_aggregate(node, "r", clear) is True
    assert node.metrics.get(REJECTED, reason="privacy_violation") == 1
    noise_plan = NoisePlan.from_dict(plan())
    record = audit.release_record(plan=noise_plan, node="cell-a", event="edge", round=0, step=0,
                                  sigma=noise_plan.edge_sigma("cell-a", 2), sensitivity=noise_plan.edge_sensitivity(2),
                                  z=3.0, protected=["a", "b"], reporters=2)
    noised = CellUpdate(rollout="r", round=0, sender="cell-a", delta=delta, weight=2.0, reported=("a", "b"),
                        privacy={"trusted": True, "steps": [["a", "b"]], "clear": [], "releases": [record]})
    assert EdgeNode._refuse_clear_aggregate(node, "r", noised) is False

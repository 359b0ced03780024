"""Roles and ``training_failed``: a device that cannot compute its work gives the round up and says so; its edge
counts it out of the round and closes the step without it once everyone else reported (DESIGN §9, containment)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_hsgd import ARCH

from fedtier.algorithms import fedavg, hier_qsgd, hsgd, qhetfed, secure_fedavg
from fedtier.algorithms.base import Broadcast, Dropped, LocalTrain, RoleState, SendToParent
from fedtier.errors import LateMessageError, UnknownSenderError, UnselectedDeviceError, WrongRoundError
from fedtier.training import split
from fedtier.wire.messages import CellStep, CellTask, CellUpdate, DeviceTask, DeviceUpdate, Embeddings, TrainingFailed

PARAMS = {"w": np.zeros((2, 2), np.float32)}
MEMBERS = ("dev-0", "dev-1", "dev-2")


def failed(device: str, round: int = 0, step: int = 0, reason: str = "crash") -> TrainingFailed:
    return TrainingFailed(rollout="r", round=round, sender=device, step=step, reason=reason)


def update(device: str, step: int = 0, value: float = 1.0) -> DeviceUpdate:
    return DeviceUpdate(rollout="r", round=0, sender=device, step=step, delta={"w": np.full((2, 2), value, np.float32)},
                        num_samples=1, train_loss=0.0, steps=1)


def edge_at_round_0(module: Any, config: Any) -> Any:
    edge = module.Edge(cell="cell-a", rollout="r")
    edge.receive(CellTask(rollout="r", round=0, sender="cloud", params=PARAMS, members=MEMBERS,
                          config=config.to_dict()), 0.0)
    return edge


def test_a_device_that_cannot_compute_its_work_gives_the_round_up_and_reports_it() -> None:
    device = fedavg.Device(device_id="dev-0", cell="cell-a", rollout="r")
    task = DeviceTask(rollout="r", round=0, sender="cell-a", params=PARAMS, config=fedavg.FedAvgConfig().to_dict(),
                      members=MEMBERS)
    [work] = device.receive(task, 0.0)
    assert isinstance(work, LocalTrain)
    # Execute: the shell could not train.
    [report] = device.failed(0, 0, "crash")
    # Assert: reported upward, the round given up (a repeated task is a duplicate); the next round trains.
    assert isinstance(report, SendToParent) and isinstance(report.message, TrainingFailed)
    assert report.message.key == "training_failed/r/0/0/dev-0" and report.message.reason == "crash"
    assert device.state is RoleState.IDLE and device.last_round == 0
    assert [a.reason for a in device.receive(task, 0.0) if isinstance(a, Dropped)] == ["duplicate"]
    later = DeviceTask(rollout="r", round=1, sender="cell-a", params=PARAMS, config=task.config, members=MEMBERS)
    assert [type(a) for a in device.receive(later, 0.0)] == [LocalTrain]


def test_a_device_restarted_after_reporting_a_failure_does_not_take_that_round_again() -> None:
    # The shell stores last_round with the report; a restarted role starts from it.
    device = fedavg.Device(device_id="dev-0", cell="cell-a", rollout="r", last_round=0, last_sent=(0, 0))
    task = DeviceTask(rollout="r", round=0, sender="cell-a", params=PARAMS, config=fedavg.FedAvgConfig().to_dict(),
                      members=MEMBERS)
    assert [a.reason for a in device.receive(task, 0.0) if isinstance(a, Dropped)] == ["duplicate"]


def test_the_edge_closes_each_step_without_the_failed_member_once_the_others_reported() -> None:
    # Prepare: two edge rounds per round, quorum 1.0 (the default): a straggler would hold the round.
    edge = edge_at_round_0(hier_qsgd, hier_qsgd.HierConfig(edge_rounds=2, local_steps=1))
    assert edge.receive(update("dev-0"), 0.0) == []
    # Execute / Assert: dev-1 fails step 0; the step closes when dev-2 reports.
    assert edge.receive(failed("dev-1"), 0.0) == []
    assert edge.overdue(1e9) == ("dev-2",) and edge.resend("dev-1", 0.0) == []
    [step] = edge.receive(update("dev-2", value=3.0), 0.0)
    assert isinstance(step, Broadcast) and isinstance(step.message, CellStep)
    assert step.message.reported == ("dev-0", "dev-2")
    # dev-1 is out of the round: step 1 does not wait for it either.
    assert edge.overdue(1e9) == ("dev-0", "dev-2")
    assert edge.receive(update("dev-0", step=1), 0.0) == []
    actions = edge.receive(update("dev-2", step=1), 0.0)
    [sent] = [a for a in actions if isinstance(a, SendToParent)]
    assert isinstance(sent.message, CellUpdate) and sent.message.reported == ("dev-0", "dev-2")
    assert edge.state is RoleState.FORWARDED


def test_a_failure_of_the_last_member_closes_the_step_at_once() -> None:
    edge = edge_at_round_0(fedavg, fedavg.FedAvgConfig())
    edge.receive(update("dev-0"), 0.0)
    edge.receive(update("dev-1"), 0.0)
    actions = edge.receive(failed("dev-2", reason="error"), 0.0)
    [sent] = [a for a in actions if isinstance(a, SendToParent)]
    assert sent.message.reported == ("dev-0", "dev-1")


def test_the_edge_refuses_failures_it_cannot_place_and_drops_repeats() -> None:
    edge = edge_at_round_0(fedavg, fedavg.FedAvgConfig())
    with pytest.raises(UnknownSenderError):
        edge.receive(failed("stranger"), 0.0)
    with pytest.raises(WrongRoundError):
        edge.receive(failed("dev-0", round=1), 0.0)
    with pytest.raises(WrongRoundError):
        edge.receive(failed("dev-0", step=1), 0.0)
    assert edge.receive(failed("dev-0"), 0.0) == []
    assert [a.reason for a in edge.receive(failed("dev-0"), 0.0) if isinstance(a, Dropped)] == ["duplicate"]
    edge.receive(update("dev-1"), 0.0)
    edge.receive(update("dev-2"), 0.0)  # the cell closed
    with pytest.raises(LateMessageError):
        edge.receive(failed("dev-1"), 0.0)
    assert edge.state is RoleState.FORWARDED


def test_a_qhetfed_set_goes_on_without_a_failed_device() -> None:
    edge = edge_at_round_0(qhetfed, qhetfed.QHetFedConfig(tau=1))
    from fedtier.algorithms.common import digest
    from fedtier.wire.messages import DeviceGradient

    def gradient(device: str) -> DeviceGradient:
        return DeviceGradient(rollout="r", round=0, sender=device, step=0, grad={"w": np.ones((2, 2), np.float32)},
                              model_sha=digest(PARAMS), loss=0.1, num_samples=1)

    edge.receive(gradient("dev-0"), 0.0)
    edge.receive(failed("dev-1"), 0.0)
    [step] = edge.receive(gradient("dev-2"), 0.0)
    assert isinstance(step.message, CellStep) and step.message.reported == ("dev-0", "dev-2")


def test_a_secure_aggregation_edge_counts_a_failed_device_as_a_dropout_at_the_phase_deadline() -> None:
    edge = edge_at_round_0(secure_fedavg, secure_fedavg.SecureFedAvgConfig(secagg_min_survivors=2))
    assert edge.receive(failed("dev-1"), 0.0) == []  # recorded; the keys phase still closes at its deadline
    assert edge.state is RoleState.COLLECTING


def test_hsgd_goes_on_to_the_host_without_a_selected_device_that_failed_to_embed() -> None:
    params = split.init_params(ARCH, 1)
    devices = tuple(f"d{i}" for i in range(6))
    config = hsgd.HsgdConfig(global_interval=2, local_interval=1, alpha=0.5, hosts={"c": "h"})
    edge = hsgd.Edge(cell="c", rollout="r")
    edge.receive(CellTask(rollout="r", round=0, sender="cloud", params=params, members=(*devices, "h"),
                          config=config.to_dict()), 0.0)
    chosen, other = edge.selected, next(d for d in devices if d not in edge.selected)
    with pytest.raises(UnselectedDeviceError):
        edge.receive(TrainingFailed(rollout="r", round=0, sender=other, reason="crash"), 0.0)
    for d in chosen[1:]:
        edge.receive(Embeddings(rollout="r", round=0, sender=d, zeta=np.ones((1, ARCH.d2), np.float32), rows=(d,)), 0.0)
    assert edge.overdue(1e9) == (chosen[0],)
    actions = edge.receive(TrainingFailed(rollout="r", round=0, sender=chosen[0], reason="crash"), 0.0)
    [to_host] = [a for a in actions if getattr(a, "child", None) == "h"]
    assert to_host.message.rows == chosen[1:]
    assert edge.resend(chosen[0], 0.0) == []


def test_an_hsgd_device_and_host_report_their_failure() -> None:
    device = hsgd.Device(device_id="d0", cell="c", rollout="r")
    params = split.init_params(ARCH, 1)
    config = hsgd.HsgdConfig(global_interval=2, local_interval=1, alpha=1.0, hosts={"c": "h"})
    task = DeviceTask(rollout="r", round=0, sender="c", params=split.block(params, "theta2"), config=config.to_dict(),
                      members=("d0",))
    device.receive(task, 0.0)
    [report] = device.failed(0, 0, "error")
    assert isinstance(report.message, TrainingFailed) and device.state is RoleState.IDLE
    host = hsgd.Host(host_id="h", cell="c", rollout="r")
    with pytest.raises(Exception, match="failed"):
        host.failed(0, 0, "crash")  # no work was asked of it: a misuse

"""A device whose training fails contains it (DESIGN §9): an error or a non-finite result is reported at once as
``training_failed``; an agent that dies in the same step ``max_task_crashes`` times reports it instead of training
it again; and a restarted agent trains nothing of a rollout until its edge shows the rollout still runs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_coordinator.rollout import prepare
from device_agent.data import LocalData
from device_agent.faults import ENV, Fault, from_env
from device_agent.node import TRAINING_FAILED, DeviceNode
from device_agent.state import DeviceState
from device_agent.trainers import make_trainer
from fedtier.artifacts.cache import ArtifactCache
from fedtier.errors import ConfigError
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker
from fedtier.wire import messages
from fedtier.wire.messages import DeviceTask, DeviceUpdate, TrainingFailed


class Died(BaseException):
    """Stands for the process dying inside the trainer (a native crash): nothing in the agent catches it."""


class Trainer:
    """The real trainer, with a test's behaviour in ``train_steps`` and a count of the calls."""

    calls = 0

    def __init__(self, inner: Any, behaviour: str) -> None:
        self.inner = inner
        self.behaviour = behaviour

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def train_steps(self, batches: Any, lr: float) -> Any:
        Trainer.calls += 1
        if self.behaviour == "die":
            raise Died()
        stats = self.inner.train_steps(batches, lr)
        if self.behaviour == "nan":
            self.inner.set_parameters({k: np.full_like(v, np.nan) for k, v in self.inner.get_parameters().items()})
        return stats


class Rig:
    """One device of the small rollout, its edge as a plain connection, restartable on its state directory."""

    def __init__(self, prepared: Any, tmp: Path) -> None:
        self.prepared = prepared
        self.tmp = tmp
        self.rollout = prepared.config.rollout
        self.cell = next(iter(prepared.cells))
        self.device = prepared.cells[self.cell][0]
        self.connect(MemoryBroker())

    def connect(self, broker: MemoryBroker) -> None:
        self.broker = broker
        self.received: list = []
        self.edge = broker.connect("edge", self.received.append)
        self.edge.subscribe(topics.cell_up_filter(self.cell))

    def start(self, behaviour: str = "ok", fault: Fault | None = None) -> DeviceNode:
        x, y = self.prepared.data.train[self.device]
        node = DeviceNode(device_id=self.device, cell=self.cell, transport=self.broker.connect(self.device),
                          data=LocalData(x=x, y=y),
                          trainer_provider=lambda b: Trainer(make_trainer("ort", b), behaviour),
                          state=DeviceState(self.tmp / "agent.db"), cache=ArtifactCache(self.tmp / "cache"),
                          bundles_dir=self.tmp / "bundles", fault=fault)
        node.tx.set_handler(lambda inbound: node.handle(inbound, self.broker.now))
        for sha, path in self.prepared.artifact_files().items():
            node.cache.put(sha, path.read_bytes())
        node.start(0.0)
        self.node = node
        return node

    def stop(self) -> None:
        self.node.tx.close()
        self.node.state.close()

    def manifest(self) -> None:
        self.edge.publish(topics.cell_manifest(self.rollout, self.cell), self.prepared.manifest.encode(), retain=True)

    def task(self, round: int) -> None:
        cfg = self.prepared.algorithm_config().to_dict()
        task = DeviceTask(rollout=self.rollout, round=round, sender=self.cell, params=self.prepared.initial_params,
                          config=cfg, members=self.prepared.cells[self.cell])
        self.edge.publish(topics.cell_down(self.rollout, self.cell, task.KIND), task.encode())

    def sent(self, kind: type) -> list:
        return [m for m in (messages.decode_message(i.payload) for i in self.received) if isinstance(m, kind)]


@pytest.fixture
def rig(small_rollout: Any, tmp_path: Path) -> Rig:
    Trainer.calls = 0
    return Rig(prepare(small_rollout()), tmp_path)


@pytest.mark.parametrize(("behaviour", "fault", "reason"), [("ok", Fault("raise", 0), "error"),
                                                            ("nan", None, "non_finite")])
def test_a_trainer_error_or_a_non_finite_result_is_reported_at_once_and_the_next_round_trains(
        rig: Rig, behaviour: str, fault: Fault | None, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    rig.start(behaviour, fault)
    rig.manifest()
    with caplog.at_level(logging.ERROR, logger="fedtier.agent"):
        rig.task(0)
        rig.broker.run_until_idle()
    # Assert: no update of round 0; its failure, by reason, once; the agent is alive and counted it.
    assert rig.sent(DeviceUpdate) == []
    [failed] = rig.sent(TrainingFailed)
    assert (failed.round, failed.step, failed.reason) == (0, 0, reason)
    assert rig.node.metrics.get(TRAINING_FAILED, reason=reason) == 1
    assert f"round 0 step 0 of {rig.rollout} not trained" in caplog.text
    # The same task again (the edge asking again) is not trained again: the same report goes out again (the
    # edge drops it by its key if it has it); the next round's task is trained.
    calls = Trainer.calls
    rig.task(0)
    rig.broker.run_until_idle()
    assert Trainer.calls == calls and {m.key for m in rig.sent(TrainingFailed)} == {failed.key}
    if behaviour == "nan":
        rig.node.trainers[rig.rollout].behaviour = "ok"
    rig.task(1)
    rig.broker.run_until_idle()
    assert [u.round for u in rig.sent(DeviceUpdate)] == [1]


def test_an_agent_that_keeps_dying_in_the_same_step_reports_it_failed_instead_of_training_it_again(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    # Execute: the agent dies in round 0's training, is restarted and gets the same task again (its
    # persistent session redelivers what it had not acknowledged), twice.
    for _ in range(2):
        rig.start("die")
        rig.manifest()
        rig.task(0)
        with pytest.raises(Died):
            rig.broker.run_until_idle()
        rig.stop()
    assert Trainer.calls == 2
    with caplog.at_level(logging.ERROR, logger="fedtier.agent"):
        rig.start("die")
        assert "died while it trained round 0 step 0" in caplog.text
        rig.manifest()
        rig.task(0)
        rig.broker.run_until_idle()
    # Assert: not trained a third time: reported as a crash; the agent lives and trains the next round.
    assert Trainer.calls == 2 and rig.sent(DeviceUpdate) == []
    [failed] = rig.sent(TrainingFailed)
    assert (failed.round, failed.reason) == (0, "crash")
    rig.node.trainers[rig.rollout].behaviour = "ok"
    rig.task(1)
    rig.broker.run_until_idle()
    assert [u.round for u in rig.sent(DeviceUpdate)] == [1]
    assert rig.node.state.open_work() == []


def test_a_restarted_agent_trains_a_waiting_task_only_once_its_edge_shows_the_rollout_still_runs(rig: Rig) -> None:
    rig.start()
    rig.manifest()
    rig.task(0)
    rig.broker.run_until_idle()
    assert [u.round for u in rig.sent(DeviceUpdate)] == [0]
    rig.stop()
    # Execute: the agent restarts against a broker that lost its retained messages; a task arrives first.
    rig.connect(MemoryBroker())
    node = rig.start()
    rig.task(1)
    rig.broker.run_until_idle()
    assert rig.sent(DeviceUpdate) == [] and rig.rollout not in node.trainers
    # Assert: the edge publishes the manifest again (as it does when a device comes online): now it trains.
    rig.manifest()
    rig.broker.run_until_idle()
    assert [u.round for u in rig.sent(DeviceUpdate)] == [1]


def test_a_restarted_agent_never_trains_a_task_of_a_rollout_that_ended(rig: Rig, caplog: pytest.LogCaptureFixture,
                                                                        ) -> None:
    rig.start()
    rig.manifest()
    rig.task(0)
    rig.broker.run_until_idle()
    rig.stop()
    # The rollout is stopped while the agent is down: the edge clears the cell's retained manifest.
    rig.edge.publish(topics.cell_manifest(rig.rollout, rig.cell), b"", retain=True)
    rig.broker.run_until_idle()
    # Execute: restarted, the agent's session redelivers a task of the stopped rollout, then the deletion.
    with caplog.at_level(logging.INFO, logger="fedtier.agent"):
        node = rig.start()
        rig.task(1)
        rig.broker.run_until_idle()
        assert rig.sent(DeviceUpdate)[1:] == []
        rig.edge.publish(topics.cell_manifest(rig.rollout, rig.cell), b"")
        rig.broker.run_until_idle()
    # Assert: never trained, the task dropped, the rollout forgotten (a later restart resumes nothing of it).
    assert [u.round for u in rig.sent(DeviceUpdate)] == [0]
    assert f"dropped the waiting task of round 1 of {rig.rollout}, which ended" in caplog.text
    assert node._pending_task == {} and node.state.installed_manifests() == {}


def test_the_test_fault_is_off_unless_its_variable_names_the_device() -> None:
    assert from_env("dev-1", {}) is None
    assert from_env("dev-1", {ENV: "dev-0:segv@1"}) is None
    assert from_env("dev-1", {ENV: "dev-0:segv@1, dev-1:abort@3"}) == Fault("abort", 3)
    with pytest.raises(ConfigError):
        from_env("dev-1", {ENV: "dev-1:explode@1"})

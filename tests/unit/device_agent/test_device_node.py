"""The device node over the in-memory transport: artifacts, training, outbox."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cloud_coordinator.rollout import prepare
from device_agent.data import LocalData
from device_agent.node import DeviceNode
from device_agent.state import DeviceState
from device_agent.trainers import make_trainer
from fedtier.algorithms.common import digest
from fedtier.artifacts.cache import ArtifactCache
from fedtier.runtime.node_base import REJECTED
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker
from fedtier.wire import messages
from fedtier.wire.messages import ArtifactBlob, ArtifactRequest, CellStep, DeviceTask, DeviceUpdate


def make_node(prepared, broker: MemoryBroker, cell: str, directory: Path) -> DeviceNode:
    """The first device of ``cell``, its state, cache and bundles under ``directory`` (a restart
    builds another node on the same directory)."""
    device_id = prepared.cells[cell][0]
    x, y = prepared.data.train[device_id]
    node = DeviceNode(device_id=device_id, cell=cell, transport=broker.connect(device_id),
                      data=LocalData(x=x, y=y), trainer_provider=lambda b: make_trainer("ort", b),
                      state=DeviceState(directory / "agent.db"), cache=ArtifactCache(directory / "cache"),
                      bundles_dir=directory / "bundles")
    node.tx.set_handler(lambda inbound: node.handle(inbound, broker.now))
    return node


@pytest.fixture
def setup(small_rollout, tmp_path: Path):
    prepared = prepare(small_rollout())
    broker = MemoryBroker()
    received: list = []
    edge = broker.connect("edge", received.append)
    cell = next(iter(prepared.cells))
    edge.subscribe(topics.cell_up_filter(cell))
    node = make_node(prepared, broker, cell, tmp_path)
    return prepared, broker, edge, received, node, cell


def task_for(prepared, cell: str, round: int = 0) -> DeviceTask:
    cfg = prepared.algorithm_config().to_dict()
    return DeviceTask(rollout=prepared.config.rollout, round=round, sender=cell, params=prepared.initial_params,
                      config=cfg, members=prepared.cells[cell])


def uplinks(received: list, kind: type) -> list:
    out = []
    for inbound in received:
        msg = messages.decode_message(inbound.payload)
        if isinstance(msg, kind):
            out.append(msg)
    return out


def test_device_fetches_artifacts_then_runs_the_waiting_task(setup) -> None:
    prepared, broker, edge, received, node, cell = setup
    rollout = prepared.config.rollout
    node.start(0.0)
    # Prepare: the edge relays the manifest and broadcasts the task before the device has artifacts.
    edge.publish(topics.cell_manifest(rollout, cell), prepared.manifest.encode(), retain=True)
    edge.publish(topics.cell_down(rollout, cell, DeviceTask.KIND), task_for(prepared, cell).encode())
    broker.run_until_idle()
    [request] = uplinks(received, ArtifactRequest)
    assert set(request.digests) == set(prepared.manifest.artifact_digests.values())
    assert uplinks(received, DeviceUpdate) == []  # the task waits for the trainer
    # Execute: the edge serves the files.
    for entry in prepared.bundle.files.values():
        data = (prepared.bundle.directory / entry.filename).read_bytes()
        blob = ArtifactBlob(rollout=rollout, round=0, sender=cell, sha256=entry.sha256, name=entry.filename, data=data)
        edge.publish(topics.cell_down(rollout, cell, blob.KIND), blob.encode())
    broker.run_until_idle()
    # Assert: one update for round 0, with the model's layout, acknowledged (outbox empty).
    [update] = uplinks(received, DeviceUpdate)
    assert update.round == 0 and update.sender == node.device_id
    assert set(update.delta) == set(prepared.bundle.layout.names)
    assert any(np.abs(d).max() > 0 for d in update.delta.values())
    assert update.num_samples == len(node.data)
    assert node.state.pending() == [] and node.state.last_round(rollout) == 0
    assert node.state.last_sent(rollout) == (0, 0)


def test_a_tampered_artifact_is_rejected_and_not_cached(setup) -> None:
    prepared, broker, edge, received, node, cell = setup
    rollout = prepared.config.rollout
    node.start(0.0)
    edge.publish(topics.cell_manifest(rollout, cell), prepared.manifest.encode(), retain=True)
    entry = prepared.bundle.files["checkpoint"]
    data = bytearray((prepared.bundle.directory / entry.filename).read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob = ArtifactBlob(rollout=rollout, round=0, sender=cell, sha256=entry.sha256, name=entry.filename,
                        data=bytes(data))
    edge.publish(topics.cell_down(rollout, cell, blob.KIND), blob.encode())
    broker.run_until_idle()
    assert node.metrics.get(REJECTED, reason="sha_mismatch") == 1
    assert not node.cache.has(entry.sha256) and rollout not in node.trainers


def test_a_broadcast_file_the_device_does_not_need_is_dropped_before_its_body_is_read(setup) -> None:
    # In a cell of 1,000 devices starting over minutes the edge broadcasts each file many times: a device
    # that has it (or needs nothing) must not hash every copy. A corrupt copy proves the body was not read.
    prepared, broker, edge, received, node, cell = setup
    rollout = prepared.config.rollout
    node.start(0.0)

    def corrupt_blob(name: str) -> bytes:
        entry = prepared.bundle.files[name]
        data = bytearray((prepared.bundle.directory / entry.filename).read_bytes())
        data[0] ^= 0xFF
        return ArtifactBlob(rollout=rollout, round=0, sender=cell, sha256=entry.sha256, name=entry.filename,
                            data=bytes(data)).encode()

    edge.publish(topics.cell_down(rollout, cell, ArtifactBlob.KIND), corrupt_blob("checkpoint"))
    broker.run_until_idle()  # no manifest yet: nothing is wanted
    assert node.metrics.get(REJECTED, reason="sha_mismatch") == 0
    edge.publish(topics.cell_manifest(rollout, cell), prepared.manifest.encode(), retain=True)
    entry = prepared.bundle.files["checkpoint"]
    good = ArtifactBlob(rollout=rollout, round=0, sender=cell, sha256=entry.sha256, name=entry.filename,
                        data=(prepared.bundle.directory / entry.filename).read_bytes())
    edge.publish(topics.cell_down(rollout, cell, good.KIND), good.encode())
    broker.run_until_idle()
    assert node.cache.has(entry.sha256)
    edge.publish(topics.cell_down(rollout, cell, ArtifactBlob.KIND), corrupt_blob("checkpoint"))  # already cached
    broker.run_until_idle()
    assert node.metrics.get(REJECTED, reason="sha_mismatch") == 0
    needed = next(n for n in prepared.bundle.files if n != "checkpoint")
    edge.publish(topics.cell_down(rollout, cell, ArtifactBlob.KIND), corrupt_blob(needed))  # still wanted: checked
    broker.run_until_idle()
    assert node.metrics.get(REJECTED, reason="sha_mismatch") == 1


def test_unacknowledged_updates_are_resent_at_start(setup) -> None:
    prepared, broker, edge, received, node, cell = setup
    update = DeviceUpdate(rollout="t", round=4, sender=node.device_id,
                          delta={"w": np.zeros(2, np.float32)}, num_samples=3, train_loss=0.1, steps=1)
    topic = topics.cell_up("t", cell, node.device_id, update.KIND)
    node.state.put_update(update.key, topic, update.encode(), "t", 4, 0.0)
    node.start(0.0)
    broker.run_until_idle()
    assert [m.round for m in uplinks(received, DeviceUpdate)] == [4]
    assert node.state.pending() == []


def test_another_devices_catch_up_task_is_ignored(setup) -> None:
    prepared, broker, edge, received, node, cell = setup
    node.start(0.0)
    other = prepared.cells[cell][1]
    edge.publish(topics.cell_down(prepared.config.rollout, cell, DeviceTask.KIND, other),
                 task_for(prepared, cell).encode())
    broker.run_until_idle()
    assert node._pending_task == {} and node.metrics.total(REJECTED) == 0


def test_data_that_does_not_fit_the_model_keeps_the_device_out_without_crashing(setup, caplog) -> None:
    prepared, broker, edge, received, node, cell = setup
    rollout = prepared.config.rollout
    node.data = LocalData(x=node.data.x, y=node.data.y + 10)  # labels beyond the 10 classes
    node.cache = ArtifactCache(node.cache.directory)
    for entry in prepared.bundle.files.values():
        node.cache.put(entry.sha256, (prepared.bundle.directory / entry.filename).read_bytes())
    node.start(0.0)
    edge.publish(topics.cell_manifest(rollout, cell), prepared.manifest.encode(), retain=True)
    edge.publish(topics.cell_down(rollout, cell, DeviceTask.KIND), task_for(prepared, cell).encode())
    broker.run_until_idle()
    assert rollout not in node.trainers and uplinks(received, DeviceUpdate) == []
    assert "refused, not taking part" in caplog.text and "10 classes" in caplog.text


def test_a_device_restarted_mid_round_does_not_release_an_uploaded_step_again(small_rollout, tmp_path: Path) -> None:
    # Prepare: two edge rounds per round, devices add DP noise (untrusted edges), artifacts cached.
    prepared = prepare(small_rollout(algorithm="hier_qsgd", hier_qsgd={"edge_rounds": 2, "local_steps": 2},
                                     privacy={"epsilon": 6.0, "clip": 1.0, "require_tls": False}))
    rollout, cell = prepared.config.rollout, next(iter(prepared.cells))
    broker = MemoryBroker()
    received: list = []
    edge = broker.connect("edge", received.append)
    edge.subscribe(topics.cell_up_filter(cell))
    node = make_node(prepared, broker, cell, tmp_path)
    for entry in prepared.bundle.files.values():
        node.cache.put(entry.sha256, (prepared.bundle.directory / entry.filename).read_bytes())
    node.start(0.0)
    edge.publish(topics.cell_manifest(rollout, cell), prepared.manifest.encode(), retain=True)
    task = task_for(prepared, cell)
    edge.publish(topics.cell_down(rollout, cell, DeviceTask.KIND), task.encode())
    broker.run_until_idle()
    [first] = uplinks(received, DeviceUpdate)
    assert first.step == 0 and first.release is not None  # a noisy release, charged by the ledger
    # Execute: the agent dies and restarts on its state; the edge, not having the update yet,
    # resends the open task to it.
    node.tx.close()
    node.state.close()
    restarted = make_node(prepared, broker, cell, tmp_path)
    restarted.start(0.0)
    edge.publish(topics.cell_down(rollout, cell, DeviceTask.KIND, restarted.device_id), task.encode())
    broker.run_until_idle()
    # Assert: no second release of step 0: the same bytes again (the edge asked, so it lacks them), not a
    # second training; the device waits for the cell's average and goes on.
    sent = [inbound.payload for inbound in received if inbound.topic.endswith(DeviceUpdate.KIND)]
    assert len(sent) == 2 and sent[1] == sent[0]
    set_model = {n: p + first.delta[n] for n, p in prepared.initial_params.items()}
    step = CellStep(rollout=rollout, round=0, sender=cell, step=0, tensors_=first.delta, kind="delta",
                    model_sha=digest(set_model), reported=(restarted.device_id,))
    edge.publish(topics.cell_down(rollout, cell, CellStep.KIND), step.encode())
    broker.run_until_idle()
    assert [(u.round, u.step) for u in uplinks(received, DeviceUpdate)] == [(0, 0), (0, 0), (0, 1)]


def test_an_agent_started_in_another_cell_sends_its_outbox_there(small_rollout, tmp_path: Path) -> None:
    """A roaming device that moved: what it queued in its old cell goes to the uplink of the cell it is in now (the
    one its broker lets it publish on), and its kept copy with it."""
    prepared = prepare(small_rollout())
    rollout = prepared.config.rollout
    old, new = list(prepared.cells)[:2]
    device = prepared.cells[old][0]
    broker = MemoryBroker()
    heard: dict[str, list] = {old: [], new: []}
    for cell in (old, new):
        broker.connect(f"edge-{cell}", heard[cell].append).subscribe(topics.cell_up_filter(cell))
    state = DeviceState(tmp_path / "agent.db")
    update = DeviceUpdate(rollout=rollout, round=0, sender=device, step=3, delta=prepared.initial_params,
                          num_samples=4, train_loss=0.5, steps=1)
    state.put_update(update.key, topics.cell_up(rollout, old, device, update.KIND), update.encode(), rollout, 0, 0.0,
                     sent=(0, 3))
    state.close()
    x, y = prepared.data.train[device]
    node = DeviceNode(device_id=device, cell=new, transport=broker.connect(device), data=LocalData(x=x, y=y),
                      trainer_provider=lambda b: make_trainer("ort", b), state=DeviceState(tmp_path / "agent.db"),
                      cache=ArtifactCache(tmp_path / "cache"), bundles_dir=tmp_path / "bundles")
    node.start(0.0)
    broker.run_until_idle()
    assert heard[old] == [] and [u.key for u in uplinks(heard[new], DeviceUpdate)] == [update.key]
    assert heard[new][0].topic == topics.cell_up(rollout, new, device, update.KIND)
    assert node.state.pending() == [] and [t for _, t, _ in node.state.uploads(rollout, 0, 3)] == [heard[new][0].topic]
    node.state.close()

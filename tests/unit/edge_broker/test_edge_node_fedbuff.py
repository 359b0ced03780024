"""An asynchronous (FedBuff) edge over the in-memory transport: its store holds its newest checkpoint and the
inputs after it, not the rollout; a restart from it goes on where the edge was; what the cloud counted is forgotten,
never what a replay would make again."""

from __future__ import annotations

import math
import sqlite3
from contextlib import closing
from pathlib import Path

import numpy as np

from edge_helpers import memory_edge

from edge_broker.service import CHECKPOINT_SHARE, EdgeNode
from fedtier.algorithms import fedbuff
from fedtier.artifacts.cache import sha256_hex
from fedtier.privacy.plan import CellPlan, NoisePlan
from fedtier.security.manifest import Manifest
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker
from fedtier.wire import messages
from fedtier.wire.messages import CellTask, CellUpdate, DeviceUpdate

CELL, ROLLOUT = "cell-a", "r"
PARAMS = {"w": np.zeros((2, 2), np.float32)}
FILE = b"pretend this is an onnx model"
MANIFEST = Manifest(rollout=ROLLOUT, version=1, algorithm="fedbuff",
                    bundle={"files": {"training_model": {"filename": "t.onnx", "sha256": sha256_hex(FILE),
                                                         "size": len(FILE)}}},
                    cells=(CELL,), rounds=50, created=1.0)


class Rig:
    """One edge of ``members`` devices, the cloud and the devices as clients of one in-memory broker."""

    def __init__(self, tmp: Path, members: tuple[str, ...], **config: object) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp, self.db, self.members = tmp, tmp / "edge.db", members
        self.config = fedbuff.FedBuffConfig(local_steps=1, batch_size=4, lr=0.1, **config)  # type: ignore[arg-type]
        self.broker = MemoryBroker()
        self.at_cloud: list = []
        self.cloud = self.broker.connect("cloud", self.at_cloud.append)
        self.cloud.subscribe(topics.edge_up_filter())
        self.devices = self.broker.connect("devices")
        self.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)  # the rollout runs
        self.edge = self.start()
        self.steps: dict[str, int] = {}

    def start(self) -> EdgeNode:
        return memory_edge(self.broker, CELL, self.db, self.tmp / "cache")

    def restart(self) -> None:
        self.edge.store.close()
        self.edge.cell_tx.close()
        self.edge.cloud_tx.close()
        self.edge = self.start()

    def task(self, version: int, counted: int = 0) -> None:
        config = {**self.config.to_dict(), **({fedbuff.COUNTED: counted} if counted else {})}
        task = CellTask(rollout=ROLLOUT, round=version, sender="cloud", params=PARAMS, members=self.members,
                        config=config, model_version=version)
        self.cloud.publish(topics.cloud_down(ROLLOUT, CELL, task.KIND), task.encode())
        self.broker.run_until_idle()

    def upload(self, device: str, version: int, value: float) -> None:
        step = self.steps[device] = self.steps.get(device, -1) + 1
        upd = DeviceUpdate(rollout=ROLLOUT, round=version, sender=device, step=step,
                           delta={"w": np.full((2, 2), value, np.float32)}, num_samples=1, train_loss=0.0, steps=1)
        self.devices.publish(topics.cell_up(ROLLOUT, CELL, device, upd.KIND), upd.encode())
        self.broker.run_until_idle()

    def published(self) -> list[CellUpdate]:
        out = [messages.decode_message(i.payload) for i in self.at_cloud
               if i.topic == topics.edge_up(ROLLOUT, CELL, CellUpdate.KIND)]
        return [m for m in out if isinstance(m, CellUpdate)]

    def held(self) -> dict[str, int]:
        with closing(sqlite3.connect(self.db)) as con:
            return {"inputs": con.execute("SELECT COUNT(*) FROM inputs WHERE kind != 'cell_task'").fetchone()[0],
                    "outputs": con.execute("SELECT COUNT(*) FROM outputs").fetchone()[0],
                    "states": con.execute("SELECT COUNT(*) FROM strategy_states").fetchone()[0]}


def test_a_small_cell_checkpoints_at_every_cell_update_and_a_restart_goes_on_where_it_was(tmp_path: Path) -> None:
    # Prepare: 3 devices, k_edge 2; an uninterrupted edge beside it gives the reference.
    members = ("dev-0", "dev-1", "dev-2")
    rig, ref = Rig(tmp_path / "a", members, k_edge=2), Rig(tmp_path / "b", members, k_edge=2)
    plan = [("task", 0), ("dev-0", 0), ("dev-1", 0), ("dev-2", 0), ("task", 1), ("dev-0", 0), ("dev-1", 1)]
    for r in (rig, ref):
        for who, version in plan:
            r.task(version) if who == "task" else r.upload(who, version, float(len(r.published()) + 1))
    # Assert: one buffer's input after the newest checkpoint (taken with the second cell update), not six
    assert rig.held() == {"inputs": 1, "outputs": 2, "states": 1}
    # Execute: restart; the edge goes on as the uninterrupted one does
    rig.restart()
    assert len(rig.published()) == 2  # the restart published nothing: its replay made no cell update again
    for r in (rig, ref):
        r.upload("dev-0", 1, 9.0)
    assert [(u.round, u.reported, u.delta["w"].tolist()) for u in rig.published()] == \
        [(u.round, u.reported, u.delta["w"].tolist()) for u in ref.published()]
    # the cloud counted updates 0 and 1: forgotten; update 2 is kept until it says so
    assert len(rig.published()) == 3 and rig.held()["outputs"] == 3
    rig.task(2, counted=2)
    assert rig.held()["outputs"] == 1


def test_a_large_cell_checkpoints_every_sixteenth_of_its_devices_and_keeps_what_a_replay_makes_again(
        tmp_path: Path) -> None:
    # Prepare: 64 devices (a checkpoint every 4 inputs), k_edge 1, a trusted cell: its updates are noised
    members = tuple(f"dev-{i:02d}" for i in range(64))
    plan = NoisePlan(mode="rdp", epsilon=4.0, delta=1e-5, budget_epsilon=math.inf, clip=10.0, edge_rounds=1,
                     rounds=50, require_tls=False, cells={CELL: CellPlan(True, len(members), 0.0, 1.0)})
    rig = Rig(tmp_path, members, k_edge=1, privacy=plan.to_dict())
    rig.task(0)
    for i in range(6):
        rig.upload(members[i], 0, 1.0)
    every = len(members) // CHECKPOINT_SHARE
    assert every == 4 and rig.held() == {"inputs": 2, "outputs": 6, "states": 1}  # checkpoint with update 3
    # Execute: the cloud counted all six; the edge may forget only those its checkpoint holds (0 to 3)
    rig.task(1, counted=6)
    assert rig.held()["outputs"] == 2
    first = [m.delta["w"].tolist() for m in rig.published()]
    rig.restart()
    # Assert: the replay of updates 4 and 5 publishes their stored bytes again, never a second noisy release
    again = rig.published()[6:]
    assert [m.round for m in again] == [4, 5] and [m.delta["w"].tolist() for m in again] == first[4:]

"""An HSGD cell in the edge node (in-memory transport): embeddings relayed between the host and the devices on
their own topics, the cell update equal to the in-process run, bad embeddings refused by reason and counted,
and a restarted edge finishing the round from its store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from test_edge_node import CELL, ROLLOUT, Rig, decoded

from local_fleet import hsgd_loop
from local_fleet import hsgd_reference as ref
from fedtier.algorithms import hsgd
from fedtier.algorithms.base import SendToParent
from fedtier.runtime.node_base import ACCEPTED, REJECTED
from fedtier.training import split
from fedtier.transport import topics
from fedtier.wire import messages
from fedtier.wire.messages import CellTask, CellUpdate, Embeddings

ARCH = split.SplitArch(x1=12, x2=8, d1=8, d2=8, classes=3)
HOST = "host-a"


def cell() -> hsgd_loop.HybridCell:
    (g,), _ = ref.fixture(2, sizes=(10,))
    return hsgd_loop.HybridCell(host=HOST, devices=tuple(f"dev-{n}" for n in range(10)), x1=g[0], x2=g[1], y=g[2])


CONFIG = hsgd.HsgdConfig(global_interval=4, local_interval=2, alpha=0.3, lr=0.05, seed=3, hosts={CELL: HOST})


class Nodes:
    """The cell's host and devices as roles with numpy trainers, reading what the rig's devices connection got."""

    def __init__(self, rig: Rig, data: hsgd_loop.HybridCell, *, corrupt: str | None = None) -> None:
        self.rig, self.seen, self.corrupt = rig, 0, corrupt
        self.roles: dict[str, Any] = {HOST: hsgd.Host(host_id=HOST, cell=CELL, rollout=ROLLOUT)}
        self.trainers = {HOST: split.SplitTrainer(dict(zip(data.devices, data.x1, strict=True)),
                                                  dict(zip(data.devices, data.y.tolist(), strict=True)))}
        for n, d in enumerate(data.devices):
            self.roles[d] = hsgd.Device(device_id=d, cell=CELL, rollout=ROLLOUT)
            self.trainers[d] = split.SplitTrainer({d: data.x2[n]}, {d: int(data.y[n])})

    def pump(self, until: Any = None) -> None:
        while self.seen < len(self.rig.at_cell) and not (until is not None and until()):
            inbound = self.rig.at_cell[self.seen]
            self.seen += 1
            if not inbound.payload.startswith(b"FTEN"):
                continue
            parts = inbound.topic.split("/")  # ft/v1/r/cell/{cell}/down/{kind}[/{node}]
            targets = [parts[7]] if len(parts) > 7 else [n for n in self.roles if n != HOST]
            for node in targets:
                self.execute(node, self.roles[node].receive(messages.decode_message(inbound.payload), 0.0))
            self.rig.broker.run_until_idle()

    def execute(self, node: str, actions: list[Any]) -> None:
        role, trainer = self.roles[node], self.trainers[node]
        for action in actions:
            if isinstance(action, hsgd.Embed):
                self.execute(node, role.embedded(action.round, action.step,
                                                 trainer.embed(action.block, action.params, action.rows)))
            elif isinstance(action, hsgd.SplitTrain):
                params, loss = trainer.train(action.side, action.params, action.frozen, action.partner, action.rows,
                                             action.steps, action.lr)
                self.execute(node, role.split_trained(action.round, action.step, params, loss))
            elif isinstance(action, SendToParent):
                msg = action.message
                if node == self.corrupt and isinstance(msg, Embeddings):
                    bad = Embeddings(rollout=ROLLOUT, round=msg.round, sender=node, step=msg.step,
                                     zeta=np.ones((1, ARCH.d2 + 2), np.float32), rows=msg.rows)
                    self.rig.devices.publish(topics.cell_up(ROLLOUT, CELL, node, msg.KIND), bad.encode())
                    self.corrupt = None
                self.rig.devices.publish(topics.cell_up(ROLLOUT, CELL, node, msg.KIND), msg.encode(action.encodings))


def start(rig: Rig, init: dict[str, np.ndarray], data: hsgd_loop.HybridCell) -> None:
    task = CellTask(rollout=ROLLOUT, round=0, sender="cloud", params=init, members=(*data.devices, HOST),
                    config=CONFIG.to_dict())
    rig.cloud.publish(topics.cloud_down(ROLLOUT, CELL, task.KIND), task.encode())
    rig.broker.run_until_idle()


def expected(init: dict[str, np.ndarray], data: hsgd_loop.HybridCell) -> dict[str, np.ndarray]:
    return hsgd_loop.run({CELL: data}, init, CONFIG, rounds=1, rollout=ROLLOUT).params


def test_an_hsgd_round_through_the_edge_node_equals_the_in_process_run(tmp_path: Path) -> None:
    rig, data, init = Rig(tmp_path), cell(), split.init_params(ARCH, 3)
    nodes = Nodes(rig, data, corrupt=hsgd.select(data.devices, CONFIG.alpha, CONFIG.seed, ROLLOUT, CELL, 0, 0)[0])
    start(rig, init, data)
    for _ in range(50):
        nodes.pump()
    [update] = [m for _, m in decoded(rig.at_cloud) if isinstance(m, CellUpdate)]
    assert update.weight == 10.0 and HOST in update.reported
    got = {k: init[k] + update.delta[k] for k in init}
    want = expected(init, data)
    assert max(float(np.abs(got[k] - want[k]).max()) for k in init) < 1e-6
    assert rig.edge.metrics.get(REJECTED, reason="embedding_width") == 1
    assert rig.edge.metrics.get(ACCEPTED, kind="hsgd_embeddings") == 2 * (3 + 1)  # 2 intervals: 3 devices, host
    relays = {t for t, m in decoded(rig.at_cell) if m.KIND == "hsgd_partner"}
    assert topics.cell_down(ROLLOUT, CELL, "hsgd_partner", HOST) in relays


def test_a_restarted_edge_finishes_the_round_from_its_store(tmp_path: Path) -> None:
    store = tmp_path / "edge.db"
    rig, data, init = Rig(tmp_path, store), cell(), split.init_params(ARCH, 3)
    nodes = Nodes(rig, data)
    start(rig, init, data)
    nodes.pump(until=lambda: len(rig.edge.roles[ROLLOUT].history) == 1)  # interval 0 closed, 1 opened
    assert not [m for _, m in decoded(rig.at_cloud) if isinstance(m, CellUpdate)]
    rig.edge.store.close()
    rig.edge.cell_tx.close()
    rig.edge.cloud_tx.close()
    rig.edge = rig.new_edge(tmp_path, store)  # "restart": its stored round waits for the rollout's next message
    assert ROLLOUT not in rig.edge.roles
    for _ in range(50):
        nodes.pump()
    [update] = [m for _, m in decoded(rig.at_cloud) if isinstance(m, CellUpdate)]
    assert rig.edge.roles[ROLLOUT].round == 0 and len(rig.edge.roles[ROLLOUT].history) == 2
    got = {k: init[k] + update.delta[k] for k in init}
    want = expected(init, data)
    assert max(float(np.abs(got[k] - want[k]).max()) for k in init) < 1e-6

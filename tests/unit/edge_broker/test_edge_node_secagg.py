"""The edge node with secure aggregation: a restart mid-round replays what still applies, never crashes,
and the next round runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_helpers import memory_edge

from edge_broker.service import EdgeNode
from fedtier.algorithms.base import LocalResult, LocalTrain, SendToParent
from fedtier.algorithms.secure_fedavg import Device, SecureFedAvgConfig
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker
from fedtier.wire import messages
from fedtier.wire.messages import CellTask, CellUpdate

CELL, ROLLOUT = "cell-a", "r"
MEMBERS = ("dev-0", "dev-1", "dev-2")
PARAMS = {"w": np.zeros((2, 2), np.float32)}
CONFIG = SecureFedAvgConfig(secagg_min_survivors=2, deadline_s=5.0, local_steps=1)


class Rig:
    """An edge node over the memory broker, with real secure_fedavg device roles answering on the cell."""

    def __init__(self, tmp: Path, db: Path, config: SecureFedAvgConfig = CONFIG) -> None:
        self.tmp, self.db, self.config = tmp, db, config
        self.broker = MemoryBroker()
        self.at_cloud: list = []
        self.cloud = self.broker.connect("cloud", self.at_cloud.append)
        self.cloud.subscribe(topics.edge_up_filter())
        self.silent: set[str] = set()
        self.roles = {d: Device(device_id=d, cell=CELL, rollout=ROLLOUT) for d in MEMBERS}
        self.devices = self.broker.connect("devices", self.on_cell)
        self.devices.subscribe(topics.cell_down_filter(CELL))
        self.edge = self.new_edge()

    def new_edge(self) -> EdgeNode:
        return memory_edge(self.broker, CELL, self.db, self.tmp / "cache")

    def on_cell(self, inbound) -> None:
        parsed = topics.parse(inbound.topic)
        if parsed is None or not inbound.payload.startswith(b"FTEN"):
            return
        msg = messages.decode_message(inbound.payload)
        for d in ([parsed.device] if parsed.device else MEMBERS):
            if d in self.silent:
                continue
            try:
                actions = self.roles[d].receive(msg, self.broker.now)
            except Exception:  # a device's reject (e.g. a phase it has left): counted by its shell
                continue
            while actions:
                a = actions.pop(0)
                if isinstance(a, LocalTrain):
                    delta = {"w": np.full((2, 2), float(MEMBERS.index(d) + 1), np.float32)}
                    actions += self.roles[d].trained(a.round, LocalResult(delta=delta, num_samples=1,
                                                                          mean_loss=0.0, steps=1))
                elif isinstance(a, SendToParent):
                    self.devices.publish(topics.cell_up(ROLLOUT, CELL, d, a.message.KIND), a.message.encode())

    def task(self, r: int) -> None:
        task = CellTask(rollout=ROLLOUT, round=r, sender="cloud", params=PARAMS, members=MEMBERS,
                        config=self.config.to_dict())
        self.cloud.publish(topics.cloud_down(ROLLOUT, CELL, task.KIND), task.encode())
        self.broker.run_until_idle()

    def tick(self, dt: float) -> None:
        self.broker.now += dt
        self.edge.tick(self.broker.now)
        self.broker.run_until_idle()

    def updates(self) -> list[CellUpdate]:
        return [m for m in (messages.decode_message(i.payload) for i in self.at_cloud if i.payload.startswith(b"FTEN"))
                if isinstance(m, CellUpdate)]


def test_a_full_round_through_the_edge_node(tmp_path: Path) -> None:
    rig = Rig(tmp_path, tmp_path / "edge.db")
    rig.task(0)
    [update] = rig.updates()
    assert update.reported == MEMBERS
    np.testing.assert_allclose(update.delta["w"], np.full((2, 2), 2.0), atol=1e-6)


def test_a_restart_mid_round_does_not_crash_and_the_next_round_runs(tmp_path: Path) -> None:
    rig = Rig(tmp_path, tmp_path / "edge.db")
    rig.silent = {"dev-2"}
    rig.task(0)   # dev-0 and dev-1 advertise keys; dev-2 is silent
    rig.tick(6.0)  # the keys phase closes at its deadline; shares, masked inputs... flow
    assert [u.reported for u in rig.updates()] == [("dev-0", "dev-1")]
    # Restart: the stored inputs are replayed; the keys phase is open again (deadlines are not stored), so
    # the later phases' inputs no longer apply: skipped, not a crash.
    rig.edge.store.close()
    rig.edge.cell_tx.close()
    rig.edge.cloud_tx.close()
    rig.at_cloud.clear()
    rig.edge = rig.new_edge()
    rig.silent = set()
    rig.task(1)  # wakes the rollout (replay), then round 1 runs with everyone
    [update] = rig.updates()
    assert update.round == 1 and update.reported == MEMBERS


def test_an_abort_is_counted_by_reason_and_only_the_abort_goes_up(tmp_path: Path) -> None:
    from edge_broker.service import SECAGG_ABORTS, SECAGG_WAITED
    from fedtier.secagg.messages import SecAggAborted

    rig = Rig(tmp_path, tmp_path / "edge.db", SecureFedAvgConfig(secagg_min_survivors=3, deadline_s=5.0,
                                                                local_steps=1))
    rig.silent = {"dev-2"}
    rig.task(0)
    rig.tick(2.9)
    assert rig.at_cloud == []  # the keys phase has 0.6 x 5 s
    rig.tick(0.1)
    assert rig.updates() == []
    [report] = [messages.decode_message(i.payload) for i in rig.at_cloud]
    assert isinstance(report, SecAggAborted) and (report.phase, report.reason) == ("keys", "too_few_keys")
    assert report.waited == {"keys": ("dev-2",)}
    assert rig.edge.metrics.get(SECAGG_ABORTS, reason="too_few_keys") == 1
    assert rig.edge.metrics.get(SECAGG_WAITED, phase="keys") == 1
    rig.at_cloud.clear()
    rig.task(0)  # the cloud asks again (its copy was lost): the stored report, the same bytes
    assert [messages.decode_message(i.payload).key for i in rig.at_cloud] == [report.key]


def test_a_phase_closes_at_its_own_deadline_and_the_update_says_whom_it_waited_for(tmp_path: Path) -> None:
    from edge_broker.service import SECAGG_WAITED

    rig = Rig(tmp_path, tmp_path / "edge.db")
    rig.silent = {"dev-2"}
    rig.task(0)
    rig.tick(2.9)
    assert rig.updates() == []
    rig.tick(0.1)  # 3 s = 0.6 x deadline_s: the keys phase closes with dev-0 and dev-1 (s_min 2)
    [update] = rig.updates()
    assert update.reported == ("dev-0", "dev-1") and update.stats["secagg_waited"] == {"keys": ["dev-2"]}
    assert rig.edge.metrics.get(SECAGG_WAITED, phase="keys") == 1


def test_bad_secagg_messages_are_rejected_and_counted_by_reason(tmp_path: Path) -> None:
    from fedtier.runtime.node_base import REJECTED
    from fedtier.secagg.messages import SecAggKeys, SecAggMasked

    rig = Rig(tmp_path, tmp_path / "edge.db")
    rig.silent = set(MEMBERS)  # nobody answers: the round stays in its keys phase
    rig.task(0)

    def send(device: str, msg: object, payload: bytes | None = None) -> None:
        rig.devices.publish(topics.cell_up(ROLLOUT, CELL, device, msg.KIND), payload or msg.encode())
        rig.broker.run_until_idle()

    short = SecAggKeys(rollout=ROLLOUT, round=0, sender="dev-0", c_pk=b"k" * 31, s_pk=b"s" * 32, b_commit=b"h" * 32)
    send("dev-0", short)  # a public key of 31 bytes
    masked = SecAggMasked(rollout=ROLLOUT, round=0, sender="dev-1", masked=np.zeros(4, np.uint64), width=6)
    send("dev-1", masked)  # the masked phase has not started
    late = SecAggKeys(rollout=ROLLOUT, round=5, sender="dev-2", c_pk=b"k" * 32, s_pk=b"s" * 32, b_commit=b"h" * 32)
    send("dev-2", late)  # a round the cell is not in
    stranger = SecAggKeys(rollout=ROLLOUT, round=0, sender="dev-9", c_pk=b"k" * 32, s_pk=b"s" * 32,
                          b_commit=b"h" * 32)
    send("dev-9", stranger)  # not a member
    send("dev-0", short, short.encode()[:-3])  # truncated bytes
    m = rig.edge.metrics
    assert m.get(REJECTED, reason="malformed_share") == 1
    assert m.get(REJECTED, reason="wrong_phase") == 1
    assert m.get(REJECTED, reason="wrong_round") == 1
    assert m.get(REJECTED, reason="unknown_sender") == 1
    assert m.total(REJECTED) == 5
    assert rig.edge.roles[ROLLOUT].session.answered() == ()  # nothing was taken in

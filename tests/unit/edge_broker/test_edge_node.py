"""The edge node over the in-memory transport: relaying, artifacts, presence, replay after restart."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from edge_helpers import memory_edge

from edge_broker.service import TRAINING_FAILED, EdgeNode
from fedtier.algorithms.fedavg import FedAvgConfig
from fedtier.artifacts.cache import sha256_hex
from fedtier.privacy.mechanism import NoiseSource
from fedtier.privacy.plan import CellPlan, NoisePlan
from fedtier.runtime.node_base import ACCEPTED, REJECTED
from fedtier.security.manifest import Manifest
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker
from fedtier.wire import messages
from fedtier.wire.messages import (ArtifactBlob, ArtifactRequest, CellPresence, CellTask, CellUpdate, DeviceTask,
                                   DeviceUpdate, TrainingFailed)

CELL, ROLLOUT = "cell-a", "r"
MEMBERS = ("dev-0", "dev-1", "dev-2")
PARAMS = {"w": np.zeros((2, 2), np.float32)}
FILE = b"pretend this is an onnx model"
SHA = sha256_hex(FILE)
MANIFEST = Manifest(rollout=ROLLOUT, version=1, algorithm="fedavg",
                    bundle={"files": {"training_model": {"filename": "t.onnx", "sha256": SHA, "size": len(FILE)}}},
                    cells=(CELL,), rounds=2, created=1.0)


class Rig:
    def __init__(self, tmp: Path, store_path: Path | None = None) -> None:
        self.broker = MemoryBroker()
        self.at_cloud: list = []
        self.at_cell: list = []
        self.cloud = self.broker.connect("cloud", self.at_cloud.append)
        self.cloud.subscribe(topics.edge_up_filter())
        self.devices = self.broker.connect("devices", self.at_cell.append)
        self.devices.subscribe(topics.cell_down_filter(CELL))
        self.edge = self.new_edge(tmp, store_path)

    def new_edge(self, tmp: Path, store_path: Path | None) -> EdgeNode:
        return memory_edge(self.broker, CELL, store_path or ":memory:", tmp / "cache")

    def task(self, config: FedAvgConfig | None = None) -> None:
        task = CellTask(rollout=ROLLOUT, round=0, sender="cloud", params=PARAMS, members=MEMBERS,
                        config=(config or FedAvgConfig()).to_dict())
        self.cloud.publish(topics.cloud_down(ROLLOUT, CELL, task.KIND), task.encode())
        self.broker.run_until_idle()

    def update(self, device: str, value: float) -> None:
        upd = DeviceUpdate(rollout=ROLLOUT, round=0, sender=device, delta={"w": np.full((2, 2), value, np.float32)},
                           num_samples=1, train_loss=0.0, steps=1)
        self.devices.publish(topics.cell_up(ROLLOUT, CELL, device, upd.KIND), upd.encode())
        self.broker.run_until_idle()


def decoded(received: list) -> list:
    return [(i.topic, messages.decode_message(i.payload)) for i in received if i.payload.startswith(b"FTEN")]


def test_manifest_is_relayed_to_the_cell_and_its_artifacts_prefetched(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.broker.run_until_idle()
    relayed = [i for i in rig.at_cell if i.topic == topics.cell_manifest(ROLLOUT, CELL)]
    assert [Manifest.decode(i.payload).version for i in relayed] == [1]
    [(_, request)] = decoded(rig.at_cloud)
    assert isinstance(request, ArtifactRequest) and request.digests == (SHA,)


def test_artifact_requests_are_served_from_the_cache_or_forwarded(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.broker.run_until_idle()
    rig.at_cell.clear()
    blob = ArtifactBlob(rollout=ROLLOUT, round=0, sender="cloud", sha256=SHA, name="t.onnx", data=FILE)
    rig.cloud.publish(topics.cloud_down(ROLLOUT, CELL, blob.KIND), blob.encode())
    rig.broker.run_until_idle()
    assert rig.edge.cache.get(SHA) == FILE
    rig.at_cell.clear()
    req = ArtifactRequest(rollout=ROLLOUT, round=0, sender="dev-1", digests=(SHA,))
    rig.devices.publish(topics.cell_up(ROLLOUT, CELL, "dev-1", req.KIND), req.encode())
    rig.broker.run_until_idle()
    served = [m for _, m in decoded(rig.at_cell) if isinstance(m, ArtifactBlob)]
    assert [b.data for b in served] == [FILE]
    # A digest the manifest does not list is refused.
    bad = ArtifactRequest(rollout=ROLLOUT, round=0, sender="dev-1", digests=("0" * 64,))
    rig.devices.publish(topics.cell_up(ROLLOUT, CELL, "dev-1", bad.KIND), bad.encode())
    rig.broker.run_until_idle()
    assert rig.edge.metrics.get(REJECTED, reason="unexpected_message") == 1


def test_a_file_goes_to_each_device_that_asks_on_its_own_topic_once_per_window(tmp_path: Path) -> None:
    # A broadcast would reach every device of the cell each time one of them asked (a thousand devices
    # starting over minutes: a thousand copies each); a device gets the file on its own topic, once per
    # window however often it asks, and another device's subscriptions never see it.
    from edge_broker.service import ARTIFACT_RESERVE_S

    rig = Rig(tmp_path)
    bystander: list = []
    other = rig.broker.connect("dev-9", bystander.append)
    for topic_filter in topics.device_down_filters(CELL, "dev-9"):
        other.subscribe(topic_filter)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.broker.run_until_idle()
    blob = ArtifactBlob(rollout=ROLLOUT, round=0, sender="cloud", sha256=SHA, name="t.onnx", data=FILE)
    rig.cloud.publish(topics.cloud_down(ROLLOUT, CELL, blob.KIND), blob.encode())
    rig.broker.run_until_idle()

    def ask(device: str) -> None:
        req = ArtifactRequest(rollout=ROLLOUT, round=0, sender=device, digests=(SHA,))
        rig.devices.publish(topics.cell_up(ROLLOUT, CELL, device, req.KIND), req.encode())
        rig.broker.run_until_idle()

    def sent() -> list[str]:
        return [topic for topic, m in decoded(rig.at_cell) if isinstance(m, ArtifactBlob) and m.data == FILE]

    rig.at_cell.clear()
    for device in ("dev-0", "dev-1", "dev-1", "dev-2"):
        ask(device)
    assert sent() == [topics.cell_down(ROLLOUT, CELL, ArtifactBlob.KIND, d) for d in ("dev-0", "dev-1", "dev-2")]
    rig.broker.now += ARTIFACT_RESERVE_S  # the window is over: a device that asks again is sent it again
    ask("dev-1")
    assert sent()[-1] == topics.cell_down(ROLLOUT, CELL, ArtifactBlob.KIND, "dev-1") and len(sent()) == 4
    assert not [m for _, m in decoded(bystander) if isinstance(m, ArtifactBlob)]


def online(device: str, since: float, cell: str = CELL, state: str = "online") -> tuple[str, bytes]:
    """A device's retained presence on its cell's topic."""
    return topics.cell_status(cell, device), json.dumps({"state": state, "since": since, "node": device}).encode()


def test_a_member_coming_online_gets_the_open_task_on_its_own_topic(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.task()
    rig.at_cell.clear()
    rig.devices.publish(*online("dev-2", 5.0), retain=True)
    rig.broker.run_until_idle()
    [(topic, task)] = decoded(rig.at_cell)
    assert topic == topics.cell_down(ROLLOUT, CELL, DeviceTask.KIND, "dev-2") and task.round == 0
    # The same online event seen again (a retained redelivery) does not resend.
    rig.devices.publish(*online("dev-2", 5.0), retain=True)
    rig.broker.run_until_idle()
    assert len(decoded(rig.at_cell)) == 1


def test_a_restarted_edge_replays_its_accepted_inputs(tmp_path: Path) -> None:
    db = tmp_path / "edge.db"
    rig = Rig(tmp_path, db)
    rig.task()
    rig.update("dev-0", 1.0)
    rig.update("dev-1", 2.0)
    rig.edge.store.close()
    rig.edge.cell_tx.close()
    rig.edge.cloud_tx.close()
    # "Restart": a new edge node over the same database. Its state waits for a sign that the
    # rollout still runs (here: the next update of the open round), then is replayed.
    rig.edge = rig.new_edge(tmp_path, db)
    assert ROLLOUT not in rig.edge.roles
    rig.update("dev-2", 6.0)
    assert rig.edge.roles[ROLLOUT].round == 0
    [(_, cell_update)] = [(t, m) for t, m in decoded(rig.at_cloud) if isinstance(m, CellUpdate)]
    assert cell_update.reported == MEMBERS
    np.testing.assert_allclose(cell_update.delta["w"], np.full((2, 2), 3.0), rtol=0, atol=1e-7)


def test_a_trusted_edge_restarted_after_forwarding_republishes_the_same_noisy_aggregate(tmp_path: Path) -> None:
    # Prepare: a trusted cell, whose edge noises the aggregate it forwards to the (untrusted) cloud.
    plan = NoisePlan(mode="rdp", epsilon=1.0, delta=1e-5, budget_epsilon=math.inf, clip=10.0, edge_rounds=1,
                     rounds=2, require_tls=False, cells={CELL: CellPlan(True, len(MEMBERS), 0.0, 2.0)})
    db = tmp_path / "edge.db"
    rig = Rig(tmp_path, db)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)  # the rollout runs
    rig.task(FedAvgConfig(privacy=plan.to_dict()))
    for i, device in enumerate(MEMBERS):
        rig.update(device, float(i))
    [first] = [i.payload for i in rig.at_cloud if i.topic == topics.edge_up(ROLLOUT, CELL, CellUpdate.KIND)]
    assert messages.decode_message(first).privacy is not None  # noised, with its release record
    # Execute: the edge dies before the next task and restarts; its replay closes the cell again.
    rig.edge.store.close()
    rig.edge.cell_tx.close()
    rig.edge.cloud_tx.close()
    rig.edge = rig.new_edge(tmp_path, db)
    # Assert: whatever was published again is the very same bytes: one release, never two.
    published = [i.payload for i in rig.at_cloud if i.topic == topics.edge_up(ROLLOUT, CELL, CellUpdate.KIND)]
    assert len(published) == 2 and set(published) == {first}


def test_foreign_topics_and_other_rollouts_are_rejected(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.task()
    upd = DeviceUpdate(rollout="other", round=0, sender="dev-0", delta=PARAMS, num_samples=1, train_loss=0.0,
                       steps=1)
    rig.devices.publish(topics.cell_up(ROLLOUT, CELL, "dev-0", upd.KIND), upd.encode())
    rig.broker.run_until_idle()
    assert rig.edge.metrics.get(REJECTED, reason="unexpected_message") == 1


def test_a_prefetched_artifact_is_relayed_only_when_a_device_waits_for_it(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.broker.run_until_idle()
    # Two devices ask before the edge has the file: the edge asks the cloud and remembers both.
    for device in ("dev-1", "dev-0"):
        req = ArtifactRequest(rollout=ROLLOUT, round=0, sender=device, digests=(SHA,))
        rig.devices.publish(topics.cell_up(ROLLOUT, CELL, device, req.KIND), req.encode())
    rig.broker.run_until_idle()
    assert [m for _, m in decoded(rig.at_cell) if isinstance(m, ArtifactBlob)] == []
    blob = ArtifactBlob(rollout=ROLLOUT, round=0, sender="cloud", sha256=SHA, name="t.onnx", data=FILE)
    rig.cloud.publish(topics.cloud_down(ROLLOUT, CELL, blob.KIND), blob.encode())
    rig.broker.run_until_idle()
    sent = [(t, m.data) for t, m in decoded(rig.at_cell) if isinstance(m, ArtifactBlob)]
    assert sent == [(topics.cell_down(ROLLOUT, CELL, ArtifactBlob.KIND, d), FILE) for d in ("dev-0", "dev-1")]
    # The same file arriving again (nobody waiting) is cached, not sent again.
    rig.cloud.publish(topics.cloud_down(ROLLOUT, CELL, blob.KIND), blob.encode())
    rig.broker.run_until_idle()
    assert len([m for _, m in decoded(rig.at_cell) if isinstance(m, ArtifactBlob)]) == 2


def test_an_ended_rollout_is_cleared_in_the_cell_and_never_replayed(tmp_path: Path) -> None:
    # Prepare: a round in progress, the cell's manifest relayed (retained).
    db = tmp_path / "edge.db"
    rig = Rig(tmp_path, db)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.task()
    for device in MEMBERS:
        rig.update(device, 1.0)
    assert any(i.topic == topics.cell_manifest(ROLLOUT, CELL) for i in rig.at_cell)
    # Execute: the coordinator clears its retained manifest (the rollout ended).
    rig.cloud.publish(topics.manifest(ROLLOUT), b"", retain=True)
    rig.broker.run_until_idle()
    # Assert: the cell's copy is cleared (a late device finds no manifest), the state is gone ...
    late: list = []
    rig.broker.connect("late", late.append).subscribe(topics.cell_down_filter(CELL))
    rig.broker.run_until_idle()
    assert late == [] and ROLLOUT not in rig.edge.roles
    assert rig.edge.store.inputs() == [] and rig.edge.store.manifests() == {}
    # ... and a restarted edge sends nothing of it to the cloud again.
    sent = len(rig.at_cloud)
    rig.edge.store.close()
    rig.edge.cell_tx.close()
    rig.edge.cloud_tx.close()
    rig.edge = rig.new_edge(tmp_path, db)
    assert len(rig.at_cloud) == sent and rig.edge.roles == {}


def test_a_restarted_edge_does_not_replay_a_rollout_that_ended_while_it_was_down(tmp_path: Path) -> None:
    db = tmp_path / "edge.db"
    rig = Rig(tmp_path, db)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.task()
    for device in MEMBERS:
        rig.update(device, 1.0)
    sent = len(rig.at_cloud)
    rig.edge.store.close()
    rig.edge.cell_tx.close()
    rig.edge.cloud_tx.close()
    rig.cloud.publish(topics.manifest(ROLLOUT), b"", retain=True)  # the rollout ends while the edge is down
    rig.broker.run_until_idle()
    rig.edge = rig.new_edge(tmp_path, db)
    assert len(rig.at_cloud) == sent and rig.edge.roles == {}


def test_a_round_past_its_deadline_names_the_devices_it_waits_for_again_at_intervals(tmp_path: Path, caplog) -> None:
    rig = Rig(tmp_path)
    rig.edge.overdue_interval_s = 30.0
    rig.task(FedAvgConfig(deadline_s=10.0))
    rig.update("dev-0", 1.0)
    with caplog.at_level("WARNING", logger="fedtier.edge"):
        for now in (5.0, 11.0, 20.0, 42.0):
            rig.edge.tick(rig.broker.now + now)
    lines = [r.getMessage() for r in caplog.records if "past its deadline" in r.getMessage()]
    assert len(lines) == 2  # at 11 s, then again 30 s later
    assert all("dev-1, dev-2" in line and "dev-0" not in line for line in lines)


SEED = 1  # its sample of the three members is proper and non-empty


def test_a_sampling_trusted_edge_shows_the_cloud_no_participation(tmp_path: Path) -> None:
    """Device sampling: the edge's secret sample (whatever it is) reaches the devices; the cloud gets every
    member, the cell's size and zero byte counts (fedtier.privacy.disclosure.SAMPLED)."""
    plan = NoisePlan(mode="rdp", epsilon=1.0, delta=1e-5, budget_epsilon=math.inf, clip=10.0, edge_rounds=1,
                     rounds=2, require_tls=False, cells={CELL: CellPlan(True, len(MEMBERS), 0.0, 2.0)},
                     sampling="poisson", sample_rate=0.5)
    rig = Rig(tmp_path)
    rig.edge.noise = NoiseSource(seed=SEED)  # reproducible test; a real edge's seed is secret
    rig.task(FedAvgConfig(privacy=plan.to_dict()))
    [task] = [m for _, m in decoded(rig.at_cell) if isinstance(m, DeviceTask)]
    sampled = task.members
    assert set(sampled) < set(MEMBERS) and sampled  # a proper, non-empty sample with this seed
    for device in sampled:
        rig.update(device, 1.0)
    [cell_update] = [m for _, m in decoded(rig.at_cloud) if isinstance(m, CellUpdate)]
    assert cell_update.reported == MEMBERS and cell_update.weight == len(MEMBERS)
    assert {k: cell_update.stats[k] for k in ("device_up_bytes", "device_up_f32_bytes", "device_down_bytes")} == \
        {"device_up_bytes": 0, "device_up_f32_bytes": 0, "device_down_bytes": 0}
    [record] = cell_update.privacy["releases"]
    assert record["sigma"] == plan.edge_sigma(CELL) and record["inputs"]["sample_rate"] == 0.5


def _round(rig: Rig, round_: int, values: dict[str, float]) -> None:
    task = CellTask(rollout=ROLLOUT, round=round_, sender="cloud", params=PARAMS, members=MEMBERS,
                    config=FedAvgConfig(strategy={"edge_optimizer": {"kind": "momentum", "lr": 1.0,
                                                                     "momentum": 0.5}}).to_dict())
    rig.cloud.publish(topics.cloud_down(ROLLOUT, CELL, task.KIND), task.encode())
    rig.broker.run_until_idle()
    for device, value in values.items():
        upd = DeviceUpdate(rollout=ROLLOUT, round=round_, sender=device,
                           delta={"w": np.full((2, 2), value, np.float32)}, num_samples=1, train_loss=0.0, steps=1)
        rig.devices.publish(topics.cell_up(ROLLOUT, CELL, device, upd.KIND), upd.encode())
        rig.broker.run_until_idle()


def _cell_updates(rig: Rig) -> dict[int, np.ndarray]:
    return {m.round: m.delta["w"] for _, m in decoded(rig.at_cloud) if isinstance(m, CellUpdate)}


def _restart(rig: Rig, tmp_path: Path, db: Path) -> None:
    rig.edge.store.close()
    rig.edge.cell_tx.close()
    rig.edge.cloud_tx.close()
    rig.edge = rig.new_edge(tmp_path, db)


def test_an_edge_optimizer_keeps_its_momentum_across_an_edge_restart(tmp_path: Path) -> None:
    # Prepare: the same three rounds of a cell with a momentum edge optimizer, once undisturbed and once
    # with the edge restarted from its store inside round 1 and again between rounds 1 and 2.
    rounds = [{"dev-0": 1.0, "dev-1": 2.0, "dev-2": 3.0}, {"dev-0": -1.0, "dev-1": 0.5, "dev-2": 2.0},
              {"dev-0": 4.0, "dev-1": 4.0, "dev-2": 1.0}]
    plain = Rig(tmp_path / "plain")
    for r, values in enumerate(rounds):
        _round(plain, r, values)
    db = tmp_path / "edge.db"
    rig = Rig(tmp_path, db)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)  # the rollout runs
    _round(rig, 0, rounds[0])
    _round(rig, 1, {"dev-0": rounds[1]["dev-0"]})
    # Execute: restarted mid-round (it replays round 1 from the momentum of round 0), then after round 1
    # closed (its replay closes the cell again; round 2 must start from the momentum after round 1)
    _restart(rig, tmp_path, db)
    _round(rig, 1, rounds[1])  # the task again (a duplicate) and the rest of the updates
    _restart(rig, tmp_path, db)
    _round(rig, 2, rounds[2])
    # Assert: the cell's changes are those of the undisturbed edge; momentum made them differ from the plain means
    expected, got = _cell_updates(plain), _cell_updates(rig)
    assert sorted(got) == [0, 1, 2]
    for r in range(3):
        np.testing.assert_allclose(got[r], expected[r], rtol=0, atol=1e-6)
    assert not np.allclose(expected[2], np.mean(list(rounds[2].values())))
    assert rig.edge.roles[ROLLOUT]._edge_optimizer.steps == 3


# --- presence stays in its cell, and reaches the cloud as a summary -------------------------------------


def summaries(received: list) -> list[CellPresence]:
    return [m for t, m in decoded(received) if t == topics.edge_up(ROLLOUT, CELL, CellPresence.KIND)]


def test_the_edge_follows_its_own_cells_presence_only_and_never_republishes_per_device(tmp_path: Path) -> None:
    # Prepare: a running rollout (its manifest relayed once), a round open.
    rig = Rig(tmp_path)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.task()
    rig.at_cell.clear()
    # Execute: devices of another cell and an older agent's cell-less presence come and go; then this cell's.
    for i in range(5):
        rig.devices.publish(*online(f"other-{i}", float(i), cell="cell-b"), retain=True)
    rig.devices.publish(topics.status("dev-1"), json.dumps({"state": "online", "since": 1.0}).encode(), retain=True)
    rig.broker.run_until_idle()
    assert rig.at_cell == [] and rig.edge._devices_online == {}
    for device in MEMBERS:
        rig.devices.publish(*online(device, 7.0), retain=True)
    rig.broker.run_until_idle()
    # Assert: each member that owes the round got its task on its own topic; no manifest was published again.
    assert sorted(t for t, m in decoded(rig.at_cell) if isinstance(m, DeviceTask)) == \
        [topics.cell_down(ROLLOUT, CELL, DeviceTask.KIND, d) for d in MEMBERS]
    assert not any(i.topic == topics.cell_manifest(ROLLOUT, CELL) for i in rig.at_cell)


def test_who_is_online_is_summarised_for_the_coordinator_on_change_at_most_every_few_seconds(tmp_path: Path) -> None:
    from edge_broker.service import PRESENCE_SUMMARY_S

    rig = Rig(tmp_path)
    rig.devices.publish(*online("dev-0", 1.0), retain=True)
    rig.broker.run_until_idle()
    rig.edge.tick(0.0)
    rig.broker.run_until_idle()
    assert summaries(rig.at_cloud) == []  # no rollout runs: nobody to tell
    # The manifest arrives: the rollout's coordinator is told at once.
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.broker.run_until_idle()
    rig.edge.tick(1.0)
    rig.broker.run_until_idle()
    [first] = summaries(rig.at_cloud)
    assert first.online == ("dev-0",) and first.known == 1 and first.sender == CELL
    # Two devices connect and one leaves within the interval: one more summary, when the interval is over.
    rig.devices.publish(*online("dev-1", 2.0), retain=True)
    rig.devices.publish(*online("dev-2", 2.0), retain=True)
    rig.devices.publish(*online("dev-0", 1.0, state="offline"), retain=True)
    rig.broker.run_until_idle()
    rig.edge.tick(1.0 + PRESENCE_SUMMARY_S / 2)
    rig.broker.run_until_idle()
    assert len(summaries(rig.at_cloud)) == 1
    rig.edge.tick(1.0 + PRESENCE_SUMMARY_S)
    rig.broker.run_until_idle()
    second = summaries(rig.at_cloud)[-1]
    assert second.online == ("dev-1", "dev-2") and second.known == 3
    # Nothing changed: nothing sent. The coordinator (re)connects: it is told again.
    rig.edge.tick(10 * PRESENCE_SUMMARY_S)
    rig.broker.run_until_idle()
    assert len(summaries(rig.at_cloud)) == 2
    rig.cloud.publish(topics.status("cloud"), json.dumps({"state": "online", "since": 9.0}).encode(), retain=True)
    rig.broker.run_until_idle()
    rig.edge.tick(20 * PRESENCE_SUMMARY_S)
    rig.broker.run_until_idle()
    assert [s.online for s in summaries(rig.at_cloud)] == [("dev-0",), ("dev-1", "dev-2"), ("dev-1", "dev-2")]


def test_manifests_are_published_again_once_per_reconnection_to_the_cell_broker(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.broker.run_until_idle()

    def relayed() -> int:
        return sum(1 for i in rig.at_cell if i.topic == topics.cell_manifest(ROLLOUT, CELL))

    assert relayed() == 1
    rig.edge.cell_tx.connects = 1  # type: ignore[attr-defined]  (as MqttTransport counts its connections)
    rig.edge.tick(1.0)
    rig.broker.run_until_idle()
    assert relayed() == 1  # the first connection: nothing lost yet
    rig.edge.cell_tx.connects = 2  # type: ignore[attr-defined]  (the broker restarted; the edge reconnected)
    for _ in range(3):
        rig.edge.tick(2.0)
    rig.broker.run_until_idle()
    assert relayed() == 2


def test_a_restarted_edge_relays_its_installed_manifest_once_when_the_coordinator_shows_it_still_runs(
        tmp_path: Path) -> None:
    db = tmp_path / "edge.db"
    rig = Rig(tmp_path, db)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.broker.run_until_idle()
    rig.edge.store.close()
    rig.edge.cell_tx.close()
    rig.edge.cloud_tx.close()
    rig.at_cell.clear()
    rig.edge = rig.new_edge(tmp_path, db)  # the retained manifest arrives again: the same bytes
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)  # and again (a redelivery)
    rig.broker.run_until_idle()
    assert [Manifest.decode(i.payload).version for i in rig.at_cell
            if i.topic == topics.cell_manifest(ROLLOUT, CELL)] == [1]


# --- devices that cannot train, rollouts that ended ------------------------------------------------------


def _failed(rig: Rig, device: str, reason: str = "crash", round: int = 0) -> None:
    msg = TrainingFailed(rollout=ROLLOUT, round=round, sender=device, reason=reason)
    rig.devices.publish(topics.cell_up(ROLLOUT, CELL, device, msg.KIND), msg.encode())
    rig.broker.run_until_idle()


def test_a_device_that_fails_to_train_is_counted_and_the_cell_closes_without_it(tmp_path: Path, caplog) -> None:
    # Prepare: quorum 1.0, two of three devices report.
    db = tmp_path / "edge.db"
    rig = Rig(tmp_path, db)
    rig.task()
    rig.update("dev-0", 1.0)
    with caplog.at_level("WARNING", logger="fedtier.edge"):
        _failed(rig, "dev-1", "crash")
    assert [m for _, m in decoded(rig.at_cloud) if isinstance(m, CellUpdate)] == []  # dev-2 still owes its update
    assert "dev-1 could not train round 0 step 0 of r (crash)" in caplog.text and "dev-2" in caplog.text
    # A repeat (QoS 1, the device's outbox) is a duplicate; the failed device is not sent its task again.
    _failed(rig, "dev-1", "crash")
    rig.at_cell.clear()
    rig.devices.publish(topics.status("dev-1"), json.dumps({"state": "online", "since": 7.0}).encode(), retain=True)
    rig.broker.run_until_idle()
    assert decoded(rig.at_cell) == []
    # Execute: the last member reports: the cell closes without the failed one.
    rig.update("dev-2", 3.0)
    # Assert: the failure is counted by reason once, and named in the cell update's stats.
    [update] = [m for _, m in decoded(rig.at_cloud) if isinstance(m, CellUpdate)]
    assert update.reported == ("dev-0", "dev-2") and update.stats["failed"] == [["dev-1", "crash"]]
    np.testing.assert_allclose(update.delta["w"], np.full((2, 2), 2.0), rtol=0, atol=1e-7)
    assert rig.edge.metrics.get(TRAINING_FAILED, reason="crash") == 1
    assert rig.edge.metrics.get(ACCEPTED, kind="training_failed") == 1


def test_a_failure_of_the_last_member_closes_the_cell_at_once_and_survives_an_edge_restart(tmp_path: Path) -> None:
    db = tmp_path / "edge.db"
    rig = Rig(tmp_path, db)
    rig.task()
    rig.update("dev-0", 1.0)
    _failed(rig, "dev-1", "error")
    # The edge restarts before the last device answers: the replay restores the failure too.
    rig.edge.store.close()
    rig.edge.cell_tx.close()
    rig.edge.cloud_tx.close()
    rig.edge = rig.new_edge(tmp_path, db)
    _failed(rig, "dev-2", "non_finite")  # the replay wakes on it; now everyone has answered
    [update] = [m for _, m in decoded(rig.at_cloud) if isinstance(m, CellUpdate)]
    assert update.reported == ("dev-0",)
    assert update.stats["failed"] == [["dev-1", "error"], ["dev-2", "non_finite"]]
    assert rig.edge.metrics.get(TRAINING_FAILED, reason="error") == 0  # counted by the edge before its restart
    assert rig.edge.metrics.get(TRAINING_FAILED, reason="non_finite") == 1


def test_a_cell_where_every_device_failed_waits_for_its_deadline_and_a_quorum(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.task(FedAvgConfig(deadline_s=5.0, quorum=0.3))
    for device in MEMBERS:
        _failed(rig, device)
    rig.edge.tick(rig.broker.now + 10.0)
    assert [m for _, m in decoded(rig.at_cloud) if isinstance(m, CellUpdate)] == []  # nothing to aggregate


def test_a_replayed_task_of_an_ended_rollout_is_rejected_by_reason_also_after_a_restart(tmp_path: Path) -> None:
    # Prepare: round 0 done, then the rollout ends.
    db = tmp_path / "edge.db"
    rig = Rig(tmp_path, db)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.task()
    for device in MEMBERS:
        rig.update(device, 1.0)
    rig.cloud.publish(topics.manifest(ROLLOUT), b"", retain=True)
    rig.broker.run_until_idle()
    accepted = rig.edge.metrics.get(ACCEPTED, kind="cell_task")
    for restart in (False, True):
        if restart:
            rig.edge.store.close()
            rig.edge.cell_tx.close()
            rig.edge.cloud_tx.close()
            rig.edge = rig.new_edge(tmp_path, db)
            accepted = 0
        rig.at_cell.clear()
        # Execute: the task of round 0 (and one of round 1) arrives again, e.g. replayed on the downlink.
        for round in (0, 1):
            task = CellTask(rollout=ROLLOUT, round=round, sender="cloud", params=PARAMS, members=MEMBERS,
                            config=FedAvgConfig().to_dict())
            rig.cloud.publish(topics.cloud_down(ROLLOUT, CELL, task.KIND), task.encode())
        rig.broker.run_until_idle()
        # Assert: rejected as rollout_ended, not accepted, nothing relayed to the devices, nothing stored.
        assert rig.edge.metrics.get(REJECTED, reason="rollout_ended") == 2
        assert rig.edge.metrics.get(ACCEPTED, kind="cell_task") == accepted
        assert decoded(rig.at_cell) == [] and ROLLOUT not in rig.edge.roles
        assert rig.edge.store.inputs() == []
    # The cell's retained manifest stays cleared (cleared again once), and the old manifest replayed changes nothing.
    assert [i.payload for i in rig.at_cell if i.topic == topics.cell_manifest(ROLLOUT, CELL)] == [b""]
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode())
    rig.broker.run_until_idle()
    assert rig.edge.manifests == {} and not any(i.payload for i in rig.at_cell
                                                 if i.topic == topics.cell_manifest(ROLLOUT, CELL))


def test_a_new_manifest_under_an_ended_rollouts_id_starts_it_again(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.cloud.publish(topics.manifest(ROLLOUT), MANIFEST.encode(), retain=True)
    rig.cloud.publish(topics.manifest(ROLLOUT), b"", retain=True)
    rig.broker.run_until_idle()
    again = dataclasses.replace(MANIFEST, version=2, created=2.0)
    rig.cloud.publish(topics.manifest(ROLLOUT), again.encode(), retain=True)
    rig.task()
    assert rig.edge.metrics.get(REJECTED, reason="rollout_ended") == 0
    assert rig.edge.roles[ROLLOUT].round == 0 and rig.edge.manifests[ROLLOUT].version == 2

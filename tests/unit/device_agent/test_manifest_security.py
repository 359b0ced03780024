"""A device refuses bad manifests — and keeps training on the model it had (issue: signed manifests)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloud_coordinator.rollout import prepare
from device_agent.data import LocalData
from device_agent.node import DeviceNode
from device_agent.state import DeviceState
from device_agent.trainers import make_trainer
from fedtier.artifacts.bundle import ArtifactBundle, BundleFile
from fedtier.artifacts.cache import ArtifactCache
from fedtier.runtime.node_base import REJECTED
from fedtier.security.pki import key_id
from fedtier.security.signing import sign
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker
from fedtier.wire import messages
from fedtier.wire.messages import ArtifactBlob, DeviceTask, DeviceUpdate

KEY, STRANGER = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()


class Rig:
    def __init__(self, prepared, tmp: Path, clock_now: float) -> None:
        self.prepared = prepared
        self.broker = MemoryBroker()
        self.received: list = []
        self.edge = self.broker.connect("edge", self.received.append)
        self.cell = next(iter(prepared.cells))
        self.device = prepared.cells[self.cell][0]
        self.edge.subscribe(topics.cell_up_filter(self.cell))
        x, y = prepared.data.train[self.device]
        self.node = DeviceNode(device_id=self.device, cell=self.cell, transport=self.broker.connect(self.device),
                               data=LocalData(x=x, y=y), trainer_provider=lambda b: make_trainer("ort", b),
                               state=DeviceState(tmp / "agent.db"), cache=ArtifactCache(tmp / "cache"),
                               bundles_dir=tmp / "bundles", trusted_keys={key_id(KEY.public_key()): KEY.public_key()})
        self.node.gate.clock = lambda: clock_now
        self.node.tx.set_handler(lambda inbound: self.node.handle(inbound, self.broker.now))
        for sha, path in prepared.artifact_files().items():  # the v1 files are already on the device
            self.node.cache.put(sha, path.read_bytes())
        self.node.start(0.0)

    def publish_manifest(self, data: bytes) -> None:
        self.edge.publish(topics.cell_manifest(self.prepared.config.rollout, self.cell), data, retain=True)
        self.broker.run_until_idle()

    def updates_for_round(self, round: int) -> list[DeviceUpdate]:
        cfg = self.prepared.config.algorithm_config().to_dict()
        task = DeviceTask(rollout=self.prepared.config.rollout, round=round, sender=self.cell,
                          params=self.prepared.initial_params, config=cfg, members=self.prepared.cells[self.cell])
        self.edge.publish(topics.cell_down(task.rollout, self.cell, task.KIND), task.encode())
        self.broker.run_until_idle()
        return [m for m in (messages.decode_message(i.payload) for i in self.received)
                if isinstance(m, DeviceUpdate) and m.round == round]


@pytest.fixture
def rig(small_rollout, tmp_path: Path) -> Rig:
    prepared = prepare(small_rollout())
    v1 = dataclasses.replace(prepared.manifest, version=1, created=1000.0, expires=5000.0)
    r = Rig(prepared, tmp_path, clock_now=2000.0)
    r.v1 = v1
    r.publish_manifest(sign(v1, KEY))
    assert r.node.manifests[prepared.config.rollout].version == 1
    assert len(r.updates_for_round(0)) == 1
    return r


def test_bad_signature(rig: Rig) -> None:
    doc = json.loads(sign(dataclasses.replace(rig.v1, version=2), KEY))
    doc["signature"]["sig"] = base64.b64encode(b"\1" * 64).decode()
    _refused(rig, json.dumps(doc).encode(), "bad_signature")


def test_unknown_key(rig: Rig) -> None:
    _refused(rig, sign(dataclasses.replace(rig.v1, version=2), STRANGER), "unknown_key")


def test_older_version(rig: Rig) -> None:
    _refused(rig, sign(dataclasses.replace(rig.v1, version=1, rounds=99), KEY), "stale_manifest")


def test_expired(rig: Rig) -> None:
    _refused(rig, sign(dataclasses.replace(rig.v1, version=2, expires=1500.0), KEY), "expired_manifest")


def test_artifact_bytes_that_do_not_match_their_digest(rig: Rig) -> None:
    # v2 announces a checkpoint with other bytes (a new digest); what arrives under it is not that file.
    bundle = rig.prepared.bundle
    fake = b"a checkpoint that was swapped on the way"
    files = dict(bundle.files)
    files["checkpoint"] = BundleFile("checkpoint", hashlib.sha256(fake).hexdigest(), len(fake))
    new_bundle = ArtifactBundle(directory=None, files=files, arch=bundle.arch, layout=bundle.layout,
                                opset=bundle.opset, ir_version=bundle.ir_version, seed=bundle.seed,
                                portable=bundle.portable)
    v2 = dataclasses.replace(rig.v1, version=2, bundle=new_bundle.to_json())
    rig.publish_manifest(sign(v2, KEY))
    blob = ArtifactBlob(rollout=v2.rollout, round=0, sender=rig.cell, sha256=files["checkpoint"].sha256,
                        name="checkpoint", data=bundle.path("checkpoint").read_bytes())
    rig.edge.publish(topics.cell_down(v2.rollout, rig.cell, blob.KIND), blob.encode())
    rig.broker.run_until_idle()
    assert rig.node.metrics.get(REJECTED, reason="sha_mismatch") == 1
    _still_on_v1(rig)


def _refused(rig: Rig, data: bytes, reason: str) -> None:
    trainer = rig.node.trainers[rig.prepared.config.rollout]
    rig.publish_manifest(data)
    assert rig.node.metrics.get(REJECTED, reason=reason) == 1
    assert rig.node.incoming == {}  # nothing fetched, nothing loaded
    assert rig.node.trainers[rig.prepared.config.rollout] is trainer
    _still_on_v1(rig)


def _still_on_v1(rig: Rig) -> None:
    assert rig.node.manifests[rig.prepared.config.rollout].version == 1
    assert rig.node.state.manifest_version() == 1
    [update] = rig.updates_for_round(1)  # the agent keeps running on its previous model
    assert any(np.abs(d).max() > 0 for d in update.delta.values())


def test_a_model_failing_its_health_check_is_not_installed(rig: Rig, artifact_store: Path) -> None:
    from fedtier.training.layout import ArchSpec
    from models.artifacts import build_artifacts

    # Validly signed, files intact — but a 3-class model for data with 10 classes.
    other = build_artifacts(ArchSpec("mlp", {"sizes": [64, 16, 3]}), artifact_store)
    for role, entry in other.files.items():
        rig.node.cache.put(entry.sha256, other.path(role).read_bytes())
    rig.publish_manifest(sign(dataclasses.replace(rig.v1, version=2, bundle=other.to_json()), KEY))
    assert rig.node.metrics.get(REJECTED, reason="unusable_artifacts") == 1
    _still_on_v1(rig)


def test_a_restarted_device_installs_its_signed_manifest_again_from_its_state(rig: Rig, tmp_path: Path) -> None:
    """The edge's retained copy is the same v1 the device installed: a restart must not refuse it as stale."""
    rollout = rig.prepared.config.rollout
    rig.node.tx.close()
    rig.node.state.close()
    x, y = rig.prepared.data.train[rig.device]
    node = DeviceNode(device_id=rig.device, cell=rig.cell, transport=rig.broker.connect(rig.device),
                      data=LocalData(x=x, y=y), trainer_provider=lambda b: make_trainer("ort", b),
                      state=DeviceState(tmp_path / "agent.db"), cache=ArtifactCache(tmp_path / "cache"),
                      bundles_dir=tmp_path / "bundles", trusted_keys={key_id(KEY.public_key()): KEY.public_key()})
    node.gate.clock = lambda: 2000.0
    node.tx.set_handler(lambda inbound: node.handle(inbound, rig.broker.now))
    rig.node = node
    node.start(0.0)
    node.tx.subscribe(topics.cell_down_filter(rig.cell))
    rig.broker.run_until_idle()  # the retained v1 arrives again
    assert node.metrics.get(REJECTED, reason="stale_manifest") == 0
    assert node.manifests[rollout].version == 1 and rollout in node.trainers
    [update] = rig.updates_for_round(1)  # and it trains
    assert any(np.abs(d).max() > 0 for d in update.delta.values())


def test_a_cleared_manifest_ends_the_rollout_on_the_device(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    rollout = rig.prepared.config.rollout
    with caplog.at_level("INFO", logger="fedtier.agent"):
        rig.publish_manifest(b"")  # the edge clears its retained copy: the rollout ended
    assert rollout not in rig.node.trainers and rollout not in rig.node.manifests
    assert rig.node.state.installed_manifests() == {}
    assert f"rollout {rollout} ended; idle until the next rollout" in caplog.text

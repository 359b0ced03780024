"""The portable backend: how the agent picks it, what it refuses, and that it stays light.

Numerical equivalence with the other backends is in ``test_trainers.py`` (the shared
contract, parametrized over all backends) and ``test_portable_env.py`` (20 steps in an
environment without onnxruntime-training, against onnxruntime-training).
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import device_agent.trainers.ort_runtime as ort_runtime
from cloud_coordinator.rollout import prepare
from device_agent.config import DeviceConfig
from device_agent.data import LocalData
from device_agent.node import DeviceNode
from device_agent.state import DeviceState
from device_agent.trainers import describe_backend, make_trainer, resolve_kind
from device_agent.trainers.portable import PortableTrainer
from fedtier.artifacts.bundle import ROLES, ArtifactBundle, BundleFile, PortableInfo
from fedtier.artifacts.cache import ArtifactCache
from fedtier.errors import ArtifactError, ConfigError
from fedtier.runtime.node_base import REJECTED
from fedtier.training.layout import ArchSpec
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker
from fedtier.wire.messages import ArtifactBlob
from models.artifacts import build_artifacts

MLP = ArchSpec("mlp", {"sizes": [64, 64, 10]})


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> ArtifactBundle:
    return build_artifacts(MLP, tmp_path_factory.getbasetemp() / "fedtier-artifact-store", seed=0)


def copy_with(bundle: ArtifactBundle, directory: Path, *, files: dict[str, BundleFile] | None = None,
              portable: PortableInfo | None = None) -> ArtifactBundle:
    """The bundle's files in ``directory`` under a re-described (self-consistent) descriptor."""
    directory.mkdir(parents=True)
    chosen = files if files is not None else dict(bundle.files)
    for entry in chosen.values():
        (directory / entry.filename).write_bytes((bundle.directory / entry.filename).read_bytes())
    copy = dataclasses.replace(bundle, directory=directory, files=chosen, portable=portable)
    copy.save()
    return ArtifactBundle.load(directory)


# --- choosing the backend --------------------------------------------------------------------------


@pytest.mark.parametrize("build, expected", [("training", "ort"), ("stock", "portable")])
def test_auto_picks_onnxruntime_training_where_installed_else_the_portable_graph(
        monkeypatch: pytest.MonkeyPatch, build: str, expected: str) -> None:
    monkeypatch.setattr(ort_runtime, "installed_build", lambda: build)
    assert resolve_kind("auto") == expected
    assert describe_backend("auto").startswith(f"auto -> {expected} (")
    for kind in ("ort", "portable", "torch"):  # explicit choices are kept as they are
        assert resolve_kind(kind) == kind


def test_auto_without_any_onnxruntime_names_the_key_and_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ort_runtime, "installed_build", lambda: None)
    with pytest.raises(ConfigError, match=r"\[trainer\].*fedtier\[agent\].*trainer = 'torch'"):
        resolve_kind("auto")
    assert describe_backend("auto").startswith("none")


def test_this_environment_is_detected_as_the_training_build() -> None:
    assert ort_runtime.installed_build() == "training"
    assert describe_backend("auto") == "auto -> ort (onnxruntime-training-cpu 1.19.2; onnxruntime-training artifacts)"
    assert describe_backend("portable").startswith("portable (onnxruntime-training-cpu 1.19.2;")


def test_device_config_defaults_to_auto_and_knows_every_kind(tmp_path: Path) -> None:
    base = {"device_id": "d1", "cell": "c1", "data_dir": str(tmp_path), "state_dir": str(tmp_path)}
    assert DeviceConfig.from_mapping(base).trainer == "auto"
    for kind in ("ort", "portable", "torch"):
        assert DeviceConfig.from_mapping({**base, "trainer": kind}).trainer == kind
    with pytest.raises(ConfigError, match="trainer"):
        DeviceConfig.from_mapping({**base, "trainer": "tflite"})


@pytest.mark.parametrize("kind, backend", [("auto", "ort"), ("portable", "portable")])
def test_the_agent_announces_its_backend_in_its_presence(tmp_path: Path, kind: str, backend: str) -> None:
    from device_agent.run import build
    from fedtier import __version__

    np.savez(tmp_path / "train.npz", x=np.zeros((4, 64), np.float32), y=np.arange(4))
    cfg = DeviceConfig.from_mapping({"device_id": "d1", "cell": "c1", "data_dir": str(tmp_path),
                                     "state_dir": str(tmp_path / "state"), "trainer": kind})
    node, tx, _inbox = build(cfg)  # not started: nothing connects
    try:
        status = dict(tx.status)
        assert isinstance(status.pop("instance"), str)  # a random id per process (copied-bundle detection)
        assert status == {"node": "d1", "role": "device", "cell": "c1", "trainer": backend, "version": __version__}
    finally:
        node.state.close()


# --- what it refuses ---------------------------------------------------------------------------


def test_a_bundle_without_portable_graph_is_refused_with_the_reason(bundle: ArtifactBundle, tmp_path: Path) -> None:
    old = copy_with(bundle, tmp_path / "old", files={r: bundle.files[r] for r in ROLES}, portable=None)
    with pytest.raises(ArtifactError, match="no portable training graph.*rebuild the bundle"):
        PortableTrainer(old)
    make_trainer("ort", old)  # onnxruntime-training devices still train it


def test_a_bundle_with_unlowered_ops_is_refused_naming_them(bundle: ArtifactBundle, tmp_path: Path) -> None:
    blocked = copy_with(bundle, tmp_path / "blocked", files={r: bundle.files[r] for r in ROLES},
                        portable=PortableInfo(unsupported_ops=("GeluGrad", "LayerNormalizationGrad")))
    with pytest.raises(ArtifactError, match=r"no lowering to standard ONNX \(GeluGrad, LayerNormalizationGrad\)"):
        make_trainer("portable", blocked)


def test_a_portable_checkpoint_of_the_wrong_size_is_refused(bundle: ArtifactBundle, tmp_path: Path) -> None:
    bad = copy_with(bundle, tmp_path / "bad", portable=bundle.portable)
    target = bad.path("portable_checkpoint")
    target.write_bytes(target.read_bytes()[:-4])
    files = {**bad.files, "portable_checkpoint": BundleFile.of(target)}
    with pytest.raises(ArtifactError, match="bytes; the layout needs"):
        PortableTrainer(dataclasses.replace(bad, files=files))


def test_a_device_without_onnxruntime_training_refuses_the_rollout_by_op_name(
        small_rollout, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A manifest whose bundle lists an unlowered op: the portable device does not take part and
    logs the op; nothing of the bundle is in use."""
    prepared = prepare(small_rollout())
    src = prepared.bundle
    blocked = dataclasses.replace(src, files={r: src.files[r] for r in ROLES},
                                  portable=PortableInfo(unsupported_ops=("GeluGrad",)))
    manifest = dataclasses.replace(prepared.manifest, bundle=blocked.to_json())
    broker = MemoryBroker()
    cell = next(iter(prepared.cells))
    device = prepared.cells[cell][0]
    edge = broker.connect("edge")
    x, y = prepared.data.train[device]
    node = DeviceNode(device_id=device, cell=cell, transport=broker.connect(device), data=LocalData(x=x, y=y),
                      trainer_provider=lambda b: make_trainer("portable", b),
                      state=DeviceState(tmp_path / "agent.db"), cache=ArtifactCache(tmp_path / "cache"),
                      bundles_dir=tmp_path / "bundles")
    node.tx.set_handler(lambda inbound: node.handle(inbound, broker.now))
    node.start(0.0)
    rollout = prepared.config.rollout
    with caplog.at_level(logging.ERROR):
        edge.publish(topics.cell_manifest(rollout, cell), manifest.encode(), retain=True)
        for entry in blocked.files.values():
            blob = ArtifactBlob(rollout=rollout, round=0, sender=cell, sha256=entry.sha256, name=entry.filename,
                                data=(src.directory / entry.filename).read_bytes())
            edge.publish(topics.cell_down(rollout, cell, blob.KIND), blob.encode())
        broker.run_until_idle()
    assert rollout not in node.trainers
    assert node.metrics.get(REJECTED, reason="unusable_artifacts") == 1
    assert any("refused" in r.getMessage() and "GeluGrad" in r.getMessage() for r in caplog.records)


# --- light on a device -----------------------------------------------------------------------------

TORCH_FREE_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from device_agent.trainers import make_trainer
    from fedtier.artifacts.bundle import ArtifactBundle
    trainer = make_trainer("portable", ArtifactBundle.load(sys.argv[1]))
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    stats = trainer.train_steps([(x, np.arange(8) % 10)], 0.1)
    assert stats.steps == 1 and np.isfinite(stats.mean_loss), stats
    assert 'torch' not in sys.modules, 'torch was imported'
    assert 'onnx' not in sys.modules, 'onnx was imported'
    assert not any(m.startswith('models') for m in sys.modules), 'models was imported'
    print('ok')
""")


def test_the_portable_trainer_imports_neither_torch_nor_onnx(bundle: ArtifactBundle, tmp_path: Path) -> None:
    """Here onnxruntime is the training build, whose plain import pulls torch in; the shim keeps it out."""
    proc = subprocess.run([sys.executable, "-c", TORCH_FREE_SCRIPT, str(bundle.directory)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"

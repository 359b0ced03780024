"""build_artifacts: ORT training artifacts, content-addressed store, quiet and atomic builds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import models.artifacts as artifacts_mod
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.errors import ArtifactError
from fedtier.training.layout import ArchSpec
from models.artifacts import build_artifacts
from models.zoo import layout_of

MLP = ArchSpec("mlp", {"sizes": [64, 64, 10]})
MLP_WIDE = ArchSpec("mlp", {"sizes": [64, 300, 10]})
CNN = ArchSpec("cnn1d", {"channels": 3, "length": 32, "classes": 5, "filters": [8, 16], "kernel": 5})


@pytest.fixture(scope="session")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One artifact store per test session (shared by name with the trainer tests)."""
    return tmp_path_factory.getbasetemp() / "fedtier-artifact-store"


@pytest.fixture(scope="session")
def mlp_bundle(shared_store: Path) -> ArtifactBundle:
    return build_artifacts(MLP, shared_store, seed=0)


@pytest.fixture(scope="session")
def cnn_bundle(shared_store: Path) -> ArtifactBundle:
    return build_artifacts(CNN, shared_store, seed=0)


def test_bundle_contents(mlp_bundle: ArtifactBundle, shared_store: Path) -> None:
    assert mlp_bundle.directory == shared_store / mlp_bundle.bundle_id
    names = {p.name for p in mlp_bundle.directory.iterdir()}
    assert names == {"training_model.onnx", "eval_model.onnx", "optimizer_model.onnx",
                     "checkpoint", "bundle.json", "arch.json", "layout.json",
                     "portable_training_model.onnx", "portable_checkpoint.f32"}
    assert mlp_bundle.arch == MLP
    assert mlp_bundle.layout == layout_of(MLP)
    assert mlp_bundle.seed == 0
    assert json.loads((mlp_bundle.directory / "arch.json").read_text()) == MLP.to_json()
    assert json.loads((mlp_bundle.directory / "layout.json").read_text()) == layout_of(MLP).to_json()
    assert ArtifactBundle.load(mlp_bundle.directory) == mlp_bundle


@pytest.mark.parametrize("which", ["mlp", "cnn"])
def test_graphs_return_loss_and_logits_with_int64_labels(
        which: str, mlp_bundle: ArtifactBundle, cnn_bundle: ArtifactBundle) -> None:
    import onnx

    bundle = mlp_bundle if which == "mlp" else cnn_bundle
    names = list(bundle.layout.names)
    train = onnx.load(str(bundle.path("training_model")))
    evalm = onnx.load(str(bundle.path("eval_model")))
    optim = onnx.load(str(bundle.path("optimizer_model")))
    # Training-graph input order = layout order (what the contiguous-buffer API would use).
    assert [i.name for i in train.graph.input][: 2 + len(names)] == ["input", "labels", *names]
    for model in (train, evalm):
        outputs = [o.name for o in model.graph.output]
        assert outputs[1] == "logits" and "loss" in outputs[0]
        labels = next(i for i in model.graph.input if i.name == "labels")
        assert labels.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [n.op_type for n in optim.graph.node] == ["SGDOptimizerV2"]
    # opset / IR recorded = what the files really use, within ORT 1.19.2's limits.
    models = (train, evalm, optim)
    assert bundle.ir_version == max(m.ir_version for m in models) <= 10
    assert bundle.opset == max(op.version for m in models for op in m.opset_import
                               if op.domain in ("", "ai.onnx")) == 17


def test_same_arch_and_seed_builds_once(mlp_bundle: ArtifactBundle, shared_store: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    mtimes = {p.name: p.stat().st_mtime_ns for p in mlp_bundle.directory.iterdir()}

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("build_artifacts rebuilt a cached bundle")

    monkeypatch.setattr(artifacts_mod, "_build_into", no_rebuild)
    again = build_artifacts(MLP, shared_store, seed=0)
    assert again == mlp_bundle
    assert {p.name: p.stat().st_mtime_ns for p in again.directory.iterdir()} == mtimes
    index = json.loads((shared_store / "by-arch" / MLP.sha256).read_text())
    assert index["bundles"]["0"] == mlp_bundle.bundle_id


def test_different_arch_or_seed_gives_different_bundle(
        mlp_bundle: ArtifactBundle, cnn_bundle: ArtifactBundle, shared_store: Path) -> None:
    wide = build_artifacts(MLP_WIDE, shared_store, seed=0)
    seeded = build_artifacts(MLP, shared_store, seed=1)
    ids = {mlp_bundle.bundle_id, cnn_bundle.bundle_id, wide.bundle_id, seeded.bundle_id}
    assert len(ids) == 4
    index = json.loads((shared_store / "by-arch" / MLP.sha256).read_text())
    assert index["bundles"] == {"0": mlp_bundle.bundle_id, "1": seeded.bundle_id}
    # Only the checkpoints (initial weights, both formats) differ between seeds.
    differing = {r for r in mlp_bundle.files if mlp_bundle.files[r] != seeded.files[r]}
    assert differing == {"checkpoint", "portable_checkpoint"}


def test_builds_are_reproducible(mlp_bundle: ArtifactBundle, cnn_bundle: ArtifactBundle,
                                 tmp_path: Path) -> None:
    # Built in another order in a fresh store: onnxblock's global name counter must not leak.
    assert build_artifacts(CNN, tmp_path).bundle_id == cnn_bundle.bundle_id
    assert build_artifacts(MLP, tmp_path).bundle_id == mlp_bundle.bundle_id


def test_corrupted_file_named_and_store_repairs_itself(tmp_path: Path) -> None:
    bundle = build_artifacts(MLP, tmp_path)
    target = bundle.path("training_model")
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="training_model.onnx"):
        ArtifactBundle.load(bundle.directory)
    repaired = build_artifacts(MLP, tmp_path)  # index hit fails verification -> rebuild
    assert repaired.bundle_id == bundle.bundle_id
    ArtifactBundle.load(repaired.directory)
    assert any(p.name.startswith(".broken-") for p in tmp_path.iterdir())


def test_failed_build_leaves_no_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxruntime.training import artifacts as ort_artifacts

    def explode(*args: object, **kwargs: object) -> None:
        os.write(2, b"native noise before the crash\n")
        raise RuntimeError("boom")

    monkeypatch.setattr(ort_artifacts, "generate_artifacts", explode)
    with pytest.raises(ArtifactError, match="boom"):
        build_artifacts(MLP, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []  # no bundle, no .build-*, no index


def test_generate_artifacts_stderr_is_suppressed_and_restored(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    build_artifacts(ArchSpec("mlp", {"sizes": [5, 7, 2]}), tmp_path)
    out, err = capfd.readouterr()
    assert "graph_transformer" not in err and "[I:onnxruntime" not in err
    os.write(2, b"fd2 restored\n")
    assert "fd2 restored" in capfd.readouterr().err


def test_half_bundle_is_never_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_publish = artifacts_mod._publish
    seen: dict[str, list[str]] = {}

    def spy(tmp: Path, built: ArtifactBundle, store: Path) -> ArtifactBundle:
        seen["tmp"] = sorted(p.name for p in tmp.iterdir())
        assert tmp.name.startswith(".build-")
        assert not (store / built.bundle_id).exists()
        return real_publish(tmp, built, store)

    monkeypatch.setattr(artifacts_mod, "_publish", spy)
    bundle = build_artifacts(MLP, tmp_path)
    assert "bundle.json" in seen["tmp"] and "forward.onnx" not in seen["tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([bundle.bundle_id, "by-arch"])


IMPORT_ORDER_SCRIPT = textwrap.dedent("""
    import logging, sys
    import numpy as np
    first = sys.argv[1]
    if first == "shim":
        from device_agent.trainers.ort_runtime import install_shim, training_api
        assert install_shim() is True
        training_api()
        assert "torch" not in sys.modules
        # build_artifacts below imports onnxruntime.training.artifacts through the shim.
    else:
        from onnxruntime.training import artifacts  # the real package (imports torch)
        from device_agent.trainers.ort_runtime import install_shim, training_api
        assert install_shim() is False
        training_api()
    from fedtier.training.layout import ArchSpec
    from models.artifacts import build_artifacts
    from device_agent.trainers.ort import OrtTrainer
    bundle = build_artifacts(ArchSpec("mlp", {"sizes": [6, 5, 3]}), sys.argv[2])
    trainer = OrtTrainer(bundle)
    x = np.ones((4, 6), np.float32); y = np.array([0, 1, 2, 0])
    stats = trainer.train_steps([(x, y)], 0.1)
    assert stats.steps == 1 and np.isfinite(stats.mean_loss)
    if first == "shim":
        # build_artifacts must not configure the root logger (onnxruntime.tools calls basicConfig)
        assert logging.getLogger().handlers == [], logging.getLogger().handlers
        assert sys.modules["onnxruntime.training"].__fedtier_shim__
        from onnxruntime.training import artifacts  # a submodule of the shim package
        assert artifacts.OptimType.SGD
    print("ok", bundle.bundle_id)
""")


@pytest.mark.parametrize("first", ["shim", "artifacts"])
def test_shim_and_artifacts_import_orders(first: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", IMPORT_ORDER_SCRIPT, first, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok ")
    assert "graph_transformer" not in proc.stderr


def test_store_dir_is_created_and_foreign_entries_ignored(tmp_path: Path) -> None:
    store = tmp_path / "deep" / "store"
    bundle = build_artifacts(MLP, store)
    (store / "by-arch" / MLP.sha256).write_text("{garbage")
    again = build_artifacts(MLP, store)  # unreadable index -> rebuild, same id, valid index
    assert again.bundle_id == bundle.bundle_id
    assert json.loads((store / "by-arch" / MLP.sha256).read_text())["bundles"]["0"] == bundle.bundle_id
    shutil.rmtree(store / bundle.bundle_id)
    assert build_artifacts(MLP, store).bundle_id == bundle.bundle_id  # missing dir -> rebuild


def test_a_store_entry_from_before_portable_graphs_is_rebuilt_with_one(tmp_path: Path) -> None:
    """A coordinator upgraded in place: its store's bundles lack the portable graph, so the next
    build of that (arch, seed) makes a new bundle that has one (the old one stays loadable)."""
    import dataclasses

    from fedtier.artifacts.bundle import ROLES

    current = build_artifacts(MLP, tmp_path)
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    for role in ROLES:
        shutil.copy(current.path(role), old_dir / current.files[role].filename)
    old = dataclasses.replace(current, directory=old_dir, files={r: current.files[r] for r in ROLES},
                              portable=None)
    old.save()
    old_dir.rename(tmp_path / old.bundle_id)
    old = ArtifactBundle.load(tmp_path / old.bundle_id)  # what an older fedtier wrote: loads as is
    assert old.portable is None
    artifacts_mod._record(tmp_path, MLP, 0, old.bundle_id)
    rebuilt = build_artifacts(MLP, tmp_path)
    assert rebuilt.bundle_id == current.bundle_id and rebuilt.has_portable_graph
    assert ArtifactBundle.load(tmp_path / old.bundle_id).portable is None

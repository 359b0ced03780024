"""HSGD's ORT artifacts: partner values are graph inputs; ORT training equals the numpy split model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from local_fleet import hsgd_reference as ref
from device_agent.trainers.ort_split import OrtSplitTrainer
from fedtier.artifacts.split_bundle import DESCRIPTOR, SplitBundle
from fedtier.errors import ArtifactError
from fedtier.training import split
from models.split_artifacts import build_split_artifacts

ARCH = split.SplitArch(x1=12, x2=8, d1=8, d2=8, classes=3)


@pytest.fixture(scope="module")
def bundle(artifact_store: Path) -> SplitBundle:
    return build_split_artifacts(ARCH, artifact_store, seed=0)


def test_graph_interfaces_and_content_address(bundle: SplitBundle, artifact_store: Path) -> None:
    import onnx

    device = onnx.load(str(bundle.path("device", "training_model")))
    inputs = [i.name for i in device.graph.input]
    assert inputs[:5] == ["x2", "zeta1", "theta0_w", "theta0_b", "labels"]
    assert {"w2", "b2"} <= set(inputs) and not {"w0", "w1"} & set(inputs)  # only theta2 trains on a device
    host = onnx.load(str(bundle.path("host", "training_model")))
    assert [i.name for i in host.graph.input][:7] == ["x1", "z2", "labels", "w0", "b0", "w1", "b1"]
    assert bundle.directory.name == bundle.bundle_id
    assert build_split_artifacts(ARCH, artifact_store, seed=0).bundle_id == bundle.bundle_id
    assert len(bundle.artifact_files()) == 10 and all(len(v) == 64 for v in bundle.artifact_files().values())


def test_an_altered_file_is_refused(bundle: SplitBundle, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / bundle.bundle_id
    shutil.copytree(bundle.directory, copy)
    target = copy / "device" / json.loads((copy / DESCRIPTOR).read_text())["files"]["device/checkpoint"]["name"]
    target.write_bytes(target.read_bytes()[:-1])
    with pytest.raises(ArtifactError, match="altered"):
        SplitBundle.load(copy)


def test_ort_sides_equal_the_numpy_split_model(bundle: SplitBundle) -> None:
    groups, _ = ref.fixture(0)
    x1, x2, y = groups[0]
    ids = [f"d{i}" for i in range(len(y))]
    p = split.init_params(ARCH, 3)
    rows = tuple(ids[:10])
    host_ort = OrtSplitTrainer(bundle, "host", dict(zip(ids, x1, strict=True)), dict(zip(ids, y, strict=True)))
    host_np = split.SplitTrainer(dict(zip(ids, x1, strict=True)), dict(zip(ids, y, strict=True)))
    hp = {**split.block(p, "theta0"), **split.block(p, "theta1")}
    z2 = split.embed(p, "theta2", x2[:10])
    a, la = host_ort.train("host", hp, {}, z2, rows, 4, 0.1)
    b, lb = host_np.train("host", hp, {}, z2, rows, 4, 0.1)
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-5 and abs(la - lb) < 1e-5
    assert np.abs(host_ort.embed("theta1", hp, rows) - host_np.embed("theta1", hp, rows)).max() < 1e-5
    dev_ort = OrtSplitTrainer(bundle, "device", {"d0": x2[0]}, {"d0": int(y[0])})
    dev_np = split.SplitTrainer({"d0": x2[0]}, {"d0": int(y[0])})
    z1 = split.embed(p, "theta1", x1[:1])
    a, la = dev_ort.train("device", split.block(p, "theta2"), split.block(p, "theta0"), z1, ("d0",), 4, 0.1)
    b, lb = dev_np.train("device", split.block(p, "theta2"), split.block(p, "theta0"), z1, ("d0",), 4, 0.1)
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-5 and abs(la - lb) < 1e-5
    assert max(float(np.abs(a[k] - p[k]).max()) for k in a) > 1e-4  # it trained
    assert np.abs(dev_ort.embed("theta2", a, ("d0",)) - dev_np.embed("theta2", a, ("d0",))).max() < 1e-5


def test_hsgd_on_ort_trainers_equals_hsgd_on_numpy(bundle: SplitBundle) -> None:
    from local_fleet import hsgd_loop
    from fedtier.algorithms.hsgd import HsgdConfig

    groups, _ = ref.fixture(1, sizes=(12, 18))
    cells = hsgd_loop.make_cells(groups)
    config = HsgdConfig(global_interval=4, local_interval=2, alpha=0.5, lr=0.05,
                        hosts={c: d.host for c, d in cells.items()})
    init = split.init_params(ARCH, 0)
    numpy_run = hsgd_loop.run(cells, init, config, rounds=2)
    ort_run = hsgd_loop.run(cells, init, config, rounds=2,
                            make_trainer=lambda side, x, y: OrtSplitTrainer(bundle, side, x, y))
    assert max(float(np.abs(ort_run.params[k] - numpy_run.params[k]).max()) for k in init) < 1e-5
    assert max(float(np.abs(ort_run.params[k] - init[k]).max()) for k in init) > 1e-3

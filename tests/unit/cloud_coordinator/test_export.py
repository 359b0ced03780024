"""Exporting a trained model reads the coordinator's state, never the training data: it works with the
rollout's data files removed, rebuilds artifacts that are gone from the same model, and refuses a model
that was changed since the rollout ran."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from fedtier.cli import cli
from fedtier.runtime.config import dumps_toml, load
from fedtier.rollout.config import RolloutConfig
from fleet_data.split import SplitOptions, split_table
from fleet_data.tables import read_table
from local_fleet.simulate import simulate

MODEL_PY = textwrap.dedent("""
    import torch
    from torch import nn

    def make():
        return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3)), torch.zeros(2, 6)

    def make_cnn():
        net = nn.Sequential(nn.Conv1d(1, 4, kernel_size=3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4, 3))
        return net, torch.zeros(2, 1, 6)
""")


def rollout_on_files(tmp_path: Path, model: dict[str, Any]) -> tuple[Path, np.ndarray]:
    """A rollout file over a CSV split into 4 device shards and a central test set; returns it and the test rows."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((240, 6))
    y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0.5).astype(int)
    rows = [",".join(f"{v:.5f}" for v in r) + f",{c}" for r, c in zip(x, y, strict=True)]
    (tmp_path / "table.csv").write_text("a,b,c,d,e,f,label\n" + "\n".join(rows) + "\n")
    split_table(read_table(tmp_path / "table.csv", "label"), SplitOptions(devices=4, test_fraction=0.2),
                tmp_path / "shards")
    (tmp_path / "model.py").write_text(MODEL_PY)
    config = tmp_path / "rollout.toml"
    config.write_text(dumps_toml({
        "rollout": "own", "rounds": 2, "seed": 5, "state_dir": "state", "artifact_store": "artifacts",
        "model": model, "topology": {"cells": 2, "devices_per_cell": 2},
        "data": {"dataset": "files", "dir": "shards", "eval_file": "shards/test.npz"},
        "fedavg": {"local_steps": 4, "lr": 0.1, "batch_size": 8},
    }))
    test = np.load(tmp_path / "shards" / "test.npz")["x"].astype(np.float32)
    return config, test


def export(config: Path, out: Path) -> None:
    result = CliRunner().invoke(cli, ["coordinator", "export", "--config", str(config), "--out", str(out)])
    assert result.exit_code == 0, result.output


def predictions(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {session.get_inputs()[0].name: x})
    return np.asarray(logits)


@pytest.mark.parametrize("model", [{"kind": "mlp", "hidden": [8]}, {"kind": "torch", "factory": "model.py:make"}],
                         ids=["built-in", "torch-factory"])
def test_export_works_with_the_rollouts_data_and_artifacts_removed(tmp_path: Path, model: dict[str, Any]) -> None:
    # Prepare: train the rollout, export it as a user would while everything is still there.
    config, test = rollout_on_files(tmp_path, model)
    cfg = load(RolloutConfig, config)
    simulate(cfg, workdir=cfg.state_dir)
    export(config, tmp_path / "before.onnx")
    expected = predictions(tmp_path / "before.onnx", test)
    # Execute: the training data is gone, then the artifacts too (a coordinator moved to another disk).
    shutil.rmtree(tmp_path / "shards")
    export(config, tmp_path / "without-data.onnx")
    shutil.rmtree(tmp_path / "artifacts")
    export(config, tmp_path / "without-artifacts.onnx")
    # Assert: the same model both times, from the store and the model alone.
    np.testing.assert_array_equal(predictions(tmp_path / "without-data.onnx", test), expected)
    np.testing.assert_allclose(predictions(tmp_path / "without-artifacts.onnx", test), expected, rtol=0, atol=1e-6)


def test_export_refuses_a_model_changed_since_the_rollout_when_its_artifacts_are_gone(tmp_path: Path) -> None:
    config, _ = rollout_on_files(tmp_path, {"kind": "torch", "factory": "model.py:make"})
    cfg = load(RolloutConfig, config)
    simulate(cfg, workdir=cfg.state_dir)
    shutil.rmtree(tmp_path / "artifacts")
    (tmp_path / "model.py").write_text(MODEL_PY.replace("nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3)",
                                                        "nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)"))

    result = CliRunner().invoke(cli, ["coordinator", "export", "--config", str(config), "--out",
                                      str(tmp_path / "m.onnx")])

    assert result.exit_code == 2
    assert "[model]" in result.output and "was the model changed since the rollout ran?" in result.output
    assert not (tmp_path / "m.onnx").exists()


def test_an_exported_cnn_takes_the_datas_rows_and_states_its_interface(tmp_path: Path) -> None:
    # Prepare: a 1-D CNN whose example is (1, 6), trained on rows of 6 features.
    config, test = rollout_on_files(tmp_path, {"kind": "torch", "factory": "model.py:make_cnn"})
    cfg = load(RolloutConfig, config)
    simulate(cfg, workdir=cfg.state_dir)
    # Execute
    result = CliRunner().invoke(cli, ["coordinator", "export", "--config", str(config), "--out",
                                      str(tmp_path / "cnn.onnx")])
    # Assert: rows in, as the devices trained on them; the same logits as the network on (batch, 1, 6).
    assert result.exit_code == 0, result.output
    import onnxruntime

    session = onnxruntime.InferenceSession(str(tmp_path / "cnn.onnx"), providers=["CPUExecutionProvider"])
    (given,) = session.get_inputs()
    assert (given.name, given.shape, given.type) == ("input", ["batch", 6], "tensor(float)")
    logits = predictions(tmp_path / "cnn.onnx", test)
    assert logits.shape == (len(test), 3)
    from cloud_coordinator.export import shipped_bundle
    from cloud_coordinator.store import CoordinatorStore
    from device_agent.trainers.ort import OrtTrainer
    from fedtier.security.signing import open_manifest

    store = CoordinatorStore(cfg.store_location)
    model, raw = store.latest_model("own"), store.manifest("own")
    store.close()
    assert model is not None and raw is not None
    trainer = OrtTrainer(shipped_bundle(cfg, open_manifest(raw, {})))
    trainer.set_parameters(model.params)
    unreshaped = trainer.export_inference(tmp_path / "as-trained.onnx", ["logits"])
    np.testing.assert_allclose(predictions(unreshaped, test.reshape(-1, 1, 6)), logits, rtol=0, atol=1e-6)
    # ... and it says so, printed and beside the file.
    doc = json.loads((tmp_path / "cnn.onnx.json").read_text())
    assert doc["inputs"] == [{"name": "input", "shape": ["batch", 6], "dtype": "float32"}]
    assert doc["outputs"] == [{"name": "logits", "shape": ["batch", 3], "dtype": "float32"}]
    assert doc["example_shape"] == [1, 6] and doc["loss"] == "cross_entropy" and "largest" in doc["reading"]
    assert (doc["rollout"], doc["version"], doc["round"]) == ("own", model.version, model.round)
    assert "  input  'input': float32 (batch, 6); rows of 6 features are reshaped to (1, 6) inside the model" \
        in result.output
    assert "  output 'logits': float32 (batch, 3): one score (logit) per class" in result.output
    assert f"described in {tmp_path / 'cnn.onnx.json'}" in result.output


def test_a_row_model_is_exported_as_it_is_and_described(tmp_path: Path) -> None:
    config, test = rollout_on_files(tmp_path, {"kind": "mlp", "hidden": [8]})
    cfg = load(RolloutConfig, config)
    simulate(cfg, workdir=cfg.state_dir)
    result = CliRunner().invoke(cli, ["coordinator", "export", "--config", str(config), "--out",
                                      str(tmp_path / "mlp.onnx"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["interface"]["inputs"] == [{"name": "input", "shape": ["batch", 6], "dtype": "float32"}]
    assert "example_shape" not in doc["interface"] and doc["description"] == str(tmp_path / "mlp.onnx.json")
    assert json.loads((tmp_path / "mlp.onnx.json").read_text()) == doc["interface"]
    import onnx

    assert [n.op_type for n in onnx.load(str(tmp_path / "mlp.onnx")).graph.node][0] != "Reshape"
    assert predictions(tmp_path / "mlp.onnx", test).shape == (len(test), 3)

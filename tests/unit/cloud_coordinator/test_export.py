"""Exporting a trained model reads the coordinator's state, never the training data: it works with the
rollout's data files removed, rebuilds artifacts that are gone from the same model, and refuses a model
that was changed since the rollout ran."""

from __future__ import annotations

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

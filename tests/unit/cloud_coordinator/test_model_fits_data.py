"""A user's model against the labels, before any round: the output width against the classes (a warning with
the numbers when it works, a refusal naming [model] loss and the fix when it cannot), and the same words on a
device that meets labels its model cannot train on."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_coordinator.rollout import prepare
from device_agent.data import LocalData, fit_to_model
from fedtier.errors import ConfigError
from fedtier.rollout.config import RolloutConfig
from fedtier.training.layout import ArchSpec

MODEL_PY = textwrap.dedent("""
    import torch
    from torch import nn

    def outputs(n):
        return lambda: (nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, n)), torch.zeros(2, 6))

    five, two, one = outputs(5), outputs(2), outputs(1)
""")


def rollout(tmp_path: Path, artifact_store: Path, labels: np.ndarray, factory: str, loss: str) -> RolloutConfig:
    """A rollout of the factory in model.py, evaluated on a central test set with ``labels``."""
    (tmp_path / "model.py").write_text(MODEL_PY)
    x = np.random.default_rng(0).standard_normal((len(labels), 6)).astype(np.float32)
    np.savez(tmp_path / "test.npz", x=x, y=labels)
    mapping: dict[str, Any] = {
        "rollout": "fits", "rounds": 1, "state_dir": str(tmp_path / "state"), "artifact_store": str(artifact_store),
        "model": {"kind": "torch", "factory": f"{tmp_path / 'model.py'}:{factory}", "loss": loss},
        "data": {"dataset": "files", "eval_file": str(tmp_path / "test.npz")},
        "topology": {"cells": 1, "devices_per_cell": 2},
    }
    return RolloutConfig.from_mapping(mapping)


def test_more_outputs_than_classes_is_a_warning_with_the_numbers(tmp_path: Path, artifact_store: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    cfg = rollout(tmp_path, artifact_store, np.arange(30) % 3, "five", "cross_entropy")
    with caplog.at_level(logging.WARNING, logger="fedtier.coordinator"):
        prepared = prepare(cfg)
    assert prepared.model_arch.num_classes == 5  # it still trains
    assert [r.getMessage() for r in caplog.records] == [
        "the model has 5 outputs and the data 3 classes (labels 0..2): outputs 3..4 never match a label. Training "
        "works; if no label above 2 exists, give the model 3 outputs ([model])"]


@pytest.mark.parametrize("labels,factory,loss,match", [
    (np.arange(20) % 2, "two", "bce", r"loss = 'bce' trains one output per target column: the data's targets have 1 "
                                      r"column per example .* the model has 2 outputs: for labels 0/1 give the model "
                                      r"one output .* or keep its 2 outputs and set loss = 'cross_entropy'"),
    (np.tile([[0.0, 1.0, 0.5]], (10, 1)), "two", "mse", "targets have 3 columns .* give the model 3 outputs"),
    (np.arange(10) % 3, "one", "bce", r"targets in \[0, 1\]; the data's span \[0, 2\]: use cross_entropy"),
    (np.linspace(0.5, 2.5, 10), "five", "cross_entropy", r"class numbers 0, 1, ...; the data's labels are numbers "
                                                         r"in \[0.5, 2.5\].*use loss = 'mse'"),
], ids=["bce-two-outputs-on-0-1", "mse-width", "bce-range", "classes-of-floats"])
def test_outputs_that_cannot_fit_the_labels_are_refused_naming_model_loss_and_the_fix(
        tmp_path: Path, artifact_store: Path, labels: np.ndarray, factory: str, loss: str, match: str) -> None:
    cfg = rollout(tmp_path, artifact_store, labels, factory, loss)
    with pytest.raises(ConfigError, match=match) as refused:
        prepare(cfg)
    assert refused.value.key == "model.loss"
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def test_a_device_names_the_rollouts_loss_and_the_fix() -> None:
    arch = ArchSpec("onnx", {"sha256": "0" * 64, "input_shape": [6], "outputs": 2, "loss": "bce"})
    data = LocalData(x=np.zeros((4, 6), np.float32), y=np.array([0, 1, 1, 0]))
    with pytest.raises(ConfigError, match=r"the rollout's \[model\] loss = 'bce' trains one model output per target "
                                          r"column: local labels have 1 column\(s\) per example .* model has 2 "
                                          r"output\(s\); fix the rollout's \[model\]: .*loss = 'cross_entropy'"):
        fit_to_model(data, arch)

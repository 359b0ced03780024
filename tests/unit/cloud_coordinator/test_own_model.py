"""Your own model in a rollout: torch factory and ONNX file train the same, federated evaluation,
regression, and the config errors a newcomer meets."""

from __future__ import annotations

import importlib.util
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedtier.rollout.config import RolloutConfig
from cloud_coordinator.rollout import prepare
from local_fleet.simulate import simulate
from fedtier.errors import ConfigError
from fedtier.runtime.config import load

MODEL_PY = textwrap.dedent("""
    import torch
    from torch import nn

    def make():
        return nn.Sequential(nn.Linear(64, 24), nn.ReLU(), nn.Linear(24, 10)), torch.zeros(4, 64)

    def regressor():
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)), torch.zeros(1, 5)

    def not_a_model():
        return {"layers": 2}, torch.zeros(1, 64)
""")


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL_PY)
    return path


def base(tmp_path: Path, artifact_store: Path, **overrides: Any) -> dict[str, Any]:
    mapping: dict[str, Any] = {
        "rollout": "own", "rounds": 3, "seed": 11, "state_dir": str(tmp_path / "state"),
        "artifact_store": str(artifact_store),
        "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5, "seed": 2, "holdout": 0.2},
        "topology": {"cells": 2, "devices_per_cell": 2},
        "fedavg": {"local_steps": 8, "lr": 0.2, "batch_size": 16},
    }
    for key, value in overrides.items():
        mapping[key] = {**mapping[key], **value} if isinstance(value, dict) and key in mapping else value
    return mapping


def export_as_a_user_would(model_file: Path, seed: int, path: Path) -> Path:
    """Import the factory, seed torch, build, and export with dynamic batch axes (not via fedtier)."""
    import torch

    spec = importlib.util.spec_from_file_location("users_model", model_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(seed)
    net, example = module.make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter's notice
        torch.onnx.export(net, (example,), str(path), dynamo=False, input_names=["pixels"], output_names=["logits"],
                          dynamic_axes={"pixels": {0: "batch"}, "logits": {0: "batch"}})
    return path


def test_a_torch_factory_and_its_onnx_export_train_to_the_same_model(model_file: Path, tmp_path: Path,
                                                                     artifact_store: Path) -> None:
    # Prepare: the same network as a factory (kind = torch, init_seed 7) and as the user's own ONNX
    # export of it under torch.manual_seed(7) (kind = onnx): same initial weights, same data and seeds.
    onnx_file = export_as_a_user_would(model_file, 7, tmp_path / "model.onnx")
    as_torch = RolloutConfig.from_mapping(base(tmp_path / "a", artifact_store, model={
        "kind": "torch", "factory": f"{model_file}:make", "init_seed": 7}))
    as_onnx = RolloutConfig.from_mapping(base(tmp_path / "b", artifact_store, model={
        "kind": "onnx", "path": str(onnx_file)}))
    # Execute: 3 rounds of FedAvg each in the simulator.
    torch_run, onnx_run = simulate(as_torch), simulate(as_onnx)
    # Assert: two different graphs (the artifacts' identity is the graph, not a name) ...
    assert torch_run.prepared.arch.options["sha256"] != onnx_run.prepared.arch.options["sha256"]
    for name, value in torch_run.prepared.initial_params.items():
        np.testing.assert_array_equal(onnx_run.prepared.initial_params[name], value)
    # ... the same model after 3 rounds, which has learnt (not just stayed at its start).
    assert set(torch_run.params) == set(onnx_run.params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, value in torch_run.params.items():
        np.testing.assert_allclose(onnx_run.params[name], value, rtol=0, atol=1e-5)
        assert not np.allclose(value, torch_run.prepared.initial_params[name])
    assert [r["accuracy"] for r in torch_run.rounds] == pytest.approx([r["accuracy"] for r in onnx_run.rounds],
                                                                      abs=1e-6)
    assert torch_run.rounds[-1]["accuracy"] > 0.3  # 10 classes: chance is 0.1


def test_federated_evaluation_is_the_global_models_accuracy_on_every_held_out_row(
        model_file: Path, tmp_path: Path, artifact_store: Path) -> None:
    # Prepare: each device holds out 20 % of its rows.
    cfg = RolloutConfig.from_mapping(base(tmp_path, artifact_store, rounds=2, model={
        "kind": "torch", "factory": f"{model_file}:make"}))
    # Execute
    result = simulate(cfg)
    # Assert: round 0 reports the initial model, evaluated on the union of the devices' held-out rows
    # (count-weighted means are the mean over all rows); round 1 the model round 0 produced.
    from device_agent.trainers import make_trainer

    prepared = result.prepared
    rows = list(prepared.data.holdout.values())
    x, y = np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])
    trainer = make_trainer("ort", prepared.bundle)
    for row, params in zip(result.rounds, [prepared.initial_params, None], strict=True):
        if params is not None:
            trainer.set_parameters(params)
            expected = trainer.evaluate(x, y)
            federated = row["federated"]
            assert federated["examples"] == len(y) and federated["devices"] == 4
            assert federated["accuracy"] == pytest.approx(expected.accuracy, abs=1e-9)
            assert federated["loss"] == pytest.approx(expected.loss, rel=1e-5)
            assert federated["model_version"] == 0
    assert result.rounds[1]["federated"]["model_version"] == 1
    assert result.rounds[1]["federated"]["accuracy"] > result.rounds[0]["federated"]["accuracy"]


def test_a_regression_model_trains_on_split_files_and_reports_losses_without_accuracy(
        model_file: Path, tmp_path: Path, artifact_store: Path) -> None:
    # Prepare: a CSV of 5 readings and a float target, split iid over 4 devices with a central test set.
    from fleet_data.split import SplitOptions, split_table
    from fleet_data.tables import read_table

    rng = np.random.default_rng(5)
    x = rng.standard_normal((400, 5))
    y = x @ np.array([0.5, -1.0, 0.25, 0.0, 2.0]) + 0.05 * rng.standard_normal(400)
    lines = ["a,b,c,d,e,target", *(",".join(f"{v:.6f}" for v in (*row, t)) for row, t in zip(x, y, strict=True))]
    (tmp_path / "readings.csv").write_text("\n".join(lines) + "\n")
    split_table(read_table(tmp_path / "readings.csv", "target"), SplitOptions(devices=4, test_fraction=0.2),
                tmp_path / "shards")
    cfg = RolloutConfig.from_mapping(base(
        tmp_path, artifact_store, rounds=4,
        model={"kind": "torch", "factory": f"{model_file}:regressor", "loss": "mse"},
        data={"dataset": "files", "dir": str(tmp_path / "shards"), "eval_file": str(tmp_path / "shards/test.npz"),
              "partition": "iid", "holdout": 0.0}, fedavg={"lr": 0.05}))
    # Execute
    result = simulate(cfg)
    # Assert: the loss falls on the central test set and on the held-out rows; mse has no accuracy.
    losses = [r["loss"] for r in result.rounds]
    assert losses[-1] < 0.5 * losses[0]
    assert all(r["accuracy"] is None for r in result.rounds)
    federated = [r["federated"] for r in result.rounds]
    assert all(f["accuracy"] is None and f["devices"] == 4 for f in federated)
    assert federated[-1]["loss"] < federated[0]["loss"]


def test_hist_refuses_a_model_it_cannot_split(model_file: Path, tmp_path: Path, artifact_store: Path) -> None:
    with pytest.raises(ConfigError, match="hist partitions the hidden neurons of the built-in mlp; a torch model") \
            as caught:
        RolloutConfig.from_mapping(base(tmp_path, artifact_store, algorithm="hist",
                                        model={"kind": "torch", "factory": f"{model_file}:make"}))
    assert caught.value.key == "model.kind"


@pytest.mark.parametrize("model,key,match", [
    ({"kind": "torch"}, "model.factory", "required for kind = 'torch'"),
    ({"kind": "torch", "factory": "elsewhere.py:make"}, "model.factory", "file not found"),
    ({"kind": "onnx"}, "model.path", "required for kind = 'onnx'"),
    ({"kind": "onnx", "path": "absent.onnx"}, "model.path", "file not found"),
    ({"kind": "torch", "factory": "model.py:make", "loss": "hinge"}, "model.loss", "must be one of"),
    ({"kind": "mlp", "loss": "bce"}, "model.loss", "the built-in mlp trains with cross_entropy"),
    ({"kind": "mlp", "factory": "model.py:make"}, "model.factory", "is for kind = 'torch'"),
    ({"kind": "torch", "factory": "model.py:make", "trainable": ["0.weight"]}, "model.trainable",
     "is for kind = 'onnx'"),
])
def test_a_bad_model_section_names_its_key(model_file: Path, tmp_path: Path, model: dict, key: str,
                                          match: str) -> None:
    config = tmp_path / "rollout.toml"
    lines = ["[model]", *(f"{k} = {v!r}".replace("'", '"') for k, v in model.items())]
    config.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=match) as caught:
        load(RolloutConfig, config)
    assert caught.value.key == key and caught.value.source == str(config)


def test_a_factory_file_is_found_relative_to_the_config(model_file: Path, tmp_path: Path) -> None:
    config = tmp_path / "sub" / "rollout.toml"
    config.parent.mkdir()
    config.write_text('[model]\nkind = "torch"\nfactory = "../model.py:make"\n')
    assert load(RolloutConfig, config).model.factory == f"{model_file}:make"


@pytest.mark.parametrize("model,data,key,match", [
    ({"kind": "torch", "factory": "{dir}/model.py:not_a_model"}, {}, "model.factory",
     "returned dict where a torch.nn.Module belongs"),
    ({"kind": "torch", "factory": "{dir}/model.py:regressor", "loss": "mse"}, {}, "data", "the model takes (5,)"),
    ({"kind": "mlp"}, {"dataset": "files", "holdout": 0.0}, "data.dir", "takes its input and output sizes"),
])
def test_a_model_that_does_not_fit_is_refused_before_anything_is_built(
        model_file: Path, tmp_path: Path, artifact_store: Path, model: dict, data: dict, key: str,
        match: str) -> None:
    model = {k: v.format(dir=model_file.parent) if isinstance(v, str) else v for k, v in model.items()}
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")) as caught:
        prepare(RolloutConfig.from_mapping(base(tmp_path, artifact_store, model=model, data=data)))
    assert caught.value.key == key


def test_a_central_test_csv_without_its_label_column_names_key_and_file(model_file: Path, tmp_path: Path,
                                                                         artifact_store: Path) -> None:
    (tmp_path / "test.csv").write_text("p0,p1,digit\n0.5,0.25,3\n")
    cfg = RolloutConfig.from_mapping(base(tmp_path, artifact_store, model={
        "kind": "torch", "factory": f"{model_file}:make"}, data={
        "dataset": "files", "holdout": 0.0, "eval_file": str(tmp_path / "test.csv"), "label_column": "label"}))
    with pytest.raises(ConfigError, match="no column 'label'; the header has") as caught:
        prepare(cfg)
    assert caught.value.key == "data.label_column" and caught.value.source == str(tmp_path / "test.csv")


def test_simulating_needs_every_devices_data(model_file: Path, tmp_path: Path, artifact_store: Path) -> None:
    # A coordinator of a user model runs without the devices' data; the simulator cannot.
    cfg = RolloutConfig.from_mapping(base(tmp_path, artifact_store, model={
        "kind": "torch", "factory": f"{model_file}:make"}, data={"dataset": "files", "holdout": 0.0}))
    assert prepare(cfg).data.train == {}
    with pytest.raises(ConfigError, match="set \\[data\\] dir") as caught:
        simulate(cfg)
    assert caught.value.key == "data.dir"


def test_simulated_devices_on_the_portable_backend_train_a_bce_model_with_frozen_tensors_like_ort(
        tmp_path: Path, artifact_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[simulation] trainer = "portable": the devices train from the bundle's standard-ONNX graph, as boards
    without onnxruntime-training do; a model with 3 bce outputs and frozen tensors ends where ort's does."""
    # Prepare: soft targets of 3 outputs from 12 readings, split iid over 4 devices with held-out rows.
    from fleet_data.split import SplitOptions, split_table
    from fleet_data.tables import read_table
    from portable_models import write_models

    rng = np.random.default_rng(9)
    x = rng.standard_normal((320, 12)).astype(np.float32)
    y = (1 / (1 + np.exp(-x[:, :3] @ rng.standard_normal((3, 3))))).astype(np.float32)
    np.savez(tmp_path / "readings.npz", x=x, y=y)
    split_table(read_table(tmp_path / "readings.npz"), SplitOptions(devices=4, holdout=0.2, test_fraction=0.2),
                tmp_path / "shards")
    models = write_models(tmp_path / "models")

    def config(trainer: str) -> RolloutConfig:
        return RolloutConfig.from_mapping(base(
            tmp_path / trainer, artifact_store, rounds=3, simulation={"trainer": trainer},
            model={"kind": "torch", "factory": f"{models}/user.py:bce", "loss": "bce"},
            data={"dataset": "files", "dir": str(tmp_path / "shards"), "eval_file": str(tmp_path / "shards/test.npz"),
                  "partition": "iid", "holdout": 0.0}))

    from device_agent.trainers.portable import PortableTrainer

    portable_steps = []
    real_train_steps = PortableTrainer.train_steps

    def counted(self: PortableTrainer, batches: Any, lr: float) -> Any:
        stats = real_train_steps(self, batches, lr)
        portable_steps.append(stats.steps)
        return stats

    monkeypatch.setattr(PortableTrainer, "train_steps", counted)
    # Execute
    ort = simulate(config("ort"))
    assert portable_steps == []
    portable = simulate(config("portable"))
    # Assert: the portable backend trained every device's every round ...
    assert len(portable_steps) == 3 * 4 and set(portable_steps) == {8}
    # ... to the same model (which learnt), the same central and federated evaluations every round.
    assert portable.prepared.bundle.bundle_id == ort.prepared.bundle.bundle_id
    assert portable.prepared.bundle.has_portable_graph
    assert portable.prepared.bundle.layout.names == ("body.weight", "head.weight", "head.bias")  # the rest is frozen
    for name, value in ort.params.items():
        np.testing.assert_allclose(portable.params[name], value, rtol=0, atol=1e-5, err_msg=name)
        assert not np.allclose(value, ort.prepared.initial_params[name])
    for ours, theirs in zip(portable.rounds, ort.rounds, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-6)
        assert ours["federated"]["loss"] == pytest.approx(theirs["federated"]["loss"], rel=1e-5)
        assert ours["federated"]["accuracy"] == pytest.approx(theirs["federated"]["accuracy"], abs=1e-6)
    assert ort.rounds[-1]["loss"] < ort.rounds[0]["loss"]

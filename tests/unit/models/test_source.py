"""models.source: one entry for a built-in, torch-factory or ONNX-file model; clear errors for bad ones."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from fedtier.errors import ConfigError
from fedtier.training.layout import ArchSpec
from models.artifacts import build_artifacts
from models.source import call_factory, model_source

FACTORY = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, width=WIDTH):
            super().__init__()
            self.body = nn.Linear(6, width)
            self.head = nn.Linear(width, 3)
            self.register_buffer("scale", torch.full((6,), 0.5))

        def forward(self, x):
            return self.head(torch.tanh(self.body(x.reshape(x.shape[0], -1) * self.scale)))

    def make():
        return Net(), torch.zeros(2, 2, 3)

    def not_a_module():
        return "model", torch.zeros(2, 6)

    def only_a_module():
        return Net()

    def broken():
        raise RuntimeError("no weights file")

    def vector_output():
        return nn.Sequential(nn.Linear(6, 1), nn.Flatten(0)), torch.zeros(2, 6)
""")


def write_factory(directory: Path, width: int = 5) -> Path:
    path = directory / "net.py"
    path.write_text(FACTORY.replace("WIDTH", str(width)))
    return path


def export(directory: Path, seed: int = 0, name: str = "net.onnx", **kwargs: object) -> Path:
    """The factory's model exported as a user would: default exporter settings, their own names."""
    import warnings

    import torch

    module, example = call_factory(f"{write_factory(directory)}:make", seed)
    path = directory / name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter's notice
        torch.onnx.export(module, (example,), str(path), dynamo=False, input_names=["readings"],
                          output_names=["scores"], **kwargs)  # type: ignore[arg-type]
    return path


def test_a_torch_factory_becomes_an_onnx_architecture_identified_by_its_graph(tmp_path: Path) -> None:
    factory = f"{write_factory(tmp_path)}:make"
    source = model_source(factory=factory, seed=3)
    # Parameters with requires_grad are trained; the buffer stays frozen.
    assert source.layout.names == ("body.weight", "body.bias", "head.weight", "head.bias")
    assert source.frozen == ("scale",)
    assert source.arch.kind == "onnx" and source.arch.input_shape == (2, 3) and source.arch.num_classes == 3
    # The initial weights are the factory's under torch.manual_seed(init_seed), whatever the global RNG.
    module, _ = call_factory(factory, 3)
    for name, value in module.state_dict().items():
        if name in source.initial_params:
            np.testing.assert_array_equal(source.initial_params[name], value.numpy())
    again = model_source(factory=factory, seed=3)
    other_seed = model_source(factory=factory, seed=4)
    assert again.arch == source.arch and other_seed.arch != source.arch


def test_a_changed_model_is_a_new_architecture_and_never_a_stale_cache_hit(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = build_artifacts(model_source(factory=f"{write_factory(tmp_path, width=5)}:make"), store)
    second = build_artifacts(model_source(factory=f"{write_factory(tmp_path, width=7)}:make"), store)
    assert first.bundle_id != second.bundle_id
    assert second.layout.spec("body.weight").shape == (7, 6)


def test_an_onnx_file_trains_its_float_initializers_or_those_listed(tmp_path: Path) -> None:
    # An export without a dynamic batch axis bakes the example's batch size into the graph.
    with pytest.raises(ConfigError, match="export it with a dynamic batch axis"):
        model_source(onnx_path=export(tmp_path, name="fixed.onnx"))
    path = export(tmp_path, dynamic_axes={"readings": {0: "n"}, "scores": {0: "n"}})
    everything = model_source(onnx_path=path)
    assert set(everything.layout.names) == {"body.weight", "body.bias", "head.weight", "head.bias", "scale"}
    head_only = model_source(onnx_path=path, trainable=["head.weight", "head.bias"])
    assert head_only.layout.names == ("head.weight", "head.bias")
    assert set(head_only.frozen) == {"body.weight", "body.bias", "scale"}
    bundle = build_artifacts(head_only, tmp_path / "store")
    from device_agent.trainers import make_trainer

    trainer = make_trainer("ort", bundle)
    before = trainer.get_parameters()
    rng = np.random.default_rng(0)
    trainer.train_steps([(rng.standard_normal((8, 2, 3)).astype(np.float32), rng.integers(0, 3, 8))], 0.5)
    after = trainer.get_parameters()
    assert set(after) == {"head.weight", "head.bias"}
    assert not np.array_equal(before["head.weight"], after["head.weight"])


def test_the_built_in_models_keep_their_identity(tmp_path: Path) -> None:
    arch = ArchSpec("mlp", {"sizes": [4, 3, 2]})
    assert model_source(arch=arch).arch == arch
    assert build_artifacts(model_source(arch=arch, seed=2), tmp_path).bundle_id == \
        build_artifacts(arch, tmp_path, seed=2).bundle_id


@pytest.mark.parametrize("spec,match", [
    ("{dir}/missing.py:make", "file not found"),
    ("{dir}/net.py:nothing_here", "has no function 'nothing_here'"),
    ("{dir}/net.py:not_a_module", "returned str where a torch.nn.Module belongs"),
    ("{dir}/net.py:only_a_module", r"must return \(torch.nn.Module, example input batch\)"),
    ("{dir}/net.py:broken", "raised RuntimeError: no weights file"),
    ("{dir}/net.py:vector_output", r"fedtier trains models whose output is \(batch, outputs\)"),
    ("no_such_package_xyz.models:make", "cannot import module 'no_such_package_xyz.models'"),
    ("net.py", "is not 'package.module:function'"),
])
def test_a_bad_factory_is_a_config_error_naming_model_factory(tmp_path: Path, spec: str, match: str) -> None:
    write_factory(tmp_path)
    with pytest.raises(ConfigError, match=match) as caught:
        model_source(factory=spec.format(dir=tmp_path))
    assert caught.value.key == "model.factory"


def _graph(tmp_path: Path, name: str, *, weight_type: int = 1, two_inputs: bool = False,
           reshape_batch: int | None = None) -> Path:
    import onnx
    from onnx import helper, numpy_helper

    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])]
    inits = [numpy_helper.from_array(np.ones((2, 4), np.float32 if weight_type == 1 else np.int64), "W")]
    nodes = []
    source = "x"
    if reshape_batch is not None:  # a batch size baked into the graph
        inits.append(numpy_helper.from_array(np.array([reshape_batch, 4], np.int64), "shape"))
        nodes.append(helper.make_node("Reshape", ["x", "shape"], ["x2"]))
        source = "x2"
    if weight_type == 1:
        nodes.append(helper.make_node("Gemm", [source, "W"], ["y"], transB=1))
    else:
        nodes.append(helper.make_node("Identity", [source], ["y"]))
    if two_inputs:
        inputs.append(helper.make_tensor_value_info("mask", onnx.TensorProto.FLOAT, ["n", 4]))
    outputs = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 2 if weight_type == 1 else 4])]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("kwargs,key,match", [
    ({"onnx_path": "{dir}/absent.onnx"}, "model.path", "file not found"),
    ({"onnx_path": "{dir}/garbage.onnx"}, "model.path", "not a readable ONNX model"),
    ({"onnx_path": "{dir}/ints.onnx"}, "model.path", "no float initializers to train"),
    ({"onnx_path": "{dir}/two.onnx"}, "model.path", "2 data inputs"),
    ({"onnx_path": "{dir}/fixed.onnx"}, "model.path", "does not run on a batch of 3"),
    ({"onnx_path": "{dir}/ok.onnx", "trainable": ["W", "bias"]}, "model.trainable",
     r"\['bias'\] are not float initializers"),
    ({"onnx_path": "{dir}/ok.onnx", "loss": "hinge"}, "model.loss", "unknown loss 'hinge'"),
    ({"onnx_path": "{dir}/ok.onnx", "loss": "cross_entropy"}, None, None),
    ({"arch": ArchSpec("mlp", {"sizes": [4, 2]}), "loss": "mse"}, "model.loss", "trains with cross_entropy"),
])
def test_a_bad_onnx_model_is_a_config_error_naming_the_key(tmp_path: Path, kwargs: dict, key: str | None,
                                                           match: str | None) -> None:
    _graph(tmp_path, "ok.onnx")
    _graph(tmp_path, "ints.onnx", weight_type=7)
    _graph(tmp_path, "two.onnx", two_inputs=True)
    _graph(tmp_path, "fixed.onnx", reshape_batch=2)
    (tmp_path / "garbage.onnx").write_bytes(b"\x08\x01garbage")
    args = {k: v.format(dir=tmp_path) if isinstance(v, str) and "{dir}" in v else v for k, v in kwargs.items()}
    if key is None:  # the well-formed graph resolves (2 outputs: fine for cross_entropy)
        assert model_source(**args).arch.num_classes == 2
        return
    with pytest.raises(ConfigError, match=match) as caught:
        model_source(**args)
    assert caught.value.key == key


def test_cross_entropy_needs_an_output_per_class(tmp_path: Path) -> None:
    import warnings

    import torch

    module = torch.nn.Linear(4, 1)
    path = tmp_path / "one.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter's notice
        torch.onnx.export(module, (torch.zeros(1, 4),), str(path), dynamo=False)
    with pytest.raises(ConfigError, match="cross_entropy needs one output per class"):
        model_source(onnx_path=path)
    assert model_source(onnx_path=path, loss="bce").arch.loss == "bce"


def test_a_rollout_asks_the_zoo_once_for_its_model(small_rollout, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Before models.source, one cold prepare computed the same layout five times (layout_of x3,
    initial_parameters x2, from models/artifacts.py, models/export.py and the rollout)."""
    import models.zoo as zoo
    from cloud_coordinator.rollout import prepare

    calls: list[str] = []
    real = zoo._param_table

    def counting(arch: ArchSpec) -> list:
        calls.append(arch.kind)
        return real(arch)

    monkeypatch.setattr(zoo, "_param_table", counting)
    cfg = small_rollout(artifact_store=str(tmp_path / "cold-store"))
    prepare(cfg)  # cold: builds the artifacts
    assert calls == ["mlp"]
    calls.clear()
    prepare(cfg)  # warm: the store has them
    assert calls == ["mlp"]

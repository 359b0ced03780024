"""Model zoo and ONNX export: layouts, deterministic init, export fidelity and checks."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from fedtier.errors import ArtifactError, LocalProtocolError
from fedtier.training.layout import ArchSpec
from models.export import OPSET, _check_initializers, export_forward
from models.zoo import build_model, initial_parameters, layout_of

ARCHS = {
    "mlp-64": ArchSpec("mlp", {"sizes": [64, 64, 10]}),
    "mlp-300": ArchSpec("mlp", {"sizes": [64, 300, 10]}),
    "mlp-deep": ArchSpec("mlp", {"sizes": [8, 16, 16, 3]}),
    "cnn1d": ArchSpec("cnn1d", {"channels": 3, "length": 32, "classes": 5, "filters": [8, 16],
                                "kernel": 5}),
    "cnn1d-default": ArchSpec("cnn1d", {"channels": 2, "length": 20, "classes": 4}),
}


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_layout_matches_state_dict(name: str) -> None:
    arch = ARCHS[name]
    model = build_model(arch, seed=0)
    state = model.state_dict()
    layout = layout_of(arch)
    assert list(layout.names) == list(state)
    for spec in layout.params:
        assert tuple(state[spec.name].shape) == spec.shape
        assert spec.dtype == "float32"


def test_layout_names_are_readable() -> None:
    assert layout_of(ARCHS["mlp-64"]).names == ("fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias")
    assert layout_of(ARCHS["cnn1d-default"]).names == (
        "conv0.weight", "conv0.bias", "conv1.weight", "conv1.bias", "head.weight", "head.bias")
    assert layout_of(ARCHS["cnn1d-default"]).spec("conv1.weight").shape == (32, 16, 5)


@pytest.mark.parametrize("name", ["mlp-64", "cnn1d"])
def test_initial_parameters_deterministic(name: str) -> None:
    arch = ARCHS[name]
    a, b, c = initial_parameters(arch, 3), initial_parameters(arch, 3), initial_parameters(arch, 4)
    assert list(a) == list(layout_of(arch).names)
    for key in a:
        assert a[key].dtype == np.float32 and a[key].flags.c_contiguous
        np.testing.assert_array_equal(a[key], b[key])
        assert not np.array_equal(a[key], c[key])
    # torch-default-like scale: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    fan_in = 64 if name == "mlp-64" else 3 * 5
    first = a[next(iter(a))]
    assert np.abs(first).max() <= 1 / np.sqrt(fan_in)


@pytest.mark.parametrize("name", ["mlp-64", "cnn1d"])
def test_build_model_uses_initial_parameters_and_spares_global_rng(name: str) -> None:
    import torch

    arch = ARCHS[name]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    model = build_model(arch, seed=9)
    assert torch.equal(torch.get_rng_state(), before)
    expected = initial_parameters(arch, 9)
    for key, value in model.state_dict().items():
        assert value.dtype == torch.float32
        np.testing.assert_array_equal(value.numpy(), expected[key])
    assert not any(isinstance(m, (torch.nn.BatchNorm1d, torch.nn.Dropout)) for m in model.modules())


def test_cnn1d_keeps_length_and_pools() -> None:
    import torch

    arch = ARCHS["cnn1d"]
    model = build_model(arch, seed=0)
    x = torch.randn(4, 3, 32)
    assert model(x).shape == (4, 5)
    features = model[:4](x)  # conv0, relu0, conv1, relu1
    assert features.shape == (4, 16, 32)


@pytest.mark.parametrize(("arch", "message"), [
    (ArchSpec("mlp", {"sizes": [4]}), "sizes"),
    (ArchSpec("mlp", {"sizes": [4, 0]}), "positive"),
    (ArchSpec("mlp", {"sizes": [4, 2], "hidden": 3}), "unknown option"),
    (ArchSpec("mlp", {}), "missing"),
    (ArchSpec("cnn1d", {"channels": 2, "length": 8}), "missing"),
    (ArchSpec("cnn1d", {"channels": 2, "length": 8, "classes": 3, "kernel": 4}), "odd"),
    (ArchSpec("cnn1d", {"channels": 2, "length": 8, "classes": 3, "filters": []}), "filters"),
])
def test_invalid_options_rejected(arch: ArchSpec, message: str) -> None:
    with pytest.raises(LocalProtocolError, match=message):
        layout_of(arch)
    with pytest.raises(LocalProtocolError, match=message):
        initial_parameters(arch, 0)


def test_invalid_seed_rejected() -> None:
    with pytest.raises(LocalProtocolError, match="seed"):
        initial_parameters(ARCHS["mlp-64"], -1)


@pytest.mark.parametrize("name", ["mlp-64", "mlp-300", "cnn1d"])
def test_onnx_forward_equals_torch(name: str, tmp_path: Path) -> None:
    import onnx
    import onnxruntime
    import torch

    arch = ARCHS[name]
    path = tmp_path / "forward.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the exporter's must not leak
        proto = export_forward(arch, 5, path)
    assert [init.name for init in proto.graph.initializer] == list(layout_of(arch).names)
    assert [op.version for op in proto.opset_import if op.domain in ("", "ai.onnx")] == [OPSET]
    assert proto.ir_version <= 10
    assert [i.name for i in proto.graph.input] == ["input"]
    assert [o.name for o in proto.graph.output] == ["logits"]
    onnx.checker.check_model(proto)

    model = build_model(arch, 5)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch in (1, 7, 33):  # dynamic batch axis
        x = rng.standard_normal((batch, *arch.input_shape)).astype(np.float32)
        (got,) = session.run(["logits"], {"input": x})
        with torch.no_grad():
            want = model(torch.from_numpy(x)).numpy()
        assert got.shape == (batch, arch.num_classes)
        assert np.abs(got - want).max() <= 1e-5


def test_folded_initializers_are_reported(tmp_path: Path) -> None:
    arch = ARCHS["mlp-64"]
    proto = export_forward(arch, 0, tmp_path / "f.onnx")
    keys = list(layout_of(arch).names)
    with pytest.raises(ArtifactError, match="constant folding"):
        _check_initializers(proto, [*keys, "bn.running_mean"], arch)
    del proto.graph.initializer[1]
    with pytest.raises(ArtifactError, match="fc0.bias"):
        _check_initializers(proto, keys, arch)


def test_model_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import models, models.zoo, models.export, models.artifacts\n"
        "import device_agent.trainers, device_agent.trainers.torch_backend\n"
        "from fedtier.training.layout import ArchSpec\n"
        "models.zoo.layout_of(ArchSpec('mlp', {'sizes': [4, 2]}))\n"
        "models.zoo.initial_parameters(ArchSpec('mlp', {'sizes': [4, 2]}), 0)\n"
        "heavy = [m for m in ('torch', 'onnxruntime', 'onnx') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

"""The portable training graph: each lowering against the contrib kernel it replaces, and the whole graph.

Op by op: a one-node model with the ``com.microsoft`` op runs in onnxruntime-training's
runtime (which has the contrib kernels); the same model lowered by ``models.portable`` runs
in the same runtime; on random inputs the outputs must agree. The lowered models hold
standard-domain nodes only, so stock onnxruntime runs them too
(``tests/unit/device_agent/test_portable_env.py`` trains with them there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import models.portable as portable_mod
from device_agent.trainers import make_trainer
from device_agent.trainers.ort_runtime import import_onnxruntime
from fedtier.artifacts.bundle import PORTABLE_ROLES, ArtifactBundle
from fedtier.errors import ArtifactError
from fedtier.training.layout import ArchSpec
from models.artifacts import build_artifacts
from models.portable import LOWERINGS, STANDARD_DOMAINS, lower_training_graph

MLP = ArchSpec("mlp", {"sizes": [64, 64, 10]})
CNN = ArchSpec("cnn1d", {"channels": 3, "length": 32, "classes": 5, "filters": [8, 16], "kernel": 5})
ATOL_PER_SCALE = 2e-6
"""Float32 sums in another order (a GEMM against a convolution) differ by a few ulps of the
output's magnitude, not of each element; so the tolerance scales with the largest output."""

Feeds = dict[str, np.ndarray]


def contrib_model(op: str, inputs: list[tuple[str, int, list[Any] | None]],
                  outputs: list[tuple[str, int, list[Any]] | None], **attrs: Any) -> Any:
    """A one-node model with the contrib op ``op`` (opset 17, IR 8: what the artifacts use).

    ``outputs`` are ``(name, dtype, shape)``, or ``None`` for an optional output left out.
    """
    names = [o[0] if o else "" for o in outputs]
    node = helper.make_node(op, [name for name, _, _ in inputs], names, domain="com.microsoft", name=op, **attrs)
    graph = helper.make_graph(
        [node], f"{op}_test",
        [helper.make_tensor_value_info(name, dtype, shape) for name, dtype, shape in inputs],
        [helper.make_tensor_value_info(*o) for o in outputs if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def run(model: Any, feeds: Feeds) -> list[np.ndarray]:
    ort = import_onnxruntime()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def lowered(model: Any, params: tuple[str, ...] = ()) -> Any:
    result = lower_training_graph(model, params)
    assert result.unsupported_ops == () and result.model is not None
    assert all(node.domain in STANDARD_DOMAINS for node in result.model.graph.node)
    assert [o.domain for o in result.model.opset_import] == [""]
    return result.model


def assert_lowering_matches(model: Any, feeds: Feeds) -> None:
    want = run(model, feeds)
    portable = lowered(model)
    got = run(portable, {i.name: feeds[i.name] for i in portable.graph.input})  # unused inputs are pruned
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=0, atol=ATOL_PER_SCALE * max(1.0, float(np.abs(w).max())))


@pytest.fixture
def randn() -> Any:
    """Standard normal float32 arrays from a generator seeded per test (order-independent)."""
    rng = np.random.default_rng(0)
    return lambda *shape: rng.standard_normal(shape).astype(np.float32)


# --- op by op --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 7), (2, 3, 5)])
def test_relu_grad(shape: tuple[int, ...], randn: Any) -> None:
    y = np.maximum(randn(*shape), 0)  # Relu's output: zeros included, where the gradient stops
    assert (y == 0).any()
    model = contrib_model("ReluGrad", [("dY", TensorProto.FLOAT, list(shape)), ("X", TensorProto.FLOAT, list(shape))],
                          [("dX", TensorProto.FLOAT, list(shape))])
    assert_lowering_matches(model, {"dY": randn(*shape), "X": y})
    assert_lowering_matches(model, {"dY": randn(*shape), "X": randn(*shape)})  # on Relu's input: same sign


@pytest.mark.parametrize("scale_down", [0, 1])
@pytest.mark.parametrize("scale", [32.0, 3.7])
def test_scale(scale_down: int, scale: float, randn: Any) -> None:
    model = contrib_model("Scale", [("A", TensorProto.FLOAT, [2, 16, 1]), ("s", TensorProto.FLOAT, [1])],
                          [("Y", TensorProto.FLOAT, [2, 16, 1])], scale_down=scale_down)
    assert_lowering_matches(model, {"A": randn(2, 16, 1), "s": np.array([scale], np.float32)})


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(16, 10), (4, 5, 3)])
def test_softmax_cross_entropy_loss_grad(reduction: str, shape: tuple[int, ...], randn: Any) -> None:
    logits = randn(*shape) * 3
    log_prob = (logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))).astype(np.float32)
    labels = np.random.default_rng(1).integers(0, shape[1], size=(shape[0], *shape[2:])).astype(np.int64)
    d_y = randn() if reduction != "none" else randn(*labels.shape)
    model = contrib_model("SoftmaxCrossEntropyLossGrad",
                          [("dY", TensorProto.FLOAT, list(np.shape(d_y))), ("log_prob", TensorProto.FLOAT, list(shape)),
                           ("labels", TensorProto.INT64, list(labels.shape))], [("dX", TensorProto.FLOAT, list(shape))],
                          reduction=reduction)
    assert_lowering_matches(model, {"dY": np.asarray(d_y, np.float32), "log_prob": log_prob, "labels": labels})


CONV_CASES = {
    # name: (X shape, W shape, attributes); "generated" is the 1-D CNN's layer as generate_artifacts writes it
    "generated-1d": ((4, 8, 32), (16, 8, 5), {"pads": [2, 2], "strides": [1], "dilations": [1]}),
    "valid-1d": ((3, 2, 11), (4, 2, 3), {"pads": [0, 0], "strides": [1], "dilations": [1]}),
    "dilated-1d": ((2, 3, 20), (5, 3, 3), {"pads": [1, 3], "strides": [1], "dilations": [2]}),
    "strided-1d": ((2, 3, 20), (5, 3, 4), {"pads": [1, 2], "strides": [3], "dilations": [1]}),
    "2d": ((2, 3, 9, 8), (4, 3, 3, 2), {"pads": [1, 0, 1, 1], "strides": [1, 1], "dilations": [1, 1]}),
    "strided-2d": ((2, 3, 9, 10), (4, 3, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2], "dilations": [1, 1]}),
}


def _conv_out(x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any]) -> tuple[int, ...]:
    rank = len(w_shape) - 2
    spatial = []
    for i in range(rank):
        span = attrs["dilations"][i] * (w_shape[2 + i] - 1) + 1
        spatial.append((x_shape[2 + i] + attrs["pads"][i] + attrs["pads"][i + rank] - span) // attrs["strides"][i] + 1)
    return (x_shape[0], w_shape[0], *spatial)


@pytest.mark.parametrize("case", sorted(CONV_CASES))
@pytest.mark.parametrize("wanted", ["all", "no-dx"])
def test_conv_grad(case: str, wanted: str, randn: Any) -> None:
    x_shape, w_shape, attrs = CONV_CASES[case]
    y_shape = _conv_out(x_shape, w_shape, attrs)
    outputs: list = [("dX", TensorProto.FLOAT, list(x_shape)), ("dW", TensorProto.FLOAT, list(w_shape)),
                     ("dB", TensorProto.FLOAT, [w_shape[0]])]
    if wanted == "no-dx":
        outputs[0] = None  # the first layer needs no dX
    inputs = [("dY", TensorProto.FLOAT, list(y_shape)), ("X", TensorProto.FLOAT, list(x_shape)),
              ("W", TensorProto.FLOAT, list(w_shape))]
    model = contrib_model("ConvGrad", inputs, outputs,
                          kernel_shape=list(w_shape[2:]), group=1, auto_pad="NOTSET", **attrs)
    assert_lowering_matches(model, {"dY": randn(*y_shape), "X": randn(*x_shape), "W": randn(*w_shape)})


def test_grouped_conv_weight_gradient_is_recorded_as_unsupported() -> None:
    model = contrib_model("ConvGrad", [("dY", TensorProto.FLOAT, [2, 4, 8]), ("X", TensorProto.FLOAT, [2, 4, 8]),
                                       ("W", TensorProto.FLOAT, [4, 2, 3])],
                          [("dX", TensorProto.FLOAT, [2, 4, 8]), ("dW", TensorProto.FLOAT, [4, 2, 3]),
                           ("dB", TensorProto.FLOAT, [4])],
                          kernel_shape=[3], group=2, pads=[1, 1], strides=[1], dilations=[1])
    result = lower_training_graph(model, ())
    assert result.model is None and result.unsupported_ops == ("ConvGrad (group=2)",)


@pytest.mark.parametrize("op, forward", [("SigmoidGrad", "sigmoid"), ("TanhGrad", "tanh")])
@pytest.mark.parametrize("shape", [(16, 3), (2, 4, 5)])
def test_activation_grads_on_the_forward_output(op: str, forward: str, shape: tuple[int, ...], randn: Any) -> None:
    """Both kernels take the activation's output ``Y``: fed here as the forward computes it."""
    x = randn(*shape) * 3
    y = (1 / (1 + np.exp(-x)) if forward == "sigmoid" else np.tanh(x)).astype(np.float32)
    model = contrib_model(op, [("dY", TensorProto.FLOAT, list(shape)), ("Y", TensorProto.FLOAT, list(shape))],
                          [("dX", TensorProto.FLOAT, list(shape))])
    assert_lowering_matches(model, {"dY": randn(*shape), "Y": y})


@pytest.mark.parametrize("alpha", [0.01, 0.1, 0.5])
def test_leaky_relu_grad(alpha: float, randn: Any) -> None:
    x = randn(6, 7)
    y = np.where(x > 0, x, np.float32(alpha) * x).astype(np.float32)
    y[0, :3] = 0.0  # the kernel's boundary: Y == 0 takes the alpha branch
    model = contrib_model("LeakyReluGrad", [("dY", TensorProto.FLOAT, [6, 7]), ("Y", TensorProto.FLOAT, [6, 7])],
                          [("dX", TensorProto.FLOAT, [6, 7])], alpha=alpha)
    assert_lowering_matches(model, {"dY": randn(6, 7), "Y": y})


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("op", ["SoftmaxGrad_13", "LogSoftmaxGrad_13"])
@pytest.mark.parametrize("shape, axis", [((8, 5), 1), ((8, 5), -1), ((3, 4, 6), 1), ((3, 4, 6), 0)])
def test_softmax_grads(op: str, shape: tuple[int, ...], axis: int, randn: Any) -> None:
    prob = _softmax(randn(*shape) * 2, axis)
    y = prob if op == "SoftmaxGrad_13" else np.log(prob).astype(np.float32)
    model = contrib_model(op, [("dY", TensorProto.FLOAT, list(shape)), ("Y", TensorProto.FLOAT, list(shape))],
                          [("dX", TensorProto.FLOAT, list(shape))], axis=axis)
    assert_lowering_matches(model, {"dY": randn(*shape), "Y": y})


MAX_POOL_CASES = {
    # name: (X shape, attributes); "starter" is fedtier init's model as generate_artifacts writes it
    "starter": ((4, 8, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [0, 0, 0, 0]}),
    "overlapping": ((2, 3, 7, 7), {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [0, 0, 0, 0]}),
    "overlapping-padded": ((2, 3, 8, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "asymmetric": ((2, 2, 9, 6), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 0, 1]}),
    "dilated": ((2, 2, 9, 9), {"kernel_shape": [2, 2], "strides": [1, 1], "pads": [0, 0, 0, 0],
                               "dilations": [2, 2]}),
    "ceil-mode": ((2, 2, 7, 7), {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [0, 0, 0, 0], "ceil_mode": 1}),
    "1d": ((3, 4, 20), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    "3d": ((2, 2, 5, 6, 4), {"kernel_shape": [2, 2, 2], "strides": [1, 2, 1], "pads": [0, 0, 0, 1, 0, 0]}),
}


def max_pool_model(x_shape: tuple[int, ...], y_shape: tuple[int, ...], **attrs: Any) -> Any:
    """MaxPool with its indices output and onnxruntime's MaxPoolGrad on them, as the generated graphs hold them.

    MaxPoolGrad is in the standard domain (where onnxruntime-training registers it) although ONNX
    defines no such op; its kernel reads dX's shape from the graph, so the output is declared.
    """
    nodes = [helper.make_node("MaxPool", ["X"], ["Y", "indices"], name="pool", **attrs),
             helper.make_node("MaxPoolGrad", ["dY", "indices"], ["dX"], name="pool_grad", **attrs)]
    graph = helper.make_graph(nodes, "max_pool_grad_test",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x_shape)),
                               helper.make_tensor_value_info("dY", TensorProto.FLOAT, list(y_shape))],
                              [helper.make_tensor_value_info("dX", TensorProto.FLOAT, list(x_shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("case", sorted(MAX_POOL_CASES))
def test_max_pool_grad(case: str, randn: Any) -> None:
    """Each incoming gradient lands where its window's maximum was; where windows overlap, they add up."""
    x_shape, attrs = MAX_POOL_CASES[case]
    x = randn(*x_shape)
    forward = helper.make_model(helper.make_graph(
        [helper.make_node("MaxPool", ["X"], ["Y"], **attrs)], "pool",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)]), opset_imports=[helper.make_opsetid("", 17)])
    forward.ir_version = 8
    (y,) = run(forward, {"X": x})
    model = max_pool_model(x_shape, y.shape, **attrs)
    d_y = randn(*y.shape)
    assert_lowering_matches(model, {"X": x, "dY": d_y})
    (d_x,) = run(lowered(model), {"X": x, "dY": d_y})
    np.testing.assert_allclose(d_x.sum(), d_y.sum(), rtol=1e-5)  # every gradient went somewhere in X
    if case.startswith("overlapping"):  # some maximum won several windows, and got their gradients summed
        assert (d_x != 0).sum() < d_y.size


def test_max_pool_grad_with_column_major_indices_is_recorded_as_unsupported() -> None:
    model = max_pool_model((1, 1, 4, 4), (1, 1, 2, 2), kernel_shape=[2, 2], strides=[2, 2], storage_order=1)
    result = lower_training_graph(model, ())
    assert result.model is None and result.unsupported_ops == ("MaxPoolGrad (storage_order=1)",)


def test_max_pool_grad_of_indices_no_max_pool_made_is_recorded_as_unsupported() -> None:
    node = helper.make_node("MaxPoolGrad", ["dY", "indices"], ["dX"], kernel_shape=[2, 2], strides=[2, 2])
    inputs = [helper.make_tensor_value_info("dY", TensorProto.FLOAT, [1, 1, 2, 2]),
              helper.make_tensor_value_info("indices", TensorProto.INT64, [1, 1, 2, 2])]
    graph = helper.make_graph([node], "orphan", inputs,
                              [helper.make_tensor_value_info("dX", TensorProto.FLOAT, [1, 1, 4, 4])])
    result = lower_training_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), ())
    assert result.model is None and result.unsupported_ops == ("MaxPoolGrad (indices not from a MaxPool)",)


def test_in_place_accumulator_becomes_the_gradient_output(randn: Any) -> None:
    """With ``lazy_reset_grad`` (what every trainer sets after each step) the accumulator's
    result is the fresh gradient; the portable graph outputs that gradient as ``<param>_grad``."""
    model = contrib_model("InPlaceAccumulatorV2",
                          [("w_grad.accumulation.buffer", TensorProto.FLOAT, [3, 4]), ("g", TensorProto.FLOAT, [3, 4]),
                           ("lazy_reset_grad", TensorProto.BOOL, [1])],
                          [("w_grad.accumulation.out", TensorProto.BOOL, [1]),
                           ("accumulated", TensorProto.FLOAT, [3, 4])])
    gradient, buffer = randn(3, 4), randn(3, 4)
    _flag, accumulated = run(model, {"w_grad.accumulation.buffer": buffer, "g": gradient,
                                     "lazy_reset_grad": np.array([True])})
    portable = lowered(model, ("w",))
    assert [o.name for o in portable.graph.output] == ["w_grad"]  # the flag is gone
    assert [i.name for i in portable.graph.input] == ["g"]  # buffer and reset flag are gone
    (got,) = run(portable, {"g": gradient})
    np.testing.assert_array_equal(got, accumulated)
    np.testing.assert_array_equal(got, gradient)


def test_an_op_without_lowering_is_named() -> None:
    model = contrib_model("GeluGrad", [("dY", TensorProto.FLOAT, [2, 3]), ("X", TensorProto.FLOAT, [2, 3])],
                          [("dX", TensorProto.FLOAT, [2, 3])])
    result = lower_training_graph(model, ())
    assert result.model is None and result.unsupported_ops == ("GeluGrad",)


# --- the generated graphs ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "fedtier-artifact-store"


@pytest.mark.parametrize("arch, contrib", [
    (MLP, {"SoftmaxCrossEntropyLossGrad", "ReluGrad", "InPlaceAccumulatorV2"}),
    (CNN, {"SoftmaxCrossEntropyLossGrad", "ReluGrad", "InPlaceAccumulatorV2", "ConvGrad", "Scale"}),
], ids=["mlp", "cnn1d"])
def test_bundles_carry_a_portable_graph_of_standard_ops(arch: ArchSpec, contrib: set[str], store: Path) -> None:
    bundle = build_artifacts(arch, store, seed=0)
    training = onnx.load(str(bundle.path("training_model")))
    found = {n.op_type for n in training.graph.node if n.domain not in STANDARD_DOMAINS}
    assert found == contrib  # the inventory the lowerings cover (a new op would show up here)
    assert {("com.microsoft", op) for op in found} <= set(LOWERINGS)

    assert bundle.has_portable_graph and bundle.portable is not None and bundle.portable.unsupported_ops == ()
    assert set(PORTABLE_ROLES) <= set(bundle.files)
    graph = onnx.load(str(bundle.path("portable_model")))
    onnx.checker.check_model(graph, full_check=True)
    assert {n.domain for n in graph.graph.node} == {""} and [o.domain for o in graph.opset_import] == [""]
    names = list(bundle.layout.names)
    assert [i.name for i in graph.graph.input] == ["input", "labels", *names]
    assert [o.name for o in graph.graph.output][1:] == ["logits", *[f"{n}_grad" for n in names]]
    checkpoint = bundle.path("portable_checkpoint").read_bytes()
    assert len(checkpoint) == 4 * bundle.layout.num_parameters
    # the portable checkpoint holds the same initial weights as onnxruntime-training's
    flat = np.concatenate([v.ravel() for v in make_trainer("ort", bundle).get_parameters().values()])
    np.testing.assert_array_equal(np.frombuffer(checkpoint, "<f4"), flat)


def test_a_graph_with_an_unlowerable_op_is_recorded_and_refused_by_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundle still builds (onnxruntime-training devices train it) and says what blocks the rest."""
    monkeypatch.delitem(portable_mod.LOWERINGS, ("com.microsoft", "ConvGrad"))
    bundle = build_artifacts(CNN, tmp_path / "store", seed=0)
    assert bundle.portable is not None and bundle.portable.unsupported_ops == ("ConvGrad",)
    assert not bundle.has_portable_graph and not set(PORTABLE_ROLES) & set(bundle.files)
    assert ArtifactBundle.load(bundle.directory) == bundle  # the record is part of the signed descriptor
    assert "unsupported_ops" in (bundle.directory / "bundle.json").read_text()
    with pytest.raises(ArtifactError, match=r"no lowering to standard ONNX \(ConvGrad\)"):
        make_trainer("portable", bundle)
    make_trainer("ort", bundle).train_steps([(np.zeros((2, 3, 32), np.float32), np.array([0, 1]))], 0.1)


def test_a_graph_wanting_other_inputs_is_recorded_not_shipped(store: Path, tmp_path: Path) -> None:
    """The portable interface is (input, labels or target, trained parameters, frozen initializers): a graph
    that needs anything else gets a record instead of a graph devices cannot feed."""
    from models.portable import write_portable

    bundle = build_artifacts(MLP, store, seed=0)
    training = onnx.load(str(bundle.path("training_model")))
    for node in training.graph.node:
        node.input[:] = ["mask" if name == "labels" else name for name in node.input]
    for graph_input in training.graph.input:
        if graph_input.name == "labels":
            graph_input.name = "mask"
    forward = onnx.load(str(bundle.path("eval_model")))  # initial weights are only read if it lowers
    files, info = write_portable(tmp_path, forward, training, bundle.layout)
    assert files == {} and not info.lowered
    assert info.unsupported_ops == ("graph inputs ['mask'] (the portable graph takes input, labels or target, the "
                                    "trained parameters and frozen initializers)",)


# --- users' models ---------------------------------------------------------------------------------

USER_CONTRIB = {
    # the ops of each generated training graph that ONNX does not define (what the lowerings must cover)
    "starter": {"SoftmaxCrossEntropyLossGrad", "ReluGrad", "InPlaceAccumulatorV2", "ConvGrad", "MaxPoolGrad"},
    "cross_entropy": {"SoftmaxCrossEntropyLossGrad", "TanhGrad", "InPlaceAccumulatorV2"},
    "bce": {"SigmoidGrad", "Scale", "TanhGrad", "InPlaceAccumulatorV2"},
    "mse": {"Scale", "TanhGrad", "InPlaceAccumulatorV2"},
    "onnx_head_only": {"SoftmaxCrossEntropyLossGrad", "InPlaceAccumulatorV2"},  # no gradient below the head
}


@pytest.fixture(scope="module")
def user_bundles(tmp_path_factory: pytest.TempPathFactory, store: Path) -> dict[str, ArtifactBundle]:
    from portable_models import build_user_bundles

    return build_user_bundles(tmp_path_factory.mktemp("user-models"), store)


def _not_onnx(graph: Any) -> set[str]:
    return {n.op_type for n in graph.node if not onnx.defs.has(n.op_type, "" if n.domain == "ai.onnx" else n.domain)}


@pytest.mark.parametrize("name", sorted(USER_CONTRIB))
def test_user_models_carry_a_portable_graph_with_their_frozen_tensors(
        name: str, user_bundles: dict[str, ArtifactBundle]) -> None:
    """fedtier init's starter (MaxPool), one model per loss with frozen tensors, and an ONNX file of which only
    the head is trainable: all lowered; the graph
    takes the loss's label input and the frozen tensors after the parameters, whose values end the checkpoint."""
    from portable_models import FROZEN

    bundle = user_bundles[name]
    training = onnx.load(str(bundle.path("training_model")))
    assert _not_onnx(training.graph) == USER_CONTRIB[name]
    assert {("" if op == "MaxPoolGrad" else "com.microsoft", op) for op in USER_CONTRIB[name]} <= set(LOWERINGS)
    assert bundle.has_portable_graph and bundle.portable is not None and bundle.portable.unsupported_ops == ()

    graph = onnx.load(str(bundle.path("portable_model")))
    onnx.checker.check_model(graph, full_check=True)
    assert _not_onnx(graph.graph) == set() and {n.domain for n in graph.graph.node} == {""}
    label = "labels" if bundle.arch.loss == "cross_entropy" else "target"
    names, frozen = list(bundle.layout.names), list(FROZEN[name])
    assert [i.name for i in graph.graph.input] == ["input", label, *names, *frozen]
    assert not set(frozen) & set(names)
    assert [o.name for o in graph.graph.output][1:] == ["logits", *[f"{n}_grad" for n in names]]

    # the checkpoint: the trained parameters as onnxruntime-training's checkpoint holds them, then the frozen values
    from device_agent.trainers.ort_runtime import training_api

    state = training_api().CheckpointState.load_checkpoint(str(bundle.path("checkpoint")))
    held = {n: np.asarray(p.data) for n, p in state.parameters}  # the frozen tensors are there too, untrained
    assert not any(state.parameters[n].requires_grad for n in frozen)
    flat = np.concatenate([held[n].ravel() for n in [*names, *frozen]])
    np.testing.assert_array_equal(np.frombuffer(bundle.path("portable_checkpoint").read_bytes(), "<f4"), flat)


def _no_rebuild(*args: object, **kwargs: object) -> None:
    raise AssertionError("generate_artifacts ran: the store entry was rebuilt")


def test_a_store_entry_an_older_build_could_not_lower_is_rebuilt_with_a_portable_graph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle recorded as unsupported before this build's lowerings existed gets its portable graph on the
    next build (the same model, so the same training graph); one still unsupported is kept as it is."""
    from models.source import model_source
    from portable_models import write_models

    source = model_source(factory=f"{write_models(tmp_path / 'models')}/starter.py:make_model")
    with monkeypatch.context() as patched:
        patched.delitem(portable_mod.LOWERINGS, ("", "MaxPoolGrad"))
        old = build_artifacts(source, tmp_path / "store")
        assert old.portable is not None and old.portable.unsupported_ops == ("MaxPoolGrad",)
        patched.setattr("models.artifacts._generate", _no_rebuild)
        assert build_artifacts(source, tmp_path / "store").bundle_id == old.bundle_id  # still unsupported: kept
    new = build_artifacts(source, tmp_path / "store")
    assert new.bundle_id != old.bundle_id and new.has_portable_graph
    assert new.files["training_model"] == old.files["training_model"]
    assert build_artifacts(source, tmp_path / "store").bundle_id == new.bundle_id

"""The portable training graph: onnxruntime-training's generated graph on standard ONNX ops only.

Why: ``onnxruntime-training-cpu`` 1.19.2 is the last release of ORT's training packages and
has no wheel for Linux aarch64 or Python 3.13+. Stock ``onnxruntime`` (maintained, with those
wheels) loads the bundle's eval graph but refuses the training graph, because
``generate_artifacts`` writes the backward pass with contrib ops of the ``com.microsoft``
domain. This module rewrites each such op into standard ONNX ops, so any onnxruntime (or any
ONNX runtime) runs forward *and* backward; the optimizer step is left to the device (numpy),
since it is one line of SGD.

We lower what ``generate_artifacts`` emits rather than build a second gradient graph: the
gradient maths stays ORT's (the same graph the onnxruntime-training trainer runs), and every
lowering is a few standard ops that a test checks against the contrib kernel it replaces
(``tests/unit/models/test_portable.py``: both run in the same onnxruntime, on random inputs).

The lowerings (``LOWERINGS``):

* ``SoftmaxCrossEntropyLossGrad`` -> ``(Exp(log_prob) - OneHot(labels)) * dY`` divided by
  the number of labels for ``reduction = mean`` (no class weights, no ``ignore_index``);
* ``ReluGrad(dY, Y)`` -> ``Where(Y > 0, dY, 0)``;
* ``Scale(A, s)`` -> ``A * s`` (``A * (1/s)`` with ``scale_down``), as the kernel computes it;
* ``ConvGrad(dY, X, W)`` -> ``dX = ConvTranspose(dY, W)`` with the forward's pads, strides,
  dilations and group; ``dW`` by im2col (one strided ``Slice`` of the padded input per kernel
  offset) and one ``Gemm`` against ``dY``, as the contrib kernel computes it (``group = 1``);
  ``dB = ReduceSum(dY)`` over batch and space;
* ``InPlaceAccumulatorV2(buffer, grad, reset)`` -> nothing: the gradient becomes a graph
  output. The trainers reset gradients after every step (``lazy_reset_grad``), so the
  accumulator always overwrites; the portable trainer gets the same fresh gradient;
* ``SigmoidGrad(dY, Y)`` -> ``dY * Y * (1 - Y)`` (bce's loss, Sigmoid layers);
  ``TanhGrad(dY, Y)`` -> ``dY * (1 - Y * Y)``; ``LeakyReluGrad(dY, Y)`` -> ``Where(Y > 0, dY,
  alpha * dY)``; ``SoftmaxGrad_13(dY, Y)`` -> ``Y * (dY - ReduceSum(dY * Y, axis))``;
  ``LogSoftmaxGrad_13(dY, Y)`` -> ``dY - Exp(Y) * ReduceSum(dY, axis)``;
* ``MaxPoolGrad(dY, indices)`` (registered by onnxruntime in the *standard* domain, but not an
  ONNX op) -> ``ScatterElements(zeros, indices, dY, reduction = add)`` over the flattened input
  of the forward ``MaxPool`` (which returns those indices), reshaped to that input's shape:
  any padding, stride, dilation, ``ceil_mode`` and overlapping windows (not
  ``storage_order = 1``).

An op counts as standard when the ONNX schema defines it (``onnx.defs.has``), not by its domain.

A contrib op without a lowering (or a variant outside the above) is not an error at build
time: the bundle records it (``PortableInfo.unsupported_ops``) and ships without the portable
files; devices with onnxruntime-training still train it, devices without refuse it by name.

The portable graph's interface (``PORTABLE_FORMAT`` 1): inputs ``input``, the loss's label
input (int64 ``labels`` for cross-entropy, float ``target`` for bce and mse), every trained
parameter in layout order, then the model's frozen tensors (float initializers that are not
trained: a torch module's buffers and parameters without ``requires_grad``, an ONNX model's
initializers left out of ``trainable``), in the generated graph's order and with static
shapes; outputs the loss, ``logits``, then ``<param>_grad`` for every parameter in layout
order (frozen tensors get no gradient). The checkpoint is a separate file of raw
little-endian float32: the parameters in layout order, then the frozen tensors in input order
(onnxruntime-training's checkpoint is a format only its runtime reads). A model of the built-in
zoo has no frozen tensors and trains with ``labels``, so its portable files are what they were
before frozen tensors and targets were supported (same ``bundle_id``s); an agent built before
that refuses a graph with a ``target`` or frozen inputs at its interface check, by name.

onnx is imported inside functions: only the coordinator, which builds bundles, needs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from fedtier.artifacts.bundle import PORTABLE_FORMAT, BundleFile, PortableInfo
from fedtier.errors import ArtifactError
from fedtier.training.layout import Layout

if TYPE_CHECKING:  # pragma: no cover - typing only
    import onnx

logger = logging.getLogger(__name__)

FILENAMES = {
    "portable_model": "portable_training_model.onnx",
    "portable_checkpoint": "portable_checkpoint.f32",
}
GRAD_SUFFIX = "_grad"
"""Portable gradient outputs are named ``<param>_grad``."""

PORTABLE_INPUT, PORTABLE_LABELS, PORTABLE_TARGET = "input", "labels", "target"
"""The portable graph's first input, and its second: int64 ``labels`` (cross-entropy) or float ``target``
(bce, mse); then the trained parameters in layout order, then any frozen tensors."""

STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")
"""Domains every onnxruntime build implements."""

_ACCUMULATOR_SUFFIX = "_grad.accumulation.buffer"
_MIN_OPSET = 15  # CastLike (opset 15) keeps the lowerings dtype-generic


class NotLowerable(Exception):
    """A contrib op (or a variant of one) this module cannot express in standard ops."""


@dataclass
class LoweringContext:
    """What a lowering may ask of the graph being rewritten, and what it may record.

    Args:
        opset: The graph's ai.onnx opset.
        shapes: Static shapes known for tensor names (graph inputs, value_info); ``None``
            for a dimension that is symbolic.
        taken: Every name already used in the graph (new names avoid them).
        producers: The node of the generated graph that outputs each tensor name (a
            gradient op may need what its forward op saw, e.g. MaxPool's input shape).
    """

    opset: int
    shapes: dict[str, list[int | None]]
    taken: set[str]
    producers: dict[str, Any] = field(default_factory=dict)
    initializers: list[Any] = field(default_factory=list)
    gradients: dict[str, str] = field(default_factory=dict)
    gradient_buffers: dict[str, str] = field(default_factory=dict)
    dropped_outputs: set[str] = field(default_factory=set)

    def fresh(self, hint: str) -> str:
        """A new tensor name based on ``hint``."""
        name, n = hint, 0
        while name in self.taken:
            n += 1
            name = f"{hint}_{n}"
        self.taken.add(name)
        return name

    def const(self, hint: str, value: np.ndarray) -> str:
        """Add ``value`` as an initializer; return its name."""
        from onnx import numpy_helper

        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def static_shape(self, name: str) -> list[int | None] | None:
        return self.shapes.get(name)


Lowering = Callable[[Any, LoweringContext], list[Any]]


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _node(op: str, inputs: Sequence[str], outputs: Sequence[str], base: Any, tag: str, **attrs: Any) -> Any:
    from onnx import helper

    name = f"{base.name or base.op_type}/portable/{tag}"
    return helper.make_node(op, list(inputs), list(outputs), name=name, **attrs)


# --- the lowerings ------------------------------------------------------------------------------


def lower_relu_grad(node: Any, ctx: LoweringContext) -> list[Any]:
    """``ReluGrad(dY, Y) = dY where Y > 0 else 0`` (``Y`` is Relu's output or input: same sign)."""
    d_y, y = node.input[0], node.input[1]
    (d_x,) = node.output
    zero = ctx.const(f"{d_x}/zero", np.zeros((), np.float32))
    zero_y, zero_dy, positive = ctx.fresh(f"{d_x}/zero_y"), ctx.fresh(f"{d_x}/zero_dy"), ctx.fresh(f"{d_x}/pos")
    return [
        _node("CastLike", [zero, y], [zero_y], node, "zero_y"),
        _node("CastLike", [zero, d_y], [zero_dy], node, "zero_dy"),
        _node("Greater", [y, zero_y], [positive], node, "positive"),
        _node("Where", [positive, d_y, zero_dy], [d_x], node, "where"),
    ]


def lower_scale(node: Any, ctx: LoweringContext) -> list[Any]:
    """``Scale(A, s) = A * s``; with ``scale_down``, ``A * (1 / s)`` (the kernel's arithmetic)."""
    a, s = node.input[0], node.input[1]
    (y,) = node.output
    scale = ctx.fresh(f"{y}/scale")
    nodes = [_node("CastLike", [s, a], [scale], node, "cast")]
    if int(_attrs(node).get("scale_down", 0)):
        inverse = ctx.fresh(f"{y}/inverse")
        nodes.append(_node("Reciprocal", [scale], [inverse], node, "reciprocal"))
        scale = inverse
    nodes.append(_node("Mul", [a, scale], [y], node, "mul"))
    return nodes


def lower_softmax_cross_entropy_loss_grad(node: Any, ctx: LoweringContext) -> list[Any]:
    """``d logits = (softmax - one_hot(labels)) * dY``, divided by the label count for ``mean``."""
    attrs = _attrs(node)
    reduction = _text(attrs.get("reduction", "mean"))
    if len(node.input) > 3 and node.input[3]:
        raise NotLowerable("class weights")
    if "ignore_index" in attrs:
        raise NotLowerable("ignore_index")
    if reduction not in ("mean", "sum", "none"):
        raise NotLowerable(f"reduction={reduction}")
    d_y, log_prob, labels = node.input[0], node.input[1], node.input[2]
    (d_logits,) = node.output
    t = ctx.fresh
    prob, shape, depth, onehot = t(f"{d_logits}/prob"), t(f"{d_logits}/shape"), t(f"{d_logits}/depth"), \
        t(f"{d_logits}/onehot")
    values, diff = t(f"{d_logits}/values"), t(f"{d_logits}/diff")
    nodes = [
        _node("Exp", [log_prob], [prob], node, "exp"),
        _node("Shape", [log_prob], [shape], node, "shape"),
        _node("Gather", [shape, ctx.const(f"{d_logits}/class_axis", np.array([1], np.int64))], [depth], node,
              "depth", axis=0),
        _node("CastLike", [ctx.const(f"{d_logits}/off_on", np.array([0.0, 1.0], np.float32)), log_prob], [values],
              node, "values"),
        _node("OneHot", [labels, depth, values], [onehot], node, "onehot", axis=1),
        _node("Sub", [prob, onehot], [diff], node, "sub"),
    ]
    if reduction == "none":  # dY has the labels' shape: broadcast it over the class axis
        scale = t(f"{d_logits}/dy")
        nodes.append(_node("Unsqueeze", [d_y, ctx.const(f"{d_logits}/unsq", np.array([1], np.int64))], [scale],
                           node, "unsqueeze"))
    elif reduction == "sum":
        scale = d_y
    else:
        count, count_t, scale = t(f"{d_logits}/count"), t(f"{d_logits}/count_t"), t(f"{d_logits}/scale")
        nodes += [
            _node("Size", [labels], [count], node, "size"),
            _node("CastLike", [count, d_y], [count_t], node, "count"),
            _node("Div", [d_y, count_t], [scale], node, "mean"),
        ]
    nodes.append(_node("Mul", [diff, scale], [d_logits], node, "mul"))
    return nodes


def lower_conv_grad(node: Any, ctx: LoweringContext) -> list[Any]:
    """ConvGrad as ``ConvTranspose`` (dX), a batch-contracting ``Conv`` (dW) and ``ReduceSum`` (dB)."""
    d_y, x, w = node.input[0], node.input[1], node.input[2]
    outputs = [*node.output, "", "", ""][:3]
    d_x, d_w, d_b = outputs
    attrs = _attrs(node)
    auto_pad = _text(attrs.get("auto_pad", "NOTSET"))
    if auto_pad not in ("NOTSET", "VALID"):
        raise NotLowerable(f"auto_pad={auto_pad}")
    kernel = list(attrs.get("kernel_shape", []))
    w_shape = ctx.static_shape(w)
    if not kernel and w_shape and all(d is not None for d in w_shape[2:]):
        kernel = [int(d) for d in w_shape[2:]]  # type: ignore[arg-type]
    if not kernel:
        raise NotLowerable("kernel shape unknown")
    rank = len(kernel)
    strides = list(attrs.get("strides", [1] * rank))
    dilations = list(attrs.get("dilations", [1] * rank))
    pads = list(attrs.get("pads", [0] * (2 * rank))) if auto_pad == "NOTSET" else [0] * (2 * rank)
    group = int(attrs.get("group", 1))
    common = {"dilations": dilations, "pads": pads, "strides": strides, "kernel_shape": kernel, "group": group}
    nodes: list[Any] = []
    if d_x:
        extra: dict[str, Any] = {}
        if any(s != 1 for s in strides):
            extra["output_padding"] = _output_padding(ctx.static_shape(x), kernel, strides, dilations, pads)
        nodes.append(_node("ConvTranspose", [d_y, w], [d_x], node, "dx", **common, **extra))
    if d_w:
        if group != 1:
            raise NotLowerable(f"group={group}")
        nodes += _conv_weight_grad(node, ctx, d_y, x, w, d_w, kernel, strides, dilations, pads)
    if d_b:
        axes = ctx.const(f"{d_b}/axes", np.array([0, *range(2, 2 + rank)], np.int64))
        nodes.append(_node("ReduceSum", [d_y, axes], [d_b], node, "db", keepdims=0))
    return nodes


def _conv_weight_grad(node: Any, ctx: LoweringContext, d_y: str, x: str, w: str, d_w: str, kernel: list[int],
                      strides: list[int], dilations: list[int], pads: list[int]) -> list[Any]:
    """``dW[o, c, k] = sum over batch and positions of dY[n, o, l] * Xpad[n, c, l*s + k*d]`` as one GEMM.

    im2col, as onnxruntime's ConvGrad kernel does it: one strided ``Slice`` of the padded,
    channel-major input per kernel offset gives the window each weight saw, ``(C, N, Lo...)``;
    stacked along a kernel axis and flattened to ``(C*K, N*L)``, they meet ``dY`` flattened to
    ``(O, N*L)`` in one ``Gemm``. (A ``Conv`` of X against dY with batch and channels swapped
    computes the same, but MLAS runs such a long "kernel" 2-3x slower.) Output sizes are
    read from ``dY``'s shape at run time, so any batch and input length work.
    """
    rank = len(kernel)
    spatial = list(range(2, 2 + rank))
    t = ctx.fresh
    x_pad, x_t, dy_shape, lo, lo_m1, span_m1, span = (t(f"{d_w}/{n}") for n in (
        "x_pad", "x_t", "dy_shape", "lo", "lo_m1", "span_m1", "span"))
    one = ctx.const(f"{d_w}/one", np.ones(rank, np.int64))
    axes = ctx.const(f"{d_w}/axes", np.array(spatial, np.int64))
    steps = ctx.const(f"{d_w}/steps", np.array(strides, np.int64))
    nodes = [
        _node("Pad", [x, ctx.const(f"{d_w}/pads", np.array([0, 0, *pads[:rank], 0, 0, *pads[rank:]], np.int64))],
              [x_pad], node, "dw_pad"),
        _node("Transpose", [x_pad], [x_t], node, "dw_x_t", perm=[1, 0, *spatial]),  # (C, N, Lp...)
        _node("Shape", [d_y], [dy_shape], node, "dw_dy_shape"),
        _node("Slice", [dy_shape, ctx.const(f"{d_w}/from", np.array([2], np.int64)),
                        ctx.const(f"{d_w}/to", np.array([2 + rank], np.int64))], [lo], node, "dw_lo"),
        _node("Sub", [lo, one], [lo_m1], node, "dw_lo_m1"),
        _node("Mul", [lo_m1, steps], [span_m1], node, "dw_span_m1"),
        _node("Add", [span_m1, one], [span], node, "dw_span"),  # extent of one window's positions
    ]
    windows = []
    for offset in np.ndindex(*kernel):  # row-major: the flattened kernel index
        tag = "_".join(map(str, offset))
        starts = ctx.const(f"{d_w}/starts_{tag}", np.array(offset, np.int64) * np.array(dilations, np.int64))
        ends, window, lifted = t(f"{d_w}/ends_{tag}"), t(f"{d_w}/window_{tag}"), t(f"{d_w}/lifted_{tag}")
        nodes += [
            _node("Add", [starts, span], [ends], node, f"dw_ends_{tag}"),
            _node("Slice", [x_t, starts, ends, axes, steps], [window], node, f"dw_window_{tag}"),
            _node("Unsqueeze", [window, ctx.const(f"{d_w}/kaxis_{tag}", np.array([1], np.int64))], [lifted], node,
                  f"dw_lift_{tag}"),
        ]
        windows.append(lifted)
    patches, cols, dy_t, dy_2d, w_shape, flat = (t(f"{d_w}/{n}") for n in (
        "patches", "cols", "dy_t", "dy_2d", "w_shape", "flat"))
    nodes += [
        _node("Concat", windows, [patches], node, "dw_patches", axis=1),  # (C, K, N, Lo...)
        _node("Flatten", [patches], [cols], node, "dw_cols", axis=2),  # (C*K, N*L)
        _node("Transpose", [d_y], [dy_t], node, "dw_dy_t", perm=[1, 0, *spatial]),  # (O, N, Lo...)
        _node("Flatten", [dy_t], [dy_2d], node, "dw_dy_2d", axis=1),  # (O, N*L)
        _node("Gemm", [dy_2d, cols], [flat], node, "dw_gemm", transB=1),  # (O, C*K)
        _node("Shape", [w], [w_shape], node, "dw_w_shape"),
        _node("Reshape", [flat, w_shape], [d_w], node, "dw_reshape"),
    ]
    return nodes


def _output_padding(x_shape: list[int | None] | None, kernel: list[int], strides: list[int],
                    dilations: list[int], pads: list[int]) -> list[int]:
    """ConvTranspose's ``output_padding`` that restores X's spatial size (strided convs only)."""
    rank = len(kernel)
    if x_shape is None or len(x_shape) != rank + 2 or any(d is None for d in x_shape[2:]):
        raise NotLowerable("stride > 1 with an input of unknown spatial size")
    out = []
    for i in range(rank):
        size = int(x_shape[2 + i])  # type: ignore[arg-type]
        span = dilations[i] * (kernel[i] - 1) + 1
        produced = (size + pads[i] + pads[i + rank] - span) // strides[i] + 1
        restored = (produced - 1) * strides[i] + span - pads[i] - pads[i + rank]
        out.append(size - restored)
    return out


def lower_accumulator(node: Any, ctx: LoweringContext) -> list[Any]:
    """``InPlaceAccumulatorV2``: the gradient becomes an output; the trainer never accumulates."""
    buffer, value = node.input[0], node.input[1]
    if not buffer.endswith(_ACCUMULATOR_SUFFIX):
        raise NotLowerable(f"accumulation buffer {buffer!r} names no parameter")
    param = buffer[: -len(_ACCUMULATOR_SUFFIX)]
    ctx.gradients[param] = value
    ctx.gradient_buffers[param] = buffer  # a graph input of the parameter's type and shape
    ctx.dropped_outputs.update(o for o in node.output if o)
    return []


def _one_like(node: Any, ctx: LoweringContext, like: str, hint: str) -> tuple[str, list[Any]]:
    """A scalar 1 of ``like``'s element type."""
    one = ctx.fresh(f"{hint}/one")
    return one, [_node("CastLike", [ctx.const(f"{hint}/one_f", np.ones((), np.float32)), like], [one], node, "one")]


def lower_sigmoid_grad(node: Any, ctx: LoweringContext) -> list[Any]:
    """``SigmoidGrad(dY, Y) = dY * Y * (1 - Y)`` (``Y`` is Sigmoid's output), in the kernel's order."""
    d_y, y = node.input[0], node.input[1]
    (d_x,) = node.output
    one, nodes = _one_like(node, ctx, y, d_x)
    dy_y, one_m_y = ctx.fresh(f"{d_x}/dy_y"), ctx.fresh(f"{d_x}/one_minus_y")
    return [
        *nodes,
        _node("Mul", [d_y, y], [dy_y], node, "dy_y"),
        _node("Sub", [one, y], [one_m_y], node, "one_minus_y"),
        _node("Mul", [dy_y, one_m_y], [d_x], node, "mul"),
    ]


def lower_tanh_grad(node: Any, ctx: LoweringContext) -> list[Any]:
    """``TanhGrad(dY, Y) = dY * (1 - Y * Y)`` (``Y`` is Tanh's output)."""
    d_y, y = node.input[0], node.input[1]
    (d_x,) = node.output
    one, nodes = _one_like(node, ctx, y, d_x)
    y_sq, one_m = ctx.fresh(f"{d_x}/y_sq"), ctx.fresh(f"{d_x}/one_minus_y_sq")
    return [
        *nodes,
        _node("Mul", [y, y], [y_sq], node, "y_sq"),
        _node("Sub", [one, y_sq], [one_m], node, "one_minus_y_sq"),
        _node("Mul", [d_y, one_m], [d_x], node, "mul"),
    ]


def lower_leaky_relu_grad(node: Any, ctx: LoweringContext) -> list[Any]:
    """``LeakyReluGrad(dY, Y) = dY where Y > 0 else alpha * dY`` (``Y`` is LeakyRelu's output)."""
    d_y, y = node.input[0], node.input[1]
    (d_x,) = node.output
    alpha = float(_attrs(node).get("alpha", 0.01))
    zero = ctx.const(f"{d_x}/zero", np.zeros((), np.float32))
    slope = ctx.const(f"{d_x}/alpha", np.array(alpha, np.float32))
    zero_y, slope_t, scaled, positive = (ctx.fresh(f"{d_x}/{n}") for n in ("zero_y", "alpha_t", "scaled", "pos"))
    return [
        _node("CastLike", [zero, y], [zero_y], node, "zero_y"),
        _node("CastLike", [slope, d_y], [slope_t], node, "alpha"),
        _node("Mul", [d_y, slope_t], [scaled], node, "scaled"),
        _node("Greater", [y, zero_y], [positive], node, "positive"),
        _node("Where", [positive, d_y, scaled], [d_x], node, "where"),
    ]


def _axis(node: Any, ctx: LoweringContext, hint: str) -> str:
    return ctx.const(f"{hint}/axis", np.array([int(_attrs(node).get("axis", -1))], np.int64))


def lower_softmax_grad_13(node: Any, ctx: LoweringContext) -> list[Any]:
    """``SoftmaxGrad_13(dY, Y) = Y * (dY - sum(dY * Y, axis))`` (opset-13 Softmax: one axis)."""
    d_y, y = node.input[0], node.input[1]
    (d_x,) = node.output
    prod, total, diff = ctx.fresh(f"{d_x}/dy_y"), ctx.fresh(f"{d_x}/sum"), ctx.fresh(f"{d_x}/diff")
    return [
        _node("Mul", [d_y, y], [prod], node, "dy_y"),
        _node("ReduceSum", [prod, _axis(node, ctx, d_x)], [total], node, "sum", keepdims=1),
        _node("Sub", [d_y, total], [diff], node, "diff"),
        _node("Mul", [y, diff], [d_x], node, "mul"),
    ]


def lower_log_softmax_grad_13(node: Any, ctx: LoweringContext) -> list[Any]:
    """``LogSoftmaxGrad_13(dY, Y) = dY - exp(Y) * sum(dY, axis)`` (``Y`` is LogSoftmax's output)."""
    d_y, y = node.input[0], node.input[1]
    (d_x,) = node.output
    prob, total, scaled = ctx.fresh(f"{d_x}/prob"), ctx.fresh(f"{d_x}/sum"), ctx.fresh(f"{d_x}/scaled")
    return [
        _node("Exp", [y], [prob], node, "exp"),
        _node("ReduceSum", [d_y, _axis(node, ctx, d_x)], [total], node, "sum", keepdims=1),
        _node("Mul", [prob, total], [scaled], node, "scaled"),
        _node("Sub", [d_y, scaled], [d_x], node, "sub"),
    ]


_SCATTER_ADD_OPSET = 16  # ScatterElements' reduction attribute


def lower_max_pool_grad(node: Any, ctx: LoweringContext) -> list[Any]:
    """``MaxPoolGrad(dY, indices)``: ``dX`` of MaxPool's input shape, ``dX.flat[indices[i]] += dY.flat[i]``.

    onnxruntime registers MaxPoolGrad in the standard domain, but ONNX defines no such op. Its
    kernel reads only the indices the forward ``MaxPool`` returned (flat positions in the
    whole row-major input, batch and channel included), so padding, strides, dilations,
    ``ceil_mode`` and overlapping windows need nothing here: a ``ScatterElements`` with
    ``reduction = add`` over the flattened input adds each incoming gradient where its
    maximum was, in the kernel's order. ``dX``'s shape is the forward input's (read with
    ``Shape`` on it; the kernel takes the statically inferred one).

    Not lowered: ``storage_order = 1`` (column-major indices, which the kernel would scatter as
    row-major ones), indices that no ``MaxPool`` of the graph produced, and graphs below opset 16.
    """
    attrs = _attrs(node)
    if int(attrs.get("storage_order", 0)) != 0:
        raise NotLowerable("storage_order=1")
    if ctx.opset < _SCATTER_ADD_OPSET:
        raise NotLowerable(f"opset {ctx.opset} < {_SCATTER_ADD_OPSET}")
    d_y, indices = node.input[0], node.input[1]
    (d_x,) = node.output
    forward = ctx.producers.get(indices)
    if (forward is None or forward.op_type != "MaxPool" or forward.domain not in ("", "ai.onnx")
            or len(forward.output) < 2 or forward.output[1] != indices):
        raise NotLowerable("indices not from a MaxPool")
    x = forward.input[0]
    t = ctx.fresh
    shape, count, size, zeros, flat_i, flat_dy, summed = (t(f"{d_x}/{n}") for n in (
        "shape", "count", "size", "zeros", "flat_indices", "flat_dy", "scattered"))
    flat = ctx.const(f"{d_x}/flat", np.array([-1], np.int64))
    from onnx import helper

    return [
        _node("Shape", [x], [shape], node, "shape"),
        _node("Size", [x], [count], node, "count"),
        _node("Reshape", [count, ctx.const(f"{d_x}/one_dim", np.array([1], np.int64))], [size], node, "size"),
        _node("ConstantOfShape", [size], [zeros], node, "zeros",
              value=helper.make_tensor("zero", 1, [1], [0.0])),  # float32, the kernel's only type
        _node("Reshape", [indices, flat], [flat_i], node, "flat_indices"),
        _node("Reshape", [d_y, flat], [flat_dy], node, "flat_dy"),
        _node("ScatterElements", [zeros, flat_i, flat_dy], [summed], node, "scatter", axis=0, reduction="add"),
        _node("Reshape", [summed, shape], [d_x], node, "dx"),
    ]


LOWERINGS: dict[tuple[str, str], Lowering] = {
    ("com.microsoft", "ReluGrad"): lower_relu_grad,
    ("com.microsoft", "Scale"): lower_scale,
    ("com.microsoft", "SoftmaxCrossEntropyLossGrad"): lower_softmax_cross_entropy_loss_grad,
    ("com.microsoft", "ConvGrad"): lower_conv_grad,
    ("com.microsoft", "InPlaceAccumulatorV2"): lower_accumulator,
    ("com.microsoft", "SigmoidGrad"): lower_sigmoid_grad,
    ("com.microsoft", "TanhGrad"): lower_tanh_grad,
    ("com.microsoft", "LeakyReluGrad"): lower_leaky_relu_grad,
    ("com.microsoft", "SoftmaxGrad_13"): lower_softmax_grad_13,
    ("com.microsoft", "LogSoftmaxGrad_13"): lower_log_softmax_grad_13,
    ("", "MaxPoolGrad"): lower_max_pool_grad,  # ORT's kernel in the standard domain; not an ONNX op
}
"""(domain, op type) -> lowering. Each entry has an op-by-op test against the contrib kernel."""


# --- the whole graph ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Lowered:
    """Result of :func:`lower_training_graph`: the portable model, or the ops that blocked it."""

    model: Any | None
    unsupported_ops: tuple[str, ...] = ()


def _static_shapes(graph: Any) -> dict[str, list[int | None]]:
    shapes: dict[str, list[int | None]] = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        tensor = info.type.tensor_type
        if tensor.HasField("shape"):
            shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    return shapes


def lower_training_graph(model: "onnx.ModelProto", params: Sequence[str]) -> Lowered:
    """Rewrite a generated training graph into standard ONNX ops.

    Args:
        model: ``training_model.onnx`` as ``generate_artifacts`` wrote it.
        params: The trainable parameters, in layout order; each must have a gradient
            accumulator in the graph.

    Returns:
        The portable model (inputs: data, labels, parameters; outputs: the original outputs
        without accumulator flags, then ``<param>_grad`` in ``params`` order), or no model
        and the sorted names of the ops that have no lowering.

    Raises:
        ArtifactError: The graph is not a training graph of these parameters (a parameter
            without gradient accumulator).
    """
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    taken = {name for n in graph.node for name in (*n.input, *n.output)}
    taken |= {i.name for i in graph.input} | {i.name for i in graph.initializer}
    producers = {name: n for n in graph.node for name in n.output if name}
    ctx = LoweringContext(opset=opset, shapes=_static_shapes(graph), taken=taken, producers=producers)
    nodes: list[Any] = []
    unsupported: set[str] = set()
    for node in graph.node:
        lowered, why_not = _lower_node(node, ctx)
        nodes.extend(lowered)
        if why_not is not None:
            unsupported.add(why_not)
    if unsupported:
        return Lowered(model=None, unsupported_ops=tuple(sorted(unsupported)))
    outputs = _gradient_outputs(graph, params, ctx, nodes)
    return Lowered(model=_portable_model(model, nodes, outputs, ctx))


def _is_standard(node: Any) -> bool:
    """Whether the ONNX schema defines ``node``'s op. onnxruntime registers some gradient kernels
    (MaxPoolGrad, ...) in the standard domain although ONNX defines no such op: the domain alone is not enough."""
    import onnx

    return node.domain in STANDARD_DOMAINS and onnx.defs.has(node.op_type, "" if node.domain == "ai.onnx"
                                                             else node.domain)


def _lower_node(node: Any, ctx: LoweringContext) -> tuple[list[Any], str | None]:
    """``(the nodes replacing node, None)``, or ``([], why not)`` naming the op (and the reason) that blocks
    the portable graph. A standard node stays as it is."""
    if _is_standard(node):
        return [node], None
    lowering = LOWERINGS.get(("" if node.domain == "ai.onnx" else node.domain, node.op_type))
    if lowering is None:
        return [], node.op_type
    if ctx.opset < _MIN_OPSET:
        return [], f"{node.op_type} (opset {ctx.opset} < {_MIN_OPSET})"
    try:
        return lowering(node, ctx), None
    except NotLowerable as exc:
        return [], f"{node.op_type} ({exc})"


def _gradient_outputs(graph: Any, params: Sequence[str], ctx: LoweringContext, nodes: list[Any]) -> list[Any]:
    """The portable graph's outputs: the original ones the accumulators did not flag, then ``<param>_grad`` for
    every parameter in ``params`` order, each typed as its accumulation buffer. A gradient whose tensor has
    another name (or is a graph input) gets an ``Identity`` appended to ``nodes`` to carry the output's name."""
    from onnx import helper

    inputs_by_name = {i.name: i for i in graph.input}
    missing = [p for p in params if p not in ctx.gradients]
    if missing:
        raise ArtifactError(f"training graph has no gradient accumulator for {missing}")
    outputs = [o for o in graph.output if o.name not in ctx.dropped_outputs]
    for param in params:
        target = f"{param}{GRAD_SUFFIX}"
        source = ctx.gradients[param]
        if source != target or source in inputs_by_name:
            if target in ctx.taken and source != target:
                raise ArtifactError(f"cannot name the gradient of {param!r} {target!r}: the name is taken")
            nodes.append(helper.make_node("Identity", [source], [target], name=f"{target}/portable/output"))
        spec = inputs_by_name[ctx.gradient_buffers[param]].type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in spec.shape.dim]
        outputs.append(helper.make_tensor_value_info(target, spec.elem_type, dims))
    return outputs


def _portable_model(model: "onnx.ModelProto", nodes: list[Any], outputs: list[Any],
                    ctx: LoweringContext) -> "onnx.ModelProto":
    """The lowered graph as a checked model: only the inputs and value_info still used, the new initializers
    after the original ones, and opset imports for the domains the nodes still use."""
    import onnx
    from onnx import helper

    graph = model.graph
    used = {name for n in nodes for name in n.input} | {o.name for o in outputs}
    inputs = [i for i in graph.input if i.name in used]
    produced = {name for n in nodes for name in n.output} | {i.name for i in inputs}
    domains = {n.domain for n in nodes} - {""}
    new_graph = helper.make_graph(
        nodes, f"{graph.name}_portable", inputs, outputs,
        initializer=[*graph.initializer, *ctx.initializers],
        value_info=[v for v in graph.value_info if v.name in produced])
    opsets = [helper.make_opsetid("", ctx.opset)] + [
        o for o in model.opset_import if o.domain in domains and o.domain not in ("", "ai.onnx")]
    portable = helper.make_model(new_graph, opset_imports=opsets, producer_name="fedtier.models.portable",
                                 ir_version=model.ir_version)
    helper.set_model_props(portable, {"fedtier.portable_format": str(PORTABLE_FORMAT)})
    try:
        onnx.checker.check_model(portable)
    except onnx.checker.ValidationError as exc:
        raise ArtifactError(f"the portable training graph is not valid ONNX: {exc}") from exc
    return portable


def write_portable(directory: Path, forward: "onnx.ModelProto", training: "onnx.ModelProto",
                   layout: Layout) -> tuple[dict[str, BundleFile], PortableInfo]:
    """Write the portable training graph and its checkpoint into a bundle being built.

    Args:
        directory: The bundle's build directory.
        forward: The exported forward model (its initializers are the initial weights and the
            frozen tensors' values, the same values ``generate_artifacts`` put into the checkpoint).
        training: The generated training graph.
        layout: The bundle's parameter layout.

    Returns:
        The files to add to the bundle (none if an op has no lowering) and the record for
        its descriptor.

    Raises:
        ArtifactError: The forward model's initializers do not match the layout, or the
            lowered graph is invalid.
    """
    import onnx
    from onnx import numpy_helper

    lowered = lower_training_graph(training, list(layout.names))
    frozen: list[str] = []
    if lowered.model is not None:
        blocked, frozen = _fit_interface(lowered.model, training, forward, layout)
        if blocked:
            lowered = Lowered(model=None, unsupported_ops=(blocked,))
    info = PortableInfo(format=PORTABLE_FORMAT, unsupported_ops=lowered.unsupported_ops)
    if lowered.model is None:
        logger.warning("no portable training graph: no lowering for %s; devices without "
                       "onnxruntime-training will refuse this bundle", ", ".join(lowered.unsupported_ops))
        return {}, info
    weights = {init.name: numpy_helper.to_array(init) for init in forward.graph.initializer}
    chunks = []
    for spec in layout.params:
        value = weights.get(spec.name)
        if value is None or tuple(value.shape) != spec.shape or value.dtype != np.float32:
            raise ArtifactError(f"forward model initializer {spec.name!r} does not match the layout "
                                f"({None if value is None else (value.shape, value.dtype)} vs {spec.shape})")
        chunks.append(np.ascontiguousarray(value, dtype="<f4").tobytes())
    chunks += [np.ascontiguousarray(weights[name], dtype="<f4").tobytes() for name in frozen]
    model_path = Path(directory) / FILENAMES["portable_model"]
    checkpoint_path = Path(directory) / FILENAMES["portable_checkpoint"]
    onnx.save(lowered.model, str(model_path))
    checkpoint_path.write_bytes(b"".join(chunks))
    return {role: BundleFile.of(Path(directory) / name) for role, name in FILENAMES.items()}, info


def _fit_interface(portable: "onnx.ModelProto", training: "onnx.ModelProto", forward: "onnx.ModelProto",
                   layout: Layout) -> tuple[str, list[str]]:
    """Order the portable graph's inputs as the interface says; return ``(why not, frozen names)``.

    The interface: ``input``, the loss's label input (``labels`` or ``target``), the trained
    parameters in layout order, then the frozen tensors in the generated graph's order, each
    with its static shape (the device reads their values from the checkpoint's tail, and
    feeds them to the eval graph too, which takes them as inputs like the training graph).
    Anything else the graph wants is reported as the reason it cannot ship.
    """
    import onnx
    from onnx import TensorProto, helper

    graph = portable.graph
    by_name = {i.name: i for i in graph.input}
    names = set(layout.names)
    label = next((n for n in (PORTABLE_LABELS, PORTABLE_TARGET) if n in by_name), None)
    weights = {init.name: init for init in forward.graph.initializer}
    generated = [i.name for i in training.graph.input]
    frozen = [n for n in generated if n not in names and n in weights and weights[n].data_type == TensorProto.FLOAT]
    head = [PORTABLE_INPUT, label, *layout.names]
    extra = [n for n in by_name if n not in head and n not in frozen]
    if label is None or PORTABLE_INPUT not in by_name or extra or not names <= set(by_name):
        wanted = extra or [n for n in head if n not in by_name]
        return (f"graph inputs {wanted} (the portable graph takes {PORTABLE_INPUT}, {PORTABLE_LABELS} or "
                f"{PORTABLE_TARGET}, the trained parameters and frozen initializers)"), []
    ordered = []
    for name in head:
        kept = onnx.ValueInfoProto()
        kept.CopyFrom(by_name[name])  # copied before the inputs are cleared below
        ordered.append(kept)
    # A frozen tensor the lowered graph no longer reads stays an input: the eval graph takes it.
    ordered += [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(weights[n].dims)) for n in frozen]
    del graph.input[:]
    graph.input.extend(ordered)
    return "", frozen


__all__ = [
    "FILENAMES",
    "GRAD_SUFFIX",
    "LOWERINGS",
    "Lowered",
    "LoweringContext",
    "NotLowerable",
    "lower_training_graph",
    "write_portable",
]

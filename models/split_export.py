"""HSGD's trained split model as one inference ONNX graph: ``(x1, x2) -> logits``.

The model is ``theta0``'s head over the two encoders' embeddings (``fedtier.training.split``):
``logits = [relu(x1 W1^T + b1), relu(x2 W2^T + b2)] W0^T + b0``. A deployment that keeps the feature
blocks apart runs the same weights as HSGD does — the device computes ``zeta2`` with ``theta2`` and
the host the rest — but a model served where both blocks are at hand (a hospital's own analysis, or
the held-out evaluation) wants one graph; this writes it with ``onnx.helper`` from the parameters
alone (no torch), at opset 17 like every graph of the project.

onnx is imported inside the function (the coordinator has it, through onnxruntime-training).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from fedtier.errors import ArtifactError
from fedtier.training.split import SplitArch

OPSET = 17
INPUTS = ("x1", "x2")
"""The host's feature block and a device's, each ``(batch, width)`` float32."""
OUTPUT = "logits"


def export_split(arch: SplitArch, params: Mapping[str, np.ndarray], path: Path | str) -> Path:
    """Write ``params`` (the six ``theta*`` tensors of ``arch``) as ``(x1, x2) -> logits`` to ``path``.

    Raises:
        ArtifactError: a tensor is missing or has the wrong shape, or onnx's checker refuses the graph.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    for name, shape in arch.shapes().items():
        if name not in params:
            raise ArtifactError(f"split model: no {name} among the parameters {sorted(params)}")
        if tuple(np.shape(params[name])) != shape:
            raise ArtifactError(f"split model: {name} has shape {tuple(np.shape(params[name]))}, "
                                f"the arch needs {shape}")
    initializers = [numpy_helper.from_array(np.asarray(params[name], np.float32), name.replace("/", "_"))
                    for name in arch.shapes()]
    nodes = [
        helper.make_node("Gemm", ["x1", "theta1_w", "theta1_b"], ["pre1"], transB=1),
        helper.make_node("Relu", ["pre1"], ["zeta1"]),
        helper.make_node("Gemm", ["x2", "theta2_w", "theta2_b"], ["pre2"], transB=1),
        helper.make_node("Relu", ["pre2"], ["zeta2"]),
        helper.make_node("Concat", ["zeta1", "zeta2"], ["h"], axis=1),
        helper.make_node("Gemm", ["h", "theta0_w", "theta0_b"], [OUTPUT], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "hsgd_split_model",
        [helper.make_tensor_value_info("x1", TensorProto.FLOAT, ["batch", arch.x1]),
         helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["batch", arch.x2])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", arch.classes])],
        initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="fedtier")
    model.ir_version = 8  # what onnxruntime 1.19 (and every later one) reads
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ArtifactError(f"split model graph refused by onnx's checker: {exc}") from exc
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    return out

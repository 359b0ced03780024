"""The inference file a user takes away (``fedtier coordinator export``, ``fedtier rollout export``): rows in,
and what it takes and returns stated beside it.

* **Flat rows.** Devices train on rows (a CSV's features, a shard's ``x``) reshaped to the model's example
  shape. An exported model whose example has more than one axis (a 1-D CNN's ``(channels, length)``, an
  image's ``(1, 8, 8)``) gets a ``Reshape`` as its first node (``accept_flat_rows``), so it takes the same
  rows, ``(batch, features)``, and nobody reshapes them by hand. Its input keeps the name ``input``.
* **Its interface, stated.** ``describe`` reads the names, shapes and element types of the written file's
  inputs and outputs (the file itself, so the statement cannot drift from it) and says how to read the
  outputs; ``write_description`` puts that beside the file as ``<file>.json`` (``hand1.onnx`` ->
  ``hand1.onnx.json``), and the export commands print it.

onnx is imported inside the functions (only the coordinator exports).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from models.export import INPUT_NAME

RESHAPED = "input_as_example"
"""The exported graph's name for the rows reshaped to the model's example shape."""

_DTYPES = {1: "float32", 6: "int32", 7: "int64", 10: "float16", 11: "float64"}

READING = {
    "cross_entropy": "one score (logit) per class: the largest is the predicted class; softmax gives probabilities",
    "bce": "one logit per target column: sigmoid gives the probability of 1",
    "mse": "the predicted targets, one per target column",
    "weighted_score": "one score per example: higher ranks it as more likely positive (sigmoid gives a probability)",
}
"""How to read a model's outputs, by the loss it was trained with."""


def description_path(model_path: Path | str) -> Path:
    """Where the description of ``model_path`` goes: ``<file>.json`` beside it."""
    path = Path(model_path)
    return path.with_name(path.name + ".json")


def accept_flat_rows(path: Path | str, example_shape: Sequence[int]) -> bool:
    """Make the model at ``path`` take rows ``(batch, prod(example_shape))`` and reshape them to
    ``(batch, *example_shape)`` itself; nothing to do (``False``) when the example is already a row.

    The file is rewritten in place; its input keeps its name (``input``).
    """
    import onnx
    from onnx import numpy_helper

    shape = [int(d) for d in example_shape]
    if len(shape) <= 1:
        return False
    model = onnx.load(str(path))
    graph = model.graph
    (value,) = [i for i in graph.input if i.name == INPUT_NAME]
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name == INPUT_NAME:
                node.input[k] = RESHAPED
    target = numpy_helper.from_array(np.array([-1, *shape], dtype=np.int64), name=f"{RESHAPED}_shape")
    graph.initializer.append(target)
    graph.node.insert(0, onnx.helper.make_node("Reshape", [INPUT_NAME, target.name], [RESHAPED],
                                               name="flat_rows_to_example"))
    dims = value.type.tensor_type.shape.dim
    del dims[:]
    dims.add().dim_param = "batch"
    dims.add().dim_value = int(np.prod(shape))
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return True


def describe(path: Path | str, *, loss: str | None = None, example_shape: Sequence[int] | None = None,
             **facts: Any) -> dict[str, Any]:
    """The interface of the ONNX file at ``path``: each input's and output's name, shape (``"batch"`` for the
    batch axis) and element type, read from the file; ``loss`` adds how to read the outputs, ``example_shape``
    what the network sees after a flat-rows reshape; ``facts`` (rollout, version, ...) are kept as given."""
    import onnx

    graph = onnx.load(str(path)).graph
    initializers = {i.name for i in graph.initializer}

    def tensor(value: Any) -> dict[str, Any]:
        t = value.type.tensor_type
        shape = [int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
        return {"name": value.name, "shape": shape, "dtype": _DTYPES.get(t.elem_type, f"onnx type {t.elem_type}")}

    doc: dict[str, Any] = {"file": Path(path).name, **facts,
                           "inputs": [tensor(i) for i in graph.input if i.name not in initializers],
                           "outputs": [tensor(o) for o in graph.output]}
    if example_shape is not None and len(example_shape) > 1:
        doc["example_shape"] = [int(d) for d in example_shape]
        doc["reshape"] = (f"rows of {int(np.prod(example_shape))} features are reshaped to "
                          f"{tuple(int(d) for d in example_shape)} inside the model")
    if loss is not None:
        doc["loss"] = loss
        if loss in READING:
            doc["reading"] = READING[loss]
    return doc


def write_description(path: Path | str, doc: Mapping[str, Any]) -> Path:
    """Write ``doc`` beside the model as ``<file>.json``; return its path."""
    target = description_path(path)
    target.write_text(json.dumps(doc, indent=1) + "\n")
    return target


def interface_lines(doc: Mapping[str, Any]) -> list[str]:
    """The interface in a few lines, for a terminal (what the export commands print)."""

    def shape(t: Mapping[str, Any]) -> str:
        return "(" + ", ".join(str(d) for d in t["shape"]) + ")"

    lines = [f"  input  {t['name']!r}: {t['dtype']} {shape(t)}" for t in doc["inputs"]]
    if "reshape" in doc:
        lines[-1] += f"; {doc['reshape']}"
    lines += [f"  output {t['name']!r}: {t['dtype']} {shape(t)}" for t in doc["outputs"]]
    if "reading" in doc:
        lines[-1] += f": {doc['reading']}"
    return lines

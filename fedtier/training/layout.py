"""Model descriptions every tier can read without torch: architecture and parameter layout.

``ArchSpec`` says *which* network (so the coordinator can build it and a torch-backed
device can rebuild it); ``Layout`` says *what tensors* it has (names, shapes, order). Both
are plain data with a canonical JSON form, so their sha256 can be put in manifests and
message headers: a receiver refuses tensors whose layout hash is not the rollout's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from fedtier.errors import LayoutMismatchError, LocalProtocolError

ARCH_KINDS = ("mlp", "cnn1d", "onnx")
"""``mlp`` and ``cnn1d`` are the built-in models; ``onnx`` is a user's model (a torch factory or an
ONNX file), identified by the sha256 of its forward graph."""

LOSSES = ("cross_entropy", "bce", "mse", "weighted_score")
"""Training losses: ``cross_entropy`` on integer class labels, ``bce`` (binary cross-entropy on
logits) and ``mse`` on float targets shaped like the model's output; ``weighted_score`` is the
graph X-risk algorithms (FeDXL) train through: ``sum_n c_n * output_n`` for a one-output score
model, the coefficients ``c`` fed as the graph's ``labels`` input (computed outside the graph from
the current scores), the data's labels being classes 0 (negative) and 1 (positive)."""

SCORE_LOSSES = ("weighted_score",)
"""Losses whose model is a scorer trained by coefficients, not by labels (``Trainer.score_gradient``)."""

_ONNX_OPTIONS = frozenset({"sha256", "input_shape", "outputs", "loss"})


def canonical_json(obj: Any) -> bytes:
    """The one JSON form we hash and sign: sorted keys, no whitespace, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One named parameter tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "ParamSpec":
        return cls(name=str(obj["name"]), shape=tuple(int(d) for d in obj["shape"]),
                   dtype=str(obj.get("dtype", "float32")))


@dataclass(frozen=True, slots=True)
class Layout:
    """Ordered parameter specs of a model (training-graph order, not alphabetical)."""

    params: tuple[ParamSpec, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise LocalProtocolError(f"duplicate parameter names in layout: {names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def num_parameters(self) -> int:
        return sum(p.size for p in self.params)

    def spec(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_json(self) -> list[dict[str, Any]]:
        return [p.to_json() for p in self.params]

    @classmethod
    def from_json(cls, obj: list[Mapping[str, Any]]) -> "Layout":
        return cls(params=tuple(ParamSpec.from_json(p) for p in obj))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(canonical_json(self.to_json())).hexdigest()

    def check(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Raise ``LayoutMismatchError`` unless ``tensors`` has exactly this layout."""
        if set(tensors) != set(self.names):
            missing = sorted(set(self.names) - set(tensors))
            extra = sorted(set(tensors) - set(self.names))
            raise LayoutMismatchError(f"tensor names differ from layout: missing={missing} extra={extra}")
        for p in self.params:
            arr = tensors[p.name]
            if tuple(arr.shape) != p.shape:
                raise LayoutMismatchError(f"{p.name}: shape {tuple(arr.shape)} != layout {p.shape}")

    def zeros(self) -> dict[str, np.ndarray]:
        return {p.name: np.zeros(p.shape, dtype=np.dtype(p.dtype)) for p in self.params}


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """Which network to build. ``kind`` picks the family; ``options`` its hyper-parameters.

    * ``mlp``: ``{"sizes": [in, hidden..., out]}`` — ReLU between Linear layers.
    * ``cnn1d``: ``{"channels": c, "length": L, "classes": k, "filters": [..], "kernel": k}``
      — a 1-D CNN for sensor windows.
    * ``onnx``: ``{"sha256": <forward graph>, "input_shape": [..], "outputs": k, "loss": ..}`` —
      a user's model (``models.source``). Its identity is the sha256 of the forward graph that
      was trained, so a changed model is a different architecture, never a stale cache hit.
      Built-in models always train with ``cross_entropy``.
    """

    kind: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ARCH_KINDS:
            raise LocalProtocolError(f"unknown architecture kind {self.kind!r}; expected one of {ARCH_KINDS}")
        if self.kind == "onnx":
            _check_onnx_options(self.options)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "options": dict(self.options)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "ArchSpec":
        return cls(kind=str(obj["kind"]), options=dict(obj.get("options", {})))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(canonical_json(self.to_json())).hexdigest()

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input example (without the batch axis)."""
        if self.kind == "mlp":
            return (int(self.options["sizes"][0]),)
        if self.kind == "onnx":
            return tuple(int(d) for d in self.options["input_shape"])
        return (int(self.options["channels"]), int(self.options["length"]))

    @property
    def num_classes(self) -> int:
        """Width of the model's output: classes for ``cross_entropy``, outputs for ``bce``/``mse``."""
        if self.kind == "mlp":
            return int(self.options["sizes"][-1])
        if self.kind == "onnx":
            return int(self.options["outputs"])
        return int(self.options["classes"])

    @property
    def loss(self) -> str:
        """The training loss (one of ``LOSSES``)."""
        return str(self.options["loss"]) if self.kind == "onnx" else "cross_entropy"

    @property
    def builtin(self) -> bool:
        """A model of the zoo, which a torch-backed device can rebuild from ``(arch, seed)``."""
        return self.kind != "onnx"


def _check_onnx_options(options: Mapping[str, Any]) -> None:
    """An ``onnx`` architecture's options: exactly the known keys, with sane values."""
    if set(options) != _ONNX_OPTIONS:
        raise LocalProtocolError(f"onnx architecture options {sorted(options)} differ from {sorted(_ONNX_OPTIONS)}")
    sha = options["sha256"]
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        raise LocalProtocolError(f"onnx architecture sha256 {sha!r} is not a hex sha256")
    shape, outputs = options["input_shape"], options["outputs"]
    if (not isinstance(shape, (list, tuple)) or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise LocalProtocolError(f"onnx architecture input_shape {shape!r} must be a list of positive ints")
    if not isinstance(outputs, int) or isinstance(outputs, bool) or outputs < 1:
        raise LocalProtocolError(f"onnx architecture outputs {outputs!r} must be a positive int")
    if options["loss"] not in LOSSES:
        raise LocalProtocolError(f"onnx architecture loss {options['loss']!r} is not one of {LOSSES}")


PROX_PREFIX = "prox."
"""FedProx training graphs (``proximal_mu`` > 0) take the anchor weights as inputs ``prox.<parameter>``."""
PROX_UNSUPPORTED = "the FedProx proximal term (its anchor inputs; train with onnxruntime-training)"
"""What a FedProx bundle's descriptor names as blocking the portable trainer (it feeds no anchors)."""

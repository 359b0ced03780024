"""Users' models for the portable backend's tests: the ``fedtier init`` starter and one model per loss.

The per-loss models have frozen tensors of both kinds a torch module can have (a buffer, and a
parameter with ``requires_grad = False``) and a Tanh, so their generated graphs hold a frozen
input, TanhGrad, and for bce SigmoidGrad. Built through ``models.source`` as a rollout builds them.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from commands.starter import MODEL_PY as STARTER_PY
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.training.layout import ArchSpec

USER_PY = textwrap.dedent("""
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self, outputs):
            super().__init__()
            self.body = nn.Linear(12, 8)
            self.head = nn.Linear(8, outputs)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 12))  # frozen: a buffer
            self.body.bias.requires_grad_(False)  # frozen: a parameter left out of training

        def forward(self, x):
            return self.head(torch.tanh(self.body(x.flatten(1) * self.scale)))


    def cross_entropy():
        return Net(4), torch.zeros(2, 12)

    def bce():
        return Net(3), torch.zeros(2, 12)

    def mse():
        return Net(2), torch.zeros(2, 12)
""")

MODELS = {
    "starter": ("starter.py:make_model", "cross_entropy"),
    "cross_entropy": ("user.py:cross_entropy", "cross_entropy"),
    "bce": ("user.py:bce", "bce"),
    "mse": ("user.py:mse", "mse"),
    "onnx_head_only": ("user.py:cross_entropy", "cross_entropy"),  # exported to a file; trainable = the head
}
"""name -> (factory in the models directory, loss)."""

HEAD = ["head.weight", "head.bias"]
"""``[model] trainable`` of the ``onnx_head_only`` model: the rest of its float initializers stay frozen."""

FROZEN = {"starter": (), "cross_entropy": ("scale", "body.bias"), "bce": ("scale", "body.bias"),
          "mse": ("scale", "body.bias"), "onnx_head_only": ("scale", "body.weight", "body.bias")}
"""The frozen tensors of each model, in the generated graph's order."""


def write_models(directory: Path) -> Path:
    """Write the factories' files into ``directory``; return it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "starter.py").write_text(STARTER_PY)
    (directory / "user.py").write_text(USER_PY)
    return directory


def build_user_bundles(directory: Path, store: Path) -> dict[str, ArtifactBundle]:
    """Build every model of :data:`MODELS` (factories in ``directory``) into ``store``."""
    from models.artifacts import build_artifacts
    from models.source import model_source

    write_models(directory)
    bundles = {}
    for name, (factory, loss) in MODELS.items():
        if name == "onnx_head_only":
            source = model_source(onnx_path=export_as_a_user_would(directory, factory), loss=loss, trainable=HEAD)
        else:
            source = model_source(factory=f"{directory / factory}", loss=loss, seed=0)
        bundles[name] = build_artifacts(source, store)
    return bundles


def export_as_a_user_would(directory: Path, factory: str) -> Path:
    """The factory's module exported with torch's own exporter (not fedtier's), dynamic batch axis."""
    import warnings

    import torch

    from models.source import call_factory

    module, example = call_factory(f"{directory / factory}", 0)
    path = directory / "exported.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter's notice
        torch.onnx.export(module, (example,), str(path), dynamo=False, input_names=["readings"],
                          output_names=["scores"], dynamic_axes={"readings": {0: "n"}, "scores": {0: "n"}})
    return path


def batches_for(arch: ArchSpec, steps: int, seed: int, batch: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` batches of inputs and of labels or targets fitting the model's loss."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps, batch, *arch.input_shape)).astype(np.float32)
    if arch.loss == "cross_entropy":
        y = rng.integers(0, arch.num_classes, size=(steps, batch)).astype(np.int64)
    elif arch.loss == "bce":
        y = rng.random((steps, batch, arch.num_classes)).astype(np.float32)  # soft targets in [0, 1]
    else:
        y = (2 * rng.standard_normal((steps, batch, arch.num_classes))).astype(np.float32)
    return x, y

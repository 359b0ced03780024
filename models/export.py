"""Export a zoo model (or a user's torch module) to an ONNX forward graph that onnxruntime-training 1.19.2 can train.

Settings follow the field notes (§0, §1.2): the legacy TorchScript exporter
(``dynamo=False``; the dynamo exporter ignores ``training=`` and silently folds layers),
opset 17 (ORT 1.19.2 tops out at 21), ``TrainingMode.TRAINING`` and no constant folding so
every parameter stays a named initializer. After export we check that the initializers are
exactly the ``state_dict`` entries, in order and with the layout's shapes: a silently folded
or renamed parameter would otherwise surface much later as a layout mismatch on devices.

torch and onnx are imported inside the function (``import models.export`` stays cheap).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from fedtier.errors import ArtifactError
from fedtier.training.layout import ArchSpec, Layout, ParamSpec
from models.zoo import build_model, layout_of

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np
    import onnx
    import torch

logger = logging.getLogger(__name__)

OPSET = 17
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
_EXPORT_BATCH = 2


def export_forward(arch: ArchSpec, seed: int, path: Path | str,
                   params: "dict[str, np.ndarray] | None" = None) -> "onnx.ModelProto":
    """Export ``build_model(arch, seed)`` as an ONNX forward model (input -> logits).

    Args:
        arch: The architecture.
        seed: Seed of the initial weights written as initializers.
        path: Where to write the ``.onnx`` file (parent directory must exist).
        params: The weights of ``initial_parameters(arch, seed)`` if the caller has them (then
            the zoo is not asked again for them or for the layout).

    Returns:
        The exported model as loaded back from ``path``.

    Raises:
        ArtifactError: The exported initializers differ from the model's ``state_dict``
            (names, order or shapes), i.e. the exporter folded or renamed a parameter.
        LocalProtocolError: Invalid architecture options or seed.
    """
    import torch

    model = build_model(arch, seed, params)
    layout = None if params is None else Layout(
        params=tuple(ParamSpec(name, tuple(arr.shape)) for name, arr in params.items()))
    dummy = torch.zeros((_EXPORT_BATCH, *arch.input_shape), dtype=torch.float32)
    proto = export_module(model, dummy, path)
    _check_initializers(proto, list(model.state_dict()), arch, layout)
    logger.debug("exported %s (seed %d) to %s: IR %d, opset %d", arch.kind, seed, path,
                 proto.ir_version, OPSET)
    return proto


def export_module(model: "torch.nn.Module", example: "torch.Tensor", path: Path | str | BinaryIO
                  ) -> "onnx.ModelProto":
    """Export a torch module (in train mode) with the settings ORT 1.19.2 can make trainable.

    The zoo's models and users' torch factories (``models.source``) go through here, so both
    get the same exporter, opset and batch axis.

    Args:
        model: The module; its parameters become named initializers.
        example: One example batch ``(batch, *input_shape)``.
        path: Where to write the ``.onnx`` file, or a binary stream.

    Returns:
        The exported model, loaded back.

    Raises:
        Exception: Whatever ``torch.onnx.export`` raises for a module it cannot trace.
    """
    import onnx
    import torch

    model.train()
    with warnings.catch_warnings():
        # torch 2.9+ deprecates the legacy exporter and the ``training`` argument; we need
        # both (field notes §0.5), so keep the warnings out of users' logs.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        torch.onnx.export(
            model,
            (example,),
            path if not isinstance(path, Path) else str(path),  # type: ignore[arg-type]  # streams work too
            dynamo=False,
            export_params=True,
            opset_version=OPSET,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
            keep_initializers_as_inputs=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )
    if isinstance(path, (str, Path)):
        return onnx.load(str(path))
    path.seek(0)
    return onnx.load_model_from_string(path.read())


def _check_initializers(proto: "onnx.ModelProto", state_keys: list[str], arch: ArchSpec,
                        layout: Layout | None = None) -> None:
    """Raise ``ArtifactError`` unless the initializers are exactly the layout (default: the zoo's), in order."""
    init_names = [init.name for init in proto.graph.initializer]
    if init_names != state_keys:
        raise ArtifactError(
            f"ONNX export of {arch.kind} changed the parameters (constant folding or renaming?): "
            f"initializers {init_names} != state_dict keys {state_keys}")
    if layout is None:
        layout = layout_of(arch)
    if init_names != list(layout.names):
        raise ArtifactError(
            f"zoo layout {list(layout.names)} disagrees with the exported initializers {init_names}")
    for init in proto.graph.initializer:
        shape = tuple(int(d) for d in init.dims)
        if shape != layout.spec(init.name).shape:
            raise ArtifactError(
                f"exported initializer {init.name} has shape {shape}, layout says "
                f"{layout.spec(init.name).shape}")
        if init.data_type != 1:  # onnx.TensorProto.FLOAT
            raise ArtifactError(f"exported initializer {init.name} is not float32")

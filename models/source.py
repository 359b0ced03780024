"""One entry for a rollout's model: a built-in zoo model, a torch factory, or an ONNX file.

:func:`model_source` resolves the model once into a :class:`ModelSource` — its architecture
(``ArchSpec``), parameter layout, initial weights, frozen tensors and the forward graph to make
trainable — and artifact building (``models.artifacts.build_artifacts``), the rollout's initial
parameters and the coordinator's evaluation all read that one object instead of asking the
zoo again.

Users' models (``[model] kind = "torch"`` or ``"onnx"``):

* **torch**: ``factory = "package.module:function"`` or ``"path/to/file.py:function"``, a callable
  returning ``(module, example_input)``. It is called under ``torch.manual_seed(seed)`` (on a
  forked RNG), so its initial weights are a function of ``[model] init_seed``; the module is
  exported with the zoo's exporter settings (``models.export.export_module``). The module's
  parameters with ``requires_grad`` are trained; its buffers stay frozen.
* **onnx**: ``path = "model.onnx"``, an inference graph with one batch-first input and one
  ``(batch, outputs)`` output. Its float initializers are trained, or only those listed in
  ``trainable`` (the others stay frozen); non-float initializers are constants.

Both end as the same thing, a *normalized forward graph*: input renamed ``input``, output
``logits``, the batch axis symbolic, stale shape annotations dropped. Its sha256 is the
model's identity (``ArchSpec("onnx", {"sha256": ...})``), so the content-addressed artifact
store never returns a bundle of an older version of the model. Before anything is built the
graph is run once with onnxruntime on a batch of three examples.

Every problem with a user's model is a ``ConfigError`` naming the config key
(``model.factory``, ``model.path``, ``model.trainable``, ``model.loss``). torch, onnx and
onnxruntime are imported inside functions; only the coordinator calls this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from fedtier.artifacts.bundle import MAX_IR_VERSION, MAX_OPSET
from fedtier.errors import ConfigError
from fedtier.rollout.config import ModelConfig
from fedtier.training.layout import LOSSES, ArchSpec, Layout, ParamSpec
from models.export import INPUT_NAME, OUTPUT_NAME

if TYPE_CHECKING:  # pragma: no cover - typing only
    import onnx

_FLOAT = 1  # onnx.TensorProto.FLOAT
_CHECK_BATCH = 3
_ONNX_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True, eq=False)
class ModelSource:
    """A rollout's model, resolved once.

    Attributes:
        arch: What the manifest and the bundle say the model is.
        layout: The trained tensors (names and shapes, in training-graph order).
        initial_params: Their initial values (float32), keyed like ``layout``.
        seed: The seed recorded in the bundle (the zoo's weights, or the factory's manual seed).
        frozen: Float initializers of the graph that are not trained.
        forward: The normalized forward graph of a user's model; ``None`` for a built-in model,
            which is exported from the zoo when artifacts are built.
    """

    arch: ArchSpec
    layout: Layout
    initial_params: Mapping[str, np.ndarray]
    seed: int = 0
    frozen: tuple[str, ...] = ()
    forward: bytes | None = None

    def write_forward(self, path: Path) -> "onnx.ModelProto":
        """Write the forward graph that ``generate_artifacts`` makes trainable; return it.

        Raises:
            ArtifactError: The zoo export changed the parameters (built-in models).
        """
        if self.forward is None:
            from models.export import export_forward

            return export_forward(self.arch, self.seed, path, params=dict(self.initial_params))
        import onnx

        Path(path).write_bytes(self.forward)
        return onnx.load_model_from_string(self.forward)


def model_source(*, arch: ArchSpec | None = None, factory: str | None = None, onnx_path: Path | str | None = None,
                 loss: str = "cross_entropy", trainable: Sequence[str] | None = None, seed: int = 0) -> ModelSource:
    """Resolve a model from exactly one of ``arch`` (built-in), ``factory`` (torch) or ``onnx_path``.

    Args:
        arch: A zoo architecture (``mlp``, ``cnn1d``).
        factory: ``"package.module:function"`` or ``"path/to/file.py:function"``.
        onnx_path: An ONNX inference graph.
        loss: ``cross_entropy``, ``bce``, ``mse`` or ``weighted_score`` (built-in models: ``cross_entropy``, or
            ``weighted_score`` for a one-output scorer, resolved as an ONNX model).
        trainable: ONNX only: the float initializers to train (default: all of them).
        seed: Seed of the initial weights (zoo models; the factory runs under it).

    Returns:
        The resolved model.

    Raises:
        ConfigError: A user's model cannot be loaded, called, exported or run, or does not fit
            the loss; the message names the config key.
        LocalProtocolError: Invalid built-in architecture options or seed.
    """
    given = [name for name, value in (("arch", arch), ("factory", factory), ("onnx_path", onnx_path))
             if value is not None]
    if len(given) != 1:
        raise ValueError(f"model_source needs exactly one of arch, factory, onnx_path; got {given or 'none'}")
    if loss not in LOSSES:
        raise ConfigError(f"unknown loss {loss!r}; one of {', '.join(LOSSES)}", key="model.loss")
    if arch is not None:
        if loss == "weighted_score":
            return builtin_scorer_source(arch, seed)
        if loss != "cross_entropy":
            raise ConfigError(f"the built-in {arch.kind} trains with cross_entropy", key="model.loss")
        return builtin_source(arch, seed)
    if factory is not None:
        if trainable is not None:
            raise ConfigError("for kind = 'torch' the module decides: set requires_grad = False on the "
                              "parameters to freeze", key="model.trainable")
        return _torch_source(factory, loss, seed)
    assert onnx_path is not None
    return _onnx_file_source(Path(onnx_path), loss, trainable)


def builtin_source(arch: ArchSpec, seed: int) -> ModelSource:
    """A zoo model: its weights are drawn once, and the layout is read off them.

    Raises:
        LocalProtocolError: Invalid architecture options or seed.
    """
    from models.zoo import initial_parameters

    params = initial_parameters(arch, seed)
    layout = Layout(params=tuple(ParamSpec(name, tuple(arr.shape)) for name, arr in params.items()))
    return ModelSource(arch=arch, layout=layout, initial_params=params, seed=int(seed))


def builtin_scorer_source(arch: ArchSpec, seed: int) -> ModelSource:
    """A zoo model with one output trained as an X-risk scorer (loss ``weighted_score``, FeDXL).

    The zoo's classifiers train with cross-entropy only, and their identity says so; a scorer of
    the same shape is the zoo's weights exported once and resolved like a user's ONNX model (kind
    ``onnx``, named by its forward graph's sha256), so its artifacts never share a store entry with
    the classifier's.

    Raises:
        ConfigError: The architecture has more than one output.
        LocalProtocolError: Invalid architecture options or seed.
    """
    import tempfile

    from models.export import export_forward

    source = builtin_source(arch, seed)
    if arch.num_classes != 1:
        raise ConfigError(f"a score model has one output; this {arch.kind} has {arch.num_classes}", key="model")
    with tempfile.TemporaryDirectory(prefix="fedtier-scorer-") as tmp:
        proto = export_forward(arch, seed, Path(tmp) / "forward.onnx", params=dict(source.initial_params))
    return _normalized_source(proto, "weighted_score", list(source.layout.names), key="model", what=f"the {arch.kind}",
                              seed=seed)


# --- torch factories ------------------------------------------------------------------------------


def load_factory(spec: str) -> Callable[[], Any]:
    """Import the function a ``factory`` names (a file path is imported as a fresh module).

    Raises:
        ConfigError: Malformed spec, missing file or module, import failure, no such callable.
    """
    key = "model.factory"
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ConfigError(f"{spec!r} is not 'package.module:function' or 'path/to/file.py:function'", key=key)
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(Path(target), key)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # noqa: BLE001 - any import failure of user code is a config error
            raise ConfigError(f"cannot import module {target!r}: {type(exc).__name__}: {exc}", key=key) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"{target} has no function {name!r}", key=key)
    return function


def _import_file(path: Path, key: str) -> Any:
    if not path.is_file():
        raise ConfigError(f"file not found: {path}", key=key)
    resolved = path.resolve()
    module_name = "fedtier_user_model_" + hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path} cannot be imported as a Python module", key=key)
    module = importlib.util.module_from_spec(spec)
    with _on_sys_path(resolved.parent):  # so the file can import its neighbours
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"importing {path} failed: {type(exc).__name__}: {exc}", key=key) from None
    return module


@contextlib.contextmanager
def _on_sys_path(directory: Path) -> Iterator[None]:
    entry = str(directory)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)


def call_factory(spec: str, seed: int) -> tuple[Any, Any]:
    """Call the factory under ``torch.manual_seed(seed)``; return ``(module, example batch)``.

    Raises:
        ConfigError: The factory raises, or does not return ``(torch.nn.Module, example input)``.
    """
    import torch

    key = "model.factory"
    function = load_factory(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        try:
            result = function()
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"{spec} raised {type(exc).__name__}: {exc}", key=key) from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise ConfigError(f"{spec} returned {type(result).__name__}; it must return (torch.nn.Module, "
                          "example input batch)", key=key)
    module, example = result
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"{spec} returned {type(module).__name__} where a torch.nn.Module belongs", key=key)
    if isinstance(example, np.ndarray):
        example = torch.from_numpy(np.ascontiguousarray(example))
    if not isinstance(example, torch.Tensor) or example.ndim < 2 or example.shape[0] < 1 \
            or not torch.is_floating_point(example):
        raise ConfigError(f"{spec}'s example input must be a float tensor or array of shape (batch, ...), got "
                          f"{getattr(example, 'shape', type(example).__name__)}", key=key)
    return module.float(), example.float()


def _torch_source(spec: str, loss: str, seed: int) -> ModelSource:
    import torch

    from models.export import export_module

    key = "model.factory"
    module, example = call_factory(spec, seed)
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError(f"{spec}'s module has no parameter with requires_grad: nothing to train", key=key)
    module.train()
    with torch.no_grad():
        try:
            out = module(example)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"{spec}'s module fails on its example input: {type(exc).__name__}: {exc}",
                              key=key) from None
    if not isinstance(out, torch.Tensor) or out.ndim != 2:
        raise ConfigError(f"{spec}'s module returns {getattr(out, 'shape', type(out).__name__)}; fedtier trains "
                          "models whose output is (batch, outputs)", key=key)
    buffer = io.BytesIO()
    try:
        proto = export_module(module, example, buffer)
    except Exception as exc:  # noqa: BLE001 - torch.onnx raises a zoo of types
        raise ConfigError(f"the ONNX export of {spec}'s module failed: {type(exc).__name__}: {exc}",
                          key=key) from None
    initializers = {init.name for init in proto.graph.initializer}
    lost = [name for name in trainable if name not in initializers]
    if lost:
        raise ConfigError(f"parameters {lost} of {spec}'s module are not initializers of its ONNX export: "
                          "forward() does not use them, or the exporter folded or renamed them; set "
                          "requires_grad = False on parameters forward() does not use", key=key)
    return _normalized_source(proto, loss, trainable, key=key, what=spec, seed=seed)


# --- ONNX graphs ----------------------------------------------------------------------------------


def _onnx_file_source(path: Path, loss: str, trainable: Sequence[str] | None) -> ModelSource:
    import onnx

    key = "model.path"
    if not path.is_file():
        raise ConfigError(f"file not found: {path}", key=key)
    try:
        proto = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - protobuf decode errors have many types
        raise ConfigError(f"{path} is not a readable ONNX model: {type(exc).__name__}: {exc}", key=key) from None
    return _normalized_source(proto, loss, list(trainable) if trainable is not None else None, key=key,
                              what=str(path), seed=0)


def _normalized_source(proto: "onnx.ModelProto", loss: str, trainable: list[str] | None, *, key: str, what: str,
                       seed: int) -> ModelSource:
    """Check and normalize a forward graph; read its trainable tensors; run it once."""
    from onnx import numpy_helper

    _check_versions(proto, key, what)
    graph = proto.graph
    inits = {init.name: init for init in graph.initializer}
    # Old exports list initializers as graph inputs too; only the data input is a real one.
    data_inputs = [i for i in graph.input if i.name not in inits]
    if len(data_inputs) != 1:
        raise ConfigError(f"{what} has {len(data_inputs)} data inputs {[i.name for i in data_inputs]}; fedtier "
                          "trains graphs with one input (a batch of examples)", key=key)
    if len(graph.output) != 1:
        raise ConfigError(f"{what} has {len(graph.output)} outputs {[o.name for o in graph.output]}; fedtier "
                          "trains graphs with one output (batch, outputs)", key=key)
    input_shape = _example_shape(data_inputs[0], key, what)
    floats = [init.name for init in graph.initializer if init.data_type == _FLOAT]
    if trainable is None:
        trainable = floats
    else:
        unknown = [name for name in trainable if name not in floats]
        if unknown:
            raise ConfigError(f"{unknown} are not float initializers of {what}; it has {floats}",
                              key="model.trainable")
    if not trainable:
        raise ConfigError(f"{what} has no float initializers to train", key=key if not floats else "model.trainable")
    chosen = set(trainable)
    ordered = [name for name in floats if name in chosen]  # initializer order = training-graph order
    frozen = tuple(name for name in floats if name not in chosen)

    forward = _normalize(proto, data_inputs[0].name, graph.output[0].name, key, what)
    outputs = _run_once(forward, input_shape, key, what)
    if loss == "cross_entropy" and outputs < 2:
        raise ConfigError(f"{what} has {outputs} output; cross_entropy needs one output per class (>= 2); "
                          "a single output is a bce or mse model", key="model.loss")
    if loss == "weighted_score" and outputs != 1:
        raise ConfigError(f"{what} has {outputs} outputs; a score model (fedxl) has one: its score logit",
                          key="model.loss")
    params = {name: np.ascontiguousarray(numpy_helper.to_array(inits[name]), dtype=np.float32) for name in ordered}
    layout = Layout(params=tuple(ParamSpec(name, tuple(arr.shape)) for name, arr in params.items()))
    arch = ArchSpec("onnx", {"sha256": hashlib.sha256(forward).hexdigest(), "input_shape": list(input_shape),
                             "outputs": outputs, "loss": loss})
    return ModelSource(arch=arch, layout=layout, initial_params=params, seed=int(seed), frozen=frozen,
                       forward=forward)


def _check_versions(proto: "onnx.ModelProto", key: str, what: str) -> None:
    if proto.ir_version > MAX_IR_VERSION:
        raise ConfigError(f"{what} uses ONNX IR version {proto.ir_version}; onnxruntime-training 1.19.2 reads up to "
                          f"{MAX_IR_VERSION} (export with onnx<1.17)", key=key)
    opsets = [op.version for op in proto.opset_import if op.domain in _ONNX_DOMAINS]
    if opsets and max(opsets) > MAX_OPSET:
        raise ConfigError(f"{what} uses opset {max(opsets)}; onnxruntime-training 1.19.2 trains up to opset "
                          f"{MAX_OPSET} (export with opset_version={MAX_OPSET} or lower)", key=key)


def _example_shape(value: Any, key: str, what: str) -> tuple[int, ...]:
    """The shape of one example: the input's dimensions after the batch axis, all fixed."""
    dims = value.type.tensor_type.shape.dim
    if value.type.tensor_type.elem_type != _FLOAT:
        raise ConfigError(f"{what}'s input {value.name!r} is not float32", key=key)
    if len(dims) < 2 or not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims[1:]):
        shown = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
        raise ConfigError(f"{what}'s input {value.name!r} has shape {shown}; fedtier needs (batch, fixed sizes...)",
                          key=key)
    return tuple(int(d.dim_value) for d in dims[1:])


def _normalize(proto: "onnx.ModelProto", input_name: str, output_name: str, key: str, what: str) -> bytes:
    """The graph with input ``input``, output ``logits``, a symbolic batch axis, no stale shapes."""
    import onnx

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    graph = model.graph
    inits = {init.name for init in graph.initializer}
    del graph.input[:]
    graph.input.extend(i for i in proto.graph.input if i.name not in inits or i.name == input_name)
    renames = {input_name: INPUT_NAME, output_name: OUTPUT_NAME}
    used = {name for node in graph.node for name in (*node.input, *node.output)} | inits
    for old, new in renames.items():
        if old != new and new in used:
            raise ConfigError(f"{what} already has a tensor named {new!r} besides its "
                              f"{'input' if new == INPUT_NAME else 'output'}; rename it", key=key)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        for i, name in enumerate(node.output):
            if name in renames:
                node.output[i] = renames[name]
    for value in (*graph.input, *graph.output):
        value.name = renames.get(value.name, value.name)
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].Clear()
            dims[0].dim_param = "batch"
    del graph.value_info[:]  # inferred again by ORT; a fixed batch size in them would contradict the input
    return bytes(model.SerializeToString())


def _run_once(forward: bytes, input_shape: tuple[int, ...], key: str, what: str) -> int:
    """Run the normalized graph on a batch of 3 zeros; return the output width."""
    from models.ort_tools import no_root_basic_config

    with no_root_basic_config():  # importing onnxruntime would configure the root logger
        import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    try:
        session = onnxruntime.InferenceSession(forward, options, providers=["CPUExecutionProvider"])
        (out,) = session.run(None, {INPUT_NAME: np.zeros((_CHECK_BATCH, *input_shape), np.float32)})
    except Exception as exc:  # noqa: BLE001 - onnxruntime's pybind errors
        raise ConfigError(f"{what} does not run on a batch of {_CHECK_BATCH} examples of shape {input_shape} "
                          f"(export it with a dynamic batch axis): {exc}", key=key) from None
    out = np.asarray(out)
    if out.ndim != 2 or out.shape[0] != _CHECK_BATCH or out.shape[1] < 1:
        raise ConfigError(f"{what} returns shape {tuple(out.shape)} for a batch of {_CHECK_BATCH}; fedtier trains "
                          "models whose output is (batch, outputs)", key=key)
    return int(out.shape[1])


def source_for(model: ModelConfig, num_features: int, num_classes: int, loss: str | None = None) -> ModelSource:
    """The model a rollout's ``[model]`` section names, resolved; imports torch for built-in and torch models.

    Args:
        num_features, num_classes: the data's sizes (a built-in model's input and output widths).
        loss: the algorithm's loss when it imposes one (``weighted_score`` for fedxl: a built-in model
            then gets one output); default this section's ``loss``.

    Raises:
        ConfigError: The user's model cannot be loaded or does not fit its loss (naming the key).
    """
    loss = loss or model.loss
    if model.kind == "torch":
        return model_source(factory=model.factory, loss=loss, seed=model.init_seed)
    if model.kind == "onnx":
        return model_source(onnx_path=model.path, loss=loss, trainable=model.trainable)
    if loss == "weighted_score":
        return model_source(arch=model.arch(num_features, 1), loss=loss, seed=model.init_seed)
    return model_source(arch=model.arch(num_features, num_classes), seed=model.init_seed)


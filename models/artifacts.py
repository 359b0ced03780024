"""Build onnxruntime-training artifacts for an architecture, once, in a content-addressed store.

Store layout::

    store_dir/
      <bundle_id>/            training_model.onnx eval_model.onnx optimizer_model.onnx
                              checkpoint bundle.json arch.json layout.json
                              portable_training_model.onnx portable_checkpoint.f32
                                (the portable training path, ``models.portable``)
      by-arch/<arch.sha256>   {"arch": {...}, "bundles": {"<seed>": "<bundle_id>"}}
      .build-XXXX/            in-progress builds (renamed to <bundle_id> when complete)

A build goes into a temporary directory inside the store and is renamed to its final name
in one ``rename``, so a crash never leaves a half bundle under a ``bundle_id`` (and a
truncated file would fail ``ArtifactBundle.load``'s sha256 check anyway). The ``by-arch``
index lets a second call for the same ``(arch, seed)`` return the verified existing bundle
without running the exporter. Index updates are atomic but not locked: two concurrent
builders may drop each other's index entry, which only costs a rebuild later (builds are
deterministic, so the rebuild lands on the same ``bundle_id``).

The artifacts: SGD optimizer (``SGDOptimizerV2``, stateless), the model's loss on the
``logits`` output — mean cross-entropy with int64 ``labels`` for the zoo, or a user model's
``cross_entropy``, ``bce`` (``BCEWithLogitsLoss``), ``mse`` (float ``target``) or ``weighted_score``
(``sum labels * logits`` with float ``labels`` shaped like ``logits``: X-risk scorers) — every layout
tensor trainable (a user's ONNX graph may keep other float initializers frozen), and
``additional_output_names=["logits"]`` so both the training and the eval graph return
``(loss, logits)``. The checkpoint holds the initial weights; rounds ship parameters.

What is built comes from a ``models.source.ModelSource`` (built-in zoo model, torch factory or
ONNX file), resolved once by the caller; an ``ArchSpec`` of the zoo is resolved here.
Next to them, ``models.portable`` writes the training graph lowered to standard ONNX ops (for
devices with only the stock onnxruntime) and records in the descriptor whether it could.

torch, onnx and onnxruntime are imported inside functions. ``generate_artifacts`` prints
hundreds of INFO lines from C++ straight to file descriptor 2 (``set_default_logger_severity``
does not stop them, field notes §1.3), so the call runs with fd 2 redirected to a temp file
that is logged at DEBUG, or at ERROR level if the build fails.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from fedtier.artifacts.bundle import (
    PORTABLE_FORMAT,
    MAX_IR_VERSION,
    MAX_OPSET,
    ArtifactBundle,
    BundleFile,
    PortableInfo,
    write_text_atomic,
)
from fedtier.errors import ArtifactError, LocalProtocolError
from fedtier.training.layout import PROX_PREFIX, PROX_UNSUPPORTED, ArchSpec
from models.export import INPUT_NAME, OUTPUT_NAME
from models.ort_tools import no_root_basic_config, quiet_fd2
from models.portable import write_portable
from models.source import ModelSource, builtin_source

logger = logging.getLogger(__name__)

INDEX_DIR = "by-arch"
LABELS_NAME = "labels"
TARGET_NAME = "target"
"""The label input of the training graph: int64 ``labels`` (cross-entropy), float ``target`` (bce, mse)."""
FILENAMES = {
    "training_model": "training_model.onnx",
    "eval_model": "eval_model.onnx",
    "optimizer_model": "optimizer_model.onnx",
    "checkpoint": "checkpoint",
}
_ONNX_ROLES = ("training_model", "eval_model", "optimizer_model")
_ONNX_DOMAINS = ("", "ai.onnx")


def build_artifacts(model: ArchSpec | ModelSource, store_dir: Path | str, *, seed: int = 0,
                    proximal_mu: float = 0.0) -> ArtifactBundle:
    """Return the artifact bundle for a model, building it only if the store lacks it.

    Args:
        model: The resolved model (``models.source.model_source``), or a zoo architecture,
            resolved here with ``seed``.
        store_dir: The content-addressed store (created if missing).
        seed: Seed of the initial weights in the checkpoint (zoo architectures; a
            ``ModelSource`` carries its own).
        proximal_mu: FedProx's mu: > 0 adds ``(mu/2) ||w - w_anchor||^2`` to the training loss,
            the anchor weights as graph inputs ``prox.<name>`` (``_proximal_loss``); 0 builds
            exactly the bundle built without it.

    Returns:
        The verified bundle in ``store_dir/<bundle_id>``.

    Raises:
        ArtifactError: Export or artifact generation failed, or the generated graphs are not
            what ORT 1.19.2 / the trainers expect (opset, IR, inputs, outputs).
        LocalProtocolError: Invalid architecture options or seed.
    """
    if isinstance(model, ModelSource):
        source = model
    else:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise LocalProtocolError(f"seed must be a non-negative int, got {seed!r}")
        source = builtin_source(model, seed)  # validates options before touching the store or torch
    arch, seed = source.arch, source.seed
    if not (isinstance(proximal_mu, (int, float)) and proximal_mu >= 0 and proximal_mu == proximal_mu):
        raise LocalProtocolError(f"proximal_mu must be >= 0, got {proximal_mu!r}")
    if proximal_mu and arch.loss == "weighted_score":
        raise LocalProtocolError("FedProx is for label losses; a weighted_score scorer trains through X-risk steps")
    key = _index_key(seed, proximal_mu)
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    cached = _lookup(store, arch, seed, key)
    if cached is not None:
        logger.debug("artifact store hit: %s seed %d -> %s", arch.kind, seed, cached.bundle_id)
        return cached

    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=store))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the published bundle should be readable
    try:
        built = _build_into(tmp, source, proximal_mu=float(proximal_mu))
        bundle = _publish(tmp, built, store)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _record(store, arch, key, bundle.bundle_id)
    logger.info("built artifacts for %s (seed %d): bundle %s", arch.kind, seed, bundle.bundle_id)
    return bundle


# --- store -------------------------------------------------------------------------------------


def _index_path(store: Path, arch: ArchSpec) -> Path:
    return store / INDEX_DIR / arch.sha256


def _read_index(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        logger.warning("ignoring unreadable artifact index %s: %s", path, exc)
        return {}
    return obj if isinstance(obj, dict) else {}


def _index_key(seed: int, proximal_mu: float) -> str:
    """The index entry of ``(seed, mu)``: the seed alone without FedProx (as before it existed)."""
    return str(seed) if not proximal_mu else f"{seed}/prox={float(proximal_mu)!r}"


def _lookup(store: Path, arch: ArchSpec, seed: int, key: str | None = None) -> ArtifactBundle | None:
    """The verified bundle the index names for ``(arch, seed)`` (``key``: with FedProx's mu), or None."""
    index = _read_index(_index_path(store, arch))
    bundles = index.get("bundles")
    bundle_id = bundles.get(key or str(seed)) if isinstance(bundles, dict) else None
    if not isinstance(bundle_id, str) or not _is_hex_digest(bundle_id):
        return None
    try:
        bundle = ArtifactBundle.load(store / bundle_id, verify=True)
    except ArtifactError as exc:
        logger.warning("artifact store entry %s is unusable, rebuilding: %s", bundle_id, exc)
        return None
    if bundle.portable is None:
        logger.info("artifact store entry %s predates portable graphs; rebuilding", bundle_id[:12])
        return None
    if bundle.portable.unsupported_ops and PROX_UNSUPPORTED not in bundle.portable.unsupported_ops \
            and _lowers_now(bundle):
        logger.info("artifact store entry %s has no portable graph (%s), which this build can lower; rebuilding",
                    bundle_id[:12], ", ".join(bundle.portable.unsupported_ops))
        return None
    if bundle.arch.sha256 != arch.sha256 or bundle.seed != seed or bundle.bundle_id != bundle_id:
        logger.warning("artifact index %s points at a bundle of another arch/seed; rebuilding",
                       arch.sha256[:12])
        return None
    return bundle


def _lowers_now(bundle: ArtifactBundle) -> bool:
    """Whether the lowerings of this build cover a stored training graph an older build could not lower."""
    import onnx

    from models.portable import lower_training_graph

    try:
        training = onnx.load(str(bundle.path("training_model")))
        return lower_training_graph(training, list(bundle.layout.names)).model is not None
    except Exception as exc:  # noqa: BLE001 - a graph that does not load is rebuilt anyway
        logger.warning("cannot re-check the training graph of %s: %s", bundle.bundle_id[:12], exc)
        return True


def _is_hex_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _record(store: Path, arch: ArchSpec, seed: int | str, bundle_id: str) -> None:
    path = _index_path(store, arch)
    path.parent.mkdir(parents=True, exist_ok=True)
    index = _read_index(path)
    previous = index.get("bundles")
    bundles: dict[str, Any] = dict(previous) if isinstance(previous, dict) else {}
    bundles[str(seed)] = bundle_id
    write_text_atomic(path, json.dumps({"arch": arch.to_json(), "bundles": bundles},
                                       indent=2, sort_keys=True) + "\n")


def _publish(tmp: Path, built: ArtifactBundle, store: Path) -> ArtifactBundle:
    """Rename the finished build to ``store/<bundle_id>``; reuse a valid existing copy."""
    final = store / built.bundle_id
    _fsync_tree(tmp)
    for _attempt in range(2):
        try:
            os.rename(tmp, final)
            _fsync_dir(store)
            break
        except OSError:
            if not final.exists():
                raise
        # Someone built the same bundle before us (or a broken copy sits there).
        try:
            return ArtifactBundle.load(final, verify=True)
        except ArtifactError as exc:
            aside = store / f".broken-{built.bundle_id[:12]}-{uuid.uuid4().hex[:8]}"
            logger.warning("replacing broken bundle %s (moved to %s): %s", final, aside, exc)
            with contextlib.suppress(FileNotFoundError):
                os.rename(final, aside)
    else:
        raise ArtifactError(f"could not publish bundle {built.bundle_id} into {store}")
    return ArtifactBundle.load(final, verify=True)


def _fsync_tree(directory: Path) -> None:
    """Flush the build's files so a crash after the rename cannot leave empty files behind."""
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    if sys.platform == "win32":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- build ---------------------------------------------------------------------------------------


def _build_into(tmp: Path, source: ModelSource, *, proximal_mu: float = 0.0) -> ArtifactBundle:
    """Export, generate and check the artifacts in ``tmp``; write the descriptor files."""
    import onnx

    arch, seed, layout = source.arch, source.seed, source.layout
    forward_path = tmp / "forward.onnx"
    try:
        forward = source.write_forward(forward_path)
    except (ArtifactError, LocalProtocolError):
        raise
    except Exception as exc:  # torch.onnx raises a zoo of types
        raise ArtifactError(f"ONNX export of {arch.kind} failed: {exc}") from exc
    _generate(forward, tmp, trainable=list(layout.names), frozen=list(source.frozen), loss=arch.loss,
              proximal_mu=proximal_mu)
    forward_path.unlink()

    models = {role: onnx.load(str(tmp / FILENAMES[role]), load_external_data=False)
              for role in _ONNX_ROLES}
    opset, ir_version = _check_generated(models, list(layout.names), label_name(arch.loss),
                                         proximal=proximal_mu > 0)
    (tmp / "arch.json").write_text(json.dumps(arch.to_json(), indent=2, sort_keys=True) + "\n",
                                   encoding="utf-8")
    (tmp / "layout.json").write_text(json.dumps(layout.to_json(), indent=2) + "\n",
                                     encoding="utf-8")
    if proximal_mu:
        # The portable trainer feeds (input, labels, params): not the anchors. Say so in the descriptor.
        portable_files: dict[str, BundleFile] = {}
        portable = PortableInfo(format=PORTABLE_FORMAT, unsupported_ops=(PROX_UNSUPPORTED,))
    else:
        portable_files, portable = write_portable(tmp, forward, models["training_model"], layout)
    bundle = ArtifactBundle(
        directory=tmp,
        files={**{role: BundleFile.of(tmp / name) for role, name in FILENAMES.items()}, **portable_files},
        arch=arch,
        layout=layout,
        opset=opset,
        ir_version=ir_version,
        seed=seed,
        portable=portable,
    )
    bundle.save()
    return bundle


def label_name(loss: str) -> str:
    """The training graph's label input for ``loss`` (a ``weighted_score`` graph takes its coefficients there)."""
    return LABELS_NAME if loss in ("cross_entropy", "weighted_score") else TARGET_NAME


def _weighted_score_loss() -> Any:
    """An onnxblock loss ``sum_n labels[n] * logits[n]``, the ``labels`` input shaped like ``logits``.

    X-risk algorithms (FeDXL, ``fedtier.algorithms.xrisk``) compute a coefficient per scored row from
    the current scores and the other devices' passive scores; the gradient they need is the gradient
    of this weighted sum with the coefficients held constant. Its backward pass is Mul, ReduceSum,
    Expand and the model's own ops, so the portable graph lowers as a classifier's does.
    """
    from onnxruntime.training.onnxblock import _graph_utils, blocks

    class WeightedScore(blocks.Block):
        def __init__(self) -> None:
            super().__init__()
            self._mul = blocks.Mul()
            self._sum = blocks.ReduceSum(keepdims=False)

        def build(self, scores_name: str, weights_name: str = LABELS_NAME) -> Any:
            if not _graph_utils.node_arg_exists(self.base, weights_name):
                weights_name = blocks.InputLike(scores_name)(weights_name)
            return self._sum(self._mul(scores_name, weights_name))

    return WeightedScore()


def _proximal_loss(loss: str, names: list[str], mu: float) -> Any:
    """FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020): the model's
    loss plus ``(mu/2) sum_p ||p - prox.p||^2`` over the trained tensors ``names``.

    The anchors are graph inputs ``prox.<name>`` (the global weights the local phase started from,
    fed by the trainer), not a second copy of the model; mu is a constant of the graph. The sums are
    kept 1-element vectors until the end: ORT's gradient builder cannot differentiate an ``Add`` of
    rank-0 tensors (its broadcast ``ReduceSum`` refuses rank 0).
    """
    import numpy as np
    import onnx
    from onnxruntime.training.onnxblock import _graph_utils, blocks
    from onnxruntime.training.onnxblock import loss as losses

    base_loss = {"cross_entropy": losses.CrossEntropyLoss, "bce": losses.BCEWithLogitsLoss,
                 "mse": losses.MSELoss}[loss]()
    labels = label_name(loss)

    class Proximal(blocks.Block):
        def __init__(self) -> None:
            super().__init__()
            self._base = base_loss

        def build(self, scores_name: str, labels_name: str = labels) -> Any:
            graph = self.base.graph

            def const(name: str, value: Any) -> str:
                unique = _graph_utils.generate_graph_name(name)
                graph.initializer.append(onnx.numpy_helper.from_array(value, unique))
                return unique

            def reshape(name: str, shape: list[int]) -> str:
                out = _graph_utils.generate_graph_name("prox.reshape")
                graph.node.append(onnx.helper.make_node(
                    "Reshape", [name, const("prox.shape", np.array(shape, np.int64))], [out],
                    name=_graph_utils.generate_graph_name("Reshape")))
                return out

            base = self._base(scores_name, labels_name)
            dims = {init.name: list(init.dims) for init in graph.initializer}
            total = None
            for name in names:
                anchor = f"{PROX_PREFIX}{name}"
                graph.input.append(onnx.helper.make_tensor_value_info(anchor, onnx.TensorProto.FLOAT, dims[name]))
                diff = blocks.Sub()(name, anchor)
                term = blocks.ReduceSum(keepdims=True)(reshape(blocks.Mul()(diff, diff), [-1]))
                total = term if total is None else blocks.Add()(total, term)
            scaled = blocks.Mul()(total, const("prox.half_mu", np.array([mu / 2], np.float32)))
            return reshape(blocks.Add()(reshape(base, [1]), scaled), [])

    return Proximal()


def _generate(forward: Any, out_dir: Path, *, trainable: list[str] | None = None, frozen: list[str] | None = None,
              loss: str = "cross_entropy", proximal_mu: float = 0.0) -> None:
    """Run ``generate_artifacts`` (SGD, the model's loss, logits as extra output) quietly.

    ``trainable`` defaults to every initializer of ``forward`` (the zoo's graphs hold nothing else).
    """
    with no_root_basic_config():  # onnxruntime.tools.logger calls basicConfig at import
        from onnxruntime.training import artifacts

    names = trainable if trainable is not None else [init.name for init in forward.graph.initializer]
    loss_type = {"cross_entropy": artifacts.LossType.CrossEntropyLoss, "bce": artifacts.LossType.BCEWithLogitsLoss,
                 "mse": artifacts.LossType.MSELoss}.get(loss)
    if loss == "weighted_score":
        loss_type = _weighted_score_loss()
    if proximal_mu:
        loss_type = _proximal_loss(loss, names, proximal_mu)
    failure: Exception | None = None
    with quiet_fd2() as captured, no_root_basic_config():
        _reset_graph_name_counter()
        try:
            artifacts.generate_artifacts(
                forward,
                requires_grad=names,
                frozen_params=list(frozen or []),
                loss=loss_type,
                optimizer=artifacts.OptimType.SGD,
                artifact_directory=str(out_dir),
                additional_output_names=[OUTPUT_NAME],
            )
        except Exception as exc:  # noqa: BLE001 - re-raised below once stderr is restored
            failure = exc
        native_stderr = captured.tail()
    # Log only after fd 2 is restored, or a stderr log handler would write into the sink.
    if failure is not None:
        logger.error("generate_artifacts failed: %s\n--- native stderr (tail) ---\n%s",
                     failure, native_stderr)
        raise ArtifactError(f"onnxruntime-training generate_artifacts failed: {failure}"
                            ) from failure
    logger.debug("generate_artifacts native stderr (tail):\n%s", native_stderr)
    missing = [name for name in FILENAMES.values() if not (out_dir / name).is_file()]
    if missing:
        raise ArtifactError(f"generate_artifacts did not write {missing} (is the checkpoint a "
                            "directory in this onnxruntime version?)")


def _check_generated(models: dict[str, Any], names: list[str], labels: str = LABELS_NAME,
                     proximal: bool = False) -> tuple[int, int]:
    """Check the graphs' interfaces; return ``(max ai.onnx opset, max IR version)``.

    The trained tensors must be training-graph inputs in layout order (frozen tensors of a
    user's graph may sit between them).
    """
    opset = max(op.version for m in models.values() for op in m.opset_import
                if op.domain in _ONNX_DOMAINS)
    ir_version = max(m.ir_version for m in models.values())
    if opset > MAX_OPSET or ir_version > MAX_IR_VERSION:
        raise ArtifactError(
            f"generated artifacts use opset {opset} / IR {ir_version}; onnxruntime-training "
            f"1.19.2 supports at most opset {MAX_OPSET} / IR {MAX_IR_VERSION} (pin onnx<1.17)")
    train_inputs = [i.name for i in models["training_model"].graph.input]
    prox = [n for n in train_inputs if n.startswith(PROX_PREFIX)]
    if prox != ([f"{PROX_PREFIX}{n}" for n in names] if proximal else []):
        raise ArtifactError(f"training graph's proximal inputs {prox} are not one per trained tensor in layout order")
    train_inputs = [n for n in train_inputs if not n.startswith(PROX_PREFIX)]
    wanted = set(names)
    if train_inputs[:2] != [INPUT_NAME, labels] or [n for n in train_inputs if n in wanted] != names:
        raise ArtifactError(
            f"training graph inputs {train_inputs} do not start with {[INPUT_NAME, labels]} followed by "
            f"{names} in this order: the layout order would not be the training-graph order")
    for role in ("training_model", "eval_model"):
        outputs = [o.name for o in models[role].graph.output]
        if len(outputs) < 2 or outputs[1] != OUTPUT_NAME:
            raise ArtifactError(f"{role} outputs {outputs} are not (loss, {OUTPUT_NAME}, ...)")
    eval_inputs = [i.name for i in models["eval_model"].graph.input if not i.name.startswith(PROX_PREFIX)]
    if eval_inputs[:2] != [INPUT_NAME, labels]:
        raise ArtifactError(f"eval graph inputs {eval_inputs} do not start with "
                            f"[{INPUT_NAME!r}, {labels!r}]")
    return int(opset), int(ir_version)


def _reset_graph_name_counter() -> None:
    """Make generated node names independent of earlier builds in this process.

    onnxblock names nodes ``onnx::<op>::<n>`` from a process-global counter
    (``_graph_utils._GRAPH_TOKEN``), so without a reset the same architecture built second in
    a process gets different bytes, hence a different ``bundle_id``, than when built first.
    1.19.2 is the last release, so poking this private counter is stable. Called under the
    fd-2 lock, which also serialises builds.
    """
    from onnxruntime.training.onnxblock import _graph_utils

    if hasattr(_graph_utils, "_GRAPH_TOKEN"):
        _graph_utils._GRAPH_TOKEN = 0
    else:  # pragma: no cover - other onnxruntime versions
        logger.warning("onnxblock has no _GRAPH_TOKEN; bundle ids may depend on build order")

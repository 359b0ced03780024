"""``PortableTrainer``: the ``Trainer`` protocol on stock onnxruntime, from the bundle's portable graph.

For boards where onnxruntime-training has no wheel (Linux aarch64, Python 3.13+): the
coordinator ships, inside the signed bundle, the training graph with every contrib op
lowered to standard ONNX ops (``models.portable``). It returns the loss, the logits and one
gradient per parameter; this trainer keeps the parameters as numpy arrays, feeds them to the
graph at every step and applies plain SGD itself (``w <- w - lr * g`` in float32, what
``SGDOptimizerV2`` computes). Evaluation runs the bundle's ``eval_model.onnx``, which uses
standard ops only.

Users' models too: the label input is ``labels`` (cross-entropy) or ``target`` (bce, mse),
and a model's frozen tensors (untrained initializers) are graph inputs after the parameters,
whose values follow the parameters in the portable checkpoint. They are fed to both graphs,
never updated, and are not parameters of the ``Trainer`` interface (as with ``OrtTrainer``).

It runs on any onnxruntime, the training build included (that is how the main development
environment exercises it); with the training build installed the torch-free shim is put in
place first, so importing onnxruntime does not drag torch in.

Like ``OrtTrainer``, it holds no state besides the parameters (gradients are fresh outputs of
every run), so one instance can serve many simulated devices. Sessions use
``intra_op_num_threads=threads``, sequential execution and deterministic compute.

Not thread-safe: one call at a time per instance.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from device_agent.trainers import (
    EVAL_CHUNK,
    check_batch,
    check_inputs,
    check_lr,
    check_score_model,
    check_tensors,
    check_threads,
    check_weights,
    correct_predictions,
    score_loss,
)
from device_agent.trainers.ort_runtime import import_onnxruntime
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.errors import ArtifactError
from fedtier.training.layout import SCORE_LOSSES, Layout, ParamSpec
from fedtier.training.trainer import Batch, EvalResult, TrainStats

logger = logging.getLogger(__name__)

INPUT_NAME = "input"
LABELS_NAME = "labels"
TARGET_NAME = "target"
LOGITS_NAME = "logits"
GRAD_SUFFIX = "_grad"  # models.portable.GRAD_SUFFIX (the device does not import models)
_ORT_LOG_ERROR = 3


def require_portable_graph(bundle: ArtifactBundle) -> None:
    """Refuse a bundle this trainer cannot train, saying why and naming the blocking ops.

    Raises:
        ArtifactError: The bundle predates portable graphs, or its training graph holds ops
            without a lowering to standard ONNX.
    """
    ident = bundle.bundle_id[:12]
    if bundle.portable is None:
        raise ArtifactError(
            f"bundle {ident} has no portable training graph (built before fedtier wrote them) and this "
            "device trains without onnxruntime-training: rebuild the bundle with a current coordinator")
    if bundle.portable.unsupported_ops:
        raise ArtifactError(
            f"bundle {ident}: its training graph holds ops with no lowering to standard ONNX "
            f"({', '.join(bundle.portable.unsupported_ops)}), and this device trains without "
            "onnxruntime-training, so it cannot take part in this rollout")


def label_input(loss: str) -> str:
    """The graphs' label input for ``loss``: int64 ``labels`` (cross-entropy), float ``labels`` shaped
    like the outputs (a scorer's coefficients, ``weighted_score``) or float ``target`` (bce, mse)."""
    return LABELS_NAME if loss == "cross_entropy" or loss in SCORE_LOSSES else TARGET_NAME


def read_checkpoint(path: Path, layout: Layout, frozen: Layout | None = None
                    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Parameters and frozen tensors from a portable checkpoint.

    The file is raw little-endian float32: the trained parameters in layout order, then the
    frozen tensors (a user model's untrained initializers) in the portable graph's input order.

    Returns:
        ``(parameters, frozen tensors)``, by name.

    Raises:
        ArtifactError: The file cannot be read or its size is not the one both need.
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ArtifactError(f"cannot read the portable checkpoint {path}: {exc}") from exc
    frozen = frozen or Layout(params=())
    expected = 4 * (layout.num_parameters + frozen.num_parameters)
    if len(raw) != expected:
        what = "the layout needs" if not frozen.params else "the layout and the frozen tensors need"
        raise ArtifactError(f"portable checkpoint {path} has {len(raw)} bytes; {what} {expected}")
    flat = np.frombuffer(raw, dtype="<f4")
    parts: list[dict[str, np.ndarray]] = [{}, {}]
    offset = 0
    for part, specs in zip(parts, (layout.params, frozen.params), strict=True):
        for spec in specs:
            part[spec.name] = np.array(flat[offset:offset + spec.size], dtype=np.float32).reshape(spec.shape)
            offset += spec.size
    return parts[0], parts[1]


class PortableTrainer:
    """Train and evaluate one artifact bundle with stock onnxruntime and numpy SGD.

    Args:
        bundle: A bundle with a local directory and a portable training graph.
        threads: onnxruntime intra-op threads (1 for bit-reproducible runs).

    Raises:
        ArtifactError: The bundle has no portable graph (or one with unsupported ops), its
            graphs do not have the expected interface, or onnxruntime cannot load them.
        LocalProtocolError: ``threads`` is not an int >= 1.
        ImportError: onnxruntime is not installed.
    """

    def __init__(self, bundle: ArtifactBundle, *, threads: int = 1) -> None:
        self._threads = check_threads(threads)
        require_portable_graph(bundle)
        self._bundle = bundle
        self._arch = bundle.arch
        self._layout = bundle.layout
        ort = import_onnxruntime()
        options = ort.SessionOptions()
        options.intra_op_num_threads = self._threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.use_deterministic_compute = True
        options.log_severity_level = _ORT_LOG_ERROR
        providers = ["CPUExecutionProvider"]
        try:
            self._train = ort.InferenceSession(str(bundle.path("portable_model")), options, providers=providers)
            self._eval = ort.InferenceSession(str(bundle.path("eval_model")), options, providers=providers)
        except Exception as exc:  # onnxruntime's pybind errors derive from Exception only
            raise ArtifactError(f"onnxruntime cannot load bundle {bundle.bundle_id[:12]}: {exc}") from exc
        self._label = label_input(self._arch.loss)
        self._train_outputs, frozen = self._check_interface()
        self._params, self._frozen = read_checkpoint(bundle.path("portable_checkpoint"), self._layout, frozen)
        logger.debug("PortableTrainer for bundle %s (%s, %d parameters, %d thread(s), onnxruntime %s)",
                     bundle.bundle_id[:12], self._arch.kind, self._layout.num_parameters, self._threads,
                     ort.__version__)

    def _check_interface(self) -> tuple[list[str], Layout]:
        """The training graph must take ``(input, label, *params, *frozen)`` and return
        ``(loss, logits, *grads)``; the eval graph may take only what it feeds.

        Returns:
            The training outputs to fetch, and the frozen tensors' names and static shapes.
        """
        names = list(self._layout.names)
        head = [INPUT_NAME, self._label, *names]
        inputs = self._train.get_inputs()
        if [i.name for i in inputs[:len(head)]] != head:
            raise ArtifactError(f"portable training graph inputs {[i.name for i in inputs]} do not start with {head}")
        frozen = []
        for arg in inputs[len(head):]:
            if arg.type != "tensor(float)" or not all(isinstance(d, int) and d >= 0 for d in arg.shape):
                raise ArtifactError(f"portable training graph input {arg.name!r} ({arg.type} {arg.shape}) is not a "
                                    "frozen float tensor of static shape")
            frozen.append(ParamSpec(arg.name, tuple(int(d) for d in arg.shape)))
        eval_inputs = [i.name for i in self._eval.get_inputs()]
        fed = {*head, *(spec.name for spec in frozen)}
        if eval_inputs[:2] != head[:2] or not set(eval_inputs) <= fed:
            raise ArtifactError(f"eval graph inputs {eval_inputs} are not {head[:2]} followed by parameters and "
                                "frozen tensors of the portable graph")
        self._eval_inputs = eval_inputs
        outputs = [o.name for o in self._train.get_outputs()]
        grads = [f"{name}{GRAD_SUFFIX}" for name in names]
        if len(outputs) != 2 + len(names) or outputs[1] != LOGITS_NAME or outputs[2:] != grads:
            raise ArtifactError(f"portable training graph outputs {outputs} are not (loss, {LOGITS_NAME}, "
                                f"*{grads})")
        eval_outputs = [o.name for o in self._eval.get_outputs()]
        if len(eval_outputs) < 2 or eval_outputs[1] != LOGITS_NAME:
            raise ArtifactError(f"eval graph outputs {eval_outputs} are not (loss, {LOGITS_NAME}, ...)")
        return [outputs[0], *grads], Layout(params=tuple(frozen))  # logits are computed anyway, but not copied out

    # --- Trainer protocol --------------------------------------------------------------------

    @property
    def layout(self) -> Layout:
        """Names and shapes of the trainable parameters, in training-graph order."""
        return self._layout

    @property
    def bundle(self) -> ArtifactBundle:
        """The bundle this trainer runs."""
        return self._bundle

    def get_parameters(self) -> dict[str, np.ndarray]:
        """A float32 copy of every trainable parameter, in layout order."""
        return {name: self._params[name].copy() for name in self._layout.names}

    def set_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters by name (a subset of the layout is allowed).

        Raises:
            LocalProtocolError: Unknown name, wrong shape or dtype; nothing is changed then.
        """
        self._params.update(check_tensors(self._layout, params, "parameter"))

    def train_steps(self, batches: Iterable[Batch], lr: float) -> TrainStats:
        """Run one SGD step per batch, in order, with learning rate ``lr``.

        Returns:
            Steps, samples and the sample-weighted mean of the per-step (pre-update) losses;
            ``mean_loss`` is NaN when ``batches`` is empty.

        Raises:
            LocalProtocolError: Invalid ``lr`` or batch. Steps before the bad batch stay applied.
        """
        step = np.float32(check_lr(lr))
        steps = samples = 0
        loss_sum = 0.0
        for x, y in batches:
            xs, ys = check_batch(self._arch, x, y)
            loss, grads = self._forward_backward(xs, ys)
            for name, grad in grads.items():
                self._params[name] = self._params[name] - step * grad
            steps += 1
            samples += xs.shape[0]
            loss_sum += loss * xs.shape[0]
        mean_loss = loss_sum / samples if samples else float("nan")
        return TrainStats(steps=steps, samples=samples, mean_loss=mean_loss)

    def compute_gradient(self, x: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """Gradient of the mean loss on ``(x, y)``; parameters unchanged.

        Raises:
            LocalProtocolError: Invalid batch.
        """
        xs, ys = check_batch(self._arch, x, y)
        loss, grads = self._forward_backward(xs, ys)
        return grads, loss

    def score_gradient(self, x: np.ndarray, weights: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """Gradient of ``sum_n weights[n] * output(x[n])`` (a ``weighted_score`` bundle); parameters unchanged.

        Raises:
            LocalProtocolError: Not a score model, invalid inputs or weights.
        """
        check_score_model(self._arch)
        xs = check_inputs(self._arch, x)
        loss, grads = self._forward_backward(xs, check_weights(xs.shape[0], weights))
        return grads, loss

    def apply_step(self, direction: Mapping[str, np.ndarray], lr: float) -> None:
        """Apply ``w[name] <- w[name] - lr * direction[name]`` in float32 for each given name.

        Raises:
            LocalProtocolError: Invalid ``lr``, unknown name or wrong shape; nothing changes.
        """
        step = np.float32(check_lr(lr))
        checked = check_tensors(self._layout, direction, "direction")
        for name, d in checked.items():
            self._params[name] = np.ascontiguousarray(self._params[name] - step * d, dtype=np.float32)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> EvalResult:
        """Mean loss and accuracy on ``(x, y)`` with the eval graph, in chunks.

        Raises:
            LocalProtocolError: Invalid or empty data.
        """
        xs, ys = check_batch(self._arch, x, y)
        n = xs.shape[0]
        loss_sum = 0.0
        correct = 0.0
        for start in range(0, n, EVAL_CHUNK):
            xc, yc = xs[start:start + EVAL_CHUNK], ys[start:start + EVAL_CHUNK]
            loss, logits = self._eval_step(xc, yc)
            loss_sum += loss * xc.shape[0]
            correct += correct_predictions(self._arch.loss, logits, yc)
        accuracy = None if self._arch.loss == "mse" else correct / n
        return EvalResult(loss=loss_sum / n, accuracy=accuracy, samples=n)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits ``(b, classes)`` for ``x`` with the eval graph (labels are dummies).

        Raises:
            LocalProtocolError: Wrong input shape.
        """
        xs = check_inputs(self._arch, x, allow_empty=True)
        if xs.shape[0] == 0:
            return np.zeros((0, self._arch.num_classes), dtype=np.float32)
        chunks = []
        for start in range(0, xs.shape[0], EVAL_CHUNK):
            xc = xs[start:start + EVAL_CHUNK]
            _loss, logits = self._eval_step(xc, self._dummy_labels(xc.shape[0]), with_loss=False)
            chunks.append(logits)
        return np.ascontiguousarray(np.concatenate(chunks, axis=0), dtype=np.float32)

    # --- internals ----------------------------------------------------------------------------

    def _feeds(self, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
        return {INPUT_NAME: x, self._label: y, **self._params, **self._frozen}

    def _dummy_labels(self, batch: int) -> np.ndarray:
        """Labels the eval graph takes when only outputs matter (a scorer's zero coefficients)."""
        if self._arch.loss == "cross_entropy":
            return np.zeros(batch, dtype=np.int64)
        return np.zeros((batch, self._arch.num_classes), dtype=np.float32)

    def _forward_backward(self, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        loss, *grads = self._train.run(self._train_outputs, self._feeds(x, y))
        return float(loss), {name: np.asarray(g, dtype=np.float32)
                             for name, g in zip(self._layout.names, grads, strict=True)}

    def _eval_step(self, x: np.ndarray, y: np.ndarray, with_loss: bool = True) -> tuple[float, np.ndarray]:
        scorer = self._arch.loss in SCORE_LOSSES
        # A scorer's graph takes coefficients where labels go: zeros, and the loss is computed here.
        feeds = self._feeds(x, self._dummy_labels(x.shape[0]) if scorer else y)
        loss, logits = self._eval.run(None, {name: feeds[name] for name in self._eval_inputs})[:2]
        if logits.shape != (x.shape[0], self._arch.num_classes):
            raise ArtifactError(f"eval model returned logits of shape {logits.shape}")
        return (score_loss(logits, y) if scorer and with_loss else float(loss)), np.asarray(logits, dtype=np.float32)

"""``OrtTrainer``: the ``Trainer`` protocol on onnxruntime-training 1.19.2 (torch-free).

It drives the bundle's artifacts with ``CheckpointState`` / ``Module`` / ``Optimizer``:

* Parameters are exchanged **by name** (``state.parameters[name] = arr``), never through the
  contiguous-buffer API whose defaults disagree in 1.19.2 (field notes §0.6, §1.5).
  ``Parameter.data`` and ``.grad`` return numpy *views* of the live session buffers, so
  every value handed out is copied first.
* The optimizer is ``SGDOptimizerV2`` (``w <- w - lr * g``), which keeps no state besides a
  step counter it does not use; the learning rate is set explicitly on every call (the
  artifacts default to 0.001). The gradient buffers are reset lazily (``lazy_reset_grad``)
  after every forward/backward, so no gradient leaks into the next step. Hence the trainer
  holds no per-device state beyond the parameters, and one instance can be shared by many
  simulated devices that swap parameters with ``set_parameters``.
* Sessions use ``intra_op_num_threads=threads``, ``inter_op_num_threads=1``, sequential
  execution and deterministic compute, so the simulator and the MQTT runs produce the same
  bits for the same inputs.
* The eval graph returns ``(loss, logits)`` (artifacts are built with
  ``additional_output_names=["logits"]``); ``predict`` feeds it dummy labels.

Not thread-safe: one call at a time per instance.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

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
from device_agent.trainers.ort_runtime import install_shim, module_step, training_api
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.errors import ArtifactError, LocalProtocolError
from fedtier.training.layout import PROX_PREFIX, SCORE_LOSSES, Layout
from fedtier.training.trainer import Batch, EvalResult, TrainStats

# Must run before anything imports onnxruntime, so that the import does not drag in torch.
install_shim()

logger = logging.getLogger(__name__)

_ORT_LOG_ERROR = 3


_SGD_OP = b"SGDOptimizerV2"
_STATEFUL_OPS = (b"AdamWOptimizer", b"AdamOptimizer", b"LambOptimizer")


def _require_stateless_sgd(bundle: ArtifactBundle) -> None:
    """Refuse optimizer graphs with state (AdamW moments would leak between shared devices).

    A byte search instead of an ONNX parse keeps the device free of the ``onnx`` package;
    op types are stored as plain strings in the protobuf.
    """
    try:
        raw = bundle.path("optimizer_model").read_bytes()
    except OSError as exc:
        raise ArtifactError(f"cannot read the optimizer model of bundle {bundle.bundle_id[:12]}: "
                            f"{exc}") from exc
    if _SGD_OP not in raw or any(op in raw for op in _STATEFUL_OPS):
        raise ArtifactError(
            f"bundle {bundle.bundle_id[:12]}: OrtTrainer needs the stateless SGD optimizer "
            "(SGDOptimizerV2); a stateful optimizer would carry state across devices sharing "
            "one trainer")


class OrtTrainer:
    """Train and evaluate one artifact bundle with onnxruntime-training.

    Args:
        bundle: A bundle with a local directory (normally from ``ArtifactBundle.load``).
        threads: ORT intra-op threads (1 for bit-reproducible runs).

    Raises:
        ArtifactError: The bundle has no directory or its checkpoint does not match the
            bundle's layout, or ORT cannot load the artifacts.
        LocalProtocolError: ``threads`` is not an int >= 1.
        ImportError: onnxruntime-training is not installed.
    """

    def __init__(self, bundle: ArtifactBundle, *, threads: int = 1) -> None:
        self._threads = check_threads(threads)
        self._bundle = bundle
        self._arch = bundle.arch
        self._layout = bundle.layout
        _require_stateless_sgd(bundle)
        api = training_api()
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self._threads
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        options.use_deterministic_compute = True
        # Loading the optimizer graph logs a harmless "Error merging shape info" warning.
        options.log_severity_level = _ORT_LOG_ERROR
        try:
            self._state = api.CheckpointState.load_checkpoint(str(bundle.path("checkpoint")))
            self._module = api.Module(
                str(bundle.path("training_model")),
                self._state,
                str(bundle.path("eval_model")),
                device="cpu",
                session_options=options,
            )
            self._optimizer = api.Optimizer(str(bundle.path("optimizer_model")), self._module)
        except Exception as exc:  # pybind Fail/InvalidProtobuf/... derive from Exception only
            raise ArtifactError(f"onnxruntime cannot load bundle {bundle.bundle_id[:12]}: {exc}"
                                ) from exc
        self._check_checkpoint()
        self._prox = [n for n in self._module.input_names() if n.startswith(PROX_PREFIX)]
        """FedProx bundles (``proximal_mu`` > 0) take the anchor weights as inputs ``prox.<name>``."""
        if self._prox and [n[len(PROX_PREFIX):] for n in self._prox] != list(self._layout.names):
            raise ArtifactError(f"proximal inputs {self._prox} do not match the layout {list(self._layout.names)}")
        self.anchor: dict[str, np.ndarray] = {}
        """FedProx: the weights the proximal term pulls towards (``w_global``): what the last
        ``set_parameters`` set, i.e. the model a local phase starts from. Unused by other bundles."""
        self._module.train()
        self._module.lazy_reset_grad()
        logger.debug("OrtTrainer for bundle %s (%s, %d parameters, %d thread(s))",
                     bundle.bundle_id[:12], self._arch.kind, self._layout.num_parameters,
                     self._threads)

    def _check_checkpoint(self) -> None:
        """The checkpoint's trainable tensors must be exactly the layout's (a user's graph may
        hold frozen ones besides)."""
        names = {name for name, param in self._state.parameters if param.requires_grad}
        if names != set(self._layout.names):
            raise ArtifactError(
                f"checkpoint parameters {sorted(names)} differ from the bundle layout "
                f"{sorted(self._layout.names)}")
        for spec in self._layout.params:
            param = self._state.parameters[spec.name]
            shape = tuple(param.data.shape)
            if shape != spec.shape:
                raise ArtifactError(f"checkpoint {spec.name}: shape {shape} != layout {spec.shape}")
            if not param.requires_grad:
                raise ArtifactError(f"checkpoint {spec.name} is frozen; every parameter must train")

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
        """A float32 copy of every trainable parameter, in layout order.

        Returns:
            Name -> array; the caller owns the arrays.
        """
        params = self._state.parameters
        return {name: np.array(params[name].data, dtype=np.float32, copy=True)
                for name in self._layout.names}

    def set_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters by name (a subset of the layout is allowed).

        Args:
            params: Name -> floating array of the layout's shape (cast to float32).

        Raises:
            LocalProtocolError: Unknown name, wrong shape or dtype; nothing is changed then.
        """
        checked = check_tensors(self._layout, params, "parameter")
        state_params = self._state.parameters
        for name, arr in checked.items():
            state_params[name] = arr
        if self._prox:
            self.anchor = {**self.anchor, **{n: np.array(a, np.float32, copy=True) for n, a in checked.items()}}

    @property
    def proximal(self) -> bool:
        """Whether the bundle's training loss has FedProx's ``(mu/2) ||w - anchor||^2``."""
        return bool(self._prox)

    def _anchors(self, current: bool = False) -> list[np.ndarray]:
        """The ``prox.*`` inputs: the anchor (training), or the current weights (evaluation: term 0)."""
        if not self._prox:
            return []
        if current:
            params = self.get_parameters()
            return [params[n] for n in self._layout.names]
        missing = [n for n in self._layout.names if n not in self.anchor]
        if missing:
            raise LocalProtocolError(f"FedProx bundle: no anchor for {missing} (set_parameters first)")
        return [self.anchor[n] for n in self._layout.names]

    def train_steps(self, batches: Iterable[Batch], lr: float) -> TrainStats:
        """Run one SGD step per batch, in order, with learning rate ``lr``.

        Args:
            batches: ``(x, y)`` pairs; ``x`` float32 ``(b, *input_shape)``, ``y`` int labels.
            lr: Learning rate for every step of this call.

        Returns:
            Steps, samples and the sample-weighted mean of the per-step (pre-update) losses;
            ``mean_loss`` is NaN when ``batches`` is empty.

        Raises:
            LocalProtocolError: Invalid ``lr`` or batch. Steps before the bad batch stay applied.
        """
        self._optimizer.set_learning_rate(check_lr(lr))
        self._module.train()
        steps = samples = 0
        loss_sum = 0.0
        for x, y in batches:
            xs, ys = check_batch(self._arch, x, y)
            try:
                loss, _logits = module_step(self._module, [xs, ys, *self._anchors()])
                self._optimizer.step()
            finally:
                self._module.lazy_reset_grad()
            steps += 1
            samples += xs.shape[0]
            loss_sum += float(loss) * xs.shape[0]
        mean_loss = loss_sum / samples if samples else float("nan")
        return TrainStats(steps=steps, samples=samples, mean_loss=mean_loss)

    def compute_gradient(self, x: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """Gradient of the mean loss on ``(x, y)`` at the current parameters.

        Parameters are not touched (no optimizer step) and the gradient buffers are reset
        lazily afterwards, so the next ``train_steps`` starts from a zero gradient.

        Args:
            x: Inputs ``(b, *input_shape)``.
            y: Integer labels ``(b,)``.

        Returns:
            ``(gradients by name in layout order, loss)``.

        Raises:
            LocalProtocolError: Invalid batch.
        """
        xs, ys = check_batch(self._arch, x, y)
        self._module.train()
        try:
            loss, _logits = module_step(self._module, [xs, ys, *self._anchors()])
            params = self._state.parameters
            grads = {name: np.array(params[name].grad, dtype=np.float32, copy=True)
                     for name in self._layout.names}
        finally:
            self._module.lazy_reset_grad()
        return grads, float(loss)

    def score_gradient(self, x: np.ndarray, weights: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """Gradient of ``sum_n weights[n] * output(x[n])`` at the current parameters (a ``weighted_score``
        bundle: the weights go in as the training graph's ``labels``); parameters unchanged.

        Args:
            x: Inputs ``(b, *input_shape)``.
            weights: ``b`` finite coefficients.

        Returns:
            ``(gradients by name in layout order, the weighted sum)``.

        Raises:
            LocalProtocolError: Not a score model, invalid inputs or weights.
        """
        check_score_model(self._arch)
        xs = check_inputs(self._arch, x)
        ws = check_weights(xs.shape[0], weights)
        self._module.train()
        try:
            loss, _logits = module_step(self._module, [xs, ws, *self._anchors()])
            params = self._state.parameters
            grads = {name: np.array(params[name].grad, dtype=np.float32, copy=True)
                     for name in self._layout.names}
        finally:
            self._module.lazy_reset_grad()
        return grads, float(loss)

    def apply_step(self, direction: Mapping[str, np.ndarray], lr: float) -> None:
        """Apply ``w[name] <- w[name] - lr * direction[name]`` in float32 for each given name.

        Args:
            direction: Name -> array (a subset of the layout is allowed).
            lr: Step size.

        Raises:
            LocalProtocolError: Invalid ``lr``, unknown name or wrong shape; nothing changes.
        """
        step = np.float32(check_lr(lr))
        checked = check_tensors(self._layout, direction, "direction")
        state_params = self._state.parameters
        updated = {name: np.array(state_params[name].data, dtype=np.float32, copy=True) - step * d
                   for name, d in checked.items()}
        for name, arr in updated.items():
            state_params[name] = np.ascontiguousarray(arr, dtype=np.float32)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> EvalResult:
        """Mean loss and accuracy on ``(x, y)`` with the eval graph, in chunks.

        Args:
            x: Inputs ``(n, *input_shape)``, n >= 1.
            y: Integer labels ``(n,)`` (cross-entropy), or targets ``(n, outputs)`` (bce, mse).

        Returns:
            Sample-weighted mean loss, accuracy (cross-entropy: of the argmax; bce: of each
            output's sign, averaged over outputs; mse: ``None``), and ``n``.

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
            loss_sum += float(loss) * xc.shape[0]
            correct += correct_predictions(self._arch.loss, logits, yc)
        accuracy = None if self._arch.loss == "mse" else correct / n
        return EvalResult(loss=loss_sum / n, accuracy=accuracy, samples=n)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits ``(b, classes)`` for ``x`` with the eval graph (labels are dummies).

        Args:
            x: Inputs ``(b, *input_shape)``; ``b`` may be 0.

        Returns:
            float32 logits.

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
            chunks.append(np.array(logits, dtype=np.float32, copy=True))
        return np.concatenate(chunks, axis=0)

    def export_inference(self, path: str | Path, output_names: Sequence[str]) -> Path:
        """Write an inference-only ONNX model with the current parameters (for serving the result).

        Args:
            path: the ``.onnx`` file to write.
            output_names: the forward graph's outputs to keep (e.g. ``["logits"]``).

        Returns:
            ``path``.

        Raises:
            ArtifactError: onnxruntime could not export the model.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._module.export_model_for_inferencing(str(path), list(output_names))
        except Exception as exc:  # pybind errors derive from Exception only
            raise ArtifactError(f"onnxruntime could not export an inference model: {exc}") from exc
        return path

    # --- internals ----------------------------------------------------------------------------

    def _dummy_labels(self, batch: int) -> np.ndarray:
        if self._arch.loss in ("cross_entropy", *SCORE_LOSSES):
            return np.zeros(batch, dtype=np.int64)
        return np.zeros((batch, self._arch.num_classes), dtype=np.float32)

    def _eval_step(self, x: np.ndarray, y: np.ndarray, with_loss: bool = True) -> tuple[Any, np.ndarray]:
        scorer = self._arch.loss in SCORE_LOSSES
        self._module.eval()
        try:
            # A scorer's graph takes coefficients where labels go: zeros, and the loss is computed here.
            outputs = module_step(self._module, [x, np.zeros((x.shape[0], 1), np.float32) if scorer else y,
                                                 *self._anchors(current=True)])
        finally:
            self._module.train()
        if len(outputs) != 2:
            raise ArtifactError(
                "eval model must return (loss, logits); rebuild the bundle with "
                "additional_output_names=['logits']")
        loss, logits = outputs
        if logits.shape != (x.shape[0], self._arch.num_classes):
            raise ArtifactError(f"eval model returned logits of shape {logits.shape}")
        return (score_loss(logits, y) if scorer and with_loss else loss), logits

"""HSGD's split model on onnxruntime-training: a host or a device side from a ``SplitBundle``.

The same interface as ``fedtier.training.split.SplitTrainer`` (``embed`` and ``train``, what the
shell runs for HSGD's ``Embed`` and ``SplitTrain`` actions), over the bundle's graphs: the training
graph of the node's side — whose partner values (``zeta1`` and the frozen head ``theta0`` on a device,
``z2`` on the host) are inputs fed every step — and the inference graph of its encoder. Parameters are
written into the checkpoint state before each call and read back after, so the role stays the owner
of the model (as with ``OrtTrainer``). The optimizer is stateless SGD.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import numpy as np

from device_agent.trainers.ort_runtime import install_shim, module_step, training_api
from fedtier.artifacts.split_bundle import PARAMS, SplitBundle
from fedtier.errors import ArtifactError, LocalProtocolError

install_shim()

_LOG_ERROR = 3


class OrtSplitTrainer:
    """One side (``"host"`` or ``"device"``) of the split model, with its local rows and labels."""

    def __init__(self, bundle: SplitBundle, side: str, x: Mapping[str, np.ndarray], y: Mapping[str, int]) -> None:
        if side not in PARAMS:
            raise LocalProtocolError(f"split side must be one of {sorted(PARAMS)}, got {side!r}")
        if set(x) != set(y):
            raise LocalProtocolError("split trainer: every row needs a label")
        import onnxruntime

        api = training_api()
        self.side = side
        self.bundle = bundle
        self.x = {k: np.asarray(v, np.float32).reshape(-1) for k, v in x.items()}
        self.y = {k: int(v) for k, v in y.items()}
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.use_deterministic_compute = True
        options.log_severity_level = _LOG_ERROR
        try:
            self._state = api.CheckpointState.load_checkpoint(str(bundle.path(side, "checkpoint")))
            self._module = api.Module(str(bundle.path(side, "training_model")), self._state,
                                      str(bundle.path(side, "eval_model")), device="cpu", session_options=options)
            self._optimizer = api.Optimizer(str(bundle.path(side, "optimizer_model")), self._module)
            embed = "embed1" if side == "host" else "embed2"
            self._embed = onnxruntime.InferenceSession(str(bundle.directory / embed / "embed.onnx"), options,
                                                       providers=["CPUExecutionProvider"])
        except Exception as exc:  # pybind errors derive from Exception only
            raise ArtifactError(f"onnxruntime cannot load split bundle {bundle.bundle_id[:12]}: {exc}") from exc
        self._module.train()
        self._module.lazy_reset_grad()

    def with_rows(self, x: Mapping[str, np.ndarray], y: Mapping[str, int]) -> "OrtSplitTrainer":
        """This trainer's sessions over other rows (a simulator's nodes share one session per side; every
        call writes its parameters in first, so sharing on one thread changes no result)."""
        if set(x) != set(y):
            raise LocalProtocolError("split trainer: every row needs a label")
        view = copy.copy(self)
        view.x = {k: np.asarray(v, np.float32).reshape(-1) for k, v in x.items()}
        view.y = {k: int(v) for k, v in y.items()}
        return view

    def _rows(self, rows: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        unknown = [r for r in rows if r not in self.x]
        if unknown:
            raise LocalProtocolError(f"split trainer holds no rows {unknown[:5]}")
        return np.stack([self.x[r] for r in rows]), np.array([self.y[r] for r in rows], np.int64)

    def embed(self, block_name: str, params: Mapping[str, np.ndarray], rows: tuple[str, ...]) -> np.ndarray:
        w = np.asarray(params[f"{block_name}/w"], np.float32)
        if not rows:
            return np.zeros((0, w.shape[0]), np.float32)
        x, _ = self._rows(rows)
        out = self._embed.run(None, {"x": x, "w": w, "b": np.asarray(params[f"{block_name}/b"], np.float32)})
        return np.asarray(out[0], np.float32)

    def train(self, side: str, params: Mapping[str, np.ndarray], frozen: Mapping[str, np.ndarray],
              partner: np.ndarray, rows: tuple[str, ...], steps: int, lr: float) -> tuple[dict[str, np.ndarray], float]:
        if side != self.side:
            raise LocalProtocolError(f"this trainer runs the {self.side} side, not {side!r}")
        names = PARAMS[side]
        if not rows or steps == 0:
            return {k: np.asarray(v, np.float32) for k, v in params.items()}, 0.0
        if set(params) != set(names):
            raise LocalProtocolError(f"{side} parameters {sorted(params)} are not {sorted(names)}")
        x, y = self._rows(rows)
        state = self._state.parameters
        for name, onnx_name in names.items():
            state[onnx_name] = np.ascontiguousarray(params[name], np.float32)
        inputs: list[Any] = [x, np.ascontiguousarray(partner, np.float32)]
        if side == "device":
            inputs += [np.ascontiguousarray(frozen["theta0/w"], np.float32),
                       np.ascontiguousarray(frozen["theta0/b"], np.float32)]
        self._optimizer.set_learning_rate(float(lr))
        losses = []
        for _ in range(steps):
            try:
                loss, _logits = module_step(self._module, [*inputs, y])
                self._optimizer.step()
            finally:
                self._module.lazy_reset_grad()
            losses.append(float(loss))
        out = {name: np.array(state[onnx_name].data, np.float32, copy=True) for name, onnx_name in names.items()}
        return out, float(np.mean(losses))

"""``module_step``: the ORT trainer's way around ``Module.__call__``'s slow output conversion gives
exactly what the public call gives, in training and in evaluation, and falls back to it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from device_agent.trainers.ort import OrtTrainer
from device_agent.trainers.ort_runtime import module_step
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.training.layout import ArchSpec
from models.artifacts import build_artifacts

ARCHS = {"mlp": ArchSpec.from_json({"kind": "mlp", "options": {"sizes": [12, 8, 3]}}),
         "cnn1d": ArchSpec.from_json({"kind": "cnn1d", "options": {"channels": 2, "length": 16, "classes": 3,
                                                                   "filters": [4], "kernel": 3}})}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def bundle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ArtifactBundle:
    return build_artifacts(ARCHS[request.param], Path(tmp_path_factory.mktemp("module_step")), seed=0)


def _batch(bundle: ArtifactBundle) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, *bundle.arch.input_shape)).astype(np.float32)
    return x, rng.integers(0, bundle.arch.num_classes, size=5).astype(np.int64)


def _steps(trainer: OrtTrainer, x: np.ndarray, y: np.ndarray, step: object) -> list[float]:
    """Three SGD steps taken with ``step(module, inputs)``; the losses."""
    module, losses = trainer._module, []
    module.train()
    for _ in range(3):
        loss, _logits = step(module, [x, y])  # type: ignore[operator]
        trainer._optimizer.step()
        module.lazy_reset_grad()
        losses.append(float(loss))
    return losses


def test_training_steps_equal_the_public_call(bundle: ArtifactBundle) -> None:
    x, y = _batch(bundle)
    fast, public = OrtTrainer(bundle), OrtTrainer(bundle)
    fast_losses = _steps(fast, x, y, module_step)
    public_losses = _steps(public, x, y, lambda module, inputs: module(*inputs))
    assert fast_losses == public_losses
    assert fast_losses[-1] < fast_losses[0]  # the steps trained: the comparison is not of two no-ops
    a, b = fast.get_parameters(), public.get_parameters()
    assert all(np.array_equal(a[n], b[n]) for n in a)


def test_evaluation_equals_the_public_call(bundle: ArtifactBundle) -> None:
    x, y = _batch(bundle)
    trainer = OrtTrainer(bundle)
    module = trainer._module
    module.eval()
    try:
        loss, logits = module_step(module, [x, y])
        public_loss, public_logits = module(x, y)
    finally:
        module.train()
    assert logits.shape == (5, bundle.arch.num_classes)
    assert float(loss) == float(public_loss) and np.array_equal(logits, public_logits)


def test_a_module_without_the_internal_falls_back_to_the_public_call() -> None:
    class PublicOnly:  # what a future wheel without ``_model`` would look like to module_step
        training = True

        def __call__(self, *inputs: np.ndarray) -> tuple[np.ndarray, ...]:
            return (np.float32(sum(float(np.sum(i)) for i in inputs)), inputs[0] * 2)

    x = np.ones((2, 3), np.float32)
    loss, doubled = module_step(PublicOnly(), [x, np.ones(2, np.int64)])
    assert float(loss) == 8.0 and np.array_equal(doubled, x * 2)

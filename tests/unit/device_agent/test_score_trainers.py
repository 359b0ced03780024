"""The weighted-score training graph (loss ``weighted_score``, FeDXL's scorer) on both onnxruntime backends,
against plain torch: ``score_gradient`` is the gradient of ``sum_n w_n * output(x_n)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from device_agent.trainers import make_trainer
from fedtier.errors import LocalProtocolError
from fedtier.training.layout import ArchSpec
from models.artifacts import build_artifacts
from models.source import model_source

ARCH = ArchSpec("mlp", {"sizes": [12, 8, 1]})


@pytest.fixture(scope="module")
def bundle(artifact_store: Path) -> Any:
    return build_artifacts(model_source(arch=ARCH, loss="weighted_score", seed=4), artifact_store)


def torch_reference(params: dict[str, np.ndarray], x: np.ndarray, w: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
    import torch

    tensors = {n: torch.tensor(p, dtype=torch.float64, requires_grad=True) for n, p in params.items()}
    hidden = torch.relu(torch.tensor(x, dtype=torch.float64) @ tensors["fc0.weight"].T + tensors["fc0.bias"])
    out = (hidden @ tensors["fc1.weight"].T + tensors["fc1.bias"])[:, 0]
    value = (torch.tensor(w, dtype=torch.float64) * out).sum()
    value.backward()
    return {n: t.grad.numpy() for n, t in tensors.items()}, float(value.detach())  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", ["ort", "portable"])
def test_score_gradient_is_the_gradient_of_the_weighted_scores(bundle: Any, backend: str) -> None:
    # Prepare
    trainer = make_trainer(backend, bundle)
    assert bundle.has_portable_graph and bundle.arch.loss == "weighted_score"
    gen = np.random.default_rng(0)
    x = gen.normal(size=(7, 12)).astype(np.float32)
    w = gen.normal(size=7).astype(np.float32)
    params = trainer.get_parameters()
    before = {n: p.copy() for n, p in params.items()}
    # Execute
    grads, value = trainer.score_gradient(x, w)
    # Assert: torch's gradient of the same sum, and the parameters untouched
    expected, expected_value = torch_reference(params, x, w)
    assert value == pytest.approx(expected_value, rel=1e-5)
    for name in expected:
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-4, atol=1e-5)
    for name, value_before in before.items():
        np.testing.assert_array_equal(trainer.get_parameters()[name], value_before)
    # The scores and the evaluation of a scorer: its output, accuracy by its sign, BCE of the score.
    logits = trainer.predict(x)[:, 0]
    y = (gen.random(7) < 0.5).astype(np.int64)
    result = trainer.evaluate(x, y)
    assert result.accuracy == pytest.approx(np.mean((logits > 0) == (y == 1)))
    z = logits.astype(np.float64)
    assert result.loss == pytest.approx(np.mean(np.where(y == 1, np.logaddexp(0, -z), np.logaddexp(0, z))), rel=1e-6)


def test_bad_weights_and_classifiers_are_refused(bundle: Any, artifact_store: Path) -> None:
    trainer = make_trainer("ort", bundle)
    x = np.zeros((3, 12), np.float32)
    for bad in (np.zeros(2, np.float32), np.array([0.0, np.nan, 1.0], np.float32), np.zeros(3, np.int64)):
        with pytest.raises(LocalProtocolError):
            trainer.score_gradient(x, bad)
    classifier = make_trainer("ort", build_artifacts(ArchSpec("mlp", {"sizes": [12, 2]}), artifact_store))
    with pytest.raises(LocalProtocolError, match="weighted_score"):
        classifier.score_gradient(x, np.zeros(3, np.float32))
    with pytest.raises(LocalProtocolError):
        trainer.evaluate(x, np.array([0, 2, 1]))  # a scorer's rows are negatives (0) and positives (1)

"""HIST submodels as real networks: the ONNX submodel computes the torch sub-network, and one
ORT SGD step on submodel j is the masked full-model step on j's coordinates (digest §8 checks 5-6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from device_agent.trainers import make_trainer
from fedtier.rng import stream
from fedtier.training.layout import ArchSpec
from fedtier.training.submodels import draw, extract, plan_for, reassemble, submodel_arch
from models.artifacts import build_artifacts
from models.zoo import build_model, initial_parameters

FULL = ArchSpec("mlp", {"sizes": [64, 300, 10]})
CELLS = 3


def torch_model(arch: ArchSpec, params: dict[str, np.ndarray]) -> torch.nn.Module:
    model = build_model(arch, 0)
    model.load_state_dict({n: torch.from_numpy(np.array(p)) for n, p in params.items()})
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    plan = plan_for(FULL, CELLS)
    part = draw(plan, CELLS, stream(5, "hist-partition", "r", 0))
    params = initial_parameters(FULL, 1)
    store = tmp_path_factory.mktemp("store")
    bundles = [build_artifacts(submodel_arch(plan, part.sizes(j)), store) for j in range(CELLS)]
    return plan, part, params, bundles


def test_onnx_submodel_forward_matches_the_torch_subnetwork(setup) -> None:
    plan, part, params, bundles = setup
    x = np.random.default_rng(0).normal(size=(32, 64)).astype(np.float32)
    for j in range(CELLS):
        sub = extract(part, j, params)
        trainer = make_trainer("ort", bundles[j])
        trainer.set_parameters(sub)
        expected = torch_model(submodel_arch(plan, part.sizes(j)), sub)(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(trainer.predict(x), expected, rtol=0, atol=1e-5)


def test_one_ort_step_on_a_submodel_is_the_masked_full_model_step(setup) -> None:
    plan, part, params, bundles = setup
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=16).astype(np.int64)
    lr = 0.1
    for j in range(CELLS):
        # ORT: one SGD step on cell j's physically smaller network, copied back into the full model.
        trainer = make_trainer("ort", bundles[j])
        trainer.set_parameters(extract(part, j, params))
        trainer.train_steps([(x, y)], lr)
        after_ort = reassemble(part, params, {j: trainer.get_parameters()})
        # torch: the full model with cell j's mask applied, one SGD step, the gradient masked.
        mask = {n: np.zeros_like(p) for n, p in params.items()}
        rows = part.parts[1][j]
        mask["fc0.weight"][rows] = 1
        mask["fc0.bias"][rows] = 1
        mask["fc1.weight"][:, rows] = 1
        mask["fc1.bias"][:] = 1  # shared output bias: every cell trains it
        model = torch_model(FULL, {n: params[n] * mask[n] for n in params})
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        expected = {n: params[n] - lr * mask[n] * p.grad.numpy() for n, p in model.named_parameters()}
        owned = {n: mask[n].astype(bool) for n in params}
        for n in params:
            np.testing.assert_allclose(after_ort[n][owned[n]], expected[n][owned[n]], rtol=0, atol=1e-5)
            # every coordinate outside cell j's mask is exactly what it was
            assert np.array_equal(after_ort[n][~owned[n]], params[n][~owned[n]])

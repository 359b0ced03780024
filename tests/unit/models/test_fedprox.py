"""FedProx: (mu/2) ||w - w_global||^2 in the ORT training graph (anchors as graph inputs); mu = 0: today's bundle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from device_agent.trainers import make_trainer
from fedtier.errors import ArtifactError, ConfigError
from fedtier.training.layout import ArchSpec
from models.artifacts import build_artifacts

ARCH = ArchSpec("mlp", {"sizes": [6, 5, 3]})
MU = 0.3


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("store")
    return build_artifacts(ARCH, store), build_artifacts(ARCH, store, proximal_mu=MU), store


def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(seed)
    return gen.normal(size=(16, 6)).astype(np.float32), gen.integers(0, 3, 16)


def test_mu_zero_is_todays_bundle_and_mu_positive_another(bundles) -> None:
    plain, prox, store = bundles
    assert build_artifacts(ARCH, store, proximal_mu=0.0).bundle_id == plain.bundle_id
    assert prox.bundle_id != plain.bundle_id
    assert build_artifacts(ARCH, store, proximal_mu=MU).bundle_id == prox.bundle_id  # cached under (seed, mu)
    assert not make_trainer("ort", plain).proximal and make_trainer("ort", prox).proximal


def test_the_device_gradient_is_the_analytic_one(bundles) -> None:
    plain, prox, _ = bundles
    x, y = batch()
    t, t0 = make_trainer("ort", prox), make_trainer("ort", plain)
    gen = np.random.default_rng(1)
    w = t.get_parameters()
    g = {k: v + gen.normal(scale=0.3, size=v.shape).astype(np.float32) for k, v in w.items()}
    t.set_parameters(w)
    t.anchor = g
    t0.set_parameters(w)
    grad, loss = t.compute_gradient(x, y)
    base_grad, base_loss = t0.compute_gradient(x, y)
    # d/dw [(mu/2) ||w - g||^2] = mu (w - g); the loss gains (mu/2) ||w - g||^2.
    for k in w:
        np.testing.assert_allclose(grad[k] - base_grad[k], MU * (w[k] - g[k]), rtol=0, atol=1e-6)
    penalty = MU / 2 * sum(float(np.sum((w[k].astype(np.float64) - g[k]) ** 2)) for k in w)
    assert loss - base_loss == pytest.approx(penalty, rel=1e-5)


def test_the_device_gradient_matches_finite_differences_through_ort(bundles) -> None:
    _, prox, _ = bundles
    x, y = batch(2)
    t = make_trainer("ort", prox)
    gen = np.random.default_rng(3)
    w = t.get_parameters()
    g = {k: v + gen.normal(scale=0.5, size=v.shape).astype(np.float32) for k, v in w.items()}

    def loss_at(params: dict[str, np.ndarray]) -> float:
        t.set_parameters(params)
        t.anchor = g  # the anchor stays put while w moves
        return t.compute_gradient(x, y)[1]

    t.set_parameters(w)
    t.anchor = g
    grad, _ = t.compute_gradient(x, y)
    eps = 1e-2
    for name in w:
        for idx in list(np.ndindex(w[name].shape))[:4]:
            plus = {k: v.copy() for k, v in w.items()}
            minus = {k: v.copy() for k, v in w.items()}
            plus[name][idx] += eps
            minus[name][idx] -= eps
            numeric = (loss_at(plus) - loss_at(minus)) / (2 * eps)
            assert numeric == pytest.approx(float(grad[name][idx]), abs=2e-3), (name, idx)


def test_training_pulls_towards_the_anchor(bundles) -> None:
    # With the anchor = the start (set_parameters), local SGD moves less far from it than without the term.
    plain, prox, _ = bundles
    x, y = batch(4)
    far = {}
    for label, bundle in (("plain", plain), ("prox", prox)):
        t = make_trainer("ort", bundle)
        start = t.get_parameters()
        t.set_parameters(start)
        t.train_steps([(x, y)] * 50, 0.5)
        end = t.get_parameters()
        far[label] = sum(float(np.sum((end[k] - start[k]) ** 2)) for k in start)
    assert far["prox"] < far["plain"]


def test_backends_that_cannot_feed_anchors_refuse_clearly(bundles, small_rollout) -> None:
    _, prox, _ = bundles
    for kind in ("portable", "torch"):
        with pytest.raises(ArtifactError, match="FedProx"):
            make_trainer(kind, prox)
    with pytest.raises(ConfigError, match="portable trainer") as info:
        small_rollout(fedavg={"proximal_mu": 0.1}, simulation={"trainer": "portable"})
    assert info.value.key == "simulation.trainer"


def test_mu_zero_gives_todays_model_bit_for_bit_and_mu_positive_another(small_rollout) -> None:
    from local_fleet.simulate import simulate

    today = simulate(small_rollout(rounds=2))
    zero = simulate(small_rollout(rounds=2, fedavg={"proximal_mu": 0.0}))
    prox = simulate(small_rollout(rounds=2, fedavg={"proximal_mu": 0.5}))
    assert zero.prepared.bundle.bundle_id == today.prepared.bundle.bundle_id
    for name in today.params:
        assert np.array_equal(zero.params[name], today.params[name])
    assert any(not np.array_equal(prox.params[n], today.params[n]) for n in today.params)
    assert prox.rounds[-1]["accuracy"] > 0.1


def test_partial_work_devices_send_updates_after_fewer_steps(small_rollout, tmp_path: Path) -> None:
    from fedtier.algorithms import fedavg
    from fedtier.algorithms.base import LocalTrain
    from fedtier.wire.messages import DeviceTask

    config = fedavg.FedAvgConfig(local_steps=10, partial_work=True)
    assert fedavg.FedAvgConfig.from_dict(config.to_dict()).partial_work
    assert "partial_work" not in fedavg.FedAvgConfig().to_dict()
    steps = []
    for d in range(20):
        dev = fedavg.Device(device_id=f"dev-{d}", cell="c", rollout="r")
        task = DeviceTask(rollout="r", round=0, sender="c", step=0, params={"w": np.zeros(2, np.float32)},
                          config=config.to_dict(), members=tuple(f"dev-{i}" for i in range(20)))
        train = next(a for a in dev.receive(task, 0.0) if isinstance(a, LocalTrain))
        steps.append(train.steps)
    assert all(1 <= s <= 10 for s in steps) and len(set(steps)) > 3 and min(steps) < 10
    result = __import__("local_fleet.simulate", fromlist=["simulate"]).simulate(
        small_rollout(rounds=2, fedavg={"partial_work": True, "proximal_mu": 0.1}))
    assert result.rounds[-1]["devices_reported"] == 4

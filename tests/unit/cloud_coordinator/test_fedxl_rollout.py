"""A FeDXL rollout's config, data and model: what is refused (naming the key), the rare-event generator, the
one-class split, and the one-output scorer the coordinator builds."""

from __future__ import annotations

import numpy as np
import pytest

from fedtier.rollout.config import DataConfig
from fleet_data.datasets import make_federated, rare_event
from fedtier.errors import ConfigError


def test_fedxl_is_refused_under_privacy_with_the_reason(small_rollout) -> None:
    with pytest.raises(ConfigError, match="scores") as err:
        small_rollout(algorithm="fedxl", privacy={"epsilon": 1.0, "clip": 1.0})
    assert err.value.key == "privacy"


@pytest.mark.parametrize(("overrides", "key"), [
    ({"algorithm": "fedxl", "model": {"kind": "mlp", "loss": "mse"}}, "model.loss"),
    ({"algorithm": "fedxl", "model": {"kind": "cnn1d"}}, "model.kind"),
    ({"model": {"kind": "mlp", "loss": "weighted_score"}}, "model.loss"),  # fedavg cannot train a scorer
    ({"algorithm": "fedxl", "fedxl": {"gamma": 0.0}}, "fedxl.gamma"),
    ({"algorithm": "fedxl", "fedxl": {"participation": 1.5}}, "fedxl.participation"),
    ({"algorithm": "fedxl", "fedxl": {"pairs": "both"}}, "fedxl.pairs"),
    ({"data": {"dataset": "rare_event", "features": 4}}, "data.features"),
])
def test_bad_fedxl_configs_name_the_key(small_rollout, overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        small_rollout(**overrides)
    assert err.value.key == key, err.value


def test_a_task_that_is_not_binary_is_refused_before_anything_is_built(small_rollout) -> None:
    from cloud_coordinator.rollout import prepare

    with pytest.raises(ConfigError, match="binary") as err:
        prepare(small_rollout(algorithm="fedxl"))  # digits: ten classes
    assert err.value.key == "data"


def test_the_coordinator_builds_a_one_output_scorer_for_fedxl(small_rollout) -> None:
    from cloud_coordinator.rollout import prepare

    prepared = prepare(small_rollout(algorithm="fedxl", data={"dataset": "rare_event", "samples": 300,
                                                              "partition": "one_class"}))
    assert prepared.arch.kind == "onnx" and prepared.arch.loss == "weighted_score" and prepared.arch.num_classes == 1
    assert prepared.bundle.has_portable_graph  # the weighted-score graph lowers to standard ONNX ops
    assert prepared.manifest.algorithm == "fedxl"


def test_the_rare_event_generator_has_the_digest_s_shape() -> None:
    cfg = DataConfig(dataset="rare_event", samples=60000, features=20, separation=2.0)
    x, y = rare_event(cfg)
    assert x.shape == (60000, 20) and set(np.unique(y)) == {0, 1}
    assert abs(y.mean() - 1 / 6) < 0.01  # pos:neg 1:5
    delta = x[y == 1].mean(axis=0) - x[y == 0].mean(axis=0)
    assert np.linalg.norm(delta[:5]) == pytest.approx(2.0, abs=0.05)
    assert np.abs(delta[5:]).max() < 0.05


def test_one_class_devices_and_their_shift() -> None:
    cfg = DataConfig(dataset="rare_event", samples=1200, partition="one_class", device_shift=1.0, test_fraction=0.25)
    devices = [f"dev-{i:02d}" for i in range(4)]
    data = make_federated(cfg, devices)
    classes = [set(np.unique(data.train[d][1]).tolist()) for d in devices]
    assert classes == [{0}, {1}, {0}, {1}]
    # device i is shifted by (i - 1.5) on coordinates 5..9, the test set by a mix of the shifts
    means = [data.train[d][0][:, 5:10].mean() for d in devices]
    np.testing.assert_allclose(np.diff(means), 1.0, atol=0.25)
    assert data.test is not None and set(np.unique(data.test[1])) == {0, 1}


def test_positive_rate_and_label_noise_on_a_bundled_binary_dataset() -> None:
    cfg = DataConfig(dataset="breast_cancer", positive_rate=0.2, label_noise=0.1, partition="iid", test_fraction=0.3)
    data = make_federated(cfg, ["dev-00", "dev-01"])
    assert data.test is not None
    labels = np.concatenate([data.test[1], *(y for _, y in data.train.values())])
    # 20 % positives before flipping (the test labels stay clean)
    assert data.test[1].mean() == pytest.approx(0.2, abs=0.02)
    assert 0.15 < labels.mean() < 0.35
    with pytest.raises(ConfigError, match="binary"):
        make_federated(DataConfig(dataset="digits", positive_rate=0.2), ["dev-00"])

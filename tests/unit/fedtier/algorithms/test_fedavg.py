"""Hierarchical FedAvg roles: the contract suite plus the maths of the two-tier average."""

from __future__ import annotations

import numpy as np
import pytest
from hierarchy import Hierarchy
from role_contract import RoleContract

from fedtier.algorithms import fedavg
from fedtier.algorithms.base import Dropped, LocalTrain
from fedtier.errors import LocalProtocolError, UnexpectedMessageError, UnknownSenderError
from fedtier.wire.messages import DeviceTask

CELLS = {"cell-a": ("dev-0", "dev-1", "dev-2"), "cell-b": ("dev-3",)}
PARAMS = {"w": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), "b": np.array([0.5, -0.5], np.float32)}


def make(rounds: int = 3, **cfg: object) -> Hierarchy:
    config = fedavg.FedAvgConfig(**{"local_steps": 2, "batch_size": 4, "lr": 0.1, **cfg})  # type: ignore[arg-type]
    return Hierarchy(algo=fedavg, cells=dict(CELLS), params={k: v.copy() for k, v in PARAMS.items()},
                     config=config, rounds=rounds)


class TestFedAvgContract(RoleContract):
    def hierarchy(self, **kwargs: object) -> Hierarchy:
        return make(**kwargs)  # type: ignore[arg-type]


def test_uniform_weighting_gives_the_flat_mean_over_devices() -> None:
    # Prepare: dev-i moves every parameter by 0.01 * (i + 1); cells of sizes 3 and 1.
    h = make(rounds=1, weighting="uniform")
    # Execute
    h.run()
    # Assert: the cloud weights cells by size, so the result is the mean over 4 devices
    # (0.01 * (1 + 2 + 3 + 4) / 4 = 0.025), not the mean of the two cell means.
    expected = {k: v + np.float32(0.025) for k, v in PARAMS.items()}
    for name in PARAMS:
        np.testing.assert_allclose(h.closed[0].params[name], expected[name], rtol=0, atol=1e-7)


def test_sample_weighting_weights_devices_by_sample_count() -> None:
    h = make(rounds=1, weighting="samples")
    h.samples = {"dev-0": 10, "dev-1": 30, "dev-2": 0, "dev-3": 60}
    h.run()
    step = (0.01 * 10 + 0.02 * 30 + 0.03 * 0 + 0.04 * 60) / 100
    np.testing.assert_allclose(h.closed[0].params["b"], PARAMS["b"] + step, rtol=0, atol=1e-7)


def test_rounds_chain_from_the_new_global_model() -> None:
    h = make(rounds=3)
    h.run()
    np.testing.assert_allclose(h.closed[-1].params["w"], PARAMS["w"] + 3 * 0.025, rtol=0, atol=1e-6)
    assert [c.metrics["model_version"] for c in h.closed] == [1, 2, 3]


def test_aggregate_is_bit_identical_whatever_the_arrival_order() -> None:
    results = []
    for order in (["dev-0", "dev-1", "dev-2"], ["dev-2", "dev-0", "dev-1"]):
        edge = fedavg.Edge(cell="cell-a", rollout="r")
        cloud = fedavg.Cloud(rollout="r", cells={"cell-a": CELLS["cell-a"]}, initial_params=PARAMS,
                             config=fedavg.FedAvgConfig(), rounds=1)
        task = cloud.start(0.0)[0].message
        edge.receive(task, 0.0)
        out = []
        for d in order:
            rng = np.random.default_rng(int(d[-1]))
            delta = {n: rng.normal(size=p.shape).astype(np.float32) for n, p in PARAMS.items()}
            from fedtier.wire.messages import DeviceUpdate
            out = edge.receive(DeviceUpdate(rollout="r", round=0, sender=d, delta=delta, num_samples=5,
                                            train_loss=0.1, steps=1), 0.0)
        results.append(out[-1].message.delta)
    for name in PARAMS:
        assert np.array_equal(results[0][name], results[1][name])


def test_device_requests_local_training_with_its_own_batch_stream() -> None:
    device = fedavg.Device(device_id="dev-1", cell="cell-a", rollout="r")
    config = fedavg.FedAvgConfig(local_steps=7, batch_size=3, lr=0.2, seed=11).to_dict()
    task = DeviceTask(rollout="r", round=4, sender="cell-a", params=PARAMS, config=config, members=("dev-1",))
    [action] = device.receive(task, 0.0)
    assert isinstance(action, LocalTrain)
    assert (action.steps, action.batch_size, action.lr) == (7, 3, 0.2)
    assert action.stream == (11, "batches", "r", "dev-1", 4, 0)  # (seed, purpose, rollout, device, round, step)


def test_device_ignores_a_round_it_is_not_selected_for() -> None:
    device = fedavg.Device(device_id="dev-9", cell="cell-a", rollout="r")
    task = DeviceTask(rollout="r", round=0, sender="cell-a", params=PARAMS,
                      config=fedavg.FedAvgConfig().to_dict(), members=("dev-1",))
    [action] = device.receive(task, 0.0)
    assert isinstance(action, Dropped) and action.reason == "not_selected"


def test_device_rejects_a_task_from_another_cell() -> None:
    device = fedavg.Device(device_id="dev-1", cell="cell-a", rollout="r")
    task = DeviceTask(rollout="r", round=0, sender="cell-b", params=PARAMS,
                      config=fedavg.FedAvgConfig().to_dict(), members=("dev-1",))
    with pytest.raises(UnknownSenderError):
        device.receive(task, 0.0)


def test_device_resumed_after_restart_does_not_retrain_a_reported_round() -> None:
    device = fedavg.Device(device_id="dev-1", cell="cell-a", rollout="r", last_round=2)
    task = DeviceTask(rollout="r", round=2, sender="cell-a", params=PARAMS,
                      config=fedavg.FedAvgConfig().to_dict(), members=("dev-1",))
    assert [a.reason for a in device.receive(task, 0.0)] == ["duplicate"]


def test_invalid_config_in_a_task_is_a_remote_error() -> None:
    device = fedavg.Device(device_id="dev-1", cell="cell-a", rollout="r")
    bad = {**fedavg.FedAvgConfig().to_dict(), "local_steps": 0}
    task = DeviceTask(rollout="r", round=0, sender="cell-a", params=PARAMS, config=bad, members=("dev-1",))
    with pytest.raises(UnexpectedMessageError):
        device.receive(task, 0.0)


@pytest.mark.parametrize("field,value", [("local_steps", 0), ("batch_size", -1), ("lr", float("nan")),
                                         ("weighting", "median"), ("quorum", 0.0), ("quorum", 1.5),
                                         ("deadline_s", 0.0)])
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(LocalProtocolError, match=field):
        fedavg.FedAvgConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("quorum,members,need", [(1.0, 6, 6), (0.5, 6, 3), (0.5, 5, 3), (0.01, 4, 1), (0.34, 3, 2)])
def test_quorum_count(quorum: float, members: int, need: int) -> None:
    assert fedavg.quorum_count(quorum, members) == need


def test_cloud_needs_members_in_every_cell() -> None:
    with pytest.raises(LocalProtocolError):
        fedavg.Cloud(rollout="r", cells={"cell-a": ()}, initial_params=PARAMS, config=fedavg.FedAvgConfig(),
                     rounds=1)

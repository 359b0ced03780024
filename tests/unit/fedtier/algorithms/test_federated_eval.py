"""Federated evaluation in the roles: who evaluates what, when, and how edge and cloud combine it."""

from __future__ import annotations

import numpy as np
import pytest
from hierarchy import Hierarchy
from numpy_model import NumpyCompute, init_params, make_data
from test_privacy_roles import SHAPE, sampled_hierarchy
from test_privacy_roles import hierarchy as private_hierarchy

from fedtier.algorithms import aggregate, fedavg, hier_qsgd, qhetfed
from fedtier.algorithms.base import Evaluate, LocalTrain
from fedtier.errors import LocalProtocolError, MalformedHeaderError
from fedtier.wire import messages
from fedtier.wire.messages import DeviceTask, DeviceUpdate, EvalStats

CELLS = {"cell-a": ("dev-0", "dev-1", "dev-2"), "cell-b": ("dev-3",)}
PARAMS = {"w": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), "b": np.array([0.5, -0.5], np.float32)}
# dev-2 holds no rows out: it trains but does not evaluate.
HELD_OUT = {"dev-0": EvalStats(loss=1.0, count=10, correct=5), "dev-1": EvalStats(loss=2.0, count=30, correct=24),
            "dev-3": EvalStats(loss=0.5, count=20, correct=20)}


def make(algo=fedavg, rounds: int = 2, evaluations=HELD_OUT, **cfg: object) -> Hierarchy:
    configs = {fedavg: fedavg.FedAvgConfig, hier_qsgd: hier_qsgd.HierConfig, qhetfed: qhetfed.QHetFedConfig}
    base: dict[str, object] = {"batch_size": 4, "lr": 0.1}
    if algo is not qhetfed:
        base["local_steps"] = 2
    config = configs[algo](**{**base, **cfg})  # type: ignore[operator]
    return Hierarchy(algo=algo, cells=dict(CELLS), params={k: v.copy() for k, v in PARAMS.items()}, config=config,
                     rounds=rounds, evaluations=dict(evaluations))


def test_the_cloud_reports_the_count_weighted_evaluation_of_the_model_each_round_started_from() -> None:
    # Prepare: three devices hold rows out (10, 30 and 20 rows), dev-2 none.
    h = make(rounds=2)
    # Execute
    h.run()
    # Assert: loss weighted by rows (10*1 + 30*2 + 20*0.5) / 60, accuracy (5 + 24 + 20) / 60, as Flower's
    # weighted_loss_avg; the evaluated model is the one each round started from.
    for r, closed in enumerate(h.closed):
        federated = closed.metrics["federated"]
        assert federated["loss"] == pytest.approx(80 / 60, abs=1e-12)
        assert federated["accuracy"] == pytest.approx(49 / 60, abs=1e-12)
        assert (federated["examples"], federated["devices"], federated["model_version"]) == (60, 3, r)
    assert sorted((d, r) for d, r, _ in h.evaluated) == [(d, r) for d in ("dev-0", "dev-1", "dev-3") for r in (0, 1)]
    starts = {0: PARAMS, 1: h.closed[0].params}
    for _device, r, params in h.evaluated:
        for name in PARAMS:
            np.testing.assert_array_equal(params[name], starts[r][name])


def test_each_cell_sends_its_devices_combined_evaluation() -> None:
    h = make(rounds=1)
    h.run()
    cell_updates = {m.sender: m for m in h.received["cloud"] if isinstance(m, messages.CellUpdate)}
    assert cell_updates["cell-a"].evaluation == EvalStats(loss=(10 * 1.0 + 30 * 2.0) / 40, count=40, correct=29,
                                                          devices=2)
    assert cell_updates["cell-b"].evaluation == EvalStats(loss=0.5, count=20, correct=20, devices=1)


@pytest.mark.parametrize("algo", [fedavg, hier_qsgd, qhetfed], ids=lambda a: a.__name__.rsplit(".", 1)[-1])
def test_each_cell_update_carries_every_devices_own_evaluation_and_the_round_row_has_them(algo) -> None:
    # Prepare: dev-1 ranks its rows of a binary task (an AUROC), the others report none; dev-2 holds nothing out.
    own = {**HELD_OUT, "dev-1": EvalStats(loss=2.0, count=30, correct=24, auroc=0.875)}
    if algo is qhetfed:  # its devices compute gradients: a real (numpy) model
        h = Hierarchy(algo=qhetfed, cells=dict(CELLS), params=init_params(), rounds=2, evaluations=own,
                      config=qhetfed.QHetFedConfig(tau=2, gamma=2, batch_size=4, lr=0.1),
                      compute=NumpyCompute(make_data([d for ds in CELLS.values() for d in ds])))
    else:
        h = make(algo=algo, rounds=2, evaluations=own, **({"edge_rounds": 2} if algo is hier_qsgd else {}))
    # Execute
    h.run()
    # Assert: each cell's update names its reporting devices' own stats, as [count, loss, correct, auroc] ...
    cell_updates = [m for m in h.received["cloud"] if isinstance(m, messages.CellUpdate)]
    assert len(cell_updates) == 4
    for update in cell_updates:
        if update.sender == "cell-a":
            assert update.stats["evaluations"] == {"dev-0": [10, 1.0, 5.0, None], "dev-1": [30, 2.0, 24.0, 0.875]}
            assert update.device_evaluations == {"dev-0": own["dev-0"], "dev-1": own["dev-1"]}
        else:
            assert update.stats["evaluations"] == {"dev-3": [20, 0.5, 20.0, None]}
        assert update.evaluation is not None and update.evaluation.auroc is None  # a combination has no AUROC
    # ... and the round's row has every device's own beside the combination (the cells' stats without them).
    for r, closed in enumerate(h.closed):
        federated = closed.metrics["federated"]
        assert federated["per_device"] == {
            "dev-0": {"accuracy": 0.5, "loss": 1.0, "examples": 10},
            "dev-1": {"accuracy": 0.8, "loss": 2.0, "examples": 30, "auroc": 0.875},
            "dev-3": {"accuracy": 1.0, "loss": 0.5, "examples": 20}}
        assert federated["accuracy"] == pytest.approx(49 / 60) and federated["model_version"] == r
        assert all("evaluations" not in stats for stats in closed.metrics["cells"].values())


def test_without_devices_own_evaluations_the_row_has_no_per_device_map() -> None:
    # (a round of an older edge's cells: only the combination; and a rollout without held-out rows: nothing)
    h = make(rounds=1, evaluations={})
    h.run()
    assert h.closed[0].metrics["federated"] is None
    cloud = fedavg.Cloud(rollout="r", cells={"cell-b": ("dev-3",)}, initial_params=PARAMS,
                         config=fedavg.FedAvgConfig(local_steps=1), rounds=1)
    cloud.start(0.0)
    update = messages.CellUpdate(rollout="r", round=0, sender="cell-b", delta={k: np.zeros_like(v)
                                                                                for k, v in PARAMS.items()},
                                 weight=1.0, reported=("dev-3",), evaluation=HELD_OUT["dev-3"])
    closed = cloud.receive(messages.decode_message(update.encode()), 0.0)[0]
    assert "per_device" not in closed.metrics["federated"] and closed.metrics["federated"]["examples"] == 20


def test_the_cloud_refuses_evaluations_of_devices_a_cell_did_not_report() -> None:
    from fedtier.errors import UnknownSenderError

    cloud = fedavg.Cloud(rollout="r", cells={"cell-a": ("dev-0", "dev-1")}, initial_params=PARAMS,
                         config=fedavg.FedAvgConfig(local_steps=1), rounds=1)
    cloud.start(0.0)
    update = messages.CellUpdate(rollout="r", round=0, sender="cell-a", delta={k: np.zeros_like(v)
                                                                                for k, v in PARAMS.items()},
                                 weight=1.0, reported=("dev-0",), evaluation=HELD_OUT["dev-0"],
                                 stats={"evaluations": {"dev-0": HELD_OUT["dev-0"].to_row(),
                                                        "dev-1": HELD_OUT["dev-1"].to_row()}})
    with pytest.raises(UnknownSenderError, match="dev-1"):
        cloud.receive(update, 0.0)


def test_a_sampling_edge_forwards_no_devices_own_evaluation() -> None:
    # Prepare: a trusted edge sampling in secret (every member, q = 1); both devices offline, so the only updates
    # the edge gets are the ones below, which carry held-out statistics the devices should not have sent.
    h = sampled_hierarchy(2, 1.0, 1)
    h.offline.update({"a0", "a1"})
    h.start()
    # Execute
    for d in ("a0", "a1"):
        update = DeviceUpdate(rollout="r", round=0, sender=d, delta={"w": np.zeros(SHAPE, np.float32)},
                              num_samples=5, evaluation=EvalStats(loss=1.0, count=5, correct=4))
        h.deliver_to_edge("edge-a", messages.decode_message(update.encode()))
    # Assert: the round closed with them, and neither a device's own row (it would name it as sampled) nor the
    # combination left the cell.
    (cell_update,) = [m for m in h.received["cloud"] if isinstance(m, messages.CellUpdate)]
    assert h.edges["edge-a"].sampling_secretly
    assert cell_update.reported == ("a0", "a1")
    assert "evaluations" not in cell_update.stats and cell_update.evaluation is None
    assert h.closed[0].metrics["federated"] is None


def test_several_edge_rounds_evaluate_once_and_report_in_the_last_upload() -> None:
    h = make(algo=hier_qsgd, rounds=1, edge_rounds=3)
    h.run()
    assert sorted(d for d, _, _ in h.evaluated) == ["dev-0", "dev-1", "dev-3"]  # once per round, at step 0
    uploads = [m for m in h.received["cell-a"] if isinstance(m, DeviceUpdate) and m.sender == "dev-0"]
    assert [m.step for m in uploads] == [0, 1, 2]
    assert [m.evaluation for m in uploads] == [None, None, HELD_OUT["dev-0"]]
    assert h.closed[0].metrics["federated"]["examples"] == 60


def test_qhetfed_devices_evaluate_before_their_first_gradient() -> None:
    h = make(algo=qhetfed, rounds=1, tau=2, gamma=2)
    h.compute = None
    device = h.devices["dev-0"]
    task = DeviceTask(rollout="r", round=0, sender="cell-a", params=PARAMS, config=h.config.to_dict(),
                      members=CELLS["cell-a"])
    actions = device.receive(task, 0.0)
    assert [type(a).__name__ for a in actions] == ["Evaluate", "ComputeGradient"]


def test_nothing_is_evaluated_when_the_task_says_no_or_the_device_holds_nothing_out() -> None:
    off = make(rounds=1, federated_eval=False)
    off.run()
    nobody = make(rounds=1, evaluations={})
    nobody.run()
    for h in (off, nobody):
        assert h.evaluated == []
        assert h.closed[0].metrics["federated"] is None


def test_a_catch_up_task_past_step_0_does_not_evaluate_the_set_model() -> None:
    device = hier_qsgd.Device(device_id="dev-0", cell="cell-a", rollout="r", evaluate=True)
    config = hier_qsgd.HierConfig(local_steps=1, edge_rounds=3).to_dict()
    task = DeviceTask(rollout="r", round=0, sender="cell-a", step=1, params=PARAMS, config=config,
                      members=("dev-0",))
    actions = device.receive(task, 0.0)
    assert [type(a) for a in actions] == [LocalTrain]


def test_under_a_noise_plan_devices_do_not_evaluate_and_edges_forward_no_statistics() -> None:
    # Prepare: one trusted and one untrusted cell, every device holding rows out.
    cells = {"cell-a": ("dev-0", "dev-1"), "cell-b": ("dev-2",)}
    h = private_hierarchy(cells, {"cell-a": True, "cell-b": False})
    for cell, members in cells.items():
        for d in members:
            h.devices[d] = hier_qsgd.Device(device_id=d, cell=cell, rollout="r", evaluate=True)
    h.evaluations = {d: EvalStats(loss=1.0, count=5, correct=5) for ds in cells.values() for d in ds}
    # Execute
    h.run()
    # Assert: the held-out statistics would be clear, data-dependent releases to the (untrusted) cloud.
    assert h.evaluated == []
    assert all(m.evaluation is None and m.device_evaluations == {} and "evaluations" not in m.stats
               for m in h.received["cloud"] if isinstance(m, messages.CellUpdate))
    assert h.closed[0].metrics["federated"] is None


def test_a_trusted_edge_drops_statistics_a_device_sent_anyway() -> None:
    # Prepare: the device is offline, so the only update the edge gets is the one below.
    h = private_hierarchy({"cell-a": ("dev-0",)}, {"cell-a": True})
    h.offline.add("dev-0")
    h.start()
    update = DeviceUpdate(rollout="r", round=0, sender="dev-0", delta={"w": np.zeros(SHAPE, np.float32)},
                          num_samples=5, evaluation=EvalStats(loss=1.0, count=5, correct=5))
    # Execute
    h.deliver_to_edge("cell-a", messages.decode_message(update.encode()))
    # Assert: the round closed with that update, and its statistics stayed at the edge.
    cell_updates = [m for m in h.received["cloud"] if isinstance(m, messages.CellUpdate)]
    assert [m.reported for m in cell_updates] == [("dev-0",)]
    assert cell_updates[0].evaluation is None and "evaluations" not in cell_updates[0].stats


def test_evaluated_without_a_request_is_a_misuse() -> None:
    device = fedavg.Device(device_id="dev-0", cell="cell-a", rollout="r", evaluate=True)
    with pytest.raises(LocalProtocolError):
        device.evaluated(-1, EvalStats(loss=1.0, count=1))
    with pytest.raises(LocalProtocolError, match="ERROR"):
        device.tick(0.0)


def test_the_shell_may_answer_none_when_the_loss_was_not_finite() -> None:
    device = fedavg.Device(device_id="dev-0", cell="cell-a", rollout="r", evaluate=True)
    config = fedavg.FedAvgConfig(local_steps=1).to_dict()
    actions = device.receive(DeviceTask(rollout="r", round=0, sender="cell-a", params=PARAMS, config=config,
                                        members=("dev-0",)), 0.0)
    assert isinstance(actions[0], Evaluate)
    assert device.evaluated(0, None) == []


def test_combining_weights_losses_by_rows_and_keeps_accuracy_only_when_every_part_has_one() -> None:
    a, b = EvalStats(loss=1.0, count=1, correct=1), EvalStats(loss=4.0, count=3, correct=0)
    combined = aggregate.combine_evaluations([a, None, b])
    assert combined == EvalStats(loss=(1.0 + 12.0) / 4, count=4, correct=1, devices=2)
    assert aggregate.combine_evaluations([a, EvalStats(loss=0.5, count=2)]) == EvalStats(
        loss=2.0 / 3, count=3, correct=None, devices=2)
    assert aggregate.combine_evaluations([None, None]) is None


@pytest.mark.parametrize("bad", [
    {"loss": 1.0, "count": 0, "devices": 1},
    {"loss": 1.0, "count": 3, "correct": 4.0, "devices": 1},
    {"loss": float("nan"), "count": 3, "devices": 1},
    {"loss": -1.0, "count": 3, "devices": 1},
    {"loss": 1.0, "count": True, "devices": 1},
    {"loss": 1.0, "count": 2},
    "not a map",
])
def test_malformed_evaluations_are_rejected_at_decode(bad: object) -> None:
    update = DeviceUpdate(rollout="r", round=0, sender="dev-0", delta={"w": np.zeros(2, np.float32)}, num_samples=1)
    env = update.to_envelope()
    env = messages.Envelope(type=env.type, rollout=env.rollout, round=env.round, step=env.step, sender=env.sender,
                            key=env.key, meta={**env.meta, "eval": bad}, tensors=env.tensors)
    with pytest.raises(MalformedHeaderError):
        messages.decode_message(messages.wire.encode(env))


@pytest.mark.parametrize("bad", [
    "not a map",
    {"dev-0": "x"},
    {"dev-0": [10, 1.0, 5.0]},
    {"dev-0": [0, 1.0, None, None]},
    {"dev-0": [10.0, 1.0, None, None]},
    {"dev-0": [10, float("nan"), None, None]},
    {"dev-0": [10, None, None, None]},
    {"dev-0": [10, 1.0, 11.0, None]},
    {"dev-0": [10, 1.0, 5.0, 1.5]},
    {"dev-0": [10, 1.0, 5.0, True]},
])
def test_malformed_devices_evaluations_in_a_cell_update_are_rejected_at_decode(bad: object) -> None:
    cell = messages.CellUpdate(rollout="r", round=0, sender="cell-a", delta={"w": np.ones(2, np.float32)},
                               weight=1.0, reported=("dev-0",), stats={"evaluations": bad})
    with pytest.raises(MalformedHeaderError):
        messages.decode_message(cell.encode())


def test_a_devices_auroc_round_trips_and_a_combination_has_none() -> None:
    stats = EvalStats(loss=0.25, count=8, correct=6.0, auroc=0.75)
    update = DeviceUpdate(rollout="r", round=0, sender="dev-0", delta={"w": np.zeros(2, np.float32)}, num_samples=1,
                          evaluation=stats)
    decoded = messages.decode_message(update.encode())
    assert isinstance(decoded, DeviceUpdate) and decoded.evaluation == stats
    assert EvalStats.from_row(stats.to_row()) == stats
    assert aggregate.combine_evaluations([stats]) == EvalStats(loss=0.25, count=8, correct=6.0)
    with pytest.raises(LocalProtocolError, match="one device's"):
        EvalStats(loss=0.25, count=8, auroc=0.5, devices=2)
    with pytest.raises(LocalProtocolError, match="auroc"):
        EvalStats(loss=0.25, count=8, auroc=-0.1)


def test_an_evaluation_round_trips_through_the_wire() -> None:
    stats = EvalStats(loss=0.25, count=7, correct=3.5, devices=2)
    cell = messages.CellUpdate(rollout="r", round=1, sender="cell-a", delta={"w": np.ones(2, np.float32)}, weight=2.0,
                               reported=("dev-0",), evaluation=stats)
    decoded = messages.decode_message(cell.encode())
    assert isinstance(decoded, messages.CellUpdate) and decoded.evaluation == stats
    assert messages.decode_message(messages.CellUpdate(rollout="r", round=1, sender="cell-a", weight=1.0,
                                                       delta={"w": np.ones(2, np.float32)}).encode()).evaluation is None

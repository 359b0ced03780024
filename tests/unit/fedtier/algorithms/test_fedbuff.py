"""Hierarchical FedBuff roles: staleness weights by hand, the K thresholds, rejection by reason, duplicates."""

from __future__ import annotations

import numpy as np
import pytest

from fedtier.algorithms import fedbuff
from fedtier.algorithms.base import Dropped, Finished, LocalResult, LocalTrain, RoundClosed, SendToChild, SendToParent
from fedtier.errors import ConfigError, LocalProtocolError, UnknownSenderError, WrongRoundError
from fedtier.rollout.config import RolloutConfig
from fedtier.wire.messages import CellTask, CellUpdate, DeviceTask, DeviceUpdate

CELLS = {"cell-a": ("dev-0", "dev-1", "dev-2"), "cell-b": ("dev-3",)}
PARAMS = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}


def config(**kw: object) -> fedbuff.FedBuffConfig:
    return fedbuff.FedBuffConfig(**{"local_steps": 2, "batch_size": 4, "lr": 0.1, **kw})  # type: ignore[arg-type]


def full(value: float) -> dict[str, np.ndarray]:
    return {n: np.full_like(p, value) for n, p in PARAMS.items()}


def cell_update(cell: str, seq: int, base: int, value: float, weight: float) -> CellUpdate:
    return CellUpdate(rollout="r", round=seq, sender=cell, delta=full(value), weight=weight,
                      reported=CELLS[cell][:int(weight)], stats={"base_version": base, "deltas": int(weight)})


def cloud(version: int = 0, rounds: int = 10, **kw: object) -> fedbuff.Cloud:
    c = fedbuff.Cloud(rollout="r", cells=CELLS, initial_params=PARAMS, config=config(**kw), rounds=rounds,
                      start_round=version, model_version=version)
    c.start(0.0)
    return c


def edge(version: int = 0, **kw: object) -> fedbuff.Edge:
    e = fedbuff.Edge(cell="cell-a", rollout="r")
    e.receive(CellTask(rollout="r", round=version, sender="cloud", params=PARAMS, members=CELLS["cell-a"],
                       config=config(**kw).to_dict(), model_version=version), 0.0)
    return e


def upload(device: str, base: int, seq: int, value: float) -> DeviceUpdate:
    return DeviceUpdate(rollout="r", round=base, sender=device, step=seq, delta=full(value), num_samples=5,
                        train_loss=0.5, steps=2)


# --- the cloud ------------------------------------------------------------------------------------


def test_staleness_weight_is_one_over_sqrt_one_plus_s_by_default() -> None:
    assert fedbuff.staleness_weight(config(), 0) == 1.0
    assert fedbuff.staleness_weight(config(), 3) == pytest.approx(0.5)
    assert fedbuff.staleness_weight(config(staleness_exponent=1.0), 3) == pytest.approx(0.25)
    assert fedbuff.staleness_weight(config(staleness_weight="constant"), 7) == 1.0


def test_cloud_applies_k_cloud_updates_weighted_by_size_and_staleness() -> None:
    # Prepare: the cloud is at version 3; k_cloud = 2.
    c = cloud(version=3, k_cloud=2)
    # Execute: a fresh update (s = 0, weight 1, delta 1) and a stale one (base 0: s = 3, weight 3, delta 2).
    first = c.receive(cell_update("cell-b", 0, base=3, value=1.0, weight=1), 0.0)
    second = c.receive(cell_update("cell-a", 0, base=0, value=2.0, weight=3), 0.0)
    # Assert: nothing after one; then Delta = (1 * 1 * 1 + 3 * 0.5 * 2) / (1 + 3) = 1.0, version 4, the new
    # model sent to both cells.
    assert first == []
    closed = [a for a in second if isinstance(a, RoundClosed)]
    tasks = [a for a in second if isinstance(a, SendToChild)]
    assert len(closed) == 1 and closed[0].round == 3 and closed[0].metrics["model_version"] == 4
    np.testing.assert_allclose(c.params["w"], 1.0, rtol=0, atol=1e-7)
    assert closed[0].metrics["mean_staleness"] == 1.5
    assert sorted(t.child for t in tasks) == ["cell-a", "cell-b"]
    assert all(t.message.round == 4 and t.message.model_version == 4 for t in tasks)
    np.testing.assert_allclose(tasks[0].message.params["b"], 1.0, rtol=0, atol=1e-7)


def test_constant_staleness_weight_gives_the_plain_weighted_mean() -> None:
    c = cloud(version=3, k_cloud=2, staleness_weight="constant")
    c.receive(cell_update("cell-b", 0, base=3, value=1.0, weight=1), 0.0)
    c.receive(cell_update("cell-a", 0, base=0, value=2.0, weight=3), 0.0)
    np.testing.assert_allclose(c.params["w"], (1 * 1 + 3 * 2) / 4, rtol=0, atol=1e-7)


def test_cloud_rejects_updates_staler_than_max_staleness_by_reason() -> None:
    c = cloud(version=5, k_cloud=1, max_staleness=2)
    out = c.receive(cell_update("cell-a", 0, base=2, value=9.0, weight=1), 0.0)  # s = 3 > 2
    assert [type(a) for a in out] == [Dropped] and out[0].reason == "stale"
    assert c.rejected == {"stale": 1} and c.round == 5
    np.testing.assert_allclose(c.params["w"], 0.0)
    out = c.receive(cell_update("cell-a", 1, base=3, value=1.0, weight=1), 0.0)  # s = 2: accepted, alpha 1/sqrt 3
    np.testing.assert_allclose(c.params["w"], 1.0 / np.sqrt(3.0), rtol=1e-6)
    assert c.round == 6


def test_cloud_ignores_a_duplicate_and_refuses_strangers_and_the_future() -> None:
    c = cloud(version=2, k_cloud=2)
    assert c.receive(cell_update("cell-a", 0, base=2, value=1.0, weight=1), 0.0) == []
    dup = c.receive(cell_update("cell-a", 0, base=2, value=1.0, weight=1), 0.0)
    assert [a.reason for a in dup if isinstance(a, Dropped)] == ["duplicate"]
    with pytest.raises(UnknownSenderError):
        c.receive(cell_update("cell-a", 1, base=2, value=1.0, weight=1).__class__(
            rollout="r", round=0, sender="cell-z", delta=full(1.0), weight=1.0, stats={"base_version": 2}), 0.0)
    with pytest.raises(WrongRoundError):
        c.receive(cell_update("cell-b", 0, base=3, value=1.0, weight=1), 0.0)
    assert c.round == 2  # the duplicate was not folded twice, nothing else was


def test_cloud_finishes_after_rounds_versions_and_uses_the_server_optimizer() -> None:
    c = cloud(version=0, rounds=2, k_cloud=1, strategy={"server_optimizer": {"kind": "sgd", "lr": 0.5}})
    c.receive(cell_update("cell-a", 0, base=0, value=2.0, weight=1), 0.0)
    np.testing.assert_allclose(c.params["w"], 1.0, rtol=0, atol=1e-7)  # w + 0.5 * 2
    out = c.receive(cell_update("cell-a", 1, base=1, value=2.0, weight=1), 0.0)
    assert isinstance(out[-1], Finished) and out[-1].rounds == 2
    assert [a.reason for a in c.receive(cell_update("cell-b", 0, base=1, value=1.0, weight=1), 0.0)] == ["finished"]


# --- the edge -------------------------------------------------------------------------------------


def test_edge_sends_a_cell_update_every_k_edge_deltas() -> None:
    # Prepare: the edge holds version 4, k_edge = 3.
    e = edge(version=4, k_edge=3)
    # Execute: three deltas started from versions 4, 3 and 4.
    outs = [e.receive(upload("dev-0", 4, 0, 1.0), 1.0), e.receive(upload("dev-1", 3, 0, 2.0), 2.0),
            e.receive(upload("dev-2", 4, 0, 6.0), 3.0)]
    # Assert: each device gets the newest model back at once; the third delta sends the mean (1 + 2 + 6) / 3,
    # weight 3, tagged with the oldest start version (3).
    for out, device in zip(outs, ("dev-0", "dev-1", "dev-2"), strict=True):
        tasks = [a for a in out if isinstance(a, SendToChild)]
        assert [t.child for t in tasks] == [device] and tasks[0].message.round == 4
    assert not any(isinstance(a, SendToParent) for o in outs[:2] for a in o)
    [up] = [a.message for a in outs[2] if isinstance(a, SendToParent)]
    assert isinstance(up, CellUpdate) and up.round == 0 and up.weight == 3.0
    assert up.stats == {"base_version": 3, "deltas": 3} and up.reported == ("dev-0", "dev-1", "dev-2")
    np.testing.assert_allclose(up.delta["w"], 3.0, rtol=0, atol=1e-7)
    # The next buffer starts empty and its update is the cell's next one.
    e.receive(upload("dev-0", 4, 1, 1.0), 4.0)
    e.receive(upload("dev-1", 4, 1, 1.0), 5.0)
    [up2] = [a.message for a in e.receive(upload("dev-2", 4, 1, 4.0), 6.0) if isinstance(a, SendToParent)]
    assert up2.round == 1 and up2.stats["base_version"] == 4
    np.testing.assert_allclose(up2.delta["b"], 2.0, rtol=0, atol=1e-7)


def test_edge_sends_a_partial_buffer_after_its_time_limit() -> None:
    e = edge(k_edge=10, edge_timeout_s=30.0)
    e.receive(upload("dev-0", 0, 0, 1.0), 100.0)
    assert e.tick(129.0) == []
    [action] = e.tick(130.0)
    assert isinstance(action, SendToParent) and action.message.stats["deltas"] == 1
    assert e.tick(1000.0) == []  # nothing buffered: nothing sent


def test_edge_rejects_a_delta_staler_than_max_staleness_and_a_duplicate() -> None:
    e = edge(version=10, k_edge=1, max_staleness=3)
    out = e.receive(upload("dev-0", 6, 0, 1.0), 0.0)  # staleness 4
    assert [a.reason for a in out if isinstance(a, Dropped)] == ["stale"] and e.rejected == {"stale": 1}
    assert not any(isinstance(a, SendToParent) for a in out)
    assert any(isinstance(a, SendToChild) for a in out)  # the device still gets the newest model
    assert any(isinstance(a, SendToParent) for a in e.receive(upload("dev-1", 7, 0, 1.0), 0.0))
    assert [a.reason for a in e.receive(upload("dev-1", 7, 0, 1.0), 0.0)] == ["duplicate"]
    with pytest.raises(UnknownSenderError):
        e.receive(upload("dev-3", 10, 0, 1.0), 0.0)  # a member of another cell
    with pytest.raises(WrongRoundError):
        e.receive(upload("dev-2", 11, 0, 1.0), 0.0)


def test_edge_keeps_only_the_newest_model_and_gives_it_to_a_device_that_comes_online() -> None:
    e = edge(version=2)
    newer = CellTask(rollout="r", round=5, sender="cloud", params=full(5.0), members=CELLS["cell-a"],
                     config=config().to_dict(), model_version=5)
    e.receive(newer, 0.0)
    older = CellTask(rollout="r", round=4, sender="cloud", params=full(4.0), members=CELLS["cell-a"],
                     config=config().to_dict(), model_version=4)
    assert [a.reason for a in e.receive(older, 0.0)] == ["superseded"]
    [task] = e.resend("dev-1", 0.0)
    assert isinstance(task, SendToChild) and task.child == "dev-1" and task.message.round == 5
    np.testing.assert_allclose(task.message.params["w"], 5.0)
    assert e.resend("dev-9", 0.0) == []


# --- the device -----------------------------------------------------------------------------------


def test_device_trains_from_the_newest_model_and_tags_its_delta_with_the_start_version() -> None:
    d = fedbuff.Device(device_id="dev-1", cell="cell-a", rollout="r")
    task = DeviceTask(rollout="r", round=7, sender="cell-a", params=PARAMS, config=config(seed=3).to_dict(),
                      members=("dev-1",))
    [train] = d.receive(task, 0.0)
    assert isinstance(train, LocalTrain) and train.round == 7 and train.steps == 2
    assert train.stream == (3, "batches", "r", "dev-1", "fedbuff", 0)
    assert [a.reason for a in d.receive(task, 0.0)] == ["busy"]
    [up] = d.trained(7, LocalResult(delta=full(0.5), num_samples=9, mean_loss=0.1, steps=2))
    assert isinstance(up, SendToParent) and up.message.round == 7 and up.message.step == 0
    assert up.message.num_samples == 9
    [train2] = d.receive(DeviceTask(rollout="r", round=9, sender="cell-a", params=PARAMS,
                                    config=config(seed=3).to_dict(), members=("dev-1",)), 0.0)
    assert train2.stream[-1] == 1  # the next device-step id
    with pytest.raises(LocalProtocolError):
        d.trained(7, LocalResult(delta=full(0.5), num_samples=9, mean_loss=0.1, steps=2))


def test_a_restarted_device_never_reuses_a_device_step_id() -> None:
    d = fedbuff.Device(device_id="dev-1", cell="cell-a", rollout="r", last_round=7, last_sent=(7, 4))
    [train] = d.receive(DeviceTask(rollout="r", round=8, sender="cell-a", params=PARAMS, config=config().to_dict(),
                                   members=("dev-1",)), 0.0)
    assert isinstance(train, LocalTrain) and train.step == 5


# --- configuration --------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, words", [({"k_edge": 0}, "k_edge"), ({"k_cloud": 0}, "k_cloud"),
                                       ({"max_staleness": -1}, "max_staleness"),
                                       ({"staleness_weight": "hinge"}, "staleness_weight"),
                                       ({"edge_timeout_s": -1.0}, "edge_timeout_s"), ({"bits_device": 4}, "float32")])
def test_config_refuses_bad_settings_by_name(kw: dict, words: str) -> None:
    with pytest.raises(LocalProtocolError, match=words):
        config(**kw)


@pytest.mark.parametrize("section, key", [({"k_edge": 0}, "fedbuff.k_edge"),
                                          ({"staleness_weight": "hinge"}, "fedbuff.staleness_weight"),
                                          ({"k_buffer": 3}, "fedbuff.k_buffer"),
                                          ({"secure_aggregation": True}, "fedbuff.secure_aggregation")])
def test_rollout_config_errors_name_the_fedbuff_key(section: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        RolloutConfig.from_mapping({"algorithm": "fedbuff", "fedbuff": section})
    assert f"[{key}]" in str(info.value)


def test_secure_aggregation_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="no such cohort"):
        RolloutConfig.from_mapping({"algorithm": "fedbuff", "fedbuff": {"secure_aggregation": True}})


def test_a_cell_update_does_not_depend_on_the_order_its_deltas_arrived_in() -> None:
    # Float32 deltas summed in float64 (aggregate.WeightedSum) with unit weights are summed exactly here, so the
    # buffer's mean is bit-identical in any order: what a simulator-equals-MQTT check needs from the edge.
    rng = np.random.default_rng(0)
    deltas = {d: {n: rng.normal(scale=0.01, size=p.shape).astype(np.float32) for n, p in PARAMS.items()}
              for d in CELLS["cell-a"]}
    means = []
    for order in (["dev-0", "dev-1", "dev-2"], ["dev-2", "dev-0", "dev-1"]):
        e = edge(version=1, k_edge=3)
        out = []
        for d in order:
            out = e.receive(DeviceUpdate(rollout="r", round=1, sender=d, step=0, delta=deltas[d], num_samples=5,
                                         train_loss=0.5, steps=2), 0.0)
        [up] = [a.message for a in out if isinstance(a, SendToParent)]
        means.append(up.delta)
    for name in PARAMS:
        assert np.array_equal(means[0][name], means[1][name])


# --- the edge's checkpoint and the cloud's "counted" ----------------------------------------------


def _task(version: int, counted: int = 0, **kw: object) -> CellTask:
    cfg = {**config(**kw).to_dict(), **({fedbuff.COUNTED: counted} if counted else {})}
    return CellTask(rollout="r", round=version, sender="cloud", params=full(float(version)), members=CELLS["cell-a"],
                    config=cfg, model_version=version)


def test_an_edge_restored_from_its_checkpoint_and_the_inputs_after_it_goes_on_as_the_uninterrupted_one() -> None:
    """The state taken right after a cell update, loaded into a new edge before its newest cell task and the inputs
    that came after it are replayed, gives the same cell updates, device tasks and duplicate drops as the edge that
    saw every input since the start; so its store need not keep those (``EdgeStore.save_checkpoint``)."""
    kw = {"k_edge": 2, "once_per_version": True}
    before = [_task(0, **kw), upload("dev-0", 0, 0, 1.0), upload("dev-1", 0, 0, 2.0), _task(1, **kw),
              upload("dev-2", 0, 0, 3.0), upload("dev-0", 1, 1, 4.0)]
    after = [upload("dev-1", 1, 1, 5.0), upload("dev-0", 1, 1, 4.0), _task(2, counted=1, **kw),
             upload("dev-2", 1, 1, 6.0), upload("dev-1", 0, 0, 2.0), upload("dev-0", 2, 2, 7.0)]
    whole = fedbuff.Edge(cell="cell-a", rollout="r")
    for m in before:
        whole.receive(m, 0.0)
    state = whole.strategy_state()  # the second cell update has just left: the buffer is empty
    assert state is not None and whole.step == 2
    restored = fedbuff.Edge(cell="cell-a", rollout="r")
    restored.load_strategy_state({k: np.array(v) for k, v in state.items()})
    restored.receive(_task(1, **kw), 0.0)  # the newest cell task, which the store keeps
    for m in after:
        got, want = restored.receive(m, 1.0), whole.receive(m, 1.0)
        assert repr(got) == repr(want), m.key
    assert restored.step == whole.step == 3
    assert restored.rejected == whole.rejected
    # a delta of the checkpointed past is a duplicate for both; a buffer holding a delta is in no checkpoint
    assert isinstance(restored.receive(upload("dev-2", 0, 0, 3.0), 2.0)[0], Dropped)
    assert restored.strategy_state() is None and whole.strategy_state() is None
    restored.receive(upload("dev-1", 2, 2, 1.0), 2.0)
    assert restored.strategy_state() is not None and restored.step == 4


def test_the_cloud_tells_each_cell_which_updates_it_counted_and_devices_never_see_it() -> None:
    c = cloud(k_cloud=2)
    c.receive(cell_update("cell-a", 0, base=0, value=1.0, weight=1), 0.0)
    actions = c.receive(cell_update("cell-b", 0, base=0, value=1.0, weight=1), 0.0)
    tasks = {a.child: a.message for a in actions if isinstance(a, SendToChild)}
    assert tasks["cell-a"].config[fedbuff.COUNTED] == 1 and tasks["cell-b"].config[fedbuff.COUNTED] == 1
    c.receive(cell_update("cell-a", 2, base=1, value=1.0, weight=1), 0.0)  # update 1 of cell-a is lost
    actions = c.receive(cell_update("cell-b", 1, base=1, value=1.0, weight=1), 0.0)
    tasks = {a.child: a.message for a in actions if isinstance(a, SendToChild)}
    assert tasks["cell-a"].config[fedbuff.COUNTED] == 1 and tasks["cell-b"].config[fedbuff.COUNTED] == 2
    e = edge()
    e.receive(upload("dev-0", 0, 0, 1.0), 0.0)
    e.receive(upload("dev-1", 0, 0, 1.0), 0.0)
    out = e.receive(tasks["cell-a"], 0.0)
    assert out[0].event == "cell_updates_counted" and out[0].fields == {"before": 1}
    assert all(fedbuff.COUNTED not in a.message.config for a in out if isinstance(a, SendToChild))

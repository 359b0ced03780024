"""FedBuff with roaming devices: an edge accepts any device of the rollout, a device takes tasks from the cell it
is in now, and the cloud counts every device-step once across cells (and across a restart)."""

from __future__ import annotations

import numpy as np
import pytest

from fedtier.algorithms import fedbuff
from fedtier.algorithms.base import Dropped, LocalResult, LocalTrain, RoundClosed, SendToChild, SendToParent
from fedtier.errors import ConfigError, LocalProtocolError, UnexpectedMessageError, UnknownSenderError
from fedtier.rollout.config import RolloutConfig
from fedtier.wire.messages import CellTask, CellUpdate, DeviceTask, DeviceUpdate

CELLS = {"cell-a": ("dev-0", "dev-1"), "cell-b": ("dev-2", "dev-3")}
PARAMS = {"w": np.zeros((2, 2), np.float32)}


def config(**kw: object) -> fedbuff.FedBuffConfig:
    return fedbuff.FedBuffConfig(**{"local_steps": 1, "batch_size": 4, "lr": 0.1, "roaming": True,
                                    **kw})  # type: ignore[arg-type]


def full(value: float) -> dict[str, np.ndarray]:
    return {n: np.full_like(p, value) for n, p in PARAMS.items()}


def cloud(**kw: object) -> fedbuff.Cloud:
    c = fedbuff.Cloud(rollout="r", cells=CELLS, initial_params=PARAMS, config=config(**kw), rounds=10)
    c.start(0.0)
    return c


def cell_task(cl: fedbuff.Cloud, cell: str) -> CellTask:
    [task] = [a.message for a in cl.resend(cell, 0.0) if isinstance(a, SendToChild)]
    assert isinstance(task, CellTask)
    return task


def edge_of(cell: str, **kw: object) -> fedbuff.Edge:
    e = fedbuff.Edge(cell=cell, rollout="r")
    e.receive(cell_task(cloud(**kw), cell), 0.0)
    return e


def upload(device: str, j: int, value: float = 1.0, base: int = 0) -> DeviceUpdate:
    return DeviceUpdate(rollout="r", round=base, sender=device, step=j, delta=full(value), num_samples=5,
                        train_loss=0.5, steps=1)


def cell_update(cell: str, u: int, steps: list[list], value: float = 1.0, base: int = 0) -> CellUpdate:
    return CellUpdate(rollout="r", round=u, sender=cell, delta=full(value), weight=float(len(steps)),
                      reported=tuple(d for d, _ in steps), stats={"base_version": base, "deltas": len(steps),
                                                                 "steps": steps})


# --- configuration --------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["fedavg", "hier_qsgd", "hist"])
def test_roaming_is_refused_for_a_synchronous_algorithm_by_key_and_why(algorithm: str) -> None:
    with pytest.raises(ConfigError) as info:
        RolloutConfig.from_mapping({"algorithm": algorithm, "topology": {"roaming": True}})
    assert "[topology.roaming]" in str(info.value)
    assert "members" in str(info.value) and "fedbuff" in str(info.value)


def test_roaming_travels_in_the_fedbuff_config_and_is_left_out_of_tasks_without_it() -> None:
    on = RolloutConfig.from_mapping({"algorithm": "fedbuff", "topology": {"roaming": True}}).algorithm_config()
    off = RolloutConfig.from_mapping({"algorithm": "fedbuff"}).algorithm_config()
    assert on.roaming is True and off.roaming is False
    assert on.to_dict()["roaming"] is True and "roaming" not in off.to_dict()  # tasks without it stay as they were


# --- the edge ---------------------------------------------------------------------------------------


def test_the_cloud_sends_the_roster_to_edges_and_the_edge_keeps_it_out_of_device_tasks() -> None:
    task = cell_task(cloud(), "cell-a")
    assert task.members == ("dev-0", "dev-1") and task.config[fedbuff.ROSTER] == ["dev-0", "dev-1", "dev-2", "dev-3"]
    e = fedbuff.Edge(cell="cell-a", rollout="r")
    out = e.receive(task, 0.0)
    # Version 0 goes to the cell's own members only, without the roster.
    assert sorted(a.child for a in out if isinstance(a, SendToChild)) == ["dev-0", "dev-1"]
    assert all(fedbuff.ROSTER not in a.message.config for a in out if isinstance(a, SendToChild))
    no_roaming = cell_task(cloud(roaming=False), "cell-a")
    assert fedbuff.ROSTER not in no_roaming.config


def test_an_edge_accepts_a_visiting_device_of_the_rollout_and_lists_device_steps() -> None:
    # Prepare: cell-b's edge; dev-0 (of cell-a) comes online in cell-b.
    e = edge_of("cell-b", k_edge=2)
    [task] = e.resend("dev-0", 0.0)
    assert isinstance(task, SendToChild) and task.child == "dev-0" and fedbuff.ROSTER not in task.message.config
    # Execute: its upload (its own step 3) and one of a member of cell-b.
    first = e.receive(upload("dev-0", 3, 1.0), 1.0)
    second = e.receive(upload("dev-2", 0, 3.0), 2.0)
    # Assert: both folded into one cell update that names each device-step; each device gets the model again.
    assert [a.child for a in first if isinstance(a, SendToChild)] == ["dev-0"]
    [up] = [a.message for a in second if isinstance(a, SendToParent)]
    assert isinstance(up, CellUpdate) and up.reported == ("dev-0", "dev-2")
    assert up.stats["steps"] == [["dev-0", 3], ["dev-2", 0]]
    np.testing.assert_allclose(up.delta["w"], 2.0)
    # A device that is not in the rollout stays a stranger.
    with pytest.raises(UnknownSenderError, match="nor a device of the rollout"):
        e.receive(upload("dev-9", 0), 3.0)
    assert e.resend("dev-9", 3.0) == []


def test_without_roaming_a_device_of_another_cell_is_refused() -> None:
    e = edge_of("cell-b", roaming=False)
    with pytest.raises(UnknownSenderError):
        e.receive(upload("dev-0", 0), 0.0)
    assert e.resend("dev-0", 0.0) == []
    [up] = [a.message for a in (e.receive(upload("dev-2", 0), 0.0) + e.receive(upload("dev-3", 0), 0.0)
                                + e.receive(upload("dev-2", 1), 0.0) + e.receive(upload("dev-3", 1), 0.0))
            if isinstance(a, SendToParent)][:1]
    assert "steps" not in up.stats


def test_a_new_version_reaches_a_visitor_even_after_it_dropped_the_resent_one() -> None:
    # Prepare: once_per_version; dev-0 trained version 0 in cell-a and moved to cell-b, whose edge resends it
    # version 0 (the device drops it: trained already). cell-b's edge cannot know that.
    cl = cloud(once_per_version=True, k_edge=1, k_cloud=1)
    e = fedbuff.Edge(cell="cell-b", rollout="r")
    e.receive(cell_task(cl, "cell-b"), 0.0)
    [again] = e.resend("dev-0", 1.0)
    assert again.message.round == 0
    # Execute: version 1 arrives.
    cl.receive(cell_update("cell-a", 0, [["dev-1", 0]]), 2.0)
    out = e.receive(cell_task(cl, "cell-b"), 2.0)
    # Assert: the visitor gets it (the members still hold their version-0 tasks: they get it after their upload).
    assert [a.child for a in out if isinstance(a, SendToChild)] == ["dev-0"]
    assert out[0].message.round == 1


def test_a_member_that_comes_back_gets_the_next_version_after_its_task_was_lost_elsewhere() -> None:
    # dev-0 got version 0 in cell-a (held), left for cell-b, came back: resend clears the held task, so version 1
    # reaches it although it never uploaded version 0 here.
    cl = cloud(k_edge=5)
    e = fedbuff.Edge(cell="cell-a", rollout="r")
    e.receive(cell_task(cl, "cell-a"), 0.0)
    e.resend("dev-0", 5.0)
    cl.receive(cell_update("cell-b", 0, [["dev-2", 0]]), 6.0)
    cl.receive(cell_update("cell-b", 1, [["dev-3", 0]]), 6.0)
    out = e.receive(cell_task(cl, "cell-a"), 7.0)
    assert "dev-0" in [a.child for a in out if isinstance(a, SendToChild)]


# --- the device -------------------------------------------------------------------------------------


def test_a_device_takes_tasks_from_the_cell_it_is_in_now_and_keeps_its_step_counter() -> None:
    d = fedbuff.Device(device_id="dev-0", cell="cell-a", rollout="r")
    task_a = DeviceTask(rollout="r", round=0, sender="cell-a", params=PARAMS, config=config().to_dict(),
                        members=("dev-0",))
    [train] = d.receive(task_a, 0.0)
    assert isinstance(train, LocalTrain) and train.step == 0
    d.trained(0, LocalResult(delta=full(0.1), num_samples=3, mean_loss=0.2, steps=1))
    d.cell = "cell-b"  # moved (a shell restarted with cell-b's config builds it so)
    with pytest.raises(UnknownSenderError):
        d.receive(task_a, 1.0)
    [train] = d.receive(DeviceTask(rollout="r", round=0, sender="cell-b", params=PARAMS, config=config().to_dict(),
                                   members=("dev-0",)), 1.0)
    assert isinstance(train, LocalTrain) and train.step == 1  # one device-step id across cells


# --- the cloud --------------------------------------------------------------------------------------


def test_the_cloud_counts_a_device_step_once_across_cells() -> None:
    # Prepare: k_cloud = 2; dev-0's step 4 went into cell-a's update 0.
    c = cloud(k_cloud=2)
    assert c.receive(cell_update("cell-a", 0, [["dev-0", 4], ["dev-1", 0]], value=1.0), 0.0) == []
    # Execute: cell-b's update repeats dev-0's step 4 (it moved while that upload was in flight).
    out = c.receive(cell_update("cell-b", 0, [["dev-0", 4], ["dev-2", 0]], value=9.0), 0.0)
    # Assert: dropped by reason, naming the device-step; never folded; counted by reason.
    assert [(a.reason, "dev-0#4" in a.detail) for a in out if isinstance(a, Dropped)] == [("duplicate_step", True)]
    assert c.rejected == {"duplicate_step": 1} and c.round == 0
    # Its cell counter is spent: the same update again is a plain duplicate.
    assert [a.reason for a in c.receive(cell_update("cell-b", 0, [["dev-0", 4]]), 0.0)] == ["duplicate"]
    # dev-0's next step through cell-b is new: folded, and the version closes with the first update only.
    closed = [a for a in c.receive(cell_update("cell-b", 1, [["dev-0", 5]], value=3.0), 0.0)
              if isinstance(a, RoundClosed)]
    assert len(closed) == 1 and closed[0].reported == {"cell-a": ("dev-0", "dev-1"), "cell-b": ("dev-0",)}
    assert closed[0].metrics["rejected_duplicate_step"] == 1
    np.testing.assert_allclose(c.params["w"], (2 * 1.0 + 1 * 3.0) / 3, rtol=1e-6)


def test_the_counted_device_steps_survive_a_restart_of_the_cloud() -> None:
    c = cloud(k_cloud=1)
    c.receive(cell_update("cell-a", 0, [["dev-0", 0], ["dev-1", 0]]), 0.0)
    state = c.strategy_state()
    assert state is not None and list(state["step/dev-0"]) == [0, 1]  # the run [0, 1)
    restarted = fedbuff.Cloud(rollout="r", cells=CELLS, initial_params=c.params, config=config(k_cloud=1),
                              rounds=10, start_round=1, model_version=1)
    restarted.load_strategy_state(state)
    restarted.start(0.0)
    out = restarted.receive(cell_update("cell-b", 0, [["dev-1", 0]], base=1), 0.0)
    assert [a.reason for a in out if isinstance(a, Dropped)] == ["duplicate_step"]


@pytest.mark.parametrize("order", [(0, 1, 3, 5, 2, 7, 6), (7, 6, 5, 3, 2, 1, 0), (3, 0, 6, 2, 7, 5, 1, 1, 6)])
def test_counted_steps_are_runs_whatever_the_order(order: tuple[int, ...]) -> None:
    counted = fedbuff.CountedSteps()
    for j in order:
        counted.add(j)
    assert [j in counted for j in range(9)] == [j in order for j in range(9)]
    assert list(counted.to_array()) == [0, 4, 5, 8]  # {0..3} and {5..7}: the gap at 4
    again = fedbuff.CountedSteps.from_array(counted.to_array())
    assert [j in again for j in range(9)] == [j in order for j in range(9)]
    big = fedbuff.CountedSteps()
    big.add(2**62)  # an absurd step costs one run, not 2**62 numbers
    assert list(big.to_array()) == [2**62, 2**62 + 1] and 5 not in big
    with pytest.raises(LocalProtocolError):
        fedbuff.CountedSteps.from_array(np.array([3, 1], np.int64))


@pytest.mark.parametrize("stats, error", [
    ({"base_version": 0, "deltas": 1}, UnexpectedMessageError),
    ({"base_version": 0, "deltas": 1, "steps": [["dev-1", 0]]}, UnexpectedMessageError),  # not its reporter
    ({"base_version": 0, "deltas": 1, "steps": [["dev-0", -1]]}, UnexpectedMessageError),
])
def test_a_roaming_cell_update_must_name_its_device_steps(stats: dict, error: type) -> None:
    c = cloud()
    with pytest.raises(error):
        c.receive(CellUpdate(rollout="r", round=0, sender="cell-a", delta=full(1.0), weight=1.0, reported=("dev-0",),
                             stats=stats), 0.0)


def test_a_cell_update_naming_a_stranger_is_refused() -> None:
    with pytest.raises(UnknownSenderError):
        cloud().receive(cell_update("cell-a", 0, [["dev-9", 0]]), 0.0)


def test_roaming_without_a_move_gives_the_simulator_the_same_model(small_rollout) -> None:
    """Nobody moves in the trace simulator: the roster, the device-step lists and the cloud's count change nothing."""
    from local_fleet.simulate import simulate

    def run(roaming: bool) -> dict[str, np.ndarray]:
        cfg = small_rollout(rounds=4, algorithm="fedbuff", topology={"roaming": roaming},
                            fedbuff={"local_steps": 3, "lr": 0.2, "batch_size": 16, "k_edge": 2, "k_cloud": 1},
                            fleet={"availability": "diurnal", "share_online": 0.5, "compute_s": 60, "day_s": 3600})
        return dict(simulate(cfg).params)

    plain, roaming = run(False), run(True)
    for name, value in plain.items():
        assert np.array_equal(value, roaming[name]), name

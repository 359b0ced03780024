"""kill -9 of a device, an edge and the coordinator in the middle of an asynchronous (FedBuff) rollout over
Mosquitto: every accepted delta is counted exactly once.

Every node is a real ``fedtier ... run`` process. With ``once_per_version``, ``k_edge`` = devices per cell and
``k_cloud`` = cells, every model version averages each device's delta from the version before exactly once, in
whatever order they arrive; so a delta lost, or folded twice after a restart (the device's outbox sent again,
the edge's replay of its stored inputs, the coordinator's replay of the updates it stored and the edges'
stored outputs published again), changes the model. The rollout must end with the model the trace simulator
computes, and the coordinator's committed rows must name every device once in every version.
"""

from __future__ import annotations

import signal
import sqlite3
import sys
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from fleet_helpers import Proc, Procs, wait_for_text

from cloud_coordinator.store import CoordinatorStore
from fedtier.runtime.config import load, read_toml
from local_fleet.simulate import simulate

pytestmark = [pytest.mark.slow, pytest.mark.broker]

VERSIONS = 14
FEDTIER = [sys.executable, "-m", "fedtier"]


def _held(db: Path) -> dict[str, int]:
    """What an edge's store holds of its rollout: inputs by kind, outputs, role states."""
    with closing(sqlite3.connect(db)) as con:
        kinds = dict(con.execute("SELECT kind, COUNT(*) FROM inputs GROUP BY kind").fetchall())
        return {"cell_tasks": kinds.pop("cell_task", 0), "deltas": sum(kinds.values()),
                "outputs": con.execute("SELECT COUNT(*) FROM outputs").fetchone()[0],
                "states": con.execute("SELECT COUNT(*) FROM strategy_states").fetchone()[0]}


def test_kill_9_of_a_device_an_edge_and_the_coordinator_counts_every_delta_once(
        mosquitto, small_rollout, tmp_path: Path) -> None:
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.configs import write_fleet

    # Prepare: 2 cells x 2 devices; one delta from every device per version.
    cfg = small_rollout(algorithm="fedbuff", rounds=VERSIONS,
                        fedbuff={"local_steps": 40, "lr": 0.1, "batch_size": 16, "k_edge": 2, "k_cloud": 2,
                                 "once_per_version": True})
    plain = cfg.to_dict()
    plain.pop("broker", None)
    plain.pop("fedavg", None)
    plain["state_dir"] = str(tmp_path / "fleet" / "coordinator")
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    procs = Procs(tmp_path)
    runs: dict[str, int] = {}

    def start(name: str, argv: list[str]) -> Proc:
        runs[name] = runs.get(name, -1) + 1
        return procs.start(f"{name}-{runs[name]}", argv)

    def edge(cell: str) -> Proc:
        return start(f"edge-{cell}", [*FEDTIER, "edge", "run", "--config", str(paths.edges[cell])])

    def agent(device: str) -> Proc:
        return start(f"agent-{device}", [*FEDTIER, "agent", "run", "--config", str(paths.devices[device])])

    def coordinator() -> Proc:
        return start("coordinator", [*FEDTIER, "coordinator", "run", "--config", str(paths.coordinator)])

    killed: list[Proc] = []

    def kill_9(proc: Proc) -> None:
        proc.send(signal.SIGKILL)
        assert proc.popen.wait(10) == -signal.SIGKILL
        procs.started.remove(proc)  # dead on purpose: not a crash for check_alive
        killed.append(proc)

    try:
        edges = {c: edge(c) for c in paths.edges}
        agents = {d: agent(d) for d in paths.devices}
        cloud = coordinator()
        # Execute: each tier is killed once while versions are being made, and restarted on its state.
        victim = sorted(agents)[1]
        wait_for_text(agents[victim], "round 2 step 2 of t: device_update sent", 120, procs)
        kill_9(agents[victim])
        agents[victim] = agent(victim)
        wait_for_text(edges["cell-a"], "closed round 5 of t", 120, procs)
        kill_9(edges["cell-a"])
        held = _held(tmp_path / "fleet" / "edges" / "cell-a" / "edge.db")
        edges["cell-a"] = edge("cell-a")
        wait_for_text(cloud, "round 8 closed", 120, procs)
        kill_9(cloud)
        cloud = coordinator()
        code = cloud.popen.wait(180)
    finally:
        procs.close()
    texts = {p.name: p.text() for p in [*procs.started, *killed]}

    # Assert: finished; every version made of each device's delta exactly once; the undisturbed model.
    assert code == 0, texts[cloud.name][-3000:]
    assert "resumed rollout t from state" in texts["edge-cell-a-1"], texts["edge-cell-a-1"][-3000:]
    assert "resuming rollout t at round" in texts["coordinator-1"], texts["coordinator-1"][-3000:]
    assert not any("Traceback" in t for t in texts.values())
    fleet_cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(fleet_cfg.state_dir / "coordinator.db")
    rows = store.rounds(fleet_cfg.rollout)
    over_mqtt = store.latest_model(fleet_cfg.rollout)
    store.close()
    assert [r["round"] for r in rows] == list(range(VERSIONS))
    # The killed edge held one buffer's inputs (at most k_edge - 1 deltas or failures) after its newest cell
    # tasks, and its newest state: not every input since the rollout began, which its restart replayed before.
    assert held["deltas"] <= 1 and 1 <= held["cell_tasks"] <= 2 and held["states"] == 1, held
    assert held["outputs"] <= 3, held  # the cell updates the cloud had not said it counted
    members: dict[str, list[str]] = {}
    for device, config in sorted(paths.devices.items()):
        members.setdefault(str(read_toml(config)["cell"]), []).append(device)
    for row in rows:
        assert {c: sorted(row["cells"][c]["reported"]) for c in members} == members, row
    simulated = simulate(RolloutConfig.from_mapping({**plain, "state_dir": str(tmp_path / "sim")}))
    assert over_mqtt is not None and over_mqtt.version == VERSIONS
    for name, value in simulated.params.items():
        np.testing.assert_allclose(over_mqtt.params[name], value, rtol=0, atol=1e-5)

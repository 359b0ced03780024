"""[aggregation] and [server_optimizer] in a rollout: validated naming the key, carried in every task,
run by the simulator, and the server optimizer's state surviving a coordinator killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from local_fleet.simulate import simulate
from fedtier.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("overrides,key,needle", [
    ({"aggregation": {"edge": "mode"}}, "aggregation.edge", "must be one of"),
    ({"aggregation": {"edgе": "median"}}, "aggregation.edgе", "unknown key"),
    ({"aggregation": {"trim": 0.5}}, "aggregation.trim", "[0, 0.5)"),
    ({"aggregation": {"edge": "krum", "byzantine": 1}}, "aggregation.byzantine", "n > 2f + 2"),
    ({"aggregation": {"cloud": "multi_krum", "byzantine": 0, "select": 3}, "topology": {"cells": 2}},
     "aggregation.byzantine", "the cloud has n = 2 cells"),
    ({"aggregation": {"cloud": "multi_krum", "byzantine": 0, "select": 4}, "topology": {"cells": 3}},
     "aggregation.select", "averages select = 4"),
    ({"aggregation": {"edge": "median", "edge_options": {"a": 1.0}}}, "aggregation.edge_options", "your own rule"),
    ({"aggregation": {"cloud": "no_such_pkg.rules:Rule"}}, "aggregation.cloud", "cannot import"),
    ({"server_optimizer": {"kind": "lamb"}}, "server_optimizer.kind", "must be one of"),
    ({"server_optimizer": {"beta1": 1.0}}, "server_optimizer.beta1", "<= 0.999"),
    ({"server_optimizer": {"lr": 0}}, "server_optimizer.lr", "> 0"),
])
def test_bad_strategy_keys_are_named(small_rollout, overrides: dict, key: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        small_rollout(**overrides)
    assert info.value.key == key and needle in str(info.value), str(info.value)


def test_rules_that_cannot_apply_are_refused_with_the_reason(small_rollout) -> None:
    with pytest.raises(ConfigError, match="hist's cloud reassembles") as info:
        small_rollout(algorithm="hist", aggregation={"cloud": "median"})
    assert info.value.key == "aggregation.cloud"
    with pytest.raises(ConfigError, match="aggregation rules and server optimizers are for"):
        small_rollout(algorithm="fedxl", server_optimizer={"kind": "adam"},
                      data={"dataset": "rare_event", "partition": "one_class"}, model={"hidden": []})
    with pytest.raises(ConfigError, match="sensitivity of the cell's mean") as info:
        small_rollout(aggregation={"edge": "median"}, privacy={"epsilon": 8.0, "clip": 1.0})
    assert info.value.key == "aggregation.edge"
    for overrides in ({"algorithm": "hist"}, {"privacy": {"epsilon": 8.0, "clip": 1.0}}):
        with pytest.raises(ConfigError) as info:
            small_rollout(edge_optimizer={"kind": "adam"}, **overrides)
        assert info.value.key == "edge_optimizer"


def test_every_task_carries_the_strategy_and_none_without_it(small_rollout) -> None:
    assert "strategy" not in small_rollout().algorithm_config().to_dict()
    cfg = small_rollout(topology={"cells": 2, "devices_per_cell": 5},
                        aggregation={"edge": "multi_krum", "byzantine": 1, "select": 2},
                        server_optimizer={"kind": "yogi", "lr": 0.02})
    strategy = cfg.algorithm_config().to_dict()["strategy"]
    assert strategy["edge"]["rule"] == "multi_krum" and strategy["edge"]["select"] == 2
    assert strategy["cloud"]["rule"] == "mean"
    assert strategy["server_optimizer"] == {"kind": "yogi", "lr": 0.02, "momentum": 0.9, "beta1": 0.9,
                                            "beta2": 0.99, "tau": 1e-3}


def test_the_simulator_runs_a_robust_edge_rule_deterministically(small_rollout) -> None:
    cfg = small_rollout(rounds=2, topology={"cells": 2, "devices_per_cell": 3}, aggregation={"edge": "median"})
    a, b = simulate(cfg), simulate(cfg)
    plain = simulate(small_rollout(rounds=2, topology={"cells": 2, "devices_per_cell": 3}))
    for name in a.params:
        assert np.array_equal(a.params[name], b.params[name])
    assert any(not np.array_equal(a.params[n], plain.params[n]) for n in a.params)
    assert a.rounds[-1]["config"]["strategy"]["edge"]["rule"] == "median"


KILLED = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.simulate import simulate
    from fedtier.runtime.config import load

    cfg = load(RolloutConfig, Path(sys.argv[1]))

    def die(row):
        if row["round"] == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean shutdown: whatever was committed is all there is

    simulate(cfg, workdir=Path(sys.argv[2]), on_round=die)
""")


def test_server_optimizer_state_survives_a_coordinator_killed_with_sigkill(small_rollout, tmp_path: Path) -> None:
    from fedtier.runtime.config import dumps_toml

    # Prepare: adam at the cloud; its moments matter from round 1 on.
    cfg = small_rollout(rounds=4, server_optimizer={"kind": "adam", "lr": 0.05})
    path = tmp_path / "rollout.toml"
    path.write_text(dumps_toml(cfg.to_dict()))
    script = tmp_path / "killed.py"
    script.write_text(KILLED)

    # Execute: a process runs the rollout and kills itself with SIGKILL right after round 1 closed.
    proc = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "run")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    resumed = simulate(cfg, workdir=tmp_path / "run")
    uninterrupted = simulate(cfg)

    # Assert: the resumed rollout (rounds 2, 3 after the kill) ends where the uninterrupted one does.
    assert [r["round"] for r in resumed.rounds] == [0, 1, 2, 3]
    for name in uninterrupted.params:
        np.testing.assert_allclose(resumed.params[name], uninterrupted.params[name], rtol=0, atol=1e-6)
    # Control: resuming with the optimizer's state lost (fresh moments) ends elsewhere.
    import sqlite3
    import shutil

    shutil.copytree(tmp_path / "run", tmp_path / "lost")
    db = sqlite3.connect(tmp_path / "lost" / "coordinator.db")
    db.execute("DELETE FROM strategy_state")
    db.execute("DELETE FROM rounds WHERE round >= 2")
    db.execute("DELETE FROM models WHERE round >= 2")
    db.execute("UPDATE rollouts SET status='running'")
    db.commit()
    db.close()
    lost = simulate(cfg, workdir=tmp_path / "lost")
    assert any(np.abs(lost.params[n] - uninterrupted.params[n]).max() > 1e-4 for n in uninterrupted.params)

"""Your own strategy: ``[aggregation] edge = "package.module:Class"`` with a class written in the test's tmp dir."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from local_fleet.simulate import simulate
from fedtier.errors import ConfigError

RULES = textwrap.dedent('''
    """Two rules written as a user would, against fedtier.algorithms.strategies.Aggregator."""
    import numpy as np


    class SmallestNorm:
        """The update with the smallest L2 norm (a crude outlier filter); ignores weights."""

        individual = True

        def aggregate(self, updates, weights):
            norms = [np.sqrt(sum(float(np.sum(np.square(t, dtype=np.float64))) for t in u.values())) for u in updates]
            best = updates[int(np.argmin(norms))]
            return {name: np.array(t, dtype=np.float32) for name, t in best.items()}


    class Smoothed:
        """The weighted mean, smoothed across rounds: s <- decay * s + (1 - decay) * mean. Keeps state."""

        individual = False

        def __init__(self, decay=0.5):
            self.decay = decay
            self.s = {}
            self.calls = 0

        def aggregate(self, updates, weights):
            total = float(sum(weights))
            out = {}
            for name in updates[0]:
                mean = sum(w * np.asarray(u[name], np.float64) for u, w in zip(updates, weights)) / total
                prev = self.s.get(name, mean)
                self.s[name] = self.decay * prev + (1 - self.decay) * mean
                out[name] = self.s[name].astype(np.float32)
            self.calls += 1
            return out

        def state(self):
            return {**{"s/" + k: v for k, v in self.s.items()}, "calls": np.array([self.calls])}

        def load_state(self, state):
            self.s = {k[2:]: np.array(v) for k, v in state.items() if k.startswith("s/")}
            self.calls = int(state["calls"][0])
''')


@pytest.fixture
def rules_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"my_rules_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / f"{name}.py").write_text(RULES)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    return name


def test_a_class_from_the_tmp_dir_aggregates_at_the_edge_and_the_cloud(small_rollout, rules_module: str,
                                                                       tmp_path: Path) -> None:
    # Prepare: the edge keeps each cell's smallest update; the cloud smooths across rounds (stateful).
    cfg = small_rollout(rounds=3, topology={"cells": 2, "devices_per_cell": 3},
                        aggregation={"edge": f"{rules_module}:SmallestNorm", "cloud": f"{rules_module}:Smoothed",
                                     "cloud_options": {"decay": 0.25}})

    # Execute
    result = simulate(cfg, workdir=tmp_path / "run")

    # Assert: it ran, its model differs from the plain means', and the cloud rule's state went to the store.
    from cloud_coordinator.store import CoordinatorStore

    plain = simulate(small_rollout(rounds=3, topology={"cells": 2, "devices_per_cell": 3}))
    assert [r["round"] for r in result.rounds] == [0, 1, 2]
    assert any(not np.array_equal(result.params[n], plain.params[n]) for n in plain.params)
    store = CoordinatorStore(tmp_path / "run" / "coordinator.db")
    state = store.strategy_state("t", 3)
    store.close()
    assert state is not None and int(state["agg/calls"][0]) == 3 and any(k.startswith("agg/s/") for k in state)


def test_the_edge_rule_is_the_users_class_and_its_state_is_kept_at_the_cloud(rules_module: str) -> None:
    import importlib

    from fedtier.algorithms import fedavg
    from fedtier.algorithms.strategies import AggregatorSpec, build

    sys_rules = importlib.import_module(rules_module)
    agg = build(AggregatorSpec(rule=f"{rules_module}:Smoothed", options={"decay": 0.5}))
    assert isinstance(agg, sys_rules.Smoothed) and agg.decay == 0.5

    # Through the roles: one cell whose devices move by 0.01, 0.02, 0.03 -> SmallestNorm keeps 0.01.
    import sys

    sys.path.insert(0, str(Path(__file__).parents[3] / "tests" / "unit" / "fedtier" / "algorithms"))
    from hierarchy import Hierarchy

    cells = {"cell-a": ("dev-0", "dev-1", "dev-2")}
    config = fedavg.FedAvgConfig(local_steps=1, strategy={"edge": {"rule": f"{rules_module}:SmallestNorm"},
                                                          "cloud": {"rule": f"{rules_module}:Smoothed",
                                                                    "options": {"decay": 0.5}}})
    h = Hierarchy(algo=fedavg, cells=cells, params={"w": np.zeros(3, np.float32)}, config=config, rounds=2)
    h.start()
    assert h.finished
    # round 0: s = 0.01 -> w = 0.01; round 1: s = 0.5 * 0.01 + 0.5 * 0.01 = 0.01 -> w = 0.02
    np.testing.assert_allclose(h.cloud.params["w"], 0.02, rtol=0, atol=1e-7)
    state = h.cloud.strategy_state()
    assert state is not None and int(state["agg/calls"][0]) == 2
    fresh = fedavg.Cloud(rollout="r", cells=cells, initial_params={"w": np.zeros(3, np.float32)}, config=config,
                         rounds=2)
    fresh.load_strategy_state(state)
    assert fresh.aggregator.calls == 2


def test_a_class_that_is_not_there_is_named(small_rollout, rules_module: str) -> None:
    with pytest.raises(ConfigError, match="has no class 'Nope'") as info:
        small_rollout(aggregation={"cloud": f"{rules_module}:Nope"})
    assert info.value.key == "aggregation.cloud"
    # An edge rule loads on the edges; the simulator's edges are here, so it refuses up front.
    with pytest.raises(ConfigError, match="SmallestNorm") as info:
        simulate(small_rollout(aggregation={"edge": f"{rules_module}:SmallestNorm", "edge_options": {"k": 1.0}}))
    assert info.value.key == "aggregation.edge"

"""fedtier.algorithms.server_opt: Reddi et al. (ICLR 2021) Algorithm 2 on a fixed pseudo-gradient sequence."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hierarchy import Hierarchy

from fedtier.algorithms import fedavg
from fedtier.algorithms.server_opt import OptimizerSpec, ServerOptimizer
from fedtier.errors import LocalProtocolError

SHAPES = {"w": (2, 3), "b": (3,)}


def sequence(seed: int = 0, steps: int = 6) -> list[dict[str, np.ndarray]]:
    gen = np.random.default_rng(seed)
    return [{k: gen.normal(scale=0.1, size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(steps)]


def reference(kind: str, x0: float, deltas: list[float], *, eta: float, mu: float = 0.9, b1: float = 0.9,
              b2: float = 0.99, tau: float = 1e-3) -> list[float]:
    """Algorithm 2 for one coordinate, written out with Python floats (the test's own reading of the paper)."""
    x, m, v = x0, 0.0, tau * tau
    out = []
    for d in deltas:
        if kind == "sgd":
            x = x + eta * d
        elif kind == "momentum":
            m = mu * m + d
            x = x + eta * m
        else:
            m = b1 * m + (1 - b1) * d
            if kind == "adagrad":
                v = v + d * d
            elif kind == "yogi":
                v = v - (1 - b2) * d * d * math.copysign(1.0, v - d * d) if v != d * d else v
            else:
                v = b2 * v + (1 - b2) * d * d
            x = x + eta * m / (math.sqrt(v) + tau)
        out.append(x)
    return out


@pytest.mark.parametrize("kind,spec", [
    ("sgd", {"lr": 0.7}), ("momentum", {"lr": 0.5, "momentum": 0.8}), ("adam", {"lr": 0.03}),
    ("yogi", {"lr": 0.05, "beta2": 0.95}), ("adagrad", {"lr": 0.02, "tau": 1e-2}), ("adam", {"beta1": 0.0}),
])
def test_each_rule_follows_algorithm_2_on_a_fixed_sequence(kind: str, spec: dict) -> None:
    # Prepare
    opt = ServerOptimizer(OptimizerSpec(kind=kind, **spec))
    s = opt.spec
    x0 = {k: np.random.default_rng(9).normal(size=sh).astype(np.float32) for k, sh in SHAPES.items()}
    deltas = sequence()

    # Execute: every step's x_{t+1}
    x, trajectory = x0, []
    for d in deltas:
        x = opt.step(x, d)
        trajectory.append(x)

    # Assert: coordinate by coordinate against the written-out rule (float32 model between steps).
    for name, shape in SHAPES.items():
        for idx in np.ndindex(shape):
            ref_x = reference(kind, float(x0[name][idx]), [float(d[name][idx]) for d in deltas], eta=s.eta,
                              mu=s.momentum, b1=s.beta1, b2=s.beta2, tau=s.tau)
            got = [float(tr[name][idx]) for tr in trajectory]
            np.testing.assert_allclose(got, ref_x, rtol=0, atol=1e-6)
    assert opt.steps == len(deltas)


def test_sgd_with_rate_one_is_fedavg_bit_for_bit() -> None:
    from fedtier.algorithms.aggregate import add

    opt = ServerOptimizer(OptimizerSpec())
    x = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    for d in sequence():
        new, expected = opt.step(x, d), add(x, d)
        assert all(np.array_equal(new[k], expected[k]) for k in x)
        x = new


@pytest.mark.parametrize("kind", ["momentum", "adam", "yogi", "adagrad"])
def test_state_saved_mid_sequence_and_loaded_into_a_new_optimizer_continues_it_exactly(kind: str) -> None:
    deltas = sequence(1)
    x = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    whole = ServerOptimizer(OptimizerSpec(kind=kind))
    xw = x
    for d in deltas:
        xw = whole.step(xw, d)
    first = ServerOptimizer(OptimizerSpec(kind=kind))
    xr = x
    for d in deltas[:3]:
        xr = first.step(xr, d)
    second = ServerOptimizer(OptimizerSpec(kind=kind))
    second.load_state(first.state())
    for d in deltas[3:]:
        xr = second.step(xr, d)
    assert all(np.array_equal(xw[k], xr[k]) for k in x)
    assert second.steps == len(deltas)


@pytest.mark.parametrize("spec,needle", [
    ({"kind": "lamb"}, "kind"), ({"lr": 0.0}, "lr"), ({"beta1": 1.0}, "beta1"), ({"tau": 0.0}, "tau"),
    ({"momentum": -0.1}, "momentum"),
])
def test_bad_specs_are_refused(spec: dict, needle: str) -> None:
    with pytest.raises(LocalProtocolError, match=needle):
        OptimizerSpec(**spec)
    with pytest.raises(LocalProtocolError, match="unknown server optimizer keys"):
        OptimizerSpec.from_dict({"kind": "adam", "epsilon": 1e-8})


def test_the_cloud_role_steps_the_optimizer_on_the_aggregated_change() -> None:
    # Two cells of one device each; devices move by 0.01 and 0.02: the mean change is 0.015 per round.
    cells = {"cell-a": ("dev-0",), "cell-b": ("dev-1",)}
    params = {"w": np.zeros((2, 2), np.float32)}
    config = fedavg.FedAvgConfig(local_steps=1, strategy={"server_optimizer": {"kind": "adam", "lr": 0.1}})
    h = Hierarchy(algo=fedavg, cells=cells, params=params, config=config, rounds=3)
    h.start()
    assert h.finished
    expected = reference("adam", 0.0, [0.015] * 3, eta=0.1)
    got = [float(c.params["w"][0, 0]) for c in h.closed]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    state = h.cloud.strategy_state()
    assert state is not None and float(state["opt/steps"][0]) == 3


def test_an_edge_optimizer_steps_each_cell_with_its_own_state_across_rounds() -> None:
    # One cell of two devices (changes 0.01, 0.02: mean 0.015); the edge steps with adam, the cloud adds.
    cells = {"cell-a": ("dev-0", "dev-1")}
    config = fedavg.FedAvgConfig(local_steps=1, strategy={"edge_optimizer": {"kind": "adam", "lr": 0.1}})
    h = Hierarchy(algo=fedavg, cells=cells, params={"w": np.zeros(3, np.float32)}, config=config, rounds=3)
    h.start()
    assert h.finished
    expected = reference("adam", 0.0, [0.015] * 3, eta=0.1)
    np.testing.assert_allclose([float(c.params["w"][0]) for c in h.closed], expected, rtol=0, atol=1e-6)
    assert h.edges["cell-a"]._edge_optimizer is not None and h.edges["cell-a"]._edge_optimizer.steps == 3


def test_an_edge_optimizer_is_refused_under_privacy_and_for_hist() -> None:
    from fedtier.algorithms import hist
    from fedtier.algorithms.common import RoundSettings
    from fedtier.errors import UnexpectedMessageError
    from fedtier.wire.messages import CellTask

    import math

    from fedtier.privacy.plan import CellPlan, NoisePlan

    privacy = NoisePlan(mode="rdp", epsilon=1.0, delta=1e-5, budget_epsilon=math.inf, clip=1.0, edge_rounds=1,
                        rounds=10, require_tls=False,
                        cells={"cell-a": CellPlan(trusted=True, members=3, device_z=0.0, edge_z=1.0)}).to_dict()
    with pytest.raises(LocalProtocolError, match="edge optimizer"):
        RoundSettings(privacy=privacy, strategy={"edge_optimizer": {"kind": "sgd"}})
    edge = hist.Edge(cell="cell-a", rollout="r")
    task = CellTask(rollout="r", round=0, sender="cloud", params={"w": np.zeros(2, np.float32)}, members=("d",),
                    config=hist.HistConfig(strategy={"edge_optimizer": {"kind": "adam"}}).to_dict())
    with pytest.raises(UnexpectedMessageError, match="hist redraws"):
        edge.receive(task, 0.0)

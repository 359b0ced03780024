"""fedtier.algorithms.strategies: each rule against a direct numpy computation of its definition,
and the rules inside the edge and cloud roles of every algorithm that sends model changes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hierarchy import Hierarchy

from fedtier.algorithms import aggregate, fedavg, hier_qsgd, hist, qhetfed, strategies
from fedtier.algorithms.common import RoundSettings
from fedtier.algorithms.strategies import AggregatorSpec, StrategyError
from fedtier.errors import LocalProtocolError, UnexpectedMessageError
from fedtier.privacy.plan import CellPlan, NoisePlan
from fedtier.training.layout import ArchSpec

SHAPES = {"w": (3, 4), "b": (4,)}


def random_updates(seed: int, n: int = 7) -> tuple[list[dict[str, np.ndarray]], list[float]]:
    gen = np.random.default_rng(seed)
    updates = [{k: gen.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(n)]
    weights = gen.uniform(0.5, 5.0, size=n).tolist()
    return updates, weights


def flat(u: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(u[k], np.float64).ravel() for k in sorted(u)])


def unflat(v: np.ndarray) -> dict[str, np.ndarray]:
    out, i = {}, 0
    for k in sorted(SHAPES):
        size = int(np.prod(SHAPES[k]))
        out[k] = v[i:i + size].reshape(SHAPES[k])
        i += size
    return out


def close(out: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(out) == set(expected)
    for k in expected:
        assert out[k].dtype == np.float32 and out[k].shape == expected[k].shape
        np.testing.assert_allclose(out[k], expected[k], rtol=0, atol=1e-6)


def run(rule: str, updates, weights, **kw) -> dict[str, np.ndarray]:
    return strategies.run(strategies.build(AggregatorSpec(rule=rule, **kw)), updates, weights)


# --- each rule against its definition ------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_is_todays_weighted_mean_bit_for_bit(seed: int) -> None:
    updates, weights = random_updates(seed)
    out = run("mean", updates, weights)
    today = aggregate.weighted_mean(list(zip(updates, weights, strict=True)))
    X = np.stack([flat(u) for u in updates])
    direct = (np.array(weights)[:, None] * X).sum(0) / sum(weights)
    for k in today:
        assert np.array_equal(out[k], today[k])
    close(out, unflat(direct))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_median_equal_weights_is_numpys_median(seed: int) -> None:
    for n in (6, 7):  # even: midpoint of the middle pair; odd: the middle value
        updates, _ = random_updates(seed, n)
        out = run("median", updates, [1.0] * n)
        close(out, unflat(np.median(np.stack([flat(u) for u in updates]), axis=0)))


def direct_weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    half = w.sum() / 2
    cum = 0.0
    for i in range(len(v)):
        cum += w[i]
        if abs(cum - half) <= 1e-12 * w.sum():
            return (v[i] + v[i + 1]) / 2
        if cum > half:
            return v[i]
    raise AssertionError


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighted_median_matches_its_definition_coordinate_by_coordinate(seed: int) -> None:
    updates, weights = random_updates(seed)
    X = np.stack([flat(u) for u in updates])
    expected = np.array([direct_weighted_median(X[:, j], np.array(weights)) for j in range(X.shape[1])])
    close(run("median", updates, weights), unflat(expected))


def test_weighted_median_a_heavy_update_wins() -> None:
    ups = [{"w": np.array([v], np.float32)} for v in (0.0, 1.0, 10.0)]
    assert run("median", ups, [1.0, 1.0, 5.0])["w"][0] == 10.0
    assert run("median", ups, [1.0, 1.0, 2.0])["w"][0] == 5.5  # cumulative weight exactly half at 1.0


@pytest.mark.parametrize("seed,trim", [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.0)])
def test_trimmed_mean_matches_its_definition(seed: int, trim: float) -> None:
    updates, weights = random_updates(seed, 10)
    X = np.stack([flat(u) for u in updates])
    w = np.array(weights)
    k = int(np.floor(trim * 10))
    expected = np.empty(X.shape[1])
    for j in range(X.shape[1]):
        order = np.argsort(X[:, j], kind="stable")[k:10 - k]
        expected[j] = (X[order, j] * w[order]).sum() / w[order].sum()
    close(run("trimmed_mean", updates, weights, trim=trim), unflat(expected))


def test_trimmed_mean_equal_weights_is_scipys_trim_mean() -> None:
    from scipy.stats import trim_mean

    updates, _ = random_updates(4, 10)
    X = np.stack([flat(u) for u in updates])
    close(run("trimmed_mean", updates, [1.0] * 10, trim=0.2), unflat(trim_mean(X, 0.2, axis=0)))


def paper_krum_scores(X: np.ndarray, f: int) -> np.ndarray:
    """Blanchard et al. 2017: s(i) = sum over the n - f - 2 closest j != i of ||V_i - V_j||^2."""
    n = len(X)
    scores = []
    for i in range(n):
        d = sorted(float(np.sum((X[i] - X[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(d[:n - f - 2]))
    return np.array(scores)


@pytest.mark.parametrize("seed,f", [(0, 1), (1, 2), (2, 3), (3, 0)])
def test_krum_picks_the_update_the_papers_score_picks(seed: int, f: int) -> None:
    # Prepare: 10 honest updates near a common point, f far away (attackers).
    gen = np.random.default_rng(seed)
    n = 10
    center = gen.normal(size=16)
    X = center + 0.1 * gen.normal(size=(n, 16))
    X[:f] = gen.normal(scale=20.0, size=(f, 16))
    updates = [unflat(x.astype(np.float32)) for x in X]
    X32 = np.stack([flat(u) for u in updates])
    scores = paper_krum_scores(X32, f)
    np.testing.assert_allclose(strategies.krum_scores(updates, f), scores, rtol=1e-9)

    out = run("krum", updates, [1.0] * n, byzantine=f)

    best = int(np.argmin(scores))
    assert best >= f  # the paper's rule does not pick an attacker here
    for k in out:
        assert np.array_equal(out[k], updates[best][k])


@pytest.mark.parametrize("seed", [0, 1])
def test_multi_krum_is_the_weighted_mean_of_the_m_best_scored(seed: int) -> None:
    updates, weights = random_updates(seed, 9)
    X = np.stack([flat(u) for u in updates])
    chosen = np.argsort(paper_krum_scores(X, 2), kind="stable")[:4]
    w = np.array(weights)[chosen]
    expected = (X[chosen] * w[:, None]).sum(0) / w.sum()
    agg = strategies.build(AggregatorSpec(rule="multi_krum", byzantine=2, select=4))
    close(strategies.run(agg, updates, weights), unflat(expected))
    assert agg.chosen == tuple(sorted(chosen.tolist()))


@pytest.mark.parametrize("seed,max_norm", [(0, 0.5), (1, 2.0), (2, 100.0)])
def test_norm_bounded_mean_matches_its_definition(seed: int, max_norm: float) -> None:
    updates, weights = random_updates(seed)
    X = np.stack([flat(u) for u in updates])
    norms = np.linalg.norm(X, axis=1)
    clipped = X * np.minimum(1.0, max_norm / norms)[:, None]
    w = np.array(weights)
    expected = (clipped * w[:, None]).sum(0) / w.sum()
    close(run("norm_bounded_mean", updates, weights, max_norm=max_norm), unflat(expected))


def test_rules_do_not_mutate_their_inputs_and_are_deterministic() -> None:
    updates, weights = random_updates(5)
    before = [{k: v.copy() for k, v in u.items()} for u in updates]
    for rule in strategies.RULES:
        a, b = run(rule, updates, weights), run(rule, updates, weights)
        for k in a:
            assert np.array_equal(a[k], b[k])
    for u, v in zip(updates, before, strict=True):
        for k in u:
            assert np.array_equal(u[k], v[k])


def test_krum_with_fewer_updates_than_its_guarantee_still_answers() -> None:
    # A quorum close may leave n <= 2f + 2: max(1, n - f - 2) neighbours, min(m, n) picks.
    updates, weights = random_updates(0, 3)
    out = run("multi_krum", updates, weights, byzantine=2, select=5)
    close(out, aggregate.weighted_mean(list(zip(updates, weights, strict=True))))
    assert set(run("krum", updates[:1], [1.0], byzantine=1)) == set(SHAPES)


# --- specs and validation -------------------------------------------------------------------------


@pytest.mark.parametrize("spec,needle", [
    ({"rule": "mode"}, "unknown aggregation rule"),
    ({"rule": "trimmed_mean", "trim": 0.5}, "trim"),
    ({"rule": "krum", "byzantine": -1}, "byzantine"),
    ({"rule": "multi_krum", "select": 0}, "select"),
    ({"rule": "norm_bounded_mean", "max_norm": 0.0}, "max_norm"),
    ({"rule": "median", "bogus": 1}, "bogus"),
    ({"rule": "median", "options": {"a": 1}}, "options"),
])
def test_bad_specs_are_refused_naming_the_key(spec: dict, needle: str) -> None:
    with pytest.raises(StrategyError, match=needle):
        AggregatorSpec.from_dict(spec)


def test_krum_refuses_a_tier_too_small_for_its_guarantee() -> None:
    AggregatorSpec(rule="krum", byzantine=2).check_fits(7, "edge")
    with pytest.raises(StrategyError, match="n > 2f \\+ 2"):
        AggregatorSpec(rule="krum", byzantine=2).check_fits(6, "edge")
    with pytest.raises(StrategyError, match="select"):
        AggregatorSpec(rule="multi_krum", byzantine=0, select=5).check_fits(4, "cloud")


def test_rules_needing_individual_updates_are_refused_where_a_tier_sees_only_sums() -> None:
    strategies.check_visibility(AggregatorSpec(rule="mean"), "edge", individual=False)
    for rule in [r for r in strategies.RULES if r != "mean"]:
        strategies.check_visibility(AggregatorSpec(rule=rule), "edge", individual=True)
        with pytest.raises(StrategyError, match="secure aggregation"):
            strategies.check_visibility(AggregatorSpec(rule=rule), "edge", individual=False)
    with pytest.raises(StrategyError, match="sum"):
        strategies.check_visibility(strategies.Median(), "edge", individual=False)


def test_a_task_without_a_strategy_is_byte_for_byte_what_it_was() -> None:
    assert "strategy" not in fedavg.FedAvgConfig().to_dict()
    with_one = fedavg.FedAvgConfig(strategy={"edge": {"rule": "median"}}).to_dict()
    assert with_one["strategy"] == {"edge": {"rule": "median"}}
    assert fedavg.FedAvgConfig.from_dict(with_one).strategy == {"edge": {"rule": "median"}}


def test_strategy_in_a_config_is_validated_and_refused_under_privacy() -> None:
    with pytest.raises(LocalProtocolError, match="unknown strategy keys"):
        RoundSettings(strategy={"edges": {}})
    with pytest.raises(LocalProtocolError, match="edge aggregator"):
        RoundSettings(strategy={"edge": {"rule": "krum", "byzantine": "1"}})
    with pytest.raises(LocalProtocolError, match="kind"):
        RoundSettings(strategy={"server_optimizer": {"kind": "lamb"}})
    privacy = NoisePlan(mode="rdp", epsilon=1.0, delta=1e-5, budget_epsilon=math.inf, clip=1.0, edge_rounds=1,
                        rounds=10, require_tls=False,
                        cells={"cell-a": CellPlan(trusted=True, members=3, device_z=0.0, edge_z=1.0)}).to_dict()
    RoundSettings(privacy=privacy, strategy={"cloud": {"rule": "median"}, "server_optimizer": {"kind": "adam"}})
    with pytest.raises(LocalProtocolError, match="sensitivity of the cell's mean"):
        RoundSettings(privacy=privacy, strategy={"edge": {"rule": "median"}})


# --- inside the roles --------------------------------------------------------------------------------

CELLS = {"cell-a": ("dev-0", "dev-1", "dev-2", "dev-3", "dev-4"), "cell-b": ("dev-5", "dev-6", "dev-7")}
PARAMS = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}


def attacked_train(params, device, round):
    """dev-0 and dev-5 send -10x an honest update; the others move by 0.01 * (i + 1)."""
    k = int(device.split("-")[-1])
    value = -1.0 if k in (0, 5) else 0.01 * (k + 1)
    return {n: np.full_like(p, value) for n, p in params.items()}


def hierarchy(algo, config, **kw) -> Hierarchy:
    h = Hierarchy(algo=algo, cells=dict(CELLS), params={k: v.copy() for k, v in PARAMS.items()}, config=config,
                  rounds=1, train=attacked_train, **kw)
    h.start()
    assert h.finished
    return h


def expected_cell(values: list[float], rule: str) -> float:
    if rule == "median":
        return float(np.median(values))
    if rule == "trimmed_mean":  # trim 0.2: one per side of 5, none of 3
        k = int(np.floor(0.2 * len(values)))
        return float(np.mean(sorted(values)[k:len(values) - k]))
    return float(np.mean(values))


@pytest.mark.parametrize("rule", ["mean", "median", "trimmed_mean"])
@pytest.mark.parametrize("algo,config", [
    (fedavg, fedavg.FedAvgConfig(local_steps=1)),
    (hier_qsgd, hier_qsgd.HierConfig(local_steps=1, edge_rounds=2, bits_device=0, bits_edge=0)),
])
def test_edge_rules_run_in_the_edges_of_fedavg_and_hier_qsgd(rule: str, algo, config) -> None:
    config = dataclasses.replace(config, strategy={"edge": {"rule": rule, "trim": 0.2}})
    h = hierarchy(algo, config)
    rounds = config.edge_rounds
    for cell, members in CELLS.items():
        values = [attacked_train(PARAMS, d, 0)["w"][0, 0] for d in members]
        update = next(m for m in h.received["cloud"] if m.sender == cell)
        np.testing.assert_allclose(update.delta["w"], rounds * expected_cell(values, rule), rtol=0, atol=1e-6)


def test_mean_edge_and_cloud_spelled_out_give_todays_model_bit_for_bit() -> None:
    plain = hierarchy(fedavg, fedavg.FedAvgConfig(local_steps=1))
    spelled = hierarchy(fedavg, fedavg.FedAvgConfig(local_steps=1, strategy={
        "edge": {"rule": "mean"}, "cloud": {"rule": "mean"}, "server_optimizer": {"kind": "sgd"}}))
    for k in PARAMS:
        assert np.array_equal(plain.cloud.params[k], spelled.cloud.params[k])


def test_cloud_rule_combines_the_cells() -> None:
    cells = {f"cell-{c}": (f"dev-{i}",) for i, c in enumerate("abcde")}
    h = Hierarchy(algo=fedavg, cells=cells, params={k: v.copy() for k, v in PARAMS.items()}, rounds=1,
                  config=fedavg.FedAvgConfig(local_steps=1, strategy={"cloud": {"rule": "median"}}),
                  train=attacked_train)
    h.start()
    # cells carry 0 -> -1.0, 1..4 -> 0.02..0.05: the median is 0.03
    np.testing.assert_allclose(h.cloud.params["w"], 0.03, rtol=0, atol=1e-7)


def test_qhetfed_model_phase_uses_the_edge_rule_and_gradients_stay_averaged() -> None:
    from numpy_model import NumpyCompute, init_params, make_data

    config = qhetfed.QHetFedConfig(tau=1, gamma=1, lr=0.1, bits_device=0, bits_edge=0, batch_size=4)
    compute = NumpyCompute(make_data([d for ds in CELLS.values() for d in ds], skew=True))
    plain = Hierarchy(algo=qhetfed, cells=dict(CELLS), params=init_params(), config=config, rounds=1,
                      compute=compute)
    robust = Hierarchy(algo=qhetfed, cells=dict(CELLS), params=init_params(), rounds=1, compute=compute,
                       config=dataclasses.replace(config, strategy={"edge": {"rule": "median"}}))
    plain.start()
    robust.start()
    # Same gradient phase (mean of gradients): the CellSteps are identical ...
    steps = [[m for m in h.received["dev-0"] if m.KIND == "cell_step"] for h in (plain, robust)]
    assert steps[0] and all(np.array_equal(a.tensors_[k], b.tensors_[k]) for a, b in zip(*steps, strict=True)
                            for k in a.tensors_)
    # ... and the model phase differs (median of the local changes).
    assert any(not np.array_equal(plain.cloud.params[k], robust.cloud.params[k]) for k in plain.cloud.params)


def test_hist_edges_use_the_rule_on_submodels_and_its_cloud_refuses_a_vote() -> None:
    arch = ArchSpec("mlp", {"sizes": [3, 8, 2]})
    gen = np.random.default_rng(0)
    params = {"fc0.weight": gen.normal(size=(8, 3)).astype(np.float32), "fc0.bias": np.zeros(8, np.float32),
              "fc1.weight": gen.normal(size=(2, 8)).astype(np.float32), "fc1.bias": np.zeros(2, np.float32)}
    config = hist.HistConfig(local_steps=1, edge_rounds=1, strategy={"edge": {"rule": "median"}})
    h = Hierarchy(algo=hist, cells=dict(CELLS), params=params, config=config, rounds=1, train=attacked_train,
                  cloud_kwargs={"arch": arch})
    h.start()
    assert h.finished
    for cell, members in CELLS.items():
        values = [attacked_train(PARAMS, d, 0)["w"][0, 0] for d in members]
        update = next(m for m in h.received["cloud"] if m.sender == cell)
        for t in update.delta.values():  # every tensor of the cell's submodel moved by the median
            np.testing.assert_allclose(t, np.median(values), rtol=0, atol=1e-7)
    with pytest.raises(StrategyError, match="nothing for a 'median' rule"):
        hist.Cloud(rollout="r", cells=dict(CELLS), initial_params=params, rounds=1, arch=arch,
                   config=dataclasses.replace(config, strategy={"cloud": {"rule": "median"}}))


def test_an_unknown_custom_rule_in_a_task_is_a_remote_error_at_the_edge() -> None:
    config = fedavg.FedAvgConfig(local_steps=1, strategy={"edge": {"rule": "no_such_pkg.mod:Rule"}})
    with pytest.raises(UnexpectedMessageError, match="cannot import"):
        hierarchy(fedavg, config)

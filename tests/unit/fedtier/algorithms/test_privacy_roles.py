"""M2FDP in the roles: clip -> noise -> quantize on every uplink, audited end to end.

Digest §8 checks 2-6 and 10, with the §3.4 worked example's numbers (paper mode: alpha 1,
q 0.05, K 20, T 100, epsilon 1, delta 1e-5, clip 0.2 so that Delta_dev = 2C = 0.4):
sigma_dev = 3.034854 and sigma_edge = sigma_dev / 5 = 0.606971. M = 8000 coordinates, so a
sample std has a relative standard error of about 0.8% and the 3% tolerance is ~4 SE.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np
import pytest
from hierarchy import Hierarchy
from scipy import stats

from cloud_coordinator.privacy.accountant import paper_noise_multiplier
from fedtier.algorithms import fedavg, hier_qsgd
from fedtier.algorithms.base import RoleState
from fedtier.errors import MissingReleaseError
from fedtier.privacy.plan import CellPlan, NoisePlan
from fedtier.wire import messages

Z = paper_noise_multiplier(alpha=1.0, sampling_rate=0.05, steps_per_round=20, rounds=100, epsilon=1.0, delta=1e-5)
CLIP = 0.2
SIGMA_DEV = Z * 2 * CLIP
SIGMA_EDGE = SIGMA_DEV / 5
SHAPE = (100, 80)  # M = 8000


def test_the_worked_example_numbers() -> None:
    assert SIGMA_DEV == pytest.approx(3.034854, abs=1e-6)
    assert SIGMA_EDGE == pytest.approx(0.606971, abs=1e-6)


def plan(trusted: Mapping[str, bool], members: Mapping[str, int], *, edge_rounds: int = 1,
         mode: str = "paper") -> dict[str, Any]:
    cells = {c: CellPlan(trusted=t, members=members[c], device_z=0.0 if t else Z, edge_z=Z if t else 0.0)
             for c, t in trusted.items()}
    return NoisePlan(mode=mode, epsilon=1.0, delta=1e-5, budget_epsilon=math.inf, clip=CLIP, edge_rounds=edge_rounds,
                     rounds=100, require_tls=False, cells=cells).to_dict()


def small_delta(device: str) -> dict[str, np.ndarray]:
    """A device's clean update: distinct per device, norm 0.1 < C (not clipped)."""
    rng = np.random.default_rng(sum(map(ord, device)))
    d = rng.normal(size=SHAPE)
    return {"w": (0.1 * d / np.linalg.norm(d)).astype(np.float32)}


def hierarchy(cells: dict[str, tuple[str, ...]], trusted: Mapping[str, bool], *, edge_rounds: int = 1,
              bits_device: int = 0, train: Any = None, seed: int = 3, mode: str = "paper") -> Hierarchy:
    privacy = plan(trusted, {c: len(m) for c, m in cells.items()}, edge_rounds=edge_rounds, mode=mode)
    config = hier_qsgd.HierConfig(local_steps=1, edge_rounds=edge_rounds, bits_device=bits_device, lr=0.0,
                                  privacy=privacy)
    return Hierarchy(algo=hier_qsgd, cells=cells, params={"w": np.zeros(SHAPE, np.float32)}, config=config,
                     rounds=1, train=train or (lambda p, d, r: small_delta(d)), noise_seed=seed)


def uploads(h: Hierarchy, cell: str) -> list[messages.DeviceUpdate]:
    return [m for m in h.received[cell] if isinstance(m, messages.DeviceUpdate)]


def test_a_device_under_an_untrusted_edge_adds_the_planned_noise() -> None:
    h = hierarchy({"edge-b": ("b0",)}, {"edge-b": False})
    h.run()
    (update,) = uploads(h, "edge-b")
    noise = (update.delta["w"].astype(np.float64) - small_delta("b0")["w"]).ravel()
    assert abs(noise.mean()) < 4 * SIGMA_DEV / math.sqrt(noise.size)
    assert noise.std() == pytest.approx(SIGMA_DEV, rel=0.03)
    assert stats.kstest(noise / SIGMA_DEV, "norm").pvalue > 0.01
    assert update.release is not None and update.release["z"] == pytest.approx(Z)
    assert update.release["sigma"] == pytest.approx(SIGMA_DEV) and update.release["protected"] == ["b0"]
    assert update.train_loss == 0.0  # no data-dependent loss to an untrusted edge


def test_a_device_under_a_trusted_edge_sends_its_clean_update_bit_for_bit() -> None:
    h = hierarchy({"edge-a": ("a0",)}, {"edge-a": True})
    h.run()
    (update,) = uploads(h, "edge-a")
    assert update.release is None
    np.testing.assert_array_equal(update.delta["w"], small_delta("a0")["w"])


def test_every_upload_is_clipped_to_c_first() -> None:
    big = {"w": np.full(SHAPE, 0.05, np.float32)}  # norm 4.47 > C
    h = hierarchy({"edge-a": ("a0",)}, {"edge-a": True}, train=lambda p, d, r: big)
    h.run()
    (update,) = uploads(h, "edge-a")
    assert float(np.linalg.norm(update.delta["w"])) == pytest.approx(CLIP, rel=1e-6)
    np.testing.assert_allclose(update.delta["w"], big["w"] * (CLIP / np.linalg.norm(big["w"])), rtol=1e-6)


def test_quantization_comes_after_the_noise() -> None:
    # Every published value lies on the QSGD grid (a multiple of ||x|| / s) of the *noised* tensor.
    h = hierarchy({"edge-b": ("b0",)}, {"edge-b": False}, bits_device=4)
    h.run()
    (update,) = uploads(h, "edge-b")
    values = np.abs(update.delta["w"].astype(np.float64))
    unit = values[values > 0].min()  # level 1 (with 8000 noisy coordinates, some land there)
    np.testing.assert_allclose(values / unit, np.round(values / unit), atol=1e-3)
    assert np.round(values / unit).max() <= 2 ** (4 - 1) - 1  # s = 7 levels at 4 bits
    # The grid's unit is ||noised|| / s, about sigma sqrt(M) / 7: the clean delta (norm 0.1) alone is far smaller.
    assert unit * 7 == pytest.approx(SIGMA_DEV * math.sqrt(values.size), rel=0.05)


def test_a_trusted_edge_adds_sigma_dev_over_s_to_the_exact_mean() -> None:
    cells = {"edge-a": tuple(f"a{i}" for i in range(5))}
    h = hierarchy(cells, {"edge-a": True})
    h.run()
    inputs = uploads(h, "edge-a")
    exact = np.mean([u.delta["w"].astype(np.float64) for u in inputs], axis=0)
    (cell_update,) = [m for m in h.received["cloud"] if isinstance(m, messages.CellUpdate)]
    noise = (cell_update.delta["w"].astype(np.float64) - exact).ravel()
    assert noise.std() == pytest.approx(SIGMA_EDGE, rel=0.03)
    report = cell_update.privacy
    assert report is not None and report["trusted"] is True
    (release,) = report["releases"]
    assert release["node"] == "edge-a" and release["event"] == "edge"
    assert release["sigma"] == pytest.approx(SIGMA_EDGE) and release["protected"] == sorted(cells["edge-a"])
    assert sorted(c["sender"] for c in report["clear"]) == sorted(cells["edge-a"])
    assert cell_update.mean_loss == 0.0  # nothing data-dependent in clear to the cloud


def test_an_untrusted_edge_forwards_the_exact_mean_and_adds_nothing() -> None:
    cells = {"edge-b": tuple(f"b{i}" for i in range(5))}
    h = hierarchy(cells, {"edge-b": False})
    h.run()
    inputs = uploads(h, "edge-b")
    exact = np.mean([u.delta["w"] for u in inputs], axis=0)
    (cell_update,) = [m for m in h.received["cloud"] if isinstance(m, messages.CellUpdate)]
    np.testing.assert_allclose(cell_update.delta["w"], exact, rtol=0, atol=1e-6)
    report = cell_update.privacy
    assert report is not None and all(r["event"] == "device" for r in report["releases"])
    assert sorted(r["node"] for r in report["releases"]) == sorted(cells["edge-b"])  # no fresh edge noise


def test_with_several_edge_rounds_each_is_a_device_release() -> None:
    cells = {"edge-b": ("b0", "b1")}
    h = hierarchy(cells, {"edge-b": False}, edge_rounds=3)
    h.run()
    assert sorted((u.sender, u.step) for u in uploads(h, "edge-b")) == [(d, i) for d in cells["edge-b"]
                                                                        for i in range(3)]
    assert all(u.release is not None and u.release["step"] == u.step for u in uploads(h, "edge-b"))
    (cell_update,) = [m for m in h.received["cloud"] if isinstance(m, messages.CellUpdate)]
    assert cell_update.privacy is not None and len(cell_update.privacy["releases"]) == 6


def test_rdp_mode_inflates_a_synced_trusted_cells_sensitivity() -> None:
    # tau = 3 edge rounds inside a trusted cell of 2: 2C (1/2 + 2), not the paper's 2C / 2.
    cells = {"edge-a": ("a0", "a1")}
    h = hierarchy(cells, {"edge-a": True}, edge_rounds=3, mode="rdp")
    h.run()
    (cell_update,) = [m for m in h.received["cloud"] if isinstance(m, messages.CellUpdate)]
    (release,) = cell_update.privacy["releases"]  # type: ignore[index]
    assert release["sensitivity"] == pytest.approx(2 * CLIP * (0.5 + 2))


def test_paper_mode_adds_the_papers_noise_but_charges_the_sound_sensitivity() -> None:
    # Issue 17 A2: 4 devices, tau = 2. The paper's calibration adds sigma = z 2C/4; what a replaced record can move
    # the cell's change by is 2C (1/4 + 1) (after the sync every member's update depends on it), so the release
    # is charged the multiplier sigma / (2C (1/4 + 1)) = z / 5, not z.
    cells = {"edge-a": ("a0", "a1", "a2", "a3")}
    h = hierarchy(cells, {"edge-a": True}, edge_rounds=2, mode="paper")
    h.run()
    (cell_update,) = [m for m in h.received["cloud"] if isinstance(m, messages.CellUpdate)]
    (release,) = cell_update.privacy["releases"]  # type: ignore[index]
    assert release["sigma"] == pytest.approx(Z * 2 * CLIP / 4, rel=1e-12)
    assert release["sensitivity"] == pytest.approx(2 * CLIP * (1 / 4 + 1), rel=1e-12)
    assert release["z"] == pytest.approx(Z / 5, rel=1e-12)
    assert release["inputs"]["calibrated_sensitivity"] == pytest.approx(2 * CLIP / 4, rel=1e-12)


def test_the_cloud_refuses_a_trusted_release_that_claims_the_papers_sensitivity() -> None:
    # A record charging 2C/n for a synced cell under-reports epsilon: the audit refuses it.
    from fedtier.privacy import audit
    from fedtier.privacy.plan import NoisePlan

    noise_plan = NoisePlan.from_dict(plan({"edge-a": True}, {"edge-a": 2}, edge_rounds=2))
    sigma = noise_plan.edge_sigma("edge-a", 2)
    record = audit.release_record(plan=noise_plan, node="edge-a", event="edge", round=0, step=0, sigma=sigma,
                                  sensitivity=2 * CLIP / 2, protected=["a0", "a1"], reporters=2)
    report = {"trusted": True, "steps": [["a0", "a1"], ["a0", "a1"]], "releases": [record], "clear": []}
    with pytest.raises(MissingReleaseError, match="sensitivity"):
        audit.check_cell_update(noise_plan, "edge-a", 0, report, ["a0", "a1"])


@pytest.mark.parametrize("p_trusted", [0.0, 0.5, 1.0])
def test_learning_rate_zero_global_noise_variance_matches_the_formula(p_trusted: float) -> None:
    # §2.3 / §8 check 6: Var = (1/N1) [p sigma_edge^2 + (1-p) n_ev sigma_dev^2 / s1], N1 = 10, s1 = 5,
    # n_ev = 1: 0.184207 / 0.110524 / 0.036841 for p = 0 / 0.5 / 1.
    cells = {f"edge-{i}": tuple(f"d{i}-{j}" for j in range(5)) for i in range(10)}
    trusted = {c: i < round(p_trusted * 10) for i, c in enumerate(cells)}
    h = hierarchy(cells, trusted, train=lambda p, d, r: {"w": np.zeros(SHAPE, np.float32)})
    h.run()
    update = h.closed[0].params["w"].astype(np.float64)
    expected = (p_trusted * SIGMA_EDGE ** 2 + (1 - p_trusted) * SIGMA_DEV ** 2 / 5) / 10
    assert expected == pytest.approx({0.0: 0.184207, 0.5: 0.110524, 1.0: 0.036841}[p_trusted], abs=2e-6)
    assert update.var() == pytest.approx(expected, rel=0.05)


def test_with_intra_round_syncs_the_variance_counts_every_untrusted_event() -> None:
    # n_ev = 4 untrusted-side events per round: device noise accumulates in the cell's change.
    cells = {f"edge-{i}": tuple(f"d{i}-{j}" for j in range(5)) for i in range(10)}
    trusted = {c: i < 5 for i, c in enumerate(cells)}
    h = hierarchy(cells, trusted, edge_rounds=4, train=lambda p, d, r: {"w": np.zeros(SHAPE, np.float32)})
    h.run()
    expected = (0.5 * SIGMA_EDGE ** 2 + 0.5 * 4 * SIGMA_DEV ** 2 / 5) / 10
    assert h.closed[0].params["w"].astype(np.float64).var() == pytest.approx(expected, rel=0.05)


# --- one release per (round, step) -----------------------------------------------------------------


def _desync(h: Hierarchy, device: str, cell: str, step: int) -> None:
    """The edge's average of ``step`` does not match ``device``'s model: it leaves the round (IDLE)."""
    wrong = messages.CellStep(rollout="r", round=0, sender=cell, step=step, tensors_={"w": np.zeros(SHAPE, np.float32)},
                              kind="delta", model_sha="0" * 64, reported=(device,))
    h.deliver_to_device(device, wrong)


def test_a_repeated_step_task_with_another_model_is_not_released_again() -> None:
    # Issue 17 A3: b0 uploads step 0, leaves the round on a desync, and the edge repeats step 0's task with a
    # different model. Training and uploading again would be a second release of step 0 that the ledger never
    # charges (and, with noise keyed by (rollout, device, round, step), the same noise: the two uploads'
    # difference would be the clean difference). The device takes the model and waits for the cell's average.
    cells = {"edge-b": ("b0", "b1")}
    h = hierarchy(cells, {"edge-b": False}, edge_rounds=2, train=lambda p, d, r: {
        "w": (small_delta(d)["w"] + 0.01 * p["w"]).astype(np.float32)})  # the delta depends on the model
    h.devices["b1"].receive = lambda msg, now: []  # type: ignore[method-assign]  # b1 silent: step 0 stays open
    h.start()
    assert [(u.sender, u.step) for u in uploads(h, "edge-b")] == [("b0", 0)]
    _desync(h, "b0", "edge-b", 0)
    other = {"w": np.full(SHAPE, 0.5, np.float32)}
    h.deliver_to_device("b0", dataclasses.replace(h.edges["edge-b"]._device_task(), params=other))
    assert [(u.sender, u.step) for u in uploads(h, "edge-b")] == [("b0", 0)]
    assert h.devices["b0"].state is RoleState.WAITING  # holding the task's model, for the cell's average


def test_a_device_that_left_a_round_still_trains_the_steps_it_has_not_released() -> None:
    # The guard is per (round, step): b0 misses step 0's average (desync), and the edge's catch-up task at step 1
    # is new work — b0 trains and uploads it, and the round closes.
    cells = {"edge-b": ("b0", "b1")}
    h = hierarchy(cells, {"edge-b": False}, edge_rounds=2)

    def lose_b0(cell: str, step: messages.CellStep) -> None:
        if "b0" not in h.offline:
            h.offline.add("b0")
            _desync(h, "b0", cell, step.step)

    h.on_step = lose_b0
    h.start()
    assert h.closed == [] and h.devices["b0"].state is RoleState.IDLE
    h.reconnect("b0")
    assert [(u.sender, u.step) for u in uploads(h, "edge-b") if u.sender == "b0"] == [("b0", 0), ("b0", 1)]
    assert len(h.closed) == 1 and h.closed[0].missing == ()


def test_a_noise_stream_is_never_drawn_twice() -> None:
    # Defence in depth behind the roles' guard: the same (rollout, node, round, step) twice would be the same noise.
    from fedtier.errors import PrivacyViolationError
    from fedtier.privacy.mechanism import NoiseSource

    source = NoiseSource(7)
    tensors = {"w": np.zeros(SHAPE, np.float32)}
    first = source.add(tensors, 1.0, "dp", "r", "b0", 0, 0)
    second = source.add({"w": np.ones(SHAPE, np.float32)}, 1.0, "dp", "r", "b0", 0, 1)
    assert not np.array_equal(first["w"], second["w"] - 1.0)
    with pytest.raises(PrivacyViolationError, match="already"):
        source.add({"w": np.ones(SHAPE, np.float32)}, 1.0, "dp", "r", "b0", 0, 0)


# --- audits --------------------------------------------------------------------------------------


def _task_hierarchy(trusted: bool) -> Hierarchy:
    h = hierarchy({"edge-x": ("x0", "x1")}, {"edge-x": trusted})
    h.devices["x1"].receive = lambda msg, now: []  # type: ignore[method-assign]  # x1 stays silent
    h.start()
    return h


def test_an_untrusted_edge_refuses_an_update_without_its_noise_record() -> None:
    h = _task_hierarchy(trusted=False)
    edge = h.edges["edge-x"]
    clear = messages.DeviceUpdate(rollout="r", round=0, sender="x1", delta=small_delta("x1"), num_samples=10)
    with pytest.raises(MissingReleaseError):
        edge.receive(clear, 0.0)
    weak = messages.DeviceUpdate(rollout="r", round=0, sender="x1", delta=small_delta("x1"), num_samples=10,
                                 release={"node": "x1", "event": "device", "round": 0, "step": 0, "z": Z / 2})
    with pytest.raises(MissingReleaseError, match="below the planned"):
        edge.receive(weak, 0.0)
    assert edge.reported == ("x0",)  # nothing was accepted


def test_the_cloud_refuses_a_cell_update_whose_noise_is_not_on_record() -> None:
    h = hierarchy({"edge-a": ("a0",), "edge-b": ("b0",)}, {"edge-a": True, "edge-b": False})
    h.offline = {"a0", "b0"}  # the round stays open: the updates below are the only ones
    h.start()
    cloud = h.cloud
    delta = {"w": np.zeros(SHAPE, np.float32)}
    bare = messages.CellUpdate(rollout="r", round=0, sender="edge-a", delta=delta, weight=1.0, reported=("a0",))
    with pytest.raises(MissingReleaseError, match="no privacy report"):
        cloud.receive(bare, 0.0)
    no_edge_noise = messages.CellUpdate(rollout="r", round=0, sender="edge-a", delta=delta, weight=1.0,
                                        reported=("a0",), privacy={"trusted": True, "steps": [["a0"]],
                                                                   "releases": [], "clear": []})
    with pytest.raises(MissingReleaseError, match="without exactly one noise release"):
        cloud.receive(no_edge_noise, 0.0)
    missing_device = messages.CellUpdate(rollout="r", round=0, sender="edge-b", delta=delta, weight=1.0,
                                         reported=("b0",), privacy={"trusted": False, "steps": [["b0"]],
                                                                    "releases": [], "clear": []})
    with pytest.raises(MissingReleaseError, match="b0"):
        cloud.receive(missing_device, 0.0)


def test_without_a_plan_nothing_changes() -> None:
    config = fedavg.FedAvgConfig(local_steps=1, lr=0.0)
    h = Hierarchy(algo=fedavg, cells={"c": ("d0",)}, params={"w": np.zeros((3,), np.float32)}, config=config,
                  rounds=1, train=lambda p, d, r: {"w": np.full(3, 7.0, np.float32)})
    h.run()
    (update,) = uploads(h, "c")
    assert update.release is None and update.train_loss == 1.0
    np.testing.assert_array_equal(update.delta["w"], np.full(3, 7.0, np.float32))  # no clipping either


# --- device sampling at a trusted edge (issue 17 Part B.1) ------------------------------------------


def sampled_hierarchy(members: int, q: float, rounds: int) -> Hierarchy:
    cells = {"edge-a": tuple(f"a{i}" for i in range(members))}
    privacy = NoisePlan(mode="rdp", epsilon=1.0, delta=1e-5, budget_epsilon=math.inf, clip=CLIP, edge_rounds=1,
                        rounds=100, require_tls=False,
                        cells={"edge-a": CellPlan(trusted=True, members=members, device_z=0.0, edge_z=Z)},
                        sampling="poisson", sample_rate=q).to_dict()
    config = hier_qsgd.HierConfig(local_steps=1, edge_rounds=1, lr=0.0, privacy=privacy)
    return Hierarchy(algo=hier_qsgd, cells=cells, params={"w": np.zeros(SHAPE, np.float32)}, config=config,
                     rounds=rounds, train=lambda p, d, r: small_delta(d), noise_seed=5)


def test_a_sampling_trusted_edge_samples_in_secret_and_releases_a_fixed_denominator_sum() -> None:
    members, q, rounds = 8, 0.5, 6
    h = sampled_hierarchy(members, q, rounds)
    h.run()
    assert h.finished
    everyone = tuple(f"a{i}" for i in range(members))
    by_round: dict[int, list[str]] = {}
    for u in uploads(h, "edge-a"):
        by_round.setdefault(u.round, []).append(u.sender)
    sizes = [len(by_round.get(r, [])) for r in range(rounds)]
    assert 0 < sum(sizes) < members * rounds and len(set(sizes)) > 1  # a sample, drawn afresh each round
    sigma = Z * CLIP / (q * members)  # z C / (q n), whoever was sampled
    cell_updates = [m for m in h.received["cloud"] if isinstance(m, messages.CellUpdate)]
    assert len(cell_updates) == rounds
    for cu in cell_updates:
        # participation stays inside the cell: the cloud sees every member, the cell's size, one fixed sigma
        assert cu.reported == everyone and cu.weight == members
        assert cu.privacy["steps"] == [list(everyone)] and cu.privacy["clear"] == []
        (record,) = cu.privacy["releases"]
        assert record["sigma"] == pytest.approx(sigma) and record["protected"] == list(everyone)
        assert record["inputs"]["sample_rate"] == q and record["inputs"]["reporters"] == members
        sampled = sorted(by_round.get(cu.round, []))
        total = sum((small_delta(d)["w"].astype(np.float64) for d in sampled), np.zeros(SHAPE))
        noise = cu.delta["w"].astype(np.float64) - total / (q * members)  # the fixed denominator
        assert noise.std() == pytest.approx(sigma, rel=0.03)


def test_an_empty_sample_still_releases_noise() -> None:
    h = sampled_hierarchy(2, 0.1, 6)
    h.run()
    assert h.finished
    uploaded = {u.round for u in uploads(h, "edge-a")}
    cell_updates = [m for m in h.received["cloud"] if isinstance(m, messages.CellUpdate)]
    empty = [cu for cu in cell_updates if cu.round not in uploaded]
    assert empty  # some round sampled nobody...
    for cu in empty:  # ...and its release looks like any other: noise at the planned sigma, every member listed
        assert cu.reported == ("a0", "a1") and cu.weight == 2
        assert cu.delta["w"].std() == pytest.approx(Z * CLIP / (0.1 * 2), rel=0.03)

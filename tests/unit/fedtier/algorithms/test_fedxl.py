"""FeDXL roles: the contract, the pool-collecting round, staleness and provenance, payloads, exact hierarchical
aggregation, the momentum, partial participation, and bad score lists (the digest's checks 5, 6, 7, 10, 11).

Devices run their X-risk steps with the agent shell's own methods on a real onnxruntime-training trainer
(``xrisk_support.ShellCompute``); every message goes through the wire codec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from typing import Any

import msgpack

import numpy as np
import pytest
from role_contract import RoleContract
from xrisk_support import QueuedHierarchy, ShellCompute, cells_of, gaussian_devices, linear_scores, shared_trainer

from fedtier.algorithms import fedxl
from fedtier.algorithms.base import RoundClosed
from fedtier.algorithms.fedxl import FedXLConfig, PassivePool
from fedtier.errors import (
    LayoutMismatchError,
    NonFiniteTensorError,
    ScoreListError,
    StaleScoresError,
    UnexpectedMessageError,
)
from fedtier import wire
from fedtier.wire import messages
from fedtier.wire.messages import (
    MOMENTUM_PREFIX,
    NEG_SCORES,
    POS_SCORES,
    POS_U,
    ScorePool,
    XRiskCellUpdate,
    XRiskDeviceTask,
    XRiskDeviceUpdate,
)

FEATURES = 6
DATA = gaussian_devices([40, 40, 40, 40, 40], [0.3, 1.0, 0.0, 0.5, 0.2], features=FEATURES, seed=3)
DEVICES = sorted(DATA)
CELLS = {"cell-a": ("dev-00", "dev-01", "dev-02"), "cell-b": ("dev-03", "dev-04")}


@pytest.fixture(scope="module")
def trainer(artifact_store: Any) -> Any:
    return shared_trainer(artifact_store, FEATURES)


@pytest.fixture(scope="module")
def init(trainer: Any) -> dict[str, np.ndarray]:
    return trainer.get_parameters()


def config(**overrides: Any) -> FedXLConfig:
    base: dict[str, Any] = {"objective": "auroc", "local_steps": 3, "batch_size": 2, "batch_neg": 4, "lr": 0.5,
                            "seed": 11}
    return FedXLConfig(**{**base, **overrides})


def make(trainer: Any, params: dict[str, np.ndarray], *, rounds: int = 3, cells: dict | None = None,
         record: bool = False, **overrides: Any) -> QueuedHierarchy:
    compute = ShellCompute(trainer, DATA)
    compute.record = record
    return QueuedHierarchy(algo=fedxl, cells=dict(cells or CELLS), params=dict(params), config=config(**overrides),
                           rounds=rounds, compute=compute)


def uploads(h: QueuedHierarchy) -> list[XRiskDeviceUpdate]:
    return [m for c in h.cells for m in h.received[c] if isinstance(m, XRiskDeviceUpdate)]


def tasks(h: QueuedHierarchy, device: str) -> list[XRiskDeviceTask]:
    return [m for m in h.received[device] if isinstance(m, XRiskDeviceTask)]


class TestFedXLContract(RoleContract):
    @pytest.fixture(autouse=True)
    def _trainer(self, trainer: Any, init: dict[str, np.ndarray]) -> None:
        self._t, self._init = trainer, init

    def hierarchy(self, **kwargs: Any) -> QueuedHierarchy:
        rounds = kwargs.pop("rounds", 3)
        return make(self._t, self._init, rounds=rounds, **kwargs)

    def device_update(self, h: Any, device: str, round: int, scale: float = 1.0,
                      tensors: dict | None = None) -> messages.Message:
        # An update without scores: allowed (a device may have nothing to add to the pool).
        return XRiskDeviceUpdate(rollout="r", round=round, sender=device, step=0,
                                 delta=tensors or {n: np.full_like(p, scale) for n, p in h.params.items()},
                                 num_samples=10, train_loss=0.5, steps=1,
                                 scores=ScorePool(round=round, sources=((device, 0, 0),)))

    def cell_update(self, h: Any, cell: str, round: int) -> messages.Message:
        return XRiskCellUpdate(rollout="r", round=round, sender=cell,
                               delta={n: np.zeros_like(p) for n, p in h.params.items()}, weight=1.0,
                               scores=ScorePool(round=round))


# --- rounds -------------------------------------------------------------------------------------------------


def test_round_0_collects_the_first_pool_and_training_starts_in_round_1(trainer: Any, init: dict) -> None:
    h = make(trainer, init, rounds=2)
    h.run()
    first, second = h.closed
    for name, value in init.items():
        np.testing.assert_array_equal(first.params[name], value)  # round 0: scores only, no change
    assert any(not np.array_equal(second.params[n], init[n]) for n in init)
    c = h.config
    round0 = [u for u in uploads(h) if u.round == 0]
    assert all(u.steps == 0 for u in round0)
    # Every device scored K B1 positives and K B2 negatives of what it holds (dev-01 has no negative, dev-02 no
    # positive).
    counts = {u.sender: (len(u.scores.pos), len(u.scores.neg)) for u in round0}
    assert counts == {"dev-00": (6, 12), "dev-01": (6, 0), "dev-02": (0, 12), "dev-03": (6, 12), "dev-04": (6, 12)}
    assert c.local_steps * c.b1 == 6 and c.local_steps * c.b2 == 12


def test_staleness_and_provenance_over_five_rounds(trainer: Any, init: dict) -> None:
    """Digest check 5: what a device consumes in round r is exactly what was computed in round r - 1."""
    h = make(trainer, init, rounds=5, objective="pauc", record=True)
    h.run()
    by_round: dict[int, list[XRiskDeviceUpdate]] = {}
    for u in uploads(h):
        by_round.setdefault(u.round, []).append(u)
    for device in DEVICES:
        for task in tasks(h, device):
            if task.round == 0:
                assert task.pool.round == -1 and len(task.pool.pos) == len(task.pool.neg) == 0
                continue
            # The pool of round r: round r - 1's uploads, concatenated by cell and device, nothing of round r.
            assert task.pool.round == task.round - 1
            previous = sorted(by_round[task.round - 1], key=lambda u: u.sender)
            expected = fedxl.merge([u.scores for u in previous], task.round - 1)
            assert task.pool == expected
    # Active scores come from the current local model: every uploaded positive score of step k is
    # sigmoid(model at step k) on the rows drawn at step k.
    c = h.config
    for u in uploads(h):
        if u.round == 0 or not len(u.scores.pos):
            continue
        steps = [(k, p) for d, r, k, p in h.compute.scored_at if d == u.sender and r == u.round]
        assert [k for k, _ in steps] == list(range(c.local_steps))
        for k, params in steps:
            from fedtier.algorithms.base import ScoreRows
            from fedtier.rng import stream
            from fedtier.training.batching import class_rows

            action = ScoreRows(round=u.round, step=k, params=params, per_class={1: c.b1, 0: c.b2},
                               stream=(c.seed, "xrisk-rows", "r", u.sender, u.round, k))
            rows = class_rows(DATA[u.sender][1], dict(action.per_class), stream(*action.stream))[1]
            np.testing.assert_allclose(u.scores.pos[k * c.b1:(k + 1) * c.b1],
                                       linear_scores(params, DATA[u.sender][0][rows]), rtol=0, atol=2e-6)
        # Step 0 scores with the round's global model, later steps with the locally updated one.
        task = next(t for t in tasks(h, u.sender) if t.round == u.round)
        assert all(np.array_equal(steps[0][1][n], task.params[n]) for n in task.params)
        assert any(not np.array_equal(steps[-1][1][n], task.params[n]) for n in task.params)


def test_a_device_refuses_a_pool_of_another_round(trainer: Any, init: dict) -> None:
    h = make(trainer, init, rounds=3)
    h.run()
    task = tasks(h, "dev-00")[2]
    device = fedxl.Device(device_id="dev-00", cell="cell-a", rollout="r")
    for stale in (task.round - 2, task.round):  # two rounds old; or this round's own (not computed yet)
        with pytest.raises(StaleScoresError):
            device.receive(dataclasses.replace(task, pool=dataclasses.replace(task.pool, round=stale)), 0.0)
    assert device.receive(task, 0.0)  # the right pool starts the round


def test_passive_pairs_keep_their_source_after_shuffling() -> None:
    """Digest check 5: each passive u is used with the score of its own source sample; the buffer is drawn
    without replacement until it is used up, then again."""
    pos = np.linspace(0.05, 0.95, 10).astype(np.float32)
    tags = (1.0 + 10.0 * pos).astype(np.float32)  # u tagged with its score
    pool = PassivePool(ScorePool(round=3, pos=pos, neg=np.arange(7, dtype=np.float32) / 10, u=tags,
                                 sources=(("d", 10, 7),)), np.random.default_rng(5))
    taken: list[np.ndarray] = []
    for _ in range(5):  # 5 x 4 = two passes over the 10 positives
        scores, u, idx = pool.take_pos(4)
        assert u is not None
        np.testing.assert_array_equal(u, (1.0 + 10.0 * scores).astype(np.float32))
        np.testing.assert_array_equal(scores, pos[idx])
        taken.append(idx)
    order = np.concatenate(taken)
    assert sorted(order[:10].tolist()) == list(range(10)) and sorted(order[10:].tolist()) == list(range(10))
    assert order[:10].tolist() != list(range(10))  # shuffled
    negatives = np.concatenate([pool.take_neg(3) for _ in range(7)])
    assert sorted(negatives[:7].tolist()) == sorted((np.arange(7, dtype=np.float32) / 10).tolist())


def test_the_payloads_carry_the_model_momentum_and_scores_only(trainer: Any, init: dict) -> None:
    """Digest check 6: uplink contents and sizes, equal across devices; the downlink pool holds >= K B."""
    h = make(trainer, init, rounds=3, objective="pauc", upload_scores=4)
    h.run()
    c = h.config
    layout = set(init)
    for u in uploads(h):
        env = u.to_envelope()
        assert set(env.tensors) <= layout | {f"{MOMENTUM_PREFIX}{n}" for n in layout} | {POS_SCORES, NEG_SCORES, POS_U}
        assert {f"{MOMENTUM_PREFIX}{n}" for n in layout} <= set(env.tensors)
        assert set(env.meta) == {"num_samples", "train_loss", "steps", "q", "pool"}  # no features, no row ids
        assert set(env.meta["pool"]) == {"round", "sources"} and env.meta["pool"]["sources"] == \
            [[u.sender, len(u.scores.pos), len(u.scores.neg)]]
        # Each list has the configured sub-sample (or nothing, for a class the device does not hold), >= ceil(K/N) B.
        holds = {int(v) for v in np.unique(DATA[u.sender][1])}
        assert len(u.scores.pos) == (4 if 1 in holds else 0) and len(u.scores.neg) == (4 if 0 in holds else 0)
        assert u.scores.u is not None and len(u.scores.u) == len(u.scores.pos)
        assert 4 >= math.ceil(c.local_steps / len(DEVICES)) * c.b1
    for device in DEVICES:
        for task in tasks(h, device)[1:]:
            assert len(task.pool.pos) >= c.local_steps * c.b1 and len(task.pool.neg) >= c.local_steps * c.b1
    # Without a sub-sample every device uploads all K B1 / K B2 scores it computed.
    full = make(trainer, init, rounds=2)
    full.run()
    assert {(len(u.scores.pos), len(u.scores.neg)) for u in uploads(full) if u.sender == "dev-00"} == {(6, 12)}


def test_hierarchical_aggregation_equals_flat_aggregation(trainer: Any, init: dict) -> None:
    """Digest check 7: two edges give the model, momentum and pool one edge gives (weighted sums, not means)."""
    two = make(trainer, init, rounds=4, objective="pauc")
    one = make(trainer, init, rounds=4, objective="pauc", cells={"cell-a": tuple(DEVICES)})
    two.run()
    one.run()
    for name in init:
        np.testing.assert_allclose(two.closed[-1].params[name], one.closed[-1].params[name], rtol=0, atol=1e-6)
        np.testing.assert_allclose(two.cloud.momentum[name], one.cloud.momentum[name], rtol=0, atol=1e-6)
    assert any(np.abs(two.cloud.momentum[n]).max() > 0 for n in init)
    # The pools: the same scores, concatenated (not averaged) in the same device order. Round 0's are computed
    # with the same w_0 and are identical; later ones differ by the models' float32 rounding at most.
    first = [next(m for m in h.received[c] if isinstance(m, messages.XRiskCellTask) and m.round == 1).pool
             for h, c in ((two, "cell-b"), (one, "cell-a"))]
    assert first[0] == first[1] and len(first[0].pos) == 4 * 6 and len(first[0].neg) == 4 * 12
    assert two.cloud.pool.sources == one.cloud.pool.sources
    for field in ("pos", "neg", "u"):
        np.testing.assert_allclose(getattr(two.cloud.pool, field), getattr(one.cloud.pool, field), rtol=0, atol=1e-6)


def test_the_momentum_is_an_ema_of_the_step_gradients_averaged_by_the_server(trainer: Any, init: dict) -> None:
    """Digest check 10: G <- (1 - beta) G + beta g on the device, G averaged over devices by the cloud."""
    h = make(trainer, init, rounds=3, objective="pauc", beta=0.3, record=True)
    h.run()
    beta = np.float32(0.3)
    for u in uploads(h):
        if u.round == 0:
            assert all(not np.any(g) for g in u.momentum.values())  # G^0 = 0 (Alg. 2)
            continue
        start = next(t for t in tasks(h, u.sender) if t.round == u.round).momentum
        g_seq = [g for d, r, _, g in h.compute.gradients if d == u.sender and r == u.round]
        momentum = {n: np.array(v) for n, v in start.items()}
        for g in g_seq:
            momentum = {n: (np.float32(1) - beta) * momentum[n] + beta * g[n] for n in momentum}
        # steps without a pair contribute a zero gradient (none here: every device pairs every step)
        assert len(g_seq) == h.config.local_steps
        for n in momentum:
            np.testing.assert_allclose(u.momentum[n], momentum[n], rtol=1e-6, atol=1e-7)
    for closed in h.closed[:-1]:
        reported = [u for u in uploads(h) if u.round == closed.round]
        nxt = next(t for t in tasks(h, "dev-00") if t.round == closed.round + 1)
        for n in init:
            np.testing.assert_allclose(nxt.momentum[n], np.mean([u.momentum[n] for u in reported], axis=0),
                                       rtol=1e-6, atol=1e-7)


def test_partial_participation_trains_averages_and_pools_only_the_sampled(trainer: Any, init: dict) -> None:
    """Digest check 11 (protocol part): Alg. 3 — only the sampled devices train, are averaged and are pooled;
    u changes only on them; the pool-collecting round takes everyone."""
    h = make(trainer, init, rounds=5, objective="pauc", participation=0.4)
    tables: dict[int, dict[str, dict[int, float]]] = {}
    original = h.cloud._open

    def snapshot(now: float) -> list:  # u tables of every device when a round opens
        tables[h.cloud.round] = {d: dict(dev._u) for d, dev in h.devices.items()}
        return original(now)

    h.cloud._open = snapshot  # type: ignore[method-assign]
    h.run()
    assert sorted(d for ds in h.closed[0].reported.values() for d in ds) == DEVICES
    for closed in h.closed[1:]:
        sampled = sorted(d for ds in closed.reported.values() for d in ds)
        assert len(sampled) == 2 and closed.missing == ()  # ceil(0.4 x 5); the others were not asked
        reported = [u for u in uploads(h) if u.round == closed.round]
        assert sorted(u.sender for u in reported) == sampled
        previous = h.closed[closed.round - 1].params
        for n in init:
            np.testing.assert_allclose(closed.params[n],
                                       previous[n] + np.mean([u.delta[n] for u in reported], axis=0),
                                       rtol=0, atol=1e-6)
        if closed.round + 1 < len(h.closed):
            pool = next(m for c in h.cells for m in h.received[c]
                        if isinstance(m, messages.XRiskCellTask) and m.round == closed.round + 1).pool
            assert sorted(d for d, _, _ in pool.sources) == sampled
            before, after = tables[closed.round], tables[closed.round + 1]
            for d in DEVICES:
                if d not in sampled:
                    assert after[d] == before[d]
    assert len({tuple(sorted(d for ds in c.reported.values() for d in ds)) for c in h.closed[1:]}) > 1


# --- bad score lists --------------------------------------------------------------------------------------------


def _open_round(trainer: Any, init: dict, **overrides: Any) -> QueuedHierarchy:
    h = make(trainer, init, rounds=2, **overrides)
    h.offline = set(h.devices)
    h.start()
    return h


def _update(h: QueuedHierarchy, device: str, **scores: Any) -> XRiskDeviceUpdate:
    c = h.config
    pool = {"round": 0, "pos": np.full(c.local_steps * c.b1, 0.5, np.float32),
            "neg": np.full(c.local_steps * c.b2, 0.5, np.float32), **scores}
    if "sources" not in scores:
        pool["sources"] = ((device, len(pool["pos"]), len(pool["neg"])),)
    return XRiskDeviceUpdate(rollout="r", round=0, sender=device, delta={n: np.zeros_like(p) for n, p in
                                                                          h.params.items()},
                             num_samples=10, steps=0, scores=ScorePool(**pool))


@pytest.mark.parametrize(("scores", "error"), [
    ({"pos": np.full(5, 0.5, np.float32)}, ScoreListError),                     # neither K B1 nor 0
    ({"neg": np.full(13, 0.5, np.float32)}, ScoreListError),
    ({"pos": np.full(6, 1.5, np.float32)}, ScoreListError),                     # not a sigmoid score
    ({"pos": np.full(6, np.nan, np.float32)}, ScoreListError),                   # NaN past the wire (in memory)
    ({"round": 1}, StaleScoresError),                                            # scores of another round
    ({"sources": (("dev-01", 6, 12),)}, ScoreListError),                         # claims another device's scores
    ({"u": np.ones(6, np.float32)}, ScoreListError),                             # u in an auroc rollout
])
def test_bad_score_lists_are_refused_with_a_typed_reason(trainer: Any, init: dict, scores: dict,
                                                         error: type[Exception]) -> None:
    h = _open_round(trainer, init)
    with pytest.raises(error):
        h.edges["cell-a"].receive(_update(h, "dev-00", **scores), 0.0)
    assert h.edges["cell-a"].reported == ()  # nothing accepted: the device may send a good one


def with_nan_score(data: bytes) -> bytes:
    """The encoded message with its first positive score's bytes replaced by a NaN, the body's sha fixed (so only
    the finiteness check can refuse it)."""
    prefix = struct.Struct(">4sBI")
    _, _, hlen = prefix.unpack_from(data, 0)
    header = msgpack.unpackb(data[prefix.size:prefix.size + hlen], raw=False)
    body = bytearray(data[prefix.size + hlen:])
    offset = 0
    for spec in header["ts"]:
        if spec["n"] == POS_SCORES:
            break
        offset += spec["nb"]
    body[offset:offset + 4] = struct.pack("<f", float("nan"))
    header.pop("dg", None), header.pop("dv", None)  # resealed with sha256, which every receiver reads
    header["sha"] = hashlib.sha256(bytes(body)).digest()
    packed = msgpack.packb(header, use_bin_type=True)
    return prefix.pack(b"FTEN", 1, len(packed)) + packed + bytes(body)


def test_a_nan_score_is_refused_by_the_wire_and_a_pauc_update_needs_u_at_least_1(trainer: Any, init: dict) -> None:
    h = _open_round(trainer, init, objective="pauc")
    momentum = {n: np.zeros_like(p) for n, p in init.items()}
    good = dataclasses.replace(_update(h, "dev-00", u=np.ones(6, np.float32)), momentum=momentum)
    assert isinstance(messages.decode_message(good.encode()), XRiskDeviceUpdate)
    with pytest.raises(NonFiniteTensorError):
        messages.decode_message(with_nan_score(good.encode()))
    with pytest.raises(ScoreListError):
        h.edges["cell-a"].receive(dataclasses.replace(good, scores=dataclasses.replace(
            good.scores, u=np.full(6, 0.5, np.float32))), 0.0)
    with pytest.raises(LayoutMismatchError):
        h.edges["cell-a"].receive(dataclasses.replace(good, momentum={}), 0.0)
    assert h.edges["cell-a"].receive(good, 0.0) == [] and h.edges["cell-a"].reported == ("dev-00",)


def test_misaligned_lists_are_refused_when_decoded() -> None:
    pool = ScorePool(round=0, pos=np.full(3, 0.5, np.float32), neg=np.zeros(0, np.float32),
                     u=np.ones(3, np.float32), sources=(("d", 3, 0),))
    env = XRiskDeviceUpdate(rollout="r", round=0, sender="d", delta={"w": np.zeros(2, np.float32)}, num_samples=1,
                            scores=pool).to_envelope()
    short_u = dataclasses.replace(env, tensors={**env.tensors, POS_U: np.ones(2, np.float32)})
    with pytest.raises(ScoreListError):
        messages.decode_message(wire.encode(short_u))
    wrong_count = dataclasses.replace(env, meta={**env.meta, "pool": {"round": 0, "sources": [["d", 2, 0]]}})
    with pytest.raises(ScoreListError):
        messages.decode_message(wire.encode(wrong_count))


def test_a_plain_device_update_is_not_a_fedxl_update(trainer: Any, init: dict) -> None:
    h = _open_round(trainer, init)
    plain = messages.DeviceUpdate(rollout="r", round=0, sender="dev-00", delta=dict(init), num_samples=1)
    with pytest.raises(UnexpectedMessageError):
        h.edges["cell-a"].receive(plain, 0.0)


def test_a_device_without_scores_does_not_stall_the_round(trainer: Any, init: dict) -> None:
    h = make(trainer, init, rounds=3)
    deliver = h.deliver_to_edge

    def strip_dev03(cell: str, msg: messages.Message) -> None:
        if isinstance(msg, XRiskDeviceUpdate) and msg.sender == "dev-03":
            msg = dataclasses.replace(msg, scores=ScorePool(round=msg.round, sources=(("dev-03", 0, 0),)))
        deliver(cell, msg)

    h.deliver_to_edge = strip_dev03  # type: ignore[method-assign]
    h.run()
    assert [c.round for c in h.closed] == [0, 1, 2] and all(c.missing == () for c in h.closed)
    assert ("dev-03", 0, 0) in h.cloud.pool.sources
    assert len(h.cloud.pool.pos) == 3 * 6  # dev-00, dev-01, dev-04 (dev-02 has no positives)


def test_a_cloud_refuses_cell_scores_that_do_not_match_the_reporters(trainer: Any, init: dict) -> None:
    h = make(trainer, init, rounds=2)
    h.offline = set(h.devices)
    h.start()
    update = XRiskCellUpdate(rollout="r", round=0, sender="cell-b", delta={n: np.zeros_like(p) for n, p in
                                                                           init.items()},
                             weight=2.0, reported=("dev-03", "dev-04"),
                             scores=ScorePool(round=0, pos=np.full(6, 0.5, np.float32), sources=(("dev-03", 6, 0),)))
    with pytest.raises(ScoreListError):
        h.cloud.receive(update, 0.0)
    with pytest.raises(StaleScoresError):
        h.cloud.receive(dataclasses.replace(update, scores=ScorePool(round=1, sources=(("dev-03", 0, 0),
                                                                                      ("dev-04", 0, 0)))), 0.0)
    good = dataclasses.replace(update, scores=ScorePool(round=0, sources=(("dev-03", 0, 0), ("dev-04", 0, 0))))
    assert h.cloud.receive(good, 0.0) == []  # accepted; the round waits for cell-a


def test_fedxl_roles_refuse_a_noise_plan() -> None:
    from fedtier.privacy.plan import CellPlan, NoisePlan

    plan = NoisePlan(mode="rdp", epsilon=8.0, delta=1e-5, budget_epsilon=math.inf, clip=1.0, edge_rounds=1, rounds=3,
                     require_tls=False, cells={"cell-a": CellPlan(trusted=False, members=1, device_z=1.0, edge_z=0.0)})
    cfg = dataclasses.replace(config(), privacy=plan.to_dict(), weighting="uniform")
    task = XRiskDeviceTask(rollout="r", round=0, sender="cell-a", params={"w": np.zeros(2, np.float32)},
                           config=cfg.to_dict(), members=("dev-00",), pool=ScorePool())
    with pytest.raises(UnexpectedMessageError, match="does not support differential privacy"):
        fedxl.Device(device_id="dev-00", cell="cell-a", rollout="r").receive(task, 0.0)


def test_the_round_closed_reports_every_reporter(trainer: Any, init: dict) -> None:
    h = make(trainer, init, rounds=2, cells=cells_of(DEVICES, 2))
    h.run()
    assert all(isinstance(c, RoundClosed) and sorted(d for ds in c.reported.values() for d in ds) == DEVICES
               for c in h.closed)


def test_results_nobody_asked_for_are_misuse(trainer: Any, init: dict) -> None:
    from fedtier.algorithms.base import GradientResult, RowScores
    from fedtier.errors import LocalProtocolError

    device = fedxl.Device(device_id="dev-00", cell="cell-a", rollout="r")
    with pytest.raises(LocalProtocolError):
        device.scored(0, 0, RowScores(rows={}, outputs={}, num_samples=1))
    with pytest.raises(LocalProtocolError):  # ERROR is terminal
        device.gradient_done(0, 0, GradientResult(grad={}, loss=0.0, num_samples=1))


@pytest.mark.parametrize("objective", ["auroc", "pauc", "psm"])
def test_the_lr_of_every_step_is_the_schedules(trainer: Any, init: dict, objective: str) -> None:
    """``lr_schedule = "step"``: step k of training round r (round 0 collects the pool) takes
    ``lr * factor ** (((r - 1) K + k) // every)``, computed from the counters alone."""
    every, factor, lr = 4, 0.5, 0.5
    h = make(trainer, init, rounds=4, objective=objective, record=True, lr=lr, lr_schedule="step",
             lr_decay_every=every, lr_decay_factor=factor, beta=1.0)
    h.run()
    K = h.config.local_steps
    assert [h.config.lr_at(r, k) for r in (1, 2, 3) for k in range(K)] == [
        lr * factor ** (((r - 1) * K + k) // every) for r in (1, 2, 3) for k in range(K)]
    checked = 0
    for u in uploads(h):
        if u.round == 0:
            continue
        params = {n: np.array(v) for n, v in next(t for t in tasks(h, u.sender) if t.round == u.round).params.items()}
        start = {n: v.copy() for n, v in params.items()}
        steps = [(k, g) for d, r, k, g in h.compute.gradients if d == u.sender and r == u.round]
        assert [k for k, _ in steps] == list(range(K))
        for k, g in steps:  # beta = 1: the momentum is the step's gradient, so every step is w - lr_t g
            rate = np.float32(lr * factor ** (((u.round - 1) * K + k) // every))
            params = {n: (p - rate * np.asarray(g[n], np.float32)).astype(np.float32) for n, p in params.items()}
        for n in params:
            np.testing.assert_allclose(u.delta[n], params[n] - start[n], rtol=1e-5, atol=1e-7)
        checked += 1
    assert checked == 3 * len(DEVICES)
    assert FedXLConfig.from_dict(h.config.to_dict()) == h.config
    assert "lr_schedule" not in config().to_dict()  # constant: tasks stay byte for byte what they were


def test_the_pairwise_sigmoid_loss_is_symmetric_and_pushes_the_pair_apart() -> None:
    from fedtier.algorithms import xrisk

    psm = xrisk.Objective("psm")
    a, b = np.array([0.9, 0.2, 0.5]), np.array([0.1, 0.7, 0.5])
    np.testing.assert_allclose(psm.pair(a, b) + psm.pair(b, a), 1.0)  # l(a, b) + l(b, a) = 1: robust to flips
    np.testing.assert_allclose(psm.pair(a, b), 1 / (1 + np.exp(a - b)))
    da, db = psm.pair_grads(a, b)
    assert np.all(da < 0) and np.all(db > 0)
    eps = 1e-6
    np.testing.assert_allclose(da, (psm.pair(a + eps, b) - psm.pair(a - eps, b)) / (2 * eps), rtol=1e-6)
    assert not psm.compositional and np.all(psm.outer_grad(np.array([3.0])) == 1.0)

"""HIST roles: submodel payloads, reassembly through the hierarchy, N = 1 is hierarchical FedAvg."""

from __future__ import annotations

import numpy as np
import pytest
from hierarchy import Hierarchy

from fedtier.algorithms import fedavg, hist
from fedtier.training.layout import ArchSpec
from fedtier.wire.messages import CellTask, CellUpdate, DeviceTask, DeviceUpdate

SIZES = [64, 300, 10]
ARCH = ArchSpec("mlp", {"sizes": SIZES})


def params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"fc0.weight": rng.normal(size=(300, 64)).astype(np.float32), "fc0.bias": np.zeros(300, np.float32),
            "fc1.weight": rng.normal(size=(10, 300)).astype(np.float32),
            "fc1.bias": rng.normal(size=10).astype(np.float32)}


def make(cells: int, rounds: int = 2, train=None, **cfg: object) -> Hierarchy:
    layout = {f"cell-{c}": tuple(f"dev-{c * 2 + i}" for i in range(2)) for c in range(cells)}
    config = hist.HistConfig(**{"local_steps": 4, "edge_rounds": 2, "lr": 0.1, "seed": 3, **cfg})  # type: ignore[arg-type]
    h = Hierarchy(algo=hist, cells=layout, params=params(), config=config, rounds=rounds, cloud_kwargs={"arch": ARCH})
    if train is not None:
        h.train = train
    return h


def sizes_of(msgs) -> set[int]:
    return {sum(t.size for t in m.tensors().values()) for m in msgs}


def test_every_device_download_and_upload_carries_the_submodel_size_and_the_cloud_one_model() -> None:
    h = make(cells=3, rounds=1)
    h.run()
    sub = 64 * 100 + 100 + 10 * 100 + 10
    device_msgs = [m for d in (f"dev-{i}" for i in range(6)) for m in h.received[d]]
    assert sizes_of([m for m in device_msgs if isinstance(m, DeviceTask)]) == {sub}
    uploads = [m for c in h.cells for m in h.received[c] if isinstance(m, DeviceUpdate)]
    assert len(uploads) == 6 * 2 and sizes_of(uploads) == {sub}  # E/H = 2 uploads per device
    tasks = [m for c in h.cells for m in h.received[c] if isinstance(m, CellTask)]
    assert sizes_of(tasks) == {sub}
    cell_updates = [m for m in h.received["cloud"] if isinstance(m, CellUpdate)]
    assert sum(sum(t.size for t in m.delta.values()) for m in cell_updates) == 22510 + 2 * 10


def test_with_learning_rate_zero_the_reassembled_model_is_bit_identical() -> None:
    h = make(cells=3, rounds=2, train=lambda p, d, r: {n: np.zeros_like(t) for n, t in p.items()}, lr=0.0)
    start = {n: t.copy() for n, t in h.params.items()}
    h.run()
    for closed in h.closed:
        assert all(np.array_equal(closed.params[n], start[n]) for n in start)


def test_partitions_are_redrawn_each_round_and_fixed_within_it() -> None:
    h = make(cells=2, rounds=2, bits_device=0)
    seen = []
    h.run()
    for m in h.received["cell-0"]:
        if isinstance(m, CellTask):
            seen.append(m.params["fc0.weight"].copy())
    assert len(seen) == 2 and not np.array_equal(seen[0], seen[1])
    # The cloud logs every draw (round and seed: reproducible); nothing sent down names neurons.
    draws = [n.fields for n in h.cloud_notes if n.event == "partition_drawn"]
    assert [(d["round"], d["seed"]) for d in draws] == [(0, 3), (1, 3)]
    for m in (m for c in h.cells for m in h.received[c]):
        if isinstance(m, CellTask):
            assert set(m.config) == set(hist.HistConfig().to_dict())


def test_cells_update_only_their_own_neurons() -> None:
    def train(p, device, round):
        return {n: np.full_like(t, 0.5) for n, t in p.items()}  # every device moves every coordinate

    h = make(cells=2, rounds=1, train=train, edge_rounds=1)
    h.start()
    partition = h.cloud.partition
    new = h.closed[0].params
    for j in range(len(h.cloud.cell_order)):
        rows = partition.parts[1][j]
        np.testing.assert_allclose(new["fc0.weight"][rows], h.params["fc0.weight"][rows] + 0.5, atol=1e-6)
    np.testing.assert_allclose(new["fc1.bias"], h.params["fc1.bias"] + 0.5, atol=1e-6)  # shared: mean of +0.5


def test_one_cell_is_hierarchical_fedavg() -> None:
    a = make(cells=1, rounds=2)
    a.run()
    config = fedavg.FedAvgConfig(local_steps=4, edge_rounds=2, lr=0.1, seed=3)
    b = Hierarchy(algo=fedavg, cells=dict(a.cells), params=params(), config=config, rounds=2)
    b.run()
    for n in a.params:
        assert np.array_equal(a.closed[-1].params[n], b.closed[-1].params[n])


def test_the_cloud_refuses_architectures_it_cannot_partition() -> None:
    with pytest.raises(Exception, match="MLP"):
        hist.Cloud(arch=ArchSpec("cnn1d", {"channels": 1, "length": 8, "classes": 2}), rollout="r",
                   cells={"c": ("d",)}, initial_params=params(), config=hist.HistConfig(), rounds=1)

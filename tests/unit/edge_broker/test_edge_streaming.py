"""The edge folds updates as they arrive and still loses nothing on a crash: a restart replays the stored
inputs (re-folding them in acceptance order), so the cell's update is the undisturbed edge's, bit for bit.
Messages with an unknown body digest or a wrong one are refused with their typed reason and counted."""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
from test_edge_node import CELL, MEMBERS, ROLLOUT, Rig, decoded

from fedtier.algorithms.fedavg import FedAvgConfig
from fedtier.runtime.node_base import ACCEPTED, REJECTED
from fedtier.transport import topics
from fedtier.wire import messages
from fedtier.wire.messages import CellTask, CellUpdate, DeviceUpdate

SHAPES = {"w": (2, 2)}  # the rig's model


def payload(device: str, seed: int, samples: int) -> bytes:
    values = np.random.default_rng(seed).normal(scale=10.0 ** (seed % 5 - 2), size=SHAPES["w"]).astype(np.float32)
    return DeviceUpdate(rollout=ROLLOUT, round=0, sender=device, delta={"w": values}, num_samples=samples,
                        train_loss=0.0, steps=1).encode()


def send(rig: Rig, device: str, data: bytes) -> None:
    rig.devices.publish(topics.cell_up(ROLLOUT, CELL, device, DeviceUpdate.KIND), data)
    rig.broker.run_until_idle()


def cell_update(rig: Rig) -> CellUpdate:
    [update] = [m for _, m in decoded(rig.at_cloud) if isinstance(m, CellUpdate)]
    return update


@pytest.mark.parametrize("strategy", [None, {"edge": {"rule": "median"}}])
def test_a_restart_mid_round_ends_with_the_undisturbed_cell_update_bit_for_bit(tmp_path: Path,
                                                                              strategy: dict | None) -> None:
    # Prepare: three updates of spread magnitudes, weighted by samples; once undisturbed, once with the edge
    # "killed" (its store and connections dropped, nothing flushed by a clean shutdown) after two of them.
    config = FedAvgConfig(weighting="samples", strategy=strategy)
    updates = {d: payload(d, seed, samples) for d, seed, samples in zip(MEMBERS, (3, 1, 4), (5, 0, 9), strict=True)}
    plain = Rig(tmp_path / "plain")
    plain.task(config)
    for device, data in updates.items():
        send(plain, device, data)
    db = tmp_path / "edge.db"
    rig = Rig(tmp_path, db)
    rig.task(config)
    for device in MEMBERS[:2]:
        send(rig, device, updates[device])
    # Execute
    rig.edge.store.close()
    rig.edge.cell_tx.close()
    rig.edge.cloud_tx.close()
    rig.edge = rig.new_edge(tmp_path, db)
    send(rig, MEMBERS[1], updates[MEMBERS[1]])  # a redelivery of an update it had stored: a duplicate
    send(rig, MEMBERS[2], updates[MEMBERS[2]])
    # Assert
    got, want = cell_update(rig), cell_update(plain)
    assert got.reported == want.reported == MEMBERS and got.weight == want.weight == 14.0
    assert np.array_equal(got.delta["w"], want.delta["w"])
    assert rig.edge.metrics.get(ACCEPTED, kind=DeviceUpdate.KIND) == 1  # only the one update sent after the restart


def test_the_edge_keeps_no_update_whole_while_it_collects(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.task(FedAvgConfig())
    send(rig, MEMBERS[0], payload(MEMBERS[0], 1, 1))

    role = rig.edge.roles[ROLLOUT]
    assert [dict(u.delta) for u in role._updates.values()] == [{}]  # folded, then dropped
    assert role._inputs is not None and role._inputs.folds


def _resealed(data: bytes, **header_changes: object) -> bytes:
    _, _, hlen = struct.unpack_from(">4sBI", data, 0)
    header = msgpack.unpackb(data[9:9 + hlen], raw=False)
    header.update(header_changes)
    packed = msgpack.packb(header, use_bin_type=True)
    return data[:5] + len(packed).to_bytes(4, "big") + packed + data[9 + hlen:]


def test_an_unknown_or_wrong_digest_is_refused_and_counted_and_sha256_still_accepted(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    rig = Rig(tmp_path)
    rig.task(FedAvgConfig())
    good = payload(MEMBERS[0], 2, 1)
    assert messages.decode_message(good).sender == MEMBERS[0]
    # Execute: an unknown digest name, a CRC that does not match, then the same update from an old device (sha256)
    send(rig, MEMBERS[0], _resealed(good, dg="blake3"))
    send(rig, MEMBERS[0], _resealed(good, dv=b"\x00\x00\x00\x00"))
    monkeypatch.setenv(messages.DIGEST_ENV, "sha256")
    send(rig, MEMBERS[0], payload(MEMBERS[0], 2, 1))
    # Assert
    assert rig.edge.metrics.get(REJECTED, reason="unknown_digest") == 1
    assert rig.edge.metrics.get(REJECTED, reason="sha_mismatch") == 1
    assert rig.edge.metrics.get(ACCEPTED, kind=DeviceUpdate.KIND) == 1
    assert rig.edge.roles[ROLLOUT].reported == (MEMBERS[0],)
    assert CellTask.KIND not in messages.UPWARD_KINDS

"""A FeDXL cell in the edge node (in-memory transport): bad score lists are refused with their typed reason
and counted, a good update after them is accepted, and a device without scores does not stall the cell."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import msgpack
import numpy as np
from test_edge_node import CELL, MEMBERS, PARAMS, ROLLOUT, Rig, decoded

from fedtier.algorithms.fedxl import FedXLConfig
from fedtier.runtime.node_base import ACCEPTED, REJECTED
from fedtier.transport import topics
from fedtier.wire.messages import POS_SCORES, ScorePool, XRiskCellTask, XRiskCellUpdate, XRiskDeviceUpdate

CONFIG = FedXLConfig(objective="auroc", local_steps=2, batch_size=3, batch_neg=4)


def task(rig: Rig) -> None:
    msg = XRiskCellTask(rollout=ROLLOUT, round=0, sender="cloud", params=PARAMS, members=MEMBERS,
                        config=CONFIG.to_dict(), pool=ScorePool())
    rig.cloud.publish(topics.cloud_down(ROLLOUT, CELL, msg.KIND), msg.encode())
    rig.broker.run_until_idle()


def update(device: str, *, pos: int = 6, neg: int = 8, value: float = 0.5, round_: int = 0) -> XRiskDeviceUpdate:
    scores = ScorePool(round=round_, pos=np.full(pos, value, np.float32), neg=np.full(neg, 0.25, np.float32),
                       sources=((device, pos, neg),))
    return XRiskDeviceUpdate(rollout=ROLLOUT, round=0, sender=device, delta={"w": np.full((2, 2), 0.5, np.float32)},
                             num_samples=4, steps=0, scores=scores)


def send(rig: Rig, device: str, payload: bytes) -> None:
    rig.devices.publish(topics.cell_up(ROLLOUT, CELL, device, XRiskDeviceUpdate.KIND), payload)
    rig.broker.run_until_idle()


def nan_first_score(data: bytes) -> bytes:
    """The message with its first positive score replaced by NaN and the body's sha fixed."""
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


def test_bad_score_lists_are_rejected_by_reason_and_counted(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    task(rig)
    send(rig, "dev-0", update("dev-0", pos=5).encode())              # neither K B1 = 6 nor 0
    send(rig, "dev-0", update("dev-0", value=1.5).encode())          # not a score in [0, 1]
    send(rig, "dev-0", update("dev-0", round_=1).encode())           # computed in another round
    send(rig, "dev-0", nan_first_score(update("dev-0").encode()))    # NaN
    assert rig.edge.metrics.get(REJECTED, reason="bad_scores") == 2
    assert rig.edge.metrics.get(REJECTED, reason="stale_scores") == 1
    assert rig.edge.metrics.get(REJECTED, reason="non_finite") == 1
    assert rig.edge.metrics.get(ACCEPTED, kind=XRiskDeviceUpdate.KIND) == 0
    # Nothing of them was kept: the device's good update is accepted, and so is one without any score.
    send(rig, "dev-0", update("dev-0").encode())
    send(rig, "dev-1", update("dev-1", pos=0, neg=0).encode())
    send(rig, "dev-2", update("dev-2", neg=0).encode())
    assert rig.edge.metrics.get(ACCEPTED, kind=XRiskDeviceUpdate.KIND) == 3
    [(_, cell_update)] = [(t, m) for t, m in decoded(rig.at_cloud) if isinstance(m, XRiskCellUpdate)]
    assert cell_update.reported == MEMBERS and cell_update.weight == 3.0
    np.testing.assert_array_equal(cell_update.delta["w"], np.full((2, 2), 1.5, np.float32))  # a sum, not a mean
    assert cell_update.scores.sources == (("dev-0", 6, 8), ("dev-1", 0, 0), ("dev-2", 6, 0))
    assert len(cell_update.scores.pos) == 12 and len(cell_update.scores.neg) == 8

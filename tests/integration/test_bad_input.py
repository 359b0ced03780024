"""Bad input on a cell's uplink is rejected with a typed, logged, counted reason; the round completes."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
from mqtt_helpers import RawClient, with_flipped_byte, with_nan

from edge_broker.config import EdgeConfig
from fedtier.algorithms.fedavg import FedAvgConfig
from fedtier.runtime.config import dumps_toml, load
from fedtier.runtime.node_base import DROPPED, REJECTED
from fedtier.transport import topics
from fedtier.wire import messages
from fedtier.wire.messages import CellTask, CellUpdate, DeviceUpdate

pytestmark = pytest.mark.broker

ROLLOUT, CELL = "bad", "cell-a"
MEMBERS = ("dev-0", "dev-1", "dev-2")
PARAMS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}


def update(sender: str, value: float, round: int = 0) -> DeviceUpdate:
    return DeviceUpdate(rollout=ROLLOUT, round=round, sender=sender,
                        delta={n: np.full_like(p, value) for n, p in PARAMS.items()},
                        num_samples=10, train_loss=0.3, steps=5)


def up(device: str) -> str:
    return topics.cell_up(ROLLOUT, CELL, device, DeviceUpdate.KIND)


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def test_bad_uplink_messages_are_rejected_and_the_round_completes(mosquitto, tmp_path: Path, caplog) -> None:
    from fleet_threads import ThreadFleet

    from local_fleet.configs import FleetPaths

    caplog.set_level(logging.INFO)
    # Prepare: an edge over Mosquitto; the test plays the cloud and the devices.
    broker = {"host": mosquitto.host, "port": mosquitto.port}
    edge_toml = tmp_path / "edge.toml"
    edge_toml.write_text(dumps_toml({"cell": CELL, "state_dir": str(tmp_path / "edge"),
                                     "cell_broker": broker, "cloud_broker": broker}))
    load(EdgeConfig, edge_toml)
    fleet = ThreadFleet(FleetPaths(coordinator=tmp_path, edges={CELL: edge_toml}, devices={}, workdir=tmp_path))
    cloud = RawClient(mosquitto.host, mosquitto.port, "test-cloud")
    devices = RawClient(mosquitto.host, mosquitto.port, "test-devices")
    try:
        cloud.subscribe(topics.edge_up(ROLLOUT, CELL, "#"))
        edge = fleet.start_edge(CELL).node
        wait_until(lambda: fleet.nodes[CELL].node.cell_tx.subscribed() and fleet.nodes[CELL].node.cloud_tx.subscribed())
        task = CellTask(rollout=ROLLOUT, round=0, sender="cloud", params=PARAMS, members=MEMBERS,
                        config=FedAvgConfig(deadline_s=600).to_dict())
        cloud.publish(topics.cloud_down(ROLLOUT, CELL, CellTask.KIND), task.encode())
        wait_until(lambda: ROLLOUT in edge.roles)

        # Execute: one good update, then every kind of bad input, then the other good updates.
        good0 = update("dev-0", 1.0).encode()
        devices.publish(up("dev-0"), good0)
        devices.publish(up("dev-1"), b"\x00\x01 not an envelope at all")                     # garbage
        devices.publish(up("dev-1"), update("dev-1", 2.0).encode()[:40])                    # truncated
        devices.publish(up("dev-1"), with_flipped_byte(update("dev-1", 2.0).encode()))      # sha mismatch
        devices.publish(up("dev-1"), update("dev-1", 2.0, round=7).encode())                # wrong round
        devices.publish(up("dev-1"), with_nan(update("dev-1", 2.0).encode()))               # NaN tensor
        devices.publish(up("intruder"), update("intruder", 9.0).encode())                   # unknown sender
        devices.publish(up("dev-2"), update("dev-1", 9.0).encode())                         # sender != topic id
        devices.publish(up("dev-0"), good0)                                                 # duplicate
        devices.publish(up("dev-1"), update("dev-1", 2.0).encode())
        devices.publish(up("dev-2"), update("dev-2", 3.0).encode())
        topic, payload = cloud.wait_for(topics.edge_up(ROLLOUT, CELL, CellUpdate.KIND))
    finally:
        fleet.stop()
        cloud.close()
        devices.close()

    # Assert: the round completed with exactly the three good updates, averaged.
    cell_update = messages.decode_message(payload)
    assert isinstance(cell_update, CellUpdate)
    assert cell_update.reported == MEMBERS
    for name, p in PARAMS.items():
        np.testing.assert_allclose(cell_update.delta[name], np.full_like(p, 2.0), rtol=0, atol=1e-7)
    # ... and each bad message was counted under its typed reason, and logged with it.
    m = edge.metrics
    expected = {"bad_magic": 1, "truncated": 1, "sha_mismatch": 1, "wrong_round": 1, "non_finite": 1,
                "unknown_sender": 1, "sender_mismatch": 1}
    assert {r: m.get(REJECTED, reason=r) for r in expected} == expected
    assert m.total(REJECTED) == sum(expected.values())
    assert m.get(DROPPED, reason="duplicate") == 1
    logged = caplog.text
    for reason in expected:
        assert f": {reason}: " in logged, reason

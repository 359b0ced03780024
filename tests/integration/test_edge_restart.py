"""Killing the edge process mid-round and restarting it loses no update it had accepted, and the cell's update is
the undisturbed edge's bit for bit (the restarted edge folds the stored updates again in acceptance order)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from conftest import free_port
from mqtt_helpers import RawClient

from fedtier.algorithms.aggregate import weighted_mean
from fedtier.algorithms.fedavg import FedAvgConfig
from fedtier.runtime.config import dumps_toml
from fedtier.transport import topics
from fedtier.wire import messages
from fedtier.wire.messages import CellTask, CellUpdate, DeviceUpdate

pytestmark = pytest.mark.broker

ROLLOUT, CELL = "crash", "cell-a"
MEMBERS = ("dev-0", "dev-1", "dev-2", "dev-3")
PARAMS = {"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)}


def update(device: str) -> DeviceUpdate:
    # values of spread magnitudes, so that the float64 running sum rounds (an order change would show)
    gen = np.random.default_rng(int(device[-1]))
    return DeviceUpdate(rollout=ROLLOUT, round=0, sender=device,
                        delta={n: (gen.normal(size=p.shape) * 10.0 ** int(device[-1])).astype(np.float32)
                               for n, p in PARAMS.items()},
                        num_samples=5, train_loss=0.1, steps=2)


def scrape(port: int) -> str:
    """The scrape as canonical lines ``name{sorted labels} value`` (integral values without ``.0``)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as resp:
            text = resp.read().decode()
    except OSError:
        return ""
    lines = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            value = int(s.value) if float(s.value).is_integer() else s.value
            lines.append(f"{s.name}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


def wait_metric(port: int, line: str, proc: subprocess.Popen, log: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if line in scrape(port):
            return
        if proc.poll() is not None:
            raise AssertionError(f"edge exited: {log.read_text()}")
        time.sleep(0.05)
    raise AssertionError(f"metric {line!r} not seen; metrics:\n{scrape(port)}\nlog:\n{log.read_text()}")


def wait_online(watcher: RawClient, after: float, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            topic, payload = watcher.messages.get(timeout=0.1)
        except Exception:
            continue
        doc = json.loads(payload)
        if topic == topics.status(CELL) and doc["state"] == "online" and doc["since"] > after:
            return
    raise AssertionError("edge did not come online")


def start_edge(config: Path, log: Path) -> subprocess.Popen:
    fh = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "fedtier", "edge", "run", "--config", str(config)],
                            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def test_edge_killed_mid_round_resumes_with_every_accepted_update(mosquitto, tmp_path: Path) -> None:
    # Prepare: a real `fedtier edge run` process; the test plays the cloud and the devices.
    metrics_port = free_port()
    broker = {"host": mosquitto.host, "port": mosquitto.port}
    config = tmp_path / "edge.toml"
    config.write_text(dumps_toml({"cell": CELL, "state_dir": str(tmp_path / "edge-state"),
                                  "metrics_port": metrics_port, "cell_broker": broker, "cloud_broker": broker}))
    log = tmp_path / "edge.log"
    cloud = RawClient(mosquitto.host, mosquitto.port, "test-cloud")
    cloud.subscribe(topics.edge_up(ROLLOUT, CELL, "#"))
    cloud.subscribe(topics.status(CELL))
    devices = RawClient(mosquitto.host, mosquitto.port, "test-devices")
    t0 = time.time()
    edge = start_edge(config, log)
    try:
        wait_online(cloud, t0)
        task = CellTask(rollout=ROLLOUT, round=0, sender="cloud", params=PARAMS, members=MEMBERS,
                        config=FedAvgConfig(deadline_s=600).to_dict())
        cloud.publish(topics.cloud_down(ROLLOUT, CELL, CellTask.KIND), task.encode())
        # Devices only ever answer a task they received, so wait for the edge to hold it.
        wait_metric(metrics_port, 'fedtier_accepted_total{kind="cell_task",node="cell-a",role="edge"} 1', edge, log)
        for d in ("dev-0", "dev-1", "dev-2"):
            devices.publish(topics.cell_up(ROLLOUT, CELL, d, DeviceUpdate.KIND), update(d).encode())
        wait_metric(metrics_port, 'fedtier_accepted_total{kind="device_update",node="cell-a",role="edge"} 3',
                    edge, log)

        # Execute: SIGKILL (no clean shutdown), one more update while it is down, restart.
        os.killpg(edge.pid, signal.SIGKILL)
        edge.wait(10)
        devices.publish(topics.cell_up(ROLLOUT, CELL, "dev-3", DeviceUpdate.KIND), update("dev-3").encode())
        devices.publish(topics.cell_up(ROLLOUT, CELL, "dev-0", DeviceUpdate.KIND), update("dev-0").encode())
        # A malformed message queued last: once the edge has refused it, it has handled the resend.
        devices.publish(topics.cell_up(ROLLOUT, CELL, "dev-0", DeviceUpdate.KIND), b"not a message")
        t1 = time.time()
        edge = start_edge(config, log)
        wait_online(cloud, t1)
        topic, payload = cloud.wait_for(topics.edge_up(ROLLOUT, CELL, CellUpdate.KIND), timeout=30)
        # dev-0's resend was queued after dev-3's update: wait until the edge has handled it too.
        wait_metric(metrics_port, 'fedtier_rejected_total{node="cell-a",reason="bad_magic",role="edge"} 1', edge, log)
        metrics_after = scrape(metrics_port)
    finally:
        if edge.poll() is None:
            os.killpg(edge.pid, signal.SIGTERM)
            edge.wait(10)
        cloud.close()
        devices.close()

    # Assert: the cell update carries all four devices: the three accepted before the crash
    # (replayed from the edge's SQLite state) and the one queued by the broker meanwhile.
    cell_update = messages.decode_message(payload)
    assert isinstance(cell_update, CellUpdate)
    assert cell_update.reported == MEMBERS
    undisturbed = weighted_mean([(update(d).delta, 1.0) for d in MEMBERS])  # the edge's mean, in arrival order
    for name in PARAMS:
        assert np.array_equal(cell_update.delta[name], undisturbed[name]), name
    assert f"resumed rollout {ROLLOUT} from state: round 0, 3 updates" in log.read_text()
    # After the restart only dev-3 was new; dev-0's resend was recognised as a duplicate. The
    # broker may also redeliver updates the edge had accepted but not yet acknowledged when it was
    # killed (at-least-once): those are duplicates too, never accepted twice.
    assert 'fedtier_accepted_total{kind="device_update",node="cell-a",role="edge"} 1' in metrics_after
    duplicates = re.search(r'fedtier_dropped_total\{node="cell-a",reason="duplicate",role="edge"\} (\d+)',
                           metrics_after)
    assert duplicates is not None and 1 <= int(duplicates.group(1)) <= 4, metrics_after

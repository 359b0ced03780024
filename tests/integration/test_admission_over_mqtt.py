"""A model that kills onnxruntime-training (an AvgPool1d layer: SIGFPE in its gradient) never reaches a broker:
`fedtier coordinator run` exits 2 naming the op before it connects to Mosquitto, and `fedtier coordinator serve`
stops a stored rollout with that model, with the reason, without publishing its manifest, and keeps serving."""

from __future__ import annotations

import json
import queue
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fleet_helpers import Procs, wait_for_text
from mqtt_helpers import RawClient

from cloud_coordinator.store import CoordinatorStore
from fedtier.rollout.config import RolloutConfig
from fedtier.runtime.config import load
from fedtier.transport import topics

pytestmark = pytest.mark.broker

FEDTIER = [sys.executable, "-m", "fedtier"]
OP = "killed by SIGFPE in a training step, in op AveragePoolGrad"

MODEL_PY = textwrap.dedent("""
    import torch
    from torch import nn

    def make():
        net = nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.AvgPool1d(2), nn.Flatten(), nn.Linear(4 * 15, 2))
        return net, torch.zeros(4, 1, 30)
""")


def write_config(tmp_path: Path, artifact_store: Path, host: str, port: int) -> Path:
    (tmp_path / "model.py").write_text(MODEL_PY)
    path = tmp_path / "rollout.toml"
    path.write_text(textwrap.dedent(f"""
        rollout = "avg"
        rounds = 2
        state_dir = "{tmp_path / 'state'}"
        artifact_store = "{artifact_store}"
        cloud_id = "cloud-adm"
        [model]
        kind = "torch"
        factory = "model.py:make"
        [data]
        dataset = "breast_cancer"
        partition = "iid"
        [topology]
        cells = 2
        devices_per_cell = 2
        [fedavg]
        local_steps = 2
        batch_size = 8
        [broker]
        host = "{host}"
        port = {port}
    """))
    return path


def test_coordinator_run_refuses_the_model_with_exit_2_before_connecting(mosquitto, artifact_store: Path,
                                                                        tmp_path: Path) -> None:
    config = write_config(tmp_path, artifact_store, mosquitto.host, mosquitto.port)
    procs = Procs(tmp_path)
    try:
        run = procs.start("coordinator", [*FEDTIER, "coordinator", "run", "--config", str(config)])
        code = run.popen.wait(300)
    finally:
        procs.close()
    assert code == 2, run.text()[-3000:]
    assert OP in run.text() and "MaxPool1d" in run.text()
    assert "cloud-adm" not in mosquitto.log_text()  # never connected


def test_coordinator_serve_stops_a_stored_rollout_whose_model_is_refused_and_publishes_nothing(
        mosquitto, artifact_store: Path, tmp_path: Path) -> None:
    # Prepare: the rollout stored and asked to run, as `rollout create` of a fedtier without admission left it
    # (today's `rollout create` refuses it); a client watching its manifest topic.
    config = write_config(tmp_path, artifact_store, mosquitto.host, mosquitto.port)
    cfg = load(RolloutConfig, config)
    cfg.state_dir.mkdir(parents=True)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    assert store.create_rollout(cfg.rollout, json.loads(json.dumps(cfg.to_dict(), default=str)))
    store.set_desired(cfg.rollout, "running")
    watcher = RawClient(mosquitto.host, mosquitto.port, "watcher")
    watcher.subscribe(f"{topics.PREFIX}/{cfg.rollout}/#")
    procs = Procs(tmp_path)
    try:
        # Execute
        serve = procs.start("coordinator", [*FEDTIER, "coordinator", "serve", "--state-dir", str(cfg.state_dir)])
        wait_for_text(serve, "rollout avg stopped before it started", 300)
        time.sleep(1.0)
        # Assert: stopped with the reason (log and metrics file), the service still up, nothing published.
        assert serve.popen.poll() is None, serve.text()[-3000:]
        assert OP in serve.text()
        assert store.status(cfg.rollout) == "stopped" and store.desired(cfg.rollout) == "stopped"
        assert OP in json.loads(cfg.metrics_path.read_text())["stopped"]
        with pytest.raises(queue.Empty):
            watcher.messages.get(timeout=0.5)
    finally:
        watcher.close()
        procs.close()
        store.close()

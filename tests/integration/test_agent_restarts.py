"""Agents restarted mid-rollout rejoin it, in a provisioned fleet with signed manifests.

Every node is a real ``fedtier ... run`` process over a Mosquitto running the config ``provision
fleet`` wrote (mutual TLS, ACLs). With the default quorum of 1.0 a round waits for every device,
so an agent that is down stops the rollout until it is back: one agent is stopped with SIGINT
right after it trained round 0, another killed with SIGKILL while the rollout waits; both are
restarted on their own state. Before the fix a restarted agent refused the edge's retained
manifest as "not newer than the installed version" and never trained again.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, mosquitto_binary, require
from fleet_helpers import Proc, Procs, retained, start_brokers, wait_for_text, write_rollout

from provisioning.rollout import provision_fleet

pytestmark = [pytest.mark.slow, pytest.mark.broker]

ROUNDS = 12
FEDTIER = [sys.executable, "-m", "fedtier"]


def test_agents_stopped_or_killed_mid_rollout_rejoin_and_every_device_finishes(
        tmp_path: Path, artifact_store: Path) -> None:
    require(mosquitto_binary() is not None, "Mosquitto (apt-get install mosquitto)")
    # Prepare: one shared broker, one cell of three devices, signed manifests.
    rollout = write_rollout(tmp_path / "rollout.toml", rollout="rs", port=free_port(), rounds=ROUNDS,
                            cells={"cell-a": ["dev-0", "dev-1", "dev-2"]}, artifact_store=artifact_store)
    result = provision_fleet(rollout, tmp_path / "site", sample_data=True)
    procs = Procs(tmp_path)
    try:
        start_brokers(procs, result.brokers)
        edge = procs.start("edge", [*FEDTIER, "edge", "run", "--config", str(result.gateways["cell-a"] / "edge.toml")])

        def agent(device: str, run: int) -> Proc:
            return procs.start(f"agent-{device}-{run}",
                               [*FEDTIER, "agent", "run", "--bundle", str(result.devices[device])])

        agents = {d: agent(d, 0) for d in result.devices}
        coordinator = procs.start("coordinator", [*FEDTIER, "coordinator", "run", "--config",
                                                  str(result.rollout_config)])
        # Execute: dev-0 stops cleanly right after its first update; the rollout now waits for it.
        wait_for_text(agents["dev-0"], "round 0 step 0 of rs: device_update sent", 90, procs)
        assert agents["dev-0"].stop(signal.SIGINT) == 0
        wait_for_text(agents["dev-1"], "device_update sent", 30, procs)
        agents["dev-1"].send(signal.SIGKILL)  # and dev-1 dies without a word
        assert agents["dev-1"].popen.wait(10) == -signal.SIGKILL
        time.sleep(2.0)
        metrics = json.loads((result.coordinator / "metrics" / "rs.json").read_text())
        assert coordinator.popen.poll() is None and len(metrics["rounds"]) < ROUNDS  # blocked on dev-0
        restarted = {d: agent(d, 1) for d in ("dev-0", "dev-1")}
        code = coordinator.popen.wait(120)
        for p in [*agents.values(), *restarted.values(), edge]:
            p.stop(signal.SIGINT)
        leftover = [t for t, _ in retained("127.0.0.1", int(result.brokers["shared"]["port"]),
                                           result.gateways["cell-a"], "ft/v1/#") if not t.startswith("ft/v1/status/")]
    finally:
        procs.close()
    texts = {p.name: p.text() for p in procs.started}

    # Assert: the rollout finished with every device in every round, the last one included.
    assert code == 0, texts["coordinator"][-3000:]
    metrics = json.loads((result.coordinator / "metrics" / "rs.json").read_text())
    assert metrics["finished"] and len(metrics["rounds"]) == ROUNDS
    assert all(r["devices_reported"] == 3 and r["missing"] == [] for r in metrics["rounds"]), metrics["rounds"]
    for proc in restarted.values():
        text = texts[proc.name]
        assert "resuming rollout rs with its installed manifest v1" in text, text[-3000:]
        assert f"round {ROUNDS - 1} step 0 of rs: device_update sent" in text, text[-3000:]
        assert "rollout rs ended; idle until the next rollout" in text
    assert not any("stale_manifest" in t or "Traceback" in t for t in texts.values())
    assert "rollout rs ended: cleared its manifest in cell cell-a" in texts[edge.name]
    # Nothing of the rollout stays retained on the broker.
    assert leftover == []

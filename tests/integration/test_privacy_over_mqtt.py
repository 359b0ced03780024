"""M2FDP over a real Mosquitto: clear updates to a trusted edge only over mutual TLS.

A provisioned fleet (fleet CA, per-node certificates, signed manifests, ACL) runs a private
rollout with one trusted and one untrusted cell to the end; the same rollout over a plain TCP
listener is refused by the trusted cell's edge and devices, which would otherwise send and
receive un-noised models in clear.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, mosquitto_binary, require, wait_port
from fleet_threads import ThreadFleet

from fedtier.rollout.config import RolloutConfig
from local_fleet.configs import write_fleet
from cloud_coordinator.privacy.ledger import recompute
from cloud_coordinator.store import CoordinatorStore
from fedtier.runtime.config import load
from fedtier.runtime.node_base import REJECTED

pytestmark = pytest.mark.broker

PRIVACY = {"epsilon": 20.0, "clip": 1.0}
TOPOLOGY = {"cells": 2, "devices_per_cell": 2, "trusted": {"cell-a": True}}


def _plain(small_rollout, tmp_path: Path, **privacy: Any) -> dict[str, Any]:
    cfg = small_rollout(rounds=2, topology=TOPOLOGY, privacy={**PRIVACY, **privacy},
                        fedavg={"local_steps": 3, "edge_rounds": 2, "lr": 0.1, "batch_size": 16})
    plain = cfg.to_dict()
    plain.pop("broker", None)
    plain["state_dir"] = str(tmp_path / "fleet" / "coordinator")
    return plain


def test_a_private_rollout_over_mutual_tls_runs_and_is_on_the_ledger(small_rollout, tmp_path: Path) -> None:
    from provisioning.broker_config import combined_broker_config
    from provisioning.bundles import issue_coordinator, issue_device, issue_gateway
    from provisioning.fleet import Fleet

    binary = mosquitto_binary()
    require(binary is not None, "Mosquitto (apt-get install mosquitto)")
    assert binary is not None
    plain = _plain(small_rollout, tmp_path)
    cells = RolloutConfig.from_mapping(plain).topology.layout()
    port = free_port()
    endpoint = ("127.0.0.1", port)
    fleet = Fleet.init(tmp_path / "pki")
    bundles = {"cloud": issue_coordinator(fleet, endpoint, tmp_path / "b" / "cloud").path}
    for cell, members in cells.items():
        bundles[cell] = issue_gateway(fleet, cell, endpoint, tmp_path / "b" / cell, cloud_broker=endpoint).path
        for device in members:
            bundles[device] = issue_device(fleet, device, cell, endpoint, tmp_path / "b" / device).path
    setup = combined_broker_config(list(cells), "cloud", fleet=fleet, out=tmp_path / "broker", port=port)
    log = open(tmp_path / "mosquitto.log", "wb")
    broker = subprocess.Popen(setup.command(binary), stdout=log, stderr=subprocess.STDOUT)
    fleet_nodes = None
    try:
        wait_port(port)
        paths = write_fleet(plain, tmp_path / "fleet", {"host": "127.0.0.1", "port": port}, bundles)
        fleet_nodes = ThreadFleet(paths)
        fleet_nodes.start_all()
        cloud = fleet_nodes.wait_finished(timeout=90)
    finally:
        if fleet_nodes is not None:
            fleet_nodes.stop()
        broker.terminate()
        broker.wait(10)
        log.close()
    for name, running in fleet_nodes.nodes.items():
        assert running.node.metrics.total(REJECTED) == 0, (name, running.node.metrics.snapshot())
    assert [r["round"] for r in cloud.history] == [0, 1]
    assert all(r["devices_reported"] == 4 for r in cloud.history)
    cfg = load(RolloutConfig, paths.coordinator)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    rows = store.privacy_releases(cfg.rollout)
    offline = recompute(store, cfg.rollout, cfg.privacy.delta)  # type: ignore[union-attr]
    store.close()
    assert len(rows) == 2 * (2 * 2 + 1) and all(r["observed"] for r in rows)
    live = cloud.history[-1]["privacy"]["epsilon"]
    assert offline == pytest.approx(live, rel=1e-12)


def test_without_tls_the_trusted_cell_refuses_to_move_clear_models(mosquitto, small_rollout, tmp_path: Path) -> None:
    plain = _plain(small_rollout, tmp_path)  # require_tls defaults to true
    paths = write_fleet(plain, tmp_path / "fleet", {"host": mosquitto.host, "port": mosquitto.port})
    fleet = ThreadFleet(paths)
    try:
        fleet.start_all()
        edge_a = fleet.nodes["cell-a"].node
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and edge_a.metrics.get(REJECTED, reason="privacy_violation") == 0:
            fleet.check()
            time.sleep(0.05)
        assert edge_a.metrics.get(REJECTED, reason="privacy_violation") >= 1  # refused the round's task
        time.sleep(1.0)
        cloud = fleet.nodes["coordinator"].node
        assert cloud.history == []  # no round can close: the trusted cell never reports
        # The untrusted cell's devices noise their updates and are unaffected by the missing TLS.
        assert fleet.nodes["cell-b"].node.metrics.get(REJECTED, reason="privacy_violation") == 0
    finally:
        fleet.stop()

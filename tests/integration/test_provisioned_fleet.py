"""Fleets written by ``fedtier provision fleet``, run through real Mosquittos with their generated
configs (mutual TLS, CRL, ACLs, client id bound to the certificate) and signed manifests.

Both layouts complete a rollout: one broker shared by the coordinator, every edge and every
device; and a broker per gateway (each edge connected to its cell's broker and to the cloud's).
The nodes run as threads, built by each role's ``build()`` from the bundles' own configs.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from conftest import free_port, mosquitto_binary, require
from fleet_helpers import Procs, retained, start_brokers, write_rollout
from fleet_threads import ThreadFleet

from fedtier.cli import cli
from local_fleet.configs import FleetPaths
from provisioning.rollout import provision_fleet

pytestmark = pytest.mark.broker

CELLS = {"cell-a": ["dev-0", "dev-1"], "cell-b": ["dev-2", "dev-3"]}


def paths_of(result) -> FleetPaths:
    return FleetPaths(coordinator=result.rollout_config, edges={c: p / "edge.toml" for c, p in result.gateways.items()},
                      devices={d: p / "device.toml" for d, p in result.devices.items()}, workdir=result.out)


@pytest.mark.parametrize("layout", ["shared broker", "broker per gateway"])
def test_a_provisioned_fleet_completes_a_rollout_and_leaves_nothing_retained(
        tmp_path: Path, artifact_store: Path, layout: str) -> None:
    require(mosquitto_binary() is not None, "Mosquitto (apt-get install mosquitto)")
    # Prepare: provision the topology; start the brokers from the configs it wrote.
    cloud_port = free_port()
    rollout = write_rollout(tmp_path / "rollout.toml", rollout="r1", port=cloud_port, cells=CELLS,
                            artifact_store=artifact_store)
    cell_brokers = {c: ("127.0.0.1", free_port()) for c in CELLS} if layout == "broker per gateway" else {}
    result = provision_fleet(rollout, tmp_path / "site", cell_brokers=cell_brokers, sample_data=True)
    assert sorted(result.brokers) == (["cell-a", "cell-b", "cloud"] if cell_brokers else ["shared"])
    procs = Procs(tmp_path)
    fleet = ThreadFleet(paths_of(result))
    try:
        start_brokers(procs, result.brokers)
        # Execute: every node from its bundle; the rollout runs to its end.
        fleet.start_all()
        coordinator = fleet.wait_finished(timeout=90)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (
                coordinator.cleared and all("r1" not in fleet.nodes[c].node.manifests for c in CELLS)):
            time.sleep(0.05)
        # Assert: every device in every round; the manifest was signed and verified everywhere.
        assert [row["devices_reported"] for row in coordinator.history] == [4, 4, 4]
        assert all(row["missing"] == [] for row in coordinator.history)
        assert all(fleet.nodes[d].node.gate.enforcing for d in result.devices)
        fleet.stop()
        # Nothing of the rollout is left retained on any broker (read with a stopped edge's identity).
        for cell in CELLS:
            for broker in result.brokers.values():
                if broker["serves"].find(cell) < 0:
                    continue
                left = [t for t, _ in retained("127.0.0.1", int(broker["port"]), result.gateways[cell], "ft/v1/#")
                        if not t.startswith("ft/v1/status/")]
                assert left == [], (broker["dir"], left)
    finally:
        fleet.stop()
        procs.close()


def test_edges_behind_bridged_gateway_brokers_talk_to_their_local_broker_alone(
        tmp_path: Path, artifact_store: Path) -> None:
    """``--cell-broker ... --bridge``: each gateway's Mosquitto bridges its cell to the cloud's over TLS.

    Devices' presence stays behind the bridge; each edge's summary crosses it, so ``rollout status`` and the
    coordinator's ``/metrics`` show the devices online."""
    require(mosquitto_binary() is not None, "Mosquitto (apt-get install mosquitto)")
    # Prepare: two gateway brokers bridged to a cloud broker, all three with mutual TLS.
    cloud_port = free_port()
    rollout = write_rollout(tmp_path / "rollout.toml", rollout="r1", port=cloud_port, cells=CELLS,
                            artifact_store=artifact_store)
    cell_brokers = {c: ("127.0.0.1", free_port()) for c in CELLS}
    result = provision_fleet(rollout, tmp_path / "site", cell_brokers=cell_brokers, sample_data=True, bridge=True)
    for cell, (_, port) in cell_brokers.items():
        edge = (result.gateways[cell] / "edge.toml").read_text()
        # The edge knows one broker, its gateway's: both of its sides use it (one connection).
        assert edge.count(f"port = {port}") == 2 and f"port = {cloud_port}" not in edge
        conf = Path(result.brokers[cell]["conf"]).read_text()
        assert f"address 127.0.0.1:{cloud_port}" in conf and "bridge_certfile" in conf
    procs = Procs(tmp_path)
    fleet = ThreadFleet(paths_of(result))
    try:
        start_brokers(procs, result.brokers)
        # Execute: every node from its bundle; the devices are online before the coordinator starts.
        for device in result.devices:
            fleet.start_device(device)
        for cell in CELLS:
            fleet.start_edge(cell)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                sum(fleet.nodes[c].node._devices_online.values()) == 2 for c in CELLS):
            fleet.check()
            time.sleep(0.05)
        coordinator = fleet.start_coordinator().node
        scrape = coordinator.metrics.serve(0)
        coordinator = fleet.wait_finished(timeout=90)
        exported = urllib.request.urlopen(f"http://127.0.0.1:{scrape.server_address[1]}/metrics", timeout=10).read()
        scrape.shutdown()
        status = CliRunner().invoke(cli, ["rollout", "status", "r1", "--store", coordinator.cfg.store_location,
                                          "--json"])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (
                coordinator.cleared and all("r1" not in fleet.nodes[c].node.manifests for c in CELLS)):
            time.sleep(0.05)
        # Assert: every device in every round reached the coordinator across the bridges, and so did the
        # edges' summaries of who is online: rollout status and /metrics show both devices of each cell.
        assert [row["devices_reported"] for row in coordinator.history] == [4, 4, 4]
        assert status.exit_code == 0, status.output
        cells = json.loads(status.output)["cells"]
        assert {c: (cells[c]["devices_online"], cells[c]["devices_known"]) for c in CELLS} == \
            {c: (2, 2) for c in CELLS}
        online = {sample.labels["cell"]: sample.value for family in text_string_to_metric_families(exported.decode())
                  for sample in family.samples if sample.name == "fedtier_devices_online"}
        assert online == {c: 2.0 for c in CELLS}
        fleet.stop()
        # The bridges carried the coordinator's clean-up to the gateways: nothing of the rollout is
        # left retained on a gateway's broker, nor on the cloud's (read with stopped nodes' identities).
        for cell, (_, port) in cell_brokers.items():
            left = [t for t, _ in retained("127.0.0.1", port, result.devices[CELLS[cell][0]], "ft/v1/#")
                    if not t.startswith("ft/v1/status/")]
            assert left == [], (cell, left)
        left = [t for t, _ in retained("127.0.0.1", cloud_port, result.coordinator, "ft/v1/#")
                if not t.startswith("ft/v1/status/")]
        assert left == []
    finally:
        fleet.stop()
        procs.close()

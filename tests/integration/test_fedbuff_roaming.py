"""Issue 36 item 4: a device of a roaming FedBuff rollout moves between cells mid-rollout and keeps contributing.

A fleet written by ``fedtier provision fleet`` with a broker per gateway, or one broker shared by every node (mutual
TLS, the ACLs it wrote for ``[topology] roaming = true``, client id bound to the certificate), its nodes as threads
built from their bundles.
``once_per_version`` with ``k_edge = 1`` and ``k_cloud`` = the number of devices makes every model version average
every device once, so a version cannot close without the device that moved: it must contribute from its new cell.
The move is how it looks on a board: its agent stops, and starts again with the new cell and that gateway's broker
in its config, on its own state (its outbox, its device-step counter).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import free_port, mosquitto_binary, require
from fleet_helpers import Procs, start_brokers, write_rollout
from fleet_threads import ThreadFleet

from fedtier.cli import cli
from fedtier.runtime.config import dumps_toml, read_toml
from fedtier.wire.messages import CellUpdate, decode_message
from local_fleet.configs import FleetPaths
from provisioning.rollout import provision_fleet

pytestmark = pytest.mark.broker

CELLS = {"cell-a": ["dev-0", "dev-1"], "cell-b": ["dev-2", "dev-3"]}
VERSIONS = 5
FEDBUFF = '''algorithm = "fedbuff"

[topology]
roaming = true

[fedbuff]
local_steps = 3
lr = 0.2
batch_size = 16
k_edge = 1
k_cloud = 4
once_per_version = true
'''


def moved_config(bundle: Path, cell: str, port: int) -> Path:
    """The device's config after a move: the new cell and that gateway's broker (same identity, data and state)."""
    cfg = read_toml(bundle / "device.toml")
    cfg["cell"] = cell
    cfg["broker"]["port"] = port
    path = bundle / f"device-{cell}.toml"
    path.write_text(dumps_toml(cfg))
    return path


def inventory(coordinator: Any) -> dict[str, dict[str, Any]]:
    """``fedtier devices list --json`` of the coordinator's store: node -> its row."""
    listed = CliRunner().invoke(cli, ["devices", "list", "--store", coordinator.cfg.store_location, "--json"])
    assert listed.exit_code == 0, listed.output
    return {d["node"]: d for d in json.loads(listed.output)}


def gated(gate: threading.Event) -> Any:
    """A device hook: its training waits for ``gate`` (the rollout waits with it: no version closes without it)."""
    def prepare(node: Any) -> None:
        train = node.train

        def waiting(trainer: Any, request: Any) -> Any:
            gate.wait(60)
            return train(trainer, request)

        node.train = waiting
    return prepare


def record_outputs(fleet: ThreadFleet, cell: str, into: list[CellUpdate]) -> None:
    """Keep every cell update the edge of ``cell`` stores before it publishes it (its store forgets them when the
    rollout ends)."""
    store = fleet.nodes[cell].node.store
    save = store.save_checkpoint  # an asynchronous edge stores each cell update with its state

    def saving(rollout: str, round: int, key: str, payload: bytes, state: bytes) -> None:
        message = decode_message(payload)
        if isinstance(message, CellUpdate):
            into.append(message)
        save(rollout, round, key, payload, state)

    store.save_checkpoint = saving


def provision(tmp_path: Path, artifact_store: Path, layout: str) -> tuple[Any, int]:
    """2 cells x 2 devices with the ACLs `provision fleet` writes for roaming: a Mosquitto per gateway, or one
    shared by every node. Returns the fleet and the port of cell-b's broker."""
    rollout = write_rollout(tmp_path / "rollout.toml", rollout="roam", port=free_port(), rounds=VERSIONS,
                            cells=CELLS, artifact_store=artifact_store, extra=FEDBUFF)
    cell_brokers = {c: ("127.0.0.1", free_port()) for c in CELLS} if layout == "broker per gateway" else {}
    result = provision_fleet(rollout, tmp_path / "site", cell_brokers=cell_brokers, sample_data=True)
    broker_b = result.brokers["cell-b" if cell_brokers else "shared"]
    acl_b = Path(broker_b["conf"]).with_name("fedtier.acl").read_text()
    assert "topic write ft/v1/+/cell/cell-b/up/dev-1/#" in acl_b  # dev-1 (enrolled in cell-a) may act in cell-b
    return result, int(broker_b["port"])


def move_with_an_upload_in_flight(fleet: ThreadFleet, device: str, cell: str, port: int,
                                  gate: threading.Event) -> int:
    """Stop ``device``, put its newest upload (which its old cell's edge has) back into its outbox, as if that
    cell's broker had taken it but the acknowledgement never reached the agent, and start it again in ``cell``
    (its training held by ``gate``). Returns the device-step ``j`` of that upload."""
    running = fleet.nodes[device].node
    fleet.stop_node(device)
    state = running.state
    version, in_flight = state.last_sent("roam")
    [(key, topic, payload)] = state.uploads("roam", version, in_flight)
    state.put_update(key, topic, payload, "roam", state.last_round("roam"), 0.0, sent=(version, in_flight))
    state.close()
    fleet.paths.devices[device] = moved_config(fleet.paths.devices[device].parent, cell, port)
    fleet.start_device(device, prepare=gated(gate))
    return int(in_flight)


def assert_each_device_step_counted_once(rows: list[dict[str, Any]], stored: dict[str, list[CellUpdate]],
                                         rejected: dict[str, int], in_flight: int) -> None:
    """The committed rows name each device-step once across cells; the edges' stores show the one that reached
    both cells, which the cloud refused (``duplicate_step``) and never folded."""
    counted = [tuple(s) for r in rows for c in CELLS for s in r["cells"][c].get("steps", [])]
    assert len(counted) == 4 * VERSIONS and len(set(counted)) == len(counted), counted
    assert sorted(j for d, j in counted if d == "dev-1") == list(range(VERSIONS))  # one counter across cells
    sent = Counter(tuple(s) for c in CELLS for u in stored[c] for s in u.stats["steps"])
    assert set(sent) == set(counted)
    assert [d for d, n in sent.items() if n > 1] == [("dev-1", in_flight)], sent
    assert rejected == {"duplicate_step": 1}, rejected
    from_b = sorted(j for u in stored["cell-b"] for d, j in u.stats["steps"] if d == "dev-1")
    assert from_b[0] == in_flight and len(from_b) > 1, from_b  # the upload in flight, then new steps from cell-b


@pytest.mark.parametrize("layout", ["broker per gateway", "shared broker"])
def test_a_device_that_moves_to_another_cell_keeps_contributing_and_no_step_counts_twice(
        tmp_path: Path, artifact_store: Path, layout: str) -> None:
    require(mosquitto_binary() is not None, "Mosquitto (apt-get install mosquitto)")
    # Prepare
    result, port_b = provision(tmp_path, artifact_store, layout)
    paths = FleetPaths(coordinator=result.rollout_config,
                       edges={c: p / "edge.toml" for c, p in result.gateways.items()},
                       devices={d: p / "device.toml" for d, p in result.devices.items()}, workdir=result.out)
    procs = Procs(tmp_path)
    fleet = ThreadFleet(paths)
    stored: dict[str, list[CellUpdate]] = {c: [] for c in CELLS}
    try:
        start_brokers(procs, result.brokers)
        for cell in CELLS:
            fleet.start_edge(cell)
            record_outputs(fleet, cell, stored[cell])
        for device in result.devices:
            fleet.start_device(device)
        coordinator = fleet.start_coordinator().node
        # Execute: once version 2 is committed and cell-a's edge has dev-1's newest upload, dev-1 leaves cell-a and
        # turns up in cell-b, with that upload "in flight".
        state = fleet.nodes["dev-1"].node.state

        def newest_upload_at_cell_a() -> bool:
            sent = state.last_sent("roam")
            return sent is not None and not state.pending() and any(
                s == ["dev-1", sent[1]] for u in stored["cell-a"] for s in u.stats["steps"])

        fleet.wait_until(lambda: len(coordinator.history) >= 2 and newest_upload_at_cell_a(),
                         "model version 2 and dev-1's newest upload at cell-a", timeout=90)
        gate = threading.Event()
        in_flight = move_with_an_upload_in_flight(fleet, "dev-1", "cell-b", port_b, gate)
        # The version cannot close without dev-1, whose training waits until `devices list` shows it in cell-b.
        fleet.wait_until(lambda: inventory(coordinator).get("dev-1", {}).get("cell") == "cell-b",
                         "`devices list` to show dev-1 in cell-b", 30)
        seen = inventory(coordinator)
        gate.set()
        coordinator = fleet.wait_finished(timeout=120)
        rejected: dict[str, int] = dict(getattr(coordinator.role, "rejected", {}))
    finally:
        fleet.stop()
        procs.close()

    # Assert: the rollout finished; every version averaged every device once, dev-1 through cell-a before the move
    # and through cell-b after it; no device-step counted twice.
    rows = coordinator.history
    assert [r["devices_reported"] for r in rows] == [4] * VERSIONS, rows
    via = [{c: r["cells"][c]["reported"] for c in CELLS} for r in rows]
    assert "dev-1" in via[0]["cell-a"] and "dev-1" in via[-1]["cell-b"] and "dev-1" not in via[-1]["cell-a"], via
    assert all(r["cells"][c]["missing"] == [] for r in rows for c in CELLS)  # dev-1 reported, through another cell
    assert_each_device_step_counted_once(rows, stored, rejected, in_flight)
    # Presence: while it ran, and at its end, the inventory (`fedtier devices list`) showed dev-1 online in cell-b,
    # where cell-b's edge summary put it (a gateway's broker keeps devices' own presence from the cloud) or its own
    # presence there (a shared broker; its offline document in cell-a stays retained).
    assert (seen["dev-1"]["cell"], seen["dev-1"]["state"]) == ("cell-b", "online"), seen["dev-1"]
    assert {d: seen[d]["cell"] for d in ("dev-0", "dev-2", "dev-3")} == {"dev-0": "cell-a", "dev-2": "cell-b",
                                                                        "dev-3": "cell-b"}
    assert inventory(coordinator)["dev-1"]["cell"] == "cell-b"

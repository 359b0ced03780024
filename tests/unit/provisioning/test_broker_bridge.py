"""Gateway brokers bridged to the cloud broker: which topics cross, in which direction, as whom."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_fleet_cli import Cli, allowed, cli, fleet_dir, grants  # noqa: F401  (fixtures)

from fedtier.transport import topics
from fedtier.transport.topic_filters import topic_matches
from fedtier.wire.messages import MESSAGE_TYPES
from provisioning import broker_config
from provisioning.broker_bridge import bridge_topics

R, CELL, CLOUD = "r1", "c0", "cloud"


def crosses(topic: str, direction: str) -> bool:
    return any(d == direction and topic_matches(f, topic) for d, f in bridge_topics(CELL, CLOUD))


def test_exactly_the_edges_cloud_side_crosses_each_way_and_the_cloud_acl_grants_it() -> None:
    cloud_acl = broker_config.broker_acl(cloud_side=[CELL, "c1"], cloud_id=CLOUD)
    for kind in sorted(MESSAGE_TYPES):
        # The coordinator's tasks for this cell come in; another cell's do not.
        assert crosses(topics.cloud_down(R, CELL, kind), "in")
        assert not crosses(topics.cloud_down(R, "c1", kind), "in")
        # The cell's aggregates go out, under the gateway's name the cloud ACL lets write them.
        assert crosses(topics.edge_up(R, CELL, kind), "out")
        assert allowed(cloud_acl, CELL, "write", topics.edge_up(R, CELL, kind))
        assert not crosses(topics.edge_up(R, "c1", kind), "out")
        # Devices' traffic never leaves the gateway, in either direction.
        for direction in ("in", "out"):
            assert not crosses(topics.cell_up(R, CELL, "d0", kind), direction)
            assert not crosses(topics.cell_down(R, CELL, kind), direction)
    assert crosses(topics.manifest(R), "in") and allowed(cloud_acl, CELL, "read", topics.manifest(R))
    assert crosses(topics.status(CLOUD), "in") and allowed(cloud_acl, CELL, "read", topics.status(CLOUD))
    assert crosses(topics.status(CELL), "out") and allowed(cloud_acl, CELL, "write", topics.status(CELL))
    for direction in ("in", "out"):
        assert not crosses(topics.status("d0"), direction)
    # Every remote filter of the bridge is one the cloud ACL grants the gateway (else Mosquitto drops it).
    for direction, pattern in bridge_topics(CELL, CLOUD):
        access = "read" if direction == "in" else "write"
        exact = "+" not in pattern and "#" not in pattern
        assert pattern in grants(cloud_acl, CELL, access) or (exact and allowed(cloud_acl, CELL, access, pattern))


def test_broker_config_bridge_to_writes_the_bridge_and_a_two_sided_gateway_account(
        tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:  # noqa: F811
    out, gateway = tmp_path / "gw0", tmp_path / "gateway"
    cli("broker", "gw0", "--fleet", fleet_dir, "--host", "127.0.0.1", "--out", out)
    cli("gateway", CELL, "--fleet", fleet_dir, "--broker", "127.0.0.1:18883", "--out", gateway)
    cli("broker-config", "--cell", CELL, "--fleet", fleet_dir, "--out", out, "--port", 18883,
        "--bridge-to", "cloud.example:8883", "--bridge-cert", gateway / "cert.pem", "--bridge-key", gateway / "key.pem")
    conf = (out / "mosquitto.conf").read_text().splitlines()
    for line in ("connection fedtier-c0", "address cloud.example:8883", "bridge_insecure false", "try_private true",
                 f"bridge_certfile {gateway / 'cert.pem'}", f"bridge_cafile {out / 'ca.pem'}",
                 "topic ft/v1/+/edge/c0/up/# out 1", "topic ft/v1/+/cloud/down/c0/# in 1"):
        assert line in conf, line
    acl = (out / "fedtier.acl").read_text()
    # The edge uses this broker for both of its sides.
    assert allowed(acl, CELL, "write", topics.edge_up(R, CELL, "cell_update"))
    assert allowed(acl, CELL, "read", topics.cloud_down(R, CELL, "cell_task"))
    assert allowed(acl, CELL, "read", topics.cell_up(R, CELL, "d0", "device_update"))


@pytest.mark.parametrize("case", ["device cert", "missing key", "no cert"])
def test_a_bridge_that_would_not_authenticate_as_the_gateway_is_refused(
        tmp_path: Path, fleet_dir: Path, cli: Cli, case: str) -> None:  # noqa: F811
    out = tmp_path / "gw0"
    cli("broker", "gw0", "--fleet", fleet_dir, "--host", "127.0.0.1", "--out", out)
    cli("device", "d0", "--cell", CELL, "--fleet", fleet_dir, "--broker", "127.0.0.1:18883", "--out", tmp_path / "d0")
    args = ["broker-config", "--cell", CELL, "--fleet", fleet_dir, "--out", out, "--bridge-to", "cloud.example:8883"]
    if case == "device cert":
        result = cli(*args, "--bridge-cert", tmp_path / "d0" / "cert.pem", "--bridge-key", tmp_path / "d0" / "key.pem",
                     ok=False)
        assert "not of the gateway of cell 'c0'" in result.output
    elif case == "missing key":
        result = cli(*args, "--bridge-cert", tmp_path / "d0" / "cert.pem", ok=False)
        assert "--bridge-key" in result.output
    else:
        result = cli(*args, ok=False)
        assert "--bridge-cert" in result.output
    assert not (out / "mosquitto.conf").exists()

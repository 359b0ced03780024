"""Failures that say what is wrong, through a real Mosquitto running the configs ``provision fleet``
wrote (mutual TLS, CRL, ACL, client id bound to the certificate).

For each failure the node's log names the cause and the fix; credential failures (a certificate
refused by either side, an ACL refusal) end the node with exit code 77 after
``max_auth_failures`` tries; connection failures are retried, logged once and then
rate-limited. A second agent with a copied bundle is reported by both agents and counted at
the edge, and a device's certificate cannot connect under another device's client id.
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import shutil
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import paho.mqtt.client as mqtt
import pytest
from conftest import free_port, mosquitto_binary, require, wait_port
from fleet_helpers import Procs, start_brokers, write_rollout
from paho.mqtt.enums import CallbackAPIVersion

from fedtier.rollout.config import RolloutConfig
from local_fleet.configs import bundle_settings
from device_agent.config import DeviceConfig
from edge_broker.config import EdgeConfig
from fedtier.runtime.config import load, read_toml
from fedtier.runtime.mqtt_service import EXIT_UNAUTHORIZED
from fedtier.runtime.node_base import IDENTITY_CONFLICTS
from fedtier.security import pki
from fedtier.transport import mqtt as transport
from fedtier.transport import topics
from provisioning import ca
from provisioning.broker_config import current_user, publish_crl, write_cell_broker_config
from provisioning.bundles import issue_broker
from provisioning.fleet import Fleet
from provisioning.rollout import FleetResult, provision_fleet

pytestmark = pytest.mark.broker

CELLS = {"cell-a": ["dev-0", "dev-1", "dev-2"]}
TRIES = 2  # max_auth_failures in these tests


@dataclass
class World:
    root: Path
    result: FleetResult
    fleet: Fleet
    port: int
    procs: Procs
    other_ca: Path

    def bundle(self, name: str) -> Path:
        return self.result.devices.get(name) or self.result.gateways.get(name) or self.result.coordinator


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, artifact_store: Path) -> Iterator[World]:
    require(mosquitto_binary() is not None, "Mosquitto (apt-get install mosquitto)")
    root = tmp_path_factory.mktemp("failures")
    port = free_port()
    rollout = write_rollout(root / "rollout.toml", rollout="f1", port=port, cells=CELLS,
                            artifact_store=artifact_store)
    result = provision_fleet(rollout, root / "site", sample_data=True)
    fleet = Fleet(result.fleet)
    # A revoked device, an expired one and another fleet's device, all named like fleet members.
    revoked = root / "revoked"
    shutil.copytree(result.devices["dev-2"], revoked)
    fleet.revoke("dev-2")
    publish_crl(fleet, [Path(result.brokers["shared"]["dir"])])
    key = pki.generate_tls_key()
    now = ca.utcnow()
    _, cert = fleet.issue("old", "device", key.public_key(), cell="cell-a", not_before=now - dt.timedelta(days=30),
                          not_after=now - dt.timedelta(days=1))
    pki.write_private_key(root / "old" / "key.pem", key)
    pki.write_certificate(root / "old" / "cert.pem", cert)
    other_key, other_cert = ca.create_ca("another fleet's CA")
    pki.write_certificate(root / "other-ca.pem", other_cert)
    key = pki.generate_tls_key()
    pki.write_private_key(root / "alien" / "key.pem", key)
    pki.write_certificate(root / "alien" / "cert.pem",
                          ca.issue_node_certificate(other_key, other_cert, key.public_key(), "dev-0"))
    procs = Procs(root)
    start_brokers(procs, result.brokers)
    yield World(root, result, fleet, port, procs, root / "other-ca.pem")
    procs.close()


def device_config(world: World, tmp: Path, bundle: str = "dev-0", **broker: Any) -> DeviceConfig:
    """The bundle's device.toml with its own state directory and ``broker`` overrides."""
    path = world.result.devices[bundle]
    data = read_toml(path / "device.toml")
    data.update(bundle_settings(path))
    data["broker"].update({"max_auth_failures": TRIES, **{k: str(v) if isinstance(v, Path) else v
                                                           for k, v in broker.items()}})
    data.update(data_dir=str(path / "data"), state_dir=str(tmp / f"state-{len(list(tmp.glob('state-*')))}"))
    return DeviceConfig.from_mapping(data, source="test")


def run_in_thread(target: Callable[..., int], cfg: Any) -> tuple[threading.Thread, threading.Event, list[int]]:
    stop, codes = threading.Event(), []
    thread = threading.Thread(target=lambda: codes.append(target(cfg, stop)), daemon=True)
    thread.start()
    return thread, stop, codes


def agent_exit_code(cfg: DeviceConfig, timeout: float = 30.0) -> int:
    from device_agent.run import run

    thread, stop, codes = run_in_thread(run, cfg)
    thread.join(timeout)
    stop.set()
    thread.join(10)
    assert codes, "the agent did not end by itself"
    return codes[0]


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


# --- failures that heal: logged once, then rate-limited; retried forever ------------------------------


@pytest.mark.parametrize("case", ["refused", "dns"])
def test_a_broker_that_cannot_be_reached_is_named_once_and_retried(
        world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str) -> None:
    from device_agent.run import run

    broker = {"port": free_port()} if case == "refused" else {"host": "no-such-host.invalid"}
    expected = "refused: nothing listens there" if case == "refused" else "cannot resolve the broker's host name"
    caplog.set_level(logging.DEBUG, logger="fedtier.transport.mqtt")
    thread, stop, codes = run_in_thread(run, device_config(world, tmp_path, **broker))

    def attempts() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "fedtier.transport.mqtt" and expected in r.getMessage()]

    deadline = time.monotonic() + 30  # paho retries after 1 s, then 2 s: a second attempt within 3 s when idle
    while len(attempts()) < 2 and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    stop.set()
    thread.join(10)
    records = attempts()
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(records) >= 2, "expected several attempts"
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # the first; repeats at most once a minute
    assert "[broker]" in warnings[0].getMessage()  # the fix names the setting
    assert codes == [0]  # stopped by us, not given up: this may heal


# --- credential failures: named, then exit code 77 -------------------------------------------------------


def test_another_fleets_certificate_is_named_and_ends_the_agent(
        world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = device_config(world, tmp_path, tls_cert=world.root / "alien" / "cert.pem",
                        tls_key=world.root / "alien" / "key.pem")
    assert agent_exit_code(cfg) == EXIT_UNAUTHORIZED
    assert any("not issued by the CA the broker trusts" in m for m in messages(caplog, logging.ERROR))
    assert any("giving up after 2 authorization failures" in m for m in messages(caplog, logging.ERROR))


def test_a_revoked_certificate_is_named_and_ends_the_agent(
        world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    revoked = world.root / "revoked"
    cfg = device_config(world, tmp_path, "dev-2", tls_cert=revoked / "cert.pem", tls_key=revoked / "key.pem")
    assert agent_exit_code(cfg) == EXIT_UNAUTHORIZED
    assert any("it has been revoked" in m and "fedtier provision revoke" in m for m in messages(caplog, logging.ERROR))


def test_an_expired_certificate_is_named_by_the_agent_before_it_connects(
        world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    old = world.root / "old"
    cfg = DeviceConfig.from_mapping({**device_config(world, tmp_path).to_dict(), "device_id": "old",
                                     "broker": {**device_config(world, tmp_path).broker.to_dict(),
                                                "tls_cert": str(old / "cert.pem"), "tls_key": str(old / "key.pem")}})
    assert agent_exit_code(cfg) == EXIT_UNAUTHORIZED
    assert any("expired on" in m and "fedtier provision rotate old" in m for m in messages(caplog, logging.ERROR))


def test_an_expired_certificate_is_refused_by_the_broker_with_its_cause(world: World) -> None:
    """The transport's own diagnosis (without the agent's check at start) of the broker's refusal."""
    cfg = device_config(world, world.root)
    old = world.root / "old"
    tls = transport.TlsSettings(ca_file=str(cfg.broker.tls_ca), cert_file=str(old / "cert.pem"),
                                key_file=str(old / "key.pem"))
    tx = transport.MqttTransport(name="t", client_id="old", host="127.0.0.1", port=world.port, inbox=queue.Queue(),
                                 tls=tls, max_auth_failures=TRIES).start()
    try:
        deadline = time.monotonic() + 15
        while tx.fatal is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        tx.stop()
    assert tx.fatal is not None and tx.fatal.cause == "tls_expired" and "rotate" in tx.fatal.fix


@pytest.mark.parametrize("case", ["another fleet's broker", "host name not in its certificate"])
def test_a_broker_certificate_the_agent_cannot_trust_is_named_and_ends_it(
        world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str) -> None:
    procs = Procs(tmp_path)
    try:
        if case == "another fleet's broker":
            cfg = device_config(world, tmp_path, tls_ca=world.other_ca)
            expected = "presented a certificate this node does not trust"
        else:  # a broker of this fleet whose certificate lists only gw.example, dialled at 127.0.0.1
            port = free_port()
            issue_broker(world.fleet, "gw-elsewhere", ["gw.example"], tmp_path / "broker")
            setup = write_cell_broker_config(world.fleet, "cell-a", tmp_path / "broker", port=port, bind="127.0.0.1",
                                             run_as=current_user())
            procs.start("broker-elsewhere", [str(mosquitto_binary()), "-c", str(setup.conf)])
            wait_port(port)
            cfg = device_config(world, tmp_path, port=port)
            expected = "presented a certificate that is not valid for '127.0.0.1'"
        assert agent_exit_code(cfg) == EXIT_UNAUTHORIZED
        assert any(expected in m for m in messages(caplog, logging.ERROR)), messages(caplog)
    finally:
        procs.close()


def test_an_acl_that_refuses_the_coordinator_is_named_and_ends_it(
        world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The coordinator on a broker configured for one cell only (no rule for the cloud's topics)."""
    from cloud_coordinator.run import run

    port = free_port()
    issue_broker(world.fleet, "gw-cell-only", ["127.0.0.1"], tmp_path / "broker")
    setup = write_cell_broker_config(world.fleet, "cell-a", tmp_path / "broker", port=port, bind="127.0.0.1",
                                     run_as=current_user())
    procs = Procs(tmp_path)
    try:
        procs.start("broker-cell-only", [str(mosquitto_binary()), "-c", str(setup.conf)])
        wait_port(port)
        base = load(RolloutConfig, world.result.rollout_config).to_dict()
        base["broker"].update(port=port, max_auth_failures=TRIES)
        base["state_dir"] = str(tmp_path / "coordinator")
        cfg = RolloutConfig.from_mapping(base)
        thread, stop, codes = run_in_thread(run, cfg)
        thread.join(60)
        stop.set()
        thread.join(10)
    finally:
        procs.close()
    assert codes == [EXIT_UNAUTHORIZED]
    refused = [m for m in messages(caplog, logging.ERROR) if "refused 'cloud' publishing on ft/v1/f1/manifest" in m]
    assert refused and "not authorized (reason code 135)" in refused[0] and "fedtier provision fleet" in refused[0]


# --- identity bound to the certificate ---------------------------------------------------------------------


class RawClient:
    def __init__(self, port: int, bundle: Path, client_id: str) -> None:
        self.disconnects: list[object] = []
        self.acks: "queue.Queue[int]" = queue.Queue()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        ctx = ssl.create_default_context(cafile=str(bundle / "ca.pem"))
        ctx.load_cert_chain(str(bundle / "cert.pem"), str(bundle / "key.pem"))
        self.client.tls_set_context(ctx)
        self.client.on_disconnect = lambda c, u, f, rc, p: self.disconnects.append(rc)
        self.client.on_publish = lambda c, u, mid, rc, p: self.acks.put(int(rc.value))
        connected = threading.Event()
        self.client.on_connect = lambda c, u, f, rc, p: connected.set()
        self.client.reconnect_delay_set(1, 1)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert connected.wait(5)

    def publish(self, topic: str) -> int:
        self.client.publish(topic, b"x", qos=1)
        return self.acks.get(timeout=5)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_a_device_certificate_cannot_connect_under_another_devices_client_id(world: World) -> None:
    victim = RawClient(world.port, world.bundle("dev-1"), "dev-1")
    impostor = RawClient(world.port, world.bundle("dev-0"), "dev-1")  # dev-0's certificate asks for dev-1's id
    try:
        # A sentinel: a takeover happens as the broker accepts the impostor (before its CONNACK); its DISCONNECT
        # would reach the victim before the PUBACK of anything the victim publishes afterwards.
        victim.publish(topics.cell_up("f1", "cell-a", "dev-1", "device_update"))
        assert victim.disconnects == []  # it was not taken over: the broker gave the impostor the id dev-0
        assert impostor.publish(topics.cell_up("f1", "cell-a", "dev-1", "device_update")) == 135
        assert victim.publish(topics.cell_up("f1", "cell-a", "dev-1", "device_update")) < 128
        assert impostor.publish(topics.cell_up("f1", "cell-a", "dev-0", "device_update")) < 128  # it is dev-0
        assert victim.disconnects == []
    finally:
        impostor.close()
        victim.close()


def test_two_agents_with_a_copied_bundle_are_reported_and_counted_at_the_edge(
        world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from device_agent.run import run as run_agent
    from edge_broker.run import build as build_edge
    from fedtier.runtime import mqtt_service

    gateway = world.result.gateways["cell-a"]
    edge_cfg = load(EdgeConfig, gateway / "edge.toml")
    edge_cfg = EdgeConfig.from_mapping({**edge_cfg.to_dict(), "state_dir": str(tmp_path / "edge")})
    node, transports, inbox = build_edge(edge_cfg)
    edge_stop = threading.Event()
    edge = threading.Thread(target=mqtt_service.run, args=(node, transports, inbox), daemon=True,
                            kwargs={"start": node.start, "stop": edge_stop, "install_signals": False})
    edge.start()
    runs = [run_in_thread(run_agent, device_config(world, tmp_path, "dev-1")) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60  # two agents take turns; slower on a loaded machine
        while time.monotonic() < deadline and not (
                node.metrics.get(IDENTITY_CONFLICTS, identity="dev-1") >= 1
                and any("another client connected as 'dev-1'" in m for m in messages(caplog, logging.ERROR))):
            time.sleep(0.1)
    finally:
        for _, stop, _ in runs:
            stop.set()
        edge_stop.set()
        for thread, _, _ in runs:
            thread.join(10)
        edge.join(10)
    assert node.metrics.get(IDENTITY_CONFLICTS, identity="dev-1") >= 1
    errors = messages(caplog, logging.ERROR)
    assert any("two clients use the identity dev-1" in m for m in errors), errors
    assert any("another client connected as 'dev-1'" in m and "copied bundle" in m for m in errors), errors

"""Provisioned identities against a real Mosquitto running the generated configs.

One combined broker (every cell + the cloud, ``combined_broker_config``) serves the module:
mutual TLS, the fleet's CRL and the generated ACL. Clients use the bundles' own files.
Checked: who gets in (a provisioned device, CSR-enrolled or not) and who does not (no
certificate, another CA, expired, revoked — at start and after a SIGHUP —, a broker's
server certificate, plain TCP); and that each role's ACL grants exactly the topics that
role uses in ``fedtier.transport.topics``, and nothing of another device or cell.
"""

from __future__ import annotations

import datetime as dt
import os
import pwd
import queue
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import paho.mqtt.client as mqtt
import pytest
from conftest import free_port, mosquitto_binary, require, system_user, wait_port
from cryptography.hazmat.primitives import serialization
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes

from device_agent.enroll import enroll
from fedtier.security import pki
from fedtier.transport import topics
from fedtier.wire.messages import MESSAGE_TYPES
from provisioning import broker_config, bundles, ca
from provisioning.broker_config import BrokerSetup, combined_broker_config, write_cell_broker_config
from provisioning.fleet import Fleet

pytestmark = pytest.mark.broker

CELLS = ["c0", "c1"]
ROLLOUT = "r1"
KINDS = sorted(MESSAGE_TYPES)  # the ACL is kind-agnostic: every message kind must pass
NOT_AUTHORIZED = 135


# --- identities and the broker -----------------------------------------------------------------


@dataclass
class Identity:
    ca: Path
    cert: Path
    key: Path


def _ident(directory: Path, ca_path: Path | None = None) -> Identity:
    return Identity(ca=ca_path or directory / "ca.pem", cert=directory / "cert.pem", key=directory / "key.pem")


@dataclass
class World:
    fleet: Fleet
    setup: BrokerSetup
    proc: subprocess.Popen
    log: Path
    ids: dict[str, Identity]
    configs: dict[str, Path]

    @property
    def port(self) -> int:
        return self.setup.port

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _start(binary: str, setup: BrokerSetup, log: Path) -> subprocess.Popen:
    with open(log, "ab") as fh:
        proc = subprocess.Popen(setup.command(binary), stdout=fh, stderr=subprocess.STDOUT)
    try:
        wait_port(setup.port, timeout=5)
    except RuntimeError:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"mosquitto did not start:\n{log.read_text()}") from None
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    binary = mosquitto_binary()
    require(binary is not None, "Mosquitto (apt-get install mosquitto)")
    assert binary is not None
    root = tmp_path_factory.mktemp("provisioned")
    fleet = Fleet.init(root / "fleet")
    port = free_port()
    b = ("127.0.0.1", port)
    ids: dict[str, Identity] = {}
    ids["cloud"] = _ident(bundles.issue_coordinator(fleet, b, root / "cloud").path)
    for cell in CELLS:
        ids[cell] = _ident(bundles.issue_gateway(fleet, cell, b, root / cell).path)
    for name, cell in (("d0", "c0"), ("d1", "c0"), ("e0", "c1"), ("victim", "c0"), ("gone", "c0")):
        ids[name] = _ident(bundles.issue_device(fleet, name, cell, b, root / name).path)
    # Enrolled with its own key: the bundle (no key.pem) is unpacked next to it.
    csr = enroll("csr0", root / "csr0")
    bundles.sign_csr(fleet, csr, "c0", b, root / "csr0-bundle")
    for f in ("cert.pem", "ca.pem", "device.toml"):
        shutil.copy(root / "csr0-bundle" / f, root / "csr0" / f)
    ids["csr0"] = _ident(root / "csr0")
    configs = {"device": root / "d0" / "device.toml", "csr-device": root / "csr0" / "device.toml",
               "edge": root / "c1" / "edge.toml", "coordinator": root / "cloud" / "coordinator.toml"}
    # Expired: a validity window in the past, through the library API.
    key = pki.generate_tls_key()
    now = ca.utcnow()
    _, cert = fleet.issue("old", "device", key.public_key(), cell="c0", not_before=now - dt.timedelta(days=30),
                          not_after=now - dt.timedelta(days=1))
    pki.write_private_key(root / "old" / "key.pem", key)
    pki.write_certificate(root / "old" / "cert.pem", cert)
    ids["old"] = _ident(root / "old", fleet.ca_cert_path)
    # Another CA's device with a plausible name.
    other_key, other_ca = ca.create_ca("someone else's CA")
    key = pki.generate_tls_key()
    pki.write_private_key(root / "alien" / "key.pem", key)
    pki.write_certificate(root / "alien" / "cert.pem",
                          ca.issue_node_certificate(other_key, other_ca, key.public_key(), "d9"))
    ids["alien"] = _ident(root / "alien", fleet.ca_cert_path)
    fleet.revoke("gone")  # revoked before the broker starts
    setup = combined_broker_config(CELLS, "cloud", fleet=fleet, out=root / "broker", port=port)
    ids["broker"] = Identity(ca=fleet.ca_cert_path, cert=setup.cert, key=setup.key)
    log = root / "mosquitto.log"
    proc = _start(binary, setup, log)
    yield World(fleet, setup, proc, log, ids, configs)
    _stop(proc)


# --- clients -----------------------------------------------------------------------------------------


def _context(ident: Identity | None, ca_path: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_path))
    if ident is not None:
        ctx.load_cert_chain(str(ident.cert), str(ident.key))
    return ctx


def raw_connect(port: int, ctx: ssl.SSLContext | None, client_id: str = "probe", *, await_alert: float = 0.0) -> str:
    """TLS handshake (if ``ctx``) + an MQTT 3.1.1 CONNECT; "connack:<rc>" or why not.

    With TLS 1.3 the server checks the client certificate after the client's side of the
    handshake has finished, so a refusal arrives as an alert on the first read. Writing the
    CONNECT first can make the server's close a TCP reset that discards the alert, so with
    ``await_alert`` the client first listens that long for it.
    """
    cid = client_id.encode()
    body = b"\x00\x04MQTT\x04\x02\x00\x0a" + len(cid).to_bytes(2, "big") + cid
    packet = b"\x10" + bytes([len(body)]) + body
    sock = socket.create_connection(("127.0.0.1", port), timeout=3)
    try:
        conn: socket.socket = ctx.wrap_socket(sock, server_hostname="127.0.0.1") if ctx else sock
        if await_alert:
            conn.settimeout(await_alert)
            try:
                if not conn.recv(1):
                    return "closed"
            except socket.timeout:
                pass
            conn.settimeout(3)
        conn.sendall(packet)
        data = conn.recv(4)
        if len(data) == 4 and data[0] == 0x20:
            return f"connack:{data[3]}"
        return "closed" if not data else f"garbage:{data!r}"
    except ssl.SSLError as exc:
        return f"tls:{exc.reason}"
    except (ConnectionResetError, BrokenPipeError, socket.timeout) as exc:
        return f"closed:{type(exc).__name__}"
    finally:
        sock.close()


class Client:
    """A paho MQTT 5 client over mutual TLS that waits for every acknowledgement."""

    def __init__(self, port: int, ident: Identity, client_id: str, *, will: str | None = None) -> None:
        self.messages: "queue.Queue[tuple[str, bytes, bool]]" = queue.Queue()
        self._acks: dict[int, Any] = {}
        self._cond = threading.Condition()
        self.connack: object = None
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self.client.tls_set_context(_context(ident, ident.ca))
        if will is not None:
            self.client.will_set(will, b"offline", qos=1, retain=True)
        self.client.on_connect = self._on_connect
        self.client.on_publish = lambda c, u, mid, rc, p: self._ack(mid, rc)
        self.client.on_subscribe = lambda c, u, mid, rcs, p: self._ack(mid, rcs)
        self.client.on_message = lambda c, u, m: self.messages.put((m.topic, bytes(m.payload), bool(m.retain)))
        self.client.connect("127.0.0.1", port, keepalive=10)
        self.client.loop_start()
        with self._cond:
            self._cond.wait_for(lambda: self.connack is not None, timeout=5)

    def _on_connect(self, client: object, userdata: object, flags: object, rc: object, props: object) -> None:
        with self._cond:
            self.connack = rc
            self._cond.notify_all()

    def _ack(self, mid: int, value: object) -> None:
        with self._cond:
            self._acks[mid] = value
            self._cond.notify_all()

    def _wait(self, mid: int | None) -> Any:
        assert mid is not None
        with self._cond:
            assert self._cond.wait_for(lambda: mid in self._acks, timeout=5), "no acknowledgement"
            return self._acks.pop(mid)

    def publish(self, topic: str, payload: bytes = b"x", retain: bool = False) -> int:
        """The PUBACK reason code (0 success, 16 no subscribers, 135 not authorized)."""
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        return int(self._wait(info.mid).value)

    def subscribe(self, topic_filter: str) -> int:
        """The SUBACK reason code (granted QoS, or >= 128 for a failure)."""
        _, mid = self.client.subscribe(topic_filter, qos=1)
        codes = self._wait(mid)
        return int(codes[0].value)

    def received(self, wait: float = 0.3) -> set[str]:
        """Topics received so far (after waiting ``wait`` seconds for stragglers)."""
        time.sleep(wait)
        got = set()
        while True:
            try:
                got.add(self.messages.get_nowait()[0])
            except queue.Empty:
                return got

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def clients(world: World) -> Iterator[dict[str, Client]]:
    """Connected clients by node id, created on first use and closed after the test."""
    made: dict[str, Client] = {}

    class Factory(dict[str, Client]):
        def __missing__(self, name: str) -> Client:
            client_id = f"{name}.up" if name in CELLS else name  # the edge's cloud connection id
            c = Client(world.port, world.ids[name], client_id, will=topics.status(name))
            assert getattr(c.connack, "value", None) == 0, f"{name} could not connect: {c.connack}"
            made[name] = c
            self[name] = c
            return c

    yield Factory()
    for c in made.values():
        c.close()


# --- who gets in -----------------------------------------------------------------------------------


def test_provisioned_identities_connect_over_mutual_tls(world: World) -> None:
    for name in ("d0", "csr0", "c0", "cloud"):
        ident = world.ids[name]
        assert raw_connect(world.port, _context(ident, ident.ca), name) == "connack:0", name


def test_the_bundles_configs_connect_with_the_fedtier_transport(world: World) -> None:
    """device.toml / edge.toml / coordinator.toml as written, through fedtier's own MQTT transport
    (which verifies the broker's certificate and host name against the fleet CA)."""
    from fedtier.rollout.config import RolloutConfig
    from device_agent.config import DeviceConfig
    from edge_broker.config import EdgeConfig
    from fedtier.runtime.config import load
    from fedtier.transport import mqtt as transport

    dev, csr_dev = load(DeviceConfig, world.configs["device"]), load(DeviceConfig, world.configs["csr-device"])
    edge = load(EdgeConfig, world.configs["edge"])
    coord = load(RolloutConfig, world.configs["coordinator"])
    links = [(dev.broker, dev.device_id), (csr_dev.broker, csr_dev.device_id), (edge.cell_broker, edge.cell),
             (edge.cloud_broker, f"{edge.cell}.up"), (coord.broker, coord.cloud_id)]
    started = []
    try:
        for cfg, client_id in links:
            tx = transport.from_config(cfg, name="t", client_id=client_id, inbox=queue.Queue(),
                                       status={"node": client_id.split(".")[0]})
            started.append(tx.start())
        for tx in started:
            assert tx.wait_connected(10), f"{tx.client_id} did not connect"
    finally:
        for tx in started:
            tx.stop()


def test_an_agent_publishing_under_another_id_is_refused_and_logs_it(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """Through fedtier's own transport with the device bundle's config: the broker answers
    PUBACK 135 and the agent's log says so (the operator's view of an ACL denial)."""
    from device_agent.config import DeviceConfig
    from fedtier.runtime.config import load
    from fedtier.transport import mqtt as transport

    dev = load(DeviceConfig, world.configs["device"])
    tx = transport.from_config(dev.broker, name=dev.device_id, client_id=dev.device_id, inbox=queue.Queue(),
                               status={"node": dev.device_id}).start()
    try:
        assert tx.wait_connected(10)
        with caplog.at_level("WARNING", logger="fedtier.transport.mqtt"):
            tx.publish(topics.cell_up(ROLLOUT, dev.cell, "d1", "device_update"), b"forged")
            tx.publish(topics.cell_up(ROLLOUT, dev.cell, dev.device_id, "device_update"), b"own")
            deadline = time.monotonic() + 5
            while not tx.denials and time.monotonic() < deadline:
                time.sleep(0.02)
        assert tx.denials == [("publish", NOT_AUTHORIZED)]  # only the forged one
        assert any("broker refused 'd0' publishing on" in r.getMessage() and "reason code 135" in r.getMessage()
                   and "ACL" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
    finally:
        tx.stop()


REFUSALS = {  # case -> (identity, the TLS alert the broker answers with over TLS 1.3)
    "no client certificate": (None, "CERTIFICATE_REQUIRED"),
    "another CA": ("alien", "UNKNOWN_CA"),
    "expired": ("old", "CERTIFICATE_EXPIRED"),
    "revoked": ("gone", "CERTIFICATE_REVOKED"),
    "server certificate as client": ("broker", "UNSUPPORTED_CERTIFICATE"),  # EKU serverAuth only
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_the_broker_refuses_the_certificate(world: World, case: str) -> None:
    name, alert = REFUSALS[case]
    ctx = _context(world.ids[name] if name else None, world.fleet.ca_cert_path)
    outcome = raw_connect(world.port, ctx, "d9", await_alert=2.0)
    assert outcome.startswith("tls:") and alert in outcome, f"{case}: {outcome}"


def test_the_broker_refuses_plain_tcp(world: World) -> None:
    outcome = raw_connect(world.port, None, "d0")
    assert not outcome.startswith("connack"), outcome


def test_a_revocation_takes_effect_on_sighup(world: World, tmp_path: Path) -> None:
    # A broker of its own, with no other sessions: Mosquitto 2.0.11 has segfaulted on SIGHUP
    # with the sessions the other tests leave behind (docs/security.md, "Mosquitto specifics").
    binary = mosquitto_binary()
    assert binary is not None
    setup = combined_broker_config(CELLS, "cloud", fleet=world.fleet, out=tmp_path / "broker", port=free_port())
    proc = _start(binary, setup, tmp_path / "mosquitto.log")
    try:
        ident = world.ids["victim"]
        assert raw_connect(setup.port, _context(ident, ident.ca), "victim") == "connack:0"
        world.fleet.revoke("victim")  # rewrites the fleet's crl.pem, which the combined broker reads
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        outcome = "connack:0"
        while time.monotonic() < deadline and outcome == "connack:0":
            time.sleep(0.1)
            outcome = raw_connect(setup.port, _context(ident, ident.ca), "victim", await_alert=0.5)
        assert "CERTIFICATE_REVOKED" in outcome, f"the revoked certificate still connects after SIGHUP: {outcome}"
        other = world.ids["d0"]
        assert raw_connect(setup.port, _context(other, other.ca), "d0") == "connack:0"
    finally:
        _stop(proc)


# --- what each role may do -------------------------------------------------------------------------------


def test_device_topics_are_exactly_its_own(world: World, clients: dict[str, Client]) -> None:
    d0, gw = clients["d0"], clients["c0"]
    assert gw.subscribe(topics.cell_up_filter("c0")) < 128
    # Everything a device publishes: its uplink (every kind) and its presence.
    for kind in KINDS:
        assert d0.publish(topics.cell_up(ROLLOUT, "c0", "d0", kind)) < 128, kind
    assert d0.publish(topics.cell_status("c0", "d0"), retain=True) < 128
    assert d0.publish(topics.status("d0"), retain=True) < 128  # an older agent's presence topic
    assert gw.received() >= {topics.cell_up(ROLLOUT, "c0", "d0", k) for k in KINDS}
    # Nothing else: another device's id, another cell, the downlink, the cloud's topics.
    denied = [topics.cell_up(ROLLOUT, "c0", "d1", "device_update"),
              topics.cell_up(ROLLOUT, "c1", "d0", "device_update"),
              topics.cell_down(ROLLOUT, "c0", "device_task"), topics.cell_manifest(ROLLOUT, "c0"),
              topics.status("d1"), topics.status("c0"), topics.manifest(ROLLOUT),
              topics.cell_status("c0", "d1"), topics.cell_status("c1", "d0"),
              topics.edge_up(ROLLOUT, "c0", "cell_update"), topics.cloud_down(ROLLOUT, "c0", "cell_task")]
    for topic in denied:
        assert d0.publish(topic) == NOT_AUTHORIZED, topic
    assert topics.cell_up(ROLLOUT, "c0", "d1", "device_update") not in gw.received(0.2)


def test_a_csr_enrolled_device_publishes_under_its_own_id_only(world: World, clients: dict[str, Client]) -> None:
    dev = clients["csr0"]
    assert dev.publish(topics.cell_up(ROLLOUT, "c0", "csr0", "device_update")) < 128
    assert dev.publish(topics.cell_up(ROLLOUT, "c0", "d0", "device_update")) == NOT_AUTHORIZED


def test_devices_read_their_cell_downlink_and_not_another_cells(world: World, clients: dict[str, Client]) -> None:
    d0, e0 = clients["d0"], clients["e0"]
    for dev, cell in ((d0, "c0"), (e0, "c1")):
        assert dev.subscribe(topics.cell_down_filter(cell)) < 128
    # Mosquitto 2.0's acl_file does not check SUBSCRIBE (SUBACK says granted); the read rule
    # is applied to every message at delivery instead, retained ones included.
    assert d0.subscribe(topics.cell_down_filter("c1")) in (1, 128, 135)
    assert e0.subscribe(topics.cell_down_filter("c0")) in (1, 128, 135)
    for cell in CELLS:
        gw = clients[cell]
        assert gw.publish(topics.cell_manifest(ROLLOUT, cell), b"m", retain=True) < 128
        assert gw.publish(topics.cell_down(ROLLOUT, cell, "device_task")) < 128
        assert gw.publish(topics.cell_down(ROLLOUT, cell, "device_task", "d0" if cell == "c0" else "e0")) < 128
    got = {"c0": d0.received(), "c1": e0.received()}
    for cell, member in (("c0", "d0"), ("c1", "e0")):
        assert got[cell] == {topics.cell_manifest(ROLLOUT, cell), topics.cell_down(ROLLOUT, cell, "device_task"),
                             topics.cell_down(ROLLOUT, cell, "device_task", member)}
    # A late subscriber gets its own cell's retained manifest, never another cell's.
    d1 = clients["d1"]
    d1.subscribe(topics.cell_down_filter("c1"))
    d1.subscribe(topics.cell_down_filter("c0"))
    assert d1.received() == {topics.cell_manifest(ROLLOUT, "c0")}


def test_gateway_and_coordinator_have_what_their_roles_need(world: World, clients: dict[str, Client]) -> None:
    gw, cloud, d0, e0 = clients["c0"], clients["cloud"], clients["d0"], clients["e0"]
    # Subscriptions exactly as edge_broker/service.py and cloud_coordinator/node.py make them.
    for f in (topics.ALL_MANIFESTS, topics.cloud_down_filter("c0"), topics.status("cloud"), topics.cell_up_filter("c0"),
              topics.cell_status_filter("c0")):
        assert gw.subscribe(f) < 128
    for f in (topics.edge_up_filter(), topics.ALL_STATUS, topics.ALL_CELL_STATUS):
        assert cloud.subscribe(f) < 128
    d0.subscribe(topics.cell_down_filter("c0"))
    gw.received(0.1), cloud.received(0.1), d0.received(0.1)  # drop retained leftovers of other tests

    # Coordinator -> edge: manifest (retained) and tasks for c0 (and c1, which c0 must not see).
    assert cloud.publish(topics.manifest(ROLLOUT), b"m", retain=True) < 128
    for kind in KINDS:
        assert cloud.publish(topics.cloud_down(ROLLOUT, "c0", kind)) < 128
    assert cloud.publish(topics.cloud_down(ROLLOUT, "c1", "cell_task")) < 128
    assert cloud.publish(topics.status("cloud"), retain=True) < 128
    got = gw.received()
    assert got >= {topics.manifest(ROLLOUT), topics.status("cloud")}
    assert got >= {topics.cloud_down(ROLLOUT, "c0", k) for k in KINDS}
    assert topics.cloud_down(ROLLOUT, "c1", "cell_task") not in got

    # Edge -> devices and edge -> coordinator, and the edge's presence.
    assert gw.publish(topics.cell_manifest(ROLLOUT, "c0"), b"m", retain=True) < 128
    for kind in KINDS:
        assert gw.publish(topics.cell_down(ROLLOUT, "c0", kind)) < 128
        assert gw.publish(topics.edge_up(ROLLOUT, "c0", kind)) < 128
    assert gw.publish(topics.status("c0"), retain=True) < 128
    assert d0.received() >= {topics.cell_down(ROLLOUT, "c0", k) for k in KINDS}
    assert cloud.received() >= {topics.edge_up(ROLLOUT, "c0", k) for k in KINDS} | {topics.status("c0")}

    # A device's presence reaches its edge and the coordinator (on a shared broker), never another cell's edge,
    # even one that asks for every cell's (Mosquitto's acl_file grants the SUBSCRIBE and filters delivery).
    assert gw.subscribe(topics.ALL_CELL_STATUS) < 128
    assert d0.publish(topics.cell_status("c0", "d0"), retain=True) < 128
    assert e0.publish(topics.cell_status("c1", "e0"), retain=True) < 128
    seen = gw.received()
    assert topics.cell_status("c0", "d0") in seen and topics.cell_status("c1", "e0") not in seen
    assert cloud.received() >= {topics.cell_status("c0", "d0"), topics.cell_status("c1", "e0")}

    # And not more: an edge cannot speak for another cell or for the coordinator; the
    # coordinator cannot talk to devices directly or pose as an edge.
    for topic in (topics.cell_down(ROLLOUT, "c1", "device_task"), topics.edge_up(ROLLOUT, "c1", "cell_update"),
                  topics.cloud_down(ROLLOUT, "c0", "cell_task"), topics.manifest(ROLLOUT), topics.status("c1"),
                  topics.status("cloud"), topics.cell_up(ROLLOUT, "c0", "d0", "device_update")):
        assert gw.publish(topic) == NOT_AUTHORIZED, topic
    for topic in (topics.cell_down(ROLLOUT, "c0", "device_task"), topics.cell_manifest(ROLLOUT, "c0"),
                  topics.edge_up(ROLLOUT, "c0", "cell_update"), topics.cell_up(ROLLOUT, "c0", "d0", "x"),
                  topics.status("c0")):
        assert cloud.publish(topic) == NOT_AUTHORIZED, topic


def test_a_last_will_on_another_nodes_status_is_not_delivered(world: World, clients: dict[str, Client]) -> None:
    gw = clients["c0"]
    assert gw.subscribe(topics.ALL_STATUS) < 128
    gw.received(0.1)
    # Mosquitto 2.0.11 accepts the CONNECT (the will is not checked then) but applies the
    # write rule when it publishes the will: a forged presence never reaches anyone.
    forged = Client(world.port, world.ids["d0"], "d0-forger", will=topics.status("d1"))
    honest = Client(world.port, world.ids["d1"], "d1", will=topics.status("d1"))
    with_will = mqtt.ReasonCode(PacketTypes.DISCONNECT, "Disconnect with will message")
    for c in (forged, honest):
        c.client.disconnect(reasoncode=with_will)
        c.client.loop_stop()
    time.sleep(0.3)
    got = []
    while not gw.messages.empty():
        topic, payload, _ = gw.messages.get_nowait()
        got.append((topic, payload))
    assert got == [(topics.status("d1"), b"offline")]  # the honest one only


# --- privileges: a dedicated user for the broker -------------------------------------------------------


def test_cell_broker_runs_as_a_dedicated_user_with_its_0600_key(world: World) -> None:
    binary = mosquitto_binary()
    assert binary is not None
    require(os.geteuid() == 0, "root (Mosquitto drops its privileges only when it starts as root)")
    require(system_user("mosquitto") is not None, "the `mosquitto` user (Debian's mosquitto package makes it)")
    # pytest's tmp dirs are 0700 root: Mosquitto, once it is `mosquitto`, could not reach them.
    work = Path(tempfile.mkdtemp(prefix="fedtier-broker-"))
    try:
        work.chmod(0o755)
        bundles.issue_broker(world.fleet, "gw-c0", ["127.0.0.1"], work)
        # Without --run-as, root-started Mosquitto drops to `mosquitto` and cannot read the key.
        setup = write_cell_broker_config(world.fleet, "c0", work, port=free_port(), bind="127.0.0.1")
        proc = subprocess.run(setup.command(binary), capture_output=True, text=True, timeout=10)
        assert proc.returncode != 0 and "Unable to load server key file" in proc.stdout + proc.stderr
        # With run_as, the key (still 0600) is handed to that user and the broker starts.
        setup = write_cell_broker_config(world.fleet, "c0", work, port=free_port(), bind="127.0.0.1",
                                         run_as="mosquitto", force=True)
        st = setup.key.stat()
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == pwd.getpwnam("mosquitto").pw_uid
        running = _start(binary, setup, work / "mosquitto.log")
        try:
            d0 = world.ids["d0"]
            assert raw_connect(setup.port, _context(d0, d0.ca), "d0") == "connack:0"
        finally:
            _stop(running)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_an_expired_crl_locks_every_client_out(world: World, tmp_path: Path) -> None:
    """Why `provision crl` must run before the CRL's nextUpdate (OpenSSL CRL_CHECK)."""
    binary = mosquitto_binary()
    assert binary is not None
    out = tmp_path / "gw"
    bundles.issue_broker(world.fleet, "gw-expired-crl", ["127.0.0.1"], out)
    setup = write_cell_broker_config(world.fleet, "c0", out, port=free_port(), bind="127.0.0.1",
                                     run_as=broker_config.current_user())
    stale = ca.make_crl(world.fleet._ca_key(), world.fleet.ca_cert, [], crl_number=1, days=1,
                        now=ca.utcnow() - dt.timedelta(days=3))
    setup.crl.write_bytes(stale.public_bytes(serialization.Encoding.PEM))
    proc = _start(binary, setup, out / "mosquitto.log")
    try:
        d0 = world.ids["d0"]
        outcome = raw_connect(setup.port, _context(d0, d0.ca), "d0", await_alert=2.0)
        assert outcome.startswith("tls:"), outcome
    finally:
        _stop(proc)

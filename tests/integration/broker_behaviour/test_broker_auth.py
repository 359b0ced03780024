"""Credentials: a Mosquitto-format password file, on both brokers.

One file holds a user added by Mosquitto's own ``mosquitto_passwd -b`` and one added by fedtier's
writer (``fedtier broker passwd``): both brokers must let each in with its password and refuse
everyone else with CONNACK 0x87 Not authorized (3.1.1: return code 5), as Mosquitto does with
``allow_anonymous false`` and a ``password_file``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from broker_harness import Check, Peer, RawClient, check, kind, start
from conftest import require

from fedtier.embedded_broker.packets import MQTT_5, MQTT_311
from fedtier.embedded_broker.passwords import set_password

__all__ = ["check", "kind", "start"]  # fixtures
pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]
BOTH = pytest.mark.parametrize("protocol", [MQTT_5, MQTT_311], ids=["v5", "v311"])

USERS = {"edge-mosquitto": "written by mosquitto_passwd", "edge-fedtier": "written by fedtier"}


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    binary = shutil.which("mosquitto_passwd")
    require(binary is not None, "mosquitto_passwd (Debian's mosquitto package)")
    assert binary is not None
    path = tmp_path / "broker.passwd"
    subprocess.run([binary, "-c", "-b", str(path), "edge-mosquitto", USERS["edge-mosquitto"]],
                   check=True, capture_output=True)
    set_password(path, "edge-fedtier", USERS["edge-fedtier"])
    return path


@BOTH
def test_only_listed_users_with_their_password_connect(start: Any, check: Check, password_file: Path,
                                                       protocol: int) -> None:
    broker = start(password_file=password_file)
    refused = 0x87 if protocol == MQTT_5 else 5
    attempts = {
        "no user name": {},
        "a listed user without a password": {"username": "edge-fedtier"},
        "a listed user with a wrong password": {"username": "edge-fedtier", "password": b"guess"},
        "another user's password": {"username": "edge-mosquitto", "password": USERS["edge-fedtier"].encode()},
        "an unknown user": {"username": "intruder", "password": b"x"},
    }
    for what, fields in attempts.items():
        raw = RawClient(broker.port, protocol)
        connack = raw.connect("c-" + what.replace(" ", "-"), **fields)
        check.same(f"{what}: not authorized", connack.reason_code, refused)
        check.same(f"{what}: then closed", raw.packets_until_closed(), [])
        raw.close()
    for user, password in USERS.items():
        raw = RawClient(broker.port, protocol)
        connack = raw.connect(f"c-{user}", username=user, password=password.encode())
        check.same(f"{user} ({password}) is let in", connack.reason_code, 0)
        raw.close()


def test_paho_with_credentials_publishes_and_receives(start: Any, check: Check, password_file: Path) -> None:
    broker = start(password_file=password_file)
    sub = Peer(broker.port, "sub", username="edge-mosquitto", password=USERS["edge-mosquitto"]).connect()
    pub = Peer(broker.port, "pub", username="edge-fedtier", password=USERS["edge-fedtier"]).connect()
    try:
        check.same("subscribed", sub.subscribe("auth/t", 1), [1])
        pub.publish("auth/t", b"authenticated", qos=1)
        check.same("delivered", bytes(sub.get().payload), b"authenticated")
    finally:
        sub.close()
        pub.close()
    for protocol in (MQTT_5, MQTT_311):
        anonymous = Peer(broker.port, "anonymous", protocol=protocol).connect()  # returns on any CONNACK
        # paho reports the 3.1.1 return code 5 as reason code 0x87 too.
        check.same(f"paho without credentials (level {protocol}): not authorized", anonymous.connect_reason, 0x87)
        anonymous.close()

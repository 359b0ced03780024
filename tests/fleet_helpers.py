"""Helpers for tests that run provisioned fleets as processes: start, signal and read them, and
look at what a broker keeps retained.

Every process is started in its own session, so a signal to its process group reaches it
(and the children a ``bash -c`` starts) and nothing else.
"""

from __future__ import annotations

import os
import queue
import signal
import sqlite3
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


def fedtier_env() -> dict[str, str]:
    """The environment for ``fedtier`` and ``mosquitto`` commands as a user types them."""
    from conftest import mosquitto_binary

    dirs = [str(Path(sys.executable).parent)]
    binary = mosquitto_binary()
    if binary:
        dirs.append(str(Path(binary).parent))
    return {**os.environ, "PATH": os.pathsep.join([*dirs, os.environ.get("PATH", "")]), "PYTHONUNBUFFERED": "1"}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def send(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15.0) -> int:
        """Send ``sig`` and wait; SIGKILL if it does not end in ``timeout``. Returns the exit code."""
        self.send(sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            return self.popen.wait(10)


@dataclass
class Procs:
    """Processes of one test, all stopped at the end (``close``)."""

    workdir: Path
    env: dict[str, str] = field(default_factory=fedtier_env)
    started: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str] | str) -> Proc:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        args = ["bash", "-c", f"exec {argv}"] if isinstance(argv, str) else argv
        with open(log, "ab") as fh:
            popen = subprocess.Popen(args, cwd=self.workdir, stdout=fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)
        proc = Proc(name, popen, log)
        self.started.append(proc)
        return proc

    def check_alive(self) -> None:
        for p in self.started:
            code = p.popen.poll()
            if code is not None and p.name.startswith(("broker", "edge", "agent")):
                raise AssertionError(f"{p.name} exited with {code}:\n{p.text()[-3000:]}")

    def close(self) -> None:
        for p in reversed(self.started):
            if not p.name.startswith("broker"):
                p.stop(signal.SIGTERM, 5)
        for p in self.started:
            p.stop(signal.SIGTERM, 5)


def wait_for_text(proc: Proc, text: str, timeout: float, procs: Procs | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in proc.text():
            return
        if procs is not None:
            procs.check_alive()
        time.sleep(0.1)
    raise AssertionError(f"{proc.name} did not log {text!r} within {timeout}s:\n{proc.text()[-3000:]}")


def retained(host: str, port: int, bundle: Path, topic_filter: str, wait: float = 1.0) -> list[tuple[str, bytes]]:
    """The retained messages under ``topic_filter``, read with ``bundle``'s identity over mutual TLS.

    Brokers configured by fedtier bind the client id to the certificate: use the bundle of a
    node that is not running, or it is disconnected while this reads.
    """
    got: "queue.Queue[tuple[str, bytes]]" = queue.Queue()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="probe", protocol=mqtt.MQTTv5)
    ctx = ssl.create_default_context(cafile=str(bundle / "ca.pem"))
    ctx.load_cert_chain(str(bundle / "cert.pem"), str(bundle / "key.pem"))
    client.tls_set_context(ctx)
    client.on_message = lambda c, u, m: got.put((m.topic, bytes(m.payload))) if m.retain else None
    client.connect(host, port)
    client.loop_start()
    try:
        client.subscribe(topic_filter, qos=1)
        time.sleep(wait)
    finally:
        client.disconnect()
        client.loop_stop()
    out = []
    while not got.empty():
        out.append(got.get_nowait())
    return out


# --- provisioned fleets ------------------------------------------------------------------------------


def write_rollout(path: Path, *, rollout: str, port: int, cells: dict[str, list[str]], rounds: int = 3,
                  artifact_store: Path | None = None, extra: str = "") -> Path:
    """A small rollout config (digits, MLP 16, fedavg) whose cloud broker is ``127.0.0.1:port``."""
    members = "\n".join(f'{c} = [{", ".join(repr(d).replace(chr(39), chr(34)) for d in ds)}]'
                        for c, ds in cells.items())
    store = f'artifact_store = "{artifact_store}"\n' if artifact_store else ""
    path.write_text(f'''rollout = "{rollout}"
rounds = {rounds}
seed = 7
{store}{extra}
[model]
kind = "mlp"
hidden = [16]

[data]
dataset = "digits"
partition = "iid"
seed = 3

[topology.members]
{members}

[fedavg]
local_steps = 5
lr = 0.2
batch_size = 16

[broker]
host = "127.0.0.1"
port = {port}
''')
    return path


def start_brokers(procs: Procs, brokers: dict[str, dict]) -> dict[str, Proc]:
    """Start every broker ``provision fleet`` wrote (``FleetResult.brokers``) and wait for its port."""
    from conftest import mosquitto_binary, wait_port

    binary = mosquitto_binary()
    assert binary is not None
    out = {}
    for name, broker in brokers.items():
        out[name] = procs.start(f"broker-{name}", [binary, "-c", broker["conf"]])
        wait_port(int(broker["port"]))
    return out


_engines: dict[str, Any] = {}


def count_rows(db: Path | str, sql: str) -> int:
    """One number from a SQLite file (``Path``) or from a coordinator store's URL (``str``)."""
    if isinstance(db, str):
        import sqlalchemy as sa

        from cloud_coordinator.store_backend import parse_url

        engine = _engines.setdefault(db, sa.create_engine(parse_url(db), poolclass=sa.pool.NullPool))
        try:
            with engine.connect() as conn:
                return int(conn.exec_driver_sql(sql).scalar() or 0)
        except sa.exc.ProgrammingError:  # no such table yet
            return 0
    if not db.exists():
        return 0
    conn = sqlite3.connect(db, timeout=5)
    try:
        return int(conn.execute(sql).fetchone()[0])
    except sqlite3.OperationalError:
        return 0
    finally:
        conn.close()

"""Shared fixtures: real brokers on free ports, and small rollouts.

Broker tests run against a real Mosquitto started by the test on a free port. Where
Mosquitto is missing they skip on a developer machine — but in CI (``CI=true``) they
fail: a test that silently skips there hides a missing component.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from fedtier.embedded_broker.limits import BrokerLimits
from provisioning.broker_limits import limits_for, mosquitto_global_limits, mosquitto_listener_limits

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, what: str) -> None:
    """Skip locally, fail in CI, when a real component is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI (CI=true) but missing", pytrace=False)
    pytest.skip(f"{what} not available")


def mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port}")


@dataclass
class Broker:
    """A running broker process for one test."""

    host: str
    port: int
    proc: subprocess.Popen
    log: Path
    kind: str

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_mosquitto(directory: Path, *, max_packet_size: int | None = None, extra: tuple[str, ...] = (),
                    port: int | None = None, limits: BrokerLimits | None = None) -> Broker:
    """Mosquitto on a free port with fedtier's limits (``limits``, else the defaults with
    ``max_packet_size`` if given) and any ``extra`` global lines."""
    binary = mosquitto_binary()
    require(binary is not None, "Mosquitto (apt-get install mosquitto)")
    assert binary is not None
    directory.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    limits = limits or limits_for(max_packet_size)
    lines = ["allow_anonymous true", "persistence false", "log_dest stdout", "log_type all",
             *mosquitto_global_limits(limits), *extra, f"listener {port} 127.0.0.1",
             *mosquitto_listener_limits(limits)]
    conf = directory / f"mosquitto-{port}.conf"
    conf.write_text("\n".join(lines) + "\n")
    log = directory / f"mosquitto-{port}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([binary, "-c", str(conf)], stdout=fh, stderr=subprocess.STDOUT)
    try:
        wait_port(port)
    except RuntimeError:
        proc.kill()
        raise RuntimeError(f"mosquitto did not start:\n{log.read_text()}") from None
    return Broker("127.0.0.1", port, proc, log, "mosquitto")


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Broker]:
    """A fresh Mosquitto on a free port with fedtier's default limits."""
    broker = start_mosquitto(tmp_path / "broker")
    yield broker
    broker.stop()


@pytest.fixture
def mosquitto_factory(tmp_path: Path) -> Iterator[Callable[..., Broker]]:
    """Start Mosquittos with custom settings (e.g. ``max_packet_size``); all stopped after the test."""
    started: list[Broker] = []

    def factory(**kwargs: object) -> Broker:
        broker = start_mosquitto(tmp_path / f"broker{len(started)}", **kwargs)  # type: ignore[arg-type]
        started.append(broker)
        return broker

    yield factory
    for b in started:
        b.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """A PostgreSQL server of this test session (``tests/postgres_server.py``), on a free port."""
    import postgres_server as pg

    require(pg.available(), "PostgreSQL (initdb and pg_ctl, Debian's postgresql package)")
    server = pg.PostgresServer.start(free_port())
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The coordinator's store, once in SQLite (a file in tmp_path) and once in a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'coordinator.db'}"
    return request.getfixturevalue("postgres_server").create_database()


@pytest.fixture(scope="session")
def artifact_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One content-addressed artifact store for the whole session (each arch built once)."""
    return tmp_path_factory.mktemp("artifact-store")


@pytest.fixture
def small_rollout(tmp_path: Path, artifact_store: Path) -> Callable[..., object]:
    """A factory of small, fast ``RolloutConfig``s (2 cells x 2 devices, digits, few steps)."""
    from fedtier.rollout.config import RolloutConfig

    def make(**overrides: object) -> RolloutConfig:
        base: dict[str, object] = {
            "rollout": "t", "rounds": 3, "seed": 7, "state_dir": str(tmp_path / "coord"),
            "artifact_store": str(artifact_store),
            "model": {"kind": "mlp", "hidden": [16]},
            "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5, "seed": 3},
            "topology": {"cells": 2, "devices_per_cell": 2},
            "fedavg": {"local_steps": 5, "lr": 0.1, "batch_size": 16},
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}  # type: ignore[dict-item]
            else:
                base[key] = value
        return RolloutConfig.from_mapping(base)

    return make


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[Any]) -> None:
    """The end-to-end runs (each a fleet of processes: demos, operations, the deployment page) share one xdist
    worker: two of them at once on a 2-core machine would each run slower than its deadlines assume.

    ``tryfirst``: xdist's worker reads the ``xdist_group`` marks in its own hook of this name, which pluggy
    otherwise calls before this one; the marks then came too late and the runs went to both workers."""
    for item in items:
        if "e2e" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.xdist_group("e2e"))


def _broker_harness() -> Any:
    """tests/integration/broker_behaviour/broker_harness.py, imported under the name its tests use."""
    if "broker_harness" not in sys.modules:
        import importlib.util

        path = Path(__file__).parent / "integration" / "broker_behaviour" / "broker_harness.py"
        spec = importlib.util.spec_from_file_location("broker_harness", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["broker_harness"] = module
        spec.loader.exec_module(module)
    return sys.modules["broker_harness"]


class _BrokerSummaryFromWorkers:
    """Under pytest-xdist the broker-behaviour assertions are recorded in the workers: each sends its registry
    when it finishes (``workeroutput``), and the controller merges them for the summary line."""

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        data = getattr(node, "workeroutput", {}).get("broker_harness")
        if data:
            _broker_harness().merge(data)


def pytest_configure(config: Any) -> None:
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_BrokerSummaryFromWorkers(), "fedtier-broker-summary")


def pytest_sessionfinish(session: Any) -> None:
    output = getattr(session.config, "workeroutput", None)  # set in an xdist worker
    harness = sys.modules.get("broker_harness")
    if output is not None and harness is not None:
        output["broker_harness"] = harness.export()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """After a run of tests/integration/broker_behaviour: its count of shared assertions."""
    harness = sys.modules.get("broker_harness")
    if harness is not None:
        for line in harness.summary_lines():
            terminalreporter.write_line(line)

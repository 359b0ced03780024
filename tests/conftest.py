"""Shared fixtures: real brokers on free ports, and small rollouts.

Broker tests run against a real Mosquitto started by the test on a free port. Where
Mosquitto is missing they skip on a developer machine — but in CI (``CI=true``) they
fail: a test that silently skips there hides a missing component.
"""

from __future__ import annotations

import fcntl
import json
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

# pytest-xdist's workers inherit COLUMNS=80 and LINES=24 from execnet; a person's piped command has neither. Without
# them the suite runs the same on two workers as on one (-n 0): rich's tables keep their piped width.
for _variable in ("COLUMNS", "LINES"):
    os.environ.pop(_variable, None)

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, what: str) -> None:
    """Skip locally, fail in CI, when a real component is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI (CI=true) but missing", pytrace=False)
    pytest.skip(f"{what} not available")


def system_user(name: str) -> Any:
    """The system account ``name`` (its ``pwd`` entry), or None where there is none."""
    import pwd

    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


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


# --- one fleet at a time ------------------------------------------------------------------------------
#
# A test marked ``fleet`` starts a whole fleet of processes (a demo, the fleet emulator): every test in tests/e2e
# is marked here; tests elsewhere mark themselves. Two fleets at once on a 2-core machine each run slower than
# their deadlines assume, so such tests run one at a time, twice over:
#
# * one xdist group, so that ``--dist loadgroup`` sends them all to one worker. xdist reads the group from a
#   suffix it appends to the node id, which pytest 9.2 no longer takes (pytest-xdist#1386): the tests then
#   spread over both workers, silently;
# * so each also holds a file lock shared by the workers of the run, from before its first fixture (the
#   session-scoped demo of tests/e2e/test_demo.py included) until after its last teardown; a worker whose
#   fleet test finds the lock taken waits for it, outside the test's timeout.
#
# Each run of a marked test is logged (worker, test, start, end) next to the lock, and each checks at its
# teardown that no other fleet test ran while it did: without the lock and the group the runs overlap and
# that check fails.

FLEET_GROUP = "fleet"
_FLEET_LOG = "fleet-runs.jsonl"
_fleet_run = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[Any]) -> None:
    """``tryfirst``: xdist's worker reads the ``xdist_group`` marks in its own hook of this name, which pluggy
    otherwise calls before this one; the marks then came too late and the runs went to both workers."""
    for item in items:
        if "e2e" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.fleet)
        if item.get_closest_marker("fleet") is not None:
            item.add_marker(pytest.mark.xdist_group(FLEET_GROUP))


def _fleet_dir(config: Any) -> Path:
    """A directory of this run shared by its xdist workers: the run's basetemp (``pytest-N``), the parent of
    each worker's (``pytest-N/popen-gw0``); in a run without workers, that run's basetemp."""
    base: Path = config._tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


def _log_fleet_run(directory: Path, record: dict) -> None:
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(directory / _FLEET_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line)  # one write of one line with O_APPEND: lines of two workers never interleave
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def fleet_runs(directory: Path) -> list[dict]:
    """The logged runs of fleet tests in ``directory``: worker, test, start and (once it ended) end, in
    ``time.monotonic()`` seconds (one clock for every process of the machine). A run whose worker died
    before it ended (xdist replaces a crashed worker) has no known end and is left out."""
    path = directory / _FLEET_LOG
    runs: dict[tuple, dict] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        key = (record["worker"], record["test"], record["start"])
        runs.setdefault(key, {"worker": record["worker"], "pid": record["pid"], "test": record["test"],
                              "start": record["start"], "end": None})
        if record["event"] == "end":
            runs[key]["end"] = record["end"]
    return [r for r in runs.values() if r["end"] is not None or _alive(r["pid"])]


def overlapping(run: dict, runs: list[dict], now: float) -> list[dict]:
    """The runs of ``runs`` other than ``run`` that ran while ``run`` did (from its start until ``now``)."""
    def same(other: dict) -> bool:
        return (other["worker"], other["test"], other["start"]) == (run["worker"], run["test"], run["start"])

    return [o for o in runs if not same(o) and o["start"] < now and (o["end"] is None or o["end"] > run["start"])]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    """A fleet test's whole run (setup, call, teardown) under the run's fleet lock, logged.

    ``tryfirst``: the outermost wrapper, so the wait for the lock is not counted in pytest-timeout's limit."""
    if item.get_closest_marker("fleet") is None:
        return (yield)
    directory = _fleet_dir(item.config)
    with open(directory / "fleet.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, or when the worker dies
        run = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "pid": os.getpid(), "test": item.nodeid,
               "start": time.monotonic()}
        item.stash[_fleet_run] = run
        _log_fleet_run(directory, {**run, "event": "start"})
        try:
            return (yield)
        finally:
            _log_fleet_run(directory, {**run, "event": "end", "end": time.monotonic()})


@pytest.fixture(autouse=True)
def _one_fleet_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    """At the teardown of a fleet test: no other fleet test ran while it did, on any worker."""
    yield
    run = request.node.stash.get(_fleet_run, None)
    if run is not None:
        others = overlapping(run, fleet_runs(_fleet_dir(request.config)), time.monotonic())
        assert others == [], f"fleet tests ran at the same time as {run['test']} ({run['worker']}): {others}"


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


def pytest_terminal_summary(terminalreporter: Any, config: Any) -> None:
    """After a run of tests/integration/broker_behaviour: its count of shared assertions. After a run with
    fleet tests: how many ran, on which workers, and whether any two overlapped."""
    harness = sys.modules.get("broker_harness")
    if harness is not None:
        for line in harness.summary_lines():
            terminalreporter.write_line(line)
    if not hasattr(config, "workerinput"):
        runs = sorted(fleet_runs(_fleet_dir(config)), key=lambda r: r["start"])
        if runs:
            pairs = sum(len(overlapping(r, runs[i + 1:], r["end"] or time.monotonic())) for i, r in enumerate(runs))
            workers = ", ".join(sorted({r["worker"] for r in runs}))
            terminalreporter.write_line(f"fleet tests: {len(runs)} run{'s' * (len(runs) != 1)} on {workers}, "
                                        + ("one at a time" if pairs == 0 else f"{pairs} pairs ran at the same time"))

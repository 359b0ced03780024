"""``fedtier demo``: a whole hierarchy on this machine, as separate processes, over real MQTT.

1. start a broker on a free port: Mosquitto when it is on PATH, else the embedded one;
2. split scikit-learn's bundled ``digits`` non-iid (Dirichlet) across the devices and write
   each device's ``.npz`` into its own data directory;
3. write one config per node (coordinator, one edge per cell, one agent per device) and
   start each with the real command: ``fedtier coordinator|edge|agent run --config ...``;
4. follow the coordinator's metrics file: a line and a progress bar per round;
5. stop every process it started — at the end, on error, or on Ctrl-C — and print the
   summary: accuracy per round, bytes per tier, wall time.

With ``--secure`` it first provisions a throwaway fleet in the work directory, exactly as an
operator would with ``fedtier provision``: a CA and a manifest-signing key, a bundle per node
(certificate, 0600 key, CA, trusted keys), and a Mosquitto config with a mutual-TLS listener,
the fleet's CRL and a per-role ACL. Every node then talks TLS with its own certificate, every
manifest is signed and verified, and each node may publish only its own topics.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cloud_coordinator.fleet import FleetPaths, write_fleet
from cloud_coordinator.report import progress_bar, round_line

READY_TIMEOUT_S = 15.0

# Settings that reach >= 0.90 on digits in the default 30 rounds (measured in the simulator;
# see docs/concepts.md). ``local_steps``/``lr`` from the command line override them.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "fedavg": {"local_steps": 20, "lr": 0.1},
    "hier_qsgd": {"edge_rounds": 2, "local_steps": 10, "lr": 0.1},
    "qhetfed": {"tau": 4, "gamma": 10, "lr": 0.2},
    "hist": {"local_steps": 10, "edge_rounds": 2, "lr": 0.2},
}
# HIST splits the hidden layer across cells: give each cell's submodel room (64 per cell for 2 cells).
HIDDEN = {"hist": 128}


class DemoError(RuntimeError):
    """The demo could not run (no broker, a process died, timeout). Carries where the logs are."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def default_artifact_store() -> Path:
    """Artifacts are content-addressed, so every demo run can share one store (built once)."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "fedtier" / "artifacts"


def mosquitto_path() -> str | None:
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None)


@dataclass
class DemoOptions:
    devices: int = 12
    cells: int = 2
    rounds: int = 30
    broker: str = "auto"  # auto | mosquitto | embedded
    algorithm: str = "fedavg"
    local_steps: int | None = None  # per-algorithm default (ALGORITHM_DEFAULTS)
    lr: float | None = None
    bits_device: int = 4
    bits_edge: int = 8
    batch_size: int = 32
    hidden: int | None = None  # 64, or HIDDEN[algorithm]
    alpha: float = 0.5
    seed: int = 0
    workdir: Path | None = None
    timeout_s: float = 600.0
    max_packet_size: int = 0
    secure: bool = False  # provision a fleet: mutual TLS, ACLs, signed manifests
    trainer: str = "auto"  # the agents' training backend (device.toml ``trainer``)
    agent_python: Path | None = None  # run the agents with this interpreter (e.g. a stock-onnxruntime venv)


@dataclass
class DemoResult:
    rounds: list[dict[str, Any]]
    wall_s: float
    broker: str
    workdir: Path
    processes: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    role: str


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Demo:
    """Plans, starts, follows and stops one demo run."""

    def __init__(self, opts: DemoOptions, say: Callable[[str], None], progress: Callable[[str], None]) -> None:
        if opts.devices < opts.cells or opts.cells < 1:
            raise ValueError(f"need at least one device per cell (devices={opts.devices}, cells={opts.cells})")
        self.opts = opts
        self.say = say
        self.progress = progress
        self.procs: list[_Proc] = []
        self._own_workdir = opts.workdir is None
        self.workdir = Path(opts.workdir) if opts.workdir else Path(tempfile.mkdtemp(prefix="fedtier-demo-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs = self.workdir / "logs"
        self.broker_kind = ""

    # --- plan ----------------------------------------------------------------------------------------

    def members(self) -> dict[str, list[str]]:
        o = self.opts
        width = max(2, len(str(o.devices - 1)))
        devices = [f"dev-{i:0{width}d}" for i in range(o.devices)]
        sizes = [o.devices // o.cells + (1 if c < o.devices % o.cells else 0) for c in range(o.cells)]
        out, start = {}, 0
        for c, size in enumerate(sizes):
            out[f"cell-{chr(ord('a') + c) if o.cells <= 26 else c}"] = devices[start:start + size]
            start += size
        return out

    def rollout_config(self) -> dict[str, Any]:
        o = self.opts
        return {
            "rollout": "demo", "algorithm": o.algorithm, "rounds": o.rounds, "seed": o.seed,
            "state_dir": str(self.workdir / "coordinator"), "artifact_store": str(default_artifact_store()),
            "log_level": "info",
            "model": {"kind": "mlp", "hidden": [o.hidden or HIDDEN.get(o.algorithm, 64)]},
            "data": {"dataset": "digits", "partition": "dirichlet", "alpha": o.alpha, "seed": o.seed},
            "topology": {"members": self.members()},
            o.algorithm: self.algorithm_section(),
        }

    def algorithm_section(self) -> dict[str, Any]:
        o = self.opts
        section: dict[str, Any] = {**ALGORITHM_DEFAULTS[o.algorithm], "batch_size": o.batch_size, "deadline_s": 60.0}
        if o.lr is not None:
            section["lr"] = o.lr
        if o.local_steps is not None:
            section["gamma" if o.algorithm == "qhetfed" else "local_steps"] = o.local_steps
        if o.algorithm in ("hier_qsgd", "qhetfed"):
            section.update(bits_device=o.bits_device, bits_edge=o.bits_edge)
        return section

    def _broker_section(self, port: int) -> dict[str, Any]:
        section: dict[str, Any] = {"host": "127.0.0.1", "port": port, "protocol": 5}
        if self.opts.max_packet_size:
            section["max_packet_size"] = self.opts.max_packet_size
        return section

    def write_configs(self, port: int, bundles: dict[str, Path] | None = None) -> FleetPaths:
        return write_fleet(self.rollout_config(), self.workdir, self._broker_section(port), bundles,
                           device_settings={"trainer": self.opts.trainer})

    def provision(self, port: int) -> tuple[dict[str, Path], list[str]]:
        """A throwaway fleet under ``workdir/fleet``: bundles per node and the broker's config.

        Returns:
            node id -> bundle directory, and the command that runs the provisioned Mosquitto.
        """
        from provisioning.bundles import issue_coordinator, issue_device, issue_gateway
        from provisioning.broker_config import combined_broker_config
        from provisioning.fleet import Fleet

        mosq = mosquitto_path()
        if mosq is None:
            raise DemoError("--secure needs Mosquitto (the embedded broker has no TLS): apt-get install mosquitto")
        if self.opts.broker == "embedded":
            raise DemoError("--secure needs Mosquitto; the embedded broker has no TLS or ACLs")
        fleet = Fleet.init(self.workdir / "fleet")
        endpoint = ("127.0.0.1", port)
        out = self.workdir / "bundles"
        bundles = {"cloud": issue_coordinator(fleet, endpoint, out / "cloud").path}
        for cell, members in self.members().items():
            bundles[cell] = issue_gateway(fleet, cell, endpoint, out / cell, cloud_broker=endpoint).path
            for device in members:
                bundles[device] = issue_device(fleet, device, cell, endpoint, out / device).path
        setup = combined_broker_config(list(self.members()), "cloud", fleet=fleet, out=self.workdir / "broker",
                                       port=port, max_packet_size=self.opts.max_packet_size or None)
        return bundles, setup.command(mosq)

    # --- processes ------------------------------------------------------------------------------------

    def _spawn(self, name: str, role: str, argv: list[str]) -> _Proc:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        fh = open(log, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Own session: a Ctrl-C in the terminal reaches only the demo, which then stops
        # every child in order (and none is left behind if the demo itself is killed hard,
        # since the children see their broker go away and we kill the groups on exit).
        popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=env, cwd=self.workdir)
        fh.close()
        proc = _Proc(name, popen, log, role)
        self.procs.append(proc)
        return proc

    def start_broker(self, port: int, command: list[str] | None = None) -> None:
        """Start the broker: ``command`` (a provisioned Mosquitto), or per ``--broker``."""
        kind = self.opts.broker
        mosq = mosquitto_path()
        if command is not None:
            self.broker_kind = "mosquitto (mutual TLS, ACL)"
            self._spawn("broker", "broker", command)
            if not wait_for_port(port, READY_TIMEOUT_S):
                raise DemoError(f"the provisioned broker did not open port {port}:\n{_tail(self.procs[-1].log)}")
            return
        if kind == "mosquitto" and mosq is None:
            raise DemoError("--broker mosquitto, but mosquitto is not installed (apt-get install mosquitto)")
        if kind == "mosquitto" or (kind == "auto" and mosq is not None):
            conf = self.workdir / "mosquitto.conf"
            lines = [f"listener {port} 127.0.0.1", "allow_anonymous true", "persistence false",
                     "log_dest stdout", "max_queued_messages 10000"]
            if self.opts.max_packet_size:
                lines.append(f"max_packet_size {self.opts.max_packet_size}")
            conf.write_text("\n".join(lines) + "\n")
            self.broker_kind = "mosquitto"
            self._spawn("broker", "broker", [str(mosq), "-c", str(conf)])
        else:
            self.broker_kind = "embedded"
            argv = [sys.executable, "-m", "fedtier", "broker", "run", "--port", str(port)]
            if self.opts.max_packet_size:
                argv += ["--max-packet-size", str(self.opts.max_packet_size)]
            self._spawn("broker", "broker", argv)
        if not wait_for_port(port, READY_TIMEOUT_S):
            raise DemoError(f"the {self.broker_kind} broker did not open port {port}:\n{_tail(self.procs[-1].log)}")

    def start_nodes(self, paths: FleetPaths) -> None:
        fedtier = [sys.executable, "-m", "fedtier"]
        self._spawn("coordinator", "coordinator", [*fedtier, "coordinator", "run", "--config", str(paths.coordinator)])
        for cell, path in paths.edges.items():
            self._spawn(f"edge-{cell}", "edge", [*fedtier, "edge", "run", "--config", str(path)])
        # absolute() but not resolve(): a venv's python is a symlink to the base interpreter
        agent = [str(Path(self.opts.agent_python).absolute()) if self.opts.agent_python else sys.executable,
                 "-m", "fedtier"]
        for device, path in paths.devices.items():
            self._spawn(device, "agent", [*agent, "agent", "run", "--config", str(path)])

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child (devices first, broker last), then SIGKILL what remains."""
        order = sorted(self.procs, key=lambda p: ["agent", "edge", "coordinator", "broker"].index(p.role))
        for p in order:
            if p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in order:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.popen.wait()

    # --- run -----------------------------------------------------------------------------------------

    def run(self) -> DemoResult:
        started = time.perf_counter()
        o = self.opts
        ok = False
        try:
            port = free_port()
            if o.secure:
                bundles, command = self.provision(port)
                self.say(f"provisioned a fleet: CA, signing key and {len(bundles)} node bundles in "
                         f"{self.workdir / 'bundles'}")
                self.start_broker(port, command)
                paths = self.write_configs(port, bundles)
            else:
                self.start_broker(port)
                paths = self.write_configs(port)
            self.say(f"fedtier demo: {o.devices} devices in {o.cells} cells, {o.rounds} rounds of {o.algorithm} on "
                     f"digits (non-iid, Dirichlet alpha={o.alpha}); {self.broker_kind} broker on 127.0.0.1:{port}")
            self.start_nodes(paths)
            self.say(f"started {len(self.procs)} processes (logs: {self.logs})")
            rows = self.follow(self.workdir / "coordinator" / "metrics.json", started)
            ok = True
            return DemoResult(rounds=rows, wall_s=time.perf_counter() - started, broker=self.broker_kind,
                              workdir=self.workdir, processes=len(self.procs))
        finally:
            self.stop_all()
            if ok and self._own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def follow(self, metrics_path: Path, started: float) -> list[dict[str, Any]]:
        """Wait for rounds to close, reporting each; return all rows once the rollout finished."""
        import json

        seen = 0
        rows: list[dict[str, Any]] = []
        mtime = 0.0
        coordinator = next(p for p in self.procs if p.role == "coordinator")
        while True:
            if time.perf_counter() - started > self.opts.timeout_s:
                raise DemoError(f"timed out after {self.opts.timeout_s:.0f}s at round {seen}/{self.opts.rounds}; "
                                f"logs in {self.logs}")
            for p in self.procs:
                code = p.popen.poll()
                if code is not None and not (p is coordinator and code == 0):
                    raise DemoError(f"{p.name} exited with code {code}; last lines of {p.log}:\n{_tail(p.log)}")
            finished = False
            try:
                m = metrics_path.stat().st_mtime
            except FileNotFoundError:
                m = 0.0
            if m and m != mtime:
                mtime = m
                doc = json.loads(metrics_path.read_text())
                rows = doc["rounds"]
                finished = bool(doc.get("finished"))
                for row in rows[seen:]:
                    self.say(round_line(row, self.opts.rounds))
                seen = len(rows)
            self.progress(f"{progress_bar(seen, self.opts.rounds)}  {time.perf_counter() - started:5.1f}s")
            if finished or (coordinator.popen.poll() == 0 and seen >= self.opts.rounds):
                return rows
            time.sleep(0.1)

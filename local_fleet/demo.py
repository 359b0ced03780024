"""``fedtier demo``: a whole hierarchy on this machine, as separate processes, over real MQTT.

1. start a broker on a free port: Mosquitto when it is on PATH, else the embedded one;
2. split scikit-learn's bundled ``digits`` non-iid (Dirichlet) across the devices — for
   ``--algorithm fedxl`` a binary task with rare positives, one class per device — and write
   each device's ``.npz`` into its own data directory;
3. write one config per node (coordinator, one edge per cell, one agent per device) and
   start each with the real command: ``fedtier coordinator|edge|agent run --config ...``;
4. follow the coordinator's metrics file: a line per round (and a live bar on a terminal);
5. stop every process it started — at the end, on error, on Ctrl-C or SIGTERM — and print the
   summary: accuracy per round, bytes per tier, wall time.

Every child runs in its own session: a Ctrl-C in the terminal reaches only the demo, which
stops them in order (agents, edges, coordinator, broker); SIGTERM and SIGHUP do the same. If
the demo itself is killed with SIGKILL, its reaper (``local_fleet.reaper``, a small
process watching a pipe only the demo holds) stops every child that is still running. A child
that dies while the demo runs (the broker included) is restarted, and the demo says so
(``Demo.restart_dead``).

With ``--privacy`` (``PrivacyDemo``) the rollout gets a ``[privacy]`` section and trust labels:
by default the first half of the cells is trusted. Before the rounds the demo shows the noise
plan (``fedtier privacy plan``'s ``plan_document``), each round line the epsilon spent so far,
and afterwards the final epsilon recomputed from the coordinator's ledger rows (what
``fedtier privacy report`` reads). Clear updates to a trusted cell may travel only over TLS,
so a trusted cell implies ``--secure`` when Mosquitto is there; over the embedded broker (no
TLS) the demo sets ``require_tls = false`` and says so.

With ``--secure`` it first provisions a throwaway fleet in the work directory, exactly as an
operator would with ``fedtier provision``: a CA and a manifest-signing key, a bundle per node
(certificate, 0600 key, CA, trusted keys), and a Mosquitto config with a mutual-TLS listener,
the fleet's CRL and a per-role ACL. Every node then talks TLS with its own certificate, every
manifest is signed and verified, and each node may publish only its own topics.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Protocol

from fedtier import algorithms
from local_fleet.configs import FleetPaths, write_fleet

READY_TIMEOUT_S = 15.0

# Settings that reach >= 0.90 on digits in the default 30 rounds (measured in the simulator;
# see docs/concepts.md). ``local_steps``/``lr`` from the command line override them.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "fedavg": {"local_steps": 20, "lr": 0.1},
    "hier_qsgd": {"edge_rounds": 2, "local_steps": 10, "lr": 0.1},
    "qhetfed": {"tau": 4, "gamma": 10, "lr": 0.2},
    "hist": {"local_steps": 10, "edge_rounds": 2, "lr": 0.2},
    # FeDXL2 (KL-OPAUC): K = 16 steps of 8 positives and 32 negatives; test AUROC 0.911 after the first training
    # round, 0.917 after the default 30 (seed 0; Bayes 0.921).
    "fedxl": {"objective": "pauc", "local_steps": 16, "lr": 0.5, "batch_size": 8, "batch_neg": 32},
    # FedBuff: a cell update every 3 deltas, a new model version every 2 cell updates (a "round" is a version).
    "fedbuff": {"local_steps": 20, "lr": 0.1, "k_edge": 3, "k_cloud": 2, "once_per_version": True},
}
# FeDXL trains a score on a binary task: the rare-event generator, one class per device (positives on
# every other device), a linear scorer (the task's Bayes-optimal score is linear). 4,800 rows (seed 0): the
# ranking reaches 0.917 on the 960-row test split, as much as the Bayes-optimal score does there (0.917);
# with 2,400 rows it stalled at 0.896 against 0.910 for the Bayes-optimal score on its 480-row split (half
# the training rows per device, and a test split whose AUROC moves by about +-0.015 between seeds).
SCORE_DATA = {"dataset": "rare_event", "partition": "one_class", "samples": 4800}
SCORE_HIDDEN: list[int] = []
# HIST splits the hidden layer across cells: give each cell's submodel room (64 per cell for 2 cells).
HIDDEN = {"hist": 128}


# Differential privacy defaults. delta 1e-5 is far below 1/N for digits' ~1,400 training records
# (the usual rule: delta << 1/records, so that "leak one record outright" stays unlikely) and is
# [privacy]'s own default. C = 1 bounds each device's model delta; see PrivacyDemo.
DEFAULT_EPSILON = 8.0
DEFAULT_DELTA = 1e-5
DEFAULT_CLIP = 1.0


class DemoError(RuntimeError):
    """The demo could not run (no broker, a process died, timeout). Carries where the logs are."""


class Terminated(BaseException):
    """The demo got SIGTERM or SIGHUP: like ``KeyboardInterrupt``, it unwinds through every
    ``finally`` (which stops the children) and is not caught by ``except Exception``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def raise_on_termination() -> Iterator[None]:
    """Inside the block, SIGTERM and SIGHUP raise ``Terminated`` (main thread only), so ``kill
    <demo>`` stops every process the demo started, as Ctrl-C does; SIGINT raises ``KeyboardInterrupt``
    even if the demo inherited it ignored (a background job of a script: ``fedtier.cli.interruptible``).
    A second signal during the teardown is ignored. The previous handlers are back after the block."""
    watched = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    previous = {sig: signal.getsignal(sig) for sig in watched}
    if previous[signal.SIGINT] is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def handler(signum: int, frame: Any) -> None:
        for sig in watched:
            signal.signal(sig, signal.SIG_IGN)
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)
    try:
        yield
    finally:
        for sig, action in previous.items():
            signal.signal(sig, action)


@dataclass(frozen=True)
class PrivacyDemo:
    """``--privacy``: differential privacy with trust labels, as docs/privacy.md describes.

    Attributes:
        epsilon: per-device target and budget over the whole rollout.
        delta: the (epsilon, delta) guarantee's delta.
        clip: C, the L2 bound of every released model delta.
        trusted: the trusted cells; None: the first half of the cells (one of the default two).
    """

    epsilon: float = DEFAULT_EPSILON
    delta: float = DEFAULT_DELTA
    clip: float = DEFAULT_CLIP
    trusted: tuple[str, ...] | None = None


class DemoView(Protocol):
    """Where the demo reports (the CLI prints; tests may collect)."""

    def say(self, line: str) -> None:
        """A line of narration (start, plan, warnings)."""

    def rounds_started(self, total: int) -> None:
        """Every process runs; rounds follow (a terminal view may start its bar now)."""

    def round_closed(self, row: dict[str, Any], total: int) -> None:
        """A round closed (its metrics row)."""

    def rounds_ended(self) -> None:
        """No more rounds (finished, failed or interrupted)."""



class CollectingView:
    """A ``DemoView`` that keeps the narration and ignores the rounds: for a caller (a script, a test) that reads
    what the demo said once it is over."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        self.lines.append(line)

    def rounds_started(self, total: int) -> None:
        pass

    def round_closed(self, row: dict[str, Any], total: int) -> None:
        pass

    def rounds_ended(self) -> None:
        pass

def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether something listens on 127.0.0.1:``port`` within ``timeout_s`` (False at once if ``proc`` exits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
        time.sleep(0.05)
    return False


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
    privacy: PrivacyDemo | None = None  # differential privacy with trust labels (--privacy)
    trainer: str = "auto"  # the agents' training backend (device.toml ``trainer``)
    agent_python: Path | None = None  # run the agents with this interpreter (e.g. a stock-onnxruntime venv)
    dashboard: bool = False  # the coordinator also serves its web dashboard on a free localhost port
    strategy: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Tables merged into the rollout config: [aggregation], [server_optimizer], [attack], and the
    algorithm's proximal_mu / partial_work (``commands.strategy_options``; ``merge_tables``)."""
    secure_aggregation: bool = False  # SecAgg+ in every cell: edges see only their cell's sum (fedavg)
    keep_running: bool = False  # coordinator serve + rollout create; the fleet stays up after the last round


@dataclass
class DemoResult:
    rounds: list[dict[str, Any]]
    wall_s: float
    broker: str
    workdir: Path
    processes: int
    secure: bool = False
    stopped: str | None = None  # why the privacy budget stopped the rollout early, if it did
    privacy: dict[str, Any] | None = None  # privacy_summary(...) when --privacy
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    role: str
    argv: list[str] = field(default_factory=list)
    restarts: int = 0


MAX_RESTARTS = 5
"""How often the demo restarts one node that died (a service manager's Restart=on-failure) before it gives up."""
KEEP_RUNNING_STATE = "coordinator"
"""With --keep-running: the coordinator's state directory under the work directory (FEDTIER_STATE_DIR)."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Demo:
    """Plans, starts, follows and stops one demo run."""

    def __init__(self, opts: DemoOptions, view: DemoView) -> None:
        if opts.devices < opts.cells or opts.cells < 1:
            raise ValueError(f"need at least one device per cell (devices={opts.devices}, cells={opts.cells})")
        traits = algorithms.describe(opts.algorithm)
        private = ", ".join(algorithms.names("private"))
        if opts.privacy is not None and traits.scorer:
            raise ValueError(f"--privacy covers {private}; {opts.algorithm} shares every "
                             "device's scores, data-dependent releases the privacy layer does not cover yet "
                             "(docs/privacy.md, Limitations)")
        if opts.privacy is not None and not traits.private:
            raise ValueError(f"--privacy covers {private}; {opts.algorithm}'s in-cell "
                             "gradient exchange is not covered by the privacy layer yet (docs/privacy.md, "
                             "Limitations)")
        if opts.secure_aggregation and not traits.secure_aggregation:
            raise ValueError(f"--secure-aggregation runs with {', '.join(algorithms.names('secure_aggregation'))} "
                             "(docs/secure_aggregation.md)")
        self.opts = opts
        self.view = view
        self.dashboard_url: str | None = None
        """Where the coordinator serves its dashboard (``opts.dashboard``)."""
        self.say = view.say
        self.procs: list[_Proc] = []
        self.trusted = self.trusted_cells()
        self.secure = opts.secure or self._tls_for_trusted_cells()
        self._own_workdir = opts.workdir is None
        self.workdir = Path(opts.workdir).resolve() if opts.workdir else Path(tempfile.mkdtemp(prefix="fedtier-demo-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs = self.workdir / "logs"
        self.broker_kind = ""
        self.broker_port = 0
        self._reaper: subprocess.Popen | None = None

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

    def trusted_cells(self) -> tuple[str, ...]:
        """The cells labelled trusted under ``--privacy`` (none without it).

        Raises:
            ValueError: ``--trusted`` names a cell the demo does not have.
        """
        p = self.opts.privacy
        cells = list(self.members())
        if p is None:
            return ()
        if p.trusted is None:
            return tuple(cells[: len(cells) // 2])
        unknown = sorted(set(p.trusted) - set(cells))
        if unknown:
            raise ValueError(f"--trusted names {', '.join(unknown)}, but the demo's cells are {', '.join(cells)}")
        return tuple(c for c in cells if c in p.trusted)

    def _tls_for_trusted_cells(self) -> bool:
        """Whether ``--privacy`` turns ``--secure`` on: clear updates to a trusted cell need TLS,
        which the provisioned Mosquitto has and the embedded broker has not."""
        return bool(self.trusted) and self.opts.broker != "embedded" and mosquitto_path() is not None

    @property
    def require_tls(self) -> bool:
        return self.secure

    def rollout_config(self) -> dict[str, Any]:
        o = self.opts
        topology: dict[str, Any] = {"members": self.members()}
        config: dict[str, Any] = {
            "rollout": "demo", "algorithm": o.algorithm, "rounds": o.rounds, "seed": o.seed,
            "state_dir": str(self.workdir / "coordinator"), "artifact_store": str(default_artifact_store()),
            "log_level": "info",
            "model": {"kind": "mlp", "hidden": [o.hidden or HIDDEN.get(o.algorithm, 64)]},
            "data": {"dataset": "digits", "partition": "dirichlet", "alpha": o.alpha, "seed": o.seed},
            **(self.score_task() if algorithms.describe(o.algorithm).scorer else {}),
            "topology": topology,
            o.algorithm: self.algorithm_section(),
        }
        if o.privacy is not None:
            if self.trusted:
                topology["trusted"] = {cell: True for cell in self.trusted}
            config["privacy"] = {"epsilon": o.privacy.epsilon, "delta": o.privacy.delta, "clip": o.privacy.clip,
                                 "require_tls": self.require_tls}
        if o.strategy:
            from fedtier.runtime.config import merge_tables

            config = merge_tables(config, o.strategy)
        return config

    def score_task(self) -> dict[str, Any]:
        """``--algorithm fedxl``: the model and data of a binary task with rare positives (``SCORE_DATA``)."""
        o = self.opts
        return {"model": {"kind": "mlp", "hidden": [o.hidden] if o.hidden else SCORE_HIDDEN},
                "data": {**SCORE_DATA, "seed": o.seed}}

    def task_description(self) -> str:
        """What the demo trains on, for its first line."""
        if algorithms.describe(self.opts.algorithm).scorer:
            return ("a rare-event task (1 positive in 6; every other device holds only positives, the rest only "
                    "negatives), ranked by AUROC and partial AUROC")
        return f"digits (non-iid, Dirichlet alpha={self.opts.alpha})"

    def algorithm_section(self) -> dict[str, Any]:
        o = self.opts
        traits = algorithms.describe(o.algorithm)
        section: dict[str, Any] = {"batch_size": o.batch_size, **ALGORITHM_DEFAULTS[o.algorithm], "deadline_s": 60.0}
        if o.lr is not None:
            section["lr"] = o.lr
        if o.local_steps is not None:
            section[traits.local_steps_setting] = o.local_steps
        if traits.quantized:
            section.update(bits_device=o.bits_device, bits_edge=o.bits_edge)
        if o.secure_aggregation:
            # s_min: all but one device of the smallest cell (at least 1); a clip no digits update reaches.
            section.update(secure_aggregation=True, secagg_min_survivors=max(1, o.devices // o.cells - 1),
                           secagg_clip=100.0)
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
        fh = open(log, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Own session: a Ctrl-C in the terminal reaches only the demo, which then stops every
        # child in order; the reaper covers a demo killed hard (module docstring).
        popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=env, cwd=self.workdir)
        fh.close()
        proc = _Proc(name, popen, log, role, list(argv))
        self.procs.append(proc)
        self._tell_reaper(f"+{popen.pid}")
        return proc

    def start_reaper(self) -> None:
        """Start the reaper (module docstring) before any other child."""
        self._reaper = subprocess.Popen([sys.executable, "-m", "local_fleet.reaper"], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                                        start_new_session=True)

    def _tell_reaper(self, line: str) -> None:
        stdin = self._reaper.stdin if self._reaper is not None else None
        if stdin is None or stdin.closed:
            return
        try:
            stdin.write(line + "\n")
            stdin.flush()
        except OSError:  # the reaper is gone: stop_all still stops everything
            pass

    def stop_reaper(self) -> None:
        """Every child is stopped: let the reaper read end-of-file and exit (it has nothing left to do)."""
        if self._reaper is None:
            return
        if self._reaper.stdin is not None:
            try:
                self._reaper.stdin.close()
            except OSError:
                pass
        try:
            self._reaper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._reaper.kill()
            self._reaper.wait()
        self._reaper = None

    def start_broker(self, port: int, command: list[str] | None = None) -> None:
        """Start the broker: ``command`` (a provisioned Mosquitto), or per ``--broker``."""
        self.broker_port = port
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
        # Both brokers get fedtier's safe limits (docs/broker.md); larger messages travel chunked.
        from provisioning.broker_limits import limits_for, mosquitto_global_limits, mosquitto_listener_limits

        limits = limits_for(self.opts.max_packet_size)
        sockets = 2 * (self.opts.devices + self.opts.cells) + 8  # every node of the demo is on 127.0.0.1
        if sockets > limits.max_connections_per_address:
            limits = replace(limits, max_connections_per_address=sockets,
                             max_connections=max(sockets, limits.max_connections))
        if kind == "mosquitto" or (kind == "auto" and mosq is not None):
            conf = self.workdir / "mosquitto.conf"
            lines = ["allow_anonymous true", "persistence false", "log_dest stdout",
                     *mosquitto_global_limits(limits), f"listener {port} 127.0.0.1",
                     *mosquitto_listener_limits(limits)]
            conf.write_text("\n".join(lines) + "\n")
            self.broker_kind = "mosquitto"
            self._spawn("broker", "broker", [str(mosq), "-c", str(conf)])
        else:
            self.broker_kind = "embedded"
            argv = [sys.executable, "-m", "fedtier", "broker", "run", "--port", str(port),
                    "--max-packet-size", str(limits.max_packet_size or 0),
                    "--max-connections-per-address", str(limits.max_connections_per_address)]
            self._spawn("broker", "broker", argv)
        if not wait_for_port(port, READY_TIMEOUT_S):
            raise DemoError(f"the {self.broker_kind} broker did not open port {port}:\n{_tail(self.procs[-1].log)}")

    def restart_dead(self) -> None:
        """Restart every process that exited with a failure, as systemd's Restart=on-failure would, and say
        so. Exit code 77 (credentials refused) is not retried; nor is a process that died ``MAX_RESTARTS``
        times. A coordinator that ended with 0 finished its rollout; the broker never ends by itself, so
        any exit of it is a death.

        The broker comes back first (it is the first child), with the same command on the same port;
        the nodes' MQTT clients reconnect by themselves. Mosquitto runs without persistence, so the
        retained manifests and the messages it had queued are gone: the nodes recover those as after
        any broker restart (docs/operations.md, Failures)."""
        for i, p in enumerate(self.procs):
            code = p.popen.poll()
            if code is None or (p.role == "coordinator" and code == 0):
                continue
            if code == 77 or p.restarts >= MAX_RESTARTS:
                raise DemoError(f"{p.name} exited with code {code}; last lines of {p.log}:\n{_tail(p.log)}")
            self._tell_reaper(f"-{p.popen.pid}")
            where = f" on 127.0.0.1:{self.broker_port}" if p.role == "broker" else ""
            self.say(f"{p.name} died (exit code {code}); restarted it{where}, as a service manager would "
                     f"(restart {p.restarts + 1}; log {p.log})")
            new = self._spawn(p.name, p.role, p.argv)
            new.restarts = p.restarts + 1
            self.procs[i] = new
            self.procs.pop()
            if p.role == "broker":
                self._await_broker(new)

    def _await_broker(self, broker: _Proc) -> None:
        """Wait until a restarted broker listens again. One that exits meanwhile is restarted by the next
        ``restart_dead`` (within ``MAX_RESTARTS``); one that runs but does not listen is an error."""
        if not wait_listening(self.broker_port, broker.popen, READY_TIMEOUT_S) and broker.popen.poll() is None:
            raise DemoError(f"the restarted {self.broker_kind} broker did not open port {self.broker_port}:\n"
                            f"{_tail(broker.log)}")

    def register_rollout(self, paths: FleetPaths) -> Path:
        """--keep-running: register and start the rollout in the coordinator's store, as
        ``fedtier rollout create --config ... --start`` does. Returns the metrics file it writes."""
        from fedtier.rollout.config import RolloutConfig
        from cloud_coordinator.store import CoordinatorStore
        from fedtier.runtime.config import load

        cfg = load(RolloutConfig, paths.coordinator)
        metrics = cfg.state_dir / f"metrics-{cfg.rollout}.json"
        cfg = replace(cfg, metrics_file=metrics)
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        store = CoordinatorStore(cfg.store_location)
        try:
            store.create_rollout(cfg.rollout, cfg.to_dict())
            store.set_desired(cfg.rollout, "running")
        finally:
            store.close()
        return metrics

    def start_nodes(self, paths: FleetPaths) -> None:
        fedtier = [sys.executable, "-m", "fedtier"]
        http: list[str] = []
        port = free_port() if self.opts.dashboard else None
        if port is not None:
            http = ["--http", f"127.0.0.1:{port}"]
        if self.opts.keep_running:
            self._spawn("coordinator", "coordinator", [*fedtier, "coordinator", "serve", "--state-dir",
                                                       str(self.workdir / KEEP_RUNNING_STATE), *http])
        else:
            self._spawn("coordinator", "coordinator",
                        [*fedtier, "coordinator", "run", "--config", str(paths.coordinator), *http])
        for cell, path in paths.edges.items():
            self._spawn(f"edge-{cell}", "edge", [*fedtier, "edge", "run", "--config", str(path)])
        # absolute() but not resolve(): a venv's python is a symlink to the base interpreter
        agent = [str(Path(self.opts.agent_python).absolute()) if self.opts.agent_python else sys.executable,
                 "-m", "fedtier"]
        for device, path in paths.devices.items():
            self._spawn(device, "agent", [*agent, "agent", "run", "--config", str(path)])
        if port is not None:  # the URL once something answers there, not before
            self.dashboard_url = f"http://127.0.0.1:{port}/"
            if wait_listening(port, next(p for p in self.procs if p.role == "coordinator").popen, 60.0):
                self.say(f"dashboard: {self.dashboard_url} (read-only; "
                         + ("up with the fleet)" if self.opts.keep_running else "up until the demo ends)"))
            else:
                self.say(f"the dashboard did not come up on {self.dashboard_url} (see {self.logs})")

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every node (devices, edges, coordinator), wait for them, then the broker; SIGKILL what
        remains. The broker goes last so that no node sees its connection drop while it shuts down."""
        order = sorted(self.procs, key=lambda p: ["agent", "edge", "coordinator", "broker"].index(p.role))
        nodes = [p for p in order if p.role != "broker"]
        brokers = [p for p in order if p.role == "broker"]
        for group in (nodes, brokers):
            for p in group:
                if p.popen.poll() is None:
                    try:
                        os.killpg(p.popen.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace_s
            for p in group:
                try:
                    p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(p.popen.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.popen.wait()
                self._tell_reaper(f"-{p.popen.pid}")

    # --- run -----------------------------------------------------------------------------------------

    def run(self) -> DemoResult:
        started = time.perf_counter()
        o = self.opts
        ok = False
        self.start_reaper()
        try:
            port = free_port()
            if self.secure:
                bundles, command = self.provision(port)
                why = " (clear updates to trusted cells travel only over TLS)" if not o.secure else ""
                self.say(f"provisioned a fleet{why}: CA, signing key and {len(bundles)} node bundles in "
                         f"{self.workdir / 'bundles'}")
                self.start_broker(port, command)
                paths = self.write_configs(port, bundles)
            else:
                self.start_broker(port)
                paths = self.write_configs(port)
            self.say(f"fedtier demo: {o.devices} devices in {o.cells} cells, {o.rounds} rounds of {o.algorithm} on "
                     f"{self.task_description()}; {self.broker_kind} broker on 127.0.0.1:{port}")
            extra = self.announce_strategy(paths.coordinator)
            plan = None
            if o.privacy is not None:
                plan = self.privacy_plan(paths.coordinator)
                for line in plan_lines(plan, self.members()):
                    self.say(line)
                from cloud_coordinator.privacy.accountant import convergence_note

                note = convergence_note()  # dp-accounting's warnings while planning, in one line
                if note is not None:
                    self.say(f"  {note}")
            metrics = self.workdir / "coordinator" / "metrics.json"
            if o.keep_running:
                metrics = self.register_rollout(paths)
            self.start_nodes(paths)
            self.say(f"started {len(self.procs)} processes (logs: {self.logs})")
            self.view.rounds_started(o.rounds)
            try:
                doc = self.follow(metrics, started)
            finally:
                self.view.rounds_ended()
            rows = doc["rounds"]
            if o.keep_running:
                self.keep_running(paths)
            self.stop_all()
            privacy = None
            if plan is not None:
                privacy = privacy_summary(plan, self.workdir / "coordinator" / "coordinator.db", "demo", rows,
                                          self.members(), status_stopped=doc.get("stopped"))
            ok = True
            return DemoResult(rounds=rows, wall_s=time.perf_counter() - started, broker=self.broker_kind,
                              workdir=self.workdir, processes=len(self.procs), secure=self.secure,
                              stopped=doc.get("stopped"), privacy=privacy,
                              extra={**extra, **({"dashboard": self.dashboard_url} if self.dashboard_url else {})})
        finally:
            self.stop_all()
            self.stop_reaper()
            if ok and self._own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def announce_strategy(self, coordinator_config: Path) -> dict[str, Any]:
        """Say which strategy runs and, loudly, that an attack run is one; return both for the summary."""
        if not self.opts.strategy:
            return {}
        from fedtier.rollout.config import RolloutConfig
        from fedtier.runtime.config import load

        cfg = load(RolloutConfig, coordinator_config)
        out: dict[str, Any] = {}
        strategy = cfg.strategy()
        if strategy is not None:
            out["strategy"] = strategy
            opt = strategy.get("server_optimizer")
            self.say(f"strategy: edge {strategy.get('edge', {}).get('rule', 'mean')}, cloud "
                     f"{strategy.get('cloud', {}).get('rule', 'mean')}"
                     + (f", server optimizer {opt['kind']}" if opt else ""))
        partial_work = bool(getattr(cfg.section, "partial_work", False))
        if cfg.proximal_mu or partial_work:
            self.say(f"FedProx mu {cfg.proximal_mu:g}" + (", partial work" if partial_work else ""))
        if cfg.attack is not None:
            attackers = cfg.attackers()
            out["attack"] = {"kind": cfg.attack.kind, "fraction": cfg.attack.fraction, "scale": cfg.attack.scale,
                             "devices": attackers, "note": cfg.attack.describe()}
            self.say(f"{cfg.attack.describe()}: {', '.join(attackers) or 'no device at this fraction'} "
                     "(a robustness test)")
        return out

    def keep_running(self, paths: FleetPaths) -> None:
        """--keep-running: the rollout ended; leave the fleet up (restarting any child that dies) for the
        operator's commands until Ctrl-C or SIGTERM."""
        state = self.workdir / KEEP_RUNNING_STATE
        self.say(f"rollout finished; the fleet keeps running (broker, coordinator serve, {len(paths.edges)} edges, "
                 f"{len(paths.devices)} agents) until Ctrl-C. Try:")
        self.say(f"  export FEDTIER_STATE_DIR={state}")
        self.say("  fedtier rollout status demo; fedtier devices list; fedtier rollout models demo")
        if self.dashboard_url:
            self.say(f"  the dashboard of every rollout: {self.dashboard_url}")
        self.say(f"  fedtier rollout create --config {paths.coordinator} (another rollout: change its rollout id)")
        while True:
            self.restart_dead()
            time.sleep(0.5)

    def privacy_plan(self, coordinator_config: Path) -> dict[str, Any]:
        """``fedtier privacy plan``'s document of the written rollout config (the same code)."""
        from fedtier.rollout.config import RolloutConfig
        from cloud_coordinator.privacy.plan_view import plan_document
        from fedtier.runtime.config import load

        return plan_document(load(RolloutConfig, coordinator_config), coordinator_config)

    def follow(self, metrics_path: Path, started: float) -> dict[str, Any]:
        """Wait for rounds to close, reporting each; return the metrics document once the rollout ended."""
        seen = 0
        doc: dict[str, Any] = {"rounds": []}
        mtime = 0.0
        coordinator = next(p for p in self.procs if p.role == "coordinator")
        while True:
            if time.perf_counter() - started > self.opts.timeout_s:
                raise DemoError(f"timed out after {self.opts.timeout_s:.0f}s at round {seen}/{self.opts.rounds}; "
                                f"logs in {self.logs}")
            self.restart_dead()
            coordinator = next(p for p in self.procs if p.role == "coordinator")
            finished = False
            try:
                m = metrics_path.stat().st_mtime
            except FileNotFoundError:
                m = 0.0
            if m and m != mtime:
                mtime = m
                doc = json.loads(metrics_path.read_text())
                finished = bool(doc.get("finished"))
                for row in doc["rounds"][seen:]:
                    self.view.round_closed(row, self.opts.rounds)
                seen = len(doc["rounds"])
            if finished or (coordinator.popen.poll() == 0 and seen >= self.opts.rounds):
                return doc
            time.sleep(0.1)


# --- privacy: the plan before, the ledger after ---------------------------------------------------


def plan_lines(plan: dict[str, Any], members: dict[str, list[str]] | None = None) -> list[str]:
    """The noise plan in a few lines (``plan_view.render_summary``: the same document and cell lines as
    ``fedtier privacy plan``): the target, who adds noise in each cell, each tier's multiplier, the warnings.

    Args:
        plan: ``cloud_coordinator.privacy.plan_view.plan_document`` of the demo's rollout.
        members: unused (the plan's nodes say which devices each cell has); kept for callers.
    """
    from cloud_coordinator.privacy.plan_view import render_summary

    return render_summary(plan)


def plan_cloud(plan: dict[str, Any]) -> str:
    return next(n["node"] for n in plan["nodes"] if n["kind"] == "cloud")


def privacy_summary(plan: dict[str, Any], db: Path, rollout: str, rows: list[dict[str, Any]],
                    members: dict[str, list[str]], *, status_stopped: str | None = None) -> dict[str, Any]:
    """The privacy numbers of a finished demo, from the coordinator's ledger rows.

    The final epsilon is recomputed from the rows exactly as ``fedtier privacy report`` does
    (``ledger.recompute``) and compared with the live value of the last round's metrics.
    """
    from cloud_coordinator.privacy.ledger import recompute
    from cloud_coordinator.privacy.report import agrees
    from cloud_coordinator.store import CoordinatorStore

    delta = float(plan["delta"])
    store = CoordinatorStore(db)
    try:
        epsilons = recompute(store, rollout, delta)
        status = store.status(rollout)
        releases = len(store.privacy_releases(rollout))
    finally:
        store.close()
    values = list(epsilons.values()) or [0.0]
    live = (rows[-1].get("privacy") or {}).get("epsilon_max") if rows else None
    nodes = {n["node"]: n for n in plan["nodes"]}
    cells: dict[str, dict[str, Any]] = {}
    for cell, devices in members.items():
        trusted = bool(nodes[cell]["trusted"])
        injector = nodes[cell] if trusted else nodes[devices[0]]
        cells[cell] = {"trusted": trusted, "devices": len(devices), "noise_by": "edge" if trusted else "devices",
                       "z": injector["z"], "sigma": injector["sigma"], "sensitivity": injector["sensitivity"]}
    return {
        "epsilon": max(values), "epsilon_min": min(values), "delta": delta,
        "target_epsilon": plan["epsilon"], "budget_epsilon": plan["budget_epsilon"], "clip": plan["clip"],
        "calibration": plan["mode"], "require_tls": plan["require_tls"],
        "noise_multiplier": {name: t["z"] for name, t in plan["tiers"].items() if t["injectors"]},
        "cells": cells,
        "epsilon_per_round": [(r.get("privacy") or {}).get("epsilon_max") for r in rows],
        "live_epsilon": live, "ledger_agrees": agrees(max(values), live),
        "ledger_releases": releases, "status": status, "stopped": status_stopped,
        "warnings": list(plan["warnings"]),
    }

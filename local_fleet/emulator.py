"""``fedtier fleet emulate``: a large fleet on one machine, through a real Mosquitto.

Every device is a real device agent — the node ``fedtier agent run`` builds (``device_agent.run.build``),
with its own MQTT client, identity, outbox (SQLite in its state dir) and noise — running on a thread
of a worker process that hosts up to ``DEVICES_PER_PROCESS`` of them (paho-mqtt waits on its socket
with ``select``, which cannot watch a descriptor numbered 1024 or more, and each device holds about
six); the edges and the coordinator are real nodes too (``edge_broker.run.build``,
``cloud_coordinator.run.build``), each on its own thread and connection in the main process. Two
things differ from a fleet of separate devices, both for memory and both stated in the result:

* the devices of one worker share one trainer per bundle (one ORT session per architecture), and
  a lock serializes their local training (two threads must not swap parameters into one session at
  once);
* ``compute_delay_ms`` adds a simulated on-device compute time to every local run, outside that lock,
  so that a round can be made to wait for slow devices the way a real fleet's does.

With availability (``EmulatorOptions.availability``, or the rollout's own ``[fleet]``) the fleet also
comes and goes: the simulator's traces played in real time, an emulated day lasting ``day_s`` real
seconds (``local_fleet.realtime_traces``): a device is connected only in its windows and each local
training takes its trace's time on top of its computation (``local_fleet.mux``, which is also why
traces need ``loop = "mux"``).

The rollout uses the synthetic task (40 samples a device, MLP 64-64-10 by default); the result gives
each round's time, the slowest device's local run (which includes waiting for the shared session),
the median device's training, all training of the round, and the round overhead: round time minus
the slowest device's run (the broker, decoding, aggregation, evaluation and the protocol's waits).
"""

from __future__ import annotations

import getpass
import logging
import os
import resource
import shutil
import statistics
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from local_fleet.demo import free_port, mosquitto_path, wait_for_port
from fedtier.errors import ConfigError

if TYPE_CHECKING:
    from fedtier.algorithms.base import EdgeRole
    from local_fleet.realtime_traces import RealTimeTraces

log = logging.getLogger("fedtier.fleet")


@dataclass
class EmulatorOptions:
    devices: int = 100
    cells: int = 1
    rounds: int = 3
    broker: str | None = None  # HOST:PORT of a running broker; None: start a Mosquitto for the run
    stagger_s: float = 0.0  # spread the devices' start over this many seconds
    compute_delay_ms: float = 0.0
    local_steps: int = 5
    algorithm: str = "fedavg"
    """"fedavg" (rounds) or "fedbuff" (asynchronous: ``rollout_mapping``)."""
    hidden: int = 64
    deadline_s: float = 120.0
    quorum: float = 1.0
    """FedAvg: the share of a cell's devices (and of the cells) enough to close a round after ``deadline_s``; below
    1 when devices come and go (``availability``), or each round waits for its last device's window."""
    seed: int = 0
    workdir: Path | None = None
    loop: str = "mux"
    """How a worker process drives its devices: "mux", all on one thread, their sockets multiplexed
    (``fleet_mux``); or "threads", a node thread and a network thread per device."""
    keepalive_s: int = 30
    """MQTT keep-alive of every emulated node. The default holds at 10,000 devices on 2 cores (workers serve
    their devices while building them); raise it if the broker drops emulated devices for silence."""
    device_state: str = "ram"
    """Where the emulated devices keep their state (outbox, models): "ram", a RAM disk (``/dev/shm``)
    when the machine has one, since every real board writes its own flash and ten thousand outboxes
    committing to one disk make every commit on it (the edges' included) wait behind theirs; "disk", with
    the rest of the workdir."""
    stall_s: float = 900.0
    """Stop the run when no update reaches an edge and no round closes for this long, with a report of
    where every cell's edge and devices stand (``fleet_probe``); 0 waits for ever."""
    rollout: dict[str, Any] | None = None
    """A rollout config mapping to run instead of the synthetic task (``rollout_mapping``), e.g. the private
    demo's (``local_fleet.private_demo``); its devices, cells and rounds are the mapping's (and its ``[fleet]``,
    if it has one, its availability)."""
    availability: str | None = None
    """"always", "diurnal" or "file": play the fleet's availability and speed traces (``[fleet]``,
    ``fedtier.rollout.availability``) in real time; None: every device online, no added training time (or the
    rollout's own ``[fleet]``). The four below are ``[fleet]``'s keys (None: its defaults)."""
    share_online: float | None = None
    compute_s: float | None = None
    """The median device's local training, in seconds of the emulated day (scaled like the day)."""
    speed_sigma: float | None = None
    trace_file: Path | None = None
    day_s: float = 120.0
    """Real seconds one emulated day (``[fleet] day_s``, 86,400 s by default) lasts."""


@dataclass
class RoundTiming:
    round: int
    round_s: float
    slowest_device_s: float
    """The last device's local run, from its task to its update: its training, its wait for the shared
    session while others trained, and the simulated delay."""
    median_device_s: float
    """A device's training alone (median)."""
    training_s: float
    """All devices' training, one after the other (the shared session serializes it)."""
    devices_reported: int
    accuracy: float | None
    edge_decode_s: float = 0.0
    """The edges' threads decoding the round's messages (sha256 and tensor copies), summed over edges."""
    edge_work_s: float = 0.0
    """The edges' threads handling messages (decoding included: the role's aggregation, the store's writes,
    publishing) and ticking, summed over edges."""
    coordinator_s: float = 0.0
    """The coordinator's thread: decoding the cells' updates, aggregating, evaluating, committing the round."""
    workers: int = 1
    online: int | None = None
    """Devices online by their traces as the round closed (None: no availability traces)."""

    @property
    def overhead_s(self) -> float:
        """The round's time beyond its slowest device's local run."""
        return self.round_s - self.slowest_device_s

    @property
    def rest_s(self) -> float:
        """What the breakdown does not name: the broker's deliveries, the devices' own decoding, encoding and
        outbox writes, and waiting (round time minus the workers' share of the training, the edges' and the
        coordinator's work; below zero when those overlap each other on the cores)."""
        return self.round_s - self.training_s / max(1, self.workers) - self.edge_work_s - self.coordinator_s


@dataclass
class EmulationResult:
    devices: int
    cells: int
    rounds: list[RoundTiming]
    start_s: float  # from the first thread started to every device connected and subscribed
    wall_s: float
    peak_rss_mb: float
    """Of the main process (edges, coordinator); the workers hold the devices."""
    threads: int
    broker: str
    notes: list[str] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    """The coordinator's round rows (accuracy, bytes, privacy), as its metrics file has them."""

    def to_dict(self) -> dict[str, Any]:
        return {"devices": self.devices, "cells": self.cells, "start_s": self.start_s, "wall_s": self.wall_s,
                "peak_rss_mb": self.peak_rss_mb, "threads": self.threads, "broker": self.broker, "notes": self.notes,
                "rounds": [{**r.__dict__, "overhead_s": r.overhead_s, "rest_s": r.rest_s} for r in self.rounds]}


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit (each device holds a socket and a database)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _die_with_parent() -> None:
    """In a child about to exec (Linux): SIGTERM it when the emulator dies, even by SIGKILL, which skips
    the emulator's own clean-up (``prctl(PR_SET_PDEATHSIG)``). A no-op where there is no prctl."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _start_mosquitto(workdir: Path, clients: int) -> tuple[subprocess.Popen, int]:
    mosq = mosquitto_path()
    if mosq is None:
        raise ConfigError("no Mosquitto: install it (apt-get install mosquitto) or pass --broker HOST:PORT",
                          key="broker")
    port = free_port()
    conf = workdir / "mosquitto.conf"
    # `user`: Mosquitto started as root switches to the user `mosquitto`, and that change of credentials
    # clears the parent-death signal `_die_with_parent` sets; it is this process's own user instead
    conf.write_text("\n".join([f"user {getpass.getuser()}", "allow_anonymous true", "persistence false",
                               "log_dest stdout",
                               "max_queued_messages 100000", f"listener {port} 127.0.0.1",
                               f"max_connections {clients + 64}"]) + "\n")

    def more_files() -> None:  # the broker holds one socket per client
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        _die_with_parent()

    proc = subprocess.Popen([mosq, "-c", str(conf)], stdout=(workdir / "mosquitto.log").open("wb"),
                            stderr=subprocess.STDOUT, preexec_fn=more_files)
    if not wait_for_port(port, 10):
        proc.kill()
        raise RuntimeError(f"Mosquitto did not open port {port}: see {workdir / 'mosquitto.log'}")
    return proc, port


def rollout_mapping(opts: EmulatorOptions) -> dict[str, Any]:
    """The emulated rollout: the synthetic task, ``cells`` cells sharing the devices (and, with availability, its
    ``[fleet]``: ``fedtier simulate`` of the same coordinator config plays the same traces on a virtual clock)."""
    per_cell = -(-opts.devices // opts.cells)
    mapping = {"rollout": ROLLOUT, "rounds": opts.rounds, "seed": opts.seed, "algorithm": opts.algorithm,
               "model": {"kind": "mlp", "hidden": [opts.hidden]},
               "topology": {"cells": opts.cells, "devices_per_cell": per_cell},
               "data": {"dataset": "synthetic", "samples": 40 * per_cell * opts.cells, "features": 64, "classes": 10,
                        "partition": "dirichlet", "alpha": 0.5, "seed": opts.seed},
               opts.algorithm: _algorithm_section(opts, per_cell)}
    fleet = fleet_section(opts)
    if fleet is not None:
        mapping["fleet"] = fleet
    return mapping


AVAILABILITY_OPTIONS = {"availability": "--availability", "share_online": "--share-online",
                        "compute_s": "--compute-s", "speed_sigma": "--speed-sigma", "trace_file": "--trace-file"}
"""``[fleet]``'s keys the emulator takes, and the options of ``fleet emulate`` that set them."""


def fleet_section(opts: EmulatorOptions) -> dict[str, Any] | None:
    """The ``[fleet]`` the options ask for (None without ``availability``)."""
    if opts.availability is None:
        return None
    given = {key: getattr(opts, key) for key in AVAILABILITY_OPTIONS if getattr(opts, key) is not None}
    if "trace_file" in given:
        given["trace_file"] = str(Path(given["trace_file"]).resolve())
    return given


def check_availability(opts: EmulatorOptions) -> None:
    """The availability options make sense together (else a ``ConfigError`` naming the option).

    Raises:
        ConfigError: keyed by the option (``share_online``, ...), its message naming the command-line flag.
    """
    from fedtier.rollout.availability import AvailabilitySpec, load_trace_file

    if not (opts.day_s > 0 and opts.day_s < float("inf")):
        raise ConfigError(f"--day-s (real seconds an emulated day lasts) must be > 0, got {opts.day_s!r}",
                          key="day_s")
    if opts.availability is None:
        stray = [flag for key, flag in AVAILABILITY_OPTIONS.items() if getattr(opts, key) is not None]
        if stray:
            raise ConfigError(f"{stray[0]} describes the fleet's availability: give --availability too",
                              key=stray[0].lstrip("-").replace("-", "_"))
        return
    if opts.rollout is not None and "fleet" in opts.rollout:
        raise ConfigError("--availability: the rollout has its own [fleet]; leave the option out or remove the "
                          "section", key="availability")
    try:
        fields: dict[str, Any] = {key: (Path(value) if key == "trace_file" else value)
                                  for key, value in (fleet_section(opts) or {}).items()}
        AvailabilitySpec(**fields)
        if opts.availability == "file":
            load_trace_file(opts.trace_file)
    except ConfigError as exc:
        key = (exc.key or "fleet.availability").removeprefix("fleet.")
        raise ConfigError(f"{AVAILABILITY_OPTIONS.get(key, key)}: {exc.message}", key=key) from None
    if opts.loop != "mux":
        raise ConfigError("--availability needs --loop mux: the multiplexed loop takes devices off the broker and "
                          "back as their traces say", key="loop")


def _algorithm_section(opts: EmulatorOptions, per_cell: int) -> dict[str, Any]:
    """A synchronous algorithm's rounds (with ``--quorum``), or an asynchronous one (FedBuff) with a cell update
    every half cell of deltas and a version every ``cells`` cell updates, each device training once per version
    (so a device that trains fast does not flood its edge with deltas of one version while the next is on its
    way). Algorithms with hosts, pair scoring or per-cell submodels need their own task: refused."""
    from fedtier import algorithms
    from fedtier.errors import UnexpectedMessageError

    try:
        traits = algorithms.describe(opts.algorithm)
    except UnexpectedMessageError as exc:
        raise ConfigError(str(exc), key="algorithm") from None
    if traits.split_model or traits.scorer or traits.submodels:
        raise ConfigError(f"the fleet emulator's synthetic task does not suit {opts.algorithm} (it needs hosts, "
                          "pairs of classes or per-cell submodels): use fedavg or fedbuff", key="algorithm")
    section: dict[str, Any] = {traits.local_steps_setting: opts.local_steps, "batch_size": 16, "lr": 0.1,
                               "deadline_s": opts.deadline_s}
    if traits.asynchronous:
        section.update(k_edge=max(1, per_cell // 2), k_cloud=opts.cells, once_per_version=True)
    else:
        section["quorum"] = opts.quorum
    return section


class _SharedTrainers:
    """One trainer per bundle for every emulated device of this process, and the lock around its use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._trainers: dict[str, Any] = {}

    def provider(self, kind: str, threads: int) -> Callable[[Any], Any]:
        from device_agent.trainers import make_trainer

        def get(bundle: Any) -> Any:
            with self.lock:
                if bundle.bundle_id not in self._trainers:
                    self._trainers[bundle.bundle_id] = make_trainer(kind, bundle, threads=threads)
                return self._trainers[bundle.bundle_id]

        return get


DEVICES_PER_PROCESS = 120
"""Devices one threaded worker process hosts: about six descriptors each stays below ``select``'s 1024."""
MUX_DEVICES_PER_PROCESS = 2000
"""Devices one multiplexed worker hosts at most: about six descriptors each, within a 20,000 file limit."""


class _DeviceHost:
    """Device agents on threads of one process, sharing a trainer; records each local run's time."""

    def __init__(self, compute_delay_ms: float, traces: "RealTimeTraces | None" = None) -> None:
        self.shared = _SharedTrainers()
        self.delay = compute_delay_ms / 1000.0
        self.traces = traces
        """The devices' availability and speeds: the mux holds a device its trace's extra time after training;
        here that time is counted in the run's seconds."""
        # (round, device, seconds of its local run incl. waiting for the shared session and its trace's extra
        # time, seconds training, time.monotonic() as it began)
        self.runs: list[tuple[int, str, float, float, float]] = []
        self._runs_lock = threading.Lock()
        self.threads: list[tuple[str, threading.Thread, threading.Event, list[BaseException]]] = []
        self.nodes: list[Any] = []  # the device nodes, for a stalled run's report

    def _locked_train(self, device: str, train: Callable[..., Any]) -> Callable[..., Any]:
        extra = self.traces.train_delay_s(device) if self.traces is not None else 0.0

        def run(trainer: Any, action: Any) -> Any:
            start, began_at = time.perf_counter(), time.monotonic()
            with self.shared.lock:
                began = time.perf_counter()
                result = train(trainer, action)
                trained = time.perf_counter() - began
            if self.delay:
                time.sleep(self.delay)
            total = time.perf_counter() - start + extra
            with self._runs_lock:
                self.runs.append((int(action.round), device, total, trained, began_at))
            return result

        return run

    def spawn(self, name: str, node: Any, transports: list[Any], inbox: Any,
              done: Callable[[], bool] = lambda: False) -> None:
        from fedtier.runtime import mqtt_service

        stop = threading.Event()
        errors: list[BaseException] = []

        def target() -> None:
            try:
                mqtt_service.run(node, transports, inbox, start=node.start, stop=stop, install_signals=False,
                                 done=done)
            except BaseException as exc:  # noqa: BLE001 - reported by check()
                errors.append(exc)

        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self.threads.append((name, thread, stop, errors))

    def build_device(self, config_path: Path) -> tuple[str, Any, Any, Any]:
        """A device as ``fedtier agent run`` builds it, sharing this host's trainer and timing its runs."""
        from device_agent.config import DeviceConfig
        from device_agent.run import build
        from fedtier.runtime.config import load

        cfg = load(DeviceConfig, config_path)
        node, tx, inbox = build(cfg)
        node.trainer_provider = self.shared.provider(_resolved(cfg.trainer), cfg.threads)
        node.train = self._locked_train(cfg.device_id, node.train)  # type: ignore[method-assign]
        self.nodes.append(node)
        return cfg.device_id, node, tx, inbox

    def add_device(self, config_path: Path) -> None:
        name, node, tx, inbox = self.build_device(config_path)
        self.spawn(name, node, [tx], inbox)

    def errors(self) -> list[str]:
        return [f"node {name} crashed: {errors[0]!r}" for name, _, _, errors in self.threads if errors]

    def stop(self) -> None:
        for _, _, stop, _ in self.threads:
            stop.set()
        for _, thread, _, _ in self.threads:
            thread.join(10)


class _ProbeAnswer:
    """A worker's side of the stall probe: the emulator raises ``probe``'s number, each worker answers once."""

    def __init__(self, probe: Any, answers: Any, host: _DeviceHost, rollout: str = "emulated") -> None:
        self.probe, self.answers, self.host, self.answered = probe, answers, host, 0
        self.rollout = rollout

    def __call__(self) -> None:
        wanted = self.probe.value
        if wanted != self.answered:
            from local_fleet.probe import describe_devices

            self.answered = wanted
            self.answers.put(describe_devices(self.host.nodes, self.rollout))


def _worker(config_paths: list[str], compute_delay_ms: float, step_s: float, ready: Any, stop: Any,
            results: Any, loop: str = "threads", probe: Any = None, answers: Any = None,
            rollout: str = "emulated", traces: "RealTimeTraces | None" = None) -> None:
    """A worker process: host ``config_paths``' devices until ``stop``, then report their runs. It answers the
    emulator's stall probe (``probe``'s number raised) with its devices' states on ``answers``. With ``traces``
    (mux only) its devices come and go and train at their traces' speeds."""
    raise_fd_limit()
    logging.basicConfig(level=logging.WARNING)
    host = _DeviceHost(compute_delay_ms, traces)
    orphaned = _orphan_check()
    answer = _ProbeAnswer(probe, answers, host, rollout) if probe is not None else (lambda: None)
    try:
        if loop == "mux":
            _mux_worker(host, config_paths, step_s, ready, stop, results, orphaned, answer)
            return
        _thread_worker(host, config_paths, step_s, ready, stop, results, orphaned, answer)
    finally:
        if orphaned():  # nobody reads our queues any more: exit without waiting to flush them (it would never end)
            for q in (ready, results, answers):
                if q is not None:
                    q.cancel_join_thread()


def _thread_worker(host: "_DeviceHost", config_paths: list[str], step_s: float, ready: Any, stop: Any,
                   results: Any, orphaned: Callable[[], bool], answer: Callable[[], None]) -> None:
    """``_worker`` with a node thread and a network thread per device."""
    try:
        for path in config_paths:
            host.add_device(Path(path))
            if step_s:
                time.sleep(step_s)
        ready.put(len(config_paths))
        while not stop.wait(0.2):
            answer()
            if host.errors() or orphaned():
                break
    finally:
        host.stop()
        results.put({"runs": host.runs, "errors": host.errors()})


RAM_DISK = Path("/dev/shm")


def _device_state_root(where: str) -> Path | None:
    """A fresh directory on the RAM disk for the devices' state (``EmulatorOptions.device_state``), or None
    for the workdir's ``devices/``."""
    if where not in ("ram", "disk"):
        raise ConfigError(f"device_state must be 'ram' or 'disk', not {where!r}", key="device_state")
    if where == "disk" or not (RAM_DISK.is_dir() and os.access(RAM_DISK, os.W_OK)):
        return None
    return Path(tempfile.mkdtemp(prefix="fedtier-fleet-devices-", dir=RAM_DISK))


def _orphan_check() -> Callable[[], bool]:
    """True once the emulator that started this worker is gone (killed without its ``finally``, e.g. by
    SIGKILL): the worker then stops its devices instead of running on for ever."""
    parent = os.getppid()
    return lambda: os.getppid() != parent


def _mux_worker(host: _DeviceHost, config_paths: list[str], step_s: float, ready: Any, stop: Any,
                results: Any, orphaned: Callable[[], bool], answer: Callable[[], None]) -> None:
    """``_worker`` with every device on this process's one thread (``fleet_mux``)."""
    from local_fleet.mux import MuxHost

    mux = MuxHost(host.traces)
    try:
        for path in config_paths:
            mux.add(*host.build_device(Path(path)))
            mux.run_once(wait=False)
            if step_s:
                time.sleep(step_s)
        ready.put(len(config_paths))

        def done() -> bool:
            answer()
            return stop.is_set() or bool(mux.errors()) or orphaned()

        mux.run(done)
    finally:
        mux.close()
        results.put({"runs": host.runs, "errors": mux.errors()})


class FleetEmulator:
    """Builds, runs and stops an emulated fleet (see the module docstring)."""

    def __init__(self, opts: EmulatorOptions, progress: Callable[[str], None] | None = None,
                 on_round: Callable[[dict[str, Any]], None] | None = None) -> None:
        if opts.devices < 1 or opts.cells < 1 or opts.devices < opts.cells:
            raise ConfigError("need at least one device per cell", key="devices")
        check_availability(opts)
        self.opts = opts
        self.say = progress or (lambda text: None)
        self.on_round = on_round
        """Called with each closed round's row instead of the default progress line."""
        self.mapping = opts.rollout if opts.rollout is not None else rollout_mapping(opts)
        self.rollout_id = str(self.mapping.get("rollout", ROLLOUT))
        self.servers = _DeviceHost(0.0)  # the edges and the coordinator, on threads of this process
        self.runs: list[tuple[int, str, float, float, float]] = []
        self.workers = 0
        self.busy: list[dict[str, float]] = []
        """Per closed round: the edges' and the coordinator's busy seconds so far (``NodeBase.busy_s``)."""
        self.traces: RealTimeTraces | None = None
        """The devices' availability and speed in real time, once the run has started (None: no ``[fleet]``)."""
        self.online: list[int] = []
        """Per closed round: the devices online by their traces as it closed."""
        self.rollout_started: float | None = None
        """``time.monotonic()`` as the coordinator started (every device was then built and, if online, connecting)."""

    def run(self) -> EmulationResult:
        import multiprocessing

        from fedtier.rollout.config import RolloutConfig
        from local_fleet.configs import write_fleet
        from cloud_coordinator.run import build as build_cloud
        from edge_broker.config import EdgeConfig
        from edge_broker.run import build as build_edge
        from fedtier.runtime.config import load

        o = self.opts
        started = time.perf_counter()
        own_dir = o.workdir is None
        workdir = Path(tempfile.mkdtemp(prefix="fedtier-fleet-")) if own_dir else Path(o.workdir)  # type: ignore[arg-type]
        workdir.mkdir(parents=True, exist_ok=True)
        raise_fd_limit()
        broker_proc = None
        ctx = multiprocessing.get_context("spawn")
        stop, ready, results = ctx.Event(), ctx.Queue(), ctx.Queue()
        probe, answers = ctx.Value("i", 0), ctx.Queue()
        procs: list[Any] = []
        device_root: Path | None = None
        try:
            if o.broker is None:
                broker_proc, port = _start_mosquitto(workdir, o.devices + 2 * o.cells + 1)
                host, broker_label = "127.0.0.1", f"Mosquitto on 127.0.0.1:{port} (started for the run)"
            else:
                host, _, port_text = o.broker.rpartition(":")
                host, port, broker_label = host or "127.0.0.1", int(port_text), f"{o.broker}"
            self.say(f"writing the fleet: {o.devices} devices in {o.cells} cells ({workdir})")
            device_root = _device_state_root(o.device_state)
            paths = write_fleet(self.mapping, workdir, {"host": host, "port": port,
                                                              "keepalive_s": o.keepalive_s},
                                device_settings={"trainer": "auto"}, device_state_root=device_root)
            devices = [str(paths.devices[d]) for d in list(paths.devices)[: o.devices]]
            self.traces = self._traces(load(RolloutConfig, paths.coordinator), list(paths.devices)[: o.devices])
            t_start = time.perf_counter()
            if o.loop == "mux":  # one busy thread per worker: as many workers as cores, or more if descriptors run out
                count = max(1, min(len(devices), max(os.cpu_count() or 1, -(-len(devices) // MUX_DEVICES_PER_PROCESS))))
                groups = [devices[i::count] for i in range(count)]
            else:
                groups = [devices[i:i + DEVICES_PER_PROCESS] for i in range(0, len(devices), DEVICES_PER_PROCESS)]
            self.workers = len(groups)
            step = o.stagger_s / max(1, len(devices)) * len(groups)
            for group in groups:
                proc = ctx.Process(target=_worker, args=(group, o.compute_delay_ms, step, ready, stop, results,
                                                         o.loop, probe, answers, self.rollout_id, self.traces),
                                   daemon=True)
                proc.start()
                procs.append(proc)
            hosted = 0
            while hosted < len(devices):
                try:
                    hosted += int(ready.get(timeout=600))
                except Exception as exc:  # queue.Empty
                    raise RuntimeError("the device workers did not start within 10 minutes") from exc
                self.say(f"started {hosted} of {len(devices)} devices in {len(groups)} worker process(es)")
            edge_inboxes: dict[str, tuple[Any, Any]] = {}  # cell -> its edge node and inbox
            for cell in paths.edges:
                edge, transports, inbox = build_edge(load(EdgeConfig, paths.edges[cell]))
                self.servers.spawn(cell, edge, transports, inbox)
                edge_inboxes[cell] = (edge, inbox)
            edges = [edge for edge, _ in edge_inboxes.values()]
            cloud, tx, inbox = build_cloud(load(RolloutConfig, paths.coordinator))
            previous = cloud.on_round

            def snapshot(row: dict[str, Any]) -> None:
                # on the coordinator's thread as it closes the round: rounds closing within one poll of
                # the loop below still get a snapshot each (a shared one gave the later round 0 s of work)
                self.busy.append(_busy(edges, cloud))
                if self.traces is not None:
                    self.online.append(self.traces.online_count(time.monotonic()))
                if previous is not None:
                    previous(row)

            cloud.on_round = snapshot
            self.rollout_started = time.monotonic()
            self.servers.spawn("coordinator", cloud, [tx], inbox, done=lambda: cloud.finished)
            start_s = time.perf_counter() - t_start
            try:
                self._wait_rounds(cloud, edges, edge_inboxes, procs, probe, answers)
            except KeyboardInterrupt:
                raise RuntimeError("stopped while the rollout ran; where the cells stood:\n"
                                   f"{_stall_report(edge_inboxes, probe, answers, procs, self.rollout_id)}") from None
            history = list(cloud.history)
            stop.set()
            for _ in procs:
                report = results.get(timeout=60)
                self.runs.extend(tuple(r) for r in report["runs"])
                if report["errors"]:
                    raise RuntimeError(report["errors"][0])
        finally:
            stop.set()
            self.servers.stop()
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
            if broker_proc is not None:
                broker_proc.terminate()
                broker_proc.wait(10)
            if own_dir:
                shutil.rmtree(workdir, ignore_errors=True)
            if device_root is not None:
                shutil.rmtree(device_root, ignore_errors=True)
        return EmulationResult(devices=o.devices, cells=o.cells, rounds=self._timings(history), start_s=start_s,
                               wall_s=time.perf_counter() - started, peak_rss_mb=_peak_rss_mb(),
                               threads=threading.active_count(), broker=broker_label, history=history,
                               notes=[f"devices in {self.workers} worker process(es), " + (
                                   "each driving its devices on one thread (their sockets multiplexed)"
                                   if o.loop == "mux" else
                                   f"of at most {DEVICES_PER_PROCESS}, a node thread and a network thread per device")
                                   + "; those of one worker share one trainer per bundle and train one at a time "
                                     "(a real fleet trains in parallel on its own CPUs)"]
                               + ([f"each local run also sleeps {o.compute_delay_ms:g} ms (simulated device compute)"]
                                  if o.compute_delay_ms else []) + self._trace_notes())

    def _traces(self, cfg: Any, devices: list[str]) -> "RealTimeTraces | None":
        """The emulated devices' traces from the rollout's ``[fleet]`` (the options' or its own), the day starting
        now; what the simulator builds for the same rollout (its spec, seed and device ids)."""
        if cfg.fleet is None:
            return None
        if self.opts.loop != "mux":
            raise ConfigError("the rollout's [fleet] needs --loop mux: the multiplexed loop takes devices off the "
                              "broker and back as their traces say", key="loop")
        from local_fleet.realtime_traces import RealTimeTraces

        return RealTimeTraces.build(cfg.fleet.spec(), cfg.seed, devices, self.opts.day_s)

    def _trace_notes(self) -> list[str]:
        if self.traces is None:
            return []
        from fedtier.rollout.availability import speed_quantiles

        median, p90, p99 = (q * self.traces.scale for q in speed_quantiles(self.traces.traces))
        return [f"availability and speed traces in real time, a day lasting {self.opts.day_s:g} s (x "
                f"{self.traces.scale:.3g} of the trace's seconds): a device is connected only in its windows and "
                f"each local run holds it {median:.3g} s (median; p90 {p90:.3g} s, p99 {p99:.3g} s) on top of its "
                "training"]

    def _wait_rounds(self, cloud: Any, edges: list[Any], edge_inboxes: dict[str, tuple[Any, Any]], procs: list[Any],
                     probe: Any, answers: Any) -> None:
        """Until the rollout finishes: report each closed round; stop on a crash or a stall (``stall_s``)."""
        stall_s = self.opts.stall_s
        seen = 0
        progress, progressed = _progress(cloud, edges, self.rollout_id), time.monotonic()
        while not cloud.finished:
            now_at = _progress(cloud, edges, self.rollout_id)
            if now_at != progress:
                progress, progressed = now_at, time.monotonic()
            elif stall_s and time.monotonic() - progressed > stall_s:
                where = _stall_report(edge_inboxes, probe, answers, procs, self.rollout_id)
                raise RuntimeError(f"no update reached an edge and no round closed for {stall_s:g} s; where "
                                   f"the cells stand:\n{where}")
            problems = self.servers.errors()
            if problems:
                raise RuntimeError(problems[0])
            if any(not p.is_alive() for p in procs):
                raise RuntimeError("a device worker process died")
            seen = self._report_rounds(cloud.history, seen)
            time.sleep(0.05)
        self._report_rounds(cloud.history, seen)  # the rounds that closed since the last look, the last one

    def _report_rounds(self, history: list[dict[str, Any]], seen: int) -> int:
        """Report the rounds closed after the first ``seen`` (``on_round``, else a progress line); the new count."""
        for row in list(history[seen:]):
            if self.on_round is not None:
                self.on_round(row)
            else:
                online = f" ({self.online[seen]} online)" if seen < len(self.online) else ""
                self.say(f"round {row['round']} closed: {row['devices_reported']} devices{online}, "
                         f"{row['round_s']:.2f} s, accuracy {row.get('accuracy', float('nan')):.4f}")
            seen += 1
        return seen

    def _timings(self, history: list[dict[str, Any]]) -> list[RoundTiming]:
        out = []
        before = dict.fromkeys(("edge_decode", "edge_work", "coordinator"), 0.0)
        for i, row in enumerate(history):
            runs = [(total, trained) for r, _, total, trained, _ in self.runs if r == row["round"]]
            busy = self.busy[i] if i < len(self.busy) else before
            out.append(RoundTiming(round=int(row["round"]), round_s=float(row["round_s"]),
                                   slowest_device_s=max((t for t, _ in runs), default=0.0),
                                   median_device_s=statistics.median(t for _, t in runs) if runs else 0.0,
                                   training_s=sum(t for _, t in runs),
                                   devices_reported=int(row["devices_reported"]), accuracy=row.get("accuracy"),
                                   edge_decode_s=busy["edge_decode"] - before["edge_decode"],
                                   edge_work_s=busy["edge_work"] - before["edge_work"],
                                   coordinator_s=busy["coordinator"] - before["coordinator"],
                                   workers=max(1, self.workers),
                                   online=self.online[i] if i < len(self.online) else None))
            before = busy
        return out


ROLLOUT = "emulated"


def _progress(cloud: Any, edges: list[Any], rollout: str = ROLLOUT) -> tuple[int, ...]:
    """Changes whenever a round closes or an edge takes an update or moves on a step."""
    marks = [len(cloud.history)]
    for edge in edges:
        role: EdgeRole | None = edge.roles.get(rollout)
        if role is not None:
            marks += [role.round, role.step, len(role.reported)]
    return tuple(marks)


def _stall_report(edges: dict[str, tuple[Any, Any]], probe: Any, answers: Any, procs: list[Any],
                  rollout: str = ROLLOUT) -> str:
    """Every cell's edge (read here) and devices (asked of the live workers, 20 s at most)."""
    from local_fleet.probe import describe_edge, merge, render

    with probe.get_lock():
        probe.value += 1
    workers = sum(1 for p in procs if p.is_alive())  # after a Ctrl-C in a terminal they got it too
    reports: list[dict[str, dict[str, int]]] = []
    deadline = time.monotonic() + 20
    while len(reports) < workers and time.monotonic() < deadline:
        try:
            reports.append(answers.get(timeout=max(0.1, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 - queue.Empty: the workers that did not answer are counted below
            break
    report = render({cell: describe_edge(edge, inbox, rollout) for cell, (edge, inbox) in edges.items()},
                    merge(reports))
    missing = len(procs) - len(reports)
    return report + (f"\n({missing} of {len(procs)} worker processes did not answer)" if missing else "")


def _busy(edges: list[Any], cloud: Any) -> dict[str, float]:
    """The edges' and the coordinator's cumulative busy seconds (read from their threads without a lock: a
    float that is being added to is at most one message behind)."""
    return {"edge_decode": sum(e.busy_s["decode"] for e in edges),
            "edge_work": sum(e.busy_s["handle"] + e.busy_s["tick"] for e in edges),
            "coordinator": cloud.busy_s["handle"] + cloud.busy_s["tick"]}


def _resolved(kind: str) -> str:
    from device_agent.trainers import resolve_kind

    return str(resolve_kind(kind))


def _peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

"""``fedtier demo --privacy``: private federated learning at a size where it learns.

Differential privacy costs accuracy in proportion to the noise against the signal, and the noise a
trusted edge adds is divided by the number of devices it averages. The 12-device demo cannot learn
under a useful epsilon (its plan says so: the noise is ~60 times the clipped signal); a fleet of a
few hundred devices can. So the private demo runs such a fleet, as the fleet emulator does
(``local_fleet.emulator``): every device is the real agent ``fedtier agent run`` builds, with its
own MQTT connection, identity, outbox and noise, on a thread of one of a few worker processes that
share one ONNX Runtime session; the edges and the coordinator are the real nodes on threads of this
process; all over a real Mosquitto. What it picks, and prints, from the plan (``plan_view``):

* every cell trusted (``--trusted`` overrides): the devices send clipped updates to their edge, which
  adds noise once per round for its whole cell, instead of every device noising its own update;
* device sampling in secret at the rate ``q`` the plan gives the best signal-to-noise for the target
  epsilon (``choose_sample_rate``; amplification by sampling, docs/privacy.md), unless ``--sample-rate``;
* the noise multiplier calibrated by the accountant for that sampled release count, clipping at C;
* a linear softmax model (650 parameters on digits): the noise grows with the square root of the
  parameter count, and a linear model is what this data needs (0.94 without privacy).

``--compare`` runs the same fleet and seeds without ``[privacy]`` (every device every round). The
epsilon per round comes from the coordinator's live ledger, the final one from its rows (what
``fedtier privacy report`` recomputes).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from local_fleet.demo import DemoView

ROLLOUT = "private-demo"
ALGORITHM = "fedavg"
"""The private fleet trains plain hierarchical FedAvg; ``demo --algorithm`` with another runs the process fleet."""
SAMPLE_RATES = (0.1, 0.25, 0.5, 1.0)
"""The sampling rates the plan is asked about (1.0: no sampling)."""


@dataclass(frozen=True)
class PrivateFleetOptions:
    devices: int = 400
    cells: int = 2
    rounds: int = 30
    epsilon: float = 8.0
    delta: float = 1e-5
    clip: float = 1.0
    trusted: tuple[str, ...] | None = None  # None: every cell
    sample_rate: float | None = None  # None: chosen from the plan (``choose_sample_rate``)
    local_steps: int = 10
    lr: float = 0.5
    hidden: tuple[int, ...] = ()  # () = linear softmax
    alpha: float = 0.5
    seed: int = 0
    broker: str | None = None  # HOST:PORT of a running Mosquitto; None: start one
    timeout_s: float = 600.0
    workdir: Path | None = None


def members(devices: int, cells: int) -> dict[str, list[str]]:
    """cell -> its devices, spread evenly (``dev-000`` ...)."""
    width = max(3, len(str(devices - 1)))
    names = [f"dev-{i:0{width}d}" for i in range(devices)]
    sizes = [devices // cells + (1 if c < devices % cells else 0) for c in range(cells)]
    out, start = {}, 0
    for c, size in enumerate(sizes):
        out[f"cell-{chr(ord('a') + c)}"] = names[start:start + size]
        start += size
    return out


def trusted_cells(opts: PrivateFleetOptions) -> tuple[str, ...]:
    """The trusted cells: every cell unless ``opts.trusted`` says which.

    Raises:
        ValueError: ``opts.trusted`` names a cell the fleet does not have.
    """
    cells = list(members(opts.devices, opts.cells))
    if opts.trusted is None:
        return tuple(cells)
    unknown = sorted(set(opts.trusted) - set(cells))
    if unknown:
        raise ValueError(f"--trusted names {', '.join(unknown)}, but the demo's cells are {', '.join(cells)}")
    return tuple(c for c in cells if c in opts.trusted)


def rollout_mapping(opts: PrivateFleetOptions, state_dir: Path, *, private: bool = True,
                    sample_rate: float = 1.0) -> dict[str, Any]:
    """The rollout config the demo runs (what a user would write in ``rollout.toml``); ``private=False``: the
    same without ``[privacy]`` (``--compare``)."""
    from local_fleet.demo import default_artifact_store

    topology: dict[str, Any] = {"members": members(opts.devices, opts.cells)}
    mapping: dict[str, Any] = {
        "rollout": ROLLOUT, "algorithm": ALGORITHM, "rounds": opts.rounds, "seed": opts.seed,
        "state_dir": str(state_dir), "artifact_store": str(default_artifact_store()), "log_level": "warning",
        "model": {"kind": "mlp", "hidden": list(opts.hidden)},
        "data": {"dataset": "digits", "partition": "dirichlet", "alpha": opts.alpha, "seed": opts.seed},
        "topology": topology,
        "fedavg": {"local_steps": opts.local_steps, "lr": opts.lr, "batch_size": 32, "deadline_s": 120.0},
    }
    if private:
        trusted = trusted_cells(opts)
        if trusted:
            topology["trusted"] = dict.fromkeys(trusted, True)
        # No TLS in the emulated fleet (one Mosquitto on 127.0.0.1): the plan says so in a warning.
        mapping["privacy"] = {"epsilon": opts.epsilon, "delta": opts.delta, "clip": opts.clip, "require_tls": False}
        if sample_rate < 1.0:
            mapping["privacy"].update(device_sampling="poisson", sample_rate=sample_rate)
    return mapping


def plan_of(mapping: dict[str, Any], where: Path) -> dict[str, Any]:
    """``fedtier privacy plan``'s document of ``mapping`` (the same code)."""
    from cloud_coordinator.privacy.plan_view import plan_document
    from fedtier.rollout.config import RolloutConfig

    return plan_document(RolloutConfig.from_mapping({**mapping, "broker": {"host": "127.0.0.1", "port": 1883}}),
                         where)


def choose_sample_rate(opts: PrivateFleetOptions, where: Path,
                       rates: tuple[float, ...] = SAMPLE_RATES) -> tuple[float, dict[float, float]]:
    """The sampling rate whose plan has the best signal-to-noise over the rollout at the target epsilon.

    Sampling amplifies privacy (a smaller multiplier z for the same epsilon) but averages fewer devices
    (the noise is divided by q n): the plan's estimate weighs both. Ties go to the smaller rate (less work).

    Returns:
        The rate, and rate -> the plan's signal/noise over the rollout (``signal_to_noise.rollout_snr``).
    """
    snr: dict[float, float] = {}
    for q in rates:
        doc = plan_of(rollout_mapping(opts, where, sample_rate=q), where)
        estimate = doc["signal_to_noise"]
        snr[q] = float(estimate["rollout_snr"]) if estimate is not None else 0.0
    best = max(snr.values())
    return min(q for q, v in snr.items() if v >= best * (1 - 1e-9)), snr


@dataclass
class FleetRun:
    """One emulated run: the coordinator's round rows, its wall time, the broker, its workdir."""

    rounds: list[dict[str, Any]]
    wall_s: float
    broker: str
    workdir: Path
    notes: list[str]


def run_fleet(opts: PrivateFleetOptions, mapping: dict[str, Any], workdir: Path, say: Callable[[str], None],
              on_round: Callable[[dict[str, Any]], None]) -> FleetRun:
    """Run ``mapping`` on an emulated fleet (``local_fleet.emulator``) in ``workdir`` (kept)."""
    # The nodes' own warnings (the coordinator repeats the plan's) would interleave with the demo's lines, and
    # --json promises nothing but the document: the plan's warnings were printed already.
    quiet = logging.getLogger("fedtier")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        result = _emulate(opts, mapping, workdir, say, on_round)
    finally:
        quiet.setLevel(level)
    return FleetRun(rounds=result.history, wall_s=result.wall_s, broker=result.broker, workdir=workdir,
                    notes=result.notes)


def _emulate(opts: PrivateFleetOptions, mapping: dict[str, Any], workdir: Path, say: Callable[[str], None],
             on_round: Callable[[dict[str, Any]], None]) -> Any:
    from local_fleet.emulator import EmulatorOptions, FleetEmulator

    emulator = FleetEmulator(EmulatorOptions(devices=opts.devices, cells=opts.cells, rounds=opts.rounds,
                                             broker=opts.broker, seed=opts.seed, workdir=workdir, rollout=mapping,
                                             stall_s=min(300.0, opts.timeout_s)),
                             progress=say, on_round=on_round)
    return emulator.run()


@dataclass
class PrivateDemoResult:
    private: FleetRun
    privacy: dict[str, Any]
    plan: dict[str, Any]
    sample_rate: float
    snr_by_rate: dict[float, float]
    baseline: FleetRun | None = None
    wall_s: float = 0.0


def run(opts: PrivateFleetOptions, view: DemoView, *, compare: bool = False) -> PrivateDemoResult:
    """The private demo: choose from the plan, print it, run the fleet, read the ledger; then, with ``compare``,
    the same fleet and seeds without privacy. ``view`` gets the narration and every round."""
    from local_fleet.demo import privacy_summary

    started = time.perf_counter()
    own = opts.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="fedtier-private-demo-", dir=_scratch())) if own \
        else Path(opts.workdir).resolve()  # type: ignore[arg-type]
    workdir.mkdir(parents=True, exist_ok=True)
    ok = False
    try:
        q, snr, plan, mapping = _plan(opts, workdir / "private", view.say)
        private = _rounds(opts, mapping, workdir / "private", view)
        privacy = privacy_summary(plan, workdir / "private" / "coordinator" / "coordinator.db", ROLLOUT,
                                  private.rounds, members(opts.devices, opts.cells))
        privacy.update(sample_rate=q, signal_to_noise_by_rate=snr)
        baseline = None
        if compare:
            view.say("--compare: the same fleet again without privacy (same seeds, same data; every device every "
                     "round)")
            plain = workdir / "compare"
            baseline = _rounds(opts, rollout_mapping(opts, plain / "coordinator", private=False), plain, view)
        ok = True
        return PrivateDemoResult(private=private, privacy=privacy, plan=plan, sample_rate=q, snr_by_rate=snr,
                                 baseline=baseline, wall_s=time.perf_counter() - started)
    finally:
        if ok and own:
            shutil.rmtree(workdir, ignore_errors=True)


SCRATCH_MIN_FREE = 1 << 30
"""Free bytes /dev/shm needs to hold a throwaway work directory (~13 MB per 100 devices and run)."""


def _scratch() -> str | None:
    """Where a throwaway work directory goes: /dev/shm (memory) when it is there with room, else the default
    temporary directory. Each device keeps its state, outbox, artifacts and bundle (about 20 files): on a busy
    disk, writing and deleting 400 devices' worth took 10-30 s of a two-minute demo."""
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > SCRATCH_MIN_FREE:
            return str(shm)
    except OSError:
        pass
    return None


def _plan(opts: PrivateFleetOptions, where: Path, say: Callable[[str], None]
          ) -> tuple[float, dict[float, float], dict[str, Any], dict[str, Any]]:
    """Choose the sampling rate, say why and print the plan: (q, signal/noise by rate, plan, rollout mapping)."""
    from cloud_coordinator.privacy.accountant import convergence_note
    from cloud_coordinator.privacy.plan_view import render_summary

    model = "a linear softmax model" if not opts.hidden else f"an MLP {list(opts.hidden)}"
    say(f"fedtier demo --privacy: {opts.devices} device agents in {opts.cells} cells, {opts.rounds} rounds of "
        f"{ALGORITHM} on digits (non-iid, Dirichlet alpha={opts.alpha}), {model}")
    say("  why this size: a trusted edge's noise is divided by the devices it averages; at 12 devices it drowns "
        "the model (`fedtier demo --privacy --processes` runs that, and its plan says so)")
    q, snr = (opts.sample_rate, {}) if opts.sample_rate is not None else choose_sample_rate(opts, where)
    if snr:
        say(f"  sampling rate from the plan (signal/noise over the rollout at epsilon {opts.epsilon:g}): "
            + ", ".join(f"{v:.3g} at q = {r:g}" for r, v in snr.items()) + f"; so q = {q:g}"
            + (" (every device every round: no sampling)" if q >= 1 else ""))
    mapping = rollout_mapping(opts, where / "coordinator", sample_rate=q)
    plan = plan_of(mapping, where / "configs" / "coordinator.toml")
    for line in render_summary(plan):
        say(line)
    note = convergence_note()
    if note is not None:
        say(f"  {note}")
    return q, snr, plan, mapping


def _rounds(opts: PrivateFleetOptions, mapping: dict[str, Any], workdir: Path, view: DemoView) -> FleetRun:
    """One fleet run, its rounds reported to ``view``."""
    view.rounds_started(opts.rounds)
    try:
        return run_fleet(opts, mapping, workdir, view.say, lambda row: view.round_closed(row, opts.rounds))
    finally:
        view.rounds_ended()

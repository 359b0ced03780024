"""Agent footprint: peak RSS, time from process start to the first update published, and RSS over
many rounds, of real ``fedtier agent run`` processes.

A fleet of one cell runs as separate processes through its own Mosquitto, as on real hardware:
``fedtier coordinator run``, ``fedtier edge run`` and ``--devices`` agents (the demo's model, an
MLP 64-64-10 on scikit-learn's ``digits``, and its trainer, onnxruntime-training). Every agent's
``/proc/PID/status`` is sampled while it runs (VmRSS, VmHWM); a subscriber on the broker records
when each device's first update arrives. RSS is flat when the last tenth of the rounds holds no
more than the second tenth (after the model's artifacts arrived and the session warmed up).
The baseline measured in the same run: a bare Python that imports onnxruntime and opens the
bundle's training session, or with stock onnxruntime the portable graph's sessions (what the runtime
alone costs). The agents and the baseline import fedtier from bytecode compiled beforehand, as an
installed package has it (``bytecode_env``; ``--no-bytecode``: from source).

    python -m benchmarks agent                         # 3 runs of 1,000 rounds, 2 devices (docs/benchmarks.md)
    python -m benchmarks agent --rounds 3 --reps 1 --starts 0 --no-write   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import spread, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FEDTIER = [sys.executable, "-m", "fedtier"]


def status_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a live process, in kB (empty once it has exited)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines if ":" in line)
            if k in ("VmRSS", "VmHWM")}


def rounds_closed(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db, timeout=5) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM rounds").fetchone()[0])
    except sqlite3.Error:
        return 0


def open_round(db: Path) -> bool:
    if not db.exists():
        return False
    try:
        with sqlite3.connect(db, timeout=5) as conn:
            return conn.execute("SELECT COUNT(*) FROM open_rounds").fetchone()[0] > 0
    except sqlite3.Error:
        return False


class FirstUpdates:
    """A subscriber that records when each device's first update reaches the broker."""

    def __init__(self, port: int) -> None:
        import paho.mqtt.client as paho

        from fedtier.transport import topics

        self.first: dict[str, float] = {}
        self._topics = topics
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="bench-agent-observer")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.subscribe("#", qos=0)
        self.client.loop_start()

    def _on_message(self, _client: Any, _userdata: Any, msg: Any) -> None:
        parsed = self._topics.parse(msg.topic)
        if parsed is None or parsed.channel != "cell_up" or "update" not in (parsed.kind or ""):
            return
        if parsed.device and parsed.device not in self.first:
            self.first[parsed.device] = time.monotonic()

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


BASELINE = """
import sys
from device_agent.trainers import resolve_kind
d = sys.argv[1]
if resolve_kind("auto") == "ort":  # onnxruntime-training: its training API, as the agent imports it (no torch)
    from device_agent.trainers.ort_runtime import training_api
    api = training_api()
    state = api.CheckpointState.load_checkpoint(d + "/checkpoint")
    m = api.Module(d + "/training_model.onnx", state, d + "/eval_model.onnx")
    o = api.Optimizer(d + "/optimizer_model.onnx", m)
else:  # stock onnxruntime: the portable graph's two inference sessions, with the portable trainer's options
    from device_agent.trainers.ort_runtime import import_onnxruntime
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.use_deterministic_compute = True
    train = ort.InferenceSession(d + "/portable_training_model.onnx", options, providers=["CPUExecutionProvider"])
    evaluate = ort.InferenceSession(d + "/eval_model.onnx", options, providers=["CPUExecutionProvider"])
print([line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0])
"""


TRAINER_ALONE = """
import sys
import numpy as np
from device_agent.trainers import make_trainer, resolve_kind
from fedtier.artifacts.bundle import ArtifactBundle
bundle = ArtifactBundle.load(sys.argv[1])
trainer = make_trainer(resolve_kind("auto"), bundle, threads=1)
rng = np.random.default_rng(0)
x = rng.random((16, *bundle.arch.input_shape), dtype=np.float32)
y = rng.integers(0, bundle.arch.num_classes, 16)
trainer.train_steps([(x, y), (x, y)], 0.1)  # the agent's round: 2 steps of batch 16, then its held-out rows
trainer.evaluate(rng.random((180, *bundle.arch.input_shape), dtype=np.float32), rng.integers(0, 10, 180))
print([line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0])
"""


def trainer_baseline(bundle_dir: Path, python: str = sys.executable, env: dict[str, str] | None = None) -> float:
    """Peak RSS (MB) of a Python that trains the bundle as the agent's round does, with nothing else: the
    runtime, fedtier's trainer over it (``make_trainer``), two steps of batch 16 and one evaluation. The runtime
    grows on its first step (activations and gradients: about 4 MB here), which ``ort_baseline`` leaves out."""
    out = subprocess.run([python, "-c", TRAINER_ALONE, str(bundle_dir)], capture_output=True, text=True,
                         check=True, timeout=120, cwd=bundle_dir, env=env)
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def ort_baseline(bundle_dir: Path, python: str = sys.executable, env: dict[str, str] | None = None) -> float:
    """Peak RSS (MB) of a Python that only imports the runtime the agent trains with and opens its sessions:
    onnxruntime's training API (as the agent does: without the torch that ``onnxruntime.training``'s own
    ``__init__`` would import) and the training session, or stock onnxruntime and the portable graph's."""
    out = subprocess.run([python, "-c", BASELINE, str(bundle_dir)], capture_output=True, text=True, check=True,
                         timeout=120, cwd=bundle_dir, env=env)  # not the checkout: a board imports the installed one
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def bytecode_env(python: str, cache: Path) -> dict[str, str]:
    """The environment of the agents and the baseline: fedtier's modules compiled to bytecode beforehand, in
    ``cache`` (``PYTHONPYCACHEPREFIX``), as ``pip install`` leaves them on a board. Without it, on a machine
    that sets ``PYTHONDONTWRITEBYTECODE`` (this one), every agent compiles fedtier from source at start, which
    costs it about 2.4 MB of RSS that no installed agent pays."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(cache)
    where = subprocess.run([python, "-c", "import importlib, os, sys\nfor p in sys.argv[1:]: "
                            "print(os.path.dirname(importlib.import_module(p).__file__))", *PACKAGES],
                           env=env, cwd=cache, capture_output=True, text=True, check=True, timeout=120)
    subprocess.run([python, "-m", "compileall", "-q", *where.stdout.split()], env=env, check=True,
                   stdout=subprocess.DEVNULL, timeout=600)  # the packages the agents will import, wherever they are
    return env


PACKAGES = ("fedtier", "device_agent")
"""What an agent imports of the checkout (``pip install fedtier[agent]`` compiles them)."""


def run(devices: int, rounds: int, local_steps: int, timeout: float, keep: Path | None = None,
        agent_python: str = sys.executable, agent_env: dict[str, str] | None = None) -> dict[str, Any]:
    from local_fleet.demo import free_port, mosquitto_path, wait_for_port
    from local_fleet.configs import write_fleet

    mosq = mosquitto_path()
    if mosq is None:
        raise SystemExit("bench_agent needs Mosquitto (apt-get install mosquitto)")
    with tempfile.TemporaryDirectory() as tmp:
        work = keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        port = free_port()
        (work / "mosquitto.conf").write_text(f"allow_anonymous true\npersistence false\nlistener {port} 127.0.0.1\n")
        procs: list[subprocess.Popen] = [subprocess.Popen([mosq, "-c", str(work / "mosquitto.conf")],
                                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        try:
            if not wait_for_port(port, 10):
                raise RuntimeError("Mosquitto did not start")
            plain = {"rollout": "footprint", "rounds": rounds, "seed": 0,
                     "model": {"kind": "mlp", "hidden": [64]}, "topology": {"cells": 1, "devices_per_cell": devices},
                     "data": {"dataset": "digits", "partition": "iid"},
                     "fedavg": {"local_steps": local_steps, "batch_size": 16, "lr": 0.1, "deadline_s": 30.0}}
            paths = write_fleet(plain, work / "fleet", {"host": "127.0.0.1", "port": port})
            observer = FirstUpdates(port)
            logs = work / "logs"
            logs.mkdir(exist_ok=True)

            def start(name: str, argv: list[str], python: str = sys.executable,
                      env: dict[str, str] | None = None) -> subprocess.Popen:
                # agents run outside the checkout, so that `python -m fedtier` imports what `python` has installed
                p = subprocess.Popen([python, *FEDTIER[1:], *argv], cwd=ROOT if python == sys.executable else work,
                                     stdout=(logs / f"{name}.log").open("wb"), stderr=subprocess.STDOUT, env=env)
                procs.append(p)
                return p

            coordinator = start("coordinator", ["coordinator", "run", "--config", str(paths.coordinator)])
            for cell, cfg in paths.edges.items():
                start(f"edge-{cell}", ["edge", "run", "--config", str(cfg)])
            # The coordinator builds the artifacts first; agents start once it has opened round 0 (their
            # time to first update is then theirs: start-up, manifest, artifacts, training, upload).
            db = paths.workdir / "coordinator" / "coordinator.db"
            deadline = time.monotonic() + timeout
            while not open_round(db) and time.monotonic() < deadline:
                time.sleep(0.1)
            agents: dict[str, tuple[subprocess.Popen, float]] = {}
            for device, cfg in paths.devices.items():
                agents[device] = (start(f"agent-{device}", ["agent", "run", "--config", str(cfg)], agent_python,
                                          agent_env),
                                  time.monotonic())
            samples: list[dict[str, Any]] = []
            peak: dict[str, int] = {}
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    closed = rounds_closed(db)
                    for device, (proc, _) in agents.items():
                        kb = status_kb(proc.pid)
                        if kb:
                            peak[device] = max(peak.get(device, 0), kb.get("VmHWM", 0))
                            samples.append({"device": device, "round": closed, "rss_kb": kb.get("VmRSS", 0)})
                    stop.wait(0.25)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.monotonic()
            try:
                coordinator.wait(timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the rollout did not finish in {timeout:g} s (logs in {logs})") from None
            wall = time.monotonic() - started
            stop.set()
            sampler.join()
            observer.close()
            done = rounds_closed(db)
            bundle = next((paths.workdir / "coordinator" / "artifacts").rglob("training_model.onnx")).parent
            baseline = ort_baseline(bundle, agent_python, agent_env)
            trainer_alone = trainer_baseline(bundle, agent_python, agent_env)
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    per_device = {}
    for device, (_, t0) in agents.items():
        mine = [s for s in samples if s["device"] == device]
        tenth = max(1, done // 10)
        second = [s["rss_kb"] for s in mine if tenth <= s["round"] < 2 * tenth]
        last = [s["rss_kb"] for s in mine if s["round"] >= done - tenth]
        per_device[device] = {
            "peak_rss_mb": round(peak.get(device, 0) / 1024, 1),
            "first_update_s": round(observer.first[device] - t0, 2) if device in observer.first else None,
            "rss_second_tenth_mb": round(max(second) / 1024, 1) if second else None,
            "rss_last_tenth_mb": round(max(last) / 1024, 1) if last else None,
        }
    return {"devices": devices, "rounds": done, "wall_s": round(wall, 1), "ort_session_baseline_mb": round(baseline, 1),
            "trainer_alone_mb": round(trainer_alone, 1),
            "agent_python": agent_python, "bytecode": agent_env is not None, "agents": per_device}


def table(result: dict[str, Any]) -> str:
    lines = ["| run | agent | peak RSS MB | above the runtime alone MB | first update s | RSS MB, rounds in the 2nd "
             "tenth | RSS MB, last tenth |", "|---|---|---|---|---|---|---|"]
    for n, one in enumerate(result["runs"], 1):
        for device, a in one["agents"].items():
            above = round(a["peak_rss_mb"] - one["ort_session_baseline_mb"], 1)
            lines.append(f"| {n} | {device} | {a['peak_rss_mb']} | {above} | {a['first_update_s']} | "
                         f"{a['rss_second_tenth_mb']} | {a['rss_last_tenth_mb']} |")
        lines.append(f"| {n} | runtime alone (import + sessions) | {one['ort_session_baseline_mb']} | | | | |")
        lines.append(f"| {n} | trainer alone (+ 2 steps, 1 evaluation) | {one['trainer_alone_mb']} | | | | |")
    peak, base, above = result["peak_rss_mb"], result["runtime_alone_mb"], result["above_runtime_mb"]
    trainer, over = result["trainer_alone_mb"]["median"], result["above_trainer_mb"]["median"]
    lines.append(f"\nmedian over {len(result['runs'])} runs: agent peak RSS {peak['median']:.1f} MB "
                 f"({peak['min']:.1f}–{peak['max']:.1f}), runtime alone {base['median']:.1f} MB "
                 f"({base['min']:.1f}–{base['max']:.1f}), above it {above['median']:.1f} MB "
                 f"({above['min']:.1f}–{above['max']:.1f}); trainer alone {trainer:.1f} MB, above it {over:.1f} MB")
    first = result.get("first_update_s")
    if first:
        lines.append(f"time from process start to first update: median {first['median']:.2f} s "
                     f"({first['min']:.2f}–{first['max']:.2f}) over {first['seen']} agent starts")
    return "\n".join(lines)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs: every agent's peak, each run's baseline, and each agent above its run's baseline."""
    peaks = [a["peak_rss_mb"] for one in runs for a in one["agents"].values()]
    above = [a["peak_rss_mb"] - one["ort_session_baseline_mb"] for one in runs for a in one["agents"].values()]
    over_trainer = [a["peak_rss_mb"] - one["trainer_alone_mb"] for one in runs for a in one["agents"].values()]
    return {"peak_rss_mb": spread(peaks), "runtime_alone_mb": spread([one["ort_session_baseline_mb"] for one in runs]),
            "above_runtime_mb": spread(above), "trainer_alone_mb": spread([one["trainer_alone_mb"] for one in runs]),
            "above_trainer_mb": spread(over_trainer)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3, help="runs of --rounds rounds (medians over them)")
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--starts", type=int, default=5,
                    help="extra 3-round runs whose agents' time to first update is also measured")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--keep", type=Path, default=None, help="keep configs, state and logs in this directory")
    ap.add_argument("--agent-python", default=sys.executable,
                    help="the Python that runs the agents and the ORT baseline: e.g. a venv with only "
                         "`pip install fedtier[agent]` from the wheel, as on a board")
    ap.add_argument("--no-bytecode", action="store_true",
                    help="let the agents compile fedtier from source at start (as a checkout run with "
                         "PYTHONDONTWRITEBYTECODE does), instead of from bytecode compiled beforehand")
    ap.add_argument("--name", default="agent", help="results file name (benchmarks/results/NAME.json)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-agent-pyc-") as cache:
        env = None if args.no_bytecode else bytecode_env(args.agent_python, Path(cache))
        runs = [run(args.devices, args.rounds, args.local_steps, args.timeout,
                    args.keep / str(n) if args.keep else None, args.agent_python, env) for n in range(args.reps)]
        firsts = [a["first_update_s"] for one in runs for a in one["agents"].values()]
        for _ in range(args.starts):
            again = run(args.devices, 3, args.local_steps, args.timeout, agent_python=args.agent_python,
                        agent_env=env)
            firsts += [a["first_update_s"] for a in again["agents"].values()]
    seen = [f for f in firsts if f is not None]
    result: dict[str, Any] = {"runs": runs, **summarize(runs), "bytecode": not args.no_bytecode,
                              "agent_python": args.agent_python}
    result["first_update_s"] = {**spread(seen), "starts": len(firsts), "seen": len(seen)} if seen else None
    result["setup"] = (f"1 cell, {args.devices} agents as processes, digits MLP 64-64-10, {args.local_steps} local "
                       f"steps of batch 16, {args.rounds} rounds, Mosquitto on loopback, {args.reps} runs")
    if not args.no_write:
        print(f"wrote {write(args.name, result)}")
    print(json.dumps(result, indent=1) if os.environ.get("BENCH_JSON") else table(result))
    return result


if __name__ == "__main__":
    main()

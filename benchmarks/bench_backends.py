"""Training step time, agent peak RSS and install size of each trainer backend.

Backends, each measured in its own fresh process, as a device would run it:

* ``ort`` — onnxruntime-training 1.19.2 on the bundle's artifacts (this environment, torch-free
  shim; torch is installed here but not imported);
* ``portable`` — stock onnxruntime on the bundle's portable graph, numpy SGD, run with
  ``.venv-portable/bin/python`` (no onnxruntime-training, no torch: a board's environment;
  made by ``install.sh``);
* ``portable@1.19.2`` — the same portable trainer, but on this environment's onnxruntime
  (the training build, 1.19.2): separates what the approach costs from what the newer
  onnxruntime release costs;
* ``torch`` — torch eager (this environment).

Per backend and model (the MLP 64-64-10 and the 1-D CNN of the tests, batch 32, one thread):
the time of one SGD step, as wall clock and as the process's CPU time (a busy shared machine
disturbs CPU time less: one thread computes, so CPU time is the compute), and the process's
peak RSS (``VmHWM``) after loading the bundle, training and evaluating with the agent stack
imported (``device_agent.run``). Each repetition starts a fresh process per backend, and the
backends take turns within a repetition, so a busy machine slows them alike; reported: the
median over repetitions, with min and max as the spread. Install size: the bytes on disk of
the backend's runtime, its dependency closure and the agent's other dependencies.

Usage: ``python benchmarks/bench_backends.py [--reps 7 --steps 300]``; writes
benchmarks/results/backends.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _common import write

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PORTABLE_PYTHON = ROOT / ".venv-portable" / "bin" / "python"

MODELS = {
    "mlp 64-64-10": {"kind": "mlp", "options": {"sizes": [64, 64, 10]}},
    "cnn1d 3x32, filters 8,16": {"kind": "cnn1d", "options": {"channels": 3, "length": 32, "classes": 5,
                                                              "filters": [8, 16], "kernel": 5}},
}
BATCH = 32

STEP_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import device_agent.run  # the agent's import footprint, as `fedtier agent run` has it
    import numpy as np
    from device_agent.trainers import make_trainer
    from fedtier.artifacts.bundle import ArtifactBundle

    kind, directory, batch, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    bundle = ArtifactBundle.load(directory)
    trainer = make_trainer(kind, bundle, threads=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *bundle.arch.input_shape)).astype(np.float32)
    y = rng.integers(0, bundle.arch.num_classes, size=batch).astype(np.int64)
    trainer.train_steps([(x, y)] * 30, 0.01)  # warm up
    trainer.evaluate(x, y)  # the agent's health check loads the eval path too
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train_steps([(x, y)] * steps, 0.01)
    us = (time.perf_counter() - t0) / steps * 1e6
    cpu_us = (time.process_time() - c0) / steps * 1e6
    hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
    ort = sys.modules.get("onnxruntime")
    print(json.dumps({"us": us, "cpu_us": cpu_us, "peak_rss_mb": hwm / 1024, "torch_imported": "torch" in sys.modules,
                      "trainer": type(trainer).__name__, "onnxruntime": getattr(ort, "__version__", None)}))
""")

SIZE_SCRIPT = textwrap.dedent("""
    import json, sys
    import importlib.metadata as md
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement

    def closure(names):
        seen, todo = {}, list(names)
        while todo:
            name = todo.pop().lower().replace("_", "-")
            if name in seen:
                continue
            try:
                dist = md.distribution(name)
            except md.PackageNotFoundError:
                continue
            seen[name] = dist
            for line in dist.requires or []:
                req = Requirement(line)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    todo.append(req.name)
        return seen

    out = {}
    for name, dist in sorted(closure(sys.argv[1:]).items()):
        size = 0
        for f in dist.files or []:
            try:
                size += f.locate().stat().st_size
            except OSError:
                pass
        out[name] = size
    print(json.dumps(out))
""")

BREAKDOWN_SCRIPT = textwrap.dedent("""
    import json, sys
    def rss():
        return [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")][0] / 1024
    import device_agent.run
    from device_agent.trainers.ort_runtime import import_onnxruntime
    from fedtier.artifacts.bundle import ArtifactBundle
    bundle = ArtifactBundle.load(sys.argv[1])
    stack = rss()
    ort = import_onnxruntime()
    imported = rss()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    first = ort.InferenceSession(str(bundle.path("portable_model")), options, providers=["CPUExecutionProvider"])
    one = rss()
    second = ort.InferenceSession(str(bundle.path("eval_model")), options, providers=["CPUExecutionProvider"])
    two = rss()
    print(json.dumps({"onnxruntime": ort.__version__, "agent_stack_mb": stack, "import_mb": imported - stack,
                      "first_session_mb": one - imported, "second_session_mb": two - one}))
""")

AGENT_DEPS = ["numpy", "msgpack", "click", "cryptography", "paho-mqtt"]
RUNTIME = {"ort": "onnxruntime-training-cpu", "portable": "onnxruntime", "torch": "torch"}
BACKENDS = {  # name -> (trainer kind, interpreter)
    "ort": ("ort", Path(sys.executable)),
    "portable": ("portable", PORTABLE_PYTHON),
    "portable@1.19.2": ("portable", Path(sys.executable)),
    "torch": ("torch", Path(sys.executable)),
}


def run_json(argv: list[str]) -> dict:
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1)}


def measure(directory: Path, reps: int, steps: int) -> dict[str, dict]:
    """Each repetition runs every backend once, in turn, each in a fresh process."""
    runs: dict[str, list[dict]] = {name: [] for name in BACKENDS}
    for _ in range(reps):
        for name, (kind, python) in BACKENDS.items():
            runs[name].append(run_json([str(python), "-c", STEP_SCRIPT, kind, str(directory), str(BATCH),
                                        str(steps)]))
    out = {}
    for name, got in runs.items():
        out[name] = {"step_us": summary([g["us"] for g in got]), "step_cpu_us": summary([g["cpu_us"] for g in got]),
                     "peak_rss_mb": summary([g["peak_rss_mb"] for g in got]),
                     "reps": reps, "steps_per_rep": steps, "trainer": got[0]["trainer"],
                     "onnxruntime": got[0]["onnxruntime"], "torch_imported": any(g["torch_imported"] for g in got)}
    return out


def rss_breakdown(directory: Path, reps: int) -> dict[str, dict]:
    """Where an onnxruntime's memory goes: import, first session, second session (per release)."""
    out = {}
    for name, python in (("onnxruntime 1.19.2 (training build)", Path(sys.executable)),
                         ("onnxruntime (stock, .venv-portable)", PORTABLE_PYTHON)):
        runs = [run_json([str(python), "-c", BREAKDOWN_SCRIPT, str(directory)]) for _ in range(reps)]
        out[name] = {"onnxruntime": runs[0]["onnxruntime"],
                     **{key: round(statistics.median(r[key] for r in runs), 1)
                        for key in ("agent_stack_mb", "import_mb", "first_session_mb", "second_session_mb")}}
    return out


def install_size(runtime: str, python: Path) -> dict:
    """Bytes on disk of the runtime with its dependency closure, and of the whole agent stack."""
    full = run_json([str(python), "-c", SIZE_SCRIPT, runtime, *AGENT_DEPS])
    common = run_json([str(python), "-c", SIZE_SCRIPT, *AGENT_DEPS])
    extra = {k: v for k, v in full.items() if k not in common}
    return {"runtime": runtime, "agent_total_mb": round(sum(full.values()) / 2**20, 1),
            "runtime_closure_mb": round(sum(extra.values()) / 2**20, 1),
            "runtime_closure": {k: round(v / 2**20, 1) for k, v in sorted(extra.items(), key=lambda kv: -kv[1])}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="repetitions per measurement (median, min, max)")
    parser.add_argument("--steps", type=int, default=300, help="SGD steps per repetition")
    parser.add_argument("--models", default=",".join(MODELS), help="which of the models, comma-separated")
    parser.add_argument("--no-sizes", action="store_true", help="skip the install sizes")
    args = parser.parse_args(argv)

    from fedtier.training.layout import ArchSpec
    from models.artifacts import build_artifacts

    if not PORTABLE_PYTHON.exists():
        raise SystemExit(f"{PORTABLE_PYTHON} is missing: run ./install.sh")
    load_start = list(os.getloadavg())  # the machine may be shared: say how busy it was
    rows: dict[str, dict] = {}
    breakdown: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as store:
        for model, spec in MODELS.items():
            if model not in args.models.split(","):
                continue
            directory = build_artifacts(ArchSpec.from_json(spec), Path(store)).directory
            assert directory is not None
            row: dict = measure(directory, args.reps, args.steps)
            for name in BACKENDS:
                print(model, name, row[name], flush=True)
            ort = row["ort"]
            for name in ("portable", "portable@1.19.2", "torch"):
                row[name]["time_over_ort"] = round(row[name]["step_us"]["median"] / ort["step_us"]["median"], 2)
                row[name]["cpu_time_over_ort"] = round(row[name]["step_cpu_us"]["median"]
                                                       / ort["step_cpu_us"]["median"], 2)
                row[name]["rss_minus_ort_mb"] = round(row[name]["peak_rss_mb"]["median"]
                                                      - ort["peak_rss_mb"]["median"], 1)
            rows[model] = row
            if model.startswith("cnn1d"):
                breakdown = rss_breakdown(directory, args.reps)
    sizes = {} if args.no_sizes else {"ort": install_size(RUNTIME["ort"], Path(sys.executable)),
                                      "portable": install_size(RUNTIME["portable"], PORTABLE_PYTHON),
                                      "torch": install_size(RUNTIME["torch"], Path(sys.executable))}
    print(json.dumps(sizes, indent=1))
    out = {"command": "python benchmarks/bench_backends.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "batch": BATCH, "threads": 1, "load_average": {"start": load_start, "end": list(os.getloadavg())},
           "models": rows, "rss_breakdown_cnn1d": breakdown, "install_size": sizes}
    path = write("backends", out)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()

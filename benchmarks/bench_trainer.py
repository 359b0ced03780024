"""On-device training step: onnxruntime-training against torch eager, through the project's trainers.

For the MLP 64-64-10 and the 1-D CNN of the tests, at batch 1, 16 and 64, one thread each: the time
of one SGD step of ``OrtTrainer.train_steps`` and of ``TorchTrainer.train_steps`` (the baseline,
in the same process, taking turns within each repetition), as wall clock and as the process's CPU
time; median of ``--reps`` repetitions of ``--steps`` steps, with min and max. Then where an ORT
step goes (MLP, batch 16): the batch checks, the training graph's run through ``module_step``,
the optimizer graph's run, and what the wheel's public ``Module.__call__`` would add. And what
importing the device stack costs with the torch-free shim against a plain ``import onnxruntime``
(which imports torch when torch is installed).

    python -m benchmarks trainer                      # the tables in docs/benchmarks.md
    python -m benchmarks trainer --reps 1 --steps 5   # a smoke run

Writes ``benchmarks/results/trainer.json`` and the tables between the ``bench:trainer`` markers of
``docs/benchmarks.md`` (``--no-docs`` leaves the docs alone).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _common import publish, spread, write

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "mlp 64-64-10": {"kind": "mlp", "options": {"sizes": [64, 64, 10]}},
    "cnn1d 3x32, filters 8,16": {"kind": "cnn1d", "options": {"channels": 3, "length": 32, "classes": 5,
                                                              "filters": [8, 16], "kernel": 5}},
}
BATCHES = (1, 16, 64)
BACKENDS = ("ort", "torch")


def _per_step(fn: Callable[[], Any], steps: int) -> tuple[float, float]:
    """(wall, CPU) microseconds per call of ``fn``, over ``steps`` calls."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps * 1e6, (time.process_time() - c0) / steps * 1e6


def _batch(bundle: Any, size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(size)
    x = rng.standard_normal((size, *bundle.arch.input_shape)).astype(np.float32)
    return x, rng.integers(0, bundle.arch.num_classes, size=size).astype(np.int64)


def step_times(bundles: dict[str, Any], reps: int, steps: int) -> list[dict[str, Any]]:
    from device_agent.trainers import make_trainer

    rows = []
    for model, bundle in bundles.items():
        trainers = {kind: make_trainer(kind, bundle, threads=1) for kind in BACKENDS}
        for size in BATCHES:
            x, y = _batch(bundle, size)
            for trainer in trainers.values():
                trainer.train_steps([(x, y)] * 20, 0.01)  # warm up
            samples: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in BACKENDS}
            for _ in range(reps):
                for kind, trainer in trainers.items():  # taking turns: a busy machine slows both alike
                    wall, cpu = _per_step(lambda t=trainer, b=[(x, y)]: t.train_steps(b, 0.01), steps)
                    samples[kind]["wall"].append(wall)
                    samples[kind]["cpu"].append(cpu)
            row: dict[str, Any] = {"model": model, "batch": size}
            for kind in BACKENDS:
                row[kind] = {"wall_us": spread(samples[kind]["wall"]), "cpu_us": spread(samples[kind]["cpu"])}
            for clock in ("wall", "cpu"):
                row[f"ort_over_torch_{clock}"] = (row["ort"][f"{clock}_us"]["median"]
                                                  / row["torch"][f"{clock}_us"]["median"])
            rows.append(row)
            print(f"{model} batch {size}: ort {row['ort']['wall_us']['median']:.0f} µs, torch "
                  f"{row['torch']['wall_us']['median']:.0f} µs", flush=True)
    return rows


def ort_breakdown(bundle: Any, reps: int, steps: int) -> dict[str, Any]:
    """Where one ORT step of the MLP at batch 16 goes, each part timed on its own (median of reps)."""
    from device_agent.trainers import check_batch, make_trainer
    from device_agent.trainers.ort_runtime import module_step

    trainer = make_trainer("ort", bundle, threads=1)
    module, optimizer, arch = trainer._module, trainer._optimizer, bundle.arch  # noqa: SLF001 (measuring)
    x, y = _batch(bundle, 16)
    trainer.train_steps([(x, y)] * 20, 0.01)

    def graph() -> None:
        module_step(module, [x, y])
        module.lazy_reset_grad()

    def graph_and_optimizer() -> None:
        module_step(module, [x, y])
        optimizer.step()
        module.lazy_reset_grad()

    def public_call() -> None:  # what the wheel's Module.__call__ costs for the same graph run
        module(x, y)
        module.lazy_reset_grad()

    parts = {"train_steps": lambda: trainer.train_steps([(x, y)], 0.01), "checks": lambda: check_batch(arch, x, y),
             "graph": graph, "graph_and_optimizer": graph_and_optimizer, "public_call": public_call}
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(reps):
        for name, fn in parts.items():
            times[name].append(_per_step(fn, steps)[0])
    med = {name: statistics.median(values) for name, values in times.items()}
    return {"median_us": med, "spread_us": {name: spread(values) for name, values in times.items()},
            "optimizer_us": med["graph_and_optimizer"] - med["graph"],
            "rest_us": med["train_steps"] - med["graph_and_optimizer"] - med["checks"],
            "public_call_extra_us": med["public_call"] - med["graph"]}


def import_cost(code: str, reps: int) -> dict[str, Any]:
    """Seconds and peak RSS (``VmHWM``, not ``ru_maxrss``, which keeps a forking parent's) of ``code``."""
    script = ("import time\nt=time.perf_counter()\n" + code +
              "\nimport sys\nhwm=[l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]"
              "\nprint(time.perf_counter()-t, hwm, 'torch' in sys.modules)")
    runs = []
    for _ in range(reps):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
        seconds, rss_kb, torch_loaded = out.stdout.split()
        runs.append((float(seconds), int(rss_kb) / 1024, torch_loaded == "True"))
    return {"seconds": spread([r[0] for r in runs]), "peak_rss_mb": spread([r[1] for r in runs]),
            "torch_imported": runs[0][2]}


def _cell(s: dict[str, float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def markdown(results: dict[str, Any]) -> str:
    lines = [f"One SGD step through the project's trainers, one thread, µs (median of {results['reps']} "
             f"repetitions of {results['steps']} steps, min–max); ratio = ORT / torch (issue 15's target: "
             "at most 0.25 on the MLP at batch 16):", "",
             "| model | batch | ORT wall µs | torch eager wall µs | ORT / torch, wall | ORT CPU µs | torch CPU µs "
             "| ORT / torch, CPU |", "|---|---|---|---|---|---|---|---|"]
    for r in results["steps_table"]:
        lines.append(f"| {r['model']} | {r['batch']} | {_cell(r['ort']['wall_us'])} | {_cell(r['torch']['wall_us'])} "
                     f"| {r['ort_over_torch_wall']:.2f} | {_cell(r['ort']['cpu_us'])} | {_cell(r['torch']['cpu_us'])} "
                     f"| {r['ort_over_torch_cpu']:.2f} |")
    b = results["ort_breakdown"]
    med = b["median_us"]
    lines += ["", "Where an ORT step goes (MLP, batch 16; each part timed on its own, median µs):", "",
              "| part | µs |", "|---|---|",
              f"| `train_steps`, one step in all | {med['train_steps']:.1f} |",
              f"| training graph (forward + backward), `module_step` | {med['graph']:.1f} |",
              f"| optimizer graph (`Optimizer.step`) | {b['optimizer_us']:.1f} |",
              f"| batch checks (`check_batch`) | {med['checks']:.1f} |",
              f"| the rest (learning rate, loss to float, loop) | {b['rest_us']:.1f} |",
              f"| *not paid any more:* the wheel's `Module.__call__` over the same graph run | "
              f"+{b['public_call_extra_us']:.1f} |"]
    lines += ["", "Importing the device stack (median of the runs, min–max):", "",
              "| import | seconds | peak RSS MB | torch imported |", "|---|---|---|---|"]
    for name, r in results["imports"].items():
        lines.append(f"| {name} | {_cell(r['seconds'], '{:.2f}')} | {_cell(r['peak_rss_mb'], '{:.1f}')} | "
                     f"{'yes' if r['torch_imported'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="repetitions (median and spread over them)")
    ap.add_argument("--steps", type=int, default=200, help="SGD steps timed in each repetition")
    ap.add_argument("--no-docs", action="store_true", help="do not write the tables into docs/benchmarks.md")
    args = ap.parse_args(argv)
    import torch

    from fedtier.training.layout import ArchSpec
    from models.artifacts import build_artifacts

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as store:
        bundles = {name: build_artifacts(ArchSpec.from_json(spec), Path(store)) for name, spec in MODELS.items()}
        rows = step_times(bundles, args.reps, args.steps)
        breakdown = ort_breakdown(bundles["mlp 64-64-10"], args.reps, args.steps)
    imports = {
        "device stack with the shim, ORT training API": import_cost(
            "import device_agent.run\nfrom device_agent.trainers.ort_runtime import training_api\ntraining_api()",
            max(3, args.reps // 2)),
        "plain `import onnxruntime` (torch installed)": import_cost("import onnxruntime", max(3, args.reps // 2)),
    }
    results = {"reps": args.reps, "steps": args.steps, "steps_table": rows, "ort_breakdown": breakdown,
               "imports": imports}
    path = write("trainer", results)
    table = markdown(results)
    print(table)
    if not args.no_docs:
        command = "python -m benchmarks trainer" + (f" --reps {args.reps}" if args.reps != 7 else "") + (
            f" --steps {args.steps}" if args.steps != 200 else "")
        print(f"wrote {publish('trainer', command, table)}")
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()

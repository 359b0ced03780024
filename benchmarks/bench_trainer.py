"""On-device training cost: ORT step time against torch eager (the baseline, run beside it),
and what importing the device stack costs with the torch-free shim vs a plain
``import onnxruntime`` (which pulls torch in when torch is installed).

Usage: ``python benchmarks/bench_trainer.py``; writes benchmarks/results/trainer.json.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import write

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARCHS = {"mlp-64-64-10": {"kind": "mlp", "options": {"sizes": [64, 64, 10]}},
         "mlp-64-300-10": {"kind": "mlp", "options": {"sizes": [64, 300, 10]}}}


def step_time(trainer, x, y, steps: int = 300) -> float:
    batches = [(x, y)] * steps
    trainer.train_steps(batches[:20], 0.01)  # warm up
    t0 = time.perf_counter()
    trainer.train_steps(batches, 0.01)
    return (time.perf_counter() - t0) / steps * 1e6


def import_cost(code: str) -> dict:
    # VmHWM, not ru_maxrss: the latter keeps the forking parent's high-water mark across exec.
    script = ("import time\nt=time.perf_counter()\n" + code +
              "\nimport sys\nhwm=[l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]"
              "\nprint(time.perf_counter()-t, hwm, 'torch' in sys.modules)")
    runs = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
        seconds, rss_kb, torch_loaded = out.stdout.split()
        runs.append((float(seconds), int(rss_kb) / 1024, torch_loaded == "True"))
    best = min(runs)
    return {"seconds": round(best[0], 3), "peak_rss_mb": round(best[1], 1), "torch_imported": best[2]}


def main() -> None:
    import torch

    from device_agent.trainers import make_trainer
    from fedtier.training.layout import ArchSpec
    from models.artifacts import build_artifacts

    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as store:
        for name, spec in ARCHS.items():
            bundle = build_artifacts(ArchSpec.from_json(spec), Path(store))
            for batch in (16, 64):
                rng = np.random.default_rng(0)
                x = rng.normal(size=(batch, 64)).astype(np.float32)
                y = rng.integers(0, 10, size=batch).astype(np.int64)
                ort_us = step_time(make_trainer("ort", bundle), x, y)
                torch_us = step_time(make_trainer("torch", bundle), x, y)
                rows[f"{name} batch {batch}"] = {"ort_us": round(ort_us, 1), "torch_us": round(torch_us, 1),
                                                 "torch_over_ort": round(torch_us / ort_us, 2)}
                print(name, batch, rows[f"{name} batch {batch}"])
    imports = {
        "device stack with shim": import_cost(
            "import device_agent.run\nfrom device_agent.trainers.ort_runtime import training_api\ntraining_api()"),
        "plain import onnxruntime": import_cost("import onnxruntime"),
    }
    print(imports)
    path = write("trainer", {"one_sgd_step_single_thread": rows, "imports": imports})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

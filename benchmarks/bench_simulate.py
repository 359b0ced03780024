"""Simulator scale: seconds per round and peak memory as the number of devices grows.

All devices share one ORT session; each holds only its data, its outbox and progress in dicts
(``MemoryDeviceState``) and a role. Usage: ``python -m benchmarks simulate [--sizes 2x6,10x10,...]``; writes
benchmarks/results/simulate.json.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from _common import write

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, resource, sys, time
from cloud_coordinator.config import RolloutConfig
from cloud_coordinator.simulate import simulate
cells, per_cell, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = RolloutConfig.from_mapping({"rollout": "scale", "rounds": 3, "state_dir": store, "artifact_store": store,
    "model": {"hidden": [64]}, "topology": {"cells": cells, "devices_per_cell": per_cell},
    "data": {"dataset": "synthetic", "samples": 40 * cells * per_cell, "features": 64, "classes": 10,
             "partition": "dirichlet", "alpha": 0.5},
    "fedavg": {"local_steps": 10, "batch_size": 32, "lr": 0.1}})
t = time.perf_counter(); res = simulate(cfg); wall = time.perf_counter() - t
hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]
print(json.dumps({"devices": cells * per_cell, "cells": cells, "wall_s": round(wall, 2),
                  "s_per_round": round(sum(r["round_s"] for r in res.rounds) / len(res.rounds), 3),
                  "peak_rss_mb": round(int(hwm) / 1024, 1), "final_accuracy": round(res.rounds[-1]["accuracy"], 4)}))
"""


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2x6,10x10,20x50,40x100,100x100",
                    help="CELLSxDEVICES_PER_CELL, comma-separated")
    args = ap.parse_args(argv)
    sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as store:
        for cells, per_cell in sizes:
            out = subprocess.run([sys.executable, "-c", SCRIPT, str(cells), str(per_cell), store],
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1])
    path = write("simulate", {"setup": "synthetic 64 features, 10 classes, 40 samples/device, MLP 64-64-10, "
                                       "10 local steps, 3 rounds", "runs": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

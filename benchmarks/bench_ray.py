"""The simulator on Ray against the local backend: seconds per round at 100, 1,000 and 10,000 devices.

Each run is a fresh subprocess (``fedtier.simulate`` with ``backend="local"`` or ``"ray"``, the Ray
one starting a local Ray of ``--shards`` CPUs), on the synthetic task of ``bench_simulate.py``
(40 samples per device, MLP 64-64-10, 10 local steps) in cells of 100 devices. A round's time is the
coordinator's ``round_s`` (task out to aggregate in), the median over the run's rounds; each backend
and size is repeated ``--reps`` times (``--reps-large`` at 10,000 devices), alternating backends, and
the table gives the median with the spread and the ratio ray / local of the medians. Start-up (data,
devices, Ray and its actors) is reported apart.

    python benchmarks/bench_ray.py                      # the table in docs/benchmarks.md
    python benchmarks/bench_ray.py --sizes 20 --reps 1 --reps-large 1 --rounds 2   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import spread, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
from fedtier.rollout.config import RolloutConfig
from local_fleet.simulate import simulate
devices, per_cell, rounds, store, backend, shards = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                                     sys.argv[4], sys.argv[5], int(sys.argv[6]))
cells = max(1, devices // per_cell)
cfg = RolloutConfig.from_mapping({"rollout": "ray-bench", "rounds": rounds, "state_dir": store,
    "artifact_store": store, "model": {"hidden": [64]},
    "topology": {"cells": cells, "devices_per_cell": devices // cells},
    "data": {"dataset": "synthetic", "samples": 40 * devices, "features": 64, "classes": 10,
             "partition": "dirichlet", "alpha": 0.5},
    "fedavg": {"local_steps": 10, "batch_size": 32, "lr": 0.1}})
res = simulate(cfg, backend=backend, shards=shards if backend == "ray" else None)
wall = time.perf_counter() - t0
rounds_s = [r["round_s"] for r in res.rounds]
print(json.dumps({"wall_s": wall, "round_s": rounds_s, "setup_s": wall - sum(rounds_s),
                  "accuracy": res.rounds[-1]["accuracy"]}))
"""


def run(devices: int, per_cell: int, rounds: int, store: str, backend: str, shards: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(devices), str(per_cell), str(rounds), store, backend,
                          str(shards)], capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{backend} at {devices} devices failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: dict[str, Any]) -> str:
    lines = ["| devices | reps | local s/round, median (min–max) | ray s/round, median (min–max) | ray / local | "
             "start-up local, s | start-up ray, s | same accuracy |", "|---|---|---|---|---|---|---|---|"]
    for r in results["sizes"]:
        lo, ra = r["local"], r["ray"]
        lines.append(f"| {r['devices']:,} | {r['reps']} | {lo['round_s']['median']:.2f} ({lo['round_s']['min']:.2f}–"
                     f"{lo['round_s']['max']:.2f}) | {ra['round_s']['median']:.2f} ({ra['round_s']['min']:.2f}–"
                     f"{ra['round_s']['max']:.2f}) | {ra['round_s']['median'] / lo['round_s']['median']:.2f} | "
                     f"{lo['setup_s']['median']:.1f} | {ra['setup_s']['median']:.1f} | "
                     f"{'yes' if r['same_accuracy'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,1000,10000", help="devices, comma-separated")
    ap.add_argument("--per-cell", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--reps-large", type=int, default=3, help="repetitions at 10,000 devices and more")
    ap.add_argument("--shards", type=int, default=2, help="Ray actors (one per core here)")
    ap.add_argument("--name", default="ray")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"setup": "synthetic 64 features, 10 classes, 40 samples/device, MLP 64-64-10, "
                                        f"10 local steps, {args.rounds} rounds, cells of {args.per_cell}; "
                                        f"ray: a local Ray of {args.shards} CPUs, {args.shards} actors",
                               "sizes": []}
    with tempfile.TemporaryDirectory() as store:
        for devices in (int(x) for x in args.sizes.split(",")):
            reps = args.reps if devices < 10_000 else args.reps_large
            runs: dict[str, list[dict[str, Any]]] = {"local": [], "ray": []}
            for _ in range(reps):
                for backend in ("local", "ray"):
                    runs[backend].append(run(devices, args.per_cell, args.rounds, store, backend, args.shards))
                    print(devices, backend, f"{statistics.median(runs[backend][-1]['round_s']):.2f} s/round",
                          flush=True)
            row: dict[str, Any] = {"devices": devices, "reps": reps}
            for backend, rs in runs.items():
                row[backend] = {"round_s": spread([statistics.median(r["round_s"]) for r in rs]),
                                "setup_s": spread([r["setup_s"] for r in rs])}
            row["same_accuracy"] = {r["accuracy"] for r in runs["local"]} == {r["accuracy"] for r in runs["ray"]}
            results["sizes"].append(row)
    path = write(args.name, results)
    print(table(results))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()

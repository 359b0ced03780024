"""Simulator scale: seconds per round and peak memory as the fleet grows (issue 15's simulator row).

Each run is a fresh process running ``fedtier simulate``'s code on a synthetic task (64 features,
10 classes, 40 samples per device, Dirichlet 0.5, MLP 64-64-10, 10 local steps of batch 32, 3
rounds) with ``CELLS x DEVICES_PER_CELL`` devices; all devices share one ORT session and each keeps
its data, its outbox and progress in dicts (``MemoryDeviceState``) and a role. Reported per size:
seconds per round and peak RSS (``VmHWM``), median of ``--reps`` runs with min and max, and the two
ratios issue 15 sets targets for — the per-device time against the first (smallest) size's, measured
in the same run (at most 1.5x), and the memory per device beyond the first size's (at most 100 kB).

    python -m benchmarks simulate                                  # the table in docs/benchmarks.md
    python -m benchmarks simulate --sizes 1x4,2x4 --reps 1 --rounds 1 --no-docs   # a smoke run

Writes ``benchmarks/results/simulate.json`` and the table between the ``bench:simulate`` markers of
``docs/benchmarks.md``.
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

from _common import publish, spread, write

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIZES = "1x100,10x100,100x100"

SCRIPT = """
import json, sys, time
from fedtier.rollout.config import RolloutConfig
from local_fleet.simulate import simulate
cells, per_cell, rounds, store = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = RolloutConfig.from_mapping({"rollout": "scale", "rounds": rounds, "state_dir": store, "artifact_store": store,
    "model": {"hidden": [64]}, "topology": {"cells": cells, "devices_per_cell": per_cell},
    "data": {"dataset": "synthetic", "samples": 40 * cells * per_cell, "features": 64, "classes": 10,
             "partition": "dirichlet", "alpha": 0.5},
    "fedavg": {"local_steps": 10, "batch_size": 32, "lr": 0.1}})
t = time.perf_counter(); res = simulate(cfg); wall = time.perf_counter() - t
hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]
print(json.dumps({"wall_s": wall, "s_per_round": sum(r["round_s"] for r in res.rounds) / len(res.rounds),
                  "peak_rss_mb": int(hwm) / 1024, "final_accuracy": res.rounds[-1]["accuracy"]}))
"""


def run_once(cells: int, per_cell: int, rounds: int, store: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(cells), str(per_cell), str(rounds), store],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"simulate {cells}x{per_cell} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(sizes: list[tuple[int, int]], reps: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as store:
        run_once(*sizes[0], 1, store)  # builds the artifacts once, outside the timed runs
        for cells, per_cell in sizes:
            runs = [run_once(cells, per_cell, rounds, store) for _ in range(reps)]
            devices = cells * per_cell
            row = {"cells": cells, "devices_per_cell": per_cell, "devices": devices, "runs": runs,
                   "s_per_round": spread([r["s_per_round"] for r in runs]),
                   "peak_rss_mb": spread([r["peak_rss_mb"] for r in runs]),
                   "final_accuracy": statistics.median(r["final_accuracy"] for r in runs)}
            row["ms_per_device_round"] = 1e3 * row["s_per_round"]["median"] / devices
            rows.append(row)
            print(f"{devices} devices: {row['s_per_round']['median']:.2f} s/round, "
                  f"{row['peak_rss_mb']['median']:.0f} MB", flush=True)
    base = rows[0]
    for row in rows:
        row["per_device_time_vs_first"] = row["ms_per_device_round"] / base["ms_per_device_round"]
        extra = row["devices"] - base["devices"]
        row["kb_per_device_beyond_first"] = (1024 * (row["peak_rss_mb"]["median"] - base["peak_rss_mb"]["median"])
                                             / extra if extra else None)
    return rows


def markdown(results: dict[str, Any]) -> str:
    first = results["rows"][0]["devices"]
    lines = [f"{results['setup']}; median of {results['reps']} runs (min–max):", "",
             f"| devices | cells | s per round | ms per device and round | per-device time vs {first:,} devices "
             f"| peak RSS MB | kB per device beyond the first {first:,} | final accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        s, m = r["s_per_round"], r["peak_rss_mb"]
        kb = "" if r["kb_per_device_beyond_first"] is None else f"{r['kb_per_device_beyond_first']:.0f}"
        lines.append(f"| {r['devices']:,} | {r['cells']} | {s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f}) | "
                     f"{r['ms_per_device_round']:.2f} | {r['per_device_time_vs_first']:.2f}x | "
                     f"{m['median']:.0f} ({m['min']:.0f}–{m['max']:.0f}) | {kb} | {r['final_accuracy']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="CELLSxDEVICES_PER_CELL, comma-separated, smallest first")
    ap.add_argument("--reps", type=int, default=5, help="fresh processes per size (median and spread)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-docs", action="store_true", help="do not write the table into docs/benchmarks.md")
    ap.add_argument("--name", default="simulate", help="results file name (benchmarks/results/NAME.json)")
    args = ap.parse_args(argv)
    sizes = [(int(a), int(b)) for a, b in (size.split("x") for size in args.sizes.split(","))]
    setup = (f"synthetic task, 64 features, 10 classes, 40 samples per device, MLP 64-64-10, 10 local steps, "
             f"{args.rounds} rounds, in-process simulator")
    results = {"setup": setup, "reps": args.reps, "rows": measure(sizes, args.reps, args.rounds)}
    path = write(args.name, results)
    table = markdown(results)
    print(table)
    if not args.no_docs:
        flags = "".join(f" --{k} {v}" for k, v, d in (("sizes", args.sizes, DEFAULT_SIZES), ("reps", args.reps, 5),
                                                      ("rounds", args.rounds, 3)) if v != d)
        print(f"wrote {publish('simulate', 'python -m benchmarks simulate' + flags, table)}")
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()

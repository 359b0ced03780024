"""Fleet rounds through a real Mosquitto: ``fedtier fleet emulate`` at several fleet sizes.

Each repetition is a fresh ``fedtier fleet emulate --json`` (its own Mosquitto, one cell unless
``--cells``, the synthetic task, MLP 64-64-10, 5 local steps). Round 0 also distributes the model's
artifacts to every device, so the table reports rounds 1 and later: the round time, the round
overhead (round time minus the slowest device's local run) and, as the baseline measured in the
same run, the devices' training (all of it, one after the other: each worker process shares one
session). Median over the
repetitions of each run's median, with the spread.

    python benchmarks/bench_fleet.py                                 # the table in docs/benchmarks.md
    python benchmarks/bench_fleet.py --sizes 10000 --cells 10 --reps 1 --rounds 3 --name fleet_10k
    python benchmarks/bench_fleet.py --sizes 10 --reps 1 --rounds 2  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import spread, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def emulate(devices: int, rounds: int, timeout: float, keepalive_s: int = 30, cells: int = 1,
            loop: str = "mux") -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "fedtier", "fleet", "emulate", "--devices", str(devices),
                          "--cells", str(cells), "--rounds", str(rounds), "--keepalive-s", str(keepalive_s),
                          "--loop", loop, "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{devices} devices failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


BREAKDOWN = ("edge_decode_s", "edge_work_s", "coordinator_s", "rest_s")


def _spread(v: dict[str, float]) -> str:
    return f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})"


def table(results: dict[str, Any]) -> str:
    lines = ["| devices | reps | round s | overhead s (round − slowest device) | devices' training s | "
             "round 0 s (with artifacts) | start-up s |", "|---|---|---|---|---|---|---|"]
    for r in results["sizes"]:
        lines.append(f"| {r['devices']:,} | {r['reps']} | {_spread(r['round_s'])} | {_spread(r['overhead_s'])} | "
                     f"{_spread(r['training_s'])} | {_spread(r['round0_s'])} | {_spread(r['start_s'])} |")
    if all(k in r for r in results["sizes"] for k in BREAKDOWN):
        lines += ["", "Where a round (1 and later) goes, seconds, median (min–max):", "",
                  "| devices | round | devices' training per worker | edges: decoding | edges: all work (decoding "
                  "included) | coordinator | rest: broker, devices' own decode/encode/outbox, waiting |",
                  "|---|---|---|---|---|---|---|"]
        for r in results["sizes"]:
            lines.append(f"| {r['devices']:,} | " + " | ".join(_spread(r[k]) for k in (
                "round_s", "training_per_worker_s", *BREAKDOWN)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,500,1000", help="devices, comma-separated")
    ap.add_argument("--cells", type=int, default=1, help="cells the devices are spread over")
    ap.add_argument("--loop", choices=("mux", "threads"), default="mux", help="fleet emulate --loop")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--name", default="fleet")
    ap.add_argument("--keepalive-s", type=int, default=30, help="the emulated nodes' MQTT keep-alive")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"setup": f"{args.cells} cell(s), synthetic task, MLP 64-64-10, 5 local steps, "
                                        f"{args.rounds} rounds, keep-alive {args.keepalive_s} s, --loop {args.loop}",
                               "sizes": []}
    for devices in (int(x) for x in args.sizes.split(",")):
        runs = [emulate(devices, args.rounds, args.timeout, args.keepalive_s, args.cells, args.loop)
                for _ in range(args.reps)]
        later = [[r for r in run["rounds"] if r["round"] > 0] for run in runs]
        row = {"devices": devices, "reps": args.reps,
               "round_s": spread([statistics.median(r["round_s"] for r in rs) for rs in later]),
               "overhead_s": spread([statistics.median(r["overhead_s"] for r in rs) for rs in later]),
               "training_s": spread([statistics.median(r["training_s"] for r in rs) for rs in later]),
               "round0_s": spread([run["rounds"][0]["round_s"] for run in runs]),
               **{key: spread([statistics.median(r[key] for r in rs) for rs in later]) for key in BREAKDOWN},
               "training_per_worker_s": spread([statistics.median(r["training_s"] / r["workers"] for r in rs)
                                                for rs in later]),
               "start_s": spread([run["start_s"] for run in runs])}
        results["sizes"].append(row)
        print(devices, f"{row['round_s']['median']:.2f} s/round", flush=True)
    path = write(args.name, results)
    print(table(results))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()

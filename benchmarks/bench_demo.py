"""How long `fedtier demo` takes with defaults, and what accuracy it reaches.

Runs the real command (separate processes, real broker) ``--repeat`` times per broker and
records wall time (whole command, process start to exit) and the demo's own training time.
Usage: ``python benchmarks/bench_demo.py [--repeat 3]``; writes benchmarks/results/demo.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from _common import write


def run(broker: str, demo_args: list[str]) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "fedtier", "demo", "--json", "--broker", broker, *demo_args],
                         capture_output=True, text=True, check=True)
    total = time.perf_counter() - t0
    doc = json.loads(out.stdout)
    return {"command_s": round(total, 2), "demo_wall_s": round(doc["wall_s"], 2),
            "final_accuracy": round(doc["final_accuracy"], 4),
            "first_round_at_or_above_0.90": next((r["round"] + 1 for r in doc["rounds"] if r["accuracy"] >= 0.9),
                                                 None),
            "bytes": doc["bytes"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=None, help="the demo's --rounds (default: the demo's own)")
    ap.add_argument("--devices", type=int, default=None, help="the demo's --devices (default: the demo's own)")
    args = ap.parse_args(argv)
    demo_args = [*(["--rounds", str(args.rounds)] if args.rounds else []),
                 *(["--devices", str(args.devices)] if args.devices else [])]
    results = {}
    for broker in ("mosquitto", "embedded"):
        runs = [run(broker, demo_args) for _ in range(args.repeat)]
        results[broker] = {"runs": runs,
                           "median_command_s": statistics.median(r["command_s"] for r in runs),
                           "median_final_accuracy": statistics.median(r["final_accuracy"] for r in runs)}
        print(broker, results[broker]["median_command_s"], results[broker]["median_final_accuracy"])
    ratio = results["embedded"]["median_command_s"] / results["mosquitto"]["median_command_s"]
    setup = "12 devices, 2 cells, 30 rounds, digits Dirichlet(0.5)" if not demo_args else " ".join(demo_args)
    out = {"defaults": setup, **results, "embedded_over_mosquitto_time_ratio": round(ratio, 3)}
    path = write("demo", out)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()

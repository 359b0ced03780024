"""Bytes to accuracy: what each algorithm sends per tier to reach a target test accuracy, against
hierarchical FedAvg with float32 updates on the same task and seeds.

The task is the demo's (scikit-learn's ``digits``, 2 cells of 6 devices, non-iid), run by the
in-process simulator, which counts the bytes every message has on the wire (quantized payloads
included). A run that never reaches the target within ``--rounds`` is reported as not reaching it.

Usage: ``python -m benchmarks bytes [--target 0.9] [--seeds 3] [--rounds 60] [--quick]``; writes
benchmarks/results/bytes.json and prints the table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write  # noqa: E402

BASE: dict[str, Any] = {"rollout": "bytes", "model": {"hidden": [64]},
                        "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
                        "topology": {"cells": 2, "devices_per_cell": 6}}

RUNS: dict[str, dict[str, Any]] = {
    "fedavg f32 (baseline)": {"algorithm": "fedavg", "fedavg": {"local_steps": 10, "lr": 0.1}},
    "hier_qsgd 8/8 bits": {"algorithm": "hier_qsgd", "hier_qsgd": {"local_steps": 10, "edge_rounds": 1, "lr": 0.1,
                                                                  "bits_device": 8, "bits_edge": 8}},
    "hier_qsgd 4/8 bits": {"algorithm": "hier_qsgd", "hier_qsgd": {"local_steps": 10, "edge_rounds": 1, "lr": 0.1,
                                                                  "bits_device": 4, "bits_edge": 8}},
    "hier_qsgd 2/8 bits": {"algorithm": "hier_qsgd", "hier_qsgd": {"local_steps": 10, "edge_rounds": 1, "lr": 0.1,
                                                                  "bits_device": 2, "bits_edge": 8}},
    "qhetfed 4/8 bits": {"algorithm": "qhetfed", "qhetfed": {"tau": 3, "gamma": 10, "lr": 0.1,
                                                            "bits_device": 4, "bits_edge": 8}},
    "hist f32": {"algorithm": "hist", "hist": {"local_steps": 10, "edge_rounds": 1, "lr": 0.1}},
}
TIERS = ("device_up", "device_down", "edge_up", "cloud_down")


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def bytes_to_target(rows: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Cumulative bytes per tier up to the first round whose test accuracy reaches ``target``."""
    total = dict.fromkeys(TIERS, 0)
    for row in rows:
        for tier in TIERS:
            total[tier] += int(row["bytes"].get(tier, 0))
        if row["accuracy"] is not None and row["accuracy"] >= target:
            return {"reached": True, "round": row["round"], "bytes": total, "accuracy": row["accuracy"]}
    return {"reached": False, "round": None, "bytes": total, "accuracy": rows[-1]["accuracy"] if rows else None}


def run_one(name: str, seed: int, rounds: int, target: float, workdir: str) -> dict[str, Any]:
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.simulate import simulate

    plain = merged(BASE, RUNS[name])
    plain.update({"seed": seed, "rounds": rounds, "state_dir": workdir, "artifact_store": workdir})
    result = simulate(RolloutConfig.from_mapping(plain, source=f"bench_bytes {name}"))
    return {"run": name, "seed": seed, **bytes_to_target(result.rounds, target)}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: the median over seeds of the bytes to target (only if every seed reached it)."""
    base = [r for r in runs if r["run"] == "fedavg f32 (baseline)"]
    base_up = statistics.median(r["bytes"]["device_up"] + r["bytes"]["edge_up"] for r in base) if base and all(
        r["reached"] for r in base) else None
    table = []
    for name in RUNS:
        mine = [r for r in runs if r["run"] == name]
        if not mine:
            continue
        reached = all(r["reached"] for r in mine)
        row: dict[str, Any] = {"run": name, "seeds": len(mine), "reached": sum(r["reached"] for r in mine)}
        if reached:
            row["rounds"] = statistics.median(r["round"] + 1 for r in mine)
            for tier in TIERS:
                row[tier] = statistics.median(r["bytes"][tier] for r in mine)
            up = statistics.median(r["bytes"]["device_up"] + r["bytes"]["edge_up"] for r in mine)
            row["uplink"] = up
            row["uplink_vs_baseline"] = round(up / base_up, 3) if base_up else None
        table.append(row)
    return table


def markdown(table: list[dict[str, Any]], target: float) -> str:
    lines = [f"| algorithm | seeds at {target:g} | rounds | device up (KB) | edge up (KB) | uplink vs fedavg f32 |",
             "|---|---|---|---|---|---|"]
    for row in table:
        if "uplink" in row:
            lines.append(f"| {row['run']} | {row['reached']}/{row['seeds']} | {row['rounds']:g} | "
                         f"{row['device_up'] / 1e3:,.0f} | {row['edge_up'] / 1e3:,.0f} | "
                         f"{row['uplink_vs_baseline']:.2f}x |")
        else:
            lines.append(f"| {row['run']} | {row['reached']}/{row['seeds']} | not reached | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated run names")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 1 seed, 2 runs: checks the harness only")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/bytes.json")
    args = parser.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    if args.quick:
        args.seeds, args.rounds, names = 1, 2, ["fedavg f32 (baseline)", "hier_qsgd 4/8 bits"]
    unknown = set(names) - set(RUNS)
    if unknown:
        parser.error(f"unknown runs {sorted(unknown)}; known: {', '.join(RUNS)}")
    runs = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            for seed in range(args.seeds):
                runs.append(run_one(name, seed, args.rounds, args.target, workdir))
                r = runs[-1]
                print(f"{name} seed {seed}: " + (f"{args.target:g} at round {r['round']}" if r["reached"] else
                                                  f"not reached (last {r['accuracy']:.3f})"), flush=True)
    table = summarize(runs)
    doc = {"task": "digits, 2 cells x 6 devices, dirichlet alpha 0.5, MLP 64-64-10, in-process simulator",
           "target": args.target, "rounds_max": args.rounds, "seeds": args.seeds, "table": table, "runs": runs}
    if not args.no_write:
        print(f"wrote {write('bytes', doc)}")
    print(markdown(table, args.target))
    return doc


if __name__ == "__main__":
    main()

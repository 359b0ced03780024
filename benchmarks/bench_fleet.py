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
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import spread, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class RunFailed(RuntimeError):
    """One repetition did not finish (a stall, a crash, the timeout); its message says where it stood."""


def emulate(devices: int, rounds: int, timeout: float, keepalive_s: int = 30, cells: int = 1,
            loop: str = "mux", stall_s: float = 600.0) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, "-m", "fedtier", "fleet", "emulate", "--devices", str(devices),
                             "--cells", str(cells), "--rounds", str(rounds), "--keepalive-s", str(keepalive_s),
                             "--loop", loop, "--stall-s", str(stall_s), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the emulator stops and says where the cells stood
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise RunFailed(f"{devices} devices: no result within {timeout:g} s\n{err[-6000:]}") from None
    if proc.returncode != 0:
        raise RunFailed(f"{devices} devices failed:\n{err[-6000:]}")
    return json.loads(out)


BREAKDOWN = ("edge_decode_s", "edge_work_s", "coordinator_s", "rest_s")


def _spread(v: dict[str, float]) -> str:
    return f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})"


def table(results: dict[str, Any]) -> str:
    lines = ["| devices | runs finished | round s | overhead s (round − slowest device) | devices' training s | "
             "round 0 s (with artifacts) | start-up s |", "|---|---|---|---|---|---|---|"]
    finished = [r for r in results["sizes"] if r["finished"]]
    for r in results["sizes"]:
        cells = [_spread(r[k]) if r["finished"] else "–" for k in
                 ("round_s", "overhead_s", "training_s", "round0_s", "start_s")]
        lines.append(f"| {r['devices']:,} | {r['finished']} of {r['reps']} | " + " | ".join(cells) + " |")
    if finished and all(k in r for r in finished for k in BREAKDOWN):
        lines += ["", "Where a round (1 and later) goes, seconds, median (min–max):", "",
                  "| devices | round | devices' training per worker | edges: decoding | edges: all work (decoding "
                  "included) | coordinator | rest: broker, devices' own decode/encode/outbox, waiting |",
                  "|---|---|---|---|---|---|---|"]
        for r in finished:
            lines.append(f"| {r['devices']:,} | " + " | ".join(_spread(r[k]) for k in (
                "round_s", "training_per_worker_s", *BREAKDOWN)) + " |")
    for r in results["sizes"]:
        for failure in r["failures"]:
            lines += ["", f"A run of {r['devices']:,} devices did not finish:", "", "```", failure.strip(), "```"]
    return "\n".join(lines)


def summarize(devices: int, reps: int, runs: list[dict[str, Any]], failures: list[str]) -> dict[str, Any]:
    """One table row from the runs that finished (medians of each run's median over rounds 1 and later)."""
    row: dict[str, Any] = {"devices": devices, "reps": reps, "finished": len(runs), "failures": failures}
    if not runs:
        return row
    later = [[r for r in run["rounds"] if r["round"] > 0] for run in runs]
    row.update({"round_s": spread([statistics.median(r["round_s"] for r in rs) for rs in later]),
                "overhead_s": spread([statistics.median(r["overhead_s"] for r in rs) for rs in later]),
                "training_s": spread([statistics.median(r["training_s"] for r in rs) for rs in later]),
                "round0_s": spread([run["rounds"][0]["round_s"] for run in runs]),
                **{key: spread([statistics.median(r[key] for r in rs) for rs in later]) for key in BREAKDOWN},
                "training_per_worker_s": spread([statistics.median(r["training_s"] / r["workers"] for r in rs)
                                                 for rs in later]),
                "start_s": spread([run["start_s"] for run in runs])})
    return row


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
    ap.add_argument("--stall-s", type=float, default=600.0,
                    help="a run without progress this long stops and reports where its cells stand")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"setup": f"{args.cells} cell(s), synthetic task, MLP 64-64-10, 5 local steps, "
                                        f"{args.rounds} rounds, keep-alive {args.keepalive_s} s, --loop {args.loop}",
                               "sizes": []}
    path = None
    for devices in (int(x) for x in args.sizes.split(",")):
        runs: list[dict[str, Any]] = []
        failures: list[str] = []
        results["sizes"].append(summarize(devices, args.reps, runs, failures))
        for rep in range(args.reps):
            try:
                runs.append(emulate(devices, args.rounds, args.timeout, args.keepalive_s, args.cells, args.loop,
                                    args.stall_s))
                print(devices, f"run {rep + 1}: {runs[-1]['wall_s']:.1f} s", flush=True)
            except RunFailed as exc:
                failures.append(str(exc))
                print(devices, f"run {rep + 1} did not finish:\n{exc}", flush=True)
            # written after every run: a later one that stalls or is stopped loses none of the earlier
            results["sizes"][-1] = summarize(devices, args.reps, runs, failures)
            path = write(args.name, results)
    print(table(results))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()

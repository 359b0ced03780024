"""Asynchronous against synchronous: hierarchical FedBuff vs hierarchical FedAvg under real availability.

Issue 36, part 5: the virtual time and the bytes each needs to reach a target test accuracy, at 1,000 and
10,000 simulated devices (100 per cell), with 10 %, 30 % (``diurnal``: one window a day per device) and
100 % (``always``) of the fleet online and heavy-tailed (lognormal) training times.

What runs: fedtier's own roles (``fedtier.algorithms.fedavg`` and ``fedbuff``, unchanged) on the trace
simulator (``local_fleet.trace_sim``) with availability traces from ``fedtier.rollout.availability``; every
message through the real codec, bytes counted per link. What does not: ONNX training — a device's local
training is a numpy softmax regression (as ``experiments/dp_fleet.py``; 10,000 ORT devices do not fit two
shared cores in the time), on a synthetic non-iid task (each device holds 20 rows of 2 of 10 classes), its
minibatches drawn from the streams the roles name.

Usage: ``python experiments/async.py [--config experiments/async.toml] [--fleets 1000] [--seeds 0]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, Mapping

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import IMG, md_table, print_table, write_section  # noqa: E402

from fedtier.algorithms.base import LocalResult, LocalTrain  # noqa: E402
from fedtier.rng import stream  # noqa: E402
from fedtier.training.batching import minibatch_indices  # noqa: E402

ALGORITHMS = ("fedavg", "fedbuff")


# --- data, model, local training ----------------------------------------------------------------


def make_data(d: Mapping[str, Any], devices: list[str], seed: int) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]],
                                                                           tuple[np.ndarray, np.ndarray]]:
    """Per-device rows (``classes_per_device`` adjacent classes each) and an iid test set."""
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, d["mean_std"], size=(d["classes"], d["features"]))
    s, k, n = d["samples_per_device"], d["classes_per_device"], len(devices)
    first = rng.integers(0, d["classes"], size=n)
    picks = (first[:, None] + rng.integers(0, k, size=(n, s))) % d["classes"]
    x = (means[picks] + rng.normal(size=(n, s, d["features"]))).astype(np.float32)
    yt = rng.integers(0, d["classes"], size=d["test_samples"])
    xt = (means[yt] + rng.normal(size=(d["test_samples"], d["features"]))).astype(np.float32)
    return {dev: (x[i], picks[i]) for i, dev in enumerate(devices)}, (xt, yt)


def init_params(d: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {"W": np.zeros((d["features"], d["classes"]), np.float32), "b": np.zeros(d["classes"], np.float32)}


def _grad(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.mean(np.log(p[np.arange(len(y)), y] + 1e-12)))
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return x.T @ p, p.sum(axis=0), loss


class SoftmaxCompute:
    """``LocalTrain`` in numpy: minibatch SGD on the device's rows, batches from the stream the role names."""

    def __init__(self, data: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.data = data

    def __call__(self, device: str, request: LocalTrain) -> LocalResult:
        x, y = self.data[device]
        w0, b0 = request.params["W"], request.params["b"]
        w, b = w0.astype(np.float64), b0.astype(np.float64)
        losses = []
        for idx in minibatch_indices(len(y), request.batch_size, request.steps, stream(*request.stream)):
            gw, gb, loss = _grad(w, b, x[idx], y[idx])
            w -= request.lr * gw
            b -= request.lr * gb
            losses.append(loss)
        delta = {"W": (w.astype(np.float32) - w0), "b": (b.astype(np.float32) - b0)}
        return LocalResult(delta=delta, num_samples=len(y), mean_loss=float(np.mean(losses)), steps=request.steps)


def accuracy_of(test: tuple[np.ndarray, np.ndarray]) -> Any:
    xt, yt = test

    def evaluate(params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {"accuracy": float(np.mean(np.argmax(xt @ params["W"] + params["b"], axis=1) == yt))}

    return evaluate


# --- one run ------------------------------------------------------------------------------------


def rollout_mapping(spec: Mapping[str, Any], algorithm: str, devices: int, share: float, seed: int) -> dict[str, Any]:
    """The rollout config of one run (its algorithm section and [fleet]); ``tests/unit/test_docs.py`` loads them."""
    base = {k: dict(v) if isinstance(v, dict) else v for k, v in spec["rollout"].items()}
    per_cell = spec["devices_per_cell"]
    section = dict(base.get(algorithm, {}))
    if algorithm == "fedavg":
        section["quorum"] = spec["fedavg_quorum_share"] * share
    base[algorithm] = section
    base.update(algorithm=algorithm, seed=seed, rounds=spec["max_versions"] if algorithm == "fedbuff"
                else spec["max_rounds"],
                topology={"cells": devices // per_cell, "devices_per_cell": per_cell},
                fleet={**spec["fleet"], "availability": "always" if share >= 1 else "diurnal", "share_online": share})
    return base


def all_mappings(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    plain = [rollout_mapping(spec, a, n, s, seed) for a in ALGORITHMS for n in spec["devices"] for s in spec["shares"]
             for seed in spec["seeds"]]
    return plain + [rollout_mapping(variant(spec, d), a, d["devices"], d["share"], spec["seeds"][0])
                    for d in spec.get("diagnostics", []) for a in ALGORITHMS]


def run_diagnostics(spec: Mapping[str, Any], done: list[dict[str, Any]], results_path: Path | None
                    ) -> list[dict[str, Any]]:
    """Each ``[[diagnostics]]`` entry: both algorithms at its size and share, first seed, with its changes."""
    out = []
    for d in spec.get("diagnostics", []):
        for a in ALGORITHMS:
            key = (a, d["devices"], d["share"], spec["seeds"][0], d["label"])
            r = next((x for x in done if (x["algorithm"], x["devices"], x["share"], x["seed"], x.get("label"))
                      == key), None)
            if r is None:
                r = {**run(variant(spec, d), a, d["devices"], d["share"], spec["seeds"][0]), "label": d["label"]}
                if results_path is not None:
                    with results_path.open("a") as fh:
                        fh.write(json.dumps(r) + "\n")
            print(f"diagnostic {d['label']!r} {a}: " + (f"target at {r['time_s'] / 60:.1f} virtual min"
                                                       if r["reached"] else "target not reached"), flush=True)
            out.append(r)
    return out


def diagnostic_rows(spec: Mapping[str, Any], diagnostics: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for d in spec.get("diagnostics", []):
        cell = {r["algorithm"]: r for r in diagnostics if r.get("label") == d["label"]}
        minutes = {a: cell[a]["time_s"] / 60 if a in cell and cell[a]["reached"] else None for a in ALGORITHMS}
        ratio = (f"{minutes['fedbuff'] / minutes['fedavg']:.2f}" if minutes["fedbuff"] and minutes["fedavg"]
                 else "—")
        rows.append([d["label"], f"{d['devices']:,}", f"{d['share']:.0%}",
                     f"{d.get('target_accuracy', spec['target_accuracy']):.2f}",
                     *[f"{minutes[a]:,.0f}" if minutes[a] is not None else "not reached" for a in ALGORITHMS],
                     f"{cell['fedbuff']['rounds']}" if "fedbuff" in cell else "—", ratio])
    return rows


def variant(spec: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` with a diagnostic's changes: its ``fleet``, ``fedavg`` and ``fedbuff`` tables update the spec's."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in spec.items()}
    out["rollout"] = {k: dict(v) if isinstance(v, dict) else v for k, v in spec["rollout"].items()}
    out["fleet"].update(changes.get("fleet", {}))
    out["target_accuracy"] = changes.get("target_accuracy", spec["target_accuracy"])
    for algorithm in ALGORITHMS:
        out["rollout"][algorithm].update(changes.get(algorithm, {}))
    return out


def run(spec: Mapping[str, Any], algorithm: str, devices: int, share: float, seed: int) -> dict[str, Any]:
    """One configuration, stopped at the target accuracy (or the horizon, or its rounds)."""
    from fedtier import algorithms
    from fedtier.rollout.availability import make_traces
    from fedtier.rollout.config import RolloutConfig
    from local_fleet.trace_sim import TraceSimulation

    cfg = RolloutConfig.from_mapping(rollout_mapping(spec, algorithm, devices, share, seed))
    assert cfg.fleet is not None
    cells = cfg.topology.layout()
    ids = [d for m in cells.values() for d in m]
    data, test = make_data(spec["data"], ids, spec["data"]["seed"] + seed)
    traces = make_traces(cfg.fleet.spec(), seed, ids)
    start = time.perf_counter()
    target = spec["target_accuracy"]
    sim = TraceSimulation(module=algorithms.load(algorithm), cells=cells, initial_params=init_params(spec["data"]),
                          config=cfg.algorithm_config(), rounds=cfg.rounds, traces=traces,
                          compute=SoftmaxCompute(data), evaluate=accuracy_of(test), rollout=cfg.rollout)
    result = sim.run(horizon_s=spec["horizon_h"] * 3600.0, stop=lambda row: row["accuracy"] >= target)
    hit = next((r for r in result.rows if r["accuracy"] >= target), None)
    return {"algorithm": algorithm, "devices": devices, "share": share, "seed": seed,
            "reached": hit is not None, "time_s": hit["time_s"] if hit else None,
            "bytes": hit["bytes_total"] if hit else None, "rounds": len(result.rows),
            "trainings": result.trainings, "final_accuracy": result.rows[-1]["accuracy"] if result.rows else 0.0,
            "virtual_s": result.now, "dropped": result.dropped, "wall_s": time.perf_counter() - start,
            "curve": [(r["time_s"], r["accuracy"], r["bytes_total"]) for r in result.rows]}


# --- report -------------------------------------------------------------------------------------


def _mean(values: list[float]) -> str:
    """``m`` or ``m ± s``: whole numbers, one decimal below 10 (a few virtual minutes)."""
    if not values:
        return "—"
    m = statistics.mean(values)
    spec = ",.1f" if m < 10 else ",.0f"
    return f"{m:{spec}}" if len(values) == 1 else f"{m:{spec}} ± {statistics.stdev(values):{spec}}"


def table_rows(spec: Mapping[str, Any], results: list[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    """The table's rows (sizes x shares where both algorithms ran), and the acceptance verdicts."""
    rows, verdicts = [], []
    for n in spec["devices"]:
        for share in spec["shares"]:
            cell = {a: [r for r in results if r["algorithm"] == a and r["devices"] == n and r["share"] == share]
                    for a in ALGORITHMS}
            if not all(cell.values()):
                continue
            out, ratio = _cell_row(spec, n, share, cell)
            rows.append(out)
            if share == min(spec["shares"]):
                verdicts.append(f"{n:,} devices, {share:.0%} online: FedBuff / FedAvg time = "
                                + (f"{ratio:.2f} — {'met' if ratio <= 0.5 else 'NOT met'}" if ratio is not None
                                   else "not comparable (a run did not reach the target)"))
    return rows, verdicts


def _cell_row(spec: Mapping[str, Any], n: int, share: float, cell: Mapping[str, list[dict[str, Any]]]
              ) -> tuple[list[str], float | None]:
    """One row: per algorithm minutes, MiB and runs that reached the target; the time ratio; the lower target."""
    out = [f"{n:,}", f"{share:.0%}"]
    times = {}
    for a in ALGORITHMS:
        hits = [r for r in cell[a] if r["reached"]]
        times[a] = statistics.mean([r["time_s"] for r in hits]) / 60 if len(hits) == len(cell[a]) else None
        out += [_mean([r["time_s"] / 60 for r in hits]) if hits else "not reached",
                _mean([r["bytes"] / 2**20 for r in hits]) if hits else "—", f"{len(hits)}/{len(cell[a])}"]
    ratio = times["fedbuff"] / times["fedavg"] if times["fedbuff"] and times["fedavg"] else None
    out.append(f"{ratio:.2f}" if ratio is not None else "—")
    lower = spec.get("secondary_target")
    if lower is not None:  # read off the same curves (every run passes it before it stops)
        for a in ALGORITHMS:
            hits = [first_time(r["curve"], lower) for r in cell[a]]
            found = [h / 60 for h in hits if h is not None]
            out.append(_mean(found) + ("" if len(found) == len(hits) else f" ({len(found)}/{len(hits)})")
                       if found else "not reached")
    return out, ratio


def first_time(curve: list[Any], target: float) -> float | None:
    """The virtual time of the first model at ``target`` accuracy or above (``None``: never)."""
    return next((t for t, accuracy, _ in curve if accuracy >= target), None)


def plot(spec: Mapping[str, Any], results: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(spec["devices"]), len(spec["shares"]), figsize=(4 * len(spec["shares"]),
                                                                            3 * len(spec["devices"])), squeeze=False)
    for i, n in enumerate(spec["devices"]):
        for j, share in enumerate(spec["shares"]):
            ax = axes[i][j]
            for a, color in zip(ALGORITHMS, ("tab:blue", "tab:orange"), strict=True):
                for r in results:
                    if r["algorithm"] == a and r["devices"] == n and r["share"] == share and r["curve"]:
                        t = [c[0] / 60 for c in r["curve"]]
                        ax.plot(t, [c[1] for c in r["curve"]], color=color, alpha=0.8,
                                label=a if r["seed"] == spec["seeds"][0] else None)
            ax.axhline(spec["target_accuracy"], color="grey", lw=0.8, ls="--")
            ax.set_title(f"{n:,} devices, {share:.0%} online", fontsize=9)
            ax.set_xlabel("virtual minutes")
            ax.set_ylabel("test accuracy")
            ax.legend(fontsize=8)
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    path = IMG / "async.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(spec: Mapping[str, Any], results: list[dict[str, Any]], wall: float, command: str,
          diagnostics: list[dict[str, Any]] | None = None) -> None:
    rows, verdicts = table_rows(spec, results)
    header = ["devices", "online", "FedAvg minutes to target", "FedAvg MiB to target", "reached",
              "FedBuff minutes to target", "FedBuff MiB to target", "reached", "time ratio FedBuff/FedAvg"]
    if spec.get("secondary_target") is not None:
        header += [f"FedAvg minutes to {spec['secondary_target']:.2f}", f"FedBuff minutes to "
                                                                        f"{spec['secondary_target']:.2f}"]
    r, f, fl = spec["rollout"], spec["rollout"]["fedbuff"], spec["fleet"]
    body = "\n".join([
        "## Asynchronous (FedBuff) against synchronous (FedAvg) rounds under real availability",
        "",
        f"Command: `nice -n 10 {command}`, on the 2-core machine (shared with other jobs), "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}; {sum(r['wall_s'] for r in results) / 60:.0f} minutes of wall "
        f"time for {len(results)} runs.",
        "",
        "fedtier's own roles — hierarchical FedAvg (`fedtier.algorithms.fedavg`) and hierarchical FedBuff "
        "(`fedtier.algorithms.fedbuff`) — on the trace simulator (`local_fleet/trace_sim.py`): virtual time, "
        "every message through the real codec, bytes counted on every link. Devices are online once a day "
        f"(`diurnal`, a window of share x 24 h at a seeded phase) or always; a local training takes "
        f"{fl['compute_s']:g} s x exp({fl['speed_sigma']:g} g), g ~ N(0, 1) per device (median {fl['compute_s']:g} s, "
        f"1 % of devices over {fl['compute_s'] * math.exp(2.33 * fl['speed_sigma']):.0f} s). Local training is a "
        "numpy softmax regression (not ONNX: 10,000 ORT devices do not fit the time on two cores) on a synthetic "
        f"non-iid task: {spec['data']['classes']} Gaussian classes in {spec['data']['features']} dimensions, each "
        f"device {spec['data']['samples_per_device']} rows of {spec['data']['classes_per_device']} classes; "
        f"{spec['devices_per_cell']} devices per cell. Target: test accuracy {spec['target_accuracy']:.2f}. "
        f"Seeds: {', '.join(map(str, spec['seeds']))} (a 'reached' column counts the runs that reached the target "
        "out of those made; times and bytes are means ± standard deviations over the runs that reached it).",
        "",
        f"Both: {r['fedavg']['local_steps']} local steps of batch {r['fedavg']['batch_size']}, lr "
        f"{r['fedavg']['lr']:g}. FedAvg: a round closes when every member reported or, after its deadline of "
        f"{r['fedavg']['deadline_s']:g} s, with a quorum of {spec['fedavg_quorum_share']:g} x the share online "
        f"(the existing logic: an offline device is simply not reporting). FedBuff: k_edge = {f['k_edge']}, "
        f"edge time limit {f['edge_timeout_s']:g} s, k_cloud = {f['k_cloud']}, staleness weight 1/sqrt(1 + s), "
        f"max staleness {f['max_staleness']}; an online device trains again as soon as it uploaded.",
        "",
        md_table(header, rows),
        "",
        "Acceptance (at 10 % online FedBuff reaches the target in at most half FedAvg's virtual time): "
        + "; ".join(verdicts) + ".",
        "",
        "![accuracy against virtual time](img/async.png)",
        "",
        *spec.get("notes", []),
        *([
            "",
            "Diagnostics (first seed; each changes one thing, both algorithms rerun):",
            "",
            md_table(["change", "devices", "online", "target", "FedAvg minutes", "FedBuff minutes",
                      "FedBuff versions", "ratio"], diagnostic_rows(spec, diagnostics)),
        ] if diagnostics else []),
    ])
    write_section("async", body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=HERE / "async.toml")
    ap.add_argument("--fleets", type=int, nargs="*", help="fleet sizes to run (default: the config's)")
    ap.add_argument("--seeds", type=int, nargs="*", help="seeds to run (default: the config's)")
    ap.add_argument("--results", type=Path, default=None, help="append each run's result to this JSON lines file, "
                                                                "and skip runs already in it")
    ap.add_argument("--no-write", action="store_true", help="do not write docs/experiments.md")
    ap.add_argument("--only-recorded", action="store_true", help="run nothing: report the runs in --results")
    args = ap.parse_args()
    spec = tomllib.loads(args.config.read_text())
    if args.fleets:
        spec["devices"] = args.fleets
    if args.seeds is not None and args.seeds:
        spec["seeds"] = args.seeds
    done: list[dict[str, Any]] = []
    if args.results is not None and args.results.exists():
        done = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    start = time.perf_counter()
    results = []
    for n in spec["devices"]:
        for share in spec["shares"]:
            for seed in spec["seeds"]:
                for a in ALGORITHMS:
                    prior = next((r for r in done if (r["algorithm"], r["devices"], r["share"], r["seed"])
                                  == (a, n, share, seed) and not r.get("label")), None)
                    if prior is None and args.only_recorded:
                        continue
                    r = prior if prior is not None else run(spec, a, n, share, seed)
                    if prior is None and args.results is not None:
                        with args.results.open("a") as fh:
                            fh.write(json.dumps(r) + "\n")
                    results.append(r)
                    print(f"{a:8} {n:>6} devices {share:>4.0%} online seed {seed}: "
                          + (f"target at {r['time_s'] / 60:7.1f} virtual min, {r['bytes'] / 2**20:8.2f} MiB"
                             if r["reached"] else f"target not reached (final {r['final_accuracy']:.3f})")
                          + f", {r['rounds']} models, {r['trainings']} trainings [{r['wall_s']:.0f} s]", flush=True)
    rows, verdicts = table_rows(spec, results)
    print_table("time and bytes to the target", ["devices", "online", "FedAvg min", "MiB", "n", "FedBuff min", "MiB",
                                                 "n", "ratio"], rows)
    diagnostics = (run_diagnostics(spec, done, args.results) if not args.only_recorded
                   else [r for r in done if r.get("label")])
    if not args.no_write:
        plot(spec, results)
        command = "python experiments/async.py " + " ".join(sys.argv[1:])
        write(spec, results, time.perf_counter() - start, command.strip(), diagnostics)


if __name__ == "__main__":
    main()

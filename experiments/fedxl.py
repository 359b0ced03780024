"""FeDXL vs FedAvg (cross-entropy), Local Pair and centralized training: AUROC and partial AUROC.

FeDXL is the algorithm of "FeDXL: Provable Federated Learning for Deep X-Risk Optimization" (Guo, Jin,
Luo and Yang, ICML 2023).

Runs every (dataset, method, seed) of ``experiments/fedxl.toml`` in fedtier's simulator — devices
stepping through onnxruntime-training, scores travelling as the wire carries them, the coordinator
ranking its test set every round — and writes a table (final AUROC and pAUC at FPR <= 0.3 and 0.5,
mean ± std over seeds, and the device uplink per round) and a plot of AUROC per round to
docs/experiments.md.

Usage: ``python experiments/fedxl.py [--config experiments/fedxl.toml] [--workers 2]``
"""

from __future__ import annotations

import copy
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

from report import IMG, arguments, md_table, print_table, progress, write_section  # noqa: E402

METRICS = ("auroc", "pauc_0.3", "pauc_0.5")
DATASET_KEYS = ("methods", "hidden", "select", "objective", "lrs", "label", "claim")
"""Keys of a [datasets.*] table that are not [rollout.data] settings."""


def dataset_methods(spec: dict[str, Any], dataset: str) -> list[str]:
    return list(spec["datasets"][dataset].get("methods", spec["methods"]))


def method_lrs(spec: dict[str, Any], dataset: str, method: str) -> list[float] | None:
    """The learning rates swept for ``method`` on ``dataset`` (``None``: the rollout's own)."""
    lrs = spec["datasets"][dataset].get("lrs", {})
    return lrs.get(method, spec["methods"][method].get("lrs"))


def runs(spec: dict[str, Any]) -> dict[tuple[str, str, float | None, int], dict[str, Any]]:
    """Every run's rollout config, keyed by (dataset, method, lr or None, seed)."""
    from local_fleet.demo import default_artifact_store

    out = {}
    for dataset, table in spec["datasets"].items():
        data = {k: v for k, v in table.items() if k not in DATASET_KEYS}
        for method in dataset_methods(spec, dataset):
            m = spec["methods"][method]
            for lr in method_lrs(spec, dataset, method) or [None]:
                for seed in spec["seeds"]:
                    base = copy.deepcopy(spec["rollout"])
                    name = f"{dataset}-{method}" + ("" if lr is None else f"-lr{lr}") + f"-{seed}"
                    base.update(rollout=f"{base['rollout']}-{name}".replace(".", "_"), algorithm=m["algorithm"],
                                seed=seed, artifact_store=str(default_artifact_store()))
                    base["data"] = {**base["data"], **data, "seed": seed}
                    if "hidden" in table:
                        base["model"] = {**base["model"], "hidden": table["hidden"]}
                    pool_round = m["algorithm"] == "fedxl" and m.get("fedxl", {}).get("pairs", "global") == "global"
                    base["rounds"] = spec["training_rounds"] + (1 if pool_round else 0)
                    section = m["algorithm"]
                    base[section] = {**base.get(section, {}), **m.get(section, {})}
                    if section == "fedxl" and m.get("pair_objective") and "objective" in table:
                        base[section]["objective"] = table["objective"]  # Local Pair, centralized: the dataset's loss
                    if lr is not None:
                        base[section]["lr"] = lr
                    if m.get("centralized"):
                        base["topology"] = {"cells": 1, "devices_per_cell": 1}
                        base["data"]["partition"] = "iid"
                    out[(dataset, method, lr, seed)] = base
    return out


def all_mappings(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run's rollout config (``tests/unit/test_docs.py`` loads them all)."""
    return list(runs(spec).values())


def run_one(mapping: dict[str, Any]) -> dict[str, Any]:
    """One simulated rollout from the zero model; its per-round ranking and device uplink."""
    import dataclasses
    import logging

    import numpy as np

    from fedtier.rollout.config import RolloutConfig
    from cloud_coordinator.rollout import prepare
    from local_fleet.simulate import simulate

    logging.disable(logging.WARNING)
    cfg = RolloutConfig.from_mapping(mapping, base_dir=HERE)
    t0 = time.perf_counter()
    prepared = prepare(cfg)
    if not cfg.model.hidden:  # a linear model from zero never trains ranks at exactly 0.5: "stays at chance" shows
        prepared = dataclasses.replace(prepared, initial_params={n: np.zeros_like(p)
                                                                 for n, p in prepared.initial_params.items()})
    result = simulate(cfg, prepared=prepared)
    rows = result.rounds
    devices = len(prepared.devices)
    return {**{k: [r[k] for r in rows] for k in METRICS},
            "uplink": [r["bytes"]["device_up"] / devices for r in rows], "wall_s": time.perf_counter() - t0}


def main() -> None:
    args = arguments(__doc__.splitlines()[0], HERE / "fedxl.toml")
    spec = tomllib.loads(args.config.read_text())
    jobs = runs(spec)
    t0 = time.perf_counter()
    results: dict[tuple[str, str, float | None, int], dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        outs = pool.map(run_one, jobs.values())  # submits every run: workers fork before the bar's thread
        with progress(len(jobs)) as bar:
            for done, (key, out) in enumerate(zip(jobs, outs, strict=True), 1):
                results[key] = out
                bar.line(f"{key}: final auroc {out['auroc'][-1]:.4f} pauc@0.3 {out['pauc_0.3'][-1]:.4f} "
                         f"({out['wall_s']:.0f}s)")
                bar.update(done, accuracy=out["auroc"][-1])
    write(spec, results, time.perf_counter() - t0)


def _best_lr(spec: dict[str, Any], results: dict, dataset: str, method: str) -> float | None:
    """The method's lr with the best final value of the dataset's metric (``select``, default AUROC; mean over
    seeds); ``None`` for a method without a sweep."""
    lrs = method_lrs(spec, dataset, method)
    if not lrs:
        return None
    metric = spec["datasets"][dataset].get("select", "auroc")
    return max(lrs, key=lambda lr: statistics.mean(results[(dataset, method, lr, s)][metric][-1]
                                                   for s in spec["seeds"]))


def _stat(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{values[0]:.4f}"


def _paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Mean of the per-seed differences ``a - b`` and its 95 % t-interval (runs of a seed share data and split)."""
    import numpy as np
    from scipy import stats

    d = np.asarray(a) - np.asarray(b)
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
    return float(d.mean()), float(d.mean() - half), float(d.mean() + half)


def _claim_rows(spec: dict[str, Any], dataset: str, final: Any) -> list[list[str]]:
    """A paper claim on ``dataset``: its FeDXL method against each other method, paired by seed."""
    table = spec["datasets"][dataset]
    metric = table.get("select", "auroc")
    ours = next(m for m in dataset_methods(spec, dataset) if m.startswith("fedxl"))
    rows = []
    for other in dataset_methods(spec, dataset):
        if other == ours:
            continue
        mean, lo, hi = _paired(final(dataset, ours, metric), final(dataset, other, metric))
        verdict = "FeDXL higher" if lo > 0 else ("FeDXL lower" if hi < 0 else "no difference resolved")
        rows.append([f"{dataset}: {spec['methods'][ours]['label']} vs {spec['methods'][other]['label']} ({metric})",
                     f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}]", verdict])
    return rows


def write(spec: dict[str, Any], results: dict, wall: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    seeds, methods, datasets = spec["seeds"], spec["methods"], list(spec["datasets"])
    chosen = {(d, m): _best_lr(spec, results, d, m) for d in datasets for m in dataset_methods(spec, d)}

    def final(dataset: str, method: str, metric: str) -> list[float]:
        return [results[(dataset, method, chosen[(dataset, method)], s)][metric][-1] for s in seeds]

    rows = []
    for dataset in datasets:
        for method in dataset_methods(spec, dataset):
            lr = chosen[(dataset, method)]
            uplink = np.mean([np.mean(results[(dataset, method, lr, s)]["uplink"][-spec["training_rounds"]:])
                              for s in seeds])
            label = methods[method]["label"] + ("" if lr is None else f" (lr {lr:g})")
            rows.append([dataset, label, *(_stat(final(dataset, method, k)) for k in METRICS),
                         f"{uplink / 1024:.1f} KiB"])

    one = datasets[0]
    f1, f2 = statistics.mean(final(one, "fedxl1", "auroc")), statistics.mean(final(one, "fedxl2", "auroc"))
    central = statistics.mean(final(one, "centralized", "auroc"))
    local = final(one, "local-pair", "auroc")
    ce = statistics.mean(final(one, "fedavg-ce", "auroc"))
    checks = [
        [f"{one}: FeDXL1 and FeDXL2 reach AUROC >= 0.90", f"{f1:.4f}, {f2:.4f}",
         "pass" if min(f1, f2) >= 0.90 else "FAIL"],
        [f"{one}: each within 0.01 of centralized", f"{f1 - central:+.4f}, {f2 - central:+.4f} (centralized "
                                                   f"{central:.4f})",
         "pass" if max(abs(f1 - central), abs(f2 - central)) <= 0.01 else "FAIL"],
        [f"{one}: Local Pair stays at 0.50 +- 0.01 (no pair on any device)",
         ", ".join(f"{v:.4f}" for v in local), "pass" if all(abs(v - 0.5) <= 0.01 for v in local) else "FAIL"],
        [f"{one}: FeDXL >= FedAvg (CE) - 0.01 (not required to beat it on linear data)",
         f"{max(f1, f2):.4f} vs {ce:.4f}",
         "pass" if max(f1, f2) >= ce - 0.01 else "FAIL"],
    ]
    claims = [row for d in datasets[1:] for row in _claim_rows(spec, d, final)]

    IMG.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4))
    for ax, dataset in zip(np.atleast_1d(axes), datasets, strict=True):
        metric = spec["datasets"][dataset].get("select", "auroc")
        for method in dataset_methods(spec, dataset):
            lr = chosen[(dataset, method)]
            curves = np.array([results[(dataset, method, lr, s)][metric] for s in seeds])
            # FeDXL's pool-collecting round left out
            curve = curves.mean(axis=0)[-spec["training_rounds"]:]
            ax.plot(np.arange(1, len(curve) + 1), curve, marker="." if method.startswith("fedxl") else None,
                    label=methods[method]["label"])
        ax.set_title(dataset)
        ax.set_xlabel("training round")
        ax.set_ylabel(f"test {metric} (mean of {len(seeds)} seeds)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(IMG / "fedxl_auroc.png", dpi=110)
    plt.close(fig)

    r = spec["rollout"]
    x = r["fedxl"]
    sets = spec["datasets"]
    body = f"""## FeDXL: AUROC and partial AUROC with pairs across devices

`python experiments/fedxl.py` — config `experiments/fedxl.toml`; {len(results)} simulated rollouts in
{wall / 60:.1f} min on 2 cores.

FeDXL is the algorithm of "FeDXL: Provable Federated Learning for Deep X-Risk Optimization" (Guo, Jin,
Luo and Yang, ICML 2023). FeDXL1 trains a pairwise AUROC loss with a linear outer function (the squared
hinge, or the pairwise sigmoid loss PSM of the paper's corrupted-label experiment), FeDXL2 KL-OPAUC
(one-way partial AUROC) with its moving averages `u` and momentum; both pair each device's rows with the
scores the other devices computed in the previous round.

Setup: {r['topology']['cells'] * r['topology']['devices_per_cell']} devices in {r['topology']['cells']} cells,
{spec['training_rounds']} training rounds of K = {x['local_steps']} local steps (FeDXL: B1 = {x['batch_size']}
positives and B2 = {x['batch_neg']} negatives per step; FedAvg: batches of {r['fedavg']['batch_size']}; FeDXL's
pool-collecting round 0 comes on top), the same number of local steps for every method. *Local Pair* is
the dataset's pairwise loss on each device's own pairs, *Centralized* the same on one device holding every
training row, with as many steps. A method with several learning rates ran them all; the table shows the
one with the best final value of the dataset's metric (mean over seeds). Test metrics on the coordinator's
held-out split after the last round; pAUC is McClish-standardized (0.5 = random). Uplink: bytes a device
sent per training round. Seeds {', '.join(map(str, seeds))}. Datasets:

- *one-class*: the rare-event generator (20 features, pos:neg 1:5, Bayes AUROC 0.921), every other device
  holding only positives and the rest only negatives; a linear scorer from the zero model.
- *corrupted* ({sets['corrupted']['claim']}): a synthetic binary task of {sets['corrupted']['modes']} Gaussian blobs per
  class in {sets['corrupted']['features']} dimensions (not linearly separable), positives at
  {sets['corrupted']['positive_rate']:.0%}, {sets['corrupted']['label_noise']:.0%} of each class's training labels
  flipped   (test labels clean), a Dirichlet({sets['corrupted']['alpha']}) label split; an MLP with a hidden layer of
  {sets['corrupted']['hidden'][0]}. FeDXL1 and the pairwise baselines train PSM.
- *imbalanced* ({sets['imbalanced']['claim']}): the same kind of task with positives at
  {sets['imbalanced']['positive_rate']:.0%} (1 to {round(1 / sets['imbalanced']['positive_rate']) - 1}), clean labels,
  scored by   pAUC at FPR <= 0.3; FeDXL2 and the pairwise baselines train KL-OPAUC.

{md_table(["dataset", "method", "AUROC", "pAUC (FPR <= 0.3)", "pAUC (FPR <= 0.5)", "uplink / device / round"],
          rows)}

{md_table(["acceptance check", "measured", "result"], checks)}

The paper's claims in its own regimes — FeDXL against each other method, the difference of the final
metric paired by seed (mean [95 % t-interval]):

{md_table(["claim (paper: FeDXL higher)", "FeDXL minus other", "here"], claims)}

![test metric per training round](img/fedxl_auroc.png)

One class per device is where pairs must cross devices: Local Pair has no pair on any device and
never moves from the zero model (AUROC exactly 0.5), while FeDXL matches centralized training. FedAvg
with cross-entropy also learns a ranking there — on linear Gaussian classes a tuned cross-entropy ranks
as well as the pairwise losses. The corrupted and imbalanced datasets are the paper's regimes for its
edge over cross-entropy (Tables 3 and 2): a model with a hidden layer trained long enough to fit flipped
labels, and rare positives with a partial-AUROC target.
"""
    print_table("acceptance checks", ["acceptance check", "measured", "result"], checks + claims)
    print(f"wrote {write_section('fedxl', body)}")


if __name__ == "__main__":
    main()

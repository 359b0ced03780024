"""M2FDP: test accuracy against the share of trusted edges, and against network shape.

M2FDP is the method of "Differentially-Private Multi-Tier Federated Learning" (Chen, Lin, Han and
Brinton).

Runs every study of ``experiments/m2fdp.toml`` in fedtier's simulator — devices training an ONNX
softmax model with onnxruntime, the DP mechanism in the device and edge roles, the coordinator's
ledger — and writes accuracy tables, the acceptance checks and a plot to docs/experiments.md.

Usage: ``python experiments/m2fdp.py [--config experiments/m2fdp.toml] [--workers 2]``
"""

from __future__ import annotations

import copy
import math
import random
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

SAMPLES_PER_DEVICE = 200


def rollout_mapping(spec: dict[str, Any], *, study: str | None, seed: int, p: float = 0.0, scale: float = 1.0,
                    cells: int = 10, per_cell: int = 5, schedule: str | None = None) -> dict[str, Any]:
    """One run's rollout config: ``study`` None is the non-DP baseline (with ``schedule``'s steps)."""
    from fedtier.rollout.config import TopologyConfig
    from local_fleet.demo import default_artifact_store

    s = spec["studies"][study or schedule or "paper"]
    base = copy.deepcopy(spec["rollout"])
    name = f"{study or 'nondp'}-p{p}-x{scale}-n{cells}x{per_cell}-{seed}"
    base.update(rollout=f"{base['rollout']}-{name}".replace(".", "_"), seed=seed,
                artifact_store=str(default_artifact_store()))
    test_fraction = base["data"]["test_fraction"]
    base["data"] = {**base["data"], "samples": math.ceil(cells * per_cell * SAMPLES_PER_DEVICE / (1 - test_fraction))}
    base["model"] = {**base["model"], "init_seed": seed}
    names = sorted(TopologyConfig(cells=cells, devices_per_cell=per_cell).layout())
    trusted = random.Random(seed).sample(names, round(p * cells))
    base["topology"] = {"cells": cells, "devices_per_cell": per_cell, "trusted": {c: True for c in trusted}}
    base["fedavg"] = {**base["fedavg"], "local_steps": s["local_steps"], "edge_rounds": s["edge_rounds"]}
    privacy = base.pop("privacy")
    if study is not None:
        base["privacy"] = {**privacy, "calibration": s["calibration"], "epsilon": s["epsilon"] * scale,
                           "clip": s["clip"], "noise_seed": seed}
    return base


def baseline_of(spec: dict[str, Any]) -> dict[str, str]:
    """study -> the first study with the same (local steps, edge rounds): whose non-DP run it shares."""
    first: dict[tuple[int, int], str] = {}
    for name, s in spec["studies"].items():
        first.setdefault((s["local_steps"], s["edge_rounds"]), name)
    return {name: first[(s["local_steps"], s["edge_rounds"])] for name, s in spec["studies"].items()}


def jobs(spec: dict[str, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for seed in spec["seeds"]:
        for schedule in sorted(set(baseline_of(spec).values())):
            out[("nondp", schedule, seed)] = rollout_mapping(spec, study=None, schedule=schedule, seed=seed)
        for study, s in spec["studies"].items():
            for scale in s["epsilon_scale"]:
                for p in spec["p_trusted"]:
                    out[(study, scale, p, seed)] = rollout_mapping(spec, study=study, seed=seed, p=p, scale=scale)
        net = spec["network"]
        for config in ("config1", "config2"):
            for cells, per_cell in net[config]:
                out[("net", cells, per_cell, seed)] = rollout_mapping(spec, study=net["study"], seed=seed,
                                                                      p=net["p_trusted"], cells=cells,
                                                                      per_cell=per_cell)
    return out


def all_mappings(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run's rollout config (``tests/unit/test_docs.py`` loads them all)."""
    return list(jobs(spec).values())


def run_one(mapping: dict[str, Any]) -> dict[str, Any]:
    import logging

    from fedtier.rollout.config import RolloutConfig
    from local_fleet.simulate import simulate

    logging.disable(logging.WARNING)
    cfg = RolloutConfig.from_mapping(mapping, base_dir=HERE)
    t0 = time.perf_counter()
    result = simulate(cfg)
    last = result.rounds[-1]
    plan = result.prepared.noise_plan
    return {"accuracy": [r["accuracy"] for r in result.rounds], "final": last["accuracy"],
            "epsilon_max": last.get("privacy", {}).get("epsilon_max"),
            "sigma_device": max((plan.device_sigma(c) for c in plan.cells), default=0.0) if plan else 0.0,
            "sigma_edge": max((plan.edge_sigma(c) for c in plan.cells), default=0.0) if plan else 0.0,
            "wall_s": time.perf_counter() - t0}


def main() -> None:
    args = arguments(__doc__.splitlines()[0], HERE / "m2fdp.toml")
    spec = tomllib.loads(args.config.read_text())
    todo = jobs(spec)
    t0 = time.perf_counter()
    results: dict[tuple[Any, ...], dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        outs = pool.map(run_one, todo.values())  # submits every run: workers fork before the bar's thread
        with progress(len(todo)) as bar:
            for done, (key, out) in enumerate(zip(todo, outs, strict=True), 1):
                results[key] = out
                bar.line(f"{key}: final acc {out['final']:.4f}, eps {out['epsilon_max']} ({out['wall_s']:.1f}s)")
                bar.update(done, accuracy=out["final"], epsilon=out["epsilon_max"])
    write(spec, results, time.perf_counter() - t0)


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _fmt(m: float, s: float) -> str:
    return f"{m:.3f} ± {s:.3f}"


class _Seeds:
    """Runs summarised over the seeds: (mean, std) of the final accuracy of a key, and of its non-DP baseline."""

    def __init__(self, spec: dict[str, Any], results: dict[tuple[Any, ...], dict[str, Any]]) -> None:
        self.seeds, self.results, self.baseline = spec["seeds"], results, baseline_of(spec)

    def acc(self, *key: Any) -> tuple[float, float]:
        return _stats([self.results[(*key, seed)]["final"] for seed in self.seeds])

    def nondp(self, study: str) -> tuple[float, float]:
        return self.acc("nondp", self.baseline[study])


def write(spec: dict[str, Any], results: dict[tuple[Any, ...], dict[str, Any]], wall: float) -> None:
    """The plot, this experiment's section of docs/experiments.md, and the acceptance checks on stdout."""
    runs = _Seeds(spec, results)
    rows, checks = [], []
    for study, s in spec["studies"].items():
        study_rows, study_checks = _study(spec, runs, study, s)
        rows += study_rows
        checks += study_checks
    net_rows, net_check = _network(spec, runs)
    checks.append(net_check)
    _plot(spec, runs)
    body = _body(spec, results, rows, net_rows, checks, wall)
    print_table("acceptance checks", ["acceptance check", "measured", "result"], checks)
    print(f"wrote {write_section('m2fdp', body)}")


def _study(spec: dict[str, Any], runs: _Seeds, study: str,
           s: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    """One calibration study: a row per epsilon scale, its ordering checks at scale 1, and (several scales) that
    accuracy does not fall as epsilon grows."""
    results, seeds, ps = runs.results, runs.seeds, spec["p_trusted"]
    base = runs.nondp(study)
    rows, checks = [], []
    for scale in s["epsilon_scale"]:
        eps = s["epsilon"] * scale
        by_p = {p: runs.acc(study, scale, p) for p in ps}
        sig_dev = statistics.mean(results[(study, scale, 0.0, seed)]["sigma_device"] for seed in seeds)
        sig_edge = statistics.mean(results[(study, scale, 1.0, seed)]["sigma_edge"] for seed in seeds)
        eps_real = max(results[(study, scale, p, seed)]["epsilon_max"] for p in ps for seed in seeds)
        rows.append([study, f"{eps:g}", f"K={s['local_steps'] * s['edge_rounds']}, τ={s['edge_rounds']}",
                     _fmt(*base), *(_fmt(*by_p[p]) for p in sorted(ps, reverse=True)),
                     f"{sig_dev:.3f} / {sig_edge:.3f}", f"{eps_real:.3g}"])
        if scale == 1 and s.get("check", True):
            checks += _ordering_checks(study, eps, base, by_p, ps)
    if len(s["epsilon_scale"]) > 1:
        lo, hi = min(s["epsilon_scale"]), max(s["epsilon_scale"])
        mono = [(p, runs.acc(study, lo, p)[0], runs.acc(study, hi, p)[0]) for p in ps]
        checks.append([f"{study}: accuracy does not fall from ε={s['epsilon'] * lo:g} to ε={s['epsilon'] * hi:g}",
                       ", ".join(f"p={p:g}: {a:.3f} → {b:.3f}" for p, a, b in mono),
                       "pass" if all(b >= a for _, a, b in mono) else "FAIL"])
    return rows, checks


def _ordering_checks(study: str, eps: float, base: tuple[float, float], by_p: dict[float, tuple[float, float]],
                     ps: list[float]) -> list[list[str]]:
    """The paper's claims at the target epsilon: all-local DP lands in its accuracy range, and accuracy falls
    from non-DP through shrinking trusted shares, each gap beyond the seeds' spread."""
    order = [("non-DP", base), *((f"p={p:g}", by_p[p]) for p in sorted(ps, reverse=True))]
    gaps = [(a, b, ma - mb, max(sa, sb)) for (a, (ma, sa)), (b, (mb, sb))
            in zip(order, order[1:], strict=False)]
    return [[f"{study}, ε={eps:g}: p=0 (all local DP) accuracy in 0.5..0.65",
             f"{by_p[0.0][0]:.3f}", "pass" if 0.5 <= by_p[0.0][0] <= 0.65 else "FAIL"],
            [f"{study}, ε={eps:g}: " + " > ".join(n for n, _ in order) + ", each gap > seed std",
             ", ".join(f"{g:+.3f} (std {sd:.3f})" for _, _, g, sd in gaps),
             "pass" if all(g > sd for *_, g, sd in gaps) else "FAIL"]]


def _network(spec: dict[str, Any], runs: _Seeds) -> tuple[list[list[str]], list[str]]:
    """The network-size study's rows, and its check: at the largest fleet, fewer larger cells beat more
    smaller ones."""
    net = spec["network"]
    net_rows = []
    for config in ("config1", "config2"):
        for cells, per_cell in net[config]:
            m, sd = runs.acc("net", cells, per_cell)
            net_rows.append([config.replace("config", "config "), str(cells), str(per_cell), str(cells * per_cell),
                             _fmt(m, sd)])
    big1 = max(net["config1"], key=lambda c: c[0] * c[1])
    big2 = max(net["config2"], key=lambda c: c[0] * c[1])
    a1, a2 = runs.acc("net", *big1)[0], runs.acc("net", *big2)[0]
    same = big1[0] * big1[1] == big2[0] * big2[1]
    return net_rows, [f"p=1, {big1[0] * big1[1]} devices: {big2[0]} cells x {big2[1]} beat {big1[0]} cells x "
                      f"{big1[1]}", f"{a2:.3f} > {a1:.3f}", "pass" if same and a2 > a1 else "FAIL"]


def _plot(spec: dict[str, Any], runs: _Seeds) -> None:
    """docs/img/m2fdp.png: accuracy by trusted share for every study and scale, and against network size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps, net, acc = spec["p_trusted"], spec["network"], runs.acc
    IMG.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    x = list(range(len(ps)))
    studies = [(st, sc) for st, s in spec["studies"].items() for sc in s["epsilon_scale"]]
    width = 0.8 / len(studies)
    for i, (study, scale) in enumerate(studies):
        s = spec["studies"][study]
        ms = [acc(study, scale, p) for p in ps]
        ax1.bar([xi + (i - (len(studies) - 1) / 2) * width for xi in x], [m for m, _ in ms], width,
                yerr=[sd for _, sd in ms], capsize=2, label=f"{study}, ε={s['epsilon'] * scale:g}")
    ax1.axhline(runs.nondp("paper")[0], color="black", linestyle="--", linewidth=1, label="non-DP")
    ax1.set_xticks(x, [f"p = {p:g}" for p in ps])
    ax1.set_xlabel("share of trusted edges")
    ax1.set_ylabel("test accuracy (mean ± std of seeds)")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=7, loc="lower right")
    ax1.grid(axis="y", alpha=0.3)
    for config, marker in (("config1", "o-"), ("config2", "s-")):
        pts = [(c * n, acc("net", c, n)[0]) for c, n in net[config]]
        label = "config 1: 5 devices per cell" if config == "config1" else "config 2: 2 cells"
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker, label=label)
    ax2.set_xlabel("devices")
    ax2.set_ylabel("test accuracy (mean of seeds)")
    ax2.set_title(f"p = {net['p_trusted']:g}, {net['study']} calibration")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(IMG / "m2fdp.png", dpi=110)
    plt.close(fig)


def _body(spec: dict[str, Any], results: dict[tuple[Any, ...], dict[str, Any]], rows: list[list[str]],
          net_rows: list[list[str]], checks: list[list[str]], wall: float) -> str:
    """The section's markdown: setup, the trusted-share and network tables, the checks, and what they say."""
    seeds, ps, net = spec["seeds"], spec["p_trusted"], spec["network"]
    r = spec["rollout"]
    net_eps = spec["studies"][net["study"]]["epsilon"]
    ps_desc = " / ".join(f"p={p:g}" for p in sorted(ps, reverse=True))
    return f"""## M2FDP: differential privacy with trust labels

`python experiments/m2fdp.py` — config `experiments/m2fdp.toml`; {len(results)} simulated rollouts in
{wall / 60:.1f} min on 2 cores.

M2FDP is the method of "Differentially-Private Multi-Tier Federated Learning" (Chen, Lin, Han and
Brinton).

Setup: 10 cells x 5 devices, 200 samples and 3 of the 10 labels per device, a linear
softmax on a {r['data']['features']}-dimensional Gaussian mixture (class means ~ N(0, {r['data']['mean_std']}² I)),
{r['rounds']} rounds of K local steps (lr {r['fedavg']['lr']}, batch {r['fedavg']['batch_size']}) with τ edge
aggregations per round, delta = {r['privacy']['delta']:g}. A share p of the cells is trusted (drawn per seed);
devices under untrusted cells add noise to every upload, trusted cells once per round towards
the cloud. Uploads are clipped to C. *paper*: the paper's closed form (eq. 11, alpha = 1, q =
16/200); *rdp*: noise multipliers solved with Google's dp-accounting for the real release
counts. Accuracy: final test accuracy, mean ± std over seeds {', '.join(map(str, seeds))}.
The last column is the largest per-device epsilon the coordinator's RDP ledger reports.

### Accuracy against the share of trusted edges

{md_table(["calibration", "ε (target)", "schedule", "non-DP", *ps_desc.split(" / "),
           "σ device / σ edge", "ledger ε (RDP)"], rows)}

### Network size (p = {net['p_trusted']:g}, {net['study']} calibration, ε = {net_eps:g})

{md_table(["", "cells", "devices per cell", "devices", "accuracy"], net_rows)}

{md_table(["acceptance check", "measured", "result"], checks)}

![accuracy against trusted share and network size](img/m2fdp.png)

What the numbers say. Trusting edges buys utility because a trusted cell's noise is divided by
its size s (Lemma 1) and added once per round, while devices under untrusted cells each add
the full noise at every edge aggregation. Under the paper's calibration the ordering of the
paper holds, and fewer, larger trusted cells beat more, smaller ones (trusted-edge noise
variance falls as 1/s²). The paper's closed form is not a guarantee: the RDP ledger reports a
far larger epsilon for the same noise (last column; it charges a trusted cell's release against the
sound sensitivity 2C(1/s + τ − 1), not Lemma 1's 2C/s). Under the sound RDP calibration the
ordering holds when trusted cells do not sync inside a round (τ = 1); with the paper's
intra-round sync (*rdp-synced*, τ = 2) a trusted cell's sensitivity grows to 2C(1/s + τ − 1) —
after a sync every member's update depends on the changed record — and trusting edges no longer
pays: the price of syncing inside a trusted subtree that the paper's Lemma 1 leaves out.
"""


if __name__ == "__main__":
    main()

"""Robust aggregation at the edge against attacking devices, server optimizers, and FedProx.

Runs every job of ``experiments/robust.toml`` in fedtier's simulator (digits, 10 cells x 10
devices, devices training with onnxruntime):

1. every edge rule (``fedtier.algorithms.strategies``) under every attack
   (``device_agent.attack``) at 0, 10, 20 and 30 % attacking devices, on a non-iid split:
   final central test accuracy and rounds to the target;
2. the server optimizers (``fedtier.algorithms.server_opt``) on the skewed split;
3. FedProx (``proximal_mu``) on the skewed split with partial work, when this build has it.

Writes its section of docs/experiments.md (tables and a PNG). Finished runs are cached in
``runs/robust/cache.json`` (keyed by their whole config), so a rerun only runs what changed.

Usage: ``python experiments/robust.py [--config experiments/robust.toml] [--workers 2]``
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import IMG, arguments, md_table, print_table, progress, write_section  # noqa: E402

CACHE = HERE.parent / "runs" / "robust" / "cache.json"
PROX_MUS = (0.0, 0.01, 0.1)


def base(spec: dict[str, Any], split: str, seed: int, name: str) -> dict[str, Any]:
    from local_fleet.demo import default_artifact_store

    m = copy.deepcopy(spec["rollout"])
    m.update(seed=seed, artifact_store=str(default_artifact_store()))
    m["rollout"] = f"{m['rollout']}-{name}-{split}-{seed}"
    m["data"] = {**m["data"], **spec["splits"][split], "seed": seed}
    m["model"] = {**m["model"], "init_seed": seed}
    return m


def has_fedprox() -> bool:
    from fedtier.rollout.config import FedAvgSection

    return "proximal_mu" in FedAvgSection.__dataclass_fields__


def jobs(spec: dict[str, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """(part, ...) -> rollout mapping, for every run."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for seed in spec["seeds"]:
        for rule in spec["rules"]:
            for attack in spec["attacks"]:
                for fraction in spec["fractions"]:
                    if fraction == 0 and attack != spec["attacks"][0]:
                        continue  # one attack-free run per rule and seed
                    m = base(spec, "non-iid", seed, f"{rule}-{attack}-{fraction}")
                    m["aggregation"] = {"edge": rule, **spec["aggregation"]}
                    if fraction > 0:
                        m["attack"] = {"kind": attack, "fraction": fraction}
                    out[("robust", rule, attack if fraction > 0 else "none", fraction, seed)] = m
        for name, opt in spec["optimizers"].items():
            m = base(spec, "skewed", seed, f"opt-{name}")
            m["server_optimizer"] = dict(opt)
            out[("optimizer", name, seed)] = m
        if has_fedprox():
            for mu in PROX_MUS:
                m = base(spec, "skewed", seed, f"prox-{mu}")
                m["fedavg"] = {**m["fedavg"], "proximal_mu": mu, "partial_work": True}
                out[("fedprox", mu, seed)] = m
    return out


def all_mappings(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run's rollout config (``tests/unit/test_docs.py`` loads them all)."""
    return list(jobs(spec).values())


def run_one(job: tuple[dict[str, Any], str]) -> dict[str, Any]:
    import logging

    from fedtier.rollout.config import RolloutConfig
    from local_fleet.simulate import simulate

    logging.getLogger("fedtier").setLevel(logging.ERROR)  # attack runs warn by design
    mapping, base_dir = job
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RolloutConfig.from_mapping({**mapping, "metrics_file": str(Path(tmp) / "m.json")},
                                         base_dir=Path(base_dir))
        t0 = time.perf_counter()
        result = simulate(cfg)
    return {"accuracy": [r["accuracy"] for r in result.rounds], "wall_s": time.perf_counter() - t0}


def attackers_per_cell(spec: dict[str, Any], seed: int, fraction: float) -> str:
    """How the attackers of ``seed`` fall into cells: the per-cell counts, sorted, as ``"4 3 2 ... 0"``."""
    from fedtier.rollout.config import RolloutConfig

    m = base(spec, "non-iid", seed, "count")
    m["attack"] = {"kind": "sign_flip", "fraction": fraction}
    cfg = RolloutConfig.from_mapping(m, base_dir=HERE)
    chosen = set(cfg.attackers())
    counts = sorted((len(chosen & set(members)) for members in cfg.topology.layout().values()), reverse=True)
    return " ".join(map(str, counts))


def rounds_to(run: dict[str, Any], target: float) -> int | None:
    """1-based count of rounds until the accuracy first reaches ``target`` (``None``: never)."""
    return next((i + 1 for i, a in enumerate(run["accuracy"]) if a >= target), None)


def main() -> None:
    args = arguments(__doc__.splitlines()[0], HERE / "robust.toml")
    spec = tomllib.loads(args.config.read_text())
    todo = jobs(spec)
    cache: dict[str, Any] = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    keys = {k: json.dumps(m, sort_keys=True) for k, m in todo.items()}
    missing = [k for k in todo if keys[k] not in cache]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        outs = pool.map(run_one, [(todo[k], str(HERE)) for k in missing])
        with progress(len(missing)) as bar:
            for done, (key, out) in enumerate(zip(missing, outs, strict=True), 1):
                cache[keys[key]] = out
                CACHE.parent.mkdir(parents=True, exist_ok=True)
                CACHE.write_text(json.dumps(cache))
                bar.line(f"{key}: final acc {out['accuracy'][-1]:.4f} ({out['wall_s']:.0f}s)")
                bar.update(done, accuracy=out["accuracy"][-1])
    results = {k: cache[keys[k]] for k in todo}
    write(spec, results, time.perf_counter() - t0, len(missing))


def _mean(values: list[float]) -> float:
    return float(statistics.fmean(values))


def _rounds(values: list[int | None]) -> str:
    """Median rounds to target over seeds, unreached counted as never ("–" if the median never reaches)."""
    ordered = sorted(values, key=lambda v: float("inf") if v is None else v)
    med = ordered[len(ordered) // 2]
    return "–" if med is None else str(med)


class _Seeds:
    """One key's runs summarised over the seeds: mean final accuracy, median rounds to the target."""

    def __init__(self, results: dict[tuple[Any, ...], dict[str, Any]], seeds: list[int], target: float) -> None:
        self.results, self.seeds, self.target = results, seeds, target

    def final(self, key: tuple[Any, ...]) -> float:
        return _mean([self.results[(*key, s)]["accuracy"][-1] for s in self.seeds])

    def reach(self, key: tuple[Any, ...]) -> str:
        return _rounds([rounds_to(self.results[(*key, s)], self.target) for s in self.seeds])

    def cell(self, key: tuple[Any, ...]) -> str:
        """``accuracy (rounds to target)``, as the robustness table shows a run."""
        return f"{self.final(key):.3f} ({self.reach(key)})"


def write(spec: dict[str, Any], results: dict[tuple[Any, ...], dict[str, Any]], wall: float, ran: int) -> None:
    """This experiment's section of docs/experiments.md (tables and a PNG), and the 20 % sign_flip table on
    stdout."""
    seeds, rules = spec["seeds"], spec["rules"]
    runs = _Seeds(results, seeds, spec["target"])
    table = _robustness_table(spec, runs)
    checks = _sign_flip_checks(rules, runs)
    print_table("20 % sign_flip (mean accuracy over seeds)",
                ["rule", "clean", "attacked", "vs own", "vs mean clean", "verdict"],
                [[c[0].strip("`"), *c[1:]] for c in checks])
    png = _plot(spec, runs)
    body = _body(spec, results, runs, table=table, checks=checks, png=png, wall=wall, ran=ran)
    print(f"wrote {write_section('robust', body)}")


def _robustness_table(spec: dict[str, Any], runs: _Seeds) -> str:
    """One row per (attack, fraction), a column per rule: "accuracy (rounds to target)"."""
    rules = spec["rules"]
    rows = [["none", "0 %", *[runs.cell(("robust", r, "none", 0.0)) for r in rules]]]
    for attack in spec["attacks"]:
        for fraction in [f for f in spec["fractions"] if f > 0]:
            rows.append([attack, f"{fraction:.0%}".replace("%", " %"),
                         *[runs.cell(("robust", r, attack, fraction)) for r in rules]])
    return md_table(["attack", "attackers", *[f"`{r}`" for r in rules]], rows)


def _sign_flip_checks(rules: list[str], runs: _Seeds) -> list[list[str]]:
    """Acceptance: 20 % sign_flip against the attack-free accuracy (the rule's own, and mean's)."""
    clean_mean = runs.final(("robust", "mean", "none", 0.0))
    checks = []
    for r in rules:
        clean, hit = runs.final(("robust", r, "none", 0.0)), runs.final(("robust", r, "sign_flip", 0.2))
        if r == "mean":
            verdict = "falls >= 30 points" if clean - hit >= 0.30 else "does NOT fall 30 points"
        else:
            verdict = ("within 5 points" if clean_mean - hit <= 0.05 else "NOT within 5 points of mean's clean run")
        checks.append([f"`{r}`", f"{clean:.3f}", f"{hit:.3f}", f"{hit - clean:+.3f}", f"{hit - clean_mean:+.3f}",
                       verdict])
    return checks


def _sign_flip_verdict(rules: list[str], runs: _Seeds, checks: list[list[str]]) -> str:
    """How far `mean` falls, and which rules stay within 5 points of its attack-free accuracy."""
    clean_mean = runs.final(("robust", "mean", "none", 0.0))
    within = [c[0] for c, r in zip(checks, rules, strict=True) if r != "mean" and "within 5" in c[5]
              and "NOT" not in c[5]]
    outside = [f"{c[0]} ({c[4]})" for c, r in zip(checks, rules, strict=True) if r != "mean" and "NOT" in c[5]]
    mean_drop = clean_mean - runs.final(("robust", "mean", "sign_flip", 0.2))
    return (f"At 20 % sign_flip, `mean` falls {100 * mean_drop:.1f} points. Within 5 points of the attack-free "
            f"`mean` ({clean_mean:.3f}): {', '.join(within) or 'none'}; not: {', '.join(outside) or 'none'}.")


def _plot(spec: dict[str, Any], runs: _Seeds) -> Path:
    """PNG: accuracy against the attacking share, one panel per attack, a line per rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules, rounds = spec["rules"], spec["rollout"]["rounds"]
    IMG.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(spec["attacks"]), figsize=(4 * len(spec["attacks"]), 3.4), sharey=True)
    for ax, attack in zip(axes, spec["attacks"], strict=True):
        for r in rules:
            ys = [runs.final(("robust", r, "none" if f == 0 else attack, f)) for f in spec["fractions"]]
            ax.plot([100 * f for f in spec["fractions"]], ys, marker="o", label=r)
        ax.set_title(attack)
        ax.set_xlabel("attacking devices (%)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"test accuracy after {rounds} rounds")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    png = IMG / "robust_attacks.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _optimizer_table(spec: dict[str, Any], runs: _Seeds) -> str:
    opt_rows = []
    for name, opt in spec["optimizers"].items():
        lr = opt.get("lr")
        opt_rows.append([f"`{name}`", "default" if lr is None else f"{lr:g}", f"{runs.final(('optimizer', name)):.3f}",
                         runs.reach(("optimizer", name))])
    return md_table(["server optimizer", "server lr", "final accuracy", f"rounds to {runs.target:.2f}"], opt_rows)


def _fedprox_table(results: dict[tuple[Any, ...], dict[str, Any]], runs: _Seeds) -> str:
    """FedProx's runs, or why there are none (a build without ``proximal_mu``)."""
    if has_fedprox() and all(("fedprox", mu, s) in results for mu in PROX_MUS for s in runs.seeds):
        return md_table(["proximal_mu", "final accuracy", f"rounds to {runs.target:.2f}"],
                        [[f"{mu:g}", f"{runs.final(('fedprox', mu)):.3f}", runs.reach(("fedprox", mu))]
                         for mu in PROX_MUS])
    return "FedProx (`proximal_mu`) is not in this build; no runs."


def _body(spec: dict[str, Any], results: dict[tuple[Any, ...], dict[str, Any]], runs: _Seeds, *, table: str,
          checks: list[list[str]], png: Path, wall: float, ran: int) -> str:
    """The section's markdown: setup, the three studies' tables, the verdict and how long it took."""
    seeds, rules, target = spec["seeds"], spec["rules"], spec["target"]
    rounds = spec["rollout"]["rounds"]
    check_table = md_table(["edge rule", "no attack", "20 % sign_flip", "vs its own clean run",
                            "vs mean's clean run", "verdict"], checks)
    verdict = _sign_flip_verdict(rules, runs, checks)
    crowding = "; ".join(f"seed {s}: {attackers_per_cell(spec, s, 0.2)}" for s in seeds)
    opt_table = _optimizer_table(spec, runs)
    prox = _fedprox_table(results, runs)
    agg = spec["aggregation"]
    r = spec["rollout"]
    return f"""## Robust aggregation at the edge, server optimizers, FedProx

`python experiments/robust.py` (config `experiments/robust.toml`): digits, {r['topology']['cells']} cells x
{r['topology']['devices_per_cell']} devices, MLP 64-{r['model']['hidden'][0]}-10, hierarchical FedAvg
({r['fedavg']['local_steps']} local steps of {r['fedavg']['batch_size']}, lr {r['fedavg']['lr']}), {rounds} rounds,
{len(seeds)} seeds (each seed draws the split, the initial model and the attackers). Rules
(`docs/strategies.md`): `trimmed_mean` trim {agg['trim']}, `krum`/`multi_krum` f = {agg['byzantine']}
(m = {agg['select']}), `norm_bounded_mean` max_norm {agg['max_norm']}; the cloud averages. Attackers are a
seeded share of all 100 devices, so a cell may hold more than its share. Cells: mean final central test
accuracy over the seeds (median rounds to reach {target:.2f}; – = the median seed never does).

### Edge rules under attack (non-iid: Dirichlet alpha {spec['splits']['non-iid']['alpha']})

{table}

![accuracy against the attacking share](img/{png.name})

### 20 % sign_flip (each attacker sends -10 x its update)

{check_table}

{verdict}

Attacking devices per cell at 20 % (the attackers are drawn over all devices, not per cell): {crowding}.
A coordinate-wise median breaks in a cell where half its devices attack, a trimmed mean (trim
{agg['trim']}) where more than {int(agg['trim'] * r['topology']['devices_per_cell'])} do, and Krum's
guarantee needs at most f = {agg['byzantine']} per cell.

### Server optimizers (skewed split: {spec['splits']['skewed']['classes_per_device']} label shards per device)

Reddi et al., "Adaptive Federated Optimization", Algorithm 2, at the cloud; mean at both tiers. The adaptive
kinds' server lr was picked from 0.01 and 0.03 on seed 0 (the same lr for all three); momentum uses mu 0.5.

{opt_table}

### FedProx (skewed split, partial work)

{prox}

{len(results)} runs; their simulations took {sum(v['wall_s'] for v in results.values()) / 60:.0f} min in all
(2 in parallel on a shared 2-core machine); this invocation ran {ran} of them in {wall / 60:.1f} min.
"""


if __name__ == "__main__":
    main()

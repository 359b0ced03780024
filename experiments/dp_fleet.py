"""Differential privacy at fleet scale: 10,000 devices, 100 cells, Poisson sampling, trusted share p.

Issue 17 Part B.5. A numpy fast path over the same privacy code a rollout uses (the same study as
rollouts through fedtier's simulator: ``experiments/dp_fleet_rollout.py``, which runs this path beside
it as a cross-check):

* the plan: ``cloud_coordinator.privacy.calibrate.make_plan`` from a real ``RolloutConfig``
  (device sampling, trusted cells, the accountant), so every z and sigma is the rollout's;
* the noise: ``fedtier.privacy.mechanism.NoiseSource.add`` for every release (each sampled device
  under an untrusted edge, each trusted edge every round);
* a trusted edge samples its members in secret and releases the sum of their clipped deltas over
  the fixed denominator ``q n`` plus noise (``NoisePlan.edge_denominator``/``edge_sigma``, as the
  edge role does in rollouts); the cloud samples devices under untrusted edges, at most
  ``device_release_cap`` rounds each (rollouts use ``fedtier.privacy.plan.cloud_sample``);
* the ledger: ``cloud_coordinator.privacy.accountant.Accountant`` charges every release made
  (trusted: a Poisson-sampled Gaussian to every member each round; untrusted: a full-price
  Gaussian to the device each round it was sampled); epsilon is its largest over devices, by RDP
  (what calibrates) and by PLD.

What it does not run: messages, quantization, ONNX training. The model is a linear softmax on a
synthetic 10-class Gaussian mixture; each device holds 20 rows of 2 classes (non-iid).

Usage: ``python experiments/dp_fleet.py [--config experiments/dp_fleet.toml] [--workers 2]``
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import IMG, arguments, md_table, print_table, write_section  # noqa: E402


# --- data and model ---------------------------------------------------------------------------------


def make_data(spec: dict[str, Any], n_devices: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-device rows ``X (n, s, d)``, labels ``Y (n, s)``, and an iid test set."""
    d = spec["data"]
    rng = np.random.default_rng(d["seed"])
    means = rng.normal(0.0, d["mean_std"], size=(d["classes"], d["features"]))
    s, k = d["samples_per_device"], d["classes_per_device"]
    first = rng.integers(0, d["classes"], size=n_devices)
    picks = (first[:, None] + rng.integers(0, k, size=(n_devices, s))) % d["classes"]  # k adjacent classes
    x = means[picks] + rng.normal(size=(n_devices, s, d["features"]))
    yt = rng.integers(0, d["classes"], size=d["test_samples"])
    xt = means[yt] + rng.normal(size=(d["test_samples"], d["features"]))
    return x, picks, xt, yt


def local_deltas(w: np.ndarray, x: np.ndarray, y: np.ndarray, steps: int, lr: float) -> np.ndarray:
    """Each device's model change after ``steps`` full-batch gradient steps (softmax, bias as a column)."""
    m, s, _ = x.shape
    xb = np.concatenate([x, np.ones((m, s, 1))], axis=2)
    wl = np.broadcast_to(w, (m, *w.shape)).copy()
    onehot = np.eye(w.shape[1])[y]
    for _ in range(steps):
        logits = np.einsum("msd,mdk->msk", xb, wl)
        logits -= logits.max(axis=2, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=2, keepdims=True)
        wl -= lr * np.einsum("msd,msk->mdk", xb, p - onehot) / s
    return (wl - w).reshape(m, -1)


def accuracy(w: np.ndarray, xt: np.ndarray, yt: np.ndarray) -> float:
    logits = np.concatenate([xt, np.ones((len(xt), 1))], axis=1) @ w
    return float(np.mean(logits.argmax(axis=1) == yt))


# --- one run ----------------------------------------------------------------------------------------


def trusted_cells(spec: dict[str, Any], p: float, seed: int) -> list[str]:
    from fedtier.rollout.config import TopologyConfig

    names = sorted(TopologyConfig(cells=spec["cells"], devices_per_cell=spec["devices_per_cell"]).layout())
    return [str(c) for c in np.random.default_rng(seed).permutation(names)[: round(p * len(names))]]


def rollout_mapping(spec: dict[str, Any], p: float, eps: float, seed: int, secagg: bool = False) -> dict[str, Any]:
    """The rollout config a private run's plan comes from (which cells are trusted: drawn by seed); ``secagg``:
    secure aggregation in every cell with s_min from ``[secagg]``, so the plan is distributed DP."""
    base = {k: dict(v) if isinstance(v, dict) else v for k, v in spec["rollout"].items()}
    if secagg:
        base["fedavg"] = {**base.get("fedavg", {}), "secure_aggregation": True, "weighting": "uniform",
                          "secagg_min_survivors": spec["secagg"]["min_survivors"]}
    base.update(rounds=spec["rounds"], seed=seed,
                topology={"cells": spec["cells"], "devices_per_cell": spec["devices_per_cell"],
                          "trusted": {c: True for c in trusted_cells(spec, p, seed)}},
                privacy={"epsilon": eps, "delta": spec["delta"], "clip": spec["clip"],
                         "accountant": spec["accountant"], "device_sampling": "poisson",
                         "sample_rate": spec["sample_rate"], "require_tls": False})
    return base


def all_mappings(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every private run's rollout config (tests/unit/test_docs.py loads them all)."""
    plain = [rollout_mapping(spec, p, e, s) for e in spec["epsilons"] for p in spec["p_trusted"] for s in spec["seeds"]]
    return plain + [rollout_mapping(spec, 0.0, e, s, secagg=True) for e in spec["epsilons"] for s in spec["seeds"]]


def plan_for(spec: dict[str, Any], p: float, eps: float, seed: int, secagg: bool = False) -> Any:
    """The rollout's noise plan and cell layout, from a real RolloutConfig."""
    from fedtier.rollout.config import RolloutConfig
    from cloud_coordinator.privacy.calibrate import make_plan

    cfg = RolloutConfig.from_mapping(rollout_mapping(spec, p, eps, seed, secagg))
    return make_plan(cfg, {}), {c: tuple(m) for c, m in cfg.topology.layout().items()}


def run(job: dict[str, Any], data: tuple[np.ndarray, ...] | None = None,
        w0: np.ndarray | None = None) -> dict[str, Any]:
    """One configuration: ``eps`` None is the non-DP baseline (same sampling, no clip, no noise). ``data``
    (``make_data``'s four arrays) and ``w0`` (initial weights, bias as the last row) replace the generated data and
    the zero start: dp_fleet_rollout.py runs this path on a rollout's own data and initial weights."""
    logging.getLogger("absl").setLevel(logging.ERROR)
    from cloud_coordinator.privacy.accountant import Accountant
    from fedtier.privacy.adaptive_clip import GeometricClip
    from fedtier.privacy.mechanism import NoiseSource

    spec, seed, p, eps = job["spec"], job["seed"], job["p"], job["eps"]
    adaptive = job.get("adaptive")
    start = time.perf_counter()
    n_cells, per_cell = spec["cells"], spec["devices_per_cell"]
    x, y, xt, yt = data if data is not None else make_data(spec, n_cells * per_cell)
    plan = layout = None
    secagg = bool(job.get("secagg"))
    if eps is not None:
        plan, layout = plan_for(spec, p, eps, seed, secagg)
    cells = sorted(layout) if layout is not None else [f"c{i}" for i in range(n_cells)]
    fleet = _Fleet(
        spec=spec, plan=plan, cells=cells, x=x, y=y,
        index={c: np.arange(i * per_cell, (i + 1) * per_cell) for i, c in enumerate(cells)},
        names={c: (layout[c] if layout is not None else tuple(f"{c}-{j}" for j in range(per_cell))) for c in cells},
        rng=np.random.default_rng(1000 + seed),  # sampling; trusted edges draw theirs from the same (secret) stream
        noise=NoiseSource(seed=seed),  # simulation: reproducible noise
        ledger=Accountant(spec["delta"], accounting=spec["accountant"]),
        released=np.zeros(n_cells * per_cell, dtype=int),  # releases per device under untrusted edges (the cap)
        adaptive=adaptive,
        clip_state=GeometricClip(clip=adaptive["start_clip"], target_quantile=adaptive["target_quantile"],
                                 learning_rate=adaptive["learning_rate"]) if adaptive else None)
    w = w0.copy() if w0 is not None else np.zeros((spec["data"]["features"] + 1, spec["data"]["classes"]))
    clips, accs = [], []
    for rnd in range(spec["rounds"]):
        clip = fleet.clip_state.clip if fleet.clip_state is not None else spec["clip"]
        clips.append(clip)
        w = fleet.round(w, rnd, clip)
        accs.append(accuracy(w, xt, yt))
    out = {"seed": seed, "p": p, "eps": eps, "accuracy": accs[-1], "curve": accs, "clips": clips,
           "seconds": time.perf_counter() - start, "adaptive": bool(adaptive), "secagg": secagg}
    if plan is not None:
        out.update(fleet.ledger_summary())
    return out


@dataclass
class _Fleet:
    """One run's fleet: its data, plan (``None``: non-DP), sampling and noise streams, and the ledger. Its
    steps draw from ``rng`` and ``noise`` in a fixed order (cells sorted, devices in index order), so a run
    is reproducible from its seed."""

    spec: dict[str, Any]
    plan: Any
    cells: list[str]
    x: np.ndarray
    y: np.ndarray
    index: dict[str, np.ndarray]
    names: dict[str, tuple[str, ...]]
    rng: np.random.Generator
    noise: Any
    ledger: Any
    released: np.ndarray
    adaptive: dict[str, Any] | None
    clip_state: Any

    def round(self, w: np.ndarray, rnd: int, clip: float) -> np.ndarray:
        """The model after round ``rnd``: every cell's update, averaged by weight; the adaptive clip moves on
        the cells' noised counts."""
        updates, weights = [], []
        count_total = 0.0
        for c in self.cells:
            update, weight, count = self.cell_update(c, w, rnd, clip)
            if count is not None:
                count_total += count
            if update is not None:
                updates.append(update)
                weights.append(weight)
        if updates:
            agg = np.average(np.stack(updates), axis=0, weights=np.asarray(weights, dtype=float))
            w = w + self.spec["train"]["server_lr"] * agg.reshape(w.shape)
        if self.clip_state is not None:
            self.clip_state.update(count_total, self.spec["sample_rate"] * len(self.released))
        return w

    def cell_update(self, c: str, w: np.ndarray, rnd: int,
                    clip: float) -> tuple[np.ndarray | None, int, float | None]:
        """(update, weight, noised count) of cell ``c``: its sampled devices train; the update is their mean
        (non-DP), or the release its plan says (distributed, trusted or untrusted). ``None``: nothing to add."""
        plan, idx, per_cell, t = self.plan, self.index[c], self.spec["devices_per_cell"], self.spec["train"]
        distributed = plan is not None and plan.cells[c].distributed
        trusted = plan is not None and plan.cells[c].trusted and not distributed
        chosen = self.rng.random(per_cell) < self.spec["sample_rate"]  # distributed DP: each device's own draw
        if plan is not None and not trusted and not distributed:  # the cloud samples, within the release cap
            chosen &= self.released[idx] < plan.device_release_cap
        sel = idx[chosen]
        deltas = local_deltas(w, self.x[sel], self.y[sel], t["local_steps"], t["lr"]) if len(sel) else \
            np.zeros((0, w.size))
        if plan is None:  # non-DP: the cell's mean over its sampled devices
            return (deltas.mean(axis=0), len(sel), None) if len(sel) else (None, 0, None)
        norms = np.linalg.norm(deltas, axis=1)
        clipped = deltas * np.minimum(1.0, clip / np.maximum(norms, 1e-12))[:, None]
        if distributed:
            return self.distributed_release(c, clipped, rnd), per_cell, None
        if trusted:
            return self.trusted_release(c, clipped, norms, rnd, clip)
        return self.untrusted_release(c, clipped, sel, rnd), per_cell, None

    def distributed_release(self, c: str, clipped: np.ndarray, rnd: int) -> np.ndarray:
        """Secure aggregation: every member (no dropouts here) adds its share sigma_d of the cell's noise,
        the sampled ones their clipped delta too; the edge unmasks the sum only and divides by q n.
        The n shares N(0, sigma_d^2) sum to N(0, n sigma_d^2): drawn at once (the same distribution)."""
        plan, per_cell = self.plan, self.spec["devices_per_cell"]
        shares = self.noise.add({"d": np.zeros(clipped.shape[1])}, plan.device_sigma(c) * math.sqrt(per_cell), "dp",
                                c, "shares", rnd)["d"]
        total = clipped.sum(axis=0) + shares
        self.ledger.add(self.names[c], plan.distributed_release(c, per_cell, per_cell)[2], 1,
                        sampling_rate=self.spec["sample_rate"])
        return total / plan.release_denominator(c, per_cell)

    def trusted_release(self, c: str, clipped: np.ndarray, norms: np.ndarray, rnd: int,
                        clip: float) -> tuple[np.ndarray, int, float | None]:
        """A trusted edge's fixed-denominator release; with adaptive clipping, its noised count too."""
        from fedtier.privacy.adaptive_clip import noised_centred_count, unclipped_bits, update_multiplier

        plan = self.plan
        sigma = plan.edge_sigma(c) * clip / plan.clip  # sigma scales with the round's C
        z_charged = plan.edge_charged_z(c)
        count = None
        if self.clip_state is not None:  # the count's noise takes a share of z: the update gets more
            sb = self.adaptive["count_stddev_per_cell"]  # type: ignore[index]
            sigma = sigma * update_multiplier(plan.cells[c].edge_z, sb) / plan.cells[c].edge_z
            count = noised_centred_count(unclipped_bits(norms, clip), sb, self.noise.generator("count", c, rnd))
        release = self.noise.add({"d": clipped.sum(axis=0) / plan.edge_denominator(c)}, sigma, "dp", c, rnd)
        self.ledger.add(self.names[c], z_charged, 1, sampling_rate=self.spec["sample_rate"])
        return release["d"].astype(np.float64), self.spec["devices_per_cell"], count

    def untrusted_release(self, c: str, clipped: np.ndarray, sel: np.ndarray, rnd: int) -> np.ndarray | None:
        """Devices under an untrusted edge: each sampled one noises its own update at full price; the edge
        forwards their mean (``None`` when none was sampled)."""
        plan, idx = self.plan, self.index[c]
        sigma = plan.device_sigma(c)
        noised = [self.noise.add({"d": clipped[i]}, sigma, "dp", int(sel[i]), rnd)["d"] for i in range(len(sel))]
        self.released[sel] += 1
        for i in sel:
            self.ledger.add([self.names[c][int(i) - idx[0]]], plan.cells[c].device_z, 1)
        return np.mean(noised, axis=0, dtype=np.float64) if noised else None

    def ledger_summary(self) -> dict[str, Any]:
        """The largest epsilon over devices from the releases made, by RDP and (the same releases) by PLD, and
        the plan's multipliers and cap."""
        from cloud_coordinator.privacy.accountant import Accountant

        plan, ledger = self.plan, self.ledger
        for c in self.cells:  # every device is listed, sampled or not
            ledger.add(self.names[c], 0.0, 0)
        eps_rdp = max(ledger.epsilons().values())
        pld = Accountant(self.spec["delta"], accounting="pld")
        for device in (d for c in self.cells for d in self.names[c]):
            for rel in ledger.releases(device):
                pld.add([device], rel[0], rel[1], sampling_rate=rel[2] if len(rel) > 2 else 1.0)
        return {"epsilon": eps_rdp, "epsilon_pld": max(pld.epsilons().values()),
                "device_z": max((cp.device_z for cp in plan.cells.values()), default=0.0),
                "edge_z": max((cp.edge_z for cp in plan.cells.values()), default=0.0),
                "cap": plan.device_release_cap}


CACHE = HERE.parent / "runs" / "dp_fleet"


def run_cached(job: dict[str, Any]) -> dict[str, Any]:
    """``run``, its result kept as JSON under runs/dp_fleet/ keyed by the job (a failed later run keeps the
    finished ones; delete the folder to start over)."""
    import hashlib
    import json

    key = hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = CACHE / f"{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    out = run(job)
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def main() -> None:
    args = arguments(__doc__.splitlines()[0], HERE / "dp_fleet.toml")
    spec = tomllib.loads(args.config.read_text())
    jobs = [{"spec": spec, "seed": s, "p": None, "eps": None} for s in spec["seeds"]]
    jobs += [{"spec": spec, "seed": s, "p": p, "eps": e} for e in spec["epsilons"] for p in spec["p_trusted"]
             for s in spec["seeds"]]
    a = spec["adaptive"]
    jobs += [{"spec": spec, "seed": s, "p": a["p_trusted"], "eps": a["epsilon"], "adaptive": a} for s in spec["seeds"]]
    jobs += [{"spec": spec, "seed": s, "p": 0.0, "eps": e, "secagg": True} for e in spec["epsilons"]
             for s in spec["seeds"]]
    start = time.perf_counter()
    results = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for r in pool.map(run_cached, jobs):
            tag = ("non-DP" if r["eps"] is None
                   else f"p={r['p']} eps={r['eps']}" + (" adaptive" if r["adaptive"] else "")
                   + (" secure aggregation" if r.get("secagg") else ""))
            print(f"{tag} seed {r['seed']}: accuracy {r['accuracy']:.3f}"
                  + (f", ledger epsilon {r['epsilon']:.3f} (PLD {r['epsilon_pld']:.3f})" if r["eps"] else "")
                  + f" [{r['seconds']:.0f} s]", flush=True)
            results.append(r)
    write(spec, results, time.perf_counter() - start)


def _ms(values: list[float]) -> str:
    m = statistics.mean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{m:.3f} ± {s:.3f}"


def write(spec: dict[str, Any], results: list[dict[str, Any]], wall: float) -> None:
    """This experiment's section of docs/experiments.md, its plot, and the acceptance table on stdout."""
    base = [r["accuracy"] for r in results if r["eps"] is None]
    fixed = [r for r in results if r["eps"] is not None and not r["adaptive"] and not r.get("secagg")]
    dist = [r for r in results if r.get("secagg")]
    rows, checks = _accuracy_rows(spec, base, fixed)
    ad = [r for r in results if r["adaptive"]]
    header = ["p (trusted share)", "epsilon target", "accuracy (3 seeds)", "accuracy points below non-DP",
              "ledger epsilon (RDP, max)", "same releases, PLD", "edge z", "device z"]
    body = [
        *_intro_lines(spec, results, fixed),
        "",
        f"Non-DP (same sampling, no clip, no noise): accuracy {_ms(base)}.",
        "",
        md_table(header, rows),
        "",
        "Acceptance (p = 1 within 3 accuracy points of non-DP at epsilon <= 8): "
        + "; ".join(f"epsilon {e:g}: {100 * g:.1f} points below — {'met' if g <= 0.03 else 'NOT met'}"
                    for e, g in checks) + ".",
        "",
        "p = 0 (every device adds its own noise, local DP) is reported beside it: with about "
        f"{int(spec['sample_rate'] * spec['devices_per_cell'])} sampled devices per cell and no amplification, "
        "the noise on the fleet's mean is far larger than with trusted edges at the same epsilon.",
        "",
        *distributed_lines(spec, base, fixed, dist),
        "",
        *_adaptive_lines(spec, fixed, ad),
        "",
        "![dp fleet](img/dp_fleet.png)",
    ]
    _plot(spec, base, fixed, dist, ad)
    write_section("dp_fleet", "\n".join(body))
    print_table("dp_fleet acceptance", ["epsilon", "points below non-DP (p = 1)", "met"],
                [[f"{e:g}", f"{100 * g:.1f}", "yes" if g <= 0.03 else "no"] for e, g in checks])


def _accuracy_rows(spec: dict[str, Any], base: list[float],
                   fixed: list[dict[str, Any]]) -> tuple[list[list[str]], list[tuple[float, float]]]:
    """The main table's rows (one per trusted share and epsilon) and, for p = 1, each epsilon's accuracy gap
    to non-DP (the acceptance check)."""
    rows, checks = [], []
    for p in spec["p_trusted"]:
        for e in spec["epsilons"]:
            rs = [r for r in fixed if r["p"] == p and r["eps"] == e]
            acc = [r["accuracy"] for r in rs]
            gap = statistics.mean(base) - statistics.mean(acc)
            rows.append([f"{p:g}", f"{e:g}", _ms(acc), f"{100 * gap:.1f}", f"{max(r['epsilon'] for r in rs):.3f}",
                         f"{max(r['epsilon_pld'] for r in rs):.3f}",
                         f"{rs[0]['edge_z']:.3f}" if p > 0 else "-", f"{rs[0]['device_z']:.2f}" if p < 1 else "-"])
            if p == 1.0:
                checks.append((e, gap))
    return rows, checks


def _intro_lines(spec: dict[str, Any], results: list[dict[str, Any]], fixed: list[dict[str, Any]]) -> list[str]:
    """The section's title, how it was run, the setup, and what is and is not fedtier's own code."""
    return [
        "## Differential privacy at fleet scale: sampling, trusted edges, single-digit epsilon",
        "",
        f"`python experiments/dp_fleet.py` ({args_line(spec)}; {len(results)} runs of "
        f"{statistics.median(r['seconds'] for r in results):.0f} s each (median), two at a time on the shared 2-core "
        "machine; results are kept in runs/dp_fleet/, so a rerun only writes this section). "
        "Issue 17 Part B: does device sampling with trusted edges reach useful accuracy "
        "at single-digit epsilon on a large fleet?",
        "",
        f"Setup: {spec['cells'] * spec['devices_per_cell']:,} devices in {spec['cells']} cells of "
        f"{spec['devices_per_cell']}, a linear softmax on a synthetic 10-class Gaussian mixture "
        f"({spec['data']['features']} features), {spec['data']['samples_per_device']} rows of "
        f"{spec['data']['classes_per_device']} classes per device (non-iid), {spec['rounds']} rounds, Poisson "
        f"device sampling q = {spec['sample_rate']} "
        f"(about {int(spec['sample_rate'] * spec['cells'] * spec['devices_per_cell'])} "
        f"devices a round), clip C = {spec['clip']}, delta = {spec['delta']:g}, {spec['accountant'].upper()} "
        f"calibration; {len(spec['seeds'])} seeds (data fixed; sampling, noise and which cells are trusted vary). "
        "A trusted edge samples its members in secret and releases their clipped sum over the fixed "
        "denominator q·n plus noise, charged as a Poisson-sampled Gaussian; a device under an untrusted edge "
        "noises its own update at full price (no amplification: the cloud and its edge see it release) and is "
        f"sampled at most {fixed[0]['cap']} rounds, the count its noise is calibrated for. The ledger column is "
        "the largest epsilon over all devices from the releases actually made (`Accountant`), by RDP and, for "
        "the same releases, by PLD.",
        "",
        "This is a **numpy fast path**, not a rollout (the same study run by fedtier's simulator, at 1,000 and "
        "10,000 devices, is the next section): devices train in vectorized batches (5 full-batch steps, lr 0.5), "
        "but the plan (`make_plan` from a real `RolloutConfig`), every noise draw (`NoiseSource.add`), the "
        "fixed-denominator release (`NoisePlan.edge_denominator`, `edge_sigma`) and the accountant are the "
        "rollout's code; rollouts run the same sampling in the roles (docs/privacy.md).",
    ]


def _adaptive_lines(spec: dict[str, Any], fixed: list[dict[str, Any]], ad: list[dict[str, Any]]) -> list[str]:
    """Adaptive clipping beside the same runs with the hand-picked C, and where C ended."""
    x, y, _, _ = make_data(spec, 1000)
    w0 = np.zeros((spec["data"]["features"] + 1, spec["data"]["classes"]))
    first_norm = float(np.median(np.linalg.norm(
        local_deltas(w0, x, y, spec["train"]["local_steps"], spec["train"]["lr"]), axis=1)))
    a = spec["adaptive"]
    same = [r for r in fixed if r["p"] == a["p_trusted"] and r["eps"] == a["epsilon"]]
    return [
        f"Adaptive clipping (p = {a['p_trusted']:g}, epsilon {a['epsilon']:g}, C starting at {a['start_clip']} — "
        f"{spec['clip'] / a['start_clip']:.0f}x below the hand-picked C — target quantile "
        f"{a['target_quantile']}, its noised clipped count (std {a['count_stddev_per_cell']} per cell) paid "
        f"from the same z): accuracy {_ms([r['accuracy'] for r in ad])} against {_ms([r['accuracy'] for r in same])} "
        f"with C = {spec['clip']} fixed; C ended at "
        f"{', '.join(format(r['clips'][-1], '.3f') for r in ad)} (median of the first-round update norms: "
        f"{first_norm:.2f}); ledger epsilon {max(r['epsilon'] for r in ad):.3f}. The geometric step moves C by at "
        f"most a factor e^({a['learning_rate']:g} x 0.5) a round, so from {spec['clip'] / a['start_clip']:.0f}x below "
        "the hand-picked C it had not settled by the last round (right panel); the linear model learned all the same, "
        "because clipping shrinks an update without turning it and the noise shrinks with C.",
    ]


def _plot(spec: dict[str, Any], base: list[float], fixed: list[dict[str, Any]], dist: list[dict[str, Any]],
          ad: list[dict[str, Any]]) -> None:
    """docs/img/dp_fleet.png: accuracy against epsilon per trusted share, and the adaptive clip per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for p in spec["p_trusted"]:
        means = [statistics.mean(r["accuracy"] for r in fixed if r["p"] == p and r["eps"] == e)
                 for e in spec["epsilons"]]
        axes[0].plot(spec["epsilons"], means, marker="o", label=f"p = {p:g}")
    if dist:
        axes[0].plot(spec["epsilons"], [statistics.mean(r["accuracy"] for r in dist if r["eps"] == e)
                                        for e in spec["epsilons"]], marker="s", ls="--",
                     label="p = 0, secure aggregation (distributed DP)")
    axes[0].axhline(statistics.mean(base), color="k", ls="--", label="non-DP")
    axes[0].axhline(statistics.mean(base) - 0.03, color="grey", ls=":", label="non-DP - 3 points")
    axes[0].set_xlabel("epsilon (target; ledger within it)")
    axes[0].set_ylabel("test accuracy (mean of seeds)")
    axes[0].set_title(f"{spec['cells'] * spec['devices_per_cell']:,} devices, q = {spec['sample_rate']}")
    axes[0].legend()
    for r in ad:
        axes[1].plot(r["clips"], label=f"adaptive C, seed {r['seed']}")
    axes[1].axhline(spec["clip"], color="k", ls="--", label="hand-picked C")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("round")
    axes[1].set_ylabel("clip bound C")
    axes[1].set_title("adaptive clipping (geometric quantile)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMG / "dp_fleet.png", dpi=110)


def distributed_lines(spec: dict[str, Any], base: list[float], fixed: list[dict[str, Any]],
                      dist: list[dict[str, Any]]) -> list[str]:
    """Issue 18: untrusted edges with secure aggregation (distributed DP) beside trusted edges and local DP."""
    if not dist:
        return []
    s_min = spec["secagg"]["min_survivors"]
    rows, verdicts = [], []
    for e in spec["epsilons"]:
        acc = [r["accuracy"] for r in dist if r["eps"] == e]
        trusted = [r["accuracy"] for r in fixed if r["p"] == 1.0 and r["eps"] == e]
        local = [r["accuracy"] for r in fixed if r["p"] == 0.0 and r["eps"] == e]
        gap = statistics.mean(trusted) - statistics.mean(acc)
        rows.append([f"{e:g}", _ms(acc), _ms(trusted), _ms(local), f"{100 * gap:.1f}",
                     f"{max(r['epsilon'] for r in dist if r['eps'] == e):.3f}",
                     f"{statistics.mean(r['device_z'] for r in dist if r['eps'] == e):.3f}"])
        verdicts.append(f"epsilon {e:g}: {100 * gap:.1f} points below trusted — "
                        f"{'met' if gap <= 0.01 else 'NOT met'}")
    return [
        "### Untrusted edges with secure aggregation: distributed DP",
        "",
        f"Every cell untrusted (p = 0) but running SecAgg+ with s_min = {s_min} of {spec['devices_per_cell']} "
        "(issue 18): each device decides in secret whether it is sampled, every member takes part in the protocol "
        f"and adds N(0, sigma_sum^2 / {s_min}) — the sampled ones to their clipped delta, the others to zeros — and "
        "the edge, which can unmask only the cell's sum, divides it by q·n. The release is a trusted edge's, "
        f"with sqrt(n / s_min) = {math.sqrt(spec['devices_per_cell'] / s_min):.3f} times its noise when all n "
        "survive (the plan covers any accepted sum); the ledger charges it as a Poisson-sampled Gaussian "
        "(`plan.distributed_release`). Same data, seeds, sampling rate and accountant as the table above; the "
        "masking itself is exact (tests/unit/fedtier/algorithms/test_secure_fedavg.py) and is not rerun here.",
        "",
        md_table(["epsilon target", "distributed DP (3 seeds)", "trusted edges, p = 1", "local DP, p = 0",
                  "points below trusted", "ledger epsilon (RDP, max)", "device z (its share)"], rows),
        "",
        "Acceptance (within 1 accuracy point of trusted edges, far above local DP): " + "; ".join(verdicts) + ".",
    ]


def args_line(spec: dict[str, Any]) -> str:
    return f"{len(spec['seeds'])} seeds × p ∈ {{{', '.join(f'{p:g}' for p in spec['p_trusted'])}}} × epsilon ∈ " \
           f"{{{', '.join(f'{e:g}' for e in spec['epsilons'])}}} + non-DP + adaptive clipping + secure " \
           "aggregation (distributed DP)"


if __name__ == "__main__":
    main()

"""A rollout's noise plan as an operator reads it, before the rollout runs: per tier and per node of
the aggregation tree, who adds noise, how much, and how many rounds the budget admits.

``plan_document`` computes it as plain data (``fedtier privacy plan --json`` prints it, the demo
prints it before its fleet starts); ``render_plan`` formats it as text.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

from fedtier import algorithms
from fedtier.errors import ConfigError

DEVICE_TIER = "devices under untrusted cells"
EDGE_TIER = "trusted servers, towards an untrusted parent"


def federated_data(cfg: Any) -> Any:
    """The rollout's data split, as the coordinator makes it (no torch needed)."""
    from fleet_data.datasets import make_federated

    cells = cfg.topology.layout()
    return make_federated(cfg.data, [d for members in cells.values() for d in members], cells)


def device_samples(cfg: Any, data: Any = None) -> dict[str, int]:
    """Each device's training-sample count, as the coordinator computes it (no torch needed)."""
    data = data if data is not None else federated_data(cfg)
    return {d: len(y) for d, (_, y) in data.train.items()}


def rounds_within_budget(z: float, per_round: int, rounds: int, delta: float, budget: float,
                         event: tuple[Any, ...] = (), accounting: str = "rdp") -> int:
    """How many rounds of ``per_round`` releases at multiplier ``z`` the ledger admits before the budget stops
    the rollout (it refuses a round that would take a device above ``budget``). ``event``: the releases'
    ``(q[, n])`` under device sampling; ``accounting``: the plan's accountant."""
    from cloud_coordinator.privacy.accountant import epsilon
    from cloud_coordinator.privacy.ledger import BUDGET_SLACK

    if math.isinf(budget):
        return rounds
    limit = budget * (1 + BUDGET_SLACK)

    def fits(k: int) -> bool:
        return epsilon([(z, per_round * k, *event)], delta, accounting=accounting) <= limit

    if fits(rounds):
        return rounds
    lo, hi = 0, rounds  # fits(lo), not fits(hi): epsilon grows with the count
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_document(cfg: Any, config_path: Path) -> dict[str, Any]:
    """The plan as plain data (what ``--json`` prints; ``render_plan`` formats it)."""
    from cloud_coordinator.privacy import calibrate

    p = cfg.privacy
    data = federated_data(cfg)
    samples = device_samples(cfg, data)
    tree = cfg.trust_tree()
    rows = calibrate.plan_rows(cfg, samples, tree)
    m = calibrate.multipliers(cfg, samples)
    local_steps, tau = calibrate.schedule(cfg)
    budget = float(p.budget_epsilon if p.budget_epsilon is not None else p.epsilon)
    noise_plan, snr = _noise_plan(cfg, samples, data)
    tiers = _tiers(cfg, rows, m, tau, budget)
    warnings = _warnings(cfg, tiers, rows, snr, budget)
    header = _header(cfg, config_path, m, budget, tau, local_steps, len(samples))
    return {**header, "tiers": tiers, "warnings": warnings, "details": dict(m.details),
            "signal_to_noise": snr.to_dict() if snr is not None else None,
            "nodes": [r.to_dict() for r in rows], "noise_plan": noise_plan}


def _noise_plan(cfg: Any, samples: dict[str, int], data: Any) -> tuple[dict[str, Any] | None, Any]:
    """The rollout's noise plan (as it travels) and its signal-to-noise estimate; ``(None, None)`` for a tree
    with intermediate servers, which rollouts do not run: its per-node rows are the whole plan."""
    from cloud_coordinator.privacy import calibrate, utility

    try:
        made = calibrate.make_plan(cfg, samples)
        noise_plan: dict[str, Any] | None = made.to_dict()
        snr: utility.Estimate | None = utility.estimate(
            made, utility.parameters_per_cell(cfg, data.num_features, data.num_classes),
            cells_averaged=not cfg.traits.submodels)
    except ConfigError:
        return None, None
    return noise_plan, snr


def _edge_event(p: Any, q: float, fan_in: int) -> tuple[Any, ...]:
    """(q[, n]) of a trusted server's release under device sampling: amplification (docs/privacy.md)."""
    from fedtier.privacy.plan import fixed_sample_size

    if p.device_sampling == "poisson":
        return (q,)
    if p.device_sampling == "fixed" and fixed_sample_size(fan_in, q) < fan_in:
        return (fixed_sample_size(fan_in, q) / fan_in, fan_in)
    return ()


def _tiers(cfg: Any, rows: Sequence[Any], m: Any, tau: int, budget: float) -> dict[str, dict[str, Any]]:
    """Both tiers: the devices that add their own noise, and the trusted servers that add it for their members.
    A device under an untrusted edge releases at most its cap (under sampling the cloud stops sampling it
    there), so its tier is charged that many rounds."""
    from cloud_coordinator.privacy import calibrate
    from fedtier.privacy.trust import DEVICE

    p = cfg.privacy
    q = calibrate.sample_rate(cfg)
    devices_in = [r for r in rows if r.kind == DEVICE and r.injects]
    servers_in = [r for r in rows if r.kind != DEVICE and r.injects]
    return {
        "device": _tier(p, DEVICE_TIER, devices_in, m.device_z, tau, m.details["epsilon_device_tier"],
                        int(m.details["device_releases"]) // tau, budget, cfg.rounds, lambda fan_in: ()),
        "edge": _tier(p, EDGE_TIER, servers_in, m.edge_z, 1, m.details["epsilon_edge_tier"], cfg.rounds, budget,
                      cfg.rounds, lambda fan_in: _edge_event(p, q, fan_in)),
    }


def _tier(p: Any, who: str, injecting: Sequence[Any], z: float, per_round: int, eps: float, rounds_charged: int,
          budget: float, rounds: int, event_of: Callable[[int], tuple[Any, ...]]) -> dict[str, Any]:
    """One tier's entry. With injecting nodes, ``z`` and ``eps`` are what the ledger charges: the tier's smallest
    multiplier (paper mode: it varies with the fan-in) over the releases charged, sampled as ``event_of`` its
    fan-in says; without, the calibration's values are shown."""
    from cloud_coordinator.privacy.accountant import epsilon

    event: tuple[Any, ...] = ()
    if injecting:
        worst = min(injecting, key=lambda r: r.z)
        z = worst.z
        event = event_of(worst.protects)
        eps = epsilon([(z, per_round * rounds_charged, *event)], p.delta, accounting=p.accountant)
    sens = [r.sensitivity for r in injecting]
    sigmas = [r.sigma for r in injecting]
    within = rounds_within_budget(z, per_round, rounds_charged, p.delta, budget, event, p.accountant)
    if within >= rounds_charged:
        within = rounds
    return {
        "who": who, "injectors": [r.node for r in injecting],
        "devices": sum(r.protects for r in injecting),
        "releases_per_round": per_round, "releases_per_device": per_round * rounds_charged,
        "sampling": p.device_sampling, "amplified": bool(event),
        "z": z, "sensitivity_min": min(sens, default=None), "sensitivity_max": max(sens, default=None),
        "sigma_min": min(sigmas, default=None), "sigma_max": max(sigmas, default=None),
        "epsilon": eps, "rounds_within_budget": within,
    }


def _warnings(cfg: Any, tiers: dict[str, dict[str, Any]], rows: Sequence[Any], snr: Any,
              budget: float) -> list[str]:
    """What the operator should hear before the rollout: a tier the budget stops early, noise that would drown
    the model, clear updates allowed without TLS."""
    from fedtier.privacy.trust import DEVICE

    p = cfg.privacy
    warnings = []
    for name, t in tiers.items():
        if not t["injectors"] or t["rounds_within_budget"] >= cfg.rounds:
            continue
        k = t["rounds_within_budget"]
        stop = ("will not run a single round" if k == 0
                else f"will stop before round {k} ({k} of {cfg.rounds} rounds run)")
        warnings.append(f"the {name} tier's releases reach epsilon {t['epsilon']:.4g} ({p.accountant.upper()}, "
                        f"delta {p.delta:g}) > "
                        f"budget {budget:g}: the rollout {stop}")
    if snr is not None:
        warnings += snr.warnings(p.epsilon)
    if not p.require_tls and any(r.kind == DEVICE and not r.injects and not r.distributed for r in rows):
        warnings.append("require_tls = false: devices under trusted cells may send clear updates without TLS")
    return warnings


def _header(cfg: Any, config_path: Path, m: Any, budget: float, tau: int, local_steps: int,
            devices: int) -> dict[str, Any]:
    """The rollout's privacy settings as planned (paper mode adds the inputs of its closed form)."""
    from cloud_coordinator.privacy import calibrate

    p = cfg.privacy
    header = {
        "config": str(config_path), "rollout": cfg.rollout, "algorithm": cfg.algorithm,
        "mode": p.calibration, "epsilon": p.epsilon, "delta": p.delta, "budget_epsilon": budget, "clip": p.clip,
        "rounds": cfg.rounds, "edge_rounds": tau, "local_steps": local_steps, "require_tls": p.require_tls,
        "cells": len(cfg.topology.layout()), "devices": devices, "accountant": p.accountant,
        "device_sampling": p.device_sampling, "sample_rate": calibrate.sample_rate(cfg),
        "secure_noise": p.secure_noise, "distributed_min_survivors": calibrate.distributed_min_survivors(cfg),
        "adaptive_clip": {"quantile": p.clip_quantile, "lr": p.clip_lr, "count_share": p.clip_count_share}
        if p.adaptive_clip else None,
    }
    if p.calibration == "paper":
        header.update(alpha=m.details["alpha"], sampling_rate=m.details["sampling_rate"],
                      steps_per_round=m.details["steps_per_round"])
    return header


def render_plan(doc: dict[str, Any]) -> str:
    """The human-readable plan (no trailing newline): the settings, the tiers, the signal-to-noise estimate,
    every node of the tree, then notes and warnings."""
    lines = [f"privacy plan of rollout {doc['rollout']} ({doc['config']}): {doc['algorithm']}, {doc['cells']} cells, "
             f"{doc['devices']} devices"]
    rows = _setting_rows(doc)
    width = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    lines += ["", "tiers (every device is protected by exactly one injection point):"]
    lines += _tier_table(doc)
    lines += _snr_lines(doc)
    lines += ["", "cells (who adds noise where):"]
    lines += cell_lines(doc)
    lines += ["", "nodes:"]
    lines += _node_table(doc)
    if doc["noise_plan"] is None:
        lines += ["", "note: intermediate servers (topology.parents) are planned here, but rollouts run "
                      "device -> cell -> cloud"]
    if doc["warnings"]:
        lines += ["", "warnings:"]
        lines += [f"  - WARNING: {w}" for w in doc["warnings"]]
    return "\n".join(lines)


def render_summary(doc: dict[str, Any]) -> list[str]:
    """The plan in a few lines (what ``fedtier demo --privacy`` prints before its fleet starts): the target,
    who adds noise in each cell (``cell_lines``), each tier's multiplier, and the plan's warnings. Built from
    the same document and the same cell lines as ``render_plan``, so the two never disagree."""
    budget = doc["budget_epsilon"]
    stop = ("privacy never stops the rollout" if math.isinf(budget)
            else f"the ledger stops the rollout before any device would exceed {budget:g}")
    lines = [f"privacy: epsilon {doc['epsilon']:g} per device at delta {doc['delta']:g} over {doc['rounds']} "
             f"rounds ({doc['mode']} calibration, {_accountant(doc)} accountant; {stop}); every released model "
             f"delta clipped to C = {doc['clip']:g}"]
    sampling = _sampling_row(doc)
    if sampling is not None:
        lines.append(f"  {sampling[0]}: {sampling[1]}")
    lines += cell_lines(doc)
    present = [f"{name} tier z {t['z']:.3g} (epsilon {t['epsilon']:.3g})" for name, t in doc["tiers"].items()
               if t["injectors"]]
    lines.append("  noise multiplier per tier: " + (", ".join(present) or "none (no node adds noise)"))
    lines += [f"  WARNING: {w}" for w in doc["warnings"]]
    return lines


def cell_lines(doc: dict[str, Any]) -> list[str]:
    """Who adds noise where, one line per cell and one for the cloud, from the plan's nodes: a trusted edge
    noising its clear inputs, devices noising their own updates under an untrusted edge, or (distributed DP)
    devices each adding a share of their cell's noise to a sum the edge alone cannot open."""
    nodes = doc["nodes"]
    cells = sorted((n for n in nodes if n["kind"] == "server"), key=lambda n: (n["layer"], n["node"]))
    lines = []
    for cell in cells:
        devices = [n for n in nodes if n["kind"] == "device" and n["parent"] == cell["node"]]
        if not devices:
            continue
        label = "trusted  " if cell["trusted"] else "untrusted"
        lines.append(f"  {cell['node']}  {label}  {_cell_text(doc, cell, devices)}")
    cloud = next((n for n in nodes if n["kind"] == "cloud"), None)
    if cloud is not None:
        lines.append(f"  {cloud['node']}  untrusted  adds no noise; refuses any cell update whose noise is not on "
                     "record")
    return lines


def _cell_text(doc: dict[str, Any], cell: dict[str, Any], devices: list[dict[str, Any]]) -> str:
    n, first = len(devices), devices[0]
    noise = f"z {cell['z']:.3g}, sigma {cell['sigma']:.3g} = z x sensitivity {cell['sensitivity']:.3g}"
    if first.get("distributed"):
        return (f"secure aggregation: each of its {n} devices adds a share of the cell's noise "
                f"(z {first['z']:.3g} of its own); the edge sees only the sum and adds nothing; one release a "
                f"round ({noise})")
    if cell["trusted"] and cell["injects"]:
        tls = "over TLS" if doc["require_tls"] else "WITHOUT TLS (require_tls = false)"
        sampled = (f", from the devices it samples in secret (q = {doc['sample_rate']:g})"
                   if doc.get("device_sampling", "none") != "none" else "")
        when = ("to each cell update it sends the cloud (one per k_edge deltas)"
                if algorithms.describe(str(doc.get("algorithm", "fedavg"))).asynchronous
                else "once per round towards the cloud")
        return f"its {n} devices send clear updates {tls}; the edge adds noise {when}{sampled} ({noise})"
    if cell["trusted"]:
        return f"its {n} devices send clear updates; the edge adds no noise ({cell['why']})"
    releases = sorted({int(d["releases"]) for d in devices})
    count = str(releases[0]) if len(releases) == 1 else f"{releases[0]}-{releases[-1]}"
    sampled = ", when the cloud samples it" if doc.get("device_sampling", "none") != "none" else ""
    return (f"each of its {n} devices adds noise to every update{sampled} ({count} releases: z {first['z']:.3g}, "
            f"sigma {first['sigma']:.3g} = z x 2C); the edge forwards their noised mean")


def _accountant(doc: dict[str, Any]) -> str:
    return str(doc.get("accountant", "rdp")).upper()


def _setting_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The settings block: (name, explanation) rows, the optional ones only when they apply."""
    budget = doc["budget_epsilon"]
    budget_text = ("none: privacy never stops the rollout" if math.isinf(budget)
                   else f"{budget:g} (the rollout stops before any device would exceed it)")
    rows = [("calibration", _calibration_text(doc)),
            ("target", f"epsilon {doc['epsilon']:g} per device at delta {doc['delta']:g}"),
            ("budget", budget_text),
            ("accountant", _accountant_text(doc)),
            ("clip", _clip_text(doc)),
            ("schedule", f"{doc['rounds']} rounds x {doc['edge_rounds']} edge rounds x {doc['local_steps']} "
                         "local steps"),
            ("require_tls", "yes" if doc["require_tls"] else "no")]
    sampling = _sampling_row(doc)
    if sampling is not None:
        rows.append(sampling)
    if doc.get("secure_noise"):
        rows.append(("noise", "secure: CSPRNG, sum of Gaussians (docs/privacy.md, hardened noise)"))
    return rows


def _calibration_text(doc: dict[str, Any]) -> str:
    if doc["mode"] == "rdp":
        return (f"rdp: each tier's noise multiplier z solved with the {_accountant(doc)} accountant for its real "
                "release count")
    return (f"paper: z = alpha q sqrt(K T ln(1/delta)) / epsilon (eq. 11; alpha {doc['alpha']:g}, "
            f"q {doc['sampling_rate']:.4g}, K {doc['steps_per_round']}) -- a HEURISTIC closed form, not a "
            "guarantee; the ledger charges the RDP epsilon shown per tier")


def _accountant_text(doc: dict[str, Any]) -> str:
    """Each tier's epsilon over the whole rollout; paper mode recalls the target it was calibrated for."""
    from cloud_coordinator.privacy.report import fmt

    return (f"epsilon over the whole rollout ({_accountant(doc)}, what the ledger charges): "
            + ", ".join(f"{name} tier {fmt(t['epsilon'], '.4g')}" + ("" if t["injectors"] else " (no node)")
                        for name, t in doc["tiers"].items())
            + ("" if doc["mode"] == "rdp" else f" -- the paper's target was {doc['epsilon']:g}"))


def _clip_text(doc: dict[str, Any]) -> str:
    adaptive = doc.get("adaptive_clip")
    if not adaptive:
        return f"C = {doc['clip']:g} (L2 bound on each released model delta)"
    return (f"adaptive: C starts at {doc['clip']:g} and moves every round towards the "
            f"{adaptive['quantile']:g}-quantile of update norms (rate "
            f"{adaptive['lr']:g}); each release spends {adaptive['count_share']:g} of "
            "its z^-2 on its noised clipped count, its update's noise grows by "
            f"{(1 - adaptive['count_share']) ** -0.5:.3g}x")


def _sampling_row(doc: dict[str, Any]) -> tuple[str, str] | None:
    """Distributed DP (which covers its own sampling), else device sampling, else nothing."""
    s_min = doc.get("distributed_min_survivors", 0)
    sampled = doc.get("device_sampling", "none") != "none"
    if s_min:
        return ("distributed DP", f"secure aggregation in every cell: each device adds 1/{s_min} of its cell's "
                                  f"noise variance (s_min = {s_min} survivors at least), no edge sees an update "
                                  "and none adds noise; a cell's sum is charged as a trusted edge's release"
                                  + (", its devices sampling themselves in secret" if sampled else "")
                                  + " (docs/privacy.md)")
    if sampled:
        return ("sampling", f"{doc['device_sampling']} at q = {doc['sample_rate']:g} per round: trusted edges "
                            "sample in secret and release a fixed-denominator sum (amplified); devices under "
                            "untrusted edges pay full price, sampled at most "
                            f"{doc['tiers']['device']['releases_per_device'] // max(1, doc['edge_rounds'])} "
                            "rounds (docs/privacy.md)")
    return None


def _tier_table(doc: dict[str, Any]) -> list[str]:
    from cloud_coordinator.privacy.report import fmt, table

    tier_rows = []
    for name, t in doc["tiers"].items():
        present = bool(t["injectors"])
        tier_rows.append([
            name, t["who"], str(t["devices"]) if present else "0",
            f"{t['releases_per_device']} ({t['releases_per_round']}/round"
            + (", amplified" if t.get("amplified") else "") + ")", fmt(t["z"]),
            _span(t["sensitivity_min"], t["sensitivity_max"]), _span(t["sigma_min"], t["sigma_max"]),
            fmt(t["epsilon"]) + ("" if present else " (no node in this tier)"),
            f"{t['rounds_within_budget']} of {doc['rounds']}"])
    return table(["tier", "who adds noise", "devices", "releases/device", "z", "sensitivity", "sigma",
                  f"epsilon ({_accountant(doc)})", "rounds within budget"], tier_rows)


def _snr_lines(doc: dict[str, Any]) -> list[str]:
    """The signal-to-noise block, when the plan has an estimate (not for intermediate servers)."""
    from cloud_coordinator.privacy.report import fmt, table

    snr = doc["signal_to_noise"]
    if snr is None:
        return []
    lines = ["", f"signal-to-noise per round (clipped signal bound vs expected noise norm over "
                 f"{snr['parameters']} parameters; every member reporting):"]
    snr_rows = []
    for name, label in (("device", "an untrusted cell's change"), ("edge", "a trusted cell's release"),
                        ("cloud", "the global update")):
        r = snr[name]
        if r is not None:
            snr_rows.append([label, r["cell"] or "-", fmt(r["signal"], ".3g"), fmt(r["noise"], ".3g"),
                             fmt(r["snr"], ".2g")])
    lines += table(["aggregate", "worst cell", "signal <=", "noise ~", "signal/noise"], snr_rows)
    lines.append(f"  over {doc['rounds']} rounds: signal/noise {fmt(snr['rollout_snr'], '.2g')} "
                 f"(x sqrt(rounds): the signal can add up, the noise adds up as a random walk)")
    return lines


def _node_table(doc: dict[str, Any]) -> list[str]:
    """Every node, by section: the cloud, the servers by layer, the devices by cell (identical runs collapsed)."""
    from cloud_coordinator.privacy.report import table

    nodes = doc["nodes"]
    cloud = [n for n in nodes if n["kind"] == "cloud"]
    servers = sorted((n for n in nodes if n["kind"] == "server"), key=lambda n: (n["layer"], n["node"]))
    devices = sorted((n for n in nodes if n["kind"] == "device"), key=lambda n: (n["parent"], n["node"]))
    body: list[list[str]] = []
    for section, members in (("cloud", cloud), ("servers", servers), ("devices", devices)):
        if not members:
            continue
        body.append([f"[{section}]", "", "", "", "", "", "", "", "", "", ""])
        for label, n in (_collapse(members) if section == "devices" else [(n["node"], n) for n in members]):
            body.append(_node_cells(label, n, doc["require_tls"]))
    return table(["node", "layer", "parent", "declared", "effective", "injects", "releases", "sensitivity", "z",
                  "sigma", "why"], body)


def _span(lo: float | None, hi: float | None) -> str:
    from cloud_coordinator.privacy.report import fmt

    if lo is None or hi is None:
        return "-"
    return fmt(lo) if math.isclose(lo, hi, rel_tol=1e-12) else f"{fmt(lo)}..{fmt(hi)}"


_SAME = ("parent", "layer", "declared", "trusted", "injects", "releases", "sensitivity", "z", "sigma", "why")


def _collapse(devices: Sequence[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Runs of devices of one cell with identical rows become one line: ``dev-00..dev-05 (6 devices)``."""
    from cloud_coordinator.privacy.report import device_range

    out: list[tuple[str, dict[str, Any]]] = []
    run: list[dict[str, Any]] = []
    for n in [*devices, None]:
        if run and (n is None or any(n[k] != run[0][k] for k in _SAME)):
            out.append((device_range([r["node"] for r in run]), run[0]))
            run = []
        if n is not None:
            run.append(n)
    return out


def _node_cells(label: str, n: dict[str, Any], require_tls: bool) -> list[str]:
    from cloud_coordinator.privacy.report import fmt

    declared = {None: "-", True: "trusted", False: "untrusted"}[n["declared"]]
    if n.get("distributed") and n["kind"] == "device":  # distributed DP: a share of its cell's release
        return [label, str(n["layer"]), n["parent"] or "-", declared, "-", "share", "0", fmt(n["sensitivity"]),
                fmt(n["z"]), fmt(n["sigma"]), n["why"]]
    if n["kind"] == "device":
        effective = "-"
        tls = "(TLS required)" if require_tls else "(TLS NOT required)"
        why = (f"adds noise: its cell {n['parent']} is untrusted" if n["injects"]
               else f"sends clear to trusted {n['parent']} {tls}")
    else:
        effective = "trusted" if n["trusted"] else "untrusted"
        why = n["why"]
        if n["kind"] == "server" and not n["injects"]:
            why += "; adds no noise (" + ("its parent is trusted" if n["trusted"] else "forwards noised inputs") + ")"
    injects = "yes" if n["injects"] else "no"
    if not n["injects"]:
        return [label, str(n["layer"]), n["parent"] or "-", declared, effective, injects, "0", "-", "-", "-", why]
    return [label, str(n["layer"]), n["parent"] or "-", declared, effective, injects, str(n["releases"]),
            fmt(n["sensitivity"]), fmt(n["z"]), fmt(n["sigma"]), why]

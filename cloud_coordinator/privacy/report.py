"""``fedtier privacy report``'s data and plot: a rollout's privacy ledger, summarised for people.

Everything here is computed from the ledger rows alone (``CoordinatorStore.privacy_releases``
and ``privacy_clear``), so anyone holding the coordinator's database can reproduce it; the
live numbers the coordinator wrote into each round's metrics are only *compared* against it.

* per round: every device's epsilon after that round, accumulated round by round with an
  ``Accountant`` (the plot's max and min lines), beside the round's test accuracy;
* per tier: the *device tier* is the releases devices under untrusted cells made themselves
  (rows with ``event = "device"``), the *edge tier* the releases trusted cells made towards
  the cloud on behalf of their members (``event = "edge"``);
* per device: its epsilon from the ledger next to the live one, flagged when they differ;
* the clear hops (un-noised device -> cell messages) and whether each went to a trusted cell.

Rounds are numbered from 0 in data and tables, as everywhere in fedtier; the plot's x axis
counts rounds closed (``round + 1``).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from cloud_coordinator.privacy.accountant import Accountant
from fedtier.privacy import audit

# Relative difference above which the ledger's and the live epsilon of a device disagree.
MISMATCH_REL = 1e-9

TIER_LABELS = {
    "device": "device tier (devices under untrusted cells add noise to each release)",
    "edge": "edge tier (trusted cells add noise when they forward to the cloud)",
}


# --- small helpers --------------------------------------------------------------------------------


def agrees(a: float | None, b: float | None, rel: float = MISMATCH_REL) -> bool:
    """Whether two epsilons are equal to ``rel`` (relative); ``None`` (missing) agrees with nothing."""
    if a is None or b is None:
        return False
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rel * max(abs(a), abs(b))


def finite_or_none(value: float | None) -> float | None:
    """JSON has no infinity: an unlimited budget (or an infinite epsilon) becomes ``None``."""
    return None if value is None or math.isinf(value) else float(value)


def fmt(value: float | None, spec: str = ".6g") -> str:
    """A number for a table: ``-`` when missing, ``inf`` when unbounded."""
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return format(value, spec)


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "  ") -> list[str]:
    """Left-aligned text columns (the last one is not padded, so long explanations may follow)."""
    body = [list(map(str, r)) for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) for c, w in zip(cells[:-1], widths[:-1], strict=True)]
        return (indent + "  ".join([*padded, cells[-1]])).rstrip()

    return [line(list(headers)), *(line(r) for r in body)]


def device_range(devices: Sequence[str]) -> str:
    """``dev-00`` for one device, ``dev-00..dev-05 (6 devices)`` for a run of several."""
    if len(devices) == 1:
        return devices[0]
    return f"{devices[0]}..{devices[-1]} ({len(devices)} devices)"


# --- what the ledger says -------------------------------------------------------------------------


def epsilon_by_round(releases: Sequence[Mapping[str, Any]], delta: float,
                     accounting: str = "rdp", roster: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Every device's epsilon after each round, from the ledger rows alone.

    Args:
        releases: ``CoordinatorStore.privacy_releases`` rows (any order).
        delta: the delta epsilon is reported at.
        accounting: the accountant, ``rdp`` or ``pld`` (the rollout's, so the live numbers compare).
        roster: devices the live ledger lists besides those on the rows (its every member from the
            start): with device sampling, a device of an untrusted cell the cloud never sampled has no
            row, released nothing and is charged nothing; it counts at epsilon 0, as it does live.

    Returns:
        One dict per round that has rows, in round order: ``round`` (store index),
        ``releases`` (rows of that round), ``epsilon_max`` / ``epsilon_min`` over every
        device the ledger protects, and ``epsilon`` (device -> epsilon).
    """
    acc = Accountant(delta, accounting=accounting)
    for device in sorted({d for r in releases for d in r["protected"]} | set(roster)):
        acc.add([device], 0.0, 0)  # listed from the start, like the live ledger
    by_round: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for row in releases:
        by_round[int(row["round"])].append(row)
    out = []
    for rnd in sorted(by_round):
        for row in by_round[rnd]:
            q, population = audit.sampling_of(row)
            acc.add(row["protected"], float(row["noise_multiplier"]), 1, sampling_rate=q, population=population)
        eps = acc.epsilons()
        values = list(eps.values()) or [0.0]
        out.append({"round": rnd, "releases": len(by_round[rnd]), "epsilon_max": max(values),
                    "epsilon_min": min(values), "epsilon": dict(sorted(eps.items()))})
    return out


def _live_roster(rounds: Sequence[Mapping[str, Any]]) -> set[str]:
    """Every device any round's live metrics list (the live ledger lists each member from the start)."""
    return {str(d) for r in rounds for d in ((r.get("privacy") or {}).get("epsilon") or {})}


def tier_of_devices(releases: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """device -> {tiers, cell, releases}: which tier protects it, under which cell, how many releases."""
    out: dict[str, dict[str, Any]] = {}
    for row in releases:
        event = str(row["event"])
        cell = str(row["parent"]) if event == "device" else str(row["node"])
        for device in row["protected"]:
            entry = out.setdefault(device, {"tiers": set(), "cells": set(), "releases": 0})
            entry["tiers"].add(event)
            entry["cells"].add(cell)
            entry["releases"] += 1
    return out


def tier_summary(releases: Sequence[Mapping[str, Any]], epsilons: Mapping[str, float]) -> list[dict[str, Any]]:
    """One entry per tier present in the ledger (``device`` first, then ``edge``, then others)."""
    events = sorted({str(r["event"]) for r in releases}, key=lambda e: (e not in TIER_LABELS, e != "device", e))
    out = []
    for event in events:
        rows = [r for r in releases if r["event"] == event]
        per_device: Counter[str] = Counter()
        for r in rows:
            per_device.update(set(r["protected"]))
        devices = sorted(per_device)
        eps = [epsilons[d] for d in devices if d in epsilons]
        injectors = sorted({str(r["node"]) for r in rows})
        cells = sorted({str(r["parent"]) if event == "device" else str(r["node"]) for r in rows})
        sigmas = [float(r["sigma"]) for r in rows]
        sens = [float(r["sensitivity"]) for r in rows]
        out.append({
            "tier": event,
            "label": TIER_LABELS.get(event, f"{event} releases"),
            "cells": cells,
            "injectors": len(injectors),
            "devices": len(devices),
            "releases": len(rows),
            "observed": sum(1 for r in rows if r["observed"]),
            "unobserved": sum(1 for r in rows if not r["observed"]),
            "releases_per_device_min": min(per_device.values()) if per_device else 0,
            "releases_per_device_max": max(per_device.values()) if per_device else 0,
            "z": sorted({float(r["noise_multiplier"]) for r in rows}),
            "sensitivity_min": min(sens), "sensitivity_max": max(sens),
            "sigma_min": min(sigmas), "sigma_max": max(sigmas),
            "epsilon_max": max(eps) if eps else None,
            "epsilon_min": min(eps) if eps else None,
        })
    return out


def clear_hops(clear: Sequence[Mapping[str, Any]], releases: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The clear (un-noised) hops and whether each went to a trusted receiver.

    A receiver counts as trusted only if the hop's row says so *and* the ledger shows it acting
    as one: a trusted cell makes (or is charged) an ``edge`` release every round.
    """
    trusted = {str(r["node"]) for r in releases if r["event"] == "edge"}
    bad = [dict(c) for c in clear if not (c["receiver_trusted"] and str(c["receiver"]) in trusted)]
    return {"total": len(clear), "to_trusted": len(clear) - len(bad), "all_to_trusted": not bad,
            "receivers": sorted({str(c["receiver"]) for c in clear}),
            "violations": [{k: v for k, v in c.items() if k != "rollout"} for c in bad]}


def _device_rows(releases: Sequence[Mapping[str, Any]], recomputed: Mapping[str, float],
                 live: Mapping[str, float], final: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Per device: its epsilon from the ledger next to the live one. A device no row protects (with device
    sampling, one of an untrusted cell the cloud never sampled) released nothing and is charged nothing: 0."""
    tiers = tier_of_devices(releases)
    devices = []
    for device in sorted(set(recomputed) | set(live)):
        info = tiers.get(device, {"tiers": set(), "cells": set(), "releases": 0})
        ledger_eps, live_eps = recomputed.get(device), live.get(device)
        if ledger_eps is None and not info["releases"]:
            ledger_eps = 0.0
        devices.append({"device": device, "tier": ",".join(sorted(info["tiers"])) or "-",
                        "cell": ",".join(sorted(info["cells"])) or "-", "releases": info["releases"],
                        "epsilon": ledger_eps, "live_epsilon": live_eps, "agrees": agrees(ledger_eps, live_eps)})
    if final is not None:  # the round-by-round accountant must end where ledger.recompute does
        for d in devices:
            if not agrees(final["epsilon"].get(d["device"]), d["epsilon"]):
                d["agrees"] = False
    return devices


def build(*, rollout: str, db: Path | str, releases: Sequence[Mapping[str, Any]], clear: Sequence[Mapping[str, Any]],
          rounds: Sequence[Mapping[str, Any]], recomputed: Mapping[str, float], delta: float, budget: float,
          mode: str, status: str | None, rounds_planned: int | None, stopped: str | None,
          accounting: str = "rdp", by_accountant: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` prints).

    Args:
        rollout: the rollout id.
        db: the coordinator database the rows came from.
        releases: its release rows; clear: its clear-hop rows.
        rounds: its closed rounds' metrics rows (``CoordinatorStore.rounds``), for the live epsilon and
            the accuracy.
        recomputed: device -> epsilon from ``ledger.recompute``.
        delta: the delta of every epsilon; budget: the rollout's budget (``inf``: none).
        mode: the calibration mode ("rdp" or "paper").
        status: the store's status of the rollout (finished, stopped, running).
        rounds_planned: rounds the rollout was configured for, if known.
        stopped: why the budget stopped it (the metrics file's ``stopped``), if known.
        accounting: the rollout's accountant (``rdp`` or ``pld``): ``recomputed`` and the series use it.
        by_accountant: the largest epsilon from the same rows under each accountant (rdp and pld).
    """
    live_by_round = {int(r["round"]): r.get("privacy") for r in rounds}
    accuracy_by_round = {int(r["round"]): r.get("accuracy") for r in rounds}
    last = rounds[-1] if rounds else None
    live: Mapping[str, float] = (last.get("privacy") or {}).get("epsilon", {}) if last else {}
    series = epsilon_by_round(releases, delta, accounting, roster=_live_roster(rounds))
    for point in series:
        metrics = live_by_round.get(point["round"]) or {}
        point["live_epsilon_max"] = metrics.get("epsilon_max")
        point["live_epsilon_min"] = metrics.get("epsilon_min")
        point["accuracy"] = accuracy_by_round.get(point["round"])  # what the round's privacy bought
        point["agrees"] = (agrees(point["epsilon_max"], point["live_epsilon_max"])
                           and agrees(point["epsilon_min"], point["live_epsilon_min"]))
    devices = _device_rows(releases, recomputed, live, series[-1] if series else None)
    warnings = []
    mismatched = [d["device"] for d in devices if not d["agrees"]]
    if mismatched:
        warnings.append(f"epsilon of {len(mismatched)} device(s) differs between the ledger and the live metrics "
                        f"(> {MISMATCH_REL:g} relative): {', '.join(mismatched)}")
    bad_rounds = [p["round"] for p in series if not p["agrees"]]
    if bad_rounds:
        warnings.append(f"epsilon max/min after round(s) {bad_rounds} differ from the live metrics")
    hops = clear_hops(clear, releases)
    if not hops["all_to_trusted"]:
        warnings.append(f"{len(hops['violations'])} clear hop(s) went to a receiver that is not trusted")
    worst = max(recomputed.values()) if recomputed else 0.0
    if worst > budget * (1 + MISMATCH_REL):
        warnings.append(f"a device's epsilon {worst:.6g} exceeds the budget {budget:g}")
    return {
        "rollout": rollout, "db": str(db), "status": status, "stopped": stopped,
        "rounds_closed": len(rounds), "rounds_planned": rounds_planned,
        "mode": mode, "delta": delta, "budget_epsilon": budget, "accountant": accounting,
        "epsilon_max_by_accountant": dict(by_accountant or {accounting: max(recomputed.values(), default=0.0)}),
        "releases": {"total": len(releases), "observed": sum(1 for r in releases if r["observed"]),
                     "unobserved": sum(1 for r in releases if not r["observed"])},
        "clear_hops": hops,
        "tiers": tier_summary(releases, recomputed),
        "devices": devices,
        "rounds": series,
        "epsilon_max": worst,
        "warnings": warnings,
    }


def jsonable(value: Any) -> Any:
    """``value`` with every infinite or NaN float replaced by ``None`` (JSON has neither): an unlimited
    budget, or the infinite epsilon of an un-noised release."""
    if isinstance(value, float):
        return finite_or_none(value) if not math.isnan(value) else None
    if isinstance(value, Mapping):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


# --- for people -----------------------------------------------------------------------------------


def status_line(report: Mapping[str, Any]) -> str:
    closed, planned = report["rounds_closed"], report["rounds_planned"]
    of = f"{closed} of {planned}" if planned is not None else f"{closed}"
    status = report["status"]
    if status == "finished":
        return f"finished: {of} rounds closed"
    if status == "stopped":
        why = report["stopped"] or "reason not recorded (no metrics file of this rollout)"
        return f"STOPPED early after {of} rounds: {why}"
    return f"{status or 'unknown'}: {of} rounds closed so far (not finished: still running, or interrupted)"


def render(report: Mapping[str, Any]) -> str:
    """The human-readable report (no trailing newline)."""
    budget = report["budget_epsilon"]
    budget_text = "none (never stops)" if budget is None or math.isinf(budget) else f"{budget:g}"
    rel = report["releases"]
    hops = report["clear_hops"]
    lines = [f"privacy report of rollout {report['rollout']} ({report['db']})",
             f"  status       {status_line(report)}",
             f"  accounting   {report['mode']} calibration; epsilon at delta {report['delta']:g} from the "
             f"{report.get('accountant', 'rdp').upper()} accountant; budget {budget_text}",
             "  both         " + ", ".join(f"{k.upper()} {fmt(v)}" for k, v in
                                         sorted(report.get("epsilon_max_by_accountant", {}).items()))
             + " (largest epsilon from the same rows under each accountant)",
             f"  releases     {rel['total']} on the ledger: {rel['observed']} observed by the cloud, "
             f"{rel['unobserved']} unobserved (charged at their planned multiplier)",
             f"  clear hops   {hops['total']} un-noised device -> cell messages, "
             + ("all to trusted cells" if hops["all_to_trusted"]
                else f"{len(hops['violations'])} NOT to a trusted cell"),
             f"  epsilon max  {fmt(report['epsilon_max'])} (over every device, from the ledger)",
             "", "per tier:"]
    tier_rows = []
    for t in report["tiers"]:
        per = (str(t["releases_per_device_min"]) if t["releases_per_device_min"] == t["releases_per_device_max"]
               else f"{t['releases_per_device_min']}-{t['releases_per_device_max']}")
        sigma = fmt(t["sigma_min"]) if t["sigma_min"] == t["sigma_max"] else \
            f"{fmt(t['sigma_min'])}..{fmt(t['sigma_max'])}"
        tier_rows.append([t["tier"], ",".join(t["cells"]), str(t["devices"]), str(t["releases"]),
                          str(t["unobserved"]), per, ",".join(fmt(z) for z in t["z"]), sigma,
                          fmt(t["epsilon_max"]), fmt(t["epsilon_min"])])
    lines += table(["tier", "cells", "devices", "releases", "unobserved", "per device", "z", "sigma",
                    "eps max", "eps min"], tier_rows)
    lines += ["", "per device (ledger = recomputed offline from the rows; live = last round's metrics):"]
    lines += table(["device", "tier", "cell", "releases", "epsilon (ledger)", "epsilon (live)", "match"],
                   [[d["device"], d["tier"], d["cell"], str(d["releases"]), fmt(d["epsilon"], ".10g"),
                     fmt(d["live_epsilon"], ".10g"), "yes" if d["agrees"] else "MISMATCH"]
                    for d in report["devices"]])
    lines += ["", "epsilon after each round (accumulated from the ledger rows; live = the round's metrics; "
                  "accuracy = the global model's test accuracy after the round):"]
    lines += table(["round", "accuracy", "releases", "eps max", "eps min", "live max", "live min", "match"],
                   [[str(p["round"]), fmt(p.get("accuracy"), ".4f"), str(p["releases"]), fmt(p["epsilon_max"]),
                     fmt(p["epsilon_min"]), fmt(p["live_epsilon_max"]), fmt(p["live_epsilon_min"]),
                     "yes" if p["agrees"] else "MISMATCH"]
                    for p in report["rounds"]])
    if report["warnings"]:
        lines += ["", "warnings:"]
        lines += [f"  - {w}" for w in report["warnings"]]
    return "\n".join(lines)


# --- the plot -------------------------------------------------------------------------------------


def plot_epsilon(series: Sequence[Mapping[str, Any]], path: Path, *, budget: float | None, delta: float, mode: str,
                 rollout: str) -> Path:
    """Write the epsilon-vs-round PNG: max and min over devices after each round, and the budget.

    Args:
        series: ``epsilon_by_round`` points (``round`` is the store index; the x axis counts rounds closed).
        path: the PNG to write (its directory is created).
        budget: the budget line; ``None`` or ``inf``: no line.
        delta, mode, rollout: for the title.

    Returns:
        ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: only when a plot is asked for
    from matplotlib.figure import Figure

    # Start at (0 rounds, epsilon 0): nothing is released before the first round.
    xs = [0, *(int(p["round"]) + 1 for p in series)]
    highs = [0.0, *(_plottable(p["epsilon_max"]) for p in series)]
    lows = [0.0, *(_plottable(p["epsilon_min"]) for p in series)]
    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(xs, highs, marker="o", label="max over devices")
    ax.plot(xs, lows, marker="s", linestyle="--", label="min over devices")
    if budget is not None and math.isfinite(budget):
        ax.axhline(budget, color="tab:red", linestyle=":", label=f"budget {budget:g}")
    ax.set_xlabel("rounds closed")
    ax.set_ylabel(f"epsilon (RDP accountant, delta = {delta:g})")
    ax.set_title(f"privacy loss of rollout {rollout} ({mode} calibration, delta = {delta:g})")
    top = max([h for h in highs if math.isfinite(h)] + ([budget] if budget is not None and math.isfinite(budget)
                                                         else []) + [1e-9])
    ax.set_ylim(0, top * 1.08)
    if xs:
        ax.set_xticks(xs if len(xs) <= 20 else xs[:: max(1, len(xs) // 10)])
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _plottable(value: float | None) -> float:
    return math.nan if value is None or math.isinf(value) else float(value)

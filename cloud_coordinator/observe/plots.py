"""``fedtier report``: a rollout's PNG plots and a markdown summary that links them.

Each plot is built from ``observe.status`` (the store) as a matplotlib ``Figure`` (no pyplot, no
global state: safe inside a running coordinator), titled, with axes labelled in their units and a
legend wherever there is more than one line; ``figures`` returns them so that a test can read a
plotted value back and compare it with the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloud_coordinator.observe.status import RolloutStatus
from cloud_coordinator.report import human_bytes

MIB = 1 << 20
TIER_LABELS = {"device_up": "device -> edge", "device_down": "edge -> device", "edge_up": "edge -> cloud",
               "cloud_down": "cloud -> edge"}
PLOTS = {
    "accuracy_loss": "Accuracy and loss per round",
    "bytes_per_tier": "Bytes per tier, cumulative",
    "accuracy_vs_bytes": "Accuracy against bytes sent",
    "epsilon": "Privacy spent per round",
    "devices_reporting": "Devices reporting per round and cell",
}
"""File stem -> what the plot shows (the figure's title starts with it)."""


@dataclass(frozen=True)
class Report:
    markdown: Path
    plots: dict[str, Path]


def figures(status: RolloutStatus) -> dict[str, Any]:
    """The report's figures (``matplotlib.figure.Figure``), by file stem (``PLOTS``)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    name = status.summary.rollout
    rounds = [r.round for r in status.rounds]
    out: dict[str, Any] = {}

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    acc = ax.plot(rounds, [_nan(r.accuracy) for r in status.rounds], "o-", color="tab:blue",
                  label="test accuracy")
    ax.set_xlabel("round (0-based)")
    ax.set_ylabel("test accuracy (fraction correct)")
    right = ax.twinx()
    loss = right.plot(rounds, [_nan(r.loss) for r in status.rounds], "s--", color="tab:red", label="test loss")
    right.set_ylabel("test loss (mean per example)")
    ax.legend(handles=[*acc, *loss], loc="center right")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{PLOTS['accuracy_loss']}: {name}")
    out["accuracy_loss"] = fig

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for tier, label in TIER_LABELS.items():
        ax.plot(rounds, _cumulative([r.bytes[tier] / MIB for r in status.rounds]), "o-", label=label)
    ax.set_xlabel("round (0-based)")
    ax.set_ylabel("bytes since the start (MiB)")
    ax.legend(title="tier")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{PLOTS['bytes_per_tier']}: {name}")
    out["bytes_per_tier"] = fig

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    total = _cumulative([sum(r.bytes.values()) / MIB for r in status.rounds])
    ax.plot(total, [_nan(r.accuracy) for r in status.rounds], "o-", color="tab:blue", label="test accuracy")
    ax.set_xlabel("bytes on all tiers since the start (MiB)")
    ax.set_ylabel("test accuracy (fraction correct)")
    ax.set_title(f"{PLOTS['accuracy_vs_bytes']}: {name}")
    out["accuracy_vs_bytes"] = fig

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    if any(r.epsilon is not None for r in status.rounds):
        ax.plot(rounds, [_nan(r.epsilon) for r in status.rounds], "o-", color="tab:purple",
                label="epsilon (largest over devices)")
    else:
        ax.text(0.5, 0.5, "no differential privacy: nothing spent", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("round (0-based)")
    ax.set_ylabel("epsilon spent after the round (privacy loss, unitless)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{PLOTS['epsilon']}: {name}")
    out["epsilon"] = fig

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(status.cells))  # grouped bars: equal counts do not hide one another
    for i, cell in enumerate(status.cells):
        ax.bar([x - 0.4 + width * (i + 0.5) for x in rounds],
               [r.reported_per_cell.get(cell.cell, 0) for r in status.rounds], width,
               label=f"{cell.cell} (of {cell.devices_known})")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round (0-based)")
    ax.set_ylabel("devices whose update made the round (count)")
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(title="cell")
    ax.set_title(f"{PLOTS['devices_reporting']}: {name}")
    out["devices_reporting"] = fig
    return out


def write_report(status: RolloutStatus, out: Path) -> Report:
    """Write ``<stem>.png`` for each plot and ``report.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    plots: dict[str, Path] = {}
    for stem, fig in figures(status).items():
        plots[stem] = out / f"{stem}.png"
        fig.savefig(plots[stem], dpi=110)
    path = out / "report.md"
    path.write_text(markdown(status, plots))
    return Report(markdown=path, plots=plots)


def markdown(status: RolloutStatus, plots: dict[str, Path]) -> str:
    s = status.summary
    last = status.rounds[-1] if status.rounds else None
    lines = [f"# Rollout {s.rollout}", "",
             f"{s.algorithm}, {s.status}: {s.rounds_closed} of {s.rounds_planned} rounds closed"
             + (f" (last: round {last.round})" if last else "") + ".", "",
             "| | |", "|---|---|"]
    if last is not None:
        if last.accuracy is not None:
            lines.append(f"| final test accuracy | {last.accuracy:.4f} |")
        if last.loss is not None:
            lines.append(f"| final test loss | {last.loss:.4f} |")
        if last.epsilon is not None:
            lines.append(f"| epsilon spent (largest over devices) | {last.epsilon:.4g} |")
        lines.append(f"| devices reporting in the last round | {last.devices_reported} |")
    for tier, label in TIER_LABELS.items():
        lines.append(f"| bytes {label} | {human_bytes(sum(r.bytes[tier] for r in status.rounds))} |")
    if status.models:
        lines.append(f"| model versions | {len(status.models)} (newest {status.models[-1].version}, "
                     f"sha256 {status.models[-1].sha256[:12]}) |")
    lines.append("")
    for stem, path in plots.items():
        lines += [f"## {PLOTS[stem]}", "", f"![{PLOTS[stem]}]({path.name})", ""]
    return "\n".join(lines)


def _cumulative(values: list[float]) -> list[float]:
    out, acc = [], 0.0
    for v in values:
        acc += v
        out.append(acc)
    return out


def _nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)

"""``fedtier report``: a rollout's PNG plots and a markdown summary that links them.

Each plot is built from ``observe.status`` (the store) as a matplotlib ``Figure`` (no pyplot, no
global state: safe inside a running coordinator), titled, with axes labelled in their units and a
legend wherever there is more than one line; ``figures`` returns them so that a test can read a
plotted value back and compare it with the store.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloud_coordinator.observe.status import RolloutStatus, StoreStatus
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
    "device_accuracy": "Accuracy per device and round",
}
"""File stem -> what the plot shows (the figure's title starts with it)."""


@dataclass(frozen=True)
class Report:
    markdown: Path
    plots: dict[str, Path]


BARS_UP_TO = 20
"""Devices reporting: grouped bars per round up to this many rounds, a line per cell beyond (bars
of 40 rounds and more merge into one block)."""


def figures(status: RolloutStatus, only: str | None = None) -> dict[str, Any]:
    """The report's figures (``matplotlib.figure.Figure``), by file stem (``PLOTS``); ``only``: just that one."""
    builders = {"accuracy_loss": _accuracy_loss, "bytes_per_tier": _bytes_per_tier,
                "accuracy_vs_bytes": _accuracy_vs_bytes, "epsilon": _epsilon, "devices_reporting": _devices_reporting,
                "device_accuracy": _device_accuracy}
    out: dict[str, Any] = {}
    for stem, build in builders.items():
        if only is None or stem == only:
            out[stem] = build(status)
            out[stem].axes[0].set_title(f"{PLOTS[stem]}: {status.summary.rollout}")
    return out


def _figure() -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    return fig, fig.add_subplot()


def _integer_x(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _accuracy_loss(status: RolloutStatus) -> Any:
    fig, ax = _figure()
    rounds = [r.round for r in status.rounds]
    acc = ax.plot(rounds, [_nan(r.accuracy) for r in status.rounds], "o-", color="tab:blue", label="test accuracy")
    ax.set_xlabel("round (0-based)")
    ax.set_ylabel("test accuracy (fraction correct)")
    right = ax.twinx()
    loss = right.plot(rounds, [_nan(r.loss) for r in status.rounds], "s--", color="tab:red", label="test loss")
    right.set_ylabel("test loss (mean per example)")
    ax.legend(handles=[*acc, *loss], loc="center right")
    _integer_x(ax)
    return fig


def _bytes_per_tier(status: RolloutStatus) -> Any:
    fig, ax = _figure()
    rounds = [r.round for r in status.rounds]
    for tier, label in TIER_LABELS.items():
        ax.plot(rounds, _cumulative([r.bytes[tier] / MIB for r in status.rounds]), "o-", label=label)
    ax.set_xlabel("round (0-based)")
    ax.set_ylabel("bytes since the start (MiB)")
    ax.legend(title="tier")
    _integer_x(ax)
    return fig


def _accuracy_vs_bytes(status: RolloutStatus) -> Any:
    fig, ax = _figure()
    total = _cumulative([sum(r.bytes.values()) / MIB for r in status.rounds])
    ax.plot(total, [_nan(r.accuracy) for r in status.rounds], "o-", color="tab:blue", label="test accuracy")
    ax.set_xlabel("bytes on all tiers since the start (MiB)")
    ax.set_ylabel("test accuracy (fraction correct)")
    return fig


def _epsilon(status: RolloutStatus) -> Any:
    fig, ax = _figure()
    if any(r.epsilon is not None for r in status.rounds):
        ax.plot([r.round for r in status.rounds], [_nan(r.epsilon) for r in status.rounds], "o-",
                color="tab:purple", label="epsilon (largest over devices)")
    else:
        ax.text(0.5, 0.5, "no differential privacy: nothing spent", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("round (0-based)")
    ax.set_ylabel("epsilon spent after the round (privacy loss, unitless)")
    _integer_x(ax)
    return fig


def _devices_reporting(status: RolloutStatus) -> Any:
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    rounds = [r.round for r in status.rounds]
    if len(rounds) <= BARS_UP_TO:
        width = 0.8 / max(1, len(status.cells))  # grouped bars: equal counts do not hide one another
        for i, cell in enumerate(status.cells):
            ax.bar([x - 0.4 + width * (i + 0.5) for x in rounds],
                   [r.reported_per_cell.get(cell.cell, 0) for r in status.rounds], width,
                   label=f"{cell.cell} (of {cell.devices_known})")
    else:  # a step line per cell, offset a little so that equal counts stay apart
        spread = 0.15 / max(1, len(status.cells))
        for i, cell in enumerate(status.cells):
            ax.step(rounds, [r.reported_per_cell.get(cell.cell, 0) + spread * (i - (len(status.cells) - 1) / 2)
                             for r in status.rounds], where="mid", label=f"{cell.cell} (of {cell.devices_known})")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round (0-based)")
    ax.set_ylabel("devices whose update made the round (count)")
    ax.set_ylim(bottom=0, top=max([c.devices_known for c in status.cells], default=1) * 1.3 + 0.5)
    _integer_x(ax)
    # above the bars or lines (the y axis leaves room), in columns: it never covers them
    ax.legend(title="cell", loc="upper center", ncols=min(4, max(1, len(status.cells))), fontsize="small")
    return fig


def _device_accuracies(status: RolloutStatus) -> list[tuple[int, list[float], float | None]]:
    """Per round whose devices reported their own evaluation: (round, the devices' accuracies, the combined)."""
    out = []
    for r in status.rounds:
        fed = r.federated or {}
        values = [float(d["accuracy"]) for d in (fed.get("per_device") or {}).values()
                  if d.get("accuracy") is not None]
        if values:
            out.append((r.round, values, fed.get("accuracy")))
    return out


def _device_accuracy(status: RolloutStatus) -> Any:
    """A box per round: the spread of the devices' accuracy, each on its own held-out rows, of the model the round
    started from (``federated.per_device``); the combined federated accuracy beside it."""
    from matplotlib.lines import Line2D

    fig, ax = _figure()
    rounds = _device_accuracies(status)
    if rounds:
        xs = [r for r, _, _ in rounds]
        ax.boxplot([v for _, v, _ in rounds], positions=xs, widths=0.6, whis=(0, 100), manage_ticks=False,
                   medianprops={"color": "tab:blue"})
        combined = ax.plot(xs, [_nan(c) for _, _, c in rounds], "D", color="tab:orange", markersize=4,
                           label="all devices' rows together")
        median = Line2D([], [], color="tab:blue", label="median device (box: quartiles, whiskers: min and max)")
        ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
        ax.set_ylim(-0.02, 1.16)  # room above 1 for the legend: it never covers a box
        ax.set_yticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
        ax.legend(handles=[median, *combined], loc="upper center", ncols=2, fontsize="small")
    else:
        ax.text(0.5, 0.5, "no device reported its own evaluation (devices hold out no rows, privacy is on,\n"
                          "or the model has no accuracy)", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("round (0-based; the model it started from)")
    ax.set_ylabel("accuracy on the device's held-out rows (fraction correct)")
    _integer_x(ax)
    return fig


def png(source: StoreStatus, rollout: str, stem: str) -> bytes:
    """One plot of ``rollout`` as PNG bytes, as the report writes it (the dashboard serves it); the last
    rendering is reused while the rollout has not changed (``KeyError``: no such rollout)."""
    status = source.rollout(rollout)
    key = (rollout, stem, status.summary.status, status.summary.rounds_closed, len(status.models))
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    buffer = io.BytesIO()
    with _render_lock:  # one at a time: matplotlib is not thread-safe (not even its first import)
        figures(status, only=stem)[stem].savefig(buffer, format="png", dpi=90)
    with _cache_lock:
        _cache.clear() if len(_cache) > 64 else None
        _cache[key] = buffer.getvalue()
    return _cache[key]


_cache: dict[tuple[Any, ...], bytes] = {}
_cache_lock = threading.Lock()
_render_lock = threading.Lock()


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
    spread = _last_spread(status)
    if spread is not None:
        lines.append(spread)
    for tier, label in TIER_LABELS.items():
        lines.append(f"| bytes {label} | {human_bytes(sum(r.bytes[tier] for r in status.rounds))} |")
    if status.models:
        lines.append(f"| model versions | {len(status.models)} (newest {status.models[-1].version}, "
                     f"sha256 {status.models[-1].sha256[:12]}) |")
    lines.append("")
    for stem, path in plots.items():
        lines += [f"## {PLOTS[stem]}", "", f"![{PLOTS[stem]}]({path.name})", ""]
    return "\n".join(lines)


def _last_spread(status: RolloutStatus) -> str | None:
    """The summary's row of the newest round whose devices reported their own evaluation: min, median and max
    across devices, and the worst devices (``report.device_spread``)."""
    from cloud_coordinator.report import device_spread

    for r in reversed(status.rounds):
        spread = device_spread((r.federated or {}).get("per_device") or {})
        if spread is not None:
            metric = spread["metric"]
            worst = ", ".join(f"{w['device']} {w[metric]:.4f}" for w in spread["worst"])
            return (f"| device {metric} in round {r.round} ({spread['devices']} devices, each on its own held-out "
                    f"rows) | min {spread['min']:.4f}, median {spread['median']:.4f}, max {spread['max']:.4f}; "
                    f"worst: {worst} |")
    return None


def _cumulative(values: list[float]) -> list[float]:
    out, acc = [], 0.0
    for v in values:
        acc += v
        out.append(acc)
    return out


def _nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)

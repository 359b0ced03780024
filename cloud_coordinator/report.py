"""Rendering round metrics for people: one line per round, summary tables (rich), byte units.

Rounds are numbered from 0 everywhere a person reads them — logs, these lines and tables,
``metrics.json``, the wire — so "round 29" is the same round in all of them; a rollout of 30
rounds runs rounds 0 to 29. The count of rounds closed appears next to it as ``(30/30)``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

TIERS = (("device_up", "device -> edge"), ("device_down", "edge -> device"),
         ("edge_up", "edge -> cloud"), ("cloud_down", "cloud -> edge"))
UPLINKS = (("device_up", "device_up_f32", "device -> edge"), ("edge_up", "edge_up_f32", "edge -> cloud"))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def round_epsilon(row: Mapping[str, Any]) -> float | None:
    """The privacy ledger's epsilon after this round (the largest over devices), if privacy is on."""
    privacy = row.get("privacy") or {}
    value = privacy.get("epsilon_max")
    return None if value is None else float(value)


def epsilon_spent(row: Mapping[str, Any], spec: str = ".3g") -> str:
    """``epsilon 2.4 of 6`` under differential privacy: the largest epsilon any device has spent after
    this round, and the budget (``of inf``: none); empty without privacy."""
    privacy = row.get("privacy")
    if not privacy:
        return ""
    budget = privacy.get("budget_epsilon")
    budget_text = "inf" if budget is None or math.isinf(budget) else f"{budget:g}"
    return f"epsilon {privacy['epsilon_max']:{spec}} of {budget_text}"


WORST_SHOWN = 3
"""How many of a round's worst devices ``rollout status`` and the report name (``--json`` has every device)."""


def device_spread(per_device: Mapping[str, Mapping[str, Any]], worst: int = WORST_SHOWN) -> dict[str, Any] | None:
    """How a round's model did across the devices, each on its own held-out rows (``federated.per_device``).

    Ranked by accuracy when every device has one (lowest first; equal accuracies by the higher loss), else by
    loss (``mse``: highest first); ties by device id.

    Returns:
        ``{"metric", "devices", "min", "median", "max", "worst": [{"device", "accuracy", "loss", "examples",
        "auroc"?}, ...]}`` — ``min``/``median``/``max`` of ``metric`` (``accuracy``, or ``loss``) over the
        devices, ``worst`` the ``worst`` worst devices — or ``None`` without devices.
    """
    if not per_device:
        return None
    by_accuracy = all(d.get("accuracy") is not None for d in per_device.values())
    metric = "accuracy" if by_accuracy else "loss"

    def badness(item: tuple[str, Mapping[str, Any]]) -> tuple[float, float, str]:
        device, d = item
        loss = float(d.get("loss") or 0.0)
        return (float(d["accuracy"]), -loss, device) if by_accuracy else (-loss, 0.0, device)

    ranked = sorted(per_device.items(), key=badness)
    values = sorted(float(d[metric]) for d in per_device.values())
    middle = len(values) // 2
    median = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
    return {"metric": metric, "devices": len(values), "min": values[0], "median": median, "max": values[-1],
            "worst": [{"device": device, **dict(d)} for device, d in ranked[:worst]]}


def round_line(row: dict[str, Any], total_rounds: int) -> str:
    """One line per closed round: accuracy, loss (central test set, and/or the devices' federated
    evaluation of the model the round started from), epsilon spent so far, devices, uplink bytes,
    duration."""
    b = row.get("bytes", {})
    head = f"round {row['round']:>3} ({row['round'] + 1}/{total_rounds})"
    if row.get("attack"):
        head = f"ATTACK RUN  {head}"
    if row.get("loss") is not None:
        head += f"  accuracy {_num(row.get('accuracy'), '.4f')}  loss {_loss(row['loss'])}"
    if row.get("auroc") is not None:
        head += f"  {ranking_text(row)}"
    federated = row.get("federated")
    if federated:
        head += f"  federated accuracy {_num(federated.get('accuracy'), '.4f')} loss {_loss(federated['loss'])}"
    if row.get("privacy"):
        head += f"  {epsilon_spent(row)} (delta {row['privacy']['delta']:g})"
    return (f"{head}  devices {row.get('devices_reported', 0):>3}  up {human_bytes(b.get('device_up', 0))}"
            f"  {row.get('round_s', 0.0):.2f}s")


def ranking_text(row: Mapping[str, Any]) -> str:
    """``auroc 0.9123 pauc@0.3 0.8510 pauc@0.5 0.8790`` (binary tasks; ``cloud_coordinator.metrics_eval``)."""
    return (f"auroc {_num(row.get('auroc'), '.4f')} pauc@0.3 {_num(row.get('pauc_0.3'), '.4f')} "
            f"pauc@0.5 {_num(row.get('pauc_0.5'), '.4f')}")


def totals(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    keys = [k for k, _ in TIERS] + [f32 for _, f32, _ in UPLINKS]
    out = {key: 0 for key in keys}
    for row in rows:
        for key in keys:
            out[key] += int(row.get("bytes", {}).get(key, 0))
    return out


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _loss(value: float | None) -> str:
    """Four decimals; large losses (a model swamped by DP noise) in four significant digits."""
    if value is not None and abs(value) >= 1000:
        return _num(value, ".4g")
    return _num(value, ".4f")


def rounds_table(rows: Sequence[dict[str, Any]], *, compare: Sequence[dict[str, Any]] | None = None) -> Table:
    """Accuracy per round (central and, when devices hold out rows, federated; beside it the same round
    of a run without privacy), epsilon, bytes, time."""
    private = any(r.get("privacy") for r in rows)
    federated = any(r.get("federated") for r in rows)
    ranked = any(r.get("auroc") is not None for r in rows)
    table = Table(title="per round", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("round", justify="right", no_wrap=True)
    table.add_column("accuracy", justify="right")
    if compare is not None:
        table.add_column("without privacy", justify="right")
    table.add_column("loss", justify="right")
    if ranked:
        for name in ("auroc", "pauc@0.3", "pauc@0.5"):
            table.add_column(name, justify="right")
    if federated:
        table.add_column("fed acc", justify="right")
        table.add_column("fed loss", justify="right")
    if private:
        table.add_column("epsilon", justify="right")
    for name in ("devices", "dev up", "dev down", "edge up", "cloud dn", "time"):
        table.add_column(name, justify="right")
    other = {int(r["round"]): r for r in compare or ()}
    for r in rows:
        b = r.get("bytes", {})
        cells = [str(r["round"]), _num(r.get("accuracy"), ".4f")]
        if compare is not None:
            cells.append(_num(other.get(int(r["round"]), {}).get("accuracy"), ".4f"))
        cells.append(_loss(r.get("loss")))
        if ranked:
            cells += [_num(r.get(key), ".4f") for key in ("auroc", "pauc_0.3", "pauc_0.5")]
        if federated:
            fed = r.get("federated") or {}
            cells += [_num(fed.get("accuracy"), ".4f"), _loss(fed.get("loss"))]
        if private:
            cells.append(_num(round_epsilon(r), ".4g"))
        cells += [str(r.get("devices_reported", 0)), human_bytes(b.get("device_up", 0)),
                  human_bytes(b.get("device_down", 0)), human_bytes(b.get("edge_up", 0)),
                  human_bytes(b.get("cloud_down", 0)), f"{r.get('round_s', 0.0):.2f}s"]
        table.add_row(*cells)
    if federated:
        table.caption = ("fed: the devices' evaluation, on rows they never train on, of the model the round "
                         "started from")
    return table


def bytes_table(rows: Sequence[dict[str, Any]]) -> Table:
    """Bytes per tier over all rounds, and what quantization saved on each uplink."""
    t = totals(rows)
    table = Table(title="bytes per tier (all rounds)", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("tier")
    table.add_column("bytes", justify="right")
    table.add_column("exact", justify="right")
    for key, label in TIERS:
        table.add_row(label, human_bytes(t[key]), f"{t[key]:,} B")
    return table


def savings_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """``uplink device -> edge: 12.0 KiB quantized vs 86.0 KiB in float32: saved 74.0 KiB (86 %)``."""
    t = totals(rows)
    lines = []
    for key, f32_key, label in UPLINKS:
        if t[f32_key] > t[key]:
            saved = t[f32_key] - t[key]
            lines.append(f"uplink {label}: {human_bytes(t[key])} quantized vs {human_bytes(t[f32_key])} in float32: "
                         f"saved {human_bytes(saved)} ({100 * saved / t[f32_key]:.0f} %)")
    return lines


def facts_table(facts: Sequence[tuple[str, str]]) -> Table:
    """The run's headline numbers, one per row (final accuracy, epsilon, delta, wall time ...)."""
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in facts:
        table.add_row(key, value)
    return table


def summary(rows: Sequence[dict[str, Any]], wall_s: float, title: str, *,
            facts: Sequence[tuple[str, str]] = (), compare: Sequence[dict[str, Any]] | None = None
            ) -> RenderableType:
    """Everything a run ends with: the title, accuracy per round, bytes per tier, the headline numbers.

    Args:
        rows: the run's round metrics.
        wall_s: its wall time.
        title: first line.
        facts: extra headline rows (privacy: final epsilon and delta ...), after the final accuracy.
        compare: the round metrics of the same run without privacy, shown beside each round.
    """
    head: list[tuple[str, str]] = []
    if rows and rows[-1].get("accuracy") is not None:
        head.append(("final accuracy",
                     f"{rows[-1]['accuracy']:.4f} after {len(rows)} rounds (round {rows[-1]['round']})"))
    elif rows and rows[-1].get("loss") is not None:
        head.append(("final loss", f"{rows[-1]['loss']:.4f} after {len(rows)} rounds (round {rows[-1]['round']})"))
    if rows and rows[-1].get("auroc") is not None:
        head.append(("final ranking", f"{ranking_text(rows[-1])} (test set; pAUC McClish-standardized)"))
    last_fed = next((r["federated"] for r in reversed(rows) if r.get("federated")), None)
    if last_fed is not None:
        what = (f"accuracy {last_fed['accuracy']:.4f}" if last_fed.get("accuracy") is not None
                else f"loss {last_fed['loss']:.4f}")
        head.append(("federated", f"{what} of model version {last_fed['model_version']} "
                                  f"({last_fed['examples']} held-out rows on {last_fed['devices']} devices)"))
    parts: list[RenderableType] = [Text(title), rounds_table(rows, compare=compare), bytes_table(rows)]
    parts += [Text(line) for line in savings_lines(rows)]
    parts.append(facts_table([*head, *facts, ("wall time", f"{wall_s:.1f} s")]))
    return Group(*parts)

"""Rendering round metrics for people: one line per round, a summary table, byte units.

Rounds are numbered from 0 everywhere a person reads them — logs, these lines and tables,
``metrics.json``, the wire — so "round 29" is the same round in all of them; a rollout of 30
rounds runs rounds 0 to 29. The count of rounds closed appears next to it as ``(30/30)``.
"""

from __future__ import annotations

from typing import Any, Sequence

TIERS = (("device_up", "device -> edge"), ("device_down", "edge -> device"),
         ("edge_up", "edge -> cloud"), ("cloud_down", "cloud -> edge"))
UPLINKS = (("device_up", "device_up_f32", "device -> edge"), ("edge_up", "edge_up_f32", "edge -> cloud"))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def round_line(row: dict[str, Any], total_rounds: int) -> str:
    """One line per closed round: accuracy, loss, devices, device uplink bytes, duration."""
    b = row.get("bytes", {})
    head = f"round {row['round']:>3} ({row['round'] + 1}/{total_rounds})"
    if row.get("accuracy") is not None:
        head += f"  accuracy {row['accuracy']:.4f}  loss {row['loss']:.4f}"
    return (f"{head}  devices {row.get('devices_reported', 0):>3}  up {human_bytes(b.get('device_up', 0))}"
            f"  {row.get('round_s', 0.0):.2f}s")


def progress_bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "-" * (width - filled) + f"] {done}/{total} rounds"


def totals(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    keys = [k for k, _ in TIERS] + [f32 for _, f32, _ in UPLINKS]
    out = {key: 0 for key in keys}
    for row in rows:
        for key in keys:
            out[key] += int(row.get("bytes", {}).get(key, 0))
    return out


def summary_table(rows: Sequence[dict[str, Any]], wall_s: float, title: str) -> str:
    """Accuracy per round, then bytes per tier and wall time."""
    lines = [title, "", f"{'round':>5}  {'accuracy':>8}  {'loss':>7}  {'devices':>7}  {'dev up':>10}  "
             f"{'dev down':>10}  {'edge up':>10}  {'cloud dn':>10}  {'time':>6}"]
    for r in rows:
        b = r.get("bytes", {})
        acc = f"{r['accuracy']:.4f}" if r.get("accuracy") is not None else "-"
        loss = f"{r['loss']:.4f}" if r.get("loss") is not None else "-"
        lines.append(f"{r['round']:>5}  {acc:>8}  {loss:>7}  {r.get('devices_reported', 0):>7}  "
                     f"{human_bytes(b.get('device_up', 0)):>10}  {human_bytes(b.get('device_down', 0)):>10}  "
                     f"{human_bytes(b.get('edge_up', 0)):>10}  {human_bytes(b.get('cloud_down', 0)):>10}  "
                     f"{r.get('round_s', 0.0):>5.2f}s")
    t = totals(rows)
    lines += ["", "bytes per tier (all rounds):"]
    for key, label in TIERS:
        lines.append(f"  {label:<16} {human_bytes(t[key]):>12}  ({t[key]:,} B)")
    for key, f32_key, label in UPLINKS:
        if t[f32_key] > t[key]:
            saved = t[f32_key] - t[key]
            lines.append(f"uplink {label}: {human_bytes(t[key])} quantized vs {human_bytes(t[f32_key])} in float32: "
                         f"saved {human_bytes(saved)} ({100 * saved / t[f32_key]:.0f} %)")
    if rows and rows[-1].get("accuracy") is not None:
        last = rows[-1]
        lines.append(f"final accuracy:    {last['accuracy']:.4f} after {len(rows)} rounds (round {last['round']})")
    lines.append(f"wall time:         {wall_s:.1f} s")
    return "\n".join(lines)

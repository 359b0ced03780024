"""``fedtier plan``: thin commands over :mod:`cloud_coordinator.planner`."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from cloud_coordinator import planner
from cloud_coordinator.planner import MODES, UPLOADS, InfeasiblePlanError, Plan, PlanInputs
from fedtier.errors import ConfigError

# PlanInputs field -> the option that sets it, so library errors name what the user typed.
OPTION_FOR_FIELD = {
    "C": "--C",
    "N": "--N",
    "q1": "--q1",
    "t_cp": "--t-cp",
    "t_de": "--t-de",
    "t_ec": "--t-ec",
    "round_budget_s": "--budget",
    "uploads": "--uploads",
    "mode": "--mode",
}


@click.group()
def plan() -> None:
    """Plan learning parameters for a round-time budget (per algorithm)."""


@plan.command("qhetfed")
@click.option("--C", "c_sets", type=int, required=True,
              help="Number of edge servers C, which is also the number of device sets (>= 1).")
@click.option("--N", "n_devices", type=int, required=True,
              help="Total number of devices N over all sets (>= C).")
@click.option("--q1", type=float, required=True,
              help="Variance factor q1 of the device->edge quantizer Q1, E|Q(x)-x|^2 <= q1 |x|^2 (>= 0; "
                   "0 = no quantization). The paper's run uses 11.9.")
@click.option("--t-cp", "t_cp", type=float, required=True,
              help="t_CP: seconds one device needs for one mini-batch gradient step (> 0).")
@click.option("--t-de", "t_de", type=float, required=True,
              help="t_DE: seconds for one device->edge upload of a quantized gradient or model delta (> 0).")
@click.option("--t-ec", "t_ec", type=float, required=True,
              help="t_EC: seconds for the edge->cloud exchange that ends every global round (> 0; "
                   "usually much larger than t_DE).")
@click.option("--budget", "budget", type=float, required=True,
              help="Wall-time budget of one global round in seconds, T_d/T in the paper (> 0).")
@click.option("--mode", type=click.Choice(MODES), default="robust", show_default=True,
              help="robust = integer search that always returns a feasible plan; paper = the paper's closed "
                   "form (47)-(49) as printed, real-valued and possibly infeasible (gamma < 1).")
@click.option("--uploads", type=click.Choice(UPLOADS), default="tau", show_default=True,
              help="Device->edge uploads charged per round: tau as in eq. (42), or tau+1 as Algorithm 1 "
                   "actually sends (tau gradients plus the final local-step delta).")
@click.option("--json", "as_json", is_flag=True, help="Print the inputs and the plan as JSON.")
def qhetfed(c_sets: int, n_devices: int, q1: float, t_cp: float, t_de: float, t_ec: float, budget: float,
            mode: str, uploads: str, as_json: bool) -> None:
    """Choose QHetFed's tau (intra-set gradient rounds) and gamma (local SGD steps) per global round.

    Minimises the paper's objective (43) subject to the round time (42),
    (tau + gamma)*t_CP + tau*t_DE + t_EC <= --budget, using the whole budget
    (seed paper 003, Sec. IV). All times are in seconds.

    Example (the paper's Table III setting):

    \b
        fedtier plan qhetfed --C 3 --N 60 --q1 11.9 --t-cp 0.049152 --t-de 3.33557 --t-ec 33.3557 --budget 156
    """
    try:
        inputs = PlanInputs(C=c_sets, N=n_devices, q1=q1, t_cp=t_cp, t_de=t_de, t_ec=t_ec,
                            round_budget_s=budget, uploads=uploads)
        result = planner.plan(inputs, mode=mode)
    except ConfigError as exc:
        message = str(exc).removeprefix(f"[{exc.key}] ")
        raise click.BadParameter(message, param_hint=f"'{OPTION_FOR_FIELD.get(exc.key or '', exc.key)}'") from None
    except InfeasiblePlanError as exc:
        raise click.BadParameter(str(exc), param_hint="'--budget'") from None
    if as_json:
        click.echo(json.dumps({"inputs": asdict(inputs), "plan": result.to_json()}, indent=1))
    else:
        click.echo(render(inputs, result))


def render(inputs: PlanInputs, result: Plan) -> str:
    """The human-readable report of one plan.

    Args:
        inputs: the instance that was planned.
        result: its plan.

    Returns:
        A multi-line string (no trailing newline).
    """
    lines: list[str] = []
    if not result.feasible:
        lines.append("WARNING: INFEASIBLE plan: the paper's closed form gives a (tau, gamma) that cannot be run "
                     "(see notes); use --mode robust.")
    lines.append(f"QHetFed plan ({result.mode} mode, {inputs.uploads} uploads per round)")
    share = 100.0 * result.round_time_s / inputs.round_budget_s
    rows = [
        ("tau (intra-set gradient rounds)", _num(result.tau)),
        ("gamma (local SGD steps)", _num(result.gamma)),
        ("objective J, eq. (43)" if result.mode == "robust" else "objective J, eq. (45)", f"{result.objective:.6g}"),
        ("round time, eq. (42)", f"{result.round_time_s:.6g} s of {inputs.round_budget_s:g} s budget "
                                 f"({share:.2f} %)"),
        ("a = (C/N)(1 + q1)", f"{result.a:.6g}"),
        ("r = t_DE / t_CP", f"{result.r:.6g}"),
        ("K (compute-step slots per round)", f"{result.K:.6g}"),
        ("tau_max (gamma = 1)", str(result.tau_max)),
    ]
    width = max(len(label) for label, _ in rows)
    lines.extend(f"  {label:<{width}}  {value}" for label, value in rows)
    if result.notes:
        lines.append("notes:")
        lines.extend(f"  - {note}" for note in result.notes)
    return "\n".join(lines)


def _num(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"

"""``fedtier plan``: thin commands over :mod:`fedtier.algorithms.qhetfed_plan`."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import click

from fedtier.algorithms import qhetfed_plan
from fedtier.algorithms.qhetfed_plan import MODES, UPLOADS, InfeasiblePlanError, Plan, PlanInputs
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
        result = qhetfed_plan.plan(inputs, mode=mode)
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


@plan.command("hsgd")
@click.option("--P", "p_global", type=int, default=10, show_default=True,
              help="P, iterations per global (cloud) round; a multiple of --Q.")
@click.option("--Q", "q_local", type=int, default=5, show_default=True,
              help="Q, iterations per local interval (embedding exchange and edge average of theta2).")
@click.option("--theta0", type=int, default=1000, show_default=True, help="|theta0|, values in the combined head.")
@click.option("--theta1", type=int, default=5000, show_default=True, help="|theta1|, values in the host's encoder.")
@click.option("--theta2", type=int, default=2000, show_default=True, help="|theta2|, values in the device encoder.")
@click.option("--selected", type=int, default=10, show_default=True,
              help="|A|, devices selected per group and interval (round(alpha K_m)).")
@click.option("--d1", type=int, default=16, show_default=True, help="Width of the host's embedding zeta1.")
@click.option("--d2", type=int, default=16, show_default=True, help="Width of a device's embedding zeta2.")
@click.option("--groups", "m_groups", type=int, default=1, show_default=True, help="M, groups (cells).")
@click.option("--iterations", "t_total", type=int, default=1000, show_default=True, help="T, total iterations.")
@click.option("--bits-embedding", type=int, default=32, show_default=True,
              help="Compression level of the vertical path on every hop (32 = float32, HSGD; 2..8: the QSGD width, "
                   "or with --compressor topk each row keeps bits/32 of its entries; the paper's C-HSGD is 7).")
@click.option("--compressor", type=click.Choice(["qsgd", "topk"]), default="qsgd", show_default=True,
              help="qsgd: QSGD row by row, a 4-byte scale per row (this project's substitute); topk: top-k "
                   "sparsification row by row, an index and a float32 per kept entry (the paper's C-HSGD).")
@click.option("--classes", type=int, default=0, show_default=True,
              help="C, the head's classes: theta0 is then C rows of d1 + d2 and a bias of C, as fedtier's split "
                   "model lays it out (|theta0| must be C (d1 + d2 + 1)); 0 = theta0 as one row.")
@click.option("--F0", "f0", type=float, default=2.3, show_default=True,
              help="F(theta^0), the initial global loss (strategy 2; from a short pre-training).")
@click.option("--rho", type=float, default=1.0, show_default=True, help="rho, the gradient's Lipschitz constant.")
@click.option("--eta", type=float, default=0.01, show_default=True, help="eta, the learning rate.")
@click.option("--delta", type=float, default=0.5, show_default=True,
              help="delta, the bound on the stochastic gradients' standard deviation.")
@click.option("--grad-sq", type=float, default=1.0, show_default=True,
              help="|grad F|^2 at the interval's start (strategy 3).")
@click.option("--xi", type=float, default=None,
              help="Target bound Xi of Theorem 1 (strategy 1's bound on Lambda = P/Q; omitted: not computed).")
@click.option("--json", "as_json", is_flag=True, help="Print the inputs and the results as JSON.")
def hsgd(p_global: int, q_local: int, theta0: int, theta1: int, theta2: int, selected: int, d1: int, d2: int,
         m_groups: int, t_total: int, bits_embedding: int, compressor: str, classes: int, f0: float, rho: float,
         eta: float, delta: float, grad_sq: float, xi: float | None, as_json: bool) -> None:
    """HSGD's communication cost (eq. (19)) and adaptive strategies 1-3 (seed paper 000, Sec. VI).

    Strategy 2 is shown as printed in the paper (eta^2) and as eq. (20) actually gives (eta^3); the
    report flags when they differ. The default sizes are an illustration, not the paper's (it gives no
    layer sizes): 47,640 values, 190,560 bytes per group and round in float32. Bytes price each item as
    the wire carries it (--bits-embedding, --compressor).

    Example:

    \b
        fedtier plan hsgd --P 10 --Q 5 --theta0 1000 --theta1 5000 --theta2 2000 --selected 10 --d1 16 --d2 16
    """
    from fedtier.algorithms import hsgd_plan
    from fedtier.errors import LocalProtocolError

    inputs = {"P": p_global, "Q": q_local, "theta0": theta0, "theta1": theta1, "theta2": theta2,
              "selected": selected, "d1": d1, "d2": d2, "M": m_groups, "T": t_total, "bits_embedding": bits_embedding,
              "compressor": compressor, "classes": classes,
              "F0": f0, "rho": rho, "eta": eta, "delta": delta, "grad_sq": grad_sq, "xi": xi}
    if bits_embedding != 32 and not 2 <= bits_embedding <= 8:
        raise click.BadParameter("must be 32 (float32) or 2..8", param_hint="'--bits-embedding'")
    sizes = hsgd_plan.Sizes(theta0=theta0, theta1=theta1, theta2=theta2, selected=selected, d1=d1, d2=d2,
                            classes=classes)
    try:
        sizes.head_shapes()
    except LocalProtocolError as exc:
        raise click.BadParameter(str(exc), param_hint="'--classes'") from None
    try:
        cost_round = hsgd_plan.cost_round(sizes, p_global, q_local)
        s2_paper = hsgd_plan.strategy2(F0=f0, rho=rho, eta=eta, delta=delta, T=t_total, mode="paper")
        s2_derived = hsgd_plan.strategy2(F0=f0, rho=rho, eta=eta, delta=delta, T=t_total, mode="derived")
        eta2, eta_star = hsgd_plan.strategy3(P=p_global, Q=q_local, rho=rho, delta=delta, grad_sq=grad_sq)
    except LocalProtocolError as exc:
        raise click.BadParameter(str(exc), param_hint="'--P'/'--Q'" if "P=" in str(exc) else None) from None
    bound = None if xi is None else hsgd_plan.lambda_bound(P=p_global, rho=rho, eta=eta, delta=delta, xi=xi, dF=f0,
                                                           T=t_total)
    result: dict[str, Any] = {
        "cost_round_values": cost_round,
        "cost_round_bytes": hsgd_plan.bytes_round(sizes, p_global, q_local, bits_embedding, compressor),
        "vertical_hop_bytes": hsgd_plan.vertical_hop_bytes(sizes, bits_embedding, compressor),
        "cost_total_values": hsgd_plan.cost_total(sizes, p_global, q_local, m_groups, t_total),
        "strategy1": {"lambda_bound": None if bound is None or bound == float("inf") else bound,
                      "xi_reachable": None if bound is None else bound != float("inf"),
                      "rule": "P = Q (Lambda = 1)",
                      "p_equals_q_admissible": None if bound is None else bool(bound <= 1)},
        "strategy2": {"paper": {"value": s2_paper[0], "P=Q": s2_paper[1]},
                      "derived": {"value": s2_derived[0], "P=Q": s2_derived[1]},
                      "differs": s2_paper[1] != s2_derived[1]},
        "strategy3": {"eta2": eta2, "eta_max": 1.0 / (8 * p_global * rho), "eta_star": eta_star},
    }
    if as_json:
        click.echo(json.dumps({"inputs": inputs, "plan": result}, indent=1, default=str))
        return
    lines = [f"HSGD plan (P={p_global}, Q={q_local}, Lambda={p_global // q_local}, M={m_groups}, T={t_total})",
             f"  paper cost per group and round   {cost_round} values = {result['cost_round_bytes']:.0f} bytes"
             f"{'' if bits_embedding == 32 else f' ({bits_embedding}-bit {compressor} vertical path)'}",
             f"  vertical path, every hop         {result['vertical_hop_bytes']} bytes per interval "
             "(relays and downlinks included)",
             f"  eq. (19) total                   {result['cost_total_values']:.6g} values",
             "strategy 1 (Prop. 1): use P = Q",
             "  lower bound on Lambda            " + ("(give --xi)" if bound is None else
                                                      f"{bound:.6g}" + (" -> P = Q admissible" if bound <= 1 else
                                                                        " -> P = Q does not meet --xi at this eta")),
             "strategy 2 (Prop. 2): P* = Q*",
             f"  as printed (eta^2)               {s2_paper[0]:.6g} -> {s2_paper[1]}",
             f"  as eq. (20) gives (eta^3)        {s2_derived[0]:.6g} -> {s2_derived[1]}",
             "strategy 3 (Prop. 3): learning rate",
             f"  eta_2                            {eta2:.6g}",
             f"  eta* = min(eta_2, 1/(8 P rho))   {eta_star:.6g}"]
    if result["strategy2"]["differs"]:
        lines.append("WARNING: strategy 2's printed formula and its derivation disagree "
                     f"({s2_paper[1]} vs {s2_derived[1]}); the printed form is the paper's, the derived one "
                     "follows from eq. (20). See docs/hsgd.md.")
    click.echo("\n".join(lines))

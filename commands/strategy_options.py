"""Command-line options for strategies, shared by ``fedtier simulate`` and ``fedtier demo``.

Each option maps onto a key of the rollout config (docs/strategies.md): ``[aggregation]``,
``[server_optimizer]``, ``[edge_optimizer]``, ``[attack]``, and the algorithm's ``proximal_mu``/``partial_work``.
Options override what a config file says; the merged config is validated as a file would be.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import click

from fedtier import algorithms

KINDS = ("sgd", "momentum", "adam", "yogi", "adagrad")
ATTACKS = ("sign_flip", "gaussian", "label_flip", "stale_replay")

_OPTIONS = [
    click.option("--edge-aggregator", default=None, metavar="RULE",
                 help="Edge rule over its devices' changes: mean, median, trimmed_mean, krum, multi_krum, "
                      "norm_bounded_mean or package.module:Class ([aggregation] edge)."),
    click.option("--cloud-aggregator", default=None, metavar="RULE", help="Cloud rule over the cells' changes."),
    click.option("--trim", type=click.FloatRange(0, 0.5, max_open=True), default=None,
                 help="trimmed_mean: share dropped at each end."),
    click.option("--byzantine", type=click.IntRange(0), default=None, help="krum, multi_krum: f."),
    click.option("--select", type=click.IntRange(1), default=None, help="multi_krum: m."),
    click.option("--max-norm", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="norm_bounded_mean: the L2 bound."),
    click.option("--server-optimizer", type=click.Choice(KINDS), default=None,
                 help="The cloud's step on the aggregated change (Reddi et al., Algorithm 2)."),
    click.option("--server-lr", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="The server optimizer's learning rate."),
    click.option("--edge-optimizer", type=click.Choice(KINDS), default=None,
                 help="The same step at each edge, on its cell's change (state in the edge's store)."),
    click.option("--edge-lr", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="The edge optimizer's learning rate."),
    click.option("--attack", type=click.Choice(ATTACKS), default=None,
                 help="Robustness test: a seeded share of the devices attacks (every output says so)."),
    click.option("--attack-fraction", type=click.FloatRange(0, 1), default=None,
                 help="With --attack: share of the devices that attack [default: 0.2]."),
    click.option("--attack-scale", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="With --attack: sign_flip's factor, gaussian's deviation [default: 10]."),
    click.option("--proximal-mu", type=click.FloatRange(min=0), default=None,
                 help="FedProx's mu (fedavg, hier_qsgd; ort trainers)."),
    click.option("--partial-work", is_flag=True, default=False,
                 help="Devices run a seeded 1..local_steps steps per round and still send their update."),
]

NAMES = ("edge_aggregator", "cloud_aggregator", "trim", "byzantine", "select", "max_norm", "server_optimizer",
         "server_lr", "edge_optimizer", "edge_lr", "attack", "attack_fraction", "attack_scale", "proximal_mu",
         "partial_work")


def strategy_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add every strategy option to a click command (its function takes them as keyword arguments)."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def pop_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the strategy options out of a command's keyword arguments."""
    return {name: kwargs.pop(name) for name in NAMES}


def overrides(values: Mapping[str, Any], algorithm: str) -> dict[str, dict[str, Any]]:
    """The config tables the given options set (only options that were given).

    Raises:
        click.UsageError: an option that needs another one without it.
    """
    out: dict[str, dict[str, Any]] = {}
    agg = {k: values[o] for k, o in (("edge", "edge_aggregator"), ("cloud", "cloud_aggregator"), ("trim", "trim"),
                                     ("byzantine", "byzantine"), ("select", "select"), ("max_norm", "max_norm"))
           if values.get(o) is not None}
    if agg:
        out["aggregation"] = agg
    if values.get("server_lr") is not None and values.get("server_optimizer") is None:
        raise click.UsageError("--server-lr needs --server-optimizer")
    if values.get("server_optimizer") is not None:
        out["server_optimizer"] = {"kind": values["server_optimizer"],
                                   **({"lr": values["server_lr"]} if values.get("server_lr") is not None else {})}
    if values.get("edge_lr") is not None and values.get("edge_optimizer") is None:
        raise click.UsageError("--edge-lr needs --edge-optimizer")
    if values.get("edge_optimizer") is not None:
        out["edge_optimizer"] = {"kind": values["edge_optimizer"],
                                 **({"lr": values["edge_lr"]} if values.get("edge_lr") is not None else {})}
    given = [f"--{o.replace('_', '-')}" for o in ("attack_fraction", "attack_scale") if values.get(o) is not None]
    if given and values.get("attack") is None:
        raise click.UsageError(f"{', '.join(given)} need --attack")
    if values.get("attack") is not None:
        out["attack"] = {"kind": values["attack"],
                         **({"fraction": values["attack_fraction"]} if values.get("attack_fraction") is not None
                            else {}),
                         **({"scale": values["attack_scale"]} if values.get("attack_scale") is not None else {})}
    section = {**({"proximal_mu": values["proximal_mu"]} if values.get("proximal_mu") is not None else {}),
               **({"partial_work": True} if values.get("partial_work") else {})}
    if section:
        if not algorithms.describe(algorithm).proximal:
            raise click.UsageError(f"--proximal-mu and --partial-work are for "
                                   f"{' and '.join(algorithms.names('proximal'))}, not {algorithm}")
        out[algorithm] = section
    return out

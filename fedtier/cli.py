"""The ``fedtier`` command. Role subcommands load lazily (click's LazyGroup pattern).

``fedtier agent ...`` imports only ``device_agent`` (never torch), ``fedtier edge ...``
only ``edge_broker``; the coordinator's commands import torch when they run. Library
errors are turned into exit codes in one place, ``FedtierGroup.invoke``:
``ConfigError`` -> 2 (usage), any other ``FedtierError`` -> 1.

Every ``fedtier`` process answers SIGINT (Ctrl-C), even when it inherited SIGINT ignored
(``interruptible``).
"""

from __future__ import annotations

import importlib
import signal
import threading
from typing import Any

import click

from fedtier import __version__
from fedtier.errors import ConfigError, FedtierError

LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "agent": ("device_agent.cli", "agent"),
    "edge": ("edge_broker.cli", "edge"),
    "coordinator": ("commands.coordinator", "coordinator"),
    "simulate": ("commands.coordinator", "simulate"),
    "demo": ("commands.demo", "demo"),
    "broker": ("fedtier.embedded_broker.command", "broker"),
    "plan": ("commands.plan", "plan"),
    "provision": ("provisioning.cli", "provision"),
    "privacy": ("commands.privacy", "privacy"),
    "data": ("commands.data", "data"),
    "init": ("commands.init", "init"),
    "report": ("commands.report", "report"),
    "rollout": ("commands.rollout", "rollout"),
    "devices": ("commands.rollout", "devices"),
    "fleet": ("commands.fleet", "fleet"),
}

SHORT_HELP = {
    "agent": "Run a device agent (on-device training over MQTT).",
    "edge": "Run the edge service of one cell (on a gateway).",
    "coordinator": "Run the cloud coordinator of a rollout.",
    "simulate": "Run a rollout in one process over the in-memory transport.",
    "demo": "Run a whole hierarchy on this machine over a real MQTT broker.",
    "broker": "Run the embedded pure-Python MQTT broker.",
    "plan": "Plan an algorithm's parameters under a time budget (QHetFed's tau, gamma).",
    "provision": "Provision the fleet: CA, certificates, bundles, broker ACLs, revocation.",
    "privacy": "Differential privacy: a rollout's noise plan, and its ledger's epsilon report.",
    "data": "Your own data: split a CSV or .npz table into per-device shards.",
    "init": "Write a commented starter rollout (your own model and data) to edit.",
    "report": "Plot a rollout from the coordinator's store (PNGs and a markdown summary).",
    "rollout": "Operate rollouts: create, start, pause, status, models, export, promote, rollback.",
    "devices": "The device inventory: presence, versions, last round contributed.",
    "fleet": "Emulate a large fleet on this machine through a real Mosquitto, and time its rounds.",
}


class FedtierGroup(click.Group):
    """Loads subcommands on first use and maps library errors to exit codes."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(LAZY_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = LAZY_COMMANDS.get(name)
        if target is None:
            return None
        module = importlib.import_module(target[0])
        command = getattr(module, target[1])
        if not isinstance(command, click.Command):
            raise TypeError(f"{target} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing commands must not import them (that would import torch for `fedtier --help`).
        rows = [(name, SHORT_HELP[name]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
        except FedtierError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from None


@click.group(cls=FedtierGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fedtier")
def cli() -> None:
    """fedtier: hierarchical federated learning for fleets of small devices.

    Devices train ONNX models with onnxruntime-training and publish updates over MQTT to an
    edge per cell; edges aggregate and forward to a cloud coordinator.

    Start with `fedtier demo`: a coordinator, 2 edges and 12 device agents on this machine.
    """


def interruptible() -> None:
    """Undo an inherited "ignore SIGINT", so that Ctrl-C and ``kill -INT`` stop this process.

    A non-interactive shell starts its ``&`` jobs with SIGINT ignored, and Python keeps an
    inherited ignore (it installs its ``KeyboardInterrupt`` handler only over the default). A
    ``fedtier demo`` started that way then ignored SIGINT, and whoever stopped it with SIGINT
    waited for ever. A handler set explicitly (a node's ``mqtt_service``, the embedded broker's)
    is left alone; so is SIGINT outside the main thread, where Python cannot set it.
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    interruptible()
    try:
        cli.main(args=argv, prog_name="fedtier", standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    return 0

"""The ``fedtier`` command: every --help works; errors become clear messages and exit codes."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fedtier.cli import LAZY_COMMANDS, cli


def all_command_paths() -> list[list[str]]:
    paths: list[list[str]] = [[]]
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        cmd = cli.get_command(ctx, name)
        paths.append([name])
        if isinstance(cmd, click.Group):
            paths.extend([name, sub] for sub in cmd.list_commands(ctx))
    return paths


@pytest.mark.parametrize("args", all_command_paths(), ids=lambda a: " ".join(a) or "fedtier")
def test_every_command_has_help(args: list[str]) -> None:
    result = CliRunner().invoke(cli, [*args, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and len(result.output) > 80


def test_lazy_commands_match_the_group() -> None:
    assert set(LAZY_COMMANDS) == {"agent", "edge", "coordinator", "simulate", "demo", "broker", "plan", "provision",
                                  "privacy", "data", "init", "report", "rollout", "devices", "fleet"}


@pytest.mark.parametrize("command", [["agent", "run"], ["edge", "run"], ["coordinator", "run"], ["simulate"]])
def test_a_bad_config_key_is_a_usage_error_naming_the_key(tmp_path: Path, command: list[str]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('no_such_key = 1\n')
    result = CliRunner().invoke(cli, [*command, "--config", str(config)])
    assert result.exit_code == 2
    assert "no_such_key" in result.output and str(config) in result.output


def test_a_missing_config_file_is_reported(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["edge", "run", "--config", str(tmp_path / "nope.toml")])
    assert result.exit_code == 2 and "file not found" in result.output


def test_a_wrongly_typed_value_names_key_and_value(tmp_path: Path) -> None:
    config = tmp_path / "edge.toml"
    config.write_text('cell = "cell-a"\nstate_dir = "s"\n[cell_broker]\nport = "eighteen"\n')
    result = CliRunner().invoke(cli, ["edge", "run", "--config", str(config)])
    assert result.exit_code == 2
    assert "[cell_broker.port] expected an integer" in result.output


def test_demo_rejects_more_cells_than_devices() -> None:
    result = CliRunner().invoke(cli, ["demo", "--devices", "1", "--cells", "2"])
    assert result.exit_code != 0


@pytest.mark.parametrize("bind", ["localhost:http", "127.0.0.1:70000"])
def test_coordinator_run_refuses_a_bad_http_address(tmp_path: Path, bind: str) -> None:
    config = tmp_path / "rollout.toml"
    config.write_text('rollout = "r"\n')
    result = CliRunner().invoke(cli, ["coordinator", "run", "--config", str(config), "--http", bind])
    assert result.exit_code == 2
    assert "--http" in result.output and "HOST:PORT" in result.output


def test_fedtier_answers_sigint_even_when_started_with_it_ignored() -> None:
    """A script's background job (``fedtier demo &``) inherits SIGINT ignored, and Python keeps that; ``fedtier``
    undoes it, so SIGINT (Ctrl-C, ``kill -INT``) stops it as in a terminal. A handler it sets itself stays."""
    import signal
    import subprocess
    import sys

    code = ("import signal; from fedtier.cli import main; before = signal.getsignal(signal.SIGINT); "
            "main(['--version']); print(before is signal.SIG_IGN, signal.getsignal(signal.SIGINT) is "
            "signal.default_int_handler)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert out.stdout.split()[-2:] == ["True", "True"], out.stdout + out.stderr

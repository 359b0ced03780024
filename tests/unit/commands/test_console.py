"""Progress and tables (rich): a live bar on a terminal, plain round lines when piped, nothing with --json.

The command-level tests run the real ``fedtier simulate`` (a small private rollout, so the bar
also carries an epsilon) three ways: piped, in terminal mode forced by FEDTIER_FORCE_TERMINAL,
and on a real pseudo-terminal that rich detects by itself.
"""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from commands.console import FORCE_TERMINAL_ENV, RoundProgress, make_console
from local_fleet.demo import default_artifact_store
from cloud_coordinator.report import round_line, summary

ESC = "\x1b"
ROUNDS = 4
ROUND_LINE = re.compile(r"^round\s+\d+ \((\d+)/4\)  accuracy [0-9.]+  loss [0-9.]+  epsilon [0-9.]+ of [0-9.]+ "
                        r"\(delta 1e-05\)", re.M)
BAR = re.compile(r"round\s+\d/4 .*remaining")


def rollout(tmp_path: Path) -> Path:
    config = tmp_path / "rollout.toml"
    config.write_text(f"""
rollout = "console"
algorithm = "fedavg"
rounds = {ROUNDS}
seed = 0
state_dir = "{tmp_path / 'state'}"
artifact_store = "{default_artifact_store()}"

[model]
hidden = [16]

[data]
dataset = "digits"

[topology]
cells = 2
devices_per_cell = 2
trusted = {{ cell-a = true }}

[fedavg]
local_steps = 2

[privacy]
epsilon = 8
clip = 1.0
require_tls = false
noise_seed = 3
""")
    return config


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (FORCE_TERMINAL_ENV, "COLUMNS", "FORCE_COLOR",
                                                                 "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    return {**env, **extra}


def simulate(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "fedtier", "simulate", "--config", str(rollout(tmp_path)),
           "--output", str(tmp_path / "metrics.json"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env or environment())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def piped(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    return simulate(tmp_path_factory.mktemp("piped"))


def test_piped_output_has_the_round_lines_and_no_control_characters(piped: subprocess.CompletedProcess[str]) -> None:
    assert ESC not in piped.stderr and ESC not in piped.stdout
    assert "\r" not in piped.stderr
    assert [int(m) for m in ROUND_LINE.findall(piped.stderr)] == list(range(1, ROUNDS + 1))
    assert "remaining" not in piped.stderr  # no bar
    # the summary: rich tables on stdout, with the ledger's epsilon
    assert "per round" in piped.stdout and "bytes per tier" in piped.stdout
    assert re.search(r"epsilon \(ledger\)\s+8 of 8 at delta 1e-05", piped.stdout), piped.stdout


def test_forced_terminal_mode_shows_the_live_bar_above_which_the_lines_stay(tmp_path: Path) -> None:
    proc = simulate(tmp_path, env=environment(**{FORCE_TERMINAL_ENV: "1"}))
    assert ESC + "[" in proc.stderr
    bars = BAR.findall(_strip_ansi(proc.stderr))
    assert bars, proc.stderr[-2000:]
    # the last frame (rendered when the bar stops) shows every round done and the ledger's epsilon
    last = _strip_ansi(proc.stderr).split("\r")[-2:]
    assert any("round 4/4" in frame and "epsilon 8" in frame and "accuracy" in frame for frame in last), last
    assert [int(m) for m in ROUND_LINE.findall(_strip_ansi(proc.stderr))] == list(range(1, ROUNDS + 1))


def test_a_real_terminal_is_detected_without_the_variable(tmp_path: Path) -> None:
    """stderr on a pseudo-terminal: rich detects it and draws the bar."""
    master, slave = pty.openpty()
    cmd = [sys.executable, "-m", "fedtier", "simulate", "--config", str(rollout(tmp_path)),
           "--output", str(tmp_path / "metrics.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=slave, env=environment())
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=180) == 0
    out = b"".join(chunks).decode(errors="replace")
    assert ESC + "[" in out
    assert BAR.search(_strip_ansi(out)), out[-2000:]


def test_json_prints_the_document_and_nothing_else(tmp_path: Path) -> None:
    proc = simulate(tmp_path, "--json", env=environment(**{FORCE_TERMINAL_ENV: "1"}))
    doc = json.loads(proc.stdout)
    assert len(doc["rounds"]) == ROUNDS
    # No bar and no round lines; log records (the coordinator's warning that noise dominates) may remain.
    people = [line for line in proc.stderr.splitlines() if " WARNING " not in line and " INFO " not in line]
    assert ESC not in proc.stderr and not any(line.startswith("round") for line in people), proc.stderr


# --- the building blocks ---------------------------------------------------------------------------


def row(r: int, eps: float | None = None) -> dict:
    out = {"round": r, "accuracy": 0.5 + r / 100, "loss": 1.0, "devices_reported": 4, "round_s": 0.1,
           "bytes": {"device_up": 4096, "device_down": 4096, "edge_up": 1024, "cloud_down": 1024,
                     "device_up_f32": 8192, "edge_up_f32": 1024}}
    if eps is not None:
        out["privacy"] = {"epsilon_max": eps, "delta": 1e-5}
    return out


def test_round_progress_on_a_plain_console_writes_only_the_lines() -> None:
    buf = io.StringIO()
    with RoundProgress(Console(file=buf, force_terminal=False), 2) as progress:
        for r in range(2):
            progress.line(round_line(row(r, 1.5 * (r + 1)), 2))
            progress.update(r + 1, accuracy=0.9, epsilon=3.0)
    assert buf.getvalue().splitlines() == [round_line(row(0, 1.5), 2), round_line(row(1, 3.0), 2)]
    assert "epsilon 1.5 of inf (delta 1e-05)" in buf.getvalue()


def test_round_progress_on_a_terminal_draws_a_bar_with_accuracy_and_epsilon() -> None:
    buf = io.StringIO()
    with RoundProgress(Console(file=buf, force_terminal=True, width=140), 3) as progress:
        progress.update(2, accuracy=0.8125, epsilon=4.5)
    text = _strip_ansi(buf.getvalue())
    assert ESC in buf.getvalue()
    assert re.search(r"round 2/3 .*accuracy 0\.8125 .*epsilon 4\.5 .*remaining", text), text


def test_a_disabled_progress_prints_nothing_even_on_a_terminal() -> None:
    buf = io.StringIO()
    with RoundProgress(Console(file=buf, force_terminal=True), 3, enabled=False) as progress:
        progress.line("round 1/3")
        progress.update(1, accuracy=0.5)
    assert buf.getvalue() == ""


def test_the_variable_forces_either_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_TERMINAL_ENV, "1")
    assert make_console(io.StringIO()).is_terminal
    monkeypatch.setenv(FORCE_TERMINAL_ENV, "0")
    assert not make_console(io.StringIO()).is_terminal


def test_the_summary_is_rich_tables_with_the_comparison_beside_each_round() -> None:
    buf = io.StringIO()
    rows = [row(0, 2.0), row(1, 3.0)]
    plain = [{**row(0), "accuracy": 0.91}, {**row(1), "accuracy": 0.95}]
    Console(file=buf, force_terminal=False, width=150).print(
        summary(rows, 12.5, "title", facts=[("epsilon (ledger)", "3 of 8")], compare=plain))
    text = buf.getvalue()
    assert ESC not in text
    header = next(line for line in text.splitlines() if "accuracy" in line and "round" in line)
    assert re.search(r"round\s+accuracy\s+without privacy\s+loss\s+epsilon", header), header
    assert re.search(r"\b1\s+0\.5100\s+0\.9500\s+1\.0000\s+3\b", text), text  # rounds from 0
    assert re.search(r"final accuracy\s+0\.5100 after 2 rounds", text)
    assert re.search(r"epsilon \(ledger\)\s+3 of 8", text) and re.search(r"wall time\s+12\.5 s", text)
    assert "uplink device -> edge: 8.0 KiB quantized vs 16.0 KiB in float32: saved 8.0 KiB (50 %)" in text


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)

"""``fedtier demo`` as a user runs it: separate processes, a real broker, a summary at the end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import mosquitto_binary, require
from process_helpers import alive, descendants, mentioning, stop_tree

pytestmark = pytest.mark.slow


def run_demo(*args: str, timeout: float = 240) -> dict:
    proc = subprocess.run([sys.executable, "-m", "fedtier", "demo", "--json", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def default_demo() -> dict:
    """``fedtier demo`` with its defaults (onnxruntime-training agents), run once: session-scoped, since
    the xdist worker may run other end-to-end modules between this module's tests (a module-scoped
    fixture then ran the 20-second demo twice)."""
    require(mosquitto_binary() is not None, "Mosquitto")
    return run_demo()


SMALL = ("--devices", "4", "--cells", "2", "--rounds", "3")


@pytest.fixture(scope="session")
def small_demo() -> dict:
    """A small demo over Mosquitto, undisturbed, run once: what a secure run and one whose broker is killed
    must compute (every run of the same seeds does, to the bit)."""
    require(mosquitto_binary() is not None, "Mosquitto")
    return run_demo(*SMALL)


def test_demo_with_defaults_reaches_090_accuracy(default_demo: dict) -> None:
    result = default_demo
    accuracies = [r["accuracy"] for r in result["rounds"]]
    assert len(accuracies) == 30
    assert result["final_accuracy"] >= 0.90, accuracies
    assert result["broker"] == "mosquitto"
    assert result["processes"] == 1 + 1 + 2 + 12  # broker, coordinator, edges, agents
    assert all(r["devices_reported"] == 12 for r in result["rounds"])
    assert all(v > 0 for v in result["bytes"].values())


def test_agents_without_onnxruntime_training_reach_the_same_accuracy(default_demo: dict, tmp_path: Path) -> None:
    """Every agent runs in .venv-portable (stock onnxruntime, no torch) on the portable graph."""
    agent_python = Path(__file__).resolve().parents[2] / ".venv-portable" / "bin" / "python"
    require(agent_python.exists(), f"the stock-onnxruntime device environment {agent_python.parent.parent} "
                                   "(run ./install.sh)")
    result = run_demo("--trainer", "portable", "--agent-python", str(agent_python), "--workdir", str(tmp_path))
    assert result["trainer"] == "portable" and result["broker"] == "mosquitto"
    assert len(result["rounds"]) == len(default_demo["rounds"]) == 30
    assert all(r["devices_reported"] == 12 for r in result["rounds"])
    for portable, ort in zip(result["rounds"], default_demo["rounds"], strict=True):
        assert portable["accuracy"] == pytest.approx(ort["accuracy"], abs=1e-4), (portable, ort)
    agent_log = (tmp_path / "logs" / "dev-00.log").read_text()
    assert "trainer portable (onnxruntime " in agent_log  # chosen, logged at start
    assert "(trainer: portable)" in (tmp_path / "logs" / "edge-cell-a.log").read_text()  # reported to the edge


def test_demo_over_the_embedded_broker_with_chunked_messages() -> None:
    # 8 KiB packets: every 19 KB model message travels as several chunks.
    result = run_demo("--broker", "embedded", "--devices", "4", "--cells", "2", "--rounds", "4",
                      "--max-packet-size", "8192")
    assert result["broker"] == "embedded"
    accuracies = [r["accuracy"] for r in result["rounds"]]
    assert len(accuracies) == 4 and accuracies[-1] > accuracies[0] > 0.1
    assert all(r["devices_reported"] == 4 for r in result["rounds"])


def test_secure_aggregation_demo_runs_through_mosquitto() -> None:
    require(mosquitto_binary() is not None, "Mosquitto")
    result = run_demo("--secure-aggregation", "--devices", "6", "--cells", "2", "--rounds", "3")
    assert result["secure_aggregation"] is True and result["algorithm"] == "fedavg"
    accuracies = [r["accuracy"] for r in result["rounds"]]
    assert len(accuracies) == 3 and accuracies[-1] > accuracies[0] > 0.1
    assert all(r["devices_reported"] == 6 for r in result["rounds"])


def test_secure_aggregation_with_privacy_runs_distributed_dp_through_mosquitto() -> None:
    """`--secure-aggregation --privacy`: the devices share the noise; each cell makes one release a round."""
    require(mosquitto_binary() is not None, "Mosquitto")
    result = run_demo("--secure-aggregation", "--privacy", "--devices", "6", "--cells", "2", "--rounds", "3")
    p = result["privacy"]
    assert result["secure_aggregation"] is True and len(result["rounds"]) == 3
    assert all(r["devices_reported"] == 6 for r in result["rounds"])
    assert p["ledger_agrees"] and 0 < p["epsilon"] <= p["target_epsilon"] * (1 + 1e-9)
    assert p["ledger_releases"] == 3 * 2  # one distributed release per cell and round, none per device


def test_demo_runs_qhetfed_and_reports_uplink_savings() -> None:
    require(mosquitto_binary() is not None, "Mosquitto")
    proc = subprocess.run([sys.executable, "-m", "fedtier", "demo", "--algorithm", "qhetfed", "--devices", "4",
                           "--cells", "2", "--rounds", "4"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fedtier demo: qhetfed" in proc.stdout
    assert "uplink device -> edge:" in proc.stdout and "in float32: saved" in proc.stdout
    saved = int(proc.stdout.split("uplink device -> edge:")[1].split("(")[1].split("%")[0])
    assert saved >= 80  # 4-bit codes instead of 32-bit floats


def test_ctrl_c_stops_every_process_the_demo_started(tmp_path: Path) -> None:
    """SIGINT stops the demo and every process it started, even when the demo inherited SIGINT ignored, as a
    background job (``&``) of a script does: the demo resets it, so SIGINT is sure to be handled."""
    require(mosquitto_binary() is not None, "Mosquitto")
    workdir = tmp_path / "demo"
    demo = subprocess.Popen([sys.executable, "-m", "fedtier", "demo", "--devices", "3", "--cells", "1",
                             "--rounds", "100000", "--workdir", str(workdir)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert demo.stderr is not None
        deadline = time.monotonic() + 60
        for line in demo.stderr:
            if "(2/" in line and line.startswith("round") or time.monotonic() > deadline:
                break
        children = mentioning(str(workdir))
        assert len(children) >= 5, children  # broker, coordinator, edge, 3 agents
    finally:
        stopped = stop_tree(demo, signal.SIGINT, grace_s=30, marker=str(workdir))
    assert stopped.code == 130
    assert stopped.leftover == set()


def test_secure_demo_matches_the_plain_demo(small_demo: dict, tmp_path: Path) -> None:
    """Mutual TLS, ACLs and signed manifests change who may talk, not the mathematics."""
    secure = run_demo(*SMALL, "--secure", "--workdir", str(tmp_path))
    assert secure["secure"] is True and "TLS" in secure["broker"]
    assert [r["accuracy"] for r in secure["rounds"]] == [r["accuracy"] for r in small_demo["rounds"]]
    conf = (tmp_path / "broker" / "mosquitto.conf").read_text()
    assert "require_certificate true" in conf and "allow_anonymous false" in conf
    keys = sorted((tmp_path / "bundles").glob("*/key.pem"))
    assert len(keys) == 1 + 2 + 4  # coordinator, gateways, devices
    assert all(k.stat().st_mode & 0o777 == 0o600 for k in keys)
    for device in ("dev-00", "dev-03"):  # each agent verified a signed manifest before training
        assert "manifest v1 of rollout demo installed" in (tmp_path / "logs" / f"{device}.log").read_text()


def test_a_demo_whose_broker_is_killed_restarts_it_says_so_and_ends_with_the_undisturbed_accuracy(
        small_demo: dict, tmp_path: Path) -> None:
    """SIGKILL to the demo's Mosquitto as soon as its nodes have started, while round 0 runs (rounds 1 and 2 take
    30 ms each on a quiet machine, so a kill timed by round 0's line often came after the demo had ended): the
    demo restarts it on the same port and says so;
    the nodes reconnect and recover what the broker (without persistence) lost — the retained manifests,
    the messages it had queued — so every round ends as undisturbed, to the bit: equality, not a tolerance,
    since a lost or doubled update would change the model and the round counts every device once."""
    workdir = tmp_path / "demo"
    demo = subprocess.Popen([sys.executable, "-m", "fedtier", "demo", *SMALL, "--workdir", str(workdir)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    narration: list[str] = []
    try:
        assert demo.stderr is not None
        for line in demo.stderr:
            narration.append(line)
            if line.startswith("started ") and " processes " in line:
                break
        [broker] = mentioning(f"{workdir}/mosquitto.conf")
        os.kill(broker, signal.SIGKILL)
        narration += list(demo.stderr)
        code = demo.wait(120)
    finally:
        stopped = stop_tree(demo, marker=str(workdir))
    told = "".join(narration)
    assert code == 0, told[-3000:]
    assert re.search(r"^broker died \(exit code -9\); restarted it on 127\.0\.0\.1:\d+", told, re.M), told
    rounds = json.loads((workdir / "coordinator" / "metrics.json").read_text())["rounds"]
    assert [r["accuracy"] for r in rounds] == [r["accuracy"] for r in small_demo["rounds"]]
    assert [r["devices_reported"] for r in rounds] == [4, 4, 4]
    assert stopped.leftover == set()
    logs = {path.name: path.read_text() for path in (workdir / "logs").glob("*.log")}
    assert not [line for text in logs.values() for line in text.splitlines() if " rejected message " in line
                and " WARNING " in line]  # the recovery's resends are redeliveries: DEBUG


def _start_endless_demo(workdir: Path) -> tuple[subprocess.Popen, set[int]]:
    """A demo that would run for ever, followed until its second round; returns it and its processes."""
    demo = subprocess.Popen([sys.executable, "-m", "fedtier", "demo", "--devices", "3", "--cells", "1",
                             "--rounds", "100000", "--workdir", str(workdir)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        assert demo.stderr is not None
        deadline = time.monotonic() + 90
        for line in demo.stderr:
            if "(2/" in line and line.startswith("round") or time.monotonic() > deadline:
                break
        children = descendants(demo.pid)
        # reaper, broker, coordinator, edge, 3 agents
        assert len(children) >= 7, children
    except BaseException:
        stop_tree(demo, marker=str(workdir))
        raise
    return demo, children


def test_sigterm_stops_every_process_the_demo_started(tmp_path: Path) -> None:
    require(mosquitto_binary() is not None, "Mosquitto")
    demo, children = _start_endless_demo(tmp_path / "demo")
    try:
        demo.send_signal(signal.SIGTERM)
        code = demo.wait(60)
        rest = demo.stderr.read() if demo.stderr else ""
    finally:
        stopped = stop_tree(demo, marker=str(tmp_path / "demo"))
    assert code == 128 + signal.SIGTERM, rest
    assert "terminated (SIGTERM): stopped 6 processes" in rest
    assert alive(children) == set()  # the demo waited for each before exiting
    assert stopped.leftover == set()


def test_a_sigkilled_demo_leaves_no_process_behind(tmp_path: Path) -> None:
    """No handler runs on SIGKILL: the reaper sees its pipe close and stops the rest."""
    require(mosquitto_binary() is not None, "Mosquitto")
    demo, children = _start_endless_demo(tmp_path / "demo")
    try:
        demo.kill()
        demo.wait(30)
        deadline = time.monotonic() + 60  # the reaper's grace period is 5 s
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(children) == set()
    finally:
        stop_tree(demo, marker=str(tmp_path / "demo"))


def test_privacy_demo_with_defaults_reports_the_ledgers_epsilon(tmp_path: Path) -> None:
    """`fedtier demo --privacy --processes` (the 12-process private demo) with every default, then `fedtier privacy
    report`. (The private fleet, `--privacy` alone, is tests/e2e/test_private_demo.py's.)"""
    require(mosquitto_binary() is not None, "Mosquitto")
    workdir = tmp_path / "dp"
    proc = subprocess.run([sys.executable, "-m", "fedtier", "demo", "--privacy", "--processes", "--json",
                           "--workdir", str(workdir)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""  # --json: nothing but the document
    result = json.loads(proc.stdout)
    p = result["privacy"]
    assert len(result["rounds"]) == 30 and result["stopped"] is None
    assert result["secure"] is True and "TLS" in result["broker"]  # clear updates to cell-a need TLS
    assert p["cells"]["cell-a"]["trusted"] is True and p["cells"]["cell-b"]["trusted"] is False
    assert p["delta"] == 1e-5 and p["target_epsilon"] == 8.0
    eps = p["epsilon_per_round"]
    assert len(eps) == 30 and all(a < b for a, b in zip(eps, eps[1:], strict=False))
    assert p["epsilon"] <= 8.0 * (1 + 1e-9) and p["epsilon"] > 7.9  # calibrated to spend the whole budget
    assert p["ledger_agrees"] and p["live_epsilon"] == pytest.approx(p["epsilon"], rel=1e-12)
    assert 0.0 <= result["final_accuracy"] <= 1.0
    report = subprocess.run([sys.executable, "-m", "fedtier", "privacy", "report", "--json", "--config",
                             str(workdir / "configs" / "coordinator.toml")], capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    audit = json.loads(report.stdout)
    assert audit["epsilon_max"] == p["epsilon"]
    assert audit["delta"] == p["delta"] and audit["status"] == "finished" and audit["warnings"] == []
    assert audit["releases"]["total"] == p["ledger_releases"] == 30 * (1 + 6)  # cell-a's edge + cell-b's devices


def test_privacy_demo_prints_the_plan_epsilon_per_round_and_the_comparison(tmp_path: Path) -> None:
    require(mosquitto_binary() is not None, "Mosquitto")
    proc = subprocess.run([sys.executable, "-m", "fedtier", "demo", "--privacy", "--processes", "--compare",
                           "--devices", "4",
                           "--rounds", "3", "--epsilon", "4", "--delta", "1e-6"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err, out = proc.stderr, proc.stdout
    assert "\x1b" not in err + out  # piped: no progress bar
    assert "epsilon 4 per device at delta 1e-06 over 3 rounds" in err
    assert re.search(r"cell-a\s+trusted\s+its 2 devices send clear updates over TLS", err)
    assert re.search(r"cell-b\s+untrusted\s+each of its 2 devices adds noise", err)
    private = err.split("--compare:")[0]
    assert len(re.findall(r"^round\s+\d+ \(\d/3\) .* epsilon [0-9.]+ of [0-9.]+ \(delta 1e-06\)", private, re.M)) == 3
    plain = err.split("--compare:")[1]
    assert len(re.findall(r"^round\s+\d+ \(\d/3\) ", plain, re.M)) == 3 and "epsilon" not in plain
    assert re.search(r"epsilon \(ledger\)\s+[0-9.]+ of 4 at delta 1e-06", out)
    assert re.search(r"final accuracy\s+[0-9.]+ after 3 rounds", out)
    assert re.search(r"accuracy without privacy\s+0\.[0-9]{4} after 3 rounds \(same seeds", out)
    header = next((line for line in out.splitlines() if re.search(r"^\s*round\s+accuracy", line)), "")
    assert re.search(r"accuracy\s+without privacy\s+loss\s+epsilon", header), out  # beside each round


def test_demo_trains_fedxl_on_one_class_devices_and_reports_auroc_per_round() -> None:
    """``fedtier demo --algorithm fedxl`` with its defaults: 12 devices, each holding one class of a rare-event
    task, learn a ranking through shared scores (AUROC and partial AUROC every round)."""
    require(mosquitto_binary() is not None, "Mosquitto")
    result = run_demo("--algorithm", "fedxl")
    rounds = result["rounds"]
    assert result["algorithm"] == "fedxl" and len(rounds) == 30 and result["broker"] == "mosquitto"
    assert all(r["devices_reported"] == 12 for r in rounds)
    assert all({"auroc", "pauc_0.3", "pauc_0.5"} <= set(r) for r in rounds)
    assert rounds[0]["auroc"] < rounds[1]["auroc"] - 0.2  # round 0 only collects scores; training starts in 1
    assert min(r["auroc"] for r in rounds[1:]) >= 0.85, [r["auroc"] for r in rounds]
    assert result["final_ranking"]["auroc"] >= 0.90 and result["final_ranking"]["pauc_0.5"] >= 0.8


def test_the_hsgd_demo_with_defaults_runs_hosts_and_devices_through_mosquitto_within_two_minutes() -> None:
    require(mosquitto_binary() is not None, "Mosquitto")
    t0 = time.monotonic()
    result = run_demo("--algorithm", "hsgd", timeout=120)
    assert time.monotonic() - t0 < 120
    assert result["algorithm"] == "hsgd" and result["broker"] == "mosquitto" and result["devices"] == 100
    aucs = [r["auc"] for r in result["rounds"]]
    assert len(aucs) == 30 and aucs[-1] >= 0.95 and aucs[-1] > aucs[0]
    assert result["bytes"]["vertical"] > 0 and result["bytes"]["host_up"] > 0 and not result["rejected"]

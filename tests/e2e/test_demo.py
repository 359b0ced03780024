"""``fedtier demo`` as a user runs it: separate processes, a real broker, a summary at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import mosquitto_binary, require

pytestmark = pytest.mark.slow


def run_demo(*args: str, timeout: float = 240) -> dict:
    proc = subprocess.run([sys.executable, "-m", "fedtier", "demo", "--json", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def default_demo() -> dict:
    """``fedtier demo`` with its defaults (onnxruntime-training agents), run once for the module."""
    require(mosquitto_binary() is not None, "Mosquitto")
    return run_demo()


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
    require(mosquitto_binary() is not None, "Mosquitto")
    workdir = tmp_path / "demo"
    demo = subprocess.Popen([sys.executable, "-m", "fedtier", "demo", "--devices", "3", "--cells", "1",
                             "--rounds", "100000", "--workdir", str(workdir)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        assert demo.stderr is not None
        deadline = time.monotonic() + 60
        for line in demo.stderr:
            if "round   2/" in line or time.monotonic() > deadline:
                break
        children = _processes_mentioning(str(workdir))
        assert len(children) >= 5, children  # broker, coordinator, edge, 3 agents
        demo.send_signal(signal.SIGINT)
        code = demo.wait(30)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert code == 130
    assert _processes_mentioning(str(workdir)) == []


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text().split()[2]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


def test_secure_demo_matches_the_plain_demo(tmp_path: Path) -> None:
    """Mutual TLS, ACLs and signed manifests change who may talk, not the mathematics."""
    require(mosquitto_binary() is not None, "Mosquitto")
    args = ("--devices", "4", "--cells", "2", "--rounds", "3")
    plain = run_demo(*args)
    secure = run_demo(*args, "--secure", "--workdir", str(tmp_path))
    assert secure["secure"] is True and "TLS" in secure["broker"]
    assert [r["accuracy"] for r in secure["rounds"]] == [r["accuracy"] for r in plain["rounds"]]
    conf = (tmp_path / "broker" / "mosquitto.conf").read_text()
    assert "require_certificate true" in conf and "allow_anonymous false" in conf
    keys = sorted((tmp_path / "bundles").glob("*/key.pem"))
    assert len(keys) == 1 + 2 + 4  # coordinator, gateways, devices
    assert all(k.stat().st_mode & 0o777 == 0o600 for k in keys)
    for device in ("dev-00", "dev-03"):  # each agent verified a signed manifest before training
        assert "manifest v1 of rollout demo installed" in (tmp_path / "logs" / f"{device}.log").read_text()

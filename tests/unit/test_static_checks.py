"""mypy and ruff over the packages, so CI (which runs the test suite) runs them too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["fedtier", "models", "device_agent", "edge_broker", "fleet_data", "cloud_coordinator", "provisioning",
            "local_fleet", "commands"]


def test_mypy_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "mypy", *PACKAGES], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:]


def test_ruff_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", *PACKAGES, "tests", "benchmarks"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:]

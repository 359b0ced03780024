"""mypy, ruff and radon over the packages, so CI (which runs the test suite) runs them too."""

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


def test_no_function_is_too_complex() -> None:
    """No function or method of the packages (and of the experiments and benchmarks) grades E or F in radon's
    cyclomatic complexity (above 30 independent paths): past that a function is split into named steps."""
    from radon.complexity import cc_rank, cc_visit

    offenders = []
    for package in [*PACKAGES, "experiments", "benchmarks"]:
        for path in sorted((ROOT / package).rglob("*.py")):
            for block in cc_visit(path.read_text()):
                rank = cc_rank(block.complexity)
                if rank in ("E", "F"):
                    offenders.append(f"{path.relative_to(ROOT)}:{block.lineno} {block.fullname}: "
                                     f"{rank} ({block.complexity})")
    assert not offenders, "\n".join(sorted(offenders))

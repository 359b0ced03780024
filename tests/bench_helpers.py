"""Load a script of ``benchmarks/`` as a module whose results go to a test's tmp dir (the smoke tests)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str, results: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/bench_<name>.py`` imported, its ``_common.RESULTS`` pointed at ``results``."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"bench_{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys.modules["_common"], "RESULTS", results)
    return module

"""DESIGN §2's dependency rule, checked on the source and on real imports.

* ``fedtier`` imports none of the role packages, and neither torch nor onnxruntime;
* ``device_agent`` and ``edge_broker`` import only ``fedtier`` (never torch, never each other);
  the edge not even onnxruntime; the device's torch backend imports torch and ``models``
  lazily, inside functions, and only that file may;
* only ``models`` and ``cloud_coordinator`` import torch, and lazily (never at module level);
* ``fedtier agent ...`` starts without importing torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLE_PACKAGES = {"device_agent", "edge_broker", "cloud_coordinator", "models", "provisioning"}
HEAVY = {"torch", "onnxruntime", "onnx", "sklearn", "matplotlib"}


def imports(path: Path) -> list[tuple[str, bool]]:
    """Top-level module names imported by ``path``, with whether the import is at module level."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = module_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name.split(".")[0], module_level) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append((child.module.split(".")[0], module_level))
            elif isinstance(child, ast.If) and _is_type_checking(child):
                continue  # typing-only imports
            visit(child, inner)

    visit(tree, True)
    return found


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", files("fedtier"), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_imports_no_role_package_and_nothing_heavy(path: Path) -> None:
    bad = {m for m, _ in imports(path)} & (ROLE_PACKAGES | HEAVY)
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", files("edge_broker"), ids=lambda p: str(p.relative_to(ROOT)))
def test_edge_imports_only_fedtier(path: Path) -> None:
    bad = {m for m, _ in imports(path)} & (ROLE_PACKAGES - {"edge_broker"} | HEAVY)
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", files("device_agent"), ids=lambda p: str(p.relative_to(ROOT)))
def test_device_imports_only_fedtier_and_torch_only_lazily_in_its_torch_backend(path: Path) -> None:
    found = imports(path)
    others = {m for m, _ in found} & (ROLE_PACKAGES - {"device_agent", "models"})
    assert not others, f"{path.relative_to(ROOT)} imports {sorted(others)}"
    heavy_top = {m for m, top in found if top} & ({"torch", "models", "sklearn", "matplotlib"})
    assert not heavy_top, f"{path.relative_to(ROOT)} imports {sorted(heavy_top)} at module level"
    if path.name != "torch_backend.py":
        lazy = {m for m, _ in found} & {"torch", "models"}
        assert not lazy, f"only the torch backend may import torch/models; {path.name} imports {sorted(lazy)}"


@pytest.mark.parametrize("path", files("models") + files("cloud_coordinator"), ids=lambda p: str(p.relative_to(ROOT)))
def test_torch_is_imported_lazily(path: Path) -> None:
    top = {m for m, level in imports(path) if level}
    assert "torch" not in top, f"{path.relative_to(ROOT)} imports torch at module level"


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return set(out.stdout.split())


def test_the_device_stack_loads_without_torch() -> None:
    mods = _modules_after("import device_agent.run, device_agent.node, device_agent.trainers.ort, fedtier.cli\n"
                          "from device_agent.trainers.ort_runtime import training_api; training_api()")
    assert "torch" not in mods
    assert "onnxruntime.training.api" in mods  # really loaded, through the torch-free shim


def test_fedtier_agent_cli_starts_without_torch() -> None:
    code = ("from click.testing import CliRunner\nfrom fedtier.cli import cli\n"
            "r = CliRunner().invoke(cli, ['agent', 'run', '--help'])\nassert r.exit_code == 0, r.output")
    assert "torch" not in _modules_after(code)


def test_the_edge_stack_loads_without_onnxruntime_or_torch() -> None:
    mods = _modules_after("import edge_broker.run, edge_broker.service")
    assert not {"torch", "onnxruntime"} & mods


def test_the_core_loads_without_heavy_packages() -> None:
    mods = _modules_after("import fedtier.wire, fedtier.messages, fedtier.algorithms.fedavg, fedtier.transport.mqtt")
    assert not HEAVY & {m.split('.')[0] for m in mods}

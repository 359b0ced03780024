"""Algorithm knowledge lives in the algorithm table and the roles (``fedtier/algorithms/``), nowhere else.

Outside ``fedtier/algorithms/`` no code compares a value against an algorithm's name (``==``,
``!=``, ``in``, ``not in`` against a string literal, or a tuple, list or set of them): it asks
the table (``fedtier.algorithms.describe(name).scorer``, ``RolloutConfig.traits``) instead, so
that adding an algorithm touches only the table, its roles and its config section. Defaults,
choices, dict keys and messages are not comparisons.
"""

from __future__ import annotations

import ast
from pathlib import Path

from fedtier import algorithms

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fedtier", "models", "device_agent", "edge_broker", "fleet_data", "cloud_coordinator", "provisioning",
            "local_fleet", "commands")
TABLE = ROOT / "fedtier" / "algorithms"
"""The table and the role modules: where algorithm names may be compared."""


def _literals(node: ast.expr) -> list[str]:
    """The string constants ``node`` is made of: itself, or the elements of a tuple, list or set display."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)]


def name_comparisons(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, source) of each comparison in ``path`` against one of ``names`` given literally."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        if any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops) and any(
                names & set(_literals(operand)) for operand in (node.left, *node.comparators)):
            found.append((node.lineno, ast.unparse(node)))
    return found


def violations(root: Path, packages: tuple[str, ...], allowed: Path, names: set[str]) -> list[str]:
    """``file:line: comparison`` for every literal algorithm-name comparison outside ``allowed``."""
    out: list[str] = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path.is_relative_to(allowed):
                continue
            out.extend(f"{path.relative_to(root)}:{line}: {source}" for line, source in name_comparisons(path, names))
    return out


def test_no_algorithm_name_is_compared_outside_the_table_and_the_roles() -> None:
    bad = violations(ROOT, PACKAGES, TABLE, set(algorithms.ALGORITHMS))
    assert bad == [], ("ask fedtier.algorithms.describe(name) (a trait of the algorithm) instead of comparing "
                       "names:\n" + "\n".join(bad))


def test_the_scan_finds_each_kind_of_comparison_and_nothing_else(tmp_path: Path) -> None:
    """A test of the test: comparisons are found with their line; defaults, choices, keys and messages are not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        'def f(cfg, opt):\n'
        '    if cfg.algorithm == "hist":\n'                       # 2
        '        pass\n'
        '    if "hsgd" != cfg.algorithm:\n'                       # 4
        '        pass\n'
        '    x = cfg.algorithm in ("fedavg", "hier_qsgd")\n'      # 6
        '    y = cfg.algorithm not in ["qhetfed"]\n'              # 7
        '    z = cfg.algorithm in {"other", "fedxl"}\n'           # 8
        '    a = opt("fedavg", choices=("fedavg", "hist"))\n'     # a default and choices
        '    b = {"hist": 1}["hist"]\n'                           # a dict key
        '    c = cfg.name == "histogram"\n'                       # not an algorithm's name
        '    raise ValueError("hist needs an MLP")\n'             # a message
    )
    (tmp_path / "pkg" / "algorithms").mkdir()
    (tmp_path / "pkg" / "algorithms" / "roles.py").write_text('ok = task["algorithm"] == "hist"\n')
    found = violations(tmp_path, ("pkg",), tmp_path / "pkg" / "algorithms", set(algorithms.ALGORITHMS))
    assert [v.split(": ")[0] for v in found] == [f"pkg/mod.py:{n}" for n in (2, 4, 6, 7, 8)]
    assert found[0].endswith("cfg.algorithm == 'hist'")
    everywhere = violations(tmp_path, ("pkg",), tmp_path / "elsewhere", set(algorithms.ALGORITHMS))
    assert "pkg/algorithms/roles.py:1: task['algorithm'] == 'hist'" in everywhere

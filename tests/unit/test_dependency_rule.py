"""DESIGN §2's dependency rule, checked on the source and on real imports.

* ``fedtier`` imports none of the role packages, and neither torch nor onnxruntime;
* ``device_agent`` and ``edge_broker`` import only ``fedtier`` (never torch, never each other);
  the edge not even onnxruntime; the device's torch backend imports torch and ``models``
  lazily, inside functions, and only that file may;
* only ``models`` and the packages above the roles (``fleet_data``, ``cloud_coordinator``, ``provisioning``,
  ``local_fleet``, ``commands``) import torch, and lazily (never at module level);
* ``fedtier agent ...`` starts without importing torch;
* rich (the coordinator's progress bars and tables) is in the coordinator extra only: the core,
  the device and the edge never import it, and ``fedtier agent|edge run`` start without it;
* inside ``fedtier``, each sub-package imports only the sub-packages ``CORE_RULES`` allows
  (docs/architecture.md draws the same layers);
* between the top-level packages, each imports only what ``PACKAGE_RULES`` allows (roles never the fleet
  runners or the commands; the coordinator never the simulator, the demo or the commands), and no files
  anywhere import each other in a loop (lazy imports included).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLE_PACKAGES = {"device_agent", "edge_broker", "cloud_coordinator", "models", "provisioning", "fleet_data",
                 "local_fleet", "commands"}
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


ABOVE_THE_CORE = ("models", "fleet_data", "cloud_coordinator", "provisioning", "local_fleet", "commands")


@pytest.mark.parametrize("path", [p for pkg in ABOVE_THE_CORE for p in files(pkg)],
                         ids=lambda p: str(p.relative_to(ROOT)))
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
    mods = _modules_after("import fedtier.wire, fedtier.wire.messages, fedtier.algorithms.fedavg, "
                          "fedtier.transport.mqtt")
    assert not HEAVY & {m.split('.')[0] for m in mods}


# Which part of ``fedtier`` may import which, from the bottom up. Keys are the sub-packages (or
# top-level modules) of ``fedtier``; a module may import its own part and the parts listed.
CORE_RULES: dict[str, set[str]] = {
    "errors": set(),
    "rng": set(),
    "wire": {"errors"},
    "storage": {"errors"},
    "training": {"errors", "rng"},
    "privacy": {"errors", "rng"},
    "artifacts": {"errors", "training"},
    "transport": {"errors", "wire", "storage"},
    "security": {"errors", "training", "transport"},  # transport.topics only: the id rules
    "embedded_broker": {"errors", "transport"},  # transport.topic_filters only: stdlib MQTT matching
    "secagg": {"errors", "rng", "wire"},
    "algorithms": {"errors", "rng", "wire", "training", "privacy", "secagg"},
    "runtime": {"errors", "rng", "wire", "storage", "training", "privacy", "artifacts", "transport", "security",
                "secagg", "algorithms"},
    "rollout": {"errors", "rng", "training", "privacy", "transport", "algorithms", "runtime"},  # the rollout file
    "cli": {"errors", "__init__"},  # role commands load lazily, by name
    "__main__": {"cli"},
    "__init__": set(),
}


def part_of(module: str) -> str:
    """``fedtier.wire.quant`` -> ``wire``; ``fedtier.errors`` -> ``errors``; ``fedtier`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def core_imports(path: Path, root: Path) -> list[str]:
    """Every ``fedtier...`` module that ``path`` (a file under ``root/fedtier``) imports, lazily or not."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "fedtier":
                # ``from fedtier import wire`` names a part; ``from fedtier import __version__`` the package
                found.extend("fedtier" if a.name.startswith("__") else f"fedtier.{a.name}" for a in node.names)
            elif node.module.startswith("fedtier."):
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names if a.name.startswith("fedtier."))
    return found


def boundary_violations(root: Path, rules: dict[str, set[str]]) -> list[str]:
    """``file imports module`` for each import in ``root/fedtier`` that crosses a boundary ``rules`` forbid."""
    bad: list[str] = []
    for path in sorted((root / "fedtier").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        own = part_of(".".join(p for p in rel.parts))
        if own not in rules:
            bad.append(f"{rel}: part {own!r} has no rule in CORE_RULES")
            continue
        for module in core_imports(path, root):
            target = part_of(module)
            if target != own and target not in rules[own]:
                bad.append(f"{rel} imports {module} ({own} may import only {sorted(rules[own])})")
    return bad


def test_core_sub_packages_import_only_what_the_rules_allow() -> None:
    assert boundary_violations(ROOT, CORE_RULES) == []


def test_every_core_part_has_a_rule_and_every_rule_a_part() -> None:
    parts = {p.stem if p.is_file() else p.name for p in (ROOT / "fedtier").iterdir()
             if (p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert parts == set(CORE_RULES)


def test_the_rule_check_catches_a_forbidden_import(tmp_path: Path) -> None:
    """A test of the test: a wire module that imports the runtime, and a lazy import in a function."""
    (tmp_path / "fedtier" / "wire").mkdir(parents=True)
    (tmp_path / "fedtier" / "runtime").mkdir()
    (tmp_path / "fedtier" / "wire" / "codec.py").write_text("from fedtier.runtime.metrics import Metrics\n")
    (tmp_path / "fedtier" / "wire" / "lazy.py").write_text("def f():\n    from fedtier import runtime\n")
    (tmp_path / "fedtier" / "runtime" / "ok.py").write_text("from fedtier.wire import envelope\n")
    found = boundary_violations(tmp_path, CORE_RULES)
    assert len(found) == 2
    assert any("wire/codec imports fedtier.runtime.metrics" in line for line in found)
    assert any("wire/lazy imports fedtier.runtime" in line for line in found)


# rich draws the coordinator's progress bars and tables; it is in the coordinator extra only, so
# the device and gateway installs (``fedtier[agent]``, ``fedtier[edge]``) must never need it.
COORDINATOR_ONLY = {"rich"}


@pytest.mark.parametrize("path", files("fedtier") + files("device_agent") + files("edge_broker"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_core_device_and_edge_never_import_coordinator_only_packages(path: Path) -> None:
    bad = {m for m, _ in imports(path)} & COORDINATOR_ONLY
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} (coordinator extra only)"


def test_agent_and_edge_commands_start_without_rich() -> None:
    code = ("from click.testing import CliRunner\nfrom fedtier.cli import cli\n"
            "import device_agent.run, device_agent.node, edge_broker.run, edge_broker.service\n"
            "for args in (['agent', 'run', '--help'], ['edge', 'run', '--help']):\n"
            "    r = CliRunner().invoke(cli, args)\n    assert r.exit_code == 0, r.output")
    assert not COORDINATOR_ONLY & {m.split(".")[0] for m in _modules_after(code)}


def test_rich_is_in_the_coordinator_extra_and_not_in_the_agent_or_edge_extras() -> None:
    from fedtier.runtime.config import read_toml

    extras = read_toml(ROOT / "pyproject.toml")["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        return {req.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
                for req in extras[extra]}

    assert "rich" in names("coordinator")
    assert not COORDINATOR_ONLY & (names("agent") | names("edge"))


# --- the top-level packages ------------------------------------------------------------------------
# Which top-level package may import which, lazily or not (docs/architecture.md draws the same floors).
# A package may import itself and those listed; tests, benchmarks and experiments stand above all of them.
PACKAGE_RULES: dict[str, set[str]] = {
    "fedtier": set(),
    "models": {"fedtier"},
    "device_agent": {"fedtier", "models"},  # models: its torch backend only, lazily (checked above)
    "edge_broker": {"fedtier"},
    "fleet_data": {"fedtier", "device_agent"},  # the shard format is the agent's
    "cloud_coordinator": {"fedtier", "models", "device_agent", "fleet_data"},
    "provisioning": {"fedtier", "device_agent", "edge_broker", "fleet_data"},  # node configs, sample shards
    "local_fleet": {"fedtier", "models", "device_agent", "edge_broker", "fleet_data", "cloud_coordinator",
                    "provisioning"},
    "commands": {"fedtier", "models", "device_agent", "edge_broker", "fleet_data", "cloud_coordinator",
                 "provisioning", "local_fleet"},
}


def module_imports(path: Path, root: Path) -> set[str]:
    """Every module of this tree that ``path`` imports (lazily or not), as dotted names; typing-only ones
    (``if TYPE_CHECKING:``) left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # ``from pkg import module``
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGE_RULES and _source_of(m, root) is not None}


def _source_of(module: str, root: Path) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def package_violations(root: Path, rules: dict[str, set[str]]) -> list[str]:
    """``file imports module`` for each import between top-level packages that ``rules`` forbid."""
    bad: list[str] = []
    for package, allowed in rules.items():
        for path in sorted((root / package).rglob("*.py")):
            for module in sorted(module_imports(path, root)):
                target = module.split(".")[0]
                if target != package and target not in allowed:
                    bad.append(f"{path.relative_to(root)} imports {module} ({package} may import only "
                               f"{sorted(allowed) or 'nothing above the standard library'})")
    return bad


def import_circles(root: Path, packages: set[str]) -> list[list[str]]:
    """The files of ``packages`` that import each other in a loop (lazy imports count: a loop is a loop),
    each circle as a sorted list of paths (Tarjan's strongly connected components of more than one file)."""
    graph: dict[str, set[str]] = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            targets = {_source_of(m, root) for m in module_imports(path, root)}
            graph[str(path.relative_to(root))] = {str(t.relative_to(root)) for t in targets
                                                  if t is not None and t != path and not t.name == "__init__.py"}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_every_top_level_package_has_a_rule() -> None:
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(PACKAGE_RULES)


def test_top_level_packages_import_only_what_the_rules_allow() -> None:
    assert package_violations(ROOT, PACKAGE_RULES) == []


def test_no_import_circles_in_the_tree() -> None:
    assert import_circles(ROOT, set(PACKAGE_RULES)) == []


def test_the_package_check_catches_an_edge_importing_the_fleet_runners(tmp_path: Path) -> None:
    """A test of the test: the edge reaching up into the simulator, lazily, inside a function."""
    for package in ("edge_broker", "local_fleet"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "local_fleet" / "simulate.py").write_text("def simulate():\n    pass\n")
    (tmp_path / "edge_broker" / "service.py").write_text("def f():\n    from local_fleet.simulate import simulate\n")
    found = package_violations(tmp_path, {"edge_broker": {"fedtier"}, "local_fleet": {"edge_broker"}})
    assert found == ["edge_broker/service.py imports local_fleet.simulate (edge_broker may import only ['fedtier'])"]


def test_the_circle_check_catches_a_circle(tmp_path: Path) -> None:
    """A test of the test: two modules of the simulator importing each other (one of them lazily)."""
    (tmp_path / "local_fleet").mkdir()
    (tmp_path / "local_fleet" / "__init__.py").write_text("")
    (tmp_path / "local_fleet" / "simulate.py").write_text("from local_fleet.simulate_ray import RayDevices\n")
    (tmp_path / "local_fleet" / "simulate_ray.py").write_text("def f():\n    from local_fleet import simulate\n")
    (tmp_path / "local_fleet" / "demo.py").write_text("from local_fleet.simulate import RayDevices\n")
    assert import_circles(tmp_path, {"local_fleet"}) == [["local_fleet/simulate.py", "local_fleet/simulate_ray.py"]]

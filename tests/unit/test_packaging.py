"""``fedtier[agent]`` installs on the boards and Pythons it claims, with exactly one onnxruntime.

Two layers:

* offline: the agent extra's environment markers, evaluated over a grid of machines,
  operating systems and Pythons, select exactly one of ``onnxruntime-training-cpu`` and the
  stock ``onnxruntime`` (both install the ``onnxruntime`` import package: never both);
* ``network``: pip resolves ``fedtier[agent]`` from the built wheel against the package index
  for Linux aarch64 / Python 3.13 (stock onnxruntime), aarch64 / 3.10 (Jetson's JetPack) and
  x86_64 / 3.12 (onnxruntime-training-cpu 1.19.2). In CI (``CI=true``) an unreachable index
  fails the test; locally it skips and says why.

pip evaluates environment markers for the interpreter it runs in, not for ``--platform`` /
``--python-version`` (pypa/pip#11664), so on this x86_64 machine a plain ``pip install
--dry-run --platform manylinux2014_aarch64 ...`` would still choose onnxruntime-training. The
resolution below runs pip with the marker environment of the target board (what pip on the
board itself evaluates), plus ``--platform``/``--python-version`` for the wheel tags.
onnxruntime's aarch64 wheels are tagged ``manylinux_2_27``/``2_28`` (Raspberry Pi OS
bookworm has glibc 2.36), so ``manylinux_2_28`` is offered next to ``manylinux2014``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from itertools import product
from pathlib import Path

import pytest
from conftest import require

ROOT = Path(__file__).resolve().parents[2]
TRAINING = "onnxruntime-training-cpu"
STOCK = "onnxruntime"

NETWORK_ERRORS = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                  "Could not fetch URL", "ConnectTimeout", "Network is unreachable", "ReadTimeoutError")


def index_unreachable(stderr: str) -> bool:
    """pip's words for "no index": connection errors, or not even numpy found (with retries off
    pip logs no connection error, and numpy has wheels for every target here)."""
    return any(e in stderr for e in NETWORK_ERRORS) or (
        "requirement numpy" in stderr and "(from versions: none)" in stderr)

PIP_FOR_BOARD = textwrap.dedent("""
    import sys
    from pip._vendor.packaging import markers

    machine, python = sys.argv[1], sys.argv[2]
    host = markers.default_environment

    def board():
        env = host()
        env.update(platform_machine=machine, python_version=python, python_full_version=python + ".0",
                   sys_platform="linux", platform_system="Linux", os_name="posix",
                   implementation_name="cpython", platform_python_implementation="CPython")
        return env

    markers.default_environment = board  # what pip evaluates on the board itself
    from pip._internal.cli.main import main
    sys.exit(main(sys.argv[3:]))
""")


def agent_requirements() -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["optional-dependencies"]["agent"])


def marker_environment(machine: str, system: str, python: str) -> dict[str, str]:
    sys_platform = {"Linux": "linux", "Darwin": "darwin", "Windows": "win32"}[system]
    return {"platform_machine": machine, "platform_system": system, "sys_platform": sys_platform,
            "python_version": python, "python_full_version": f"{python}.0", "os_name": "nt" if system == "Windows"
            else "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "extra": "agent"}


def agent_packages_for(env: dict[str, str]) -> set[str]:
    """The distributions ``fedtier[agent]`` asks for (beyond the core) in the marker environment ``env``."""
    from packaging.requirements import Requirement

    requirements = [Requirement(line) for line in agent_requirements()]
    return {r.name for r in requirements if r.marker is None or r.marker.evaluate(env)}


def onnxruntimes_for(env: dict[str, str]) -> set[str]:
    return agent_packages_for(env) & {TRAINING, STOCK}


@pytest.mark.parametrize("machine, system", [("x86_64", "Linux"), ("aarch64", "Linux"), ("armv7l", "Linux"),
                                             ("AMD64", "Windows"), ("ARM64", "Windows"), ("arm64", "Darwin"),
                                             ("x86_64", "Darwin")])
def test_exactly_one_onnxruntime_is_chosen_everywhere(machine: str, system: str) -> None:
    for python in ("3.10", "3.11", "3.12", "3.13", "3.14"):
        chosen = onnxruntimes_for(marker_environment(machine, system, python))
        assert len(chosen) == 1, (machine, system, python, chosen)
        has_training_wheel = python <= "3.12" and (machine in ("x86_64", "AMD64") or system == "Darwin")
        assert chosen == ({TRAINING} if has_training_wheel else {STOCK}), (machine, system, python)


def test_the_agent_extra_holds_no_torch_and_onnx_only_next_to_onnxruntime_training() -> None:
    for machine, python in product(("x86_64", "aarch64"), ("3.11", "3.13")):
        packages = agent_packages_for(marker_environment(machine, "Linux", python))
        assert "torch" not in packages and "paho-mqtt" in packages
        assert ("onnx" in packages) == (TRAINING in packages)


def test_the_agent_and_edge_extras_hold_no_dashboard_plotting_or_browser() -> None:
    """The dashboard, the plots and the browser test are the coordinator's and the developer's; a device
    or a gateway gets only prometheus-client beyond MQTT (and, on a device, ONNX Runtime)."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {extra: {Requirement(line).name for line in extras[extra]} for extra in ("agent", "edge", "coordinator",
                                                                                      "dev")}
    web = {"starlette", "uvicorn", "fastapi", "matplotlib", "playwright", "selenium", "httpx", "rich"}
    assert names["edge"] == {"paho-mqtt", "prometheus-client"}
    assert names["agent"] - {"onnxruntime-training-cpu", "onnxruntime", "onnx"} == {"paho-mqtt", "prometheus-client"}
    assert not (names["agent"] | names["edge"]) & web
    assert {"starlette", "uvicorn", "matplotlib", "prometheus-client"} <= names["coordinator"]
    assert "playwright" in names["dev"]
    assert extras["ray"] == ["ray>=2.9"] and "ray" not in names["agent"] | names["edge"] | names["coordinator"]
    assert "fedtier[agent,edge,coordinator,ray,postgres]" in extras["all"]
    sql = {"sqlalchemy", "psycopg", "psycopg2", "psycopg2-binary"}
    assert "sqlalchemy" in names["coordinator"] and not (names["agent"] | names["edge"]) & sql
    assert {Requirement(line).name for line in extras["postgres"]} == {"psycopg"}


# --- against the package index -------------------------------------------------------------------------


def source_copy(destination: Path) -> Path:
    """The checkout's files as git sees them (tracked, and new ones not ignored), copied to ``destination``;
    outside a git checkout, the tree without what .gitignore leaves out of it.

    pip builds a local project in place (setuptools writes ``build/`` and ``*.egg-info`` into it): two xdist
    workers building the checkout itself at once raced there. Each builds its own copy instead."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
    except FileNotFoundError:  # no git
        listed = None
    if listed is None or listed.returncode != 0:
        ignored = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", ".venv*", "__pycache__", "*.pyc",
                                         ".*_cache", ".hypothesis", "runs", ".fedtier")
        shutil.copytree(ROOT, destination, ignore=ignored, dirs_exist_ok=True)
        return destination
    for name in listed.stdout.split("\0"):
        source = ROOT / name
        if name and source.is_file():  # a tracked file deleted in the work tree is not part of the build
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = source_copy(tmp_path_factory.mktemp("source"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out),
                           str(source)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and index_unreachable(proc.stderr):
        require(False, "the package index (PyPI), to build the wheel")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [built] = out.glob("fedtier-*.whl")
    return built


def resolve_for_board(wheel: Path, machine: str, python: str, tmp_path: Path) -> dict[str, str]:
    """``pip install --dry-run`` of ``fedtier[agent]`` for the board: name -> version to install."""
    report = tmp_path / "report.json"
    platforms = [f"--platform=manylinux2014_{machine}", f"--platform=manylinux_2_28_{machine}"]
    argv = [sys.executable, "-c", PIP_FOR_BOARD, machine, python, "install", "--dry-run",
            "--ignore-installed", "--target", str(tmp_path / "target"), "--only-binary=:all:", *platforms,
            "--python-version", python, "--report", str(report), f"{wheel}[agent]"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and index_unreachable(proc.stderr):
        require(False, "the package index (PyPI)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    installs = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installs}


@pytest.mark.network
@pytest.mark.parametrize("machine, python, onnxruntime", [
    ("aarch64", "3.13", STOCK),     # Raspberry Pi OS 64-bit, a current Python
    ("aarch64", "3.10", STOCK),     # Jetson (JetPack's Python 3.10)
    ("x86_64", "3.12", TRAINING),   # where onnxruntime-training-cpu has its last wheel
])
def test_fedtier_agent_resolves_for_the_board(wheel: Path, tmp_path: Path, machine: str, python: str,
                                              onnxruntime: str) -> None:
    chosen = resolve_for_board(wheel, machine, python, tmp_path)
    assert chosen["fedtier"] == "0.1.0"
    assert onnxruntime in chosen, chosen
    assert {TRAINING, STOCK} - {onnxruntime} & set(chosen) == set(), chosen  # never both
    if onnxruntime == TRAINING:
        assert chosen[TRAINING] == "1.19.2"
    assert "torch" not in chosen
    assert {"numpy", "msgpack", "click", "cryptography", "paho-mqtt"} <= set(chosen)

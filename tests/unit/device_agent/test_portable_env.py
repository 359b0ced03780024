"""The agent in a device environment without onnxruntime-training and without torch.

``install.sh`` creates ``.venv-portable/``: the stock onnxruntime wheel, the agent's other
dependencies and fedtier installed without dependencies, which is what ``fedtier[agent]``
resolves to on a board without an onnxruntime-training wheel (Linux aarch64, Python 3.13+).
A script runs there in a subprocess and trains with the agent's own backend choice
(``trainer = "auto"``); this process trains the same bundles from the same initial weights
and batches with onnxruntime-training, and the weights must agree.

In CI (``CI=true``) a missing environment fails; locally the tests skip and say to run
``./install.sh``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import require

from device_agent.trainers import make_trainer
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.training.layout import ArchSpec
from models.artifacts import build_artifacts

ROOT = Path(__file__).resolve().parents[3]
PORTABLE_PYTHON = ROOT / ".venv-portable" / "bin" / "python"
ARCHS = {
    "mlp": ArchSpec("mlp", {"sizes": [64, 64, 10]}),
    "cnn1d": ArchSpec("cnn1d", {"channels": 3, "length": 32, "classes": 5, "filters": [8, 16], "kernel": 5}),
}
STEPS = 20
LR = 0.1
TOL = 1e-5

TRAIN_SCRIPT = textwrap.dedent("""
    import importlib.util, json, sys
    import numpy as np
    from device_agent.trainers import describe_backend, make_trainer, resolve_kind
    from fedtier.artifacts.bundle import ArtifactBundle

    job = json.loads(sys.argv[1])
    backend = resolve_kind("auto")
    report = {"backend": backend, "describe": describe_backend("auto"), "results": {}}
    for name, spec in job["bundles"].items():
        bundle = ArtifactBundle.load(spec["directory"])
        batches = np.load(spec["batches"], allow_pickle=False)
        trainer = make_trainer("auto", bundle)
        report["results"][name] = {"class": type(trainer).__name__}
        stats = trainer.train_steps([(batches["x"][i], batches["y"][i]) for i in range(len(batches["x"]))],
                                    job["lr"])
        np.savez(spec["out"], **trainer.get_parameters())
        report["results"][name]["mean_loss"] = stats.mean_loss
    report["torch_importable"] = importlib.util.find_spec("torch") is not None
    report["onnx_importable"] = importlib.util.find_spec("onnx") is not None
    report["torch_imported"] = "torch" in sys.modules
    print(json.dumps(report))
""")

REQUIREMENTS_SCRIPT = textwrap.dedent("""
    import importlib.metadata as md, json, re
    try:
        from packaging.requirements import Requirement
    except ImportError:  # packaging comes with onnxruntime today; pip always vendors it
        from pip._vendor.packaging.requirements import Requirement
    # What `pip install fedtier[agent]` asks for on a Raspberry Pi OS (64-bit) with Python 3.13.
    board = {"platform_machine": "aarch64", "python_version": "3.13", "python_full_version": "3.13.0",
             "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
             "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": "agent"}
    wanted = [Requirement(r) for r in md.requires("fedtier")]
    def canonical(name):  # PEP 503: prometheus_client and prometheus-client are one project
        return re.sub(r"[-_.]+", "-", name).lower()
    needed = sorted({canonical(r.name) for r in wanted if r.marker is None or r.marker.evaluate(board)})
    installed = {canonical(d.metadata["Name"]): d.version for d in md.distributions()}
    print(json.dumps({"needed": needed, "installed": installed}))
""")


def portable_python() -> Path:
    require(PORTABLE_PYTHON.exists(),
            f"the stock-onnxruntime device environment {PORTABLE_PYTHON.parent.parent} (run ./install.sh)")
    return PORTABLE_PYTHON


def run_in_portable_env(script: str, *args: str, cwd: Path) -> dict:
    proc = subprocess.run([str(portable_python()), "-c", script, *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ArtifactBundle]:
    store = tmp_path_factory.getbasetemp() / "fedtier-artifact-store"
    return {name: build_artifacts(arch, store, seed=0) for name, arch in ARCHS.items()}


def batches_for(arch: ArchSpec, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((STEPS, 16, *arch.input_shape)).astype(np.float32)
    y = rng.integers(0, arch.num_classes, size=(STEPS, 16)).astype(np.int64)
    return x, y


def test_the_device_env_has_what_fedtier_agent_needs_on_a_board_and_nothing_heavy(tmp_path: Path) -> None:
    found = run_in_portable_env(REQUIREMENTS_SCRIPT, cwd=tmp_path)
    installed = found["installed"]
    assert "onnxruntime" in found["needed"] and "onnxruntime-training-cpu" not in found["needed"]
    missing = [name for name in found["needed"] if name not in installed]
    assert missing == [], f".venv-portable lacks {missing} (install.sh and pyproject.toml disagree)"
    heavy = {"torch", "onnxruntime-training-cpu", "onnxruntime-training", "onnx"} & set(installed)
    assert heavy == set()


def assert_trains_like_onnxruntime_training(bundles: dict[str, ArtifactBundle],
                                            batches: dict[str, tuple[np.ndarray, np.ndarray]], tmp_path: Path) -> None:
    """Train each bundle 20 steps here with onnxruntime-training and there with the agent's own choice;
    the weights must agree to 1e-5 (and have moved)."""
    job: dict = {"lr": LR, "bundles": {}}
    expected = {}
    for name, bundle in bundles.items():
        x, y = batches[name]
        np.savez(tmp_path / f"{name}-batches.npz", x=x, y=y)
        job["bundles"][name] = {"directory": str(bundle.directory), "batches": str(tmp_path / f"{name}-batches.npz"),
                                "out": str(tmp_path / f"{name}-portable.npz")}
        ort_trainer = make_trainer("ort", bundle)  # the same initial weights: the bundle's
        ort_trainer.train_steps([(x[i], y[i]) for i in range(STEPS)], LR)
        expected[name] = ort_trainer.get_parameters()

    report = run_in_portable_env(TRAIN_SCRIPT, json.dumps(job), cwd=tmp_path)

    assert report["backend"] == "portable", report  # "auto" picked the portable graph there
    assert "onnxruntime" in report["describe"]
    assert not report["torch_importable"] and not report["onnx_importable"] and not report["torch_imported"]
    for name in bundles:
        assert report["results"][name]["class"] == "PortableTrainer"
        with np.load(tmp_path / f"{name}-portable.npz") as got:
            assert sorted(got.files) == sorted(expected[name])
            for param, want in expected[name].items():
                assert got[param].dtype == np.float32
                np.testing.assert_allclose(got[param], want, rtol=0, atol=TOL, err_msg=f"{name}: {param}")
            moved = max(float(np.abs(got[p] - v).max())
                        for p, v in make_trainer("ort", bundles[name]).get_parameters().items())
            assert moved > 100 * TOL  # the weights really trained away from the start


def test_agent_without_onnxruntime_training_trains_like_onnxruntime_training(
        bundles: dict[str, ArtifactBundle], tmp_path: Path) -> None:
    """20 steps of the MLP and the 1-D CNN: same weights (1e-5) as the in-process ORT-training run."""
    batches = {name: batches_for(ARCHS[name], seed) for seed, name in enumerate(bundles)}
    assert_trains_like_onnxruntime_training(bundles, batches, tmp_path)


def test_agent_without_onnxruntime_training_trains_users_models_like_onnxruntime_training(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """fedtier init's starter (MaxPool), a model per loss (cross_entropy, bce, mse) with frozen tensors, and an
    ONNX file with only its head trainable."""
    from portable_models import batches_for as user_batches
    from portable_models import build_user_bundles

    users = build_user_bundles(tmp_path_factory.mktemp("user-models"),
                               tmp_path_factory.getbasetemp() / "fedtier-artifact-store")
    batches = {name: user_batches(bundle.arch, STEPS, seed) for seed, (name, bundle) in enumerate(users.items())}
    assert_trains_like_onnxruntime_training(users, batches, tmp_path)


def test_agent_version_in_the_device_env_names_the_portable_backend(tmp_path: Path) -> None:
    proc = subprocess.run([str(portable_python()), "-m", "fedtier", "agent", "--version"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "trainer: auto -> portable (onnxruntime " in proc.stdout
    ours = subprocess.run([sys.executable, "-m", "fedtier", "agent", "--version"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert "trainer: auto -> ort (onnxruntime-training-cpu 1.19.2" in ours.stdout

"""Trainer backends (ORT, portable, torch) against a plain-torch reference, and the protocol contract.

The portable backend runs here on the onnxruntime of this environment (the training build,
which runs standard ops too); ``test_portable_env.py`` runs it in an environment with only
the stock onnxruntime.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from device_agent.trainers import make_trainer
from device_agent.trainers.ort import OrtTrainer
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.errors import LocalProtocolError
from fedtier.training.layout import ArchSpec
from fedtier.training.trainer import EvalResult, Trainer, TrainStats
from models.artifacts import build_artifacts
from models.zoo import initial_parameters

ARCHS = {
    "mlp-64": ArchSpec("mlp", {"sizes": [64, 64, 10]}),
    "mlp-300": ArchSpec("mlp", {"sizes": [64, 300, 10]}),
    "cnn1d": ArchSpec("cnn1d", {"channels": 3, "length": 32, "classes": 5, "filters": [8, 16],
                                "kernel": 5}),
}
BACKENDS = ("ort", "portable", "torch")
TOL = 1e-5

Params = dict[str, np.ndarray]


@pytest.fixture(scope="session")
def trainer_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same store as the artifact tests: bundles are built once per session."""
    return tmp_path_factory.getbasetemp() / "fedtier-artifact-store"


@pytest.fixture(scope="session")
def bundles(trainer_store: Path) -> dict[str, ArtifactBundle]:
    return {name: build_artifacts(arch, trainer_store, seed=0) for name, arch in ARCHS.items()}


@pytest.fixture(params=sorted(ARCHS))
def arch_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def new_trainer(bundles: dict[str, ArtifactBundle], arch_name: str, backend: str
                ) -> Callable[[], Trainer]:
    return lambda: make_trainer(backend, bundles[arch_name])


def data(arch: ArchSpec, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *arch.input_shape)).astype(np.float32)
    y = rng.integers(0, arch.num_classes, size=n).astype(np.int64)
    return x, y


def start_params(arch: ArchSpec) -> Params:
    """Parameters different from the bundle's checkpoint, so set_parameters really matters."""
    return initial_parameters(arch, seed=11)


# --- plain torch reference -----------------------------------------------------------------


class TorchReference:
    """Textbook torch: the zoo module, F.cross_entropy, w -= lr * grad."""

    def __init__(self, arch: ArchSpec, params: Params) -> None:
        import torch

        from models.zoo import build_model

        self.torch = torch
        self.model = build_model(arch, 0)
        self.model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in params.items()})

    def _loss(self, x: np.ndarray, y: np.ndarray):  # noqa: ANN202
        logits = self.model(self.torch.from_numpy(x))
        return self.torch.nn.functional.cross_entropy(logits, self.torch.from_numpy(y))

    def step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        self.model.zero_grad()
        loss = self._loss(x, y)
        loss.backward()
        with self.torch.no_grad():
            for p in self.model.parameters():
                p -= lr * p.grad
        return float(loss.detach())

    def gradient(self, x: np.ndarray, y: np.ndarray) -> tuple[Params, float]:
        self.model.zero_grad()
        loss = self._loss(x, y)
        loss.backward()
        grads = {k: p.grad.numpy().copy() for k, p in self.model.named_parameters()}
        return grads, float(loss.detach())

    def logits(self, x: np.ndarray) -> np.ndarray:
        with self.torch.no_grad():
            return self.model(self.torch.from_numpy(x)).numpy()

    def params(self) -> Params:
        return {k: v.numpy().copy() for k, v in self.model.state_dict().items()}


def max_diff(a: Params, b: Params) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def assert_bit_identical(a: Params, b: Params) -> None:
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# --- numerical equivalence -----------------------------------------------------------------


def test_one_step_matches_torch(new_trainer: Callable[[], Trainer], arch_name: str) -> None:
    arch = ARCHS[arch_name]
    trainer = new_trainer()
    params = start_params(arch)
    trainer.set_parameters(params)
    ref = TorchReference(arch, params)
    x, y = data(arch, 32, seed=1)
    stats = trainer.train_steps([(x, y)], lr=0.1)
    ref_loss = ref.step(x, y, 0.1)
    assert stats == TrainStats(steps=1, samples=32, mean_loss=pytest.approx(ref_loss, abs=TOL))
    assert max_diff(trainer.get_parameters(), ref.params()) <= TOL


def test_consecutive_steps_stay_close(new_trainer: Callable[[], Trainer], arch_name: str) -> None:
    arch = ARCHS[arch_name]
    trainer = new_trainer()
    params = start_params(arch)
    trainer.set_parameters(params)
    ref = TorchReference(arch, params)
    batches = [data(arch, 16, seed=100 + i) for i in range(8)]
    stats = trainer.train_steps(iter(batches), lr=0.05)  # any iterable, consumed once
    losses = [ref.step(x, y, 0.05) for x, y in batches]
    assert stats.steps == 8 and stats.samples == 128
    assert stats.mean_loss == pytest.approx(float(np.mean(losses)), abs=TOL)
    assert max_diff(trainer.get_parameters(), ref.params()) <= 5 * TOL


def test_compute_gradient(new_trainer: Callable[[], Trainer], arch_name: str) -> None:
    arch = ARCHS[arch_name]
    trainer = new_trainer()
    params = start_params(arch)
    trainer.set_parameters(params)
    x, y = data(arch, 24, seed=2)
    grads, loss = trainer.compute_gradient(x, y)
    ref_grads, ref_loss = TorchReference(arch, params).gradient(x, y)
    assert list(grads) == list(trainer.layout.names)
    assert all(g.dtype == np.float32 for g in grads.values())
    assert max_diff(grads, ref_grads) <= TOL
    assert loss == pytest.approx(ref_loss, abs=TOL)
    assert_bit_identical(trainer.get_parameters(), params)  # parameters untouched
    grads_again, _ = trainer.compute_gradient(x, y)  # no accumulation across calls
    assert_bit_identical(grads_again, grads)

    # A following train step is unaffected by the gradient computation.
    x2, y2 = data(arch, 24, seed=3)
    trainer.train_steps([(x2, y2)], lr=0.2)
    after_gradient = trainer.get_parameters()
    trainer.set_parameters(params)
    trainer.train_steps([(x2, y2)], lr=0.2)
    assert_bit_identical(after_gradient, trainer.get_parameters())


def test_apply_step_equals_manual_update(new_trainer: Callable[[], Trainer], arch_name: str) -> None:
    arch = ARCHS[arch_name]
    trainer = new_trainer()
    params = start_params(arch)
    trainer.set_parameters(params)
    rng = np.random.default_rng(4)
    direction = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    trainer.apply_step(direction, lr=0.3)
    expected = {k: params[k] - 0.3 * direction[k] for k in params}
    assert max_diff(trainer.get_parameters(), expected) == 0.0
    # a partial direction only moves the named tensors
    first = next(iter(params))
    trainer.apply_step({first: direction[first]}, lr=1.0)
    got = trainer.get_parameters()
    np.testing.assert_array_equal(got[first], expected[first] - direction[first])
    for k in list(params)[1:]:
        np.testing.assert_array_equal(got[k], expected[k])


def test_apply_step_with_own_gradient_equals_train_step(
        new_trainer: Callable[[], Trainer], arch_name: str) -> None:
    arch = ARCHS[arch_name]
    trainer = new_trainer()
    params = start_params(arch)
    trainer.set_parameters(params)
    x, y = data(arch, 16, seed=5)
    grads, _ = trainer.compute_gradient(x, y)
    trainer.apply_step(grads, lr=0.1)
    via_apply = trainer.get_parameters()
    trainer.set_parameters(params)
    trainer.train_steps([(x, y)], lr=0.1)
    assert max_diff(via_apply, trainer.get_parameters()) <= 1e-6


def test_evaluate_matches_torch(new_trainer: Callable[[], Trainer], arch_name: str) -> None:
    arch = ARCHS[arch_name]
    trainer = new_trainer()
    params = start_params(arch)
    trainer.set_parameters(params)
    ref = TorchReference(arch, params)
    x, y = data(arch, 2500, seed=6)  # > 2 evaluation chunks
    result = trainer.evaluate(x, y)
    logits = ref.logits(x)
    import torch

    ref_loss = float(torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(y)))
    ref_correct = int((logits.argmax(axis=1) == y).sum())
    top2 = np.sort(logits, axis=1)[:, -2:]
    ambiguous = int((top2[:, 1] - top2[:, 0] < 1e-4).sum())  # argmax may legitimately flip
    assert isinstance(result, EvalResult) and result.samples == 2500
    assert abs(result.accuracy * 2500 - ref_correct) <= ambiguous
    assert result.loss == pytest.approx(ref_loss, abs=TOL)
    assert_bit_identical(trainer.get_parameters(), params)
    # evaluation leaves the trainer in training mode with clean gradients
    x2, y2 = data(arch, 8, seed=7)
    grads, _ = trainer.compute_gradient(x2, y2)
    assert max_diff(grads, ref.gradient(x2, y2)[0]) <= TOL


def test_predict_matches_torch_forward(new_trainer: Callable[[], Trainer], arch_name: str) -> None:
    arch = ARCHS[arch_name]
    trainer = new_trainer()
    params = start_params(arch)
    trainer.set_parameters(params)
    x, _ = data(arch, 1500, seed=8)
    logits = trainer.predict(x)
    assert logits.dtype == np.float32 and logits.shape == (1500, arch.num_classes)
    assert float(np.abs(logits - TorchReference(arch, params).logits(x)).max()) <= TOL
    assert trainer.predict(x[:0]).shape == (0, arch.num_classes)
    # float64 input is cast; GEMM blocking may differ with the batch size, hence allclose
    np.testing.assert_allclose(trainer.predict(x[:3].astype(np.float64)), logits[:3], atol=1e-6)


# --- parameters and the protocol -------------------------------------------------------------


def test_initial_parameters_are_the_bundle_seed(new_trainer: Callable[[], Trainer],
                                                arch_name: str) -> None:
    assert_bit_identical(new_trainer().get_parameters(), initial_parameters(ARCHS[arch_name], 0))


def test_set_get_round_trip_is_exact_and_copies(new_trainer: Callable[[], Trainer],
                                                arch_name: str) -> None:
    trainer = new_trainer()
    assert isinstance(trainer, Trainer)
    assert trainer.layout.names == tuple(initial_parameters(ARCHS[arch_name], 0))
    rng = np.random.default_rng(9)
    params = {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in trainer.layout.params}
    trainer.set_parameters(params)
    got = trainer.get_parameters()
    assert_bit_identical(got, params)
    for arr in got.values():
        arr[...] = 0.0  # the caller owns returned arrays
    for arr in params.values():
        arr[...] = 1.0  # and the trainer does not keep the caller's arrays
    assert max_diff(trainer.get_parameters(), got) > 0.5
    batch = data(ARCHS[arch_name], 4, seed=10)
    grads, _ = trainer.compute_gradient(*batch)
    kept = {k: g.copy() for k, g in grads.items()}
    for g in grads.values():
        g[...] = 7.0  # returned gradients are copies too
    assert_bit_identical(trainer.compute_gradient(*batch)[0], kept)


def test_lr_zero_changes_nothing(new_trainer: Callable[[], Trainer], arch_name: str) -> None:
    trainer = new_trainer()
    before = trainer.get_parameters()
    x, y = data(ARCHS[arch_name], 8, seed=12)
    trainer.train_steps([(x, y)], lr=0.5)
    moved = trainer.get_parameters()
    assert max_diff(moved, before) > 0
    trainer.train_steps([(x, y)], lr=0.0)  # the previous call's 0.5 must not stick
    assert_bit_identical(trainer.get_parameters(), moved)


def test_invalid_parameters_rejected_atomically(new_trainer: Callable[[], Trainer]) -> None:
    trainer = new_trainer()
    before = trainer.get_parameters()
    first, second = trainer.layout.params[0], trainer.layout.params[1]
    good = np.ones(first.shape, np.float32)
    with pytest.raises(LocalProtocolError, match="unknown parameter"):
        trainer.set_parameters({first.name: good, "nope.weight": good})
    with pytest.raises(LocalProtocolError, match="shape"):
        trainer.set_parameters({first.name: good, second.name: np.ones((1, 2), np.float32)})
    with pytest.raises(LocalProtocolError, match="dtype"):
        trainer.set_parameters({first.name: good.astype(np.int32)})
    with pytest.raises(LocalProtocolError, match="unknown direction"):
        trainer.apply_step({"nope": good}, lr=0.1)
    with pytest.raises(LocalProtocolError, match="shape"):
        trainer.apply_step({first.name: good.ravel()}, lr=0.1)
    with pytest.raises(LocalProtocolError, match="learning rate"):
        trainer.apply_step({first.name: good}, lr=float("nan"))
    assert_bit_identical(trainer.get_parameters(), before)
    trainer.set_parameters({first.name: good.astype(np.float64)})  # floats are cast
    np.testing.assert_array_equal(trainer.get_parameters()[first.name], good)


def test_invalid_batches_rejected(new_trainer: Callable[[], Trainer], arch_name: str) -> None:
    arch = ARCHS[arch_name]
    trainer = new_trainer()
    x, y = data(arch, 4, seed=13)
    with pytest.raises(LocalProtocolError, match="shape"):
        trainer.train_steps([(x[:, :-1], y)], lr=0.1)
    with pytest.raises(LocalProtocolError, match="labels"):
        trainer.compute_gradient(x, y[:3])
    with pytest.raises(LocalProtocolError, match="labels"):
        trainer.evaluate(x, np.full(4, arch.num_classes))
    with pytest.raises(LocalProtocolError, match="labels"):
        trainer.evaluate(x, y.astype(np.float32))
    with pytest.raises(LocalProtocolError, match="empty"):
        trainer.evaluate(x[:0], y[:0])
    with pytest.raises(LocalProtocolError, match="learning rate"):
        trainer.train_steps([(x, y)], lr=float("inf"))
    empty = trainer.train_steps([], lr=0.1)
    assert (empty.steps, empty.samples) == (0, 0) and np.isnan(empty.mean_loss)
    # int32 labels and float64 inputs are accepted (cast to int64 / float32)
    assert trainer.train_steps([(x.astype(np.float64), y.astype(np.int32))], lr=0.1).steps == 1


def test_backends_agree_bitwise_on_initial_state_and_closely_after_training(
        bundles: dict[str, ArtifactBundle]) -> None:
    arch = ARCHS["mlp-64"]
    ort_trainer = make_trainer("ort", bundles["mlp-64"])
    torch_trainer = make_trainer("torch", bundles["mlp-64"])
    assert_bit_identical(ort_trainer.get_parameters(), torch_trainer.get_parameters())
    batches = [data(arch, 16, seed=200 + i) for i in range(20)]
    ort_trainer.train_steps(batches, lr=0.1)
    torch_trainer.train_steps(batches, lr=0.1)
    assert max_diff(ort_trainer.get_parameters(), torch_trainer.get_parameters()) <= 1e-4


# --- ORT specifics -------------------------------------------------------------------------------


def test_shared_ort_trainer_swaps_devices(bundles: dict[str, ArtifactBundle]) -> None:
    """One OrtTrainer serving two simulated devices == one trainer each, bit for bit."""
    arch = ARCHS["mlp-300"]
    shared = OrtTrainer(bundles["mlp-300"])
    devices = {"a": initial_parameters(arch, 21), "b": initial_parameters(arch, 22)}
    batches = {"a": [data(arch, 16, seed=31 + i) for i in range(3)],
               "b": [data(arch, 16, seed=41 + i) for i in range(3)]}
    state = dict(devices)
    for i in range(3):
        for dev in ("a", "b"):
            shared.set_parameters(state[dev])
            if dev == "b":
                shared.compute_gradient(*batches[dev][i])  # interleaved gradient-only call
            shared.train_steps([batches[dev][i]], lr=0.1)
            state[dev] = shared.get_parameters()
    for dev in ("a", "b"):
        alone = OrtTrainer(bundles["mlp-300"])
        alone.set_parameters(devices[dev])
        for batch in batches[dev]:
            alone.train_steps([batch], lr=0.1)
        assert_bit_identical(state[dev], alone.get_parameters())


def test_ort_trainer_is_deterministic_across_instances(bundles: dict[str, ArtifactBundle]) -> None:
    arch = ARCHS["cnn1d"]
    batches = [data(arch, 32, seed=50 + i) for i in range(5)]
    results = []
    for _ in range(2):
        trainer = OrtTrainer(bundles["cnn1d"], threads=1)
        trainer.train_steps(batches, lr=0.1)
        results.append(trainer.get_parameters())
    assert_bit_identical(*results)


def test_make_trainer_kinds(bundles: dict[str, ArtifactBundle]) -> None:
    from device_agent.trainers.portable import PortableTrainer
    from device_agent.trainers.torch_backend import TorchTrainer

    assert isinstance(make_trainer("ort", bundles["mlp-64"]), OrtTrainer)
    assert isinstance(make_trainer("portable", bundles["mlp-64"]), PortableTrainer)
    assert isinstance(make_trainer("torch", bundles["mlp-64"], threads=1), TorchTrainer)
    # this environment has onnxruntime-training: "auto" keeps today's backend
    assert isinstance(make_trainer("auto", bundles["mlp-64"]), OrtTrainer)
    with pytest.raises(ValueError, match="auto, ort, portable, torch"):
        make_trainer("tflite", bundles["mlp-64"])
    with pytest.raises(LocalProtocolError, match="threads"):
        OrtTrainer(bundles["mlp-64"], threads=0)


def test_ort_trainer_refuses_stateful_optimizer(bundles: dict[str, ArtifactBundle],
                                                tmp_path: Path) -> None:
    import dataclasses
    import shutil

    from fedtier.artifacts.bundle import BundleFile
    from fedtier.errors import ArtifactError

    src = bundles["mlp-64"]
    shutil.copytree(src.directory, tmp_path / "adamw")
    optim = tmp_path / "adamw" / "optimizer_model.onnx"
    raw = optim.read_bytes()
    assert b"SGDOptimizerV2" in raw
    optim.write_bytes(raw.replace(b"SGDOptimizerV2", b"AdamWOptimizer"))  # same length
    files = {**src.files, "optimizer_model": BundleFile.of(optim)}
    dataclasses.replace(src, directory=tmp_path / "adamw", files=files).save()
    with pytest.raises(ArtifactError, match="stateless SGD"):
        OrtTrainer(ArtifactBundle.load(tmp_path / "adamw"))


@pytest.mark.parametrize("role", ["training_model", "checkpoint"])
def test_ort_trainer_reports_unloadable_artifacts(bundles: dict[str, ArtifactBundle],
                                                  tmp_path: Path, role: str) -> None:
    import dataclasses
    import shutil

    from fedtier.artifacts.bundle import BundleFile
    from fedtier.errors import ArtifactError

    src = bundles["mlp-64"]
    shutil.copytree(src.directory, tmp_path / "bad")
    target = tmp_path / "bad" / src.files[role].filename
    target.write_bytes(b"not a model")  # re-described, so only ORT can notice
    files = {**src.files, role: BundleFile.of(target)}
    dataclasses.replace(src, directory=tmp_path / "bad", files=files).save()
    with pytest.raises(ArtifactError, match="onnxruntime cannot load"):
        OrtTrainer(ArtifactBundle.load(tmp_path / "bad"))


TORCH_FREE_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import device_agent.trainers.ort as ort_backend
    from fedtier.artifacts.bundle import ArtifactBundle
    bundle = ArtifactBundle.load(sys.argv[1])
    trainer = ort_backend.OrtTrainer(bundle)
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    y = np.arange(8, dtype=np.int64) % 10
    before = trainer.get_parameters()
    stats = trainer.train_steps([(x, y)], 0.1)
    after = trainer.get_parameters()
    assert stats.steps == 1 and np.isfinite(stats.mean_loss), stats
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    assert 'torch' not in sys.modules, 'torch was imported'
    assert 'onnx' not in sys.modules, 'onnx was imported'
    assert sys.modules['onnxruntime.training'].__fedtier_shim__
    print('ok', stats.mean_loss)
""")


def test_ort_trainer_runs_without_importing_torch(bundles: dict[str, ArtifactBundle],
                                                  tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_SCRIPT, str(bundles["mlp-64"].directory)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok ")

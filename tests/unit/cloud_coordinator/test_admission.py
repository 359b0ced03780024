"""Admission: a model is trained for a few steps in a child process on every trainer path before a rollout
ships it; a crash (signal), an error or a non-finite result refuses the rollout naming the trainer and the op;
results are cached beside the bundles; `rollout create`, `coordinator run` and `simulate` exit 2 on a model
that would kill onnxruntime-training (an AvgPool1d layer: SIGFPE in its gradient)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from cloud_coordinator import admission
from cloud_coordinator.admission import ModelRefused, admit
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.errors import ConfigError
from fedtier.rollout.config import RolloutConfig

ROOT = Path(__file__).resolve().parents[3]
FEDTIER = [sys.executable, "-m", "fedtier"]

MODELS_PY = textwrap.dedent("""
    import torch
    from torch import nn


    class Scaled(nn.Module):
        def __init__(self, rows):
            super().__init__()
            self.fc = nn.Linear(30, 2)
            self.scale = nn.Parameter(torch.ones(rows, 30))  # sized by the example's batch, not (1, 30)

        def forward(self, x):
            return self.fc(x * self.scale)


    class LogOfNegative(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(30, 2)

        def forward(self, x):
            return self.fc(torch.log(x - 2.0))


    def avgpool():
        net = nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.AvgPool1d(2), nn.Flatten(), nn.Linear(4 * 15, 2))
        return net, torch.zeros(4, 1, 30)

    def fixed_batch():
        return Scaled(ROWS), torch.zeros(ROWS, 30)

    def log_of_negative():
        return LogOfNegative(), torch.zeros(4, 30)

    def good():
        net = nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.MaxPool1d(2), nn.Flatten(), nn.Linear(4 * 15, 2))
        return net, torch.zeros(4, 1, 30)
""")


@pytest.fixture(scope="module")
def models_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.source import _CHECK_BATCH

    path = tmp_path_factory.mktemp("admission-models") / "models.py"
    # The up-front check runs the forward graph on a batch of _CHECK_BATCH rows: a model sized by that batch
    # passes it, and fails on the trial's batch of admission.BATCH rows, as it would on the devices.
    path.write_text(MODELS_PY.replace("ROWS", str(_CHECK_BATCH)))
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This module's artifact store (its admission cache is the tests' to clear)."""
    return tmp_path_factory.mktemp("admission-store")


def config(models_file: Path, store: Path, state: Path, factory: str, **extra: Any) -> RolloutConfig:
    return RolloutConfig.from_mapping({
        "rollout": "adm", "rounds": 2, "seed": 1, "state_dir": str(state), "artifact_store": str(store),
        "model": {"kind": "torch", "factory": f"{models_file}:{factory}"},
        "data": {"dataset": "breast_cancer", "partition": "iid", "seed": 2},
        "topology": {"cells": 2, "devices_per_cell": 2},
        "fedavg": {"local_steps": 2, "lr": 0.1, "batch_size": 8}, **extra})


@pytest.fixture(scope="module")
def bundles(models_file: Path, store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ArtifactBundle]:
    from models.artifacts import build_artifacts
    from models.source import source_for

    state = tmp_path_factory.mktemp("state")
    out = {}
    for name in ("avgpool", "fixed_batch", "log_of_negative", "good"):
        cfg = config(models_file, store, state, name)
        out[name] = build_artifacts(source_for(cfg.model, 30, 2), store)
    return out


def forget(store: Path) -> None:
    shutil.rmtree(store / admission.CACHE_DIR, ignore_errors=True)


def test_a_model_that_kills_onnxruntime_is_refused_naming_the_signal_the_op_and_a_layer_that_trains(
        bundles: dict[str, ArtifactBundle], store: Path) -> None:
    # Prepare: a Conv1d -> AvgPool1d network; its training graph holds AveragePoolGrad (no portable lowering).
    bundle = bundles["avgpool"]
    assert bundle.portable is not None and bundle.portable.unsupported_ops == ("AveragePoolGrad",)
    forget(store)
    # Execute
    with pytest.raises(ModelRefused) as refused:
        admit([bundle], store)
    # Assert: the child died by SIGFPE in a training step on onnxruntime-training, in AveragePoolGrad; the
    # message says the portable trainer cannot train it either, and what layer would.
    (trial,) = refused.value.trials
    assert (trial.trainer, trial.outcome, trial.detail, trial.stage, trial.op) == (
        "ort", "crash", "SIGFPE", "train", "AveragePoolGrad")
    assert isinstance(refused.value, ConfigError) and refused.value.key == "model"
    text = str(refused.value)
    assert "killed by SIGFPE in a training step, in op AveragePoolGrad" in text
    assert "no lowering for AveragePoolGrad" in text and "MaxPool1d" in text


def test_a_crash_in_an_op_not_known_to_crash_names_the_one_op_without_a_portable_lowering(
        bundles: dict[str, ArtifactBundle], store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As if AveragePoolGrad were not known to crash: the op is inferred, and the message says it is a guess.
    monkeypatch.setattr(admission, "KNOWN_CRASHES", {})
    forget(store)
    with pytest.raises(ModelRefused) as refused:
        admit([bundles["avgpool"]], store, trainers=("ort",))
    (trial,) = refused.value.trials
    assert (trial.outcome, trial.op, trial.op_guessed) == ("crash", "AveragePoolGrad", True)
    assert "probably in op AveragePoolGrad" in str(refused.value)
    assert "a supported layer instead of the one that adds AveragePoolGrad" in str(refused.value)
    forget(store)


def test_an_error_is_refused_with_its_message_and_op_on_both_trainers(bundles: dict[str, ArtifactBundle],
                                                                      store: Path) -> None:
    forget(store)
    with pytest.raises(ModelRefused) as refused:
        admit([bundles["fixed_batch"]], store)
    trials = {t.trainer: t for t in refused.value.trials}
    assert set(trials) == {"ort", "portable"}
    for trial in trials.values():
        assert (trial.outcome, trial.stage, trial.op) == ("error", "train", "Mul")
        assert f"3 by {admission.BATCH}" in trial.detail and "onnxruntime_src" not in trial.detail
    assert "fix what the error says" in str(refused.value)


def test_a_non_finite_loss_is_refused(bundles: dict[str, ArtifactBundle], store: Path) -> None:
    # A log of values below zero: NaN from the first step, on both trainers.
    forget(store)
    with pytest.raises(ModelRefused) as refused:
        admit([bundles["log_of_negative"]], store)
    assert {(t.trainer, t.outcome, t.detail) for t in refused.value.trials} == {
        ("ort", "non-finite", "the training loss is nan at step 1"),
        ("portable", "non-finite", "the training loss is nan at step 1")}
    # A good model with a learning rate that diverges: the learning rate is part of the cache key.
    admit([bundles["good"]], store)
    with pytest.raises(ModelRefused) as diverged:
        admit([bundles["good"]], store, lr=1e30)
    assert {t.outcome for t in diverged.value.trials} == {"non-finite"}
    assert "make the model finite" in str(diverged.value)


def test_a_good_model_is_admitted_on_both_trainers_once_and_then_read_from_the_cache(
        bundles: dict[str, ArtifactBundle], store: Path) -> None:
    bundle = bundles["good"]
    forget(store)
    # Execute: the first admission trains in two child processes; the second reads the cache.
    first = admit([bundle], store)
    second = admit([bundle], store)
    only_ort = admit([bundle], store, trainers=("ort",))
    # Assert
    assert {(t.trainer, t.outcome) for t in first.trials} == {("ort", "ok"), ("portable", "ok")}
    assert first.cached == 0 and second.cached == 2 and only_ort.cached == 1
    assert second.seconds < 0.1 < first.seconds
    cache = json.loads((store / admission.CACHE_DIR / f"{bundle.bundle_id}.json").read_text())
    assert cache["bundle_id"] == bundle.bundle_id
    assert sorted(key.split("|")[0] for key in cache["results"]) == ["ort", "portable"]
    assert all(admission.runtime("ort") in key for key in cache["results"])


def test_after_a_crash_the_bundles_not_reached_go_to_a_fresh_child(bundles: dict[str, ArtifactBundle],
                                                                   store: Path) -> None:
    forget(store)
    with pytest.raises(ModelRefused) as refused:
        admit([bundles["avgpool"], bundles["good"]], store, trainers=("ort",))
    assert [(t.bundle_id, t.outcome) for t in refused.value.trials] == [(bundles["avgpool"].bundle_id, "crash")]
    cached = json.loads((store / admission.CACHE_DIR / f"{bundles['good'].bundle_id}.json").read_text())
    assert [r["outcome"] for r in cached["results"].values()] == ["ok"]


def test_a_trial_that_times_out_refuses_and_is_not_cached(bundles: dict[str, ArtifactBundle], store: Path) -> None:
    forget(store)
    with pytest.raises(ModelRefused) as refused:
        admit([bundles["good"]], store, trainers=("ort",), timeout_s=0.05)
    assert [t.outcome for t in refused.value.trials] == ["timeout"]
    assert not (store / admission.CACHE_DIR / f"{bundles['good'].bundle_id}.json").exists()


def test_the_trial_process_imports_no_torch(bundles: dict[str, ArtifactBundle]) -> None:
    code = ("import runpy, sys\n"
            f"sys.argv = ['admission', '--trainer', 'ort', {str(bundles['good'].directory)!r}]\n"
            "try:\n    runpy.run_module('cloud_coordinator.admission', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = done.stdout.splitlines()
    assert json.loads(lines[-2])["outcome"] == "ok" and lines[-1] == "False", done.stderr


def test_hsgds_split_model_is_admitted_on_its_onnxruntime_trainer(store: Path) -> None:
    from fedtier.training import split
    from models.split_artifacts import build_split_artifacts

    bundle = build_split_artifacts(split.SplitArch(x1=6, x2=4, d1=3, d2=3, classes=2), store, seed=0)
    result = admit([bundle], store)
    assert [(t.trainer, t.outcome) for t in result.trials] == [("split", "ok")]
    assert admit([bundle], store, trainers=("portable",)).trials == ()  # no native code off onnxruntime


def test_prepare_refuses_before_the_manifest_and_admits_every_hist_submodel(
        models_file: Path, store: Path, tmp_path: Path) -> None:
    from cloud_coordinator.rollout import prepare

    with pytest.raises(ModelRefused, match="AveragePoolGrad"):
        prepare(config(models_file, store, tmp_path / "state", "avgpool"))
    hist = RolloutConfig.from_mapping({
        "rollout": "h", "algorithm": "hist", "state_dir": str(tmp_path / "hist"), "artifact_store": str(store),
        "model": {"kind": "mlp", "hidden": [8]}, "data": {"dataset": "breast_cancer"},
        "topology": {"cells": 2, "devices_per_cell": 1}})
    prepared = prepare(hist)
    for bundle in (prepared.model_bundle, *prepared.cell_bundles.values()):
        assert (store / admission.CACHE_DIR / f"{bundle.bundle_id}.json").is_file()


def test_the_service_stops_a_stored_rollout_whose_model_is_refused_and_never_starts_it(tmp_path: Path) -> None:
    from cloud_coordinator.service import CoordinatorService
    from cloud_coordinator.store import CoordinatorStore

    # Prepare: a rollout created (e.g. by an older fedtier) and asked to run; its model fails admission.
    cfg = RolloutConfig.from_mapping({"rollout": "r", "state_dir": str(tmp_path), "data": {"dataset": "digits"}})
    store = CoordinatorStore(tmp_path / "coordinator.db")
    assert store.create_rollout("r", json.loads(json.dumps(cfg.to_dict(), default=str)))
    store.set_desired("r", "running")
    calls = []

    def make_node(config: RolloutConfig) -> Any:
        calls.append(config.rollout)
        raise ModelRefused("the model crashes: killed by SIGFPE, in op AveragePoolGrad", [])

    service = CoordinatorService(store=store, transport=None, cloud_id="cloud",  # type: ignore[arg-type]
                                 make_node=make_node)
    # Execute: two scans.
    service._scan(0.0)
    service._scan(2.0)
    # Assert: stopped with the reason, never hosted, tried once.
    assert calls == ["r"] and service.nodes == {}
    assert store.status("r") == "stopped" and store.desired("r") == "stopped"
    metrics = json.loads(cfg.metrics_path.read_text())
    assert metrics["finished"] and metrics["stopped"].startswith("model refused: the model crashes")
    store.close()


# --- the commands, as real processes ------------------------------------------------------------------


def run_fedtier(*args: str, timeout: float = 240) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([*FEDTIER, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT)


def test_rollout_create_coordinator_run_and_simulate_refuse_the_avgpool_model_with_exit_2(
        models_file: Path, store: Path, bundles: dict[str, ArtifactBundle], tmp_path: Path) -> None:
    # Prepare: one config of the AvgPool1d model; the coordinator's broker is a socket this test listens on
    # (nothing may connect to it); the model's artifacts are in the store (the trial runs in the first command).
    forget(store)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    path = tmp_path / "rollout.toml"
    path.write_text(textwrap.dedent(f"""
        rollout = "avg"
        rounds = 2
        state_dir = "{tmp_path / 'state'}"
        artifact_store = "{store}"
        [model]
        kind = "torch"
        factory = "{models_file}:avgpool"
        [data]
        dataset = "breast_cancer"
        partition = "iid"
        [topology]
        cells = 2
        devices_per_cell = 2
        [fedavg]
        local_steps = 2
        batch_size = 8
        [broker]
        host = "127.0.0.1"
        port = {port}
    """))
    # Execute: the three commands side by side (each runs the trial unless another has cached its result).
    procs = {"create": run_fedtier("rollout", "create", "--config", str(path)),
             "coordinator": run_fedtier("coordinator", "run", "--config", str(path)),
             "simulate": run_fedtier("simulate", "--config", str(path))}
    outputs = {name: (p.communicate(timeout=240)[0], p.returncode) for name, p in procs.items()}
    # Assert: exit 2 (not SIGFPE's 136), naming the signal and the op; nothing stored, nothing connected.
    for name, (out, code) in outputs.items():
        assert code == 2, f"{name} exited {code}:\n{out[-3000:]}"
        assert "killed by SIGFPE in a training step, in op AveragePoolGrad" in out, f"{name}:\n{out[-3000:]}"
        assert "MaxPool1d" in out
    assert not (tmp_path / "state" / "coordinator.db").exists() or _no_rollouts(tmp_path / "state")
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()
    # The refusal is cached with the artifacts: the next prepare of this model costs no trial.
    cache = json.loads((store / admission.CACHE_DIR / f"{bundles['avgpool'].bundle_id}.json").read_text())
    assert [r["detail"] for r in cache["results"].values()] == ["SIGFPE"]


def _no_rollouts(state: Path) -> bool:
    from cloud_coordinator.store import CoordinatorStore

    store = CoordinatorStore(state / "coordinator.db")
    try:
        return store.rollout_rows() == []
    finally:
        store.close()


def test_an_admission_takes_about_a_second_and_a_cached_one_nothing(bundles: dict[str, ArtifactBundle],
                                                                    store: Path) -> None:
    forget(store)
    started = time.perf_counter()
    admit([bundles["good"]], store)
    first = time.perf_counter() - started
    started = time.perf_counter()
    admit([bundles["good"]], store)
    assert time.perf_counter() - started < 0.05
    assert first < 20  # about 1 s on an idle machine (two children side by side); generous for a loaded one

"""HSGD as a rollout: `algorithm = "hsgd"` validated with messages naming the key, the split bundle listed in the
manifest like any artifact, the simulator (real DeviceNode/EdgeNode/CloudNode with hosts) equal to the roles' own
in-process loop, and hosts and devices refusing what does not fit with a typed reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from local_fleet import hsgd_loop
from fedtier.rollout.config import RolloutConfig
from cloud_coordinator.rollout import prepare
from local_fleet.simulate import simulate
from device_agent.data import LocalData
from device_agent.hybrid import load_row_ids, rows_by_id
from fedtier.artifacts import split_bundle
from fedtier.errors import ArtifactError, ConfigError
from fedtier.security.manifest import Manifest
from fedtier.training.split import SplitTrainer


def hsgd_rollout(tmp_path: Path, artifact_store: Path, **overrides: Any) -> RolloutConfig:
    base: dict[str, Any] = {
        "rollout": "h", "algorithm": "hsgd", "rounds": 3, "seed": 4, "state_dir": str(tmp_path / "coord"),
        "artifact_store": str(artifact_store),
        "data": {"dataset": "breast_cancer", "partition": "iid", "standardize": True, "seed": 1},
        "topology": {"cells": 2, "devices_per_cell": 6},
        "hsgd": {"global_interval": 4, "local_interval": 2, "alpha": 0.5, "lr": 0.2},
    }
    for key, value in overrides.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return RolloutConfig.from_mapping(base)


@pytest.mark.parametrize(("override", "key", "words"), [
    ({"privacy": {"epsilon": 8.0, "clip": 1.0}}, "privacy", "data-dependent releases"),
    ({"hsgd": {"global_interval": 3, "local_interval": 2}}, "hsgd.global_interval", "multiple of local_interval"),
    ({"hsgd": {"hosts": {"cell-a": "dev-00"}}}, "hsgd.hosts", "must differ from every device id"),
    ({"hsgd": {"hosts": {"cell-z": "h"}}}, "hsgd.hosts.cell-z", "not in the topology"),
    ({"data": {"holdout": 0.2}}, "data.holdout", "one sample each"),
    ({"model": {"kind": "cnn1d"}}, "model.kind", "its own split model"),
    ({"hsgd": {"bits_embedding": 1}}, "hsgd.bits_embedding", "C-HSGD"),
])
def test_config_refuses_what_hsgd_cannot_run_and_names_the_key(tmp_path: Path, artifact_store: Path,
                                                              override: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        hsgd_rollout(tmp_path, artifact_store, **override)
    assert info.value.key == key and words in str(info.value)


def test_prepare_lists_the_split_bundle_in_the_manifest_and_adds_a_host_to_every_cell(
        tmp_path: Path, artifact_store: Path) -> None:
    cfg = hsgd_rollout(tmp_path, artifact_store, hsgd={"hosts": {"cell-b": "hospital-b"}})
    prepared = prepare(cfg)
    assert prepared.cells["cell-a"][-1] == "cell-a-host" and prepared.cells["cell-b"][-1] == "hospital-b"
    assert prepared.algorithm_config().hosts == {"cell-a": "cell-a-host", "cell-b": "hospital-b"}
    assert prepared.split is not None and prepared.hybrid is not None
    assert (prepared.split.arch.x1, prepared.split.arch.x2) == (20, 10)  # two thirds of breast_cancer's 30 columns
    manifest = Manifest.decode(prepared.manifest.encode())
    assert split_bundle.is_split(manifest.bundle)
    # every file a node must fetch is named and served by its sha256, host and device graphs alike
    digests = manifest.digests_for("cell-a")
    assert {"device/training_model.onnx", "host/training_model.onnx", "embed2/embed.onnx"} <= set(digests)
    assert set(digests.values()) == set(prepared.artifact_files())
    # a host's shard: its cell's rows in device order, with their ids; a device's: its one row
    x, y, ids = prepared.hybrid.shard("cell-a-host")
    assert ids == prepared.cells["cell-a"][:-1] and x.shape == (6, 20) and len(y) == 6
    x, y, ids = prepared.hybrid.shard("dev-07")
    assert ids == ("dev-07",) and x.shape == (1, 10)


def test_a_node_assembles_the_split_bundle_from_its_cache_and_refuses_an_altered_file(
        tmp_path: Path, artifact_store: Path) -> None:
    prepared = prepare(hsgd_rollout(tmp_path, artifact_store))
    files = prepared.artifact_files()
    cache = tmp_path / "cache"
    cache.mkdir()
    for sha, path in files.items():
        (cache / sha).write_bytes(path.read_bytes())
    entry = prepared.manifest.bundle
    bundle = split_bundle.assemble(entry, lambda sha: cache / sha, tmp_path / "bundles")
    assert bundle.bundle_id == prepared.split.bundle_id and bundle.arch == prepared.split.arch
    victim = next(iter(files))
    (cache / victim).write_bytes(b"not the graph")
    with pytest.raises(ArtifactError, match="missing or altered"):
        split_bundle.assemble(entry, lambda sha: cache / sha, tmp_path / "elsewhere")


def test_simulator_with_hosts_equals_the_roles_in_process_loop(tmp_path: Path, artifact_store: Path) -> None:
    # The simulator runs DeviceNode (hosts and devices), EdgeNode and CloudNode with the numpy split model
    # ("portable"); hsgd_loop runs the bare roles, which tests/unit/fedtier/algorithms/test_hsgd.py holds to
    # the paper's Algorithm 1. Same data, same seeds: the same model.
    cfg = hsgd_rollout(tmp_path, artifact_store, simulation={"trainer": "portable"})
    prepared = prepare(cfg)
    simulated = simulate(cfg, prepared=prepared)
    assert prepared.hybrid is not None
    looped = hsgd_loop.run(prepared.hybrid.cells, prepared.initial_params, prepared.algorithm_config(), cfg.rounds,
                           rollout=cfg.rollout)
    assert not looped.rejected
    for name, value in looped.params.items():
        np.testing.assert_allclose(simulated.params[name], value, rtol=0, atol=1e-6)
    # ... and onnxruntime-training gives the same steps
    ort = simulate(hsgd_rollout(tmp_path / "ort", artifact_store), prepared=prepared)
    for name, value in looped.params.items():
        np.testing.assert_allclose(ort.params[name], value, rtol=0, atol=1e-5)
    assert [r["round"] for r in simulated.rounds] == [0, 1, 2]
    assert all(r["bytes"]["embedding_up"] > 0 and r["paper_values"] > 0 for r in simulated.rounds)
    assert simulated.rounds[-1]["auroc"] > 0.9


def test_host_and_device_rows_are_checked_against_the_split_model(tmp_path: Path, artifact_store: Path) -> None:
    prepared = prepare(hsgd_rollout(tmp_path, artifact_store))
    bundle = prepared.split
    assert bundle is not None and prepared.hybrid is not None
    x, y, ids = prepared.hybrid.shard("cell-a-host")
    rows, labels = rows_by_id(LocalData(x=x, y=y), ids, bundle, "host")
    assert list(rows) == list(ids) and SplitTrainer(rows, labels).embed("theta1", prepared.initial_params,
                                                                         ids).shape == (6, 8)
    with pytest.raises(ConfigError, match="the split model's device block takes 10"):
        rows_by_id(LocalData(x=x, y=y), ids, bundle, "device")  # a host's 20 columns on a device
    with pytest.raises(ConfigError, match="one sample, its own"):
        rows_by_id(LocalData(x=x[:, 10:], y=y), ("dev-00",) * 6, bundle, "device")
    with pytest.raises(ConfigError, match="class numbers below 2"):
        rows_by_id(LocalData(x=x, y=y + 5), ids, bundle, "host")
    # a host's ids come from its shard; a device's shard has none
    np.savez(tmp_path / "train.npz", x=x, y=y, ids=np.array(ids))
    assert load_row_ids(tmp_path) == ids
    np.savez(tmp_path / "train.npz", x=x, y=y, ids=np.arange(6))
    with pytest.raises(ConfigError, match="sample ids"):
        load_row_ids(tmp_path)


def test_an_agent_configured_as_host_without_row_ids_says_what_its_shard_needs(tmp_path: Path) -> None:
    from device_agent.config import DeviceConfig
    from device_agent.run import build

    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "train.npz", x=np.zeros((3, 20), np.float32), y=np.zeros(3, np.int64))
    cfg = DeviceConfig.from_mapping({"device_id": "cell-a-host", "cell": "cell-a", "role": "host",
                                     "data_dir": str(data), "state_dir": str(tmp_path / "state")})
    with pytest.raises(ConfigError) as info:
        build(cfg)
    assert info.value.key == "data_dir" and "needs the array 'ids'" in str(info.value)


def test_the_rollout_in_docs_hsgd_md_is_a_valid_config() -> None:
    import tomllib

    text = (Path(__file__).resolve().parents[3] / "docs" / "hsgd.md").read_text()
    block = text.split("## Running an HSGD rollout")[1].split("```toml\n")[1].split("```")[0]
    cfg = RolloutConfig.from_mapping(tomllib.loads(block))
    assert cfg.algorithm == "hsgd" and cfg.hsgd_hosts() == {"cell-a": "cell-a-host", "cell-b": "cell-b-host"}
    assert cfg.hsgd.split_columns(30) == 20


def test_your_own_hybrid_shards_train_the_same_model_as_the_built_in_split(tmp_path: Path,
                                                                           artifact_store: Path) -> None:
    from fleet_data.hybrid import write_hybrid_shards

    built_in = hsgd_rollout(tmp_path, artifact_store, simulation={"trainer": "portable"})
    prepared = prepare(built_in)
    assert prepared.hybrid is not None
    # the shards and the test file a team would bring: a host's rows with their ids, a device's one row
    shards = tmp_path / "shards"
    nodes = {n: shards / n for c in prepared.hybrid.cells.values() for n in (c.host, *c.devices)}
    write_hybrid_shards(prepared.hybrid, nodes)
    x1, x2, y = prepared.hybrid.test
    np.savez(tmp_path / "test.npz", x=np.concatenate([x1, x2], axis=1), y=y)
    own = {"data": {"dataset": "files", "dir": str(shards), "eval_file": str(tmp_path / "test.npz")},
           "hsgd": {"host_features": 20, "device_features": 10}}
    with pytest.raises(ConfigError) as info:
        hsgd_rollout(tmp_path, artifact_store, data=own["data"])  # without the widths
    assert info.value.key == "hsgd.host_features"
    cfg = hsgd_rollout(tmp_path, artifact_store, simulation={"trainer": "portable"}, **own)
    mine, theirs = simulate(cfg), simulate(built_in, prepared=prepared)
    for name, value in theirs.params.items():
        np.testing.assert_allclose(mine.params[name], value, rtol=0, atol=1e-6)
    assert [r["auroc"] for r in mine.rounds] == pytest.approx([r["auroc"] for r in theirs.rounds])
    # a coordinator needs no shards: the widths and the test file are enough to plan and evaluate
    coordinator = prepare(hsgd_rollout(tmp_path, artifact_store, data={"dataset": "files",
                                                                       "eval_file": str(tmp_path / "test.npz")},
                                       hsgd=own["hsgd"]))
    assert coordinator.split is not None and coordinator.split.arch == prepared.split.arch
    with pytest.raises(ConfigError) as info:
        simulate(hsgd_rollout(tmp_path, artifact_store, data={"dataset": "files"},
                              hsgd={**own["hsgd"], "classes": 2}))
    assert info.value.key == "data.dir"


def test_the_exported_split_model_predicts_what_the_coordinator_evaluated(tmp_path: Path,
                                                                          artifact_store: Path) -> None:
    import onnxruntime

    from cloud_coordinator.export import export_model
    from fedtier.training import split

    cfg = hsgd_rollout(tmp_path, artifact_store, simulation={"trainer": "portable"})
    prepared = prepare(cfg)
    result = simulate(cfg, prepared=prepared, workdir=Path(cfg.state_dir))  # the coordinator's store stays there
    assert prepared.hybrid is not None

    exported = export_model(cfg, tmp_path / "hsgd.onnx")

    session = onnxruntime.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["x1", "x2"]
    x1, x2, y = prepared.hybrid.test
    (logits,) = session.run(None, {"x1": x1.astype(np.float32), "x2": x2.astype(np.float32)})
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(probs, split.probabilities(result.params, x1, x2), rtol=0, atol=1e-5)
    assert exported.round == cfg.rounds - 1
    assert float(np.mean(probs.argmax(axis=1) == y)) == pytest.approx(result.rounds[-1]["accuracy"], abs=1e-9)

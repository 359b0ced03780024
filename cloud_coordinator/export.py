"""The trained model as an inference ONNX file: the global parameters of a rollout's round, in
the rollout's own architecture, through onnxruntime-training's inference export (HSGD's split model:
one graph ``(x1, x2) -> logits`` over the host's and a device's feature blocks, ``models.split_export``).

Everything comes from the coordinator's state, never from the training data: the parameters from the
store (every closed round keeps its model version), the model's layout from the rollout's manifest in
the store (the artifact bundle it shipped, or HSGD's split architecture), the graph from the artifact
store. Artifacts the store no longer has are rebuilt from the bundle's own architecture (a built-in
model) or from the config's ``[model]`` (your torch factory or ONNX file); they are content-addressed,
so the same bundle comes back, and a model changed since the rollout is refused rather than exported
with the wrong graph.

The file takes rows ``(batch, features)`` whatever the model's example shape (a 1-D CNN's ``(1, 30)``
gets a leading ``Reshape``), and its interface — input and output names, shapes, element types, how to
read the outputs — is written beside it as ``<file>.json`` (``models.inference``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.artifacts.split_bundle import is_split
from fedtier.errors import ArtifactError, ConfigError
from fedtier.rollout.config import BUILTIN_MODELS, RolloutConfig
from fedtier.security.manifest import Manifest
from fedtier.security.signing import open_manifest
from fedtier.training.split import SplitArch


@dataclass(frozen=True)
class Exported:
    """What ``export_model`` wrote: the model, and its interface (also in ``description``, beside it)."""

    path: Path
    rollout: str
    round: int
    version: int
    sha256: str
    interface: dict[str, Any] = field(default_factory=dict)
    description: Path | None = None


def export_config(mapping: Mapping[str, Any], *, source: str, base_dir: Path | None = None) -> RolloutConfig:
    """A rollout's config as export reads it: without its ``[data]`` table, which export never reads (the model's
    layout comes from the manifest), so a rollout whose data files are gone still loads and exports.

    Args:
        mapping: the rollout file's tables (``read_toml``), or the config ``rollout create`` stored.
        source: where it came from, for error messages.
        base_dir: what relative paths in it are relative to (the file's directory).
    """
    return RolloutConfig.from_mapping({k: v for k, v in mapping.items() if k != "data"}, source=source,
                                      base_dir=base_dir)


def export_model(cfg: RolloutConfig, out: Path | str, *, version: int | None = None) -> Exported:
    """Write the rollout's model (the newest version, or ``version``) as an inference ONNX model.

    Raises:
        ConfigError: the coordinator's state has no such rollout or version, or its artifacts are gone
            and the config's model no longer builds them.
    """
    from cloud_coordinator.status import open_store

    store = open_store(cfg.state_dir, cfg.store, read_only=True)
    db = store.where
    try:
        model = store.latest_model(cfg.rollout) if version is None else store.model(cfg.rollout, version)
        raw = store.manifest(cfg.rollout)
    finally:
        store.close()
    if model is None:
        what = "no model" if version is None else f"no model version {version}"
        raise ConfigError(f"{db} holds {what} of rollout {cfg.rollout!r}", key="rollout")
    if not raw:
        raise ConfigError(f"{db} holds no manifest of rollout {cfg.rollout!r}: it was never started", key="rollout")
    manifest = open_manifest(raw, {})  # the coordinator's own copy: what it signed, or issued unsigned
    path, interface = _write(cfg, manifest, model.params, Path(out),
                             {"rollout": cfg.rollout, "version": model.version, "round": model.round,
                              "sha256": model.sha256})
    from models.inference import write_description

    return Exported(path=path, rollout=cfg.rollout, round=model.round, version=model.version, sha256=model.sha256,
                    interface=interface, description=write_description(path, interface))


def _write(cfg: RolloutConfig, manifest: Manifest, params: Mapping[str, Any], out: Path, facts: Mapping[str, Any]
           ) -> tuple[Path, dict[str, Any]]:
    """The inference graph of the manifest's model with ``params``, written to ``out``, and its interface."""
    from models.inference import accept_flat_rows, describe

    if is_split(manifest.bundle):  # HSGD: one graph over both feature blocks, (x1, x2) -> logits
        from models.split_export import export_split

        path = export_split(SplitArch(**manifest.extra["split_arch"]), params, out)
        return path, describe(path, loss="cross_entropy", **facts)
    from device_agent.trainers.ort import OrtTrainer
    from models.export import OUTPUT_NAME

    bundle = shipped_bundle(cfg, manifest)
    trainer = OrtTrainer(bundle)
    trainer.set_parameters(dict(params))
    path = trainer.export_inference(out, [OUTPUT_NAME])
    accept_flat_rows(path, bundle.arch.input_shape)
    return path, describe(path, loss=bundle.arch.loss, example_shape=bundle.arch.input_shape, **facts)


def shipped_bundle(cfg: RolloutConfig, manifest: Manifest) -> ArtifactBundle:
    """The artifact bundle the rollout's manifest shipped, from the artifact store, rebuilt if it is gone.

    Raises:
        ConfigError: the bundle is gone and what the config's ``[model]`` builds now is another bundle.
    """
    shipped = ArtifactBundle.from_json(manifest.bundle)
    try:
        return ArtifactBundle.load(cfg.artifacts_path / shipped.bundle_id, verify=True)
    except ArtifactError:
        pass  # not in this artifact store (moved, pruned, another machine): build it again
    rebuilt = _rebuild(cfg, shipped)
    if rebuilt.bundle_id != shipped.bundle_id:
        raise ConfigError(f"the artifacts of rollout {cfg.rollout!r} (bundle {shipped.bundle_id[:12]}) are not in "
                          f"{cfg.artifacts_path}, and [model] now builds another one ({rebuilt.bundle_id[:12]}): "
                          "was the model changed since the rollout ran? Point artifact_store at the rollout's "
                          "artifacts, or restore the model it trained", key="model")
    return rebuilt


def _rebuild(cfg: RolloutConfig, shipped: ArtifactBundle) -> ArtifactBundle:
    """Build the bundle ``shipped`` describes again: a built-in model from its own architecture and seed, your
    own model from the config's factory or ONNX file (neither needs the data)."""
    from models.artifacts import build_artifacts
    from models.source import source_for

    if shipped.arch.kind in BUILTIN_MODELS:
        return build_artifacts(shipped.arch, cfg.artifacts_path, seed=shipped.seed, proximal_mu=cfg.proximal_mu)
    loss = shipped.arch.options.get("loss")  # a built-in scorer (fedxl) was resolved as an ONNX model
    features = int(np.prod(shipped.arch.input_shape))
    source = source_for(cfg.model, features, shipped.arch.num_classes, loss=str(loss) if loss else None)
    return build_artifacts(source, cfg.artifacts_path, proximal_mu=cfg.proximal_mu)

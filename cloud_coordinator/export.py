"""The trained model as an inference ONNX file: the global parameters of a rollout's round, in
the rollout's own architecture, through onnxruntime-training's inference export (HSGD's split model:
one graph ``(x1, x2) -> logits`` over the host's and a device's feature blocks, ``models.split_export``).

The parameters come from the coordinator's store (every closed round keeps its model
version); the graph from the rollout's artifacts (rebuilt from the config if the artifact
store no longer has them: they are content-addressed, so the same bundle comes back).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedtier.rollout.config import RolloutConfig
from fedtier.errors import ConfigError


@dataclass(frozen=True)
class Exported:
    """What ``export_model`` wrote."""

    path: Path
    rollout: str
    round: int
    version: int
    sha256: str


def export_model(cfg: RolloutConfig, out: Path | str, *, version: int | None = None) -> Exported:
    """Write the rollout's model (the newest version, or ``version``) as an inference ONNX model.

    Raises:
        ConfigError: the coordinator's state has no such rollout or version.
    """
    from cloud_coordinator.rollout import prepare
    from device_agent.trainers.ort import OrtTrainer
    from models.export import OUTPUT_NAME

    from cloud_coordinator.status import open_store

    store = open_store(cfg.state_dir, cfg.store)
    db = store.where
    try:
        model = store.latest_model(cfg.rollout) if version is None else store.model(cfg.rollout, version)
    finally:
        store.close()
    if model is None:
        what = "no model" if version is None else f"no model version {version}"
        raise ConfigError(f"{db} holds {what} of rollout {cfg.rollout!r}", key="rollout")
    prepared = prepare(cfg)
    if prepared.split is not None:  # HSGD: one graph over both feature blocks, (x1, x2) -> logits
        from models.split_export import export_split

        path = export_split(prepared.split.arch, model.params, out)
    else:
        trainer = OrtTrainer(prepared.model_bundle)
        trainer.set_parameters(model.params)
        path = trainer.export_inference(out, [OUTPUT_NAME])
    return Exported(path=path, rollout=cfg.rollout, round=model.round, version=model.version, sha256=model.sha256)

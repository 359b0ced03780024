"""Everything a rollout needs before round 0, computed once from its config.

``prepare`` resolves the model once (``models.source``: built-in, torch factory or ONNX
file), builds (or finds in the content-addressed store) its ORT artifacts, takes its initial
parameters, lays out the topology and writes the manifest. The coordinator process, the
simulator and the demo all start from here, so they train the same model on the same data.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from cloud_coordinator.admission import TRAINER_PATHS, admit
from fedtier.rollout.config import RolloutConfig
from fleet_data.datasets import FederatedData, make_federated
from fleet_data.hybrid import HybridData, make_hybrid
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.artifacts.split_bundle import SplitBundle
from fedtier.errors import ConfigError
from fedtier.privacy.plan import NoisePlan
from fedtier.security.manifest import Manifest
from fedtier.training import split
from fedtier.training.layout import ArchSpec
from fedtier.training.submodels import fixed_sizes, plan_for, submodel_arch

log = logging.getLogger("fedtier.coordinator")


@dataclass(frozen=True)
class PreparedRollout:
    config: RolloutConfig
    arch: ArchSpec | None
    """The model's architecture; ``None`` for HSGD, whose split model is ``split.arch``."""
    bundle: ArtifactBundle | None
    """The model's ORT artifacts; ``None`` for HSGD, whose are ``split``."""
    initial_params: Mapping[str, np.ndarray]
    cells: Mapping[str, tuple[str, ...]]
    data: FederatedData
    manifest: Manifest
    cell_bundles: Mapping[str, ArtifactBundle] = field(default_factory=dict)
    """HIST: each cell's submodel bundle (cells not listed train ``bundle``)."""
    noise_plan: NoisePlan | None = None
    """Differential privacy: the resolved noise plan (also in the manifest and in every task)."""
    split: SplitBundle | None = None
    """HSGD: the split model's artifacts (both sides' training graphs and the encoders)."""
    hybrid: HybridData | None = None
    """HSGD: the hosts' and devices' columns of every sample, and the test set."""

    @property
    def model_bundle(self) -> ArtifactBundle:
        """The single model's bundle (every algorithm but HSGD, which trains a split model)."""
        if self.bundle is None:
            raise ConfigError(f"{self.config.algorithm} trains a split model, not one ONNX model", key="algorithm")
        return self.bundle

    @property
    def model_arch(self) -> ArchSpec:
        if self.arch is None:
            raise ConfigError(f"{self.config.algorithm} trains a split model, not one ONNX model", key="algorithm")
        return self.arch

    def algorithm_config(self) -> Any:
        """The algorithm's settings for the cloud role, with the noise plan when privacy is on.

        Federated evaluation is asked of devices unless privacy is on (the statistics would be
        clear, data-dependent releases to an untrusted cloud; docs/privacy.md) or the algorithm
        trains submodels (HIST: devices hold a submodel, not the global model).
        """
        config = self.config.algorithm_config()
        if self.noise_plan is not None:
            config = dataclasses.replace(config, privacy=self.noise_plan.to_dict())
        if self.noise_plan is not None or self.config.traits.submodels:
            config = dataclasses.replace(config, federated_eval=False)
        return config

    def artifact_files(self) -> dict[str, Path]:
        """sha256 -> local path of every artifact file of the rollout (all bundles)."""
        out = {}
        if self.split is not None:
            for key, item in self.split.files.items():
                out[str(item["sha256"])] = self.split.directory / key.split("/")[0] / str(item["name"])
        for bundle in (*([self.bundle] if self.bundle is not None else []), *self.cell_bundles.values()):
            for role, entry in bundle.files.items():
                out[entry.sha256] = bundle.path(role)
        return out

    def cloud_kwargs(self) -> dict[str, Any]:
        """Extra arguments the algorithm's cloud role needs (HIST partitions ``arch`` into submodels)."""
        return {"arch": self.arch} if self.config.traits.submodels else {}

    @property
    def devices(self) -> list[str]:
        return [d for members in self.cells.values() for d in members]


def prepare(cfg: RolloutConfig, *, manifest_version: int = 1,
            trainers: Sequence[str] = TRAINER_PATHS) -> PreparedRollout:
    """Build artifacts, data, initial parameters and the manifest of a rollout.

    The built bundles are admitted (``cloud_coordinator.admission``) before the manifest is
    written: trained for a few steps in a child process on each of ``trainers`` (the paths the
    devices may use; a simulation pins its own), cached in the artifact store.

    Raises:
        ModelRefused: A trial crashed, raised or gave a non-finite result (a ``ConfigError`` of key
            ``model``).
    """
    from models.artifacts import build_artifacts  # torch: only here, only on the coordinator
    from models.source import source_for

    if cfg.traits.split_model:
        return _prepare_hsgd(cfg, manifest_version, trainers)
    cells = cfg.topology.layout()
    devices = [d for members in cells.values() for d in members]
    data = make_federated(cfg.data, devices, cells)
    if cfg.model.builtin and data.num_classes < 2:
        raise ConfigError(f"the built-in {cfg.model.kind} is a classifier: the labels must be class numbers 0, 1, "
                          "... (for regression targets use your own model with loss = 'mse')", key="model.kind")
    scorer = cfg.traits.scorer
    if scorer:
        _check_binary(data)
    # The model, resolved once (an X-risk algorithm trains it as a one-output scorer).
    source = source_for(cfg.model, data.num_features, data.num_classes, loss="weighted_score" if scorer else None)
    arch = source.arch
    _check_fits(arch, data)
    bundle = build_artifacts(source, cfg.artifacts_path, proximal_mu=cfg.proximal_mu)
    params = dict(source.initial_params)
    cell_bundles: dict[str, ArtifactBundle] = {}
    if cfg.traits.submodels:
        # One bundle per submodel width; a cell's width is the same every round (array_split sizes
        # by cell order, as fedtier.algorithms.hist draws them), so these are built once.
        plan = plan_for(arch, len(cells))
        for cell, sizes in zip(sorted(cells), fixed_sizes(plan, len(cells)), strict=True):
            cell_bundles[cell] = build_artifacts(submodel_arch(plan, sizes), cfg.artifacts_path,
                                                 seed=cfg.model.init_seed)
    admit([bundle, *cell_bundles.values()], cfg.artifacts_path, trainers,
          labels={b.bundle_id: f"cell {c}'s submodel" for c, b in cell_bundles.items()})
    noise_plan = None
    extra: dict[str, Any] = {"layout_sha256": bundle.layout.sha256}
    if cfg.privacy is not None:
        from cloud_coordinator.privacy.calibrate import make_plan  # dp-accounting: coordinator only

        if cfg.privacy.device_sampling != "none" and not cfg.traits.device_sampling:
            raise ConfigError("rollouts run device sampling with fedavg and hier_qsgd; HIST's submodel edges do "
                              "not sample yet (docs/privacy.md)", key="privacy.device_sampling")
        noise_plan = make_plan(cfg, {d: len(data.train[d][1]) for d in devices})
        extra["privacy"] = noise_plan.to_dict()  # signed with the manifest: an edge cannot weaken it
    manifest = Manifest(rollout=cfg.rollout, version=manifest_version, algorithm=cfg.algorithm,
                        bundle=bundle.to_json(), cells=tuple(cells), rounds=cfg.rounds, created=time.time(),
                        extra=extra, cell_bundles={c: b.to_json() for c, b in cell_bundles.items()})
    return PreparedRollout(config=cfg, arch=arch, bundle=bundle, initial_params=params, cells=cells, data=data,
                           manifest=manifest, cell_bundles=cell_bundles, noise_plan=noise_plan)


def _prepare_hsgd(cfg: RolloutConfig, manifest_version: int, trainers: Sequence[str]) -> PreparedRollout:
    """HSGD: the hybrid data, the split model's artifacts and initial weights; each cell's members are its
    devices and, last, its host (both run ``fedtier agent run``)."""
    from models.split_artifacts import build_split_artifacts  # torch: only here, only on the coordinator

    hybrid = make_hybrid(cfg)
    arch = hybrid.arch(cfg.hsgd.embed_host, cfg.hsgd.embed_device)
    bundle = build_split_artifacts(arch, cfg.artifacts_path, seed=cfg.model.init_seed)
    admit([bundle], cfg.artifacts_path, trainers)
    cells = {c: (*h.devices, h.host) for c, h in hybrid.cells.items()}
    train = {d: (h.x2[n:n + 1], h.y[n:n + 1]) for h in hybrid.cells.values() for n, d in enumerate(h.devices)}
    x1, x2, y = hybrid.test
    data = FederatedData(train=train, test=(np.concatenate([x1, x2], axis=1), y) if len(y) else None,
                         num_features=hybrid.host_features + hybrid.device_features, num_classes=hybrid.num_classes)
    manifest = Manifest(rollout=cfg.rollout, version=manifest_version, algorithm=cfg.algorithm,
                        bundle=bundle.manifest_entry(), cells=tuple(cells), rounds=cfg.rounds, created=time.time(),
                        extra={"split_arch": dataclasses.asdict(arch)})
    initial = split.init_params(arch, cfg.model.init_seed)
    return PreparedRollout(config=cfg, arch=None, bundle=None, initial_params=initial, cells=cells, data=data,
                           manifest=manifest, split=bundle, hybrid=hybrid)


def _check_binary(data: FederatedData) -> None:
    """X-risk algorithms pair positives (label 1) with negatives (label 0): the labels must be those."""
    parts = [*data.train.values(), *data.holdout.values(), *([data.test] if data.test is not None else [])]
    labels = {float(v) for _, y in parts for v in np.unique(np.asarray(y))}
    if not labels <= {0.0, 1.0} or any(np.asarray(y).ndim != 1 for _, y in parts):
        raise ConfigError(f"fedxl trains on a binary task (labels 0 and 1, 1 the positive class); the data has "
                          f"labels {sorted(labels)[:10]}", key="data")


def _check_fits(arch: ArchSpec, data: FederatedData) -> None:
    """The data the coordinator has must fit the model, before anything is built: the example size, and the
    model's outputs against the labels (``_check_outputs``)."""
    size = int(np.prod(arch.input_shape))
    if (data.train or data.test is not None) and data.num_features != size:
        raise ConfigError(f"the data has {data.num_features} features per example; the model takes "
                          f"{arch.input_shape} ({size} values)", key="data")
    if arch.loss == "cross_entropy" and data.num_classes > arch.num_classes:
        raise ConfigError(f"the data has labels 0..{data.num_classes - 1}; the model has {arch.num_classes} "
                          "outputs (one per class)", key="data")
    _check_outputs(arch, data)


def _check_outputs(arch: ArchSpec, data: FederatedData) -> None:
    """The model's output width against the labels the coordinator has (its test set, the devices' shards it
    simulates): a refusal naming ``[model] loss`` and the fix where training cannot work, a warning with the
    numbers where it works but is likely a mistake (more outputs than classes)."""
    test = [data.test] if data.test is not None else []
    parts = [y for _, y in (*data.train.values(), *data.holdout.values(), *test) if len(y)]
    if not parts:
        return
    outputs, loss = arch.num_classes, arch.loss
    if loss == "cross_entropy":
        if data.num_classes == 0:
            raise ConfigError(f"loss = 'cross_entropy' trains on class numbers 0, 1, ...; the data's labels are "
                              f"{_labels_seen(parts)}: for float targets use loss = 'mse' (or 'bce' for targets in "
                              "[0, 1], one output per target column)", key="model.loss")
        if outputs > data.num_classes >= 2:
            log.warning("the model has %d outputs and the data %d classes (labels 0..%d): outputs %d..%d never "
                        "match a label. Training works; if no label above %d exists, give the model %d outputs "
                        "([model])", outputs, data.num_classes, data.num_classes - 1, data.num_classes, outputs - 1,
                        data.num_classes - 1, data.num_classes)
        return
    if loss not in ("bce", "mse"):
        return
    widths = {1 if y.ndim == 1 else int(np.prod(y.shape[1:])) for y in parts}
    if widths != {outputs}:
        width = max(widths)
        if loss == "bce" and width == 1 and outputs == 2 and _binary(parts):
            fix = ("for labels 0/1 give the model one output (bce: the probability of 1), or keep its 2 outputs and "
                   "set loss = 'cross_entropy' (labels 0 and 1 are then its two classes)")
        else:
            fix = f"give the model {width} output{'s' if width > 1 else ''}, one per target column"
        raise ConfigError(f"loss = '{loss}' trains one output per target column: the data's targets have {width} "
                          f"column{'s' if width > 1 else ''} per example (labels of shape "
                          f"{sorted({tuple(y.shape[1:]) for y in parts})}), the model has {outputs} outputs: {fix}",
                          key="model.loss")
    if loss == "bce":
        low, high = min(float(np.min(y)) for y in parts), max(float(np.max(y)) for y in parts)
        if low < 0 or high > 1:
            raise ConfigError(f"loss = 'bce' trains on targets in [0, 1]; the data's span [{low:g}, {high:g}]: use "
                              "cross_entropy for class numbers, mse for other targets", key="model.loss")


def _binary(parts: list[np.ndarray]) -> bool:
    return all(np.isin(y, (0, 1)).all() for y in parts)


def _labels_seen(parts: list[np.ndarray]) -> str:
    shapes = {tuple(y.shape[1:]) for y in parts}
    if shapes != {()}:
        return f"of shape {sorted(shapes)} per example"
    low, high = min(float(np.min(y)) for y in parts), max(float(np.max(y)) for y in parts)
    return f"numbers in [{low:g}, {high:g}], not all whole and non-negative"

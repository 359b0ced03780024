"""Everything a rollout needs before round 0, computed once from its config.

``prepare`` builds (or finds in the content-addressed store) the ORT artifacts of the
architecture, draws the initial parameters, lays out the topology and writes the
manifest. The coordinator process, the simulator and the demo all start from here, so
they train the same model on the same data.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from cloud_coordinator.config import RolloutConfig
from cloud_coordinator.datasets import FederatedData, make_federated
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.privacy.plan import NoisePlan
from fedtier.security.manifest import Manifest
from fedtier.training.layout import ArchSpec
from fedtier.training.submodels import fixed_sizes, plan_for, submodel_arch


@dataclass(frozen=True)
class PreparedRollout:
    config: RolloutConfig
    arch: ArchSpec
    bundle: ArtifactBundle
    initial_params: Mapping[str, np.ndarray]
    cells: Mapping[str, tuple[str, ...]]
    data: FederatedData
    manifest: Manifest
    cell_bundles: Mapping[str, ArtifactBundle] = field(default_factory=dict)
    """HIST: each cell's submodel bundle (cells not listed train ``bundle``)."""
    noise_plan: NoisePlan | None = None
    """Differential privacy: the resolved noise plan (also in the manifest and in every task)."""

    def algorithm_config(self) -> Any:
        """The algorithm's settings for the cloud role, with the noise plan when privacy is on."""
        config = self.config.algorithm_config()
        if self.noise_plan is not None:
            config = dataclasses.replace(config, privacy=self.noise_plan.to_dict())
        return config

    def artifact_files(self) -> dict[str, Path]:
        """sha256 -> local path of every artifact file of the rollout (all bundles)."""
        out = {}
        for bundle in (self.bundle, *self.cell_bundles.values()):
            for role, entry in bundle.files.items():
                out[entry.sha256] = bundle.path(role)
        return out

    def cloud_kwargs(self) -> dict[str, Any]:
        """Extra arguments the algorithm's cloud role needs (HIST partitions ``arch``)."""
        return {"arch": self.arch} if self.config.algorithm == "hist" else {}

    @property
    def devices(self) -> list[str]:
        return [d for members in self.cells.values() for d in members]


def prepare(cfg: RolloutConfig, *, manifest_version: int = 1) -> PreparedRollout:
    """Build artifacts, data, initial parameters and the manifest of a rollout."""
    from models.artifacts import build_artifacts  # torch: only here, only on the coordinator
    from models.zoo import initial_parameters

    cells = cfg.topology.layout()
    devices = [d for members in cells.values() for d in members]
    data = make_federated(cfg.data, devices, cells)
    arch = cfg.model.arch(data.num_features, data.num_classes)
    bundle = build_artifacts(arch, cfg.artifacts_path, seed=cfg.model.init_seed)
    params = initial_parameters(arch, cfg.model.init_seed)
    cell_bundles: dict[str, ArtifactBundle] = {}
    if cfg.algorithm == "hist":
        # One bundle per submodel width; a cell's width is the same every round (array_split sizes
        # by cell order, as fedtier.algorithms.hist draws them), so these are built once.
        plan = plan_for(arch, len(cells))
        for cell, sizes in zip(sorted(cells), fixed_sizes(plan, len(cells)), strict=True):
            cell_bundles[cell] = build_artifacts(submodel_arch(plan, sizes), cfg.artifacts_path,
                                                 seed=cfg.model.init_seed)
    noise_plan = None
    extra: dict[str, Any] = {"layout_sha256": bundle.layout.sha256}
    if cfg.privacy is not None:
        from cloud_coordinator.privacy.calibrate import make_plan  # dp-accounting: coordinator only

        noise_plan = make_plan(cfg, {d: len(data.train[d][1]) for d in devices})
        extra["privacy"] = noise_plan.to_dict()  # signed with the manifest: an edge cannot weaken it
    manifest = Manifest(rollout=cfg.rollout, version=manifest_version, algorithm=cfg.algorithm,
                        bundle=bundle.to_json(), cells=tuple(cells), rounds=cfg.rounds, created=time.time(),
                        extra=extra, cell_bundles={c: b.to_json() for c, b in cell_bundles.items()})
    return PreparedRollout(config=cfg, arch=arch, bundle=bundle, initial_params=params, cells=cells, data=data,
                           manifest=manifest, cell_bundles=cell_bundles, noise_plan=noise_plan)

"""Everything a rollout needs before round 0, computed once from its config.

``prepare`` builds (or finds in the content-addressed store) the ORT artifacts of the
architecture, draws the initial parameters, lays out the topology and writes the
manifest. The coordinator process, the simulator and the demo all start from here, so
they train the same model on the same data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from cloud_coordinator.config import RolloutConfig
from cloud_coordinator.datasets import FederatedData, make_federated
from fedtier.bundle import ArtifactBundle
from fedtier.layout import ArchSpec
from fedtier.manifest import Manifest


@dataclass(frozen=True)
class PreparedRollout:
    config: RolloutConfig
    arch: ArchSpec
    bundle: ArtifactBundle
    initial_params: Mapping[str, np.ndarray]
    cells: Mapping[str, tuple[str, ...]]
    data: FederatedData
    manifest: Manifest

    @property
    def devices(self) -> list[str]:
        return [d for members in self.cells.values() for d in members]


def prepare(cfg: RolloutConfig, *, manifest_version: int = 1) -> PreparedRollout:
    """Build artifacts, data, initial parameters and the manifest of a rollout."""
    from models.artifacts import build_artifacts  # torch: only here, only on the coordinator
    from models.zoo import initial_parameters

    cells = cfg.topology.layout()
    devices = [d for members in cells.values() for d in members]
    data = make_federated(cfg.data, devices)
    arch = cfg.model.arch(data.num_features, data.num_classes)
    bundle = build_artifacts(arch, cfg.artifacts_path, seed=cfg.model.init_seed)
    params = initial_parameters(arch, cfg.model.init_seed)
    manifest = Manifest(rollout=cfg.rollout, version=manifest_version, algorithm=cfg.algorithm,
                        bundle=bundle.to_json(), cells=tuple(cells), rounds=cfg.rounds, created=time.time(),
                        extra={"layout_sha256": bundle.layout.sha256})
    return PreparedRollout(config=cfg, arch=arch, bundle=bundle, initial_params=params, cells=cells, data=data,
                           manifest=manifest)

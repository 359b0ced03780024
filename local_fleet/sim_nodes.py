"""The simulated nodes of ``fedtier simulate``: devices with their shard, the trainers they share, their noise.

The in-process backend (``local_fleet.simulate``) and every Ray shard (``local_fleet.simulate_ray``)
build their devices here, so both run the same ``DeviceNode`` with the same roles.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Mapping

from cloud_coordinator.rollout import PreparedRollout
from device_agent.data import LocalData, fit_to_model
from device_agent.node import DeviceNode
from device_agent.state import MemoryDeviceState
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.artifacts.cache import ArtifactCache
from fedtier.artifacts.split_bundle import SplitBundle
from fedtier.privacy.mechanism import NoiseSource
from fedtier.rollout.config import RolloutConfig
from fedtier.training.trainer import Trainer
from fedtier.transport.memory import MemoryBroker
from fleet_data.hybrid import HybridData


def noise_source(cfg: RolloutConfig, node: str) -> NoiseSource:
    """A node's DP noise: OS-seeded, or — for reproducible experiments — from ``[privacy] noise_seed``."""
    seed = cfg.privacy.noise_seed if cfg.privacy is not None else None
    if seed is None:
        return NoiseSource()
    return NoiseSource(int.from_bytes(hashlib.sha256(f"{seed}/{node}".encode()).digest()[:16], "little"))


def simulated_trainers(cfg: RolloutConfig) -> tuple[str, ...]:
    """The trainer paths a simulation runs, so the ones its admission trials: the devices' trainer, and
    onnxruntime-training, which the coordinator evaluates with."""
    return tuple(dict.fromkeys(("ort", cfg.simulation.trainer)))


class SharedTrainers:
    """One trainer per artifact bundle, shared by every simulated device.

    ``kind`` is the devices' backend (``[simulation] trainer``): ``ort``, or ``portable`` to
    train as a board without onnxruntime-training does.
    """

    def __init__(self, threads: int = 1, kind: str = "ort") -> None:
        self.threads = threads
        self.kind = kind
        self._trainers: dict[str, Trainer] = {}
        self._split: dict[str, Any] = {}

    def split(self, bundle: SplitBundle, side: str, x: Mapping[str, Any], y: Mapping[str, int]) -> Any:
        """HSGD: a node's split trainer over its rows, sharing one ORT session per side (numpy's split model
        with ``trainer = "portable"``, as a node without onnxruntime-training trains)."""
        if self.kind != "ort":
            from fedtier.training.split import SplitTrainer

            return SplitTrainer(x, y)
        key = f"{bundle.bundle_id}/{side}"
        shared = self._split.get(key)
        if shared is None:
            from device_agent.trainers.ort_split import OrtSplitTrainer

            shared = self._split[key] = OrtSplitTrainer(bundle, side, x, y)
        return shared.with_rows(x, y)

    def __call__(self, bundle: ArtifactBundle) -> Trainer:
        trainer = self._trainers.get(bundle.bundle_id)
        if trainer is None:
            from device_agent.trainers import make_trainer

            trainer = make_trainer(self.kind, bundle, threads=self.threads)
            self._trainers[bundle.bundle_id] = trainer
        return trainer


class TrainObjective:
    """``(1/N) sum_n F_n(w)``: every device's mean training loss at the global model, averaged
    uniformly over devices (the objective QHetFed's aggregation rules minimise, digest §1)."""

    def __init__(self, prepared: PreparedRollout, trainers: SharedTrainers) -> None:
        self.trainer = trainers(prepared.model_bundle)
        fitted = [fit_to_model(LocalData(x=x, y=y), prepared.model_arch) for x, y in prepared.data.train.values()]
        self.data = [(d.x, d.y) for d in fitted]

    def __call__(self, params: dict[str, Any]) -> dict[str, Any]:
        self.trainer.set_parameters(params)
        losses = [self.trainer.evaluate(x, y).loss for x, y in self.data]
        return {"train_objective": float(sum(losses) / len(losses))}


def device_node(cfg: RolloutConfig, prepared: PreparedRollout, broker: MemoryBroker, device: str, cell: str, *,
                trainers: SharedTrainers, cache: ArtifactCache, bundles_dir: Path, attacker: bool) -> DeviceNode:
    """One simulated device on ``broker``: its data shard, the shared trainers, its own state and noise
    (the in-process backend and every Ray shard build devices here, so both run the same nodes)."""
    if prepared.hybrid is not None:
        return _hybrid_node(cfg, prepared.hybrid, broker, device, cell, trainers=trainers, cache=cache,
                            bundles_dir=bundles_dir)
    x, y = prepared.data.train[device]
    held = prepared.data.holdout.get(device)
    tx = broker.connect(device, leaf=True)
    provider: Any = trainers
    if attacker:
        provider, y = _attacker(cfg, prepared, device, trainers, y)
    node = DeviceNode(device_id=device, cell=cell, transport=tx, data=LocalData(x=x, y=y),
                      trainer_provider=provider, state=MemoryDeviceState(keep_uploads=False), cache=cache,
                      bundles_dir=bundles_dir, noise=noise_source(cfg, device),
                      eval_data=LocalData(x=held[0], y=held[1]) if held is not None else None)
    tx.set_handler(bind(node, broker))
    return node


def _hybrid_node(cfg: RolloutConfig, data: HybridData, broker: MemoryBroker, node_id: str, cell: str, *,
                 trainers: SharedTrainers, cache: ArtifactCache, bundles_dir: Path) -> DeviceNode:
    """HSGD: a simulated host or device with its rows (``HybridData.shard``)."""
    x, y, ids = data.shard(node_id)
    tx = broker.connect(node_id, leaf=True)
    node = DeviceNode(device_id=node_id, cell=cell, transport=tx, data=LocalData(x=x, y=y), trainer_provider=trainers,
                      state=MemoryDeviceState(keep_uploads=False), cache=cache, bundles_dir=bundles_dir,
                      noise=noise_source(cfg, node_id), side="host" if node_id == data.cells[cell].host else "device",
                      row_ids=ids, split_provider=trainers.split)
    tx.set_handler(bind(node, broker))
    return node


def _attacker(cfg: RolloutConfig, prepared: PreparedRollout, device: str, trainers: SharedTrainers,
              y: Any) -> tuple[Any, Any]:
    """An attacking device's trainer provider and labels (``[attack]``; ``device_agent.attack``)."""
    from device_agent.attack import AttackSpec, attacking_provider, flip_labels

    assert cfg.attack is not None
    spec = AttackSpec(kind=cfg.attack.kind, scale=cfg.attack.scale, seed=cfg.seed,
                      classes=prepared.data.num_classes if cfg.attack.kind == "label_flip" else None)
    if spec.kind == "label_flip":
        assert spec.classes is not None
        return trainers, flip_labels(y, spec.classes)
    return attacking_provider(trainers, spec, device), y


def bind(node: Any, broker: MemoryBroker) -> Callable[[Any], None]:
    return lambda inbound: node.handle(inbound, broker.now)

"""``fedtier simulate`` of a rollout on the trace simulator (``local_fleet.trace_sim``).

Used when the rollout has a ``[fleet]`` section (device availability and speeds on a virtual clock)
or its algorithm is asynchronous (FedBuff: its versions are driven by events, which the in-memory round
simulator does not model; over MQTT the node shells host it). The
devices train with the same shared trainers as the in-memory simulator (``[simulation] trainer``)
on the same shards, minibatches drawn from the streams the roles name, exactly as
``DeviceNode.train`` does; the coordinator's central test set scores every new global model.
Under ``[privacy]`` every release that reaches the cloud is charged on a ledger (``ledger``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from cloud_coordinator.node import OrtEvaluator
from cloud_coordinator.rollout import PreparedRollout
from device_agent.data import LocalData, fit_to_model
from fedtier import algorithms, rng
from fedtier.algorithms import aggregate
from fedtier.algorithms.base import LocalResult, LocalTrain
from fedtier.errors import ConfigError
from fedtier.rollout.availability import AvailabilitySpec, make_traces
from fedtier.rollout.config import RolloutConfig
from fedtier.training.batching import minibatch_indices
from local_fleet.sim_nodes import SharedTrainers
from local_fleet.trace_sim import TraceRun, TraceSimulation

HORIZON_DAYS = 30.0
"""A run that has not finished after this many virtual days stops (a fleet that never reaches quorum)."""


def uses_traces(cfg: RolloutConfig) -> bool:
    """Whether ``fedtier simulate`` runs ``cfg`` on the trace simulator."""
    return cfg.fleet is not None or cfg.traits.asynchronous


def trainer_compute(prepared: PreparedRollout, trainers: SharedTrainers) -> Callable[[str, LocalTrain], LocalResult]:
    """Local training as ``DeviceNode.train`` does it, on one shared trainer, each device on its shard."""
    trainer = trainers(prepared.model_bundle)
    shards: dict[str, LocalData] = {}

    def compute(device: str, request: LocalTrain) -> LocalResult:
        data = shards.get(device)
        if data is None:
            x, y = prepared.data.train[device]
            data = shards[device] = fit_to_model(LocalData(x=x, y=y), prepared.model_arch)
        trainer.set_parameters(request.params)
        gen = rng.stream(*request.stream)
        batches = [(data.x[idx], data.y[idx])
                   for idx in minibatch_indices(len(data), request.batch_size, request.steps, gen)]
        stats = trainer.train_steps(batches, request.lr)
        delta = aggregate.subtract(trainer.get_parameters(), request.params)
        return LocalResult(delta=delta, num_samples=len(data), mean_loss=stats.mean_loss, steps=stats.steps)

    return compute


def run_traces(cfg: RolloutConfig, prepared: PreparedRollout,
               on_round: Callable[[dict[str, Any]], None] | None = None) -> TraceRun:
    """Run ``cfg`` on the trace simulator; write its metrics to ``cfg.metrics_path``."""
    if cfg.traits.split_model or cfg.traits.submodels or cfg.traits.scorer:
        raise ConfigError(f"the trace simulator runs fedavg, hier_qsgd, qhetfed and fedbuff; {cfg.algorithm} needs "
                          "its own shells (leave out [fleet])", key="fleet")
    if cfg.attack is not None:
        raise ConfigError("attacks run in the in-memory simulator, not under [fleet] traces", key="attack")
    spec = cfg.fleet.spec() if cfg.fleet is not None else AvailabilitySpec()
    traces = make_traces(spec, cfg.seed, prepared.devices)
    trainers = SharedTrainers(cfg.simulation.threads, cfg.simulation.trainer)
    evaluator = OrtEvaluator.for_rollout(prepared, cfg.simulation.threads)

    def evaluate(params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        if evaluator is None:
            return {}
        result = evaluator(dict(params))
        return {"accuracy": result.accuracy, "loss": result.loss}

    config = prepared.algorithm_config()
    module = algorithms.load(config.ALGORITHM)
    ledger = Ledger(prepared) if prepared.noise_plan is not None else None
    sim = TraceSimulation(module=module, cells=prepared.cells, initial_params=prepared.initial_params, config=config,
                          rounds=cfg.rounds, traces=traces, compute=trainer_compute(prepared, trainers),
                          evaluate=evaluate, rollout=cfg.rollout, cloud_id=cfg.cloud_id,
                          noise_seed=cfg.privacy.noise_seed if cfg.privacy is not None else None,
                          cloud_kwargs=prepared.cloud_kwargs(),
                          on_round=_with_ledger(on_round, ledger, lambda: sim.releases))
    result = sim.run(horizon_s=HORIZON_DAYS * spec.day_s)
    _write_metrics(cfg, result, spec, ledger)
    return result


def _with_ledger(on_round: Callable[[dict[str, Any]], None] | None, ledger: "Ledger | None",
                 releases: Callable[[], list[dict[str, Any]]]) -> Callable[[dict[str, Any]], None]:
    """Charge the releases that arrived since the last row, and put epsilon in the row, before ``on_round``."""
    def hook(row: dict[str, Any]) -> None:
        if ledger is not None:
            row["privacy"] = ledger.charge(releases())
        if on_round is not None:
            on_round(row)
    return hook


class Ledger:
    """The privacy ledger of a trace run: every release charged once, as it reaches the cloud, at full price.

    A device's release under an untrusted edge is charged to that device; a trusted edge's release over its
    buffer to every device in it. No sampling amplification: nobody samples in secret (docs/privacy.md).
    Epsilon is the largest over devices, by RDP composition of each device's Gaussian releases.
    """

    def __init__(self, prepared: PreparedRollout) -> None:
        assert prepared.noise_plan is not None
        self.plan = prepared.noise_plan
        self.charged = 0
        self.per_device: dict[str, list[float]] = {}

    def charge(self, releases: list[dict[str, Any]]) -> dict[str, Any]:
        for record in releases[self.charged:]:
            for device in record["protected"]:
                self.per_device.setdefault(device, []).append(float(record["z"]))
        self.charged = len(releases)
        return {"epsilon_max": self.epsilon(), "delta": self.plan.delta, "budget_epsilon": self.plan.budget_epsilon,
                "releases": self.charged,
                "max_releases_per_device": max((len(z) for z in self.per_device.values()), default=0)}

    def epsilon(self) -> float:
        """The largest epsilon over devices (``dp_accounting``'s RDP accountant over each device's releases)."""
        from dp_accounting import GaussianDpEvent
        from dp_accounting.rdp import RdpAccountant

        worst = 0.0
        for zs in self.per_device.values():
            accountant = RdpAccountant()
            for z in zs:
                accountant.compose(GaussianDpEvent(noise_multiplier=z))
            worst = max(worst, float(accountant.get_epsilon(self.plan.delta)))
        return worst


def _write_metrics(cfg: RolloutConfig, result: TraceRun, spec: AvailabilitySpec, ledger: Ledger | None) -> None:
    doc = {"rollout": cfg.rollout, "algorithm": cfg.algorithm, "rounds_planned": cfg.rounds,
           "finished": result.finished, "virtual_s": result.now, "trainings": result.trainings,
           "bytes": result.bytes, "dropped": result.dropped, "errors": result.errors,
           "fleet": {"availability": spec.availability, "share_online": spec.share_online,
                     "compute_s": spec.compute_s, "speed_sigma": spec.speed_sigma},
           "rounds": result.rows}
    if ledger is not None:
        doc["privacy"] = ledger.charge(result.releases)
    path = Path(cfg.metrics_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_plain))
    tmp.replace(path)


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"not JSON: {type(value).__name__}")


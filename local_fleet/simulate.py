"""Run a whole hierarchy in one process over the in-memory transport (``fedtier simulate``).

The same node classes as in deployment — ``DeviceNode``, ``EdgeNode``, ``CloudNode`` and
the same sans-I/O roles inside them — are wired to one ``MemoryBroker``. Only three
things differ, all outside the algorithms:

* delivery is deterministic, on this thread (no sockets, no threads): a FIFO, except that what a
  device publishes is delivered right after it (``MemoryBroker``: an edge folds each update as
  it comes, instead of a round's updates all waiting; each node's messages arrive in FIFO order);
* time is virtual: when the hierarchy goes idle before the rollout finished (a quorum
  waits for a deadline), the clock jumps to the next deadline;
* every device shares one ORT session per architecture and swaps parameters in
  (``set_parameters`` before each local run), so thousands of devices fit in memory; the
  devices' backend is ``[simulation] trainer`` (``ort``, or ``portable``: the bundle's
  portable graph, as on a board without onnxruntime-training).

With the same config and seeds, the final model equals that of a run over MQTT (to float
tolerance); a test checks it.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cloud_coordinator.node import CloudNode, OrtEvaluator
from cloud_coordinator.rollout import PreparedRollout, prepare
from cloud_coordinator.store import CoordinatorStore
from edge_broker.service import EdgeNode
from edge_broker.store import EdgeStore
from fedtier.artifacts.cache import ArtifactCache
from fedtier.errors import ArtifactError, ConfigError
from fedtier.rollout.config import RolloutConfig
from fedtier.transport.memory import MemoryBroker
from local_fleet.trace_rollout import run_traces, uses_traces
from local_fleet.sim_nodes import SharedTrainers, TrainObjective, bind, device_node, noise_source, simulated_trainers

log = logging.getLogger("fedtier.simulate")

VIRTUAL_TICK_S = 1.0


@dataclass
class SimulationResult:
    rounds: list[dict[str, Any]]
    params: dict[str, Any]
    prepared: PreparedRollout
    wall_s: float


BACKENDS = ("local", "ray")


def simulate(cfg: RolloutConfig, *, workdir: Path | None = None,
             on_round: Callable[[dict[str, Any]], None] | None = None,
             prepared: PreparedRollout | None = None, backend: str = "local", address: str | None = None,
             shards: int | None = None) -> SimulationResult:
    """Run ``cfg`` to completion in memory; write metrics to ``cfg.metrics_path``.

    Args:
        cfg: the rollout (``experiments/<name>.toml``).
        workdir: where node state goes (default: a temporary directory, removed after). The
            coordinator's database stays there, so calling ``simulate`` again with the same
            workdir resumes the rollout after its last committed round.
        on_round: called with each round's metrics row as it closes.
        prepared: a ``prepare(cfg)`` result to reuse (tests that run several paths).
        backend: ``local`` (every device in this process) or ``ray`` (the devices sharded over Ray
            actors, ``local_fleet.simulate_ray``; the same final model).
        address: with ``ray``, an existing Ray cluster's address (default: start a local Ray).
        shards: with ``ray``, how many actors (default: the CPUs Ray has).
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown simulation backend {backend!r}: choose one of {', '.join(BACKENDS)}",
                          key="backend")
    t0 = time.perf_counter()
    prepared = prepared or prepare(cfg, trainers=simulated_trainers(cfg))
    if cfg.simulation.trainer == "portable" and prepared.hybrid is None:
        _require_portable_graphs(prepared)
    _require_edge_rule(cfg)
    if prepared.hybrid is not None and any(len(c.y) == 0 for c in prepared.hybrid.cells.values()):
        raise ConfigError("the simulator trains every host and device on its rows: set [data] dir to the shards "
                          "(docs/hsgd.md)", key="data.dir")
    absent = [d for d in prepared.devices if d not in prepared.data.train and prepared.hybrid is None]
    if absent:
        raise ConfigError(f"the simulator trains every device on its data, and {len(absent)} device(s) have none "
                          f"(e.g. {absent[0]}): set [data] dir to the shards of `fedtier data split`", key="data.dir")
    if uses_traces(cfg):  # [fleet] availability on a virtual clock, or an asynchronous algorithm
        if backend != "local":
            raise ConfigError("the trace simulator ([fleet], fedbuff) runs in this process only", key="backend")
        run = run_traces(cfg, prepared, on_round)
        return SimulationResult(rounds=run.rows, params=run.params, prepared=prepared,
                                wall_s=time.perf_counter() - t0)
    with tempfile.TemporaryDirectory(prefix="fedtier-sim-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        broker = MemoryBroker(max_payload=cfg.simulation.max_payload or (1 << 30))
        # Devices share one artifact cache, pre-filled from the coordinator's bundle.
        cache = ArtifactCache(root / "artifact-cache")
        for sha, path in prepared.artifact_files().items():
            cache.put(sha, path.read_bytes())
        trainers = SharedTrainers(cfg.simulation.threads, cfg.simulation.trainer)
        attackers = set(cfg.attackers())

        remote = None
        if backend == "ray":
            from local_fleet.simulate_ray import RayDevices

            remote = RayDevices(cfg, prepared, broker, root, address=address, shards=shards)
        nodes: list[Any] = []
        for cell, members in prepared.cells.items():
            for device in members if remote is None else ():
                nodes.append(device_node(cfg, prepared, broker, device, cell, trainers=trainers, cache=cache,
                                         bundles_dir=root / "bundles", attacker=device in attackers))
            cell_tx, up_tx = broker.connect(f"{cell}/cell"), broker.connect(f"{cell}/cloud")
            edge = EdgeNode(cell=cell, cell_transport=cell_tx, cloud_transport=up_tx,
                            store=EdgeStore(":memory:", keep_inputs=False),  # nothing restarts it to replay them
                            cache=ArtifactCache(root / "edges" / cell), parent=cfg.cloud_id,
                            noise=noise_source(cfg, cell))
            cell_tx.set_handler(bind(edge, broker))
            up_tx.set_handler(bind(edge, broker))
            nodes.append(edge)
        # With a workdir the coordinator's state persists there, and a second call resumes it.
        store = CoordinatorStore(root / "coordinator.db" if workdir is not None else ":memory:")
        cloud_tx = broker.connect("cloud")
        extra = TrainObjective(prepared, trainers) if cfg.simulation.train_objective else None
        cloud = CloudNode(prepared=prepared, transport=cloud_tx, store=store,
                          evaluator=OrtEvaluator.for_rollout(prepared, cfg.simulation.threads), on_round=on_round,
                          extra_metrics=extra)
        cloud_tx.set_handler(bind(cloud, broker))

        try:
            result = _run(cfg, broker, nodes, cloud, prepared, t0, remote)
        finally:
            store.close()
            if remote is not None:
                remote.close()
    return result


def _require_edge_rule(cfg: RolloutConfig) -> None:
    """The simulated edges run here: a rule of your own they could not load is refused up front
    (a real edge rejects the task and says why in its log; here the rollout would only stall)."""
    if cfg.aggregation is None:
        return
    from fedtier.algorithms import strategies

    try:
        strategies.build(strategies.AggregatorSpec.from_dict(cfg.aggregation.spec("edge")))
    except strategies.StrategyError as exc:
        raise ConfigError(str(exc), key="aggregation.edge") from None


def _require_portable_graphs(prepared: PreparedRollout) -> None:
    """Refuse up front what every simulated device would refuse (rather than stall in round 0).

    Raises:
        ConfigError: A bundle of the rollout has no portable graph; the message names its ops.
    """
    from device_agent.trainers.portable import require_portable_graph

    for bundle in (prepared.model_bundle, *prepared.cell_bundles.values()):
        try:
            require_portable_graph(bundle)
        except ArtifactError as exc:
            raise ConfigError(f"the simulated devices train on the portable backend, but {exc}",
                              key="simulation.trainer") from None


def _run(cfg: RolloutConfig, broker: MemoryBroker, nodes: list[Any], cloud: CloudNode, prepared: PreparedRollout,
         t0: float, remote: Any = None) -> SimulationResult:
    """Deliver until the rollout finishes; ``remote``: devices elsewhere (``simulate_ray.RayDevices``)."""
    if remote is not None:
        remote.start(broker)  # its devices start first, as the local devices come first in ``nodes``
    for node in nodes:
        node.start(broker.now)
    cloud.start(broker.now)
    stalled_ticks = 0
    while not cloud.finished:
        delivered = _settle(broker, remote)
        if cloud.finished:
            break
        # Idle but not finished: let virtual time pass so deadlines can fire.
        broker.now += VIRTUAL_TICK_S
        if remote is not None:
            remote.tick(broker)
        for node in [*nodes, cloud]:
            node.tick(broker.now)
        stalled_ticks = 0 if delivered else stalled_ticks + 1
        if stalled_ticks > 10 * cfg.deadline_s + 100:
            where = cloud.role.round if cloud.role is not None else "-"
            raise RuntimeError(f"simulation stalled in round {where}: nothing moves")
    _settle(broker, remote)
    return SimulationResult(rounds=list(cloud.history), params=cloud.params, prepared=prepared,
                            wall_s=time.perf_counter() - t0)


def _settle(broker: MemoryBroker, remote: Any) -> int:
    """Run the broker until idle and, with remote devices, exchange their mail until nobody has any."""
    delivered = broker.run_until_idle()
    while remote is not None and remote.pending():
        remote.exchange(broker)
        delivered += 1 + broker.run_until_idle()
    return delivered

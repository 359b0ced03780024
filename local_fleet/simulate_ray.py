"""``fedtier simulate --backend ray``: the simulated devices sharded over Ray actors.

The edges and the cloud run in the driver on the in-memory broker, exactly as with the local
backend. The devices are split into contiguous shards; each shard is a Ray actor that builds its
devices with the same ``sim_nodes.device_node`` (the same ``DeviceNode`` and roles, one shared
trainer — one ORT session per architecture — per actor) on a broker of its own. Messages cross
between the driver and the shards as raw MQTT payloads (exactly the bytes the memory broker would
have routed, chunks included):

* a ``_RawTap`` per shard in the driver, subscribed to the cells' downward topics of that shard's
  devices, collects what the edges send them;
* when the driver's broker is idle, every shard with mail gets it in one ``step`` call (in
  parallel), runs its broker until idle and returns what its devices published upward, which the
  driver publishes in shard order; this repeats until nobody has mail;
* virtual time advances only when everything is idle, as in the local backend; ``tick`` reaches
  the shards too.

Each device computes only from its own seeds and state, and the roles aggregate in sorted device
order, so the final model equals the local backend's for the same config (a test checks it to
1e-5). Ray serializes (pickles) the calls' arguments between the driver and its own actors: the
config, and lists of ``(topic, bytes)`` — never anything received from a network.

Ray is the optional extra ``fedtier[ray]``; nothing imports it unless ``--backend ray`` is asked for.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from fedtier.rollout.config import RolloutConfig
from cloud_coordinator.rollout import PreparedRollout
from fedtier.errors import ConfigError
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker, MemoryTransport

log = logging.getLogger("fedtier.simulate.ray")

Mail = list[tuple[str, bytes]]


def import_ray() -> Any:
    """``ray``, or a ``ConfigError`` that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--backend ray needs Ray: pip install 'fedtier[ray]'", key="backend") from None
    return ray


class _RawTap(MemoryTransport):
    """A broker connection that keeps what it is delivered as raw ``(topic, payload)`` (chunks
    unassembled), for forwarding to another broker."""

    def __init__(self, broker: MemoryBroker, name: str) -> None:
        super().__init__(broker, name, None)
        broker.register(self)
        self.mail: Mail = []

    def _deliver(self, topic: str, payload: bytes, now: float) -> None:
        self.mail.append((topic, payload))

    def drain(self) -> Mail:
        mail, self.mail = self.mail, []
        return mail


class DeviceShard:
    """One Ray actor's devices on a broker of its own (see the module docstring)."""

    def __init__(self, cfg: RolloutConfig, devices: list[tuple[str, str]], root: str) -> None:
        from cloud_coordinator.rollout import prepare
        from local_fleet.sim_nodes import SharedTrainers, device_node, simulated_trainers
        from fedtier.artifacts.cache import ArtifactCache

        prepared = prepare(cfg, trainers=simulated_trainers(cfg))
        self.broker = MemoryBroker(max_payload=cfg.simulation.max_payload or (1 << 30))
        cache = ArtifactCache(Path(root) / "artifact-cache")
        for sha, path in prepared.artifact_files().items():
            cache.put(sha, path.read_bytes())
        trainers = SharedTrainers(cfg.simulation.threads, cfg.simulation.trainer)
        attackers = set(cfg.attackers())
        self.nodes = [device_node(cfg, prepared, self.broker, device, cell, trainers=trainers, cache=cache,
                                  bundles_dir=Path(root) / "bundles", attacker=device in attackers)
                      for device, cell in devices]
        self.uplink = _RawTap(self.broker, "uplink")
        for cell in sorted({cell for _, cell in devices}):
            self.uplink.subscribe(topics.cell_up_filter(cell))

    def start(self, now: float) -> Mail:
        self.broker.now = now
        for node in self.nodes:
            node.start(now)
        self.broker.run_until_idle()
        return self.uplink.drain()

    def step(self, now: float, mail: Mail) -> Mail:
        """Deliver ``mail`` to this shard's devices; what they publish until idle."""
        self.broker.now = now
        for topic, payload in mail:
            self.broker._publish(topic, payload, False)
        self.broker.run_until_idle()
        return self.uplink.drain()

    def tick(self, now: float) -> Mail:
        self.broker.now = now
        for node in self.nodes:
            node.tick(now)
        self.broker.run_until_idle()
        return self.uplink.drain()

    def ping(self) -> int:
        return os.getpid()


class RayDevices:
    """The driver's side: the shards' actors and, on the driver's broker, one tap per shard."""

    def __init__(self, cfg: RolloutConfig, prepared: PreparedRollout, broker: MemoryBroker, root: Path, *,
                 address: str | None = None, shards: int | None = None) -> None:
        ray = import_ray()
        self.ray = ray
        self._own = not ray.is_initialized()
        if self._own:
            ray.init(address=address, num_cpus=None if address else (shards or os.cpu_count() or 1),
                     include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
        devices = [(d, c) for c, members in prepared.cells.items() for d in members]
        n = max(1, min(len(devices), shards or int(ray.available_resources().get("CPU", 1)) or 1))
        size = -(-len(devices) // n)
        parts = [devices[i:i + size] for i in range(0, len(devices), size)]
        actor = ray.remote(num_cpus=1)(DeviceShard)
        self.actors = [actor.remote(cfg, part, str(root / f"shard-{i}")) for i, part in enumerate(parts)]
        self.taps = []
        for i, part in enumerate(parts):
            tap = _RawTap(broker, f"shard-{i}")
            for cell in sorted({c for _, c in part}):
                tap.subscribe(topics.cell_down_filter(cell))
            self.taps.append(tap)
        ray.get([a.ping.remote() for a in self.actors])  # built (or failed) before the rollout starts
        log.info("simulating %d devices in %d Ray actors", len(devices), len(self.actors))

    def _publish(self, broker: MemoryBroker, outs: list[Mail]) -> None:
        for mail in outs:  # shard order, then each shard's own publishing order: deterministic
            for topic, payload in mail:
                broker._publish(topic, payload, False)

    def start(self, broker: MemoryBroker) -> None:
        self._publish(broker, self.ray.get([a.start.remote(broker.now) for a in self.actors]))

    def pending(self) -> bool:
        return any(tap.mail for tap in self.taps)

    def exchange(self, broker: MemoryBroker) -> None:
        calls = [a.step.remote(broker.now, tap.drain()) for a, tap in zip(self.actors, self.taps, strict=True)
                 if tap.mail]
        self._publish(broker, self.ray.get(calls))

    def tick(self, broker: MemoryBroker) -> None:
        self._publish(broker, self.ray.get([a.tick.remote(broker.now) for a in self.actors]))

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        if self._own:
            self.ray.shutdown()

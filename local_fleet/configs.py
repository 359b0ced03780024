"""Configs and data for a fleet on one machine: a coordinator, an edge per cell, an agent per device.

``fedtier demo`` and the integration tests both lay fleets out with ``write_fleet``: one
TOML per node (validated by loading it back), each device's shard as ``data/<device>/``
(``train.npz``, and ``eval/`` with its held-out rows when ``[data] holdout`` > 0; written by
``device_agent.data.write_shard``, as ``fedtier data split`` writes them), and separate state
directories — exactly what an operator would write by hand for ``fedtier
coordinator|edge|agent run``. With ``[data] dataset = "files"`` each device reads its shard
under ``[data] dir`` in place.

A provisioned fleet (``fedtier demo --secure``) passes the nodes' enrollment bundles
(``fedtier provision ...``): each node's broker tables (mutual TLS), trusted manifest keys
and — for the coordinator — its signing key come from its bundle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


from fedtier.rollout.config import RolloutConfig
from fleet_data.datasets import make_federated
from fleet_data.shards import write_device_data
from device_agent.config import DeviceConfig
from edge_broker.config import EdgeConfig
from fedtier.errors import ConfigError
from fedtier.runtime.config import dumps_toml, load, read_toml

# Keys of a bundle's config that hold file paths, relative to the bundle.
_PATH_KEYS = ("tls_ca", "tls_cert", "tls_key", "signing_key")


@dataclass(frozen=True)
class FleetPaths:
    coordinator: Path
    edges: dict[str, Path]
    devices: dict[str, Path]
    workdir: Path

    def all(self) -> list[Path]:
        return [self.coordinator, *self.edges.values(), *self.devices.values()]


def bundle_settings(bundle: Path) -> dict[str, Any]:
    """The security settings of an enrollment bundle's config, with absolute paths.

    Returns the broker tables (``broker``, ``cell_broker``, ``cloud_broker``: whichever the
    bundle has), ``trusted_keys`` and ``signing_key``; not its ids, data or state dirs.
    """
    bundle = Path(bundle).resolve()
    config = next((bundle / n for n in ("device.toml", "edge.toml", "coordinator.toml") if (bundle / n).exists()),
                  None)
    if config is None:
        raise FileNotFoundError(f"{bundle} holds no device.toml, edge.toml or coordinator.toml")
    data = read_toml(config)

    def absolute(value: Any) -> Any:
        return str((bundle / value).resolve()) if isinstance(value, str) else value

    out: dict[str, Any] = {}
    for key in ("broker", "cell_broker", "cloud_broker"):
        if key in data:
            out[key] = {k: absolute(v) if k in _PATH_KEYS else v for k, v in data[key].items()}
    if "trusted_keys" in data:
        out["trusted_keys"] = [absolute(p) for p in data["trusted_keys"]]
    if "signing_key" in data:
        out["signing_key"] = absolute(data["signing_key"])
    return out


def _attacks(cfg: RolloutConfig) -> dict[str, dict[str, Any]]:
    """``[attack]``: the ``device.toml`` table of each attacking device (the simulator's choice of devices)."""
    if cfg.attack is None:
        return {}
    table: dict[str, Any] = {"kind": cfg.attack.kind, "scale": cfg.attack.scale, "seed": cfg.seed}
    if cfg.attack.kind == "label_flip":
        cells = cfg.topology.layout()
        table["classes"] = make_federated(cfg.data, [d for ds in cells.values() for d in ds], cells).num_classes
    return {device: dict(table) for device in cfg.attackers()}


def write_fleet(rollout: Mapping[str, Any], workdir: Path, broker: Mapping[str, Any],
                bundles: Mapping[str, Path] | None = None,
                device_settings: Mapping[str, Any] | None = None,
                device_state_root: Path | None = None) -> FleetPaths:
    """Write every node's config and every device's data under ``workdir``.

    Args:
        rollout: a rollout config as plain data (``RolloutConfig`` keys); its ``broker``
            table is set to ``broker``, and ``state_dir`` defaults to ``workdir/coordinator``.
        workdir: where configs (``configs/``), data (``data/``) and state go.
        broker: the ``[broker]`` table every node uses (host, port, ...).
        bundles: node id (the cloud id, cell ids, device ids) -> its enrollment bundle; the
            node's broker tables, trusted keys and signing key then come from the bundle.
        device_settings: extra keys for every ``device.toml`` (e.g. ``{"trainer": "portable"}``).
        device_state_root: where the devices' state dirs go (default ``workdir/devices``); the fleet
            emulator puts them on a RAM disk, each board's flash being its own.

    Returns:
        Paths of the written configs.
    """
    bundles = bundles or {}

    def secured(node: str, config: dict[str, Any]) -> dict[str, Any]:
        return {**config, **bundle_settings(bundles[node])} if node in bundles else config

    workdir = Path(workdir)
    cfg_dir = workdir / "configs"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    rollout = {"state_dir": str(workdir / "coordinator"), **rollout, "broker": dict(broker)}
    rollout = secured(str(rollout.get("cloud_id", "cloud")), rollout)
    coordinator = cfg_dir / "coordinator.toml"
    coordinator.write_text(dumps_toml(rollout))
    cfg = load(RolloutConfig, coordinator)
    cells = cfg.topology.layout()
    files = cfg.data.dataset == "files"
    if files and cfg.data.dir is None:
        raise ConfigError("a fleet on this machine reads each device's shard from [data] dir", key="data.dir")
    hosts = cfg.hsgd_hosts() if cfg.traits.split_model else {}
    if hosts and not files:  # HSGD: a host per cell beside its devices, every node its columns of the samples
        from fleet_data.hybrid import make_hybrid, write_hybrid_shards

        write_hybrid_shards(make_hybrid(cfg), {n: workdir / "data" / n for c, ds in cells.items()
                                               for n in (*ds, hosts[c])})
    elif not files:
        write_device_data(cfg, {d: workdir / "data" / d for ds in cells.values() for d in ds})
    attacks = _attacks(cfg)
    edges: dict[str, Path] = {}
    devices: dict[str, Path] = {}
    device_states = device_state_root or workdir / "devices"
    for cell, members in cells.items():
        edge = {"cell": cell, "state_dir": str(workdir / "edges" / cell), "parent": cfg.cloud_id,
                "cell_broker": dict(broker), "cloud_broker": dict(broker)}
        edges[cell] = cfg_dir / f"edge-{cell}.toml"
        edges[cell].write_text(dumps_toml(secured(cell, edge)))
        load(EdgeConfig, edges[cell])
        for device in (*members, *([hosts[cell]] if hosts else [])):
            if files:
                assert cfg.data.dir is not None
                data_dir = cfg.data.dir / device
            else:
                data_dir = workdir / "data" / device
            dev = {"device_id": device, "cell": cell, "data_dir": str(data_dir),
                   "state_dir": str(device_states / device), "broker": dict(broker), **(device_settings or {}),
                   **({"role": "host"} if device in hosts.values() else {}),
                   **({"attack": attacks[device]} if device in attacks else {})}
            devices[device] = cfg_dir / f"device-{device}.toml"
            devices[device].write_text(dumps_toml(secured(device, dev)))
            load(DeviceConfig, devices[device])
    return FleetPaths(coordinator=coordinator, edges=edges, devices=devices, workdir=workdir)

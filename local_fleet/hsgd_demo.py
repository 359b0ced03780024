"""``fedtier demo --algorithm hsgd``: a host and one-sample devices per cell, trained through a real broker.

The fleet is the one an operator deploys: ``write_fleet`` writes a rollout (``algorithm = "hsgd"``), an
edge config per cell and an agent config per host (``role = "host"``) and device, with each node's columns
of scikit-learn's breast_cancer (hosts: features 0-19 of every sample of their cell, devices: 20-29 of
their one sample); then the coordinator, the edges and the agents run as the nodes ``fedtier coordinator
run``, ``fedtier edge run`` and ``fedtier agent run`` build — manifests, artifacts fetched and verified,
outboxes — each with its own MQTT connection to a broker started on a free port (Mosquitto when
installed, else the embedded one). They run as threads of this process (``thread_fleet``), so a hundred
agents do not need a hundred interpreters. It reports test AUC per round and the bytes per tier,
embeddings included.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fedtier.errors import LocalProtocolError

ROLLOUT = "hsgd-demo"


@dataclass(frozen=True)
class HsgdDemoOptions:
    devices: int = 100
    cells: int = 2
    rounds: int = 30
    interval: int = 2
    """P = Q, iterations per round."""
    alpha: float = 0.2
    lr: float = 0.05
    broker: str = "auto"
    seed: int = 0
    timeout_s: float = 600.0


def rollout_mapping(opts: HsgdDemoOptions, workdir: Path) -> dict[str, Any]:
    """The demo's rollout config (what a user would write in ``rollout.toml``)."""
    from local_fleet.demo import default_artifact_store

    per_cell = [opts.devices // opts.cells + (1 if c < opts.devices % opts.cells else 0) for c in range(opts.cells)]
    names = [f"dev-{i:03d}" for i in range(opts.devices)]
    members, start = {}, 0
    for c, size in enumerate(per_cell):
        members[f"cell-{chr(ord('a') + c)}"] = names[start:start + size]
        start += size
    return {"rollout": ROLLOUT, "algorithm": "hsgd", "rounds": opts.rounds, "seed": opts.seed,
            "state_dir": str(workdir / "coordinator"), "artifact_store": str(default_artifact_store()),
            "log_level": "warning",
            "data": {"dataset": "breast_cancer", "partition": "iid", "standardize": True, "seed": opts.seed},
            "topology": {"members": members},
            "hsgd": {"global_interval": opts.interval, "local_interval": opts.interval, "alpha": opts.alpha,
                     "lr": opts.lr, "host_features": 20, "deadline_s": 30.0}}


def run_demo(opts: HsgdDemoOptions, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run the demo; returns AUC per round, bytes per tier, the paper meter and the wall time."""
    from local_fleet.demo import free_port, mosquitto_path, wait_for_port
    from local_fleet.configs import write_fleet
    from local_fleet.threads import FleetError, ThreadFleet

    if not 1 <= opts.cells <= 26 or opts.devices < 2 * opts.cells:
        raise LocalProtocolError(f"--devices {opts.devices} is too few for {opts.cells} cells (2 per cell at least, "
                                 "at most 26 cells)")
    t0 = time.perf_counter()
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="fedtier-hsgd-demo-"))
    nodes = opts.devices + 2 * opts.cells + 1
    proc, kind = _start_broker(opts.broker, port, workdir, 2 * nodes + 8, mosquitto_path())
    fleet: ThreadFleet | None = None
    try:
        if not wait_for_port(port, 15):
            raise LocalProtocolError(f"the {kind} broker did not open port {port}")
        paths = write_fleet(rollout_mapping(opts, workdir), workdir, {"host": "127.0.0.1", "port": port},
                            device_settings={"log_level": "warning"})
        say(f"{kind} broker on 127.0.0.1:{port}; {opts.cells} cells, each an edge, a host and "
            f"{opts.devices // opts.cells} one-sample devices; P = Q = {opts.interval}, alpha = {opts.alpha}")
        fleet = ThreadFleet(paths)
        fleet.start_all()
        coordinator = fleet.nodes["coordinator"].node
        shown = 0
        deadline = time.monotonic() + opts.timeout_s
        while True:
            fleet.check()
            finished = coordinator.finished
            for row in coordinator.history[shown:]:
                say(f"round {row['round']} ({row['round'] + 1}/{opts.rounds}): test AUC {row['auroc']:.4f}")
            shown = len(coordinator.history)
            if finished:
                break
            if time.monotonic() > deadline:
                raise LocalProtocolError(f"the rollout did not finish in {opts.timeout_s:.0f} s "
                                         f"({shown} of {opts.rounds} rounds)")
            time.sleep(0.05)
        history = list(coordinator.history)
        traffic = _traffic(fleet, paths)
    except FleetError as exc:
        raise LocalProtocolError(str(exc)) from None
    finally:
        if fleet is not None:
            fleet.stop()
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    total = {key: sum(int(r["bytes"].get(key, 0)) for r in history)
             for key in ("device_up", "device_down", "edge_up", "cloud_down", "embedding_up", "embedding_down")}
    rejected: dict[str, int] = {}
    for row in history:
        for cell in row["cells"].values():
            for reason, n in cell["rejected"].items():
                rejected[reason] = rejected.get(reason, 0) + int(n)
    return {"algorithm": "hsgd", "broker": kind, "cells": opts.cells, "devices": opts.devices,
            "rounds": [{"round": r["round"], "auc": r["auroc"], "accuracy": r["accuracy"]} for r in history],
            "bytes": {"device_up": traffic["device_up"], "device_down": traffic["device_down"],
                      "host_up": traffic["host_up"], "host_down": traffic["host_down"],
                      "edge_up": total["edge_up"], "edge_down": total["cloud_down"],
                      "vertical": total["embedding_up"] + total["embedding_down"]},
            "paper_bytes": sum(int(r.get("paper_bytes", 0)) for r in history),
            "rejected": rejected, "wall_s": time.perf_counter() - t0}


def _traffic(fleet: Any, paths: Any) -> dict[str, int]:
    """Bytes the hosts and the devices sent (``cell_up``) and received (``cell_down``) on their connections."""
    from fedtier.rollout.config import RolloutConfig
    from fedtier.runtime.config import load

    hosts = set(load(RolloutConfig, paths.coordinator).hsgd_hosts().values())
    out = dict.fromkeys(("device_up", "device_down", "host_up", "host_down"), 0)
    for name, running in fleet.nodes.items():
        if name not in paths.devices:
            continue
        side = "host" if name in hosts else "device"
        counts = running.node.tx.traffic.bytes
        out[f"{side}_up"] += int(counts.get(("out", "cell_up"), 0))
        out[f"{side}_down"] += int(counts.get(("in", "cell_down"), 0))
    return out


def _start_broker(kind: str, port: int, workdir: Path, sockets: int, mosq: str | None) -> tuple[Any, str]:
    from dataclasses import replace

    from provisioning.broker_limits import limits_for, mosquitto_global_limits, mosquitto_listener_limits

    limits = limits_for(0)
    if sockets > limits.max_connections_per_address:
        limits = replace(limits, max_connections_per_address=sockets,
                         max_connections=max(sockets, limits.max_connections))
    if kind == "mosquitto" and mosq is None:
        raise LocalProtocolError("--broker mosquitto, but mosquitto is not installed (apt-get install mosquitto)")
    log = (workdir / "broker.log").open("w")
    if kind == "mosquitto" or (kind == "auto" and mosq is not None):
        conf = workdir / "mosquitto.conf"
        conf.write_text("\n".join(["allow_anonymous true", "persistence false", *mosquitto_global_limits(limits),
                                   f"listener {port} 127.0.0.1", *mosquitto_listener_limits(limits)]) + "\n")
        return subprocess.Popen([str(mosq), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT), "mosquitto"
    argv = [sys.executable, "-m", "fedtier", "broker", "run", "--port", str(port), "--max-connections-per-address",
            str(limits.max_connections_per_address)]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), "embedded"

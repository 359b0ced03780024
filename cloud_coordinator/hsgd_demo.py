"""``fedtier demo --algorithm hsgd``: a host and one-sample devices per cell, trained through a real broker.

HSGD's roles (``fedtier.algorithms.hsgd``) run in this process, every node (cloud, edges, hosts, devices)
with its own MQTT connection to a broker started on a free port (Mosquitto when installed, else the
embedded one), on scikit-learn's breast_cancer split vertically (hosts: features 0-19, devices: 20-29)
and horizontally into cells. It reports test AUC per round and the bytes per tier, embeddings included.
HSGD has no ``fedtier agent run`` / ``fedtier edge run`` processes yet (docs/hsgd.md), hence one process.
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


def run_demo(opts: HsgdDemoOptions, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run the demo; returns AUC per round, bytes per tier, the paper meter and the wall time."""
    from sklearn.metrics import roc_auc_score

    from cloud_coordinator import hsgd_loop
    from cloud_coordinator.demo import free_port, mosquitto_path, wait_for_port
    from cloud_coordinator.hsgd_reference import DEVICE_COLUMNS, HOST_COLUMNS, breast_cancer
    from fedtier.algorithms.hsgd import HsgdConfig
    from fedtier.training import split

    if opts.devices < 2 * opts.cells:
        raise LocalProtocolError(f"--devices {opts.devices} is too few for {opts.cells} cells (2 per cell at least)")
    t0 = time.perf_counter()
    groups, test = breast_cancer(opts.seed, groups=opts.cells, limit=opts.devices)
    cells = hsgd_loop.make_cells(groups, prefix="cell-")
    arch = split.SplitArch(len(HOST_COLUMNS), len(DEVICE_COLUMNS), 8, 8, 2)
    config = HsgdConfig(global_interval=opts.interval, local_interval=opts.interval, alpha=opts.alpha, lr=opts.lr,
                        seed=opts.seed, hosts={c: d.host for c, d in cells.items()})
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="fedtier-hsgd-demo-"))
    proc, kind = _start_broker(opts.broker, port, workdir, 2 * (opts.devices + 2 * opts.cells) + 8, mosquitto_path())
    try:
        if not wait_for_port(port, 15):
            raise LocalProtocolError(f"the {kind} broker did not open port {port}")
        say(f"{kind} broker on 127.0.0.1:{port}; {len(cells)} cells, each a host and "
            f"{', '.join(str(len(d.devices)) for d in cells.values())} one-sample devices; P = Q = {opts.interval}, "
            f"alpha = {opts.alpha}")
        rounds: list[dict[str, Any]] = []

        def auc(params: Any) -> float:
            value = float(roc_auc_score(test[2], split.probabilities(params, test[0], test[1])[:, 1]))
            rounds.append({"round": len(rounds), "auc": value})
            say(f"round {len(rounds) - 1} ({len(rounds)}/{opts.rounds}): test AUC {value:.4f}")
            return value

        bus = hsgd_loop.MqttBus("127.0.0.1", port, f"hsgd-demo-{opts.seed}", cells, timeout_s=min(opts.timeout_s, 60))
        result = hsgd_loop.run(cells, split.init_params(arch, opts.seed), config, opts.rounds,
                               rollout=f"hsgd-demo-{opts.seed}", bus=bus, evaluate=auc)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"algorithm": "hsgd", "broker": kind, "cells": len(cells),
            "devices": sum(len(d.devices) for d in cells.values()), "rounds": rounds, "bytes": dict(result.bytes),
            "paper_bytes": 4 * sum(r["paper_values"] for r in result.rounds),
            "rejected": dict(result.rejected), "wall_s": time.perf_counter() - t0}


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

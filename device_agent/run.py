"""``fedtier agent run``: build a device node over MQTT from ``device.toml`` and run it."""

from __future__ import annotations

import faulthandler
import logging
import os
import queue
import sys
import threading

from device_agent import faults
from device_agent.attack import AttackingTrainer, AttackSpec, flip_labels
from device_agent.config import DeviceConfig
from device_agent.data import LocalData, load_data_dir, load_eval_dir
from device_agent.hybrid import load_row_ids, split_provider
from device_agent.node import DeviceNode
from device_agent.state import DeviceState
from device_agent.trainers import describe_backend, make_trainer, resolve_kind
from fedtier import __version__
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.errors import ConfigError
from fedtier.artifacts.cache import ArtifactCache
from fedtier.runtime import identity, mqtt_service
from fedtier.security.signing import load_trusted_keys
from fedtier.training.trainer import Trainer
from fedtier.transport import mqtt, topics

log = logging.getLogger("fedtier.agent")


def build(cfg: DeviceConfig) -> tuple[DeviceNode, mqtt.MqttTransport, "queue.Queue"]:
    """The node and its connection, not yet started (tests drive these directly).

    The training backend is chosen here, once (``trainer = "auto"``: onnxruntime-training if
    installed, else the portable graph on stock onnxruntime), logged, and announced in the
    retained presence document (``trainer``), so the edge and operators see what each
    device trains with.

    Raises:
        ConfigError: ``trainer = "auto"`` and no onnxruntime is installed.
    """
    backend = resolve_kind(cfg.trainer)  # before touching anything: a device that cannot train says so now
    log.info("device %s: trainer %s", cfg.device_id, describe_backend(cfg.trainer))
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    data = load_data_dir(cfg.data_dir)
    held_out = load_eval_dir(cfg.data_dir, cfg.eval_dir)
    row_ids = load_row_ids(cfg.data_dir)
    if cfg.role == "host" and row_ids is None:
        raise ConfigError(f"a host holds rows of its cell's samples: {cfg.data_dir / 'train.npz'} needs the array "
                          "'ids' (each row's sample id = its device's node id; docs/hsgd.md)", key="data_dir")
    spec = None
    if cfg.attack is not None:
        spec = AttackSpec(kind=cfg.attack.kind, scale=cfg.attack.scale, seed=cfg.attack.seed,
                          classes=cfg.attack.classes)
        log.warning("ATTACK RUN: device %s is configured to attack: %s ([attack] in its config; for robustness "
                    "tests only)", cfg.device_id, spec.describe())
        if spec.kind == "label_flip":
            assert spec.classes is not None
            data = LocalData(x=data.x, y=flip_labels(data.y, spec.classes))
    fault = faults.from_env(cfg.device_id)
    if fault is not None:
        log.warning("TEST RUN: device %s fails on purpose (%s) before it trains round %d (%s is set; for "
                    "tests only)", cfg.device_id, fault.how, fault.round, faults.ENV)
    inbox: queue.Queue = queue.Queue()
    max_bytes = int(cfg.max_message_mb * (1 << 20))
    tx = mqtt.from_config(cfg.broker, name="cell", client_id=cfg.device_id, inbox=inbox,
                          status={"node": cfg.device_id, "role": cfg.role, "cell": cfg.cell, "trainer": backend,
                                  "version": __version__},
                          status_topic=topics.cell_status(cfg.cell, cfg.device_id),  # only its edge follows it
                          max_message_bytes=max_bytes)

    def provider(bundle: ArtifactBundle) -> Trainer:
        trainer = make_trainer(backend, bundle, threads=cfg.threads)  # torch is imported only if chosen
        return trainer if spec is None else AttackingTrainer(trainer, spec, cfg.device_id)

    node = DeviceNode(device_id=cfg.device_id, cell=cfg.cell, transport=tx, data=data, trainer_provider=provider,
                      state=DeviceState(cfg.state_dir / "agent.db"), cache=ArtifactCache(cfg.state_dir / "artifacts"),
                      bundles_dir=cfg.state_dir / "bundles", max_message_bytes=max_bytes,
                      trusted_keys=load_trusted_keys(cfg.trusted_keys), eval_data=held_out, side=cfg.role,
                      row_ids=row_ids, split_provider=split_provider(backend), max_task_crashes=cfg.max_task_crashes,
                      fault=fault)
    return node, tx, inbox


M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter for the number of malloc arenas (``malloc.h``)."""


def share_one_malloc_arena() -> bool:
    """Let every thread of the agent allocate from one glibc malloc arena, unless ``MALLOC_ARENA_MAX`` says
    otherwise. Returns whether it did.

    By default glibc gives each thread that allocates its own arena: the MQTT client's network thread
    receives every payload into its arena, the main thread decodes and frees it, and each arena keeps its
    high-water mark. On this agent that costs about 1.5 MB of peak RSS (``benchmarks/bench_agent.py``, with
    and without ``MALLOC_ARENA_MAX=1``); its threads take turns (one trains, one moves bytes), so sharing one
    arena costs no measurable time. Not glibc (musl, macOS): nothing to do.
    """
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes  # the runtime has loaded it already

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no glibc
        return False
    return bool(mallopt(M_ARENA_MAX, 1))


def run(cfg: DeviceConfig, stop: threading.Event | None = None) -> int:
    # A native crash of the training runtime (a segfault in onnxruntime) kills the process with no Python
    # exception: this prints where each thread was to stderr (the service's log) before it dies. The node's
    # state says which work it died in at the next start (DeviceNode._report_open_work).
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (AttributeError, ValueError, OSError):  # stderr without a file descriptor (embedded)
            log.debug("no faulthandler: stderr has no file descriptor")
    if not identity.preflight(cfg.device_id, [cfg.broker]):
        return mqtt_service.EXIT_UNAUTHORIZED
    share_one_malloc_arena()  # before the MQTT client's thread starts
    node, tx, inbox = build(cfg)
    if cfg.metrics_port:
        node.metrics.serve(cfg.metrics_port)
        log.info("metrics on http://127.0.0.1:%d/metrics", cfg.metrics_port)
    log.info("%s %s of cell %s: %d local samples, %d held out; broker %s:%d", cfg.role, cfg.device_id, cfg.cell,
             len(node.data), len(node.eval_data) if node.eval_data is not None else 0, cfg.broker.host,
             cfg.broker.port)
    return mqtt_service.run(node, [tx], inbox, start=node.start, stop=stop)

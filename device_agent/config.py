"""``device.toml``: the configuration of one device agent."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedtier.runtime.config import LOG_LEVELS, BrokerConfig, Section, node_id, opt


@dataclass(frozen=True)
class AttackConfig(Section):
    """Testing only: this device lies about its updates (device_agent.attack). Logged loudly at start-up."""

    kind: str = opt(help="sign_flip, gaussian, label_flip or stale_replay.",
                    choices=("sign_flip", "gaussian", "label_flip", "stale_replay"))
    scale: float = opt(10.0, gt=0, help="sign_flip: the factor; gaussian: the noise's standard deviation.")
    seed: int = opt(0, help="gaussian: seed of the noise.")
    classes: int | None = opt(None, min=2, help="label_flip: the number of classes (labels become classes - 1 - y).")

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        if self.kind == "label_flip" and self.classes is None:
            raise self.error("label_flip needs the number of classes", "classes", prefix=prefix, source=source)


@dataclass(frozen=True)
class DeviceConfig(Section):
    """One device: who it is, which cell it belongs to, where its data and state live."""

    device_id: str = opt(help="This device's node id (= MQTT client id; = certificate CN with TLS).",
                         check=node_id)
    cell: str = opt(help="The cell (edge) this device is in: the one its broker serves. A device of a roaming "
                         "rollout that moves gets the new cell here (and its gateway's broker).", check=node_id)
    data_dir: Path = opt(help="Directory of .npz (arrays x, y) or .csv (label last) files with local data.")
    state_dir: Path = opt(help="Directory for the outbox (SQLite) and downloaded artifacts.")
    role: str = opt("device", choices=("device", "host"),
                    help="device, or host: HSGD's feature party of the cell (the hospital), holding its block of "
                         "features for every sample of the cell, with the samples' ids in array 'ids' of its "
                         "train.npz (docs/hsgd.md).")
    eval_dir: Path | None = opt(None, help="Held-out rows (same formats) the device evaluates each round's global "
                                           "model on, never trains on (federated evaluation); default "
                                           "<data_dir>/eval if it exists.")
    trainer: str = opt("auto", choices=("auto", "ort", "portable", "torch"),
                       help="Training backend: 'ort' = onnxruntime-training; 'portable' = stock onnxruntime on the "
                            "bundle's portable graph (boards without an onnxruntime-training wheel: aarch64, "
                            "Python 3.13+); 'torch' = torch eager; 'auto' = 'ort' where onnxruntime-training is "
                            "installed, else 'portable'. All give the same weights.")
    threads: int = opt(1, min=1, max=64, help="Threads for local training.")
    max_task_crashes: int = opt(2, min=1, max=100,
                                help="An agent that died this many times while it trained the same step (a native "
                                     "crash of the training runtime: it is restarted by its service manager) does "
                                     "not train it again: it reports training_failed to its edge, which closes the "
                                     "round without it, and takes the next task.")
    broker: BrokerConfig = opt(default_factory=BrokerConfig, help="The cell broker (on the gateway).")
    trusted_keys: tuple[Path, ...] = opt((), help="Ed25519 public keys (PEM) whose signatures on rollout manifests "
                                                  "this device accepts; empty = manifests are not verified.")
    max_message_mb: float = opt(64.0, gt=0, help="Refuse messages (after reassembly) larger than this.")
    metrics_port: int = opt(0, min=0, max=65535, help="Serve Prometheus /metrics on this port (127.0.0.1); 0 = off.")
    log_level: str = opt("info", choices=LOG_LEVELS, help="Logging level.")
    attack: AttackConfig | None = opt(None, help="Testing only: make this device attack (absent: it never does).")

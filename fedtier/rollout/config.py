"""The coordinator's rollout configuration — also the format of ``experiments/<name>.toml``.

One file describes a whole training campaign: the model (built-in, a torch factory or an
ONNX file), the data (for simulation, and the held-out test split the coordinator evaluates
on), the topology of cells and devices, the algorithm's settings, and, for ``fedtier
coordinator run``, the cloud broker.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Sequence

from fedtier import algorithms
from fedtier.algorithms import strategies
from fedtier.algorithms.common import LR_SCHEDULES
from fedtier.algorithms.fedavg import FedAvgConfig
from fedtier.algorithms.fedbuff import STALENESS_WEIGHTS, FedBuffConfig
from fedtier.algorithms.secure_fedavg import MAX_PHASES_SHARE, PHASE_SHARES, SecureFedAvgConfig, check_phase_shares
from fedtier.algorithms.fedxl import FedXLConfig
from fedtier.algorithms.hier_qsgd import HierConfig
from fedtier.algorithms.hist import HistConfig
from fedtier.algorithms.hsgd import HsgdConfig
from fedtier.algorithms.qhetfed import QHetFedConfig
from fedtier.errors import ConfigError, LocalProtocolError
from fedtier.rng import stream
from fedtier.rollout.availability import MODES as AVAILABILITY_MODES
from fedtier.rollout.availability import AvailabilitySpec
from fedtier.runtime.config import LOG_LEVELS, BrokerConfig, Section, node_id, opt
from fedtier.training.layout import LOSSES, ArchSpec
from fedtier.transport.topics import check_id

DATASETS = ("digits", "breast_cancer", "synthetic", "rare_event", "files")
MODEL_KINDS = ("mlp", "cnn1d", "torch", "onnx")
BUILTIN_MODELS = ("mlp", "cnn1d")


def _bits(value: int) -> None:
    """0 (float32) or a QSGD width 2..8 (1 bit leaves no level: s = 2^0 - 1 = 0)."""
    if value == 1:
        raise ValueError("1 bit leaves QSGD no level (s = 2^(b-1) - 1 = 0); use 0 (float32) or 2..8")
PARTITIONS = ("iid", "shards", "dirichlet", "cell_shards", "one_class")


def _factory_spec(value: str) -> None:
    target, sep, name = value.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"{value!r} is not 'package.module:function' or 'path/to/file.py:function'")


def _is_file_factory(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


@dataclass(frozen=True)
class ModelConfig(Section):
    """Which network: built-in (mlp, cnn1d; sized from the data) or your own (torch factory, onnx file; docs/models.md).

    A user's model is resolved once on the coordinator (``models.source``); devices get its ORT
    artifacts like a built-in model's.
    """

    kind: str = opt("mlp", choices=MODEL_KINDS, help="mlp or cnn1d (built-in), torch (a factory) or onnx (a file).")
    hidden: tuple[int, ...] = opt((64,), help="MLP hidden layer widths.")
    channels: int = opt(1, min=1, help="CNN1D input channels (features = channels x length).")
    filters: tuple[int, ...] = opt((16, 32), help="CNN1D filters per conv layer.")
    kernel: int = opt(5, min=1, help="CNN1D kernel size.")
    init_seed: int = opt(0, help="Seed of the initial weights (built-in; torch: the factory runs under "
                                 "torch.manual_seed(init_seed)).")
    factory: str | None = opt(None, check=_factory_spec,
                              help="torch: 'package.module:function' or 'path/to/file.py:function' (relative to "
                                   "this file), returning (torch.nn.Module, example input batch). Imported on the "
                                   "coordinator only.")
    path: Path | None = opt(None, help="onnx: the exported inference graph (one batch-first input, one "
                                       "(batch, outputs) output).")
    loss: str = opt("cross_entropy", choices=LOSSES,
                    help="torch/onnx: cross_entropy (integer class labels), bce (targets in [0, 1] per output) "
                         "or mse (float targets). Built-in models use cross_entropy. fedxl trains every model as a "
                         "one-output scorer with weighted_score (set by the algorithm).")
    trainable: tuple[str, ...] | None = opt(None, help="onnx: the float initializers to train (default: all); "
                                                       "the others stay frozen.")

    @classmethod
    def rebase_strings(cls, data: Mapping[str, Any], base_dir: Path) -> Mapping[str, Any]:
        # A factory given as a file is relative to the config file, like every path in a config.
        factory = data.get("factory")
        if isinstance(factory, str):
            target, sep, name = factory.rpartition(":")
            if sep and target and _is_file_factory(target) and not Path(target).expanduser().is_absolute():
                return {**data, "factory": f"{os.path.normpath(base_dir / Path(target).expanduser())}:{name}"}
        return data

    @property
    def builtin(self) -> bool:
        return self.kind in BUILTIN_MODELS

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        if any(h <= 0 for h in self.hidden):
            raise self.error("hidden widths must be positive", "hidden", prefix=prefix, source=source)
        if any(f <= 0 for f in self.filters):
            raise self.error("filters must be positive", "filters", prefix=prefix, source=source)
        own = {"factory": "torch", "path": "onnx", "trainable": "onnx"}
        for key, kind in own.items():
            if getattr(self, key) is not None and self.kind != kind:
                raise self.error(f"is for kind = {kind!r}; this model is kind = {self.kind!r}", key,
                                 prefix=prefix, source=source)
        if self.builtin and self.loss not in ("cross_entropy", "weighted_score"):
            raise self.error(f"the built-in {self.kind} trains with cross_entropy; use kind = 'torch' or 'onnx' "
                             f"for {self.loss}", "loss", prefix=prefix, source=source)
        if self.kind == "torch":
            if self.factory is None:
                raise self.error("required for kind = 'torch': 'package.module:function' or "
                                 "'path/to/file.py:function'", "factory", prefix=prefix, source=source)
            target = self.factory.rpartition(":")[0]
            if _is_file_factory(target) and not Path(target).is_file():
                raise self.error(f"file not found: {target}", "factory", prefix=prefix, source=source)
        if self.kind == "onnx":
            if self.path is None:
                raise self.error("required for kind = 'onnx': the exported .onnx file", "path",
                                 prefix=prefix, source=source)
            if not self.path.is_file():
                raise self.error(f"file not found: {self.path}", "path", prefix=prefix, source=source)
        if self.trainable is not None and not self.trainable:
            raise self.error("an empty list trains nothing; leave it out to train every float initializer",
                             "trainable", prefix=prefix, source=source)

    def arch(self, num_features: int, num_classes: int) -> ArchSpec:
        if self.kind == "mlp":
            return ArchSpec("mlp", {"sizes": [num_features, *self.hidden, num_classes]})
        if num_features % self.channels:
            raise ValueError(f"{num_features} features do not split into {self.channels} channels")
        return ArchSpec("cnn1d", {"channels": self.channels, "length": num_features // self.channels,
                                  "classes": num_classes, "filters": list(self.filters), "kernel": self.kernel})


@dataclass(frozen=True)
class DataConfig(Section):
    """Where training data comes from: bundled, generated, or your own shards (files, from `fedtier data split`).

    Nothing is downloaded.
    """

    dataset: str = opt("digits", choices=DATASETS,
                       help="scikit-learn bundled set, a synthetic mixture, rare_event (a binary task with rare "
                            "positives: Gaussian classes in `features` dimensions, separated by `separation` on 5 of "
                            "them), or files (your shards in dir).")
    dir: Path | None = opt(None, help="files: the directory `fedtier data split` wrote (one sub-directory per device "
                                      "id, with train.npz and eval/). Needed to simulate, and to size a built-in "
                                      "model; a coordinator of a torch/onnx model runs without it.")
    eval_file: Path | None = opt(None, help="files: a central test set (.csv or .npz, e.g. the test.npz of `fedtier "
                                            "data split --test-fraction`) the coordinator evaluates every round on.")
    label_column: str | None = opt(None, help="files: eval_file's label column in a CSV (name or 0-based index; "
                                              "default: the last column).")
    holdout: float = opt(0.0, min=0, max=0.9,
                         help="Built-in datasets: the share of each device's rows it keeps out of training and "
                              "evaluates the incoming global model on (federated evaluation; 0 = off). For files, "
                              "the shards' eval/ directories play this part.")
    partition: str = opt("shards", choices=PARTITIONS,
                         help="How training data is split across devices: iid, label shards, Dirichlet, "
                              "cell_shards (iid across cells, label shards within each cell), or one_class (binary "
                              "tasks: every other device holds only negatives, the others only positives).")
    classes_per_device: int = opt(2, min=1, help="Label classes per device for partition = shards.")
    alpha: float = opt(0.5, gt=0, help="Dirichlet concentration for partition = dirichlet (small = skewed).")
    test_fraction: float = opt(0.2, gt=0, max=0.9, help="Held-out share evaluated by the coordinator.")
    seed: int = opt(0, help="Seed of the train/test split and the partition.")
    samples: int = opt(2000, min=10, help="synthetic: number of samples.")
    features: int = opt(20, min=1, help="synthetic: number of features.")
    classes: int = opt(4, min=2, help="synthetic: number of classes.")
    separation: float = opt(2.0, gt=0, help="synthetic: norm of every class mean (larger = easier).")
    mean_std: float = opt(0.0, min=0, help="synthetic: if > 0, class means ~ N(0, mean_std^2 I) instead of "
                                           "fixed-norm means (the QHetFed pilot uses 0.25).")
    modes: int = opt(1, min=1, help="synthetic: Gaussian blobs per class (> 1 needs a hidden layer to separate).")
    noise: float = opt(1.0, gt=0, help="synthetic: standard deviation of the noise around each blob.")
    standardize: bool = opt(False, help="Scale features to zero mean, unit variance (training statistics).")
    positive_rate: float = opt(0.0, min=0, max=0.99,
                               help="Binary tasks: the share of positives (label 1). rare_event draws them at this "
                                    "rate (0 = 1/6, pos:neg 1:5); other datasets keep a random subset of their "
                                    "positives so they are this share (0 = as loaded).")
    device_shift: float = opt(0.0, min=0,
                              help="rare_event: device i's features move by (i - (N-1)/2) x device_shift along 5 "
                                   "coordinates the classes do not use (per-device nuisance shift; the test set "
                                   "mixes every device's shift).")
    label_noise: float = opt(0.0, min=0, max=0.5,
                             help="Binary tasks: the share of each class's training labels flipped (test labels stay "
                                  "clean).")

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        files = self.dataset == "files"
        for key in ("dir", "eval_file", "label_column"):
            if getattr(self, key) is not None and not files:
                raise self.error(f"is for dataset = 'files'; the {self.dataset} dataset brings its own data",
                                 key, prefix=prefix, source=source)
        if self.dataset == "rare_event" and self.features < 10 and self.device_shift:
            raise self.error("rare_event separates the classes on 5 features and shifts devices on 5 others: "
                             "device_shift needs features >= 10", "features", prefix=prefix, source=source)
        if self.dataset == "rare_event" and self.features < 5:
            raise self.error("rare_event separates the classes on 5 features: it needs features >= 5", "features",
                             prefix=prefix, source=source)
        if files and (self.positive_rate or self.label_noise):
            key = "positive_rate" if self.positive_rate else "label_noise"
            raise self.error("is for the built-in datasets; your shards bring their own labels", key, prefix=prefix,
                             source=source)
        if files and self.holdout:
            raise self.error("files: each device's held-out rows are its shard's eval/ directory "
                             "(fedtier data split --holdout)", "holdout", prefix=prefix, source=source)
        if self.dir is not None and not self.dir.is_dir():
            raise self.error(f"directory not found: {self.dir}", "dir", prefix=prefix, source=source)
        if self.eval_file is not None and not self.eval_file.is_file():
            raise self.error(f"file not found: {self.eval_file}", "eval_file", prefix=prefix, source=source)


@dataclass(frozen=True)
class TopologyConfig(Section):
    """Cells and their devices: generated (cells x devices_per_cell) or listed in ``members``."""

    cells: int = opt(2, min=1, max=26 * 26, help="Number of edge cells (named cell-a, cell-b, ...).")
    devices_per_cell: int = opt(6, min=1, help="Devices per cell (named dev-00, dev-01, ...).")
    members: dict[str, tuple[str, ...]] | None = opt(
        None, help="Explicit cell -> device ids; overrides cells/devices_per_cell.")
    trusted: dict[str, bool] | None = opt(
        None, help="Trust labels for differential privacy: server id -> true (its children may send it clear "
                   "models) or false. Undeclared servers are untrusted; a server with an untrusted child is "
                   "untrusted (closure); the cloud never is.")
    parents: dict[str, str] | None = opt(
        None, help="Server -> parent server, for aggregators between the cells and the cloud (deeper trees). "
                   "`fedtier privacy plan` resolves them; rollouts run device -> cell -> cloud.")
    roaming: bool = opt(False, help="A device may contribute through any cell of the rollout, wherever it is "
                                    "connected now (its ACL lets it into every cell; each device-step is counted "
                                    "once across cells). Asynchronous algorithms only (fedbuff).")

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        if self.members is not None:
            seen: set[str] = set()
            for cell, devices in self.members.items():
                try:
                    check_id(cell, "cell")
                    for d in devices:
                        check_id(d, "device")
                except Exception as exc:
                    raise self.error(str(exc), f"members.{cell}", prefix=prefix, source=source) from None
                if not devices:
                    raise self.error("a cell needs at least one device", f"members.{cell}",
                                     prefix=prefix, source=source)
                dup = seen & set(devices)
                if dup:
                    raise self.error(f"devices in two cells: {sorted(dup)}", f"members.{cell}",
                                     prefix=prefix, source=source)
                seen |= set(devices)

    def layout(self) -> dict[str, tuple[str, ...]]:
        """cell id -> device ids."""
        if self.members is not None:
            return {c: tuple(d) for c, d in self.members.items()}
        out: dict[str, tuple[str, ...]] = {}
        names = device_ids(self.cells * self.devices_per_cell)
        for c in range(self.cells):
            name = "cell-" + (chr(ord("a") + c) if self.cells <= 26 else f"{chr(ord('a') + c // 26)}"
                                                                           f"{chr(ord('a') + c % 26)}")
            out[name] = tuple(names[c * self.devices_per_cell:(c + 1) * self.devices_per_cell])
        return out


def device_ids(count: int) -> list[str]:
    """``dev-00``, ``dev-01``, ...: the ids a generated topology gives ``count`` devices, and the
    shard directories ``fedtier data split --devices count`` writes."""
    width = max(2, len(str(count - 1)))
    return [f"dev-{i:0{width}d}" for i in range(count)]


@dataclass(frozen=True)
class RoundSection(Section):
    """Settings every algorithm has (see ``fedtier.algorithms.common.RoundSettings``)."""

    batch_size: int = opt(32, min=1, help="Minibatch size.")
    lr: float = opt(0.05, min=0, help="SGD learning rate.")
    weighting: str = opt("uniform", choices=("uniform", "samples"),
                         help="Edge weights per device: 1 each (the papers' rule), or by sample count.")
    quorum: float = opt(1.0, gt=0, max=1, help="Share of members (and cells) enough after the deadline.")
    deadline_s: float = opt(60.0, gt=0, help="Seconds before a round (or step) may close with a quorum.")

    def common(self, seed: int) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "lr": self.lr, "weighting": self.weighting, "quorum": self.quorum,
                "deadline_s": self.deadline_s, "seed": seed}


@dataclass(frozen=True)
class QuantizedSection(RoundSection):
    """Settings of the algorithms with quantized uploads."""

    bits_device: int = opt(4, min=0, max=8, check=_bits, help="Q1: QSGD bits of device uploads (0 = float32).")
    bits_edge: int = opt(8, min=0, max=8, check=_bits, help="Q2: QSGD bits of the edge's upload (0 = float32).")

    def common(self, seed: int) -> dict[str, Any]:
        return {**RoundSection.common(self, seed), "bits_device": self.bits_device, "bits_edge": self.bits_edge}


@dataclass(frozen=True)
class FedAvgSection(RoundSection):
    """Hierarchical FedAvg settings (see fedtier.algorithms.fedavg)."""

    local_steps: int = opt(10, min=1, help="SGD steps per device per edge round.")
    edge_rounds: int = opt(1, min=1, help="Edge aggregations per global round (HIST's baseline HFedAvg uses E/H).")
    proximal_mu: float = opt(0.0, min=0, help="FedProx: adds (mu/2) ||w - w_global||^2 to each device's loss in the "
                                              "training graph (0 = plain FedAvg, today's graphs; ort trainers only).")
    partial_work: bool = opt(False, help="Devices run a seeded number of local steps in 1..local_steps each round, as "
                                         "slow boards would, and still send their update (FedProx's partial work).")

    secure_aggregation: bool = opt(False, help="SecAgg+ in every cell: the edge learns only its cell's sum, never "
                                                "a device's update (docs/secure_aggregation.md).")
    secagg_min_survivors: int = opt(2, min=1, help="Secure aggregation: the fewest devices a cell's sum may contain; "
                                                   "a cell's round with fewer aborts.")
    secagg_degree: int = opt(8, min=2, help="Secure aggregation: neighbours per device in the sharing graph (the "
                                            "complete graph in smaller cells).")
    secagg_threshold: float = opt(0.6, gt=0.5, max=1, help="Secure aggregation: share of a device's share holders "
                                                            "(its neighbours in the round) needed to rebuild its "
                                                            "secrets (a strict majority).")
    secagg_bits: int = opt(48, min=16, max=62, help="Secure aggregation: updates are encoded in the ring of "
                                                    "integers modulo 2^bits.")
    secagg_clip: float = opt(10.0, gt=0, help="Secure aggregation: L2 bound each device's update is clipped to "
                                              "before encoding.")
    secagg_phases: tuple[float, ...] = opt(PHASE_SHARES, help="Secure aggregation: each phase's share of "
                                           "deadline_s (keys, training included; shares; masked; reveal), counted "
                                           f"from the cell's task and cumulated; > 0 each, <= {MAX_PHASES_SHARE} "
                                           "together (the rest carries the cell's update to the cloud in time).")

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        if self.secure_aggregation and self.edge_rounds != 1:
            raise self.error("secure aggregation runs one edge round per global round", "edge_rounds",
                             prefix=prefix, source=source)
        if self.secure_aggregation and self.weighting != "uniform":
            raise self.error("secure aggregation needs uniform weights: the edge sees only the cell's sum",
                             "weighting", prefix=prefix, source=source)
        try:
            check_phase_shares(self.secagg_phases)
        except LocalProtocolError as exc:
            raise self.error(str(exc), "secagg_phases", prefix=prefix, source=source) from None

    def algorithm_config(self, seed: int) -> FedAvgConfig:
        if self.secure_aggregation:
            return SecureFedAvgConfig(local_steps=self.local_steps, edge_rounds=self.edge_rounds,
                                      partial_work=self.partial_work, secagg_min_survivors=self.secagg_min_survivors,
                                      secagg_degree=self.secagg_degree, secagg_threshold=self.secagg_threshold,
                                      secagg_bits=self.secagg_bits, secagg_clip=self.secagg_clip,
                                      secagg_phases=self.secagg_phases,
                                      **self.common(seed))
        return FedAvgConfig(local_steps=self.local_steps, edge_rounds=self.edge_rounds, partial_work=self.partial_work,
                            **self.common(seed))


@dataclass(frozen=True)
class HierQsgdSection(QuantizedSection):
    """Hier-Local-QSGD (the QHetFed paper's baseline): tau edge rounds of gamma local steps."""

    local_steps: int = opt(3, min=1, help="gamma: SGD steps per device per edge round.")
    edge_rounds: int = opt(12, min=1, help="tau: edge aggregations per global round.")
    proximal_mu: float = opt(0.0, min=0, help="FedProx: (mu/2) ||w - w_set||^2 in each device's loss, w_set the model "
                                              "its edge round started from (0 = off; ort trainers only).")
    partial_work: bool = opt(False, help="Devices run a seeded number of local steps in 1..local_steps per edge "
                                         "round and still send their update.")

    def algorithm_config(self, seed: int) -> HierConfig:
        return HierConfig(local_steps=self.local_steps, edge_rounds=self.edge_rounds, partial_work=self.partial_work,
                          **self.common(seed))


@dataclass(frozen=True)
class FedBuffSection(RoundSection):
    """Hierarchical FedBuff (buffered asynchronous aggregation; see fedtier.algorithms.fedbuff)."""

    local_steps: int = opt(10, min=1, help="SGD steps per local training.")
    k_edge: int = opt(4, min=1, help="Deltas an edge folds into one cell update (FedBuff's K at the edge).")
    edge_timeout_s: float = opt(0.0, min=0, help="An edge sends a partial buffer this many seconds after its first "
                                                 "delta (0 = only every k_edge deltas).")
    k_cloud: int = opt(2, min=1, help="Cell updates the cloud folds into one new model version (K at the cloud).")
    max_staleness: int = opt(20, min=0, help="Versions a delta or a cell update may lag the newest model; older ones "
                                             "are rejected (counted by reason).")
    staleness_weight: str = opt("polynomial", choices=STALENESS_WEIGHTS,
                                help="How a cell update of staleness s is weighted: polynomial, (1 + s)^-a; or "
                                     "constant, 1.")
    staleness_exponent: float = opt(0.5, min=0, help="a of the polynomial staleness weight (0.5: 1/sqrt(1 + s)).")
    once_per_version: bool = opt(False, help="A device trains from each model version at most once, then waits for "
                                             "the next (with k_edge = devices per cell and k_cloud = cells every "
                                             "version averages every device once, in any arrival order).")
    secure_aggregation: bool = opt(False, help="Refused: SecAgg+ needs a cohort that agrees keys before it trains; "
                                               "an asynchronous buffer has none (docs/configuration.md).")

    REFUSES_SECURE_AGGREGATION: ClassVar[str] = (
        "fedbuff cannot run secure aggregation: SecAgg+ masks cancel only over a cohort that agreed its keys before "
        "training, and a buffer of K deltas from devices that started at different model versions, at different "
        "times, is no such cohort; use fedavg with secure_aggregation, or fedbuff with a trusted edge")

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        if self.secure_aggregation:
            raise self.error(self.REFUSES_SECURE_AGGREGATION, "secure_aggregation", prefix=prefix, source=source)

    def algorithm_config(self, seed: int) -> FedBuffConfig:
        return FedBuffConfig(local_steps=self.local_steps, k_edge=self.k_edge, edge_timeout_s=self.edge_timeout_s,
                             k_cloud=self.k_cloud, max_staleness=self.max_staleness,
                             staleness_weight=self.staleness_weight, staleness_exponent=self.staleness_exponent,
                             once_per_version=self.once_per_version, **self.common(seed))


@dataclass(frozen=True)
class FleetSection(Section):
    """When devices are online and how fast they train (fedtier.rollout.availability; fedtier simulate)."""

    availability: str = opt("always", choices=AVAILABILITY_MODES,
                            help="always (every device online), diurnal (one window a day per device, share_online "
                                 "of the day long, at a seeded phase) or file (windows from trace_file).")
    share_online: float = opt(1.0, gt=0, max=1, help="diurnal: the share of the day each device is online, so the "
                                                     "share of the fleet online at any time.")
    day_s: float = opt(86_400.0, gt=0, help="diurnal: the period of the windows, seconds.")
    compute_s: float = opt(60.0, gt=0, help="Virtual seconds the median device takes for one local training.")
    speed_sigma: float = opt(1.0, min=0, help="Heavy-tailed speeds: a device's training takes compute_s * "
                                              "exp(sigma g), g ~ N(0, 1) drawn once per device (0 = all equally "
                                              "fast).")
    trace_file: Path | None = opt(None, help="file: JSON {\"period_s\": optional, \"devices\": {id: {\"windows\": "
                                             "[[start, end], ...], \"speed\": optional}}}.")

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        if self.availability == "file" and self.trace_file is None:
            raise self.error("availability = 'file' reads the windows from trace_file: set it", "trace_file",
                             prefix=prefix, source=source)
        if self.availability == "always" and self.share_online != 1.0:
            raise self.error("share_online is the diurnal share; with availability = 'always' every device is "
                             "online (set availability = 'diurnal')", "share_online", prefix=prefix, source=source)
        if self.availability == "file" and self.trace_file is not None and not Path(self.trace_file).is_file():
            raise self.error(f"no such file {self.trace_file}", "trace_file", prefix=prefix, source=source)

    def spec(self) -> AvailabilitySpec:
        return AvailabilitySpec(availability=self.availability, share_online=self.share_online, day_s=self.day_s,
                                compute_s=self.compute_s, speed_sigma=self.speed_sigma, trace_file=self.trace_file)


@dataclass(frozen=True)
class PlanSection(Section):
    """Choose QHetFed's (tau, gamma) from a per-round time budget (Sec. IV of "A Hierarchical Federated
    Learning Approach for the Internet of Things").

    Rollouts use the robust integer planner; the paper's closed form (``fedtier plan qhetfed
    --mode paper``) can answer gamma < 1 and is for reproduction only.
    """

    t_cp: float = opt(help="Seconds for one local gradient step on a device.", gt=0)
    t_de: float = opt(help="Seconds for one device -> edge upload.", gt=0)
    t_ec: float = opt(help="Seconds for one edge -> cloud upload.", gt=0)
    round_budget_s: float = opt(help="Time budget of one global round, seconds.", gt=0)
    uploads: str = opt("tau", choices=("tau", "tau+1"), help="Device uploads charged per round (the paper: tau).")
    q1: float = opt(0.0, min=0, help="q1 for the first round; later rounds use the q1 devices measured.")
    replan: bool = opt(True, help="Re-plan every round from the measured q1.")


@dataclass(frozen=True)
class QHetFedSection(QuantizedSection):
    """QHetFed ("A Hierarchical Federated Learning Approach for the Internet of Things"): tau gradient
    aggregations in each set, then gamma local steps."""

    tau: int = opt(12, min=0, help="Intra-set gradient-aggregation iterations per global round.")
    gamma: int = opt(3, min=1, help="Local SGD steps before the model aggregation.")
    plan: PlanSection | None = opt(None, help="If set, (tau, gamma) come from the deadline planner.")

    def algorithm_config(self, seed: int, tau: int | None = None, gamma: int | None = None) -> QHetFedConfig:
        return QHetFedConfig(tau=self.tau if tau is None else tau, gamma=self.gamma if gamma is None else gamma,
                             **self.common(seed))


@dataclass(frozen=True)
class HistSection(QuantizedSection):
    """HIST ("Submodel Partitioning in Hierarchical Federated Learning"): each cell trains a disjoint
    submodel (its share of the hidden neurons)."""

    local_steps: int = opt(40, min=1, help="H: local SGD steps between edge aggregations.")
    edge_rounds: int = opt(5, min=1, help="E/H: edge aggregations per global round.")
    bits_device: int = opt(0, min=0, max=8, check=_bits, help="Q1: QSGD bits of device uploads (0 = float32).")
    bits_edge: int = opt(0, min=0, max=8, check=_bits, help="Q2: QSGD bits of the edge's upload (0 = float32).")

    def algorithm_config(self, seed: int) -> HistConfig:
        return HistConfig(local_steps=self.local_steps, edge_rounds=self.edge_rounds, **self.common(seed))


def _unit_interval(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1]; got {value!r}")


@dataclass(frozen=True)
class FedXLSection(RoundSection):
    """FeDXL ("FeDXL: Provable Federated Learning for Deep X-Risk Optimization"): AUROC or partial AUROC
    trained with pairs across devices; devices share scores, never data (see fedtier.algorithms.fedxl).

    Needs a binary task (labels 0 and 1, 1 the positive class). The model is built with one output,
    its score, and trained through a weighted sum of scores. Round 0 collects the first pool of scores;
    training starts in round 1.
    """

    objective: str = opt("auroc", choices=("auroc", "pauc", "psm"),
                         help="auroc: FeDXL1, the pairwise squared hinge (AUROC); psm: FeDXL1, the pairwise sigmoid "
                              "loss (AUROC, robust to corrupted labels: the paper's Table 3); pauc: FeDXL2, KL-OPAUC "
                              "(one-way partial AUROC) with moving averages u (each positive's starts at 1) and "
                              "momentum.")
    batch_size: int = opt(32, min=1, help="B1: positives drawn per local step.")
    batch_neg: int = opt(0, min=0, help="B2: negatives drawn per local step (0 = batch_size).")
    local_steps: int = opt(32, min=1, help="K: local steps per round (the communication interval).")
    lr: float = opt(0.1, min=0, help="Learning rate.")
    margin: float = opt(1.0, gt=0, help="m of the pairwise hinge (m - score_pos + score_neg)_+ on sigmoid scores.")
    lam: float = opt(1.0, gt=0, help="pauc: lambda of KL-OPAUC (smaller focuses on the highest-scored negatives).")
    gamma: float = opt(0.1, check=_unit_interval, help="pauc: moving-average rate of each positive's u, in (0, 1].")
    beta: float = opt(0.1, check=_unit_interval,
                      help="pauc: momentum rate, G <- (1 - beta) G + beta g, in (0, 1] (1 = none).")
    pairs: str = opt("global", choices=("global", "local"),
                     help="global: pairs across devices through the shared scores (FeDXL); local: each device pairs "
                          "its own rows only (the paper's Local Pair baseline; no scores are shared).")
    upload_scores: int = opt(0, min=0, help="Scores of each class a device uploads per round: a random subset of the "
                                            "K x B it computed (0 = all).")
    participation: float = opt(1.0, check=_unit_interval,
                               help="Share of devices sampled for each training round (partial participation); "
                                    "1 = every device.")
    lr_schedule: str = opt("constant", choices=LR_SCHEDULES,
                           help="constant: lr throughout; step: lr times lr_decay_factor every lr_decay_every local "
                                "iterations, counted from the first training round (with the defaults the paper's: "
                                "a tenth every 5,000).")
    lr_decay_every: int = opt(5000, min=1, help="step: local iterations between two decays (the paper: 5,000).")
    lr_decay_factor: float = opt(0.1, gt=0, max=1, help="step: the decay's factor (the paper: 0.1).")

    def algorithm_config(self, seed: int) -> FedXLConfig:
        return FedXLConfig(objective=self.objective, local_steps=self.local_steps, batch_neg=self.batch_neg,
                           margin=self.margin, lam=self.lam, gamma=self.gamma, beta=self.beta, pairs=self.pairs,
                           upload_scores=self.upload_scores, participation=self.participation,
                           lr_schedule=self.lr_schedule, lr_decay_every=self.lr_decay_every,
                           lr_decay_factor=self.lr_decay_factor, **self.common(seed))


def _embedding_bits(value: int) -> None:
    if value != 32 and not 2 <= value <= 8:
        raise ValueError(f"must be 32 (float32, the paper's HSGD) or a QSGD width 2..8 (C-HSGD: 7); got {value!r}")


@dataclass(frozen=True)
class HsgdSection(RoundSection):
    """HSGD ("Communication-Efficient Hybrid Federated Learning for E-health with Horizontal and Vertical
    Data Partitioning"): every cell has a feature party, its *host* (`fedtier agent run` with role =
    "host"), holding the first ``host_features`` columns of every sample of the cell; each device holds the
    other columns of its one sample. They train a split model (two encoders and a head) by exchanging
    embeddings through the edge, never raw data (docs/hsgd.md).

    The model is HSGD's own (``[model]`` is not used): a ReLU encoder of width ``embed_host`` on the host's
    block, one of width ``embed_device`` on the devices', and a linear head over both.
    """

    global_interval: int = opt(2, min=1, help="P: iterations per cloud round (a multiple of local_interval).")
    local_interval: int = opt(2, min=1, help="Q: iterations per local interval, between two embedding exchanges.")
    alpha: float = opt(0.2, check=_unit_interval, help="Share of a cell's devices selected each interval, in (0, 1].")
    bits_embedding: int = opt(32, check=_embedding_bits,
                              help="Compression level of the vertical path (embeddings and the head) on every hop, "
                                   "the edge's relays included: 2..8, or 32 = float32 (the paper's HSGD). qsgd: the "
                                   "QSGD width; topk: each row keeps bits_embedding/32 of its entries (the paper's "
                                   "C-HSGD: 7).")
    compressor: str = opt("qsgd", choices=("qsgd", "topk"),
                          help="How bits_embedding < 32 compresses: qsgd, QSGD row by row scaled by each row's largest "
                               "magnitude (this project's substitute); topk, top-k sparsification row by row (the "
                               "paper's C-HSGD).")
    lr_schedule: str = opt("constant", choices=LR_SCHEDULES,
                           help="constant: lr throughout; step: lr times lr_decay_factor every lr_decay_every "
                                "iterations (the paper halves it every T0).")
    lr_decay_every: int = opt(0, min=0, help="step: iterations between two decays, the paper's T0 (it gives no value); "
                                             "a multiple of local_interval.")
    lr_decay_factor: float = opt(0.5, gt=0, max=1, help="step: the decay's factor (the paper: 0.5).")
    host_features: int = opt(0, min=0, help="The host's block X1: the dataset's first host_features columns (0 = two "
                                            "thirds of them); the devices hold the rest. Needed with dataset = "
                                            "'files'.")
    device_features: int = opt(0, min=0, help="dataset = 'files': the width of a device's block X2 (built-in "
                                              "datasets: the columns the host does not take).")
    classes: int = opt(0, min=0, help="dataset = 'files': the number of classes (0 = from eval_file's labels).")
    embed_host: int = opt(8, min=1, help="d1: width of the host's embedding.")
    embed_device: int = opt(8, min=1, help="d2: width of a device's embedding.")
    hosts: dict[str, str] | None = opt(None, help="Cell -> its host's node id (default '<cell>-host').")

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        if self.global_interval % self.local_interval:
            raise self.error(f"global_interval P = {self.global_interval} must be a multiple of local_interval "
                             f"Q = {self.local_interval}", "global_interval", prefix=prefix, source=source)
        if self.lr_schedule == "step" and (self.lr_decay_every < 1 or self.lr_decay_every % self.local_interval):
            raise self.error(f"lr_schedule = 'step' needs lr_decay_every (the paper's T0) >= 1 and a multiple of "
                             f"local_interval Q = {self.local_interval}; got {self.lr_decay_every}", "lr_decay_every",
                             prefix=prefix, source=source)
        for cell, host in (self.hosts or {}).items():
            try:
                check_id(host, "host")
            except Exception as exc:
                raise self.error(str(exc), f"hosts.{cell}", prefix=prefix, source=source) from None

    def host_of(self, cell: str) -> str:
        return (self.hosts or {}).get(cell, f"{cell}-host")

    def split_columns(self, features: int) -> int:
        """How many of ``features`` columns the host holds."""
        return self.host_features or max(1, round(2 * features / 3))

    def algorithm_config(self, seed: int, hosts: Mapping[str, str] | None = None) -> HsgdConfig:
        return HsgdConfig(global_interval=self.global_interval, local_interval=self.local_interval, alpha=self.alpha,
                          bits_embedding=self.bits_embedding, compressor=self.compressor,
                          lr_schedule=self.lr_schedule, lr_decay_every=self.lr_decay_every,
                          lr_decay_factor=self.lr_decay_factor, hosts=dict(hosts or {}), **self.common(seed))


def _open_unit(value: float) -> None:
    if not 0 < value < 1:
        raise ValueError(f"must be in (0, 1); got {value!r}")


@dataclass(frozen=True)
class PrivacySection(Section):
    """Differential privacy with trust labels (M2FDP, "Differentially-Private Multi-Tier Federated
    Learning"; see docs/privacy.md).

    Every upload is clipped to ``clip``; devices under untrusted edges add Gaussian noise, trusted
    edges add it when they forward to the cloud. ``rdp`` calibration solves the noise multiplier
    for (epsilon, delta) over the real number of releases with an RDP accountant; ``paper`` uses
    the paper's closed form (eq. 11) and is for reproductions only. Either way the coordinator's
    ledger reports each device's epsilon from the RDP accountant and stops the rollout before
    any device would exceed ``budget_epsilon``.
    """

    epsilon: float = opt(help="Target epsilon per device over the whole rollout.", gt=0)
    clip: float = opt(help="C: L2 bound on each released model delta (the change since the last public model).",
                      gt=0)
    delta: float = opt(1e-5, check=_open_unit, help="Target delta, in (0, 1).")
    calibration: str = opt("rdp", choices=("rdp", "paper"),
                           help="rdp: noise from an RDP accountant (sound); paper: eq. (11) closed form.")
    alpha: float = opt(1.0, gt=0, help="paper: the constant alpha of eq. (11), which the paper does not give.")
    sampling_rate: float | None = opt(None, gt=0, max=1,
                                      help="paper: q of eq. (11); default batch_size / smallest device's samples.")
    budget_epsilon: float | None = opt(None, gt=0, help="Stop before any device's epsilon would exceed this "
                                                        "(default: epsilon; inf: never stop).")
    require_tls: bool = opt(True, help="Refuse to send clear (un-noised) updates over a connection without TLS.")
    noise_seed: int | None = opt(None, help="Simulation only: seed the noise for reproducible experiments. Anyone "
                                           "with the seed can remove the noise; `coordinator run` refuses it.")
    accountant: str = opt("rdp", choices=("rdp", "pld"),
                          help="Accountant that calibrates the noise and keeps the ledger (both dp-accounting's): rdp, "
                               "or pld (privacy loss distributions: tighter, slower). `privacy report` shows both.")
    device_sampling: str = opt("none", choices=("none", "poisson", "fixed"),
                               help="Sample devices each round: poisson (each device with probability sample_rate; "
                                    "trusted edges sample in secret and release a fixed-denominator sum, so their "
                                    "noise is amplified) or fixed (round(sample_rate x members) per trusted cell; RDP "
                                    "only). Device releases under untrusted edges get no amplification "
                                    "(docs/privacy.md).")
    sample_rate: float | None = opt(None, gt=0, max=1, help="q: the per-round device sampling rate (device_sampling).")
    secure_noise: bool = opt(False, help="Draw noise from the OS CSPRNG as a sum of Gaussians resistant to "
                                         "floating-point attacks (slower: docs/benchmarks.md).")
    adaptive_clip: bool = opt(False, help="Adaptive clipping (Andrew et al. 2021): clip is only the first round's C; "
                                          "the cloud moves C every round towards the clip_quantile of the update "
                                          "norms from a noised count, its cost on the ledger. Needs "
                                          "device_sampling = 'poisson' (docs/privacy.md).")
    clip_quantile: float = opt(0.5, check=_open_unit, help="Adaptive clipping: the share of updates meant to fit "
                                                            "C, in (0, 1).")
    clip_lr: float = opt(0.2, gt=0, help="Adaptive clipping: eta_C of C <- C exp(-eta_C (unclipped share - "
                                         "clip_quantile)).")
    clip_count_share: float = opt(0.05, check=_open_unit,
                                  help="Adaptive clipping: the share of each release's privacy (in z^-2) spent on its "
                                       "clipped count; the update's noise grows by 1/sqrt(1 - share).")

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        if self.device_sampling != "none" and self.sample_rate is None:
            raise self.error(f"device_sampling = {self.device_sampling!r} needs sample_rate (q in (0, 1])",
                             "sample_rate", prefix=prefix, source=source)
        if self.device_sampling == "none" and self.sample_rate is not None:
            raise self.error("sample_rate is set but device_sampling is 'none'", "sample_rate",
                             prefix=prefix, source=source)
        if self.device_sampling == "fixed" and self.accountant == "pld":
            raise self.error("fixed-size sampling is accounted by RDP only (dp-accounting's PLD has no "
                             "sampling-without-replacement event): use accountant = 'rdp' or device_sampling = "
                             "'poisson'", "accountant", prefix=prefix, source=source)
        if self.adaptive_clip and self.device_sampling != "poisson":
            raise self.error("adaptive clipping counts unclipped updates over a Poisson sample of devices "
                             "(add/remove adjacency): set device_sampling = 'poisson' and sample_rate",
                             "adaptive_clip", prefix=prefix, source=source)
        if self.device_sampling != "none" and self.calibration == "paper":
            raise self.error("device sampling needs sound calibration (calibration = 'rdp'); paper mode is a "
                             "reproduction that misapplies amplification", "device_sampling",
                             prefix=prefix, source=source)


def _rule(value: str) -> None:
    if value not in strategies.RULES and not strategies.is_custom(value):
        raise ValueError(f"must be one of {', '.join(map(repr, strategies.RULES))} or 'package.module:Class'; "
                         f"got {value!r}")


def _below_half(value: float) -> None:
    if not 0 <= value < 0.5:
        raise ValueError(f"must be in [0, 0.5); got {value!r}")


@dataclass(frozen=True)
class AggregationSection(Section):
    """How each tier combines its children's updates (fedtier.algorithms.strategies; docs/strategies.md).

    ``mean`` is the weighted mean every tier used before rules existed. The others read each update:
    coordinate-wise median and trimmed mean, Krum and Multi-Krum (Blanchard et al. 2017), and a
    mean of updates clipped to ``max_norm``. The parameters below are shared by both tiers.
    """

    edge: str = opt("mean", check=_rule,
                    help="Edge rule over its devices' model changes: mean, median, trimmed_mean, krum, multi_krum, "
                         "norm_bounded_mean, or your own 'package.module:Class'.")
    cloud: str = opt("mean", check=_rule, help="Cloud rule over the cells' changes (the same choices; hist: mean).")
    trim: float = opt(0.1, check=_below_half, help="trimmed_mean: share of updates dropped at each end, in [0, 0.5).")
    byzantine: int = opt(1, min=0, help="krum, multi_krum: f, the faulty children tolerated (needs n > 2f + 2).")
    select: int = opt(1, min=1, help="multi_krum: m, how many of the best-scored updates are averaged.")
    max_norm: float = opt(1.0, gt=0, help="norm_bounded_mean: each update is scaled to at most this L2 norm.")
    edge_options: dict[str, float] | None = opt(None, help="Your own edge rule: keyword arguments of its class.")
    cloud_options: dict[str, float] | None = opt(None, help="Your own cloud rule: keyword arguments of its class.")

    def spec(self, tier: str) -> dict[str, Any]:
        """The tier's spec as a task carries it (``fedtier.algorithms.strategies.AggregatorSpec``)."""
        rule = getattr(self, tier)
        out: dict[str, Any] = {"rule": rule, "trim": self.trim, "byzantine": self.byzantine, "select": self.select,
                               "max_norm": self.max_norm}
        options = getattr(self, f"{tier}_options")
        if options:
            out["options"] = dict(options)
        return out


@dataclass(frozen=True)
class ServerOptimizerSection(Section):
    """The cloud's step on the aggregated change, used as a pseudo-gradient (Reddi et al., "Adaptive
    Federated Optimization", ICLR 2021, Algorithm 2; fedtier.algorithms.server_opt).

    Its state (momentum, second moments) is kept in the coordinator's store with every model version.
    """

    kind: str = opt("sgd", choices=("sgd", "momentum", "adam", "yogi", "adagrad"),
                    help="sgd (lr = 1: FedAvg), momentum (FedAvgM), adam, yogi or adagrad.")
    lr: float | None = opt(None, gt=0, help="Server learning rate eta (default 1 for sgd and momentum, 0.01 for the "
                                            "adaptive kinds).")
    momentum: float = opt(0.9, min=0, max=0.999, help="momentum: mu.")
    beta1: float = opt(0.9, min=0, max=0.999, help="adam, yogi, adagrad: first-moment rate beta1.")
    beta2: float = opt(0.99, min=0, max=0.999, help="adam, yogi: second-moment rate beta2.")
    tau: float = opt(1e-3, gt=0, help="adam, yogi, adagrad: adaptivity tau (v starts at tau^2).")

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "momentum": self.momentum, "beta1": self.beta1,
                               "beta2": self.beta2, "tau": self.tau}
        if self.lr is not None:
            out["lr"] = self.lr
        return out


def choose_attackers(devices: Sequence[str], fraction: float, seed: int) -> list[str]:
    """``round(fraction * N)`` devices drawn without replacement from stream ``(seed, "attack")``, sorted."""
    if not 0 <= fraction <= 1:
        raise LocalProtocolError(f"attack fraction must be in [0, 1], got {fraction!r}")
    pool = sorted(devices)
    count = int(round(fraction * len(pool)))
    if count == 0:
        return []
    picks = stream(seed, "attack").choice(len(pool), size=count, replace=False)
    return sorted(pool[int(i)] for i in picks)


@dataclass(frozen=True)
class AttackSection(Section):
    """Attacks, for testing robustness (device_agent.attack): a seeded share of the devices lies about its update.

    Only `fedtier simulate` and `fedtier demo` make devices attack; every output of such a run says
    it is an attack run. Never active unless this section is present.
    """

    kind: str = opt(help="sign_flip (sends -scale x its update), gaussian (sends N(0, scale^2) noise), label_flip "
                         "(trains on labels classes-1-y) or stale_replay (resends its first update every round).",
                    choices=("sign_flip", "gaussian", "label_flip", "stale_replay"))
    fraction: float = opt(0.2, min=0, max=1, help="Share of the devices that attack, chosen from the rollout seed.")
    scale: float = opt(10.0, gt=0, help="sign_flip: the factor; gaussian: the noise's standard deviation.")

    def describe(self) -> str:
        scale = "" if self.kind in ("label_flip", "stale_replay") else f", scale {self.scale:g}"
        return f"ATTACK RUN: {self.kind}{scale} on {self.fraction:.0%} of the devices"


SIMULATION_TRAINERS = ("ort", "portable")
"""The device backends ``fedtier simulate`` can run (``device_agent.trainers``): both train user models."""


@dataclass(frozen=True)
class SimulationConfig(Section):
    """In-process simulation knobs."""

    threads: int = opt(1, min=1, help="onnxruntime intra-op threads of the shared session.")
    max_payload: int = opt(0, min=0, help="Chunk messages above this many bytes (0 = no limit), "
                                          "to exercise chunking as a broker limit would.")
    train_objective: bool = opt(False, help="Also report the device-uniform training objective (1/N) sum_n F_n(w) "
                                            "every round (the simulator holds every device's data).")
    trainer: str = opt("ort", choices=SIMULATION_TRAINERS,
                       help="The simulated devices' training backend: ort (onnxruntime-training) or portable (the "
                            "bundle's portable graph with numpy SGD, as a board without onnxruntime-training trains; "
                            "same weights to float rounding). The coordinator's own evaluation uses ort either way.")

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        if self.max_payload and self.max_payload < 4096:
            raise self.error("must be 0 or at least 4096 (manifests are not chunked)", "max_payload",
                             prefix=prefix, source=source)


STORE_FILE = "coordinator.db"
"""The coordinator's SQLite store in its ``state_dir`` when ``store`` is not set."""


def store_url(state_dir: Path | str, store: str | None = None) -> str:
    """The URL of a coordinator's store: ``store`` if given, else SQLite in ``state_dir``."""
    if store:
        return store
    return "sqlite:///" + str(Path(state_dir).resolve() / STORE_FILE)


def store_url_check(value: str) -> None:
    """Validator: a store URL fedtier can open (``cloud_coordinator.store_backend`` opens it)."""
    if not value.startswith(("sqlite:///", "postgresql://", "postgresql+psycopg://")):
        raise ValueError(f"{value!r} is not sqlite:///PATH or postgresql://USER@HOST:PORT/DB")


@dataclass(frozen=True)
class RolloutConfig(Section):
    """A training campaign (``fedtier coordinator run``, ``fedtier simulate``)."""

    rollout: str = opt("default", check=node_id, help="Rollout id (appears in every topic).")
    algorithm: str = opt("fedavg", choices=algorithms.names(),
                         help="Algorithm: fedavg, hier_qsgd, qhetfed, hist, fedxl, hsgd or fedbuff.")
    rounds: int = opt(20, min=1, help="Global rounds.")
    seed: int = opt(0, help="Rollout seed: names every RNG stream (minibatches, ...).")
    state_dir: Path = opt(Path("fedtier-state"), help="Coordinator state: SQLite database and artifact store.")
    store: str | None = opt(None, check=store_url_check,
                            help="The coordinator's store: sqlite:///PATH (a relative PATH is relative to this "
                                 "file) or postgresql://USER@HOST:PORT/DB (default sqlite:///<state_dir>/"
                                 "coordinator.db; docs/deployment.md).")
    metrics_file: Path | None = opt(None, help="Per-round metrics JSON (default <state_dir>/metrics.json).")
    cloud_id: str = opt("cloud", check=node_id, help="The coordinator's node id.")
    artifact_store: Path | None = opt(None, help="Content-addressed artifact store (default <state_dir>/artifacts).")
    log_level: str = opt("info", choices=LOG_LEVELS, help="Logging level.")
    metrics_port: int = opt(0, min=0, max=65535, help="Serve Prometheus /metrics on this port; 0 = off.")
    signing_key: Path | None = opt(None, help="Ed25519 private key (PEM) that signs every rollout manifest "
                                              "(from fedtier provision init); unset = unsigned manifests.")
    manifest_valid_days: float = opt(30.0, gt=0, help="Manifests expire this many days after they are issued.")
    model: ModelConfig = opt(default_factory=ModelConfig, help="Model.")
    data: DataConfig = opt(default_factory=DataConfig, help="Data.")
    topology: TopologyConfig = opt(default_factory=TopologyConfig, help="Cells and devices.")
    fedavg: FedAvgSection = opt(default_factory=FedAvgSection, help="FedAvg settings.")
    hier_qsgd: HierQsgdSection = opt(default_factory=HierQsgdSection, help="Hier-Local-QSGD settings.")
    qhetfed: QHetFedSection = opt(default_factory=QHetFedSection, help="QHetFed settings.")
    hist: HistSection = opt(default_factory=HistSection, help="HIST settings.")
    fedxl: FedXLSection = opt(default_factory=FedXLSection, help="FeDXL settings.")
    hsgd: HsgdSection = opt(default_factory=HsgdSection, help="HSGD settings (a host per cell; docs/hsgd.md).")
    fedbuff: FedBuffSection = opt(default_factory=FedBuffSection, help="FedBuff settings (asynchronous, buffered).")
    fleet: FleetSection | None = opt(None, help="Device availability and speed on a virtual clock (fedtier simulate "
                                                "runs the trace simulator when set; absent: every device online, "
                                                "training takes no time).")
    broker: BrokerConfig = opt(default_factory=BrokerConfig, help="Cloud broker (coordinator run).")
    simulation: SimulationConfig = opt(default_factory=SimulationConfig, help="Simulator knobs.")
    privacy: PrivacySection | None = opt(None, help="Differential privacy (off when absent).")
    aggregation: AggregationSection | None = opt(None, help="Per-tier aggregation rules (weighted means when "
                                                            "absent).")
    server_optimizer: ServerOptimizerSection | None = opt(None, help="The cloud's server optimizer (w + delta when "
                                                                     "absent).")
    edge_optimizer: ServerOptimizerSection | None = opt(None, help="The same rules at each edge, on its cell's change "
                                                                   "(state in the edge's store; fedavg, hier_qsgd, "
                                                                   "qhetfed; none when absent).")
    attack: AttackSection | None = opt(None, help="Attacking devices, for robustness tests (simulate and demo only; "
                                                  "none when absent).")

    @classmethod
    def rebase_strings(cls, data: Mapping[str, Any], base_dir: Path) -> Mapping[str, Any]:
        # A SQLite store named by a relative path is relative to the config file, like every path in it.
        store = data.get("store")
        prefix = "sqlite:///"
        if isinstance(store, str) and store.startswith(prefix):
            path = store[len(prefix):]
            if path and path != ":memory:" and not Path(path).expanduser().is_absolute():
                return {**data, "store": prefix + os.path.normpath(base_dir / Path(path).expanduser())}
        return data

    @property
    def store_location(self) -> str:
        """The store's URL: ``store``, else SQLite in ``state_dir``."""
        return store_url(self.state_dir, self.store)

    @property
    def metrics_path(self) -> Path:
        return self.metrics_file if self.metrics_file is not None else self.state_dir / "metrics.json"

    @property
    def artifacts_path(self) -> Path:
        return self.artifact_store if self.artifact_store is not None else self.state_dir / "artifacts"

    @property
    def traits(self) -> algorithms.Algorithm:
        """What the configured algorithm is (``fedtier.algorithms.describe``): the checks and the coordinator
        ask it rather than compare names."""
        return algorithms.describe(self.algorithm)

    @property
    def section(self) -> RoundSection:
        """The configured algorithm's own section (``[fedavg]``, ``[hist]``, ...), named after it."""
        section: RoundSection = getattr(self, self.algorithm)
        return section

    def check(self, *, prefix: str = "", source: str | None = None) -> None:
        """Constraints across sections, one step per concern, in the order their errors are reported."""
        self._check_model(prefix=prefix, source=source)
        if self.topology.roaming and not self.traits.asynchronous:
            raise self.error(f"{self.algorithm} fixes a round's members when the round opens (its edges wait for "
                             "them, by quorum and deadline), so a device cannot move to another cell mid-rollout; "
                             f"roaming needs an asynchronous algorithm ({', '.join(algorithms.names('asynchronous'))})"
                             " or roaming = false", "topology.roaming", prefix=prefix, source=source)
        self._check_trust(prefix=prefix, source=source)
        if self.traits.split_model:
            self._check_hsgd(prefix=prefix, source=source)
        self._check_loss(prefix=prefix, source=source)
        if self.privacy is not None:
            self._check_privacy(self.privacy, prefix=prefix, source=source)
        self._check_strategy(prefix=prefix, source=source)
        self._check_training(prefix=prefix, source=source)
        if self.traits.secure_aggregation and getattr(self.section, "secure_aggregation", False):
            self._check_secure_aggregation(prefix=prefix, source=source)
        self._check_plan(prefix=prefix, source=source)

    def _check_model(self, *, prefix: str, source: str | None) -> None:
        """A built-in model is sized from the data; a submodel algorithm splits the built-in MLP's neurons."""
        traits = self.traits
        if (self.model.builtin and self.data.dataset == "files" and self.data.dir is None
                and not traits.split_model):  # a split model is sized from [hsgd]
            raise self.error(f"the built-in {self.model.kind} takes its input and output sizes from the data: set "
                             "dir (or use your own model, kind = 'torch' or 'onnx')", "data.dir",
                             prefix=prefix, source=source)
        if traits.submodels:
            self._check_submodels(prefix=prefix, source=source)

    def _check_submodels(self, *, prefix: str, source: str | None) -> None:
        """HIST's cells train disjoint shares of the built-in MLP's hidden neurons: every cell needs some."""
        if not self.model.builtin:
            raise self.error(f"{self.algorithm} partitions the hidden neurons of the built-in mlp; a "
                             f"{self.model.kind} model has no neuron split {self.algorithm} can find (use fedavg, "
                             "hier_qsgd or qhetfed)", "model.kind", prefix=prefix, source=source)
        if self.model.kind != "mlp" or not self.model.hidden:
            raise self.error(f"{self.algorithm} partitions hidden neurons: it needs an MLP with at least one hidden "
                             "layer", "model.hidden", prefix=prefix, source=source)
        cells = len(self.topology.layout())
        for k in range(0, len(self.model.hidden), 2):  # hidden layers 1, 3, ... are partitioned
            if self.model.hidden[k] < cells:
                raise self.error(f"hidden layer of {self.model.hidden[k]} neurons cannot be split over "
                                 f"{cells} cells", "model.hidden", prefix=prefix, source=source)

    def _check_loss(self, *, prefix: str, source: str | None) -> None:
        """weighted_score is the scorers' loss, and only theirs."""
        if self.traits.scorer:
            self._check_scorer(prefix=prefix, source=source)
        elif self.model.loss == "weighted_score":
            raise self.error(f"weighted_score trains a scorer through X-risk coefficients, which only "
                             f"{', '.join(algorithms.names('scorer'))} computes; {self.algorithm} trains on labels",
                             "model.loss", prefix=prefix, source=source)

    def _check_privacy(self, privacy: PrivacySection, *, prefix: str, source: str | None) -> None:
        """[privacy] against the algorithm: its releases must pass the mechanism, with sound sensitivities."""
        traits, section = self.traits, self.section
        if traits.scorer:
            raise self.error(f"{self.algorithm} shares every device's scores (and u values) with the other devices "
                             "through the cloud: data-dependent releases the differential-privacy mechanism does "
                             "not cover yet, so a private rollout cannot run it (docs/privacy.md)", "privacy",
                             prefix=prefix, source=source)
        if not traits.private:
            raise self.error(f"differential privacy covers {', '.join(algorithms.names('private'))}; "
                             f"{self.algorithm}'s gradient exchange is not covered yet", "privacy",
                             prefix=prefix, source=source)
        if privacy.adaptive_clip and (not traits.adaptive_clipping or getattr(section, "secure_aggregation", False)):
            raise self.error(f"adaptive clipping runs with {' and '.join(algorithms.names('adaptive_clipping'))} "
                             f"(without secure aggregation): {self.algorithm}'s devices do not report the clipped "
                             "bit yet", "privacy.adaptive_clip", prefix=prefix, source=source)
        if privacy.device_sampling != "none" and int(getattr(section, "edge_rounds", 1)) != 1:
            raise self.error("device sampling needs edge_rounds = 1: after an intra-round sync every member's "
                             "update depends on a sampled device, so the amplified sensitivity would not hold",
                             "privacy.device_sampling", prefix=prefix, source=source)
        if section.weighting != "uniform":
            raise self.error("privacy needs uniform weights (a device's reported sample count must not raise "
                             "its weight, and with it the sensitivity of its cell's mean)",
                             f"{self.algorithm}.weighting", prefix=prefix, source=source)

    def _check_training(self, *, prefix: str, source: str | None) -> None:
        """What the devices' training must support: FedProx's term, an attack's flipped labels."""
        if self.proximal_mu and self.simulation.trainer != "ort":
            raise self.error("FedProx's proximal term is in the onnxruntime-training graph; the portable trainer "
                             "does not feed its anchor weights (use trainer = 'ort')", "simulation.trainer",
                             prefix=prefix, source=source)
        if self.attack is not None and self.attack.kind == "label_flip" and (
                self.traits.scorer or self.model.loss != "cross_entropy"):
            raise self.error("label_flip flips class labels (y -> classes - 1 - y): it needs a classifier trained "
                             "with cross_entropy", "attack.kind", prefix=prefix, source=source)

    def _check_plan(self, *, prefix: str, source: str | None) -> None:
        """A round planner must find a feasible plan before round 0."""
        planner = self.round_planner()
        if planner is None:
            return
        from fedtier.algorithms.qhetfed_plan import InfeasiblePlanError

        try:
            planner(None)
        except InfeasiblePlanError as exc:
            raise self.error(str(exc), "qhetfed.plan.round_budget_s", prefix=prefix, source=source) from None

    def _check_secure_aggregation(self, *, prefix: str, source: str | None) -> None:
        """Secure aggregation: every cell can reach s_min; with [privacy], distributed DP (docs/privacy.md)."""
        if self.privacy is not None and self.privacy.device_sampling == "fixed":
            raise self.error("distributed DP (secure aggregation with [privacy]) samples devices by Poisson only: "
                             "each device decides for itself, in secret, so nobody draws a fixed-size sample; "
                             "use device_sampling = \"poisson\" or \"none\"", "privacy.device_sampling",
                             prefix=prefix, source=source)
        if self.aggregation is not None:
            from fedtier.algorithms import strategies

            try:
                edge = strategies.parse_strategy({"edge": self.aggregation.spec("edge")})["edge"]
                strategies.check_visibility(edge, "edge", individual=False)
            except strategies.StrategyError as exc:
                raise self.error(f"{exc} (any rule at the cloud)", "aggregation.edge", prefix=prefix,
                                 source=source) from None
        smallest = min(len(m) for m in self.topology.layout().values())
        if self.fedavg.secagg_min_survivors > smallest:
            raise self.error(f"{self.fedavg.secagg_min_survivors} exceeds the smallest cell ({smallest} devices): its "
                             "rounds could never complete", "fedavg.secagg_min_survivors",
                             prefix=prefix, source=source)

    def attackers(self) -> list[str]:
        """The devices that attack under [attack] (seeded by the rollout seed; none without the section)."""
        if self.attack is None:
            return []
        devices = [d for members in self.topology.layout().values() for d in members]
        return choose_attackers(devices, self.attack.fraction, self.seed)

    def strategy(self) -> dict[str, Any] | None:
        """The ``strategy`` map every task carries (``None`` without [aggregation] and [server_optimizer])."""
        if self.aggregation is None and self.server_optimizer is None and self.edge_optimizer is None:
            return None
        out: dict[str, Any] = {}
        if self.aggregation is not None:
            out["edge"] = self.aggregation.spec("edge")
            out["cloud"] = self.aggregation.spec("cloud")
        if self.server_optimizer is not None:
            out["server_optimizer"] = self.server_optimizer.spec()
        if self.edge_optimizer is not None:
            out["edge_optimizer"] = self.edge_optimizer.spec()
        return out

    def _check_strategy(self, *, prefix: str, source: str | None) -> None:
        """[aggregation] and [server_optimizer] against the algorithm, the topology and privacy."""
        if self.edge_optimizer is not None:
            if self.traits.submodels:
                raise self.error("hist redraws which neurons a cell trains every round: an edge optimizer's moments "
                                 "would mix different neurons", "edge_optimizer", prefix=prefix, source=source)
            if self.privacy is not None:
                raise self.error("under differential privacy the edge forwards its cell's noised mean; an edge "
                                 "optimizer would release another function of the clear updates", "edge_optimizer",
                                 prefix=prefix, source=source)
        if self.aggregation is None and self.server_optimizer is None and self.edge_optimizer is None:
            return
        if not self.traits.strategies:
            key = next(k for k in ("aggregation", "server_optimizer", "edge_optimizer") if getattr(self, k) is not None)
            raise self.error(f"{self.algorithm} combines scores and models its own way; aggregation rules and server "
                             f"optimizers are for {', '.join(algorithms.names('strategies'))}", key, prefix=prefix,
                             source=source)
        agg = self.aggregation
        if agg is None:
            return
        if self.privacy is not None and agg.edge != "mean":
            raise self.error("under differential privacy the edge must average: the noise is calibrated to the "
                             "sensitivity of the cell's mean, and a median or a Krum choice has another "
                             "(the cloud may use any rule)", "aggregation.edge", prefix=prefix, source=source)
        if self.traits.submodels and agg.cloud != "mean":
            raise self.error("hist's cloud reassembles disjoint submodels (one cell per slice): nothing to vote on; "
                             "use mean at the cloud (any rule at the edge)", "aggregation.cloud",
                             prefix=prefix, source=source)
        for tier in ("edge", "cloud"):
            if getattr(agg, f"{tier}_options") and not strategies.is_custom(getattr(agg, tier)):
                raise self.error("keyword arguments of your own rule ('package.module:Class'); the built-in rules "
                                 "take trim, byzantine, select and max_norm", f"aggregation.{tier}_options",
                                 prefix=prefix, source=source)
        cells = self.topology.layout()
        sizes = {"edge": min(len(m) for m in cells.values()), "cloud": len(cells)}
        for tier in ("edge", "cloud"):
            spec = strategies.AggregatorSpec.from_dict(agg.spec(tier))
            try:
                spec.check_fits(sizes[tier], tier)
                # Every tier of a rollout sees individual updates today (no secure aggregation yet).
                strategies.check_visibility(spec, tier, individual=True)
            except strategies.StrategyError as exc:
                key = "select" if "select" in str(exc) and "n > 2f" not in str(exc) else "byzantine"
                raise self.error(str(exc), f"aggregation.{key}", prefix=prefix, source=source) from None
        if strategies.is_custom(agg.cloud):
            try:  # the cloud runs it: it must load here (an edge rule loads on the edges)
                strategies.build(strategies.AggregatorSpec.from_dict(agg.spec("cloud")))
            except strategies.StrategyError as exc:
                raise self.error(str(exc), "aggregation.cloud", prefix=prefix, source=source) from None

    def _check_hsgd(self, *, prefix: str, source: str | None) -> None:
        """HSGD trains its own split model on a built-in dataset's columns, without a noise plan."""
        if self.privacy is not None:
            raise self.error("hsgd's embeddings (zeta2, Z1) and head theta0 are data-dependent releases the "
                             "differential-privacy mechanism does not cover yet, so a private rollout cannot run it "
                             "(docs/hsgd.md)", "privacy", prefix=prefix, source=source)
        if self.data.dataset == "files":
            for key in ("host_features", "device_features"):
                if not getattr(self.hsgd, key):
                    raise self.error("your own hybrid data: the coordinator sizes the split model from host_features "
                                     "and device_features (the widths of the host's and a device's rows)",
                                     f"hsgd.{key}", prefix=prefix, source=source)
            if not self.hsgd.classes and self.data.eval_file is None:
                raise self.error("your own hybrid data without an eval_file: set the number of classes",
                                 "hsgd.classes", prefix=prefix, source=source)
        if self.attack is not None:
            raise self.error("the attacks of [attack] corrupt model updates of fedavg-style devices; hsgd has none "
                             "yet", "attack", prefix=prefix, source=source)
        if self.data.holdout:
            raise self.error("hsgd devices hold one sample each: there is nothing to hold out (the coordinator "
                             "evaluates on the test split)", "data.holdout", prefix=prefix, source=source)
        if self.model.kind != "mlp" or self.model.factory or self.model.path:
            raise self.error("hsgd trains its own split model (two encoders and a head: [hsgd] embed_host, "
                             "embed_device); leave [model] unset", "model.kind", prefix=prefix, source=source)
        cells = self.topology.layout()
        devices = {d for members in cells.values() for d in members}
        hosts = self.hsgd_hosts()
        for cell in self.hsgd.hosts or {}:
            if cell not in cells:
                raise self.error(f"names cell {cell!r}, which is not in the topology ({', '.join(sorted(cells))})",
                                 f"hsgd.hosts.{cell}", prefix=prefix, source=source)
        clash = sorted(devices & set(hosts.values()))
        if clash or len(set(hosts.values())) != len(hosts):
            raise self.error(f"a host id must differ from every device id and from the other hosts' ({clash or hosts})",
                             "hsgd.hosts", prefix=prefix, source=source)

    def hsgd_hosts(self) -> dict[str, str]:
        """HSGD: cell -> its host's node id."""
        return {cell: self.hsgd.host_of(cell) for cell in self.topology.layout()}

    def _check_scorer(self, *, prefix: str, source: str | None) -> None:
        """An X-risk algorithm trains a one-output scorer with loss weighted_score; quantization is not for it."""
        if self.model.loss not in ("cross_entropy", "weighted_score"):
            raise self.error(f"{self.algorithm} trains a score with its own pairwise loss (loss weighted_score); leave "
                             f"loss unset, not {self.model.loss}", "model.loss", prefix=prefix, source=source)
        if self.model.kind == "cnn1d":
            raise self.error(f"{self.algorithm} trains a one-output scorer: use kind = 'mlp', or your own model "
                             "(kind = 'torch' or 'onnx' with one output)", "model.kind", prefix=prefix, source=source)

    def _check_trust(self, *, prefix: str, source: str | None) -> None:
        if not (self.topology.trusted or self.topology.parents):
            return


        try:
            self.trust_tree()
        except ConfigError as exc:
            raise self.error(exc.message, exc.key or "topology", prefix=prefix, source=source) from None

    def trust_tree(self) -> dict[str, Any]:
        """The resolved trust labels and noise placement (``fedtier.privacy.trust.resolve``)."""
        from fedtier.privacy.trust import resolve

        return resolve(cloud=self.cloud_id, cells=self.topology.layout(), parents=self.topology.parents,
                       declared=self.topology.trusted)

    def algorithm_config(self) -> Any:
        """The configured algorithm's settings object (what every task carries)."""
        planner = self.round_planner()
        if planner is not None:
            return planner(None)
        if self.traits.split_model:
            return self.hsgd.algorithm_config(self.seed, self.hsgd_hosts())
        section: Any = self.section
        config = self._with_strategy(section.algorithm_config(self.seed))
        return dataclasses.replace(config, roaming=True) if self.topology.roaming else config

    def _with_strategy(self, config: Any) -> Any:
        """``config`` carrying the rollout's strategy map (unchanged without one)."""
        strategy = self.strategy()
        return config if strategy is None else dataclasses.replace(config, strategy=strategy)

    def round_planner(self) -> Callable[[float | None], Any] | None:
        """The cloud's per-round planner (``replanner``) when the algorithm re-plans its rounds and
        ``[qhetfed.plan]`` is set; ``None`` when every round has the configured settings."""
        if not self.traits.replans or self.qhetfed.plan is None:
            return None
        return self.replanner()

    def replanner(self) -> Callable[[float | None], Any]:
        """QHetFed's per-round planner: q1 estimate -> config with the planned (tau, gamma).

        A pure function (the cloud role calls it when it opens a round). Before any device has
        reported, or with ``replan = false``, it uses the configured ``plan.q1``.
        """
        from fedtier.algorithms.qhetfed_plan import PlanInputs, plan

        section, p = self.qhetfed, self.qhetfed.plan
        if p is None:
            return lambda q1: self._with_strategy(section.algorithm_config(self.seed))
        cells = self.topology.layout()
        n_devices = sum(len(m) for m in cells.values())

        def replan(q1: float | None) -> QHetFedConfig:
            measured = q1 if (q1 is not None and p.replan) else p.q1
            inputs = PlanInputs(C=len(cells), N=n_devices, q1=measured, t_cp=p.t_cp, t_de=p.t_de, t_ec=p.t_ec,
                                round_budget_s=p.round_budget_s, uploads=p.uploads)
            chosen = plan(inputs, mode="robust")
            return self._with_strategy(section.algorithm_config(self.seed, tau=int(chosen.tau),
                                                                gamma=int(chosen.gamma)))

        return replan

    @property
    def proximal_mu(self) -> float:
        """FedProx's mu of the configured algorithm (0 for those without it)."""
        return float(getattr(self.section, "proximal_mu", 0.0))

    @property
    def deadline_s(self) -> float:
        return float(self.section.deadline_s)

"""The cloud node: hosts the cloud role of a rollout, persists rounds, evaluates, serves artifacts.

Start (or restart):

1. subscribe to every cell's uplink and to presence;
2. publish the rollout's manifest (retained; a restart republishes the stored one);
3. resume from the store: the newest model version and the round after it; replay the
   cell updates accepted in the open round;
4. open the round (tasks to every cell). A cell whose edge comes online while it still
   owes the round gets its task again.

Asking again: what an edge sent while the coordinator's session was gone is lost (a broker
restarted without persistence, or another client that connected with the coordinator's id and
took its session). So when the coordinator's own connection comes back, every cell that owes the
open round gets its task again, and so does every cell still silent once the round is past its
deadline (then again every deadline); an edge that has answered publishes its stored update again
(``EdgeNode._publish_outputs_again``), never a second one. A takeover costs at most a deadline.

Presence: devices announce themselves in their cell (``topics.cell_status``), which reaches the
coordinator on a shared broker but not across a gateway's bridge; each edge also sends a summary
(``cell_presence``) on its uplink, which does. ``fedtier_devices_online`` and the device inventory
(``rollout status``, ``devices list``) take a device's own presence where it arrives and the summary
for the others.

Each closed round is evaluated on the central test set (if the rollout has one) with the ORT
eval model — and, on a binary task, ranked (AUROC, pAUC at FPR <= 0.3 and 0.5:
``cloud_coordinator.metrics_eval``) — committed to SQLite together with its model version and the devices' federated
evaluation of the model the round started from (``federated``, if devices hold out rows; with each
device's own in ``federated.per_device``, and the worst device's accuracy as the gauge
``fedtier_federated_accuracy_min``, ``observe.prom``: no series per device), and appended to the metrics file.

When the rollout ends (or was already over at start) the retained manifest is cleared: each
edge then clears its cell's copy, forgets the rollout's state and its devices go idle; no
retained message of the rollout stays on the broker. ``done`` turns true once the broker
acknowledged the clearing (or after ``CLEAR_TIMEOUT_S``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from cloud_coordinator import metrics_eval
from cloud_coordinator.observe.prom import CoordinatorMetrics
from cloud_coordinator.report import epsilon_spent
from cloud_coordinator.rollout import PreparedRollout
from cloud_coordinator.presence import PresenceBuffer
from cloud_coordinator.store import CoordinatorStore
from fedtier import algorithms, wire
from fedtier.algorithms.base import Action, CloudRole, Dropped, Finished, RoundClosed, SendToChild
from fedtier.errors import (
    LateMessageError,
    RemoteProtocolError,
    UnexpectedMessageError,
    UnknownSenderError,
)
from fedtier.runtime.metrics import Metrics
from fedtier.runtime.node_base import ACCEPTED, NodeBase, listed
from fedtier.security.manifest import Manifest
from fedtier.security.pki import key_id
from fedtier.security.signing import load_signing_key, open_manifest, sign
from fedtier.training.trainer import EvalResult
from fedtier.transport import topics
from fedtier.transport.base import Inbound, Transport
from fedtier.wire import messages
from fedtier.wire.messages import ArtifactBlob, ArtifactRequest, CellPresence, CellUpdate
from fedtier.secagg.messages import TO_CLOUD as SECAGG_TO_CLOUD

log = logging.getLogger("fedtier.coordinator")

CLEAR_TIMEOUT_S = 10.0
"""How long a finished coordinator waits for the broker to acknowledge that it cleared the manifest."""
CELL_REPORTS = (CellUpdate, *SECAGG_TO_CLOUD)
"""What a cell sends for a round, handed to the rollout's role: its update, or its secure aggregation's abort."""


class Evaluator(Protocol):
    """Evaluates a round's global model on the central test set (``OrtEvaluator``, HSGD's ``SplitEvaluator``)."""

    def __call__(self, params: dict[str, Any]) -> EvalResult: ...

    def ranking(self, params: dict[str, Any]) -> dict[str, float] | None:
        """AUROC and pAUC on a binary task; ``None`` on any other."""
        ...


class OrtEvaluator:
    """Evaluates global parameters on the central test set with the bundle's ORT eval model."""

    def __init__(self, prepared: PreparedRollout, threads: int = 1) -> None:
        from device_agent.data import LocalData, fit_to_model
        from device_agent.trainers import make_trainer

        if prepared.data.test is None:
            raise ValueError("the rollout has no central test set")
        self.trainer = make_trainer("ort", prepared.model_bundle, threads=threads)
        x, y = prepared.data.test
        fitted = fit_to_model(LocalData(x=x, y=y), prepared.model_arch)
        self.x, self.y = fitted.x, fitted.y
        labels = np.asarray(y)
        labels = labels.reshape(len(labels)) if labels.ndim == 2 and labels.shape[1] == 1 else labels
        self.binary_labels = labels if metrics_eval.is_binary(labels) else None
        """The test labels when the task is binary (then every round also reports AUROC and pAUC)."""

    @classmethod
    def for_rollout(cls, prepared: PreparedRollout, threads: int = 1) -> "OrtEvaluator | SplitEvaluator | None":
        """The evaluator of a rollout with a central test set; ``None`` without one."""
        if prepared.hybrid is not None:  # (your own hybrid data without an eval_file: no central test set)
            return SplitEvaluator(prepared.hybrid.test) if len(prepared.hybrid.test[2]) else None
        return cls(prepared, threads) if prepared.data.test is not None else None

    def __call__(self, params: dict[str, Any]) -> EvalResult:
        self.trainer.set_parameters(params)
        return self.trainer.evaluate(self.x, self.y)

    def ranking(self, params: dict[str, Any]) -> dict[str, float] | None:
        """AUROC and pAUC at FPR <= 0.3 and 0.5 on the test set (``cloud_coordinator.metrics_eval``), for a
        binary task whatever the algorithm; ``None`` otherwise."""
        if self.binary_labels is None:
            return None
        self.trainer.set_parameters(params)
        scores = metrics_eval.binary_scores(self.trainer.predict(self.x))
        return None if scores is None else metrics_eval.ranking_metrics(self.binary_labels, scores)


class SplitEvaluator:
    """HSGD: evaluates the split model (host and device columns of each test row) with its numpy forward pass."""

    def __init__(self, test: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        self.x1, self.x2, self.y = test
        self.binary_labels = self.y if metrics_eval.is_binary(self.y) else None

    def __call__(self, params: dict[str, Any]) -> EvalResult:
        from fedtier.training import split

        prob = split.probabilities(params, self.x1, self.x2)
        loss = float(-np.log(np.maximum(prob[np.arange(len(self.y)), self.y], 1e-300)).mean())
        return EvalResult(loss=loss, accuracy=float((prob.argmax(1) == self.y).mean()), samples=len(self.y))

    def ranking(self, params: dict[str, Any]) -> dict[str, float] | None:
        """AUROC and pAUC of the positive class's probability, for a binary task."""
        from fedtier.training import split

        if self.binary_labels is None:
            return None
        return metrics_eval.ranking_metrics(self.binary_labels, split.probabilities(params, self.x1, self.x2)[:, 1])


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _cell_sum(cells: Mapping[str, Mapping[str, Any]], key: str) -> int:
    """``key`` summed over the cells' round statistics (a byte count, a meter)."""
    return sum(int(c.get(key, 0)) for c in cells.values())


def _traffic(cells: Mapping[str, Mapping[str, Any]], traffic: Mapping[str, int], *,
             embeddings: bool) -> dict[str, int]:
    """A round's bytes per tier: the devices' (from their cells' statistics) and the cloud's own (``traffic``).

    ``embeddings``: a split model's vertical path (embeddings up, partner rows down), which is included in
    device_up and device_down, also on its own.
    """
    return {
        "device_up": _cell_sum(cells, "device_up_bytes"),
        "device_down": _cell_sum(cells, "device_down_bytes"),
        "edge_up": int(traffic.get("edge_up_bytes", 0)),
        "cloud_down": int(traffic.get("cloud_down_bytes", 0)),
        # What the uplinks would have cost in float32 (equal to the above when unquantized).
        "device_up_f32": _cell_sum(cells, "device_up_f32_bytes"),
        "edge_up_f32": int(traffic.get("edge_up_f32_bytes", 0)),
        **({"embedding_up": _cell_sum(cells, "embedding_up_bytes"),
            "embedding_down": _cell_sum(cells, "embedding_down_bytes")} if embeddings else {}),
    }


def _rejected_counts(value: Any) -> dict[str, int]:
    """A cell's ``stats["rejected"]`` (``[[reason, count], ...]``, see the edge) as a dict; anything else is empty."""
    if not isinstance(value, list):
        return {}
    return {str(p[0]): int(p[1]) for p in value
            if isinstance(p, list) and len(p) == 2 and isinstance(p[1], (int, float))}


def _connects(tx: Transport) -> int:
    """How many times ``tx`` has connected (``MqttTransport.connects``); 0 for a transport that never reconnects."""
    connects = getattr(tx, "connects", 0)
    return connects if isinstance(connects, int) else 0


def _failed_devices(value: Any) -> dict[str, str]:
    """A cell's ``stats["failed"]`` (``[[device, reason], ...]``, see the edge) as a dict; anything else is empty."""
    if not isinstance(value, list):
        return {}
    return {str(p[0]): str(p[1]) for p in value if isinstance(p, list) and len(p) == 2}


def write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        json.dump(obj, fh, indent=1, default=float)
    os.replace(tmp, path)


class CloudNode(NodeBase):
    """The coordinator of one rollout over ``transport``."""

    def __init__(self, *, prepared: PreparedRollout, transport: Transport, store: CoordinatorStore,
                 evaluator: Evaluator | None, metrics: Metrics | None = None,
                 on_round: Callable[[dict[str, Any]], None] | None = None,
                 wall_clock: Callable[[], float] = time.time, max_message_bytes: int = 256 << 20,
                 extra_metrics: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        cfg = prepared.config
        super().__init__(cfg.cloud_id, metrics or Metrics(node=cfg.cloud_id, role="cloud"), log, max_message_bytes)
        self.prepared = prepared
        self.cfg = cfg
        self.rollout = cfg.rollout
        self.tx = transport
        self.store = store
        self.presence: PresenceBuffer | None = PresenceBuffer(store)
        """The device inventory's writer of presence documents; ``None`` when a ``CoordinatorService`` records
        them for all."""
        self.inventory: PresenceBuffer | None = self.presence
        """Where the devices' states from the edges' summaries (``cell_presence``) go: this node's buffer, or
        the service's."""
        self._direct: set[str] = set()
        """Devices whose own presence reaches this node (a shared broker): their summaries are not needed."""
        self._online_in: dict[str, str] = {}
        """Roaming: device -> the cell whose presence topic last said it is online (its own documents)."""
        self._summarised: dict[str, tuple[bool, str]] = {}
        """The other devices' states as the last summary that named them said: online or not, and in which cell
        (under ``[topology] roaming`` a device is wherever the last summary listing it online came from)."""
        self._connects_seen = 0
        self._asked: dict[tuple[int, str], float] = {}
        """When each cell was last asked again for the open round (``_ask_again``)."""
        self.evaluator = evaluator
        self.on_round = on_round
        self.extra_metrics = extra_metrics
        self.wall_clock = wall_clock
        self.role: CloudRole | None = None
        """The rollout's cloud role while a round is served (``None``: not started, or paused between rounds)."""
        self.manifest: Manifest = prepared.manifest
        self.history: list[dict[str, Any]] = []
        self.finished = False
        self.cleared = False
        """The broker acknowledged that the finished rollout's retained manifest is cleared."""
        self._finished_at: float | None = None
        self.stop_reason: str | None = None
        self.ledger: Any = None  # cloud_coordinator.privacy.ledger.PrivacyLedger under differential privacy
        self._round_bytes: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._started_at = wall_clock()
        self._last_close = self._started_at
        self.observed = CoordinatorMetrics(self.metrics, prepared.cells, deadline_s=cfg.deadline_s,
                                           quorum=float(getattr(getattr(cfg, cfg.algorithm, None), "quorum", 1.0)))
        """Per-cell Prometheus series (devices online, dropouts, epsilon ...), docs/operations.md."""
        self.desired = "running"
        """What the operator asked (``fedtier rollout start|pause|resume|stop``), polled from the store."""
        self.active = False
        """The manifest is out and the rollout is served (running, or paused between rounds)."""
        self.control_poll_s = 0.5
        self._next_poll = 0.0
        self._open_recorded: int | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self, now: float) -> None:
        self.tx.subscribe(topics.edge_up_filter())
        self.tx.subscribe(topics.ALL_STATUS)
        self.tx.subscribe(topics.ALL_CELL_STATUS)
        self._connects_seen = _connects(self.tx)  # a service's connection may be up already: not a reconnection
        status = self.store.status(self.rollout)
        if status in ("finished", "stopped"):
            self.history = self.store.rounds(self.rollout)
            log.info("rollout %s is already %s (%d rounds); clearing its retained manifest", self.rollout, status,
                     len(self.history))
            self.finished = True
            self._clear_retained()
            return
        if self.cfg.attack is not None:
            log.warning("%s (%s): a robustness test, not a real rollout", self.cfg.attack.describe(),
                        ", ".join(self.cfg.attackers()) or "no device at this fraction")
        self.desired = self.store.desired(self.rollout) or "running"
        if self.desired == "stopped":
            self._stop_by_operator()
            return
        if self.desired == "created":
            log.info("rollout %s is created, not started: waiting for `fedtier rollout start %s`", self.rollout,
                     self.rollout)
            return
        self._activate(now)

    def _activate(self, now: float) -> None:
        """Publish the manifest and take up the rollout where the store left it: open the next round,
        or (paused between rounds) only stand by until it is resumed."""
        self.active = True
        self.manifest_bytes = self._issue_manifest()
        self.tx.publish(topics.manifest(self.rollout), self.manifest_bytes, retain=True)
        self.history = self.store.rounds(self.rollout)
        latest = self.store.latest_model(self.rollout)
        open_round = self.store.open_round(self.rollout)
        next_round = 0 if latest is None else latest.round + 1
        if self.desired == "paused" and (open_round is None or open_round["round"] != next_round):
            self.store.set_status(self.rollout, "paused")
            log.info("rollout %s is paused before round %d: `fedtier rollout resume %s` opens it", self.rollout,
                     next_round, self.rollout)
            return
        self._start_role(now)

    def _start_role(self, now: float) -> None:
        """Build the algorithm's cloud role from the newest model version and open its round (replaying
        the updates the store kept for it). Also how a paused rollout resumes."""
        latest = self.store.latest_model(self.rollout)
        if latest is None:
            self.store.save_initial_model(self.rollout, self.prepared.initial_params)
            params, start_round, version = dict(self.prepared.initial_params), 0, 0
        else:
            params, start_round, version = latest.params, latest.round + 1, latest.version
            log.info("resuming rollout %s at round %d from model version %d", self.rollout, start_round, version)
        module = algorithms.load(self.prepared.algorithm_config().ALGORITHM)  # a variant's own roles (secure_fedavg)
        replan = self.cfg.round_planner()
        plan = self.prepared.noise_plan
        if plan is not None:
            from cloud_coordinator.privacy import utility
            from cloud_coordinator.privacy.ledger import PrivacyLedger

            self.ledger = PrivacyLedger(store=self.store, rollout=self.rollout, plan=plan, cells=self.prepared.cells,
                                        cloud_id=self.cfg.cloud_id)
            parameters = {c: self.prepared.cell_bundles.get(c, self.prepared.model_bundle).layout.num_parameters
                          for c in self.prepared.cells}
            estimate = utility.estimate(plan, parameters, cells_averaged=not self.cfg.traits.submodels)
            for warning in estimate.warnings(plan.epsilon):
                log.warning("rollout %s: %s (`fedtier privacy plan` shows the details)", self.rollout, warning)
        role: CloudRole = module.Cloud(rollout=self.rollout, cells=self.prepared.cells, initial_params=params,
                                       config=self.prepared.algorithm_config(), rounds=self.cfg.rounds,
                                       cloud_id=self.cfg.cloud_id, start_round=start_round, model_version=version,
                                       replan=replan, admit=self.ledger.admit if self.ledger is not None else None,
                                       **self.prepared.cloud_kwargs())
        self.role = role
        if latest is not None:
            saved = self.store.strategy_state(self.rollout, version)
            if saved is not None:  # the server optimizer's moments, as committed with this model version
                role.load_strategy_state(saved)
                log.info("rollout %s: server-side strategy state of model version %d restored", self.rollout, version)
        self.store.set_status(self.rollout, "running")
        self._execute(role.start(now), now)
        for payload in self.store.inputs(self.rollout):
            msg = messages.decode_message(payload, max_bytes=self.max_message_bytes)
            self._on_update(payload, msg, now, replay=True)

    def _issue_manifest(self) -> bytes:
        """The rollout's manifest as published: the stored one after a restart (the same bytes,
        so nodes see nothing new), or a fresh one — a new version, an expiry, signed when a key
        is configured — for a new rollout or when the stored one has expired."""
        stored = self.store.manifest(self.rollout)
        if stored:  # b"": created by `fedtier rollout create`, not issued yet
            manifest = open_manifest(stored, {})
            if manifest.expires is None or manifest.expires > self.wall_clock() + 60:
                self.manifest = manifest
                return stored
            log.info("manifest v%d of %s expired; issuing a new one", manifest.version, self.rollout)
        now = self.wall_clock()
        self.manifest = dataclasses.replace(self.prepared.manifest, version=self.store.next_manifest_version(),
                                            created=now, expires=now + self.cfg.manifest_valid_days * 86400)
        data = self.manifest.encode()
        if self.cfg.signing_key is not None:
            key = load_signing_key(self.cfg.signing_key)
            data = sign(self.manifest, key)
            log.info("manifest v%d of %s signed by key %s", self.manifest.version, self.rollout,
                     key_id(key.public_key()))
        if stored is None:
            self.store.ensure_rollout(self.rollout, self.cfg.to_dict(), data)
        else:
            self.store.replace_manifest(self.rollout, data)
        return data

    @property
    def done(self) -> bool:
        """Finished, and its retained manifest cleared (or no acknowledgement came in time)."""
        if not self.finished:
            return False
        if self._finished_at is None:
            self._finished_at = time.monotonic()
        return self.cleared or time.monotonic() - self._finished_at > CLEAR_TIMEOUT_S

    def _clear_retained(self) -> None:
        """Delete the rollout's retained manifest; the edges clear their cells' copies in turn."""
        def acked(ok: bool) -> None:
            self.cleared = True

        self.tx.publish(topics.manifest(self.rollout), b"", retain=True, on_done=acked)

    def _poll_control(self, now: float) -> None:
        """Act on the operator's desired state: start, stop at once, resume; a pause takes effect when
        the open round closes (``_execute``)."""
        if now < self._next_poll or self.finished:
            return
        self._next_poll = now + self.control_poll_s
        desired = self.store.desired(self.rollout) or "running"
        if desired == self.desired:
            return
        log.info("rollout %s: operator asked %s (was %s)", self.rollout, desired, self.desired)
        self.desired = desired
        if desired == "stopped":
            self._stop_by_operator()
        elif desired == "running" and not self.active:
            self._activate(now)
        elif desired == "running" and self.role is None:
            log.info("rollout %s resumed", self.rollout)
            self._start_role(now)
        elif desired == "paused" and self.role is not None:
            log.info("rollout %s: pause asked; round %d finishes, no new round opens", self.rollout, self.role.round)

    def _stop_by_operator(self) -> None:
        self.finished = True
        self.stop_reason = "stopped by the operator"
        self.store.set_status(self.rollout, "stopped")
        self.store.set_open_round(self.rollout, None)
        self.observed.no_round_open()
        log.warning("rollout %s stopped by the operator", self.rollout)
        self.write_metrics()
        self._clear_retained()

    def tick(self, now: float) -> None:
        if self.presence is not None:
            self.presence.flush_due(now)
        self._poll_control(now)
        reconnected = self._reconnected()
        if self.role is not None and not self.finished:
            self._execute(self.role.tick(now), now)
            if not self.finished:
                waiting = self.role.overdue(now)
                if waiting:
                    self.report_overdue(f"round {self.role.round} of rollout {self.rollout}", (self.role.round,),
                                        [f"cell {c}" for c in waiting], now)
                self._ask_again(now, reconnected, waiting)

    def _reconnected(self) -> bool:
        """Whether the coordinator's connection came back since the last tick (not its first connect)."""
        connects = _connects(self.tx)
        again = connects > max(self._connects_seen, 1)
        self._connects_seen = max(self._connects_seen, connects)
        return again

    def _ask_again(self, now: float, reconnected: bool, waiting: Sequence[str]) -> None:
        """Send the open round's task again to the cells that owe it (the module docstring): all of them after a
        reconnection, and those ``waiting`` past the deadline once per ``deadline_s``."""
        assert self.role is not None
        round_ = self.role.round
        if reconnected:
            cells = sorted(self.prepared.cells)
            present = getattr(self.tx, "session_present", None)
            why = "the coordinator's session was lost" if present is False else "the coordinator reconnected"
        else:
            interval = max(float(self.cfg.deadline_s), 1.0)
            cells = [c for c in waiting if now - self._asked.get((round_, c), -math.inf) >= interval]
            why = "the round is past its deadline"
        actions: list[Action] = []
        asked = []
        for cell in cells:
            resent = self.role.resend(cell, now)
            if resent:
                asked.append(cell)
                actions += resent
        if not asked:
            return
        self._asked = {k: v for k, v in self._asked.items() if k[0] == round_}
        self._asked.update({(round_, c): now for c in asked})
        log.info("round %d of rollout %s: %s; asked %s again for their update (an edge that sent it publishes "
                 "its stored copy again)", round_, self.rollout, why, listed([f"cell {c}" for c in asked]))
        self._execute(actions, now)

    # --- inbound --------------------------------------------------------------------------------

    def handle(self, inbound: Inbound, now: float) -> None:
        parsed = self.parse_topic(inbound)
        if parsed is None:
            return
        if parsed.channel == "status":
            self._on_status(inbound, parsed, now)
            return
        if parsed.channel != "edge_up":
            return
        if parsed.rollout != self.rollout:
            self.reject(inbound, UnexpectedMessageError(f"message for rollout {parsed.rollout!r}"))
            return
        msg = self.decode_inbound(inbound, parsed)
        if msg is None:
            return
        try:
            if isinstance(msg, CELL_REPORTS) and (self.role is None or self.finished):
                # paused between rounds, not started, or over: an edge re-sending a closed round's update
                raise LateMessageError(f"update for round {msg.round} of {self.rollout}, which has no round open "
                                       f"({self.store.status(self.rollout)})")
            if isinstance(msg, CELL_REPORTS):
                self._on_update(inbound.payload, msg, now, wire_bytes=inbound.size_on_wire)
            elif isinstance(msg, ArtifactRequest):
                self._serve_artifacts(msg)
            elif isinstance(msg, CellPresence):
                self._on_cell_presence(msg)
            else:
                raise UnexpectedMessageError(f"coordinator does not accept {msg.KIND}")
        except RemoteProtocolError as exc:
            self.reject(inbound, exc)

    def _on_update(self, payload: bytes, msg: messages.Message, now: float, replay: bool = False,
                   wire_bytes: int | None = None) -> None:
        assert self.role is not None  # callers check: updates reach only a served round
        # An asynchronous update's round is its cell's counter: it is kept, and its bytes counted, under the
        # model version it goes into (committing that version forgets it).
        round_ = self.role.round if self.cfg.traits.asynchronous else msg.round
        actions = self.role.receive(msg, now)
        duplicate = any(isinstance(a, Dropped) and a.key == msg.key for a in actions)
        if not duplicate:
            if not replay:
                self.store.record_input(self.rollout, round_, msg.key, payload)
                self.metrics.inc(ACCEPTED, kind=msg.KIND)
            size = len(payload) if wire_bytes is None else wire_bytes
            self._round_bytes[round_]["edge_up_bytes"] += size
            self._round_bytes[round_]["edge_up_f32_bytes"] += size - len(payload) + wire.float32_equivalent(payload)
        self._execute(actions, now)

    def _on_status(self, inbound: Inbound, parsed: topics.Topic, now: float) -> None:
        if self.stale_presence(parsed) or self._left_behind(inbound, parsed):
            return
        if parsed.device in self.observed.cell_of:
            self._direct.add(parsed.device)
        self.observed.presence(parsed.device, inbound.payload)
        self._record_presence(inbound, parsed)
        node = self.came_online(inbound, parsed)
        if node is None or node not in self.prepared.cells or parsed.cell is not None:
            return  # only an edge's own presence (ft/v1/status/<cell>) is an edge coming online
        if self.active and not self.finished:
            # An edge (re)connected: the retained manifest again, in case the broker lost it (restarted
            # without persistence); the same bytes, so an edge that has it changes nothing.
            self.tx.publish(topics.manifest(self.rollout), self.manifest_bytes, retain=True)
        if self.role is not None and not self.finished:
            self._execute(self.role.resend(node, now), now)

    def _left_behind(self, inbound: Inbound, parsed: topics.Topic) -> bool:
        """Roaming: whether this is a device's ``offline`` document left retained in a cell it moved out of, while
        it is online in another (retained documents of two cells arrive in any order after a restart)."""
        if not self.cfg.topology.roaming or parsed.cell is None or parsed.device is None:
            return False
        try:
            state = json.loads(inbound.payload.decode()).get("state") if inbound.payload else "offline"
        except (UnicodeDecodeError, ValueError, AttributeError, RecursionError):
            return False  # came_online rejects and counts it
        if state == "online":
            self._online_in[parsed.device] = parsed.cell
            return False
        where = self._online_in.get(parsed.device, parsed.cell)
        if where != parsed.cell:
            return True
        self._online_in.pop(parsed.device, None)
        return False

    def _on_cell_presence(self, msg: CellPresence) -> None:
        """An edge's summary of its devices' presence: the state of each member of the cell whose own presence
        does not reach this node, for ``fedtier_devices_online`` and the device inventory."""
        members = self.prepared.cells.get(msg.sender)
        if members is None:
            raise UnknownSenderError(f"presence summary from {msg.sender!r}, not a cell of rollout {self.rollout}")
        online = set(msg.online)
        wall = self.wall_clock()
        if self.cfg.topology.roaming:  # any device of the rollout may be here; one seen in another cell stays there
            states = [(d, True) for d in sorted(online) if d in self.observed.cell_of]
            states += [(d, False) for d in self.observed.cell_of if d not in online and self._summarised.get(
                d, (False, self.observed.cell_of[d]))[1] == msg.sender]
        else:
            states = [(d, d in online) for d in members]
        for device, up in states:
            if device in self._direct or self._summarised.get(device) == (up, msg.sender):
                continue
            self._summarised[device] = (up, msg.sender)
            self.observed.set_online(device, up)
            if self.inventory is not None:  # "via": the edge that vouches for it (devices list shows no trainer)
                self.inventory.add(device, {"node": device, "cell": msg.sender, "state": "online" if up else "offline",
                                            "via": msg.sender}, wall)

    def _record_presence(self, inbound: Inbound, parsed: topics.Topic) -> None:
        """Keep every node's presence document in the store: the device inventory (``fedtier devices list``)."""
        if parsed.device is None or not inbound.payload:
            return
        try:
            doc = json.loads(inbound.payload.decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return  # came_online rejects and counts it
        if self.presence is not None and isinstance(doc, dict) and doc.get("node", parsed.device) == parsed.device:
            self.presence.add(parsed.device, doc, self.wall_clock())

    def _serve_artifacts(self, req: ArtifactRequest) -> None:
        files = self.prepared.artifact_files()
        unknown = [d for d in req.digests if d not in files]
        if unknown:
            raise UnexpectedMessageError(f"request for artifacts not in the manifest: {unknown}")
        for sha in req.digests:
            blob = ArtifactBlob(rollout=self.rollout, round=0, sender=self.cfg.cloud_id, sha256=sha,
                                name=files[sha].name, data=files[sha].read_bytes())
            self.tx.publish(topics.cloud_down(self.rollout, req.sender, blob.KIND), blob.encode())
        log.info("served %d artifact file(s) to %s", len(req.digests), req.sender)

    # --- actions --------------------------------------------------------------------------------

    def _execute(self, actions: Sequence[Action], now: float) -> None:
        self.diagnostics(actions)
        holding = False
        opened: dict[int, list[str]] = {}
        for action in actions:
            if isinstance(action, SendToChild) and holding:
                continue  # paused: the next round's tasks are not sent; resuming rebuilds them from the store
            if isinstance(action, SendToChild):
                opened.setdefault(action.message.round, []).append(action.child)
                payload = action.message.encode()
                sent = self.tx.publish(topics.cloud_down(self.rollout, action.child, action.message.KIND), payload)
                self._round_bytes[action.message.round]["cloud_down_bytes"] += sent or len(payload)
            elif isinstance(action, RoundClosed):
                self._close(action)
                self._next_poll = 0.0
                self._poll_control(now)
                if self.finished:
                    holding = True  # stopped by the operator
                elif self.desired == "paused" and action.round + 1 < self.cfg.rounds:
                    holding = True
                    self.role = None
                    self.store.set_open_round(self.rollout, None)
                    self._open_recorded = None
                    self.store.set_status(self.rollout, "paused")
                    log.info("rollout %s paused after round %d", self.rollout, action.round)
            elif isinstance(action, Finished):
                if self.finished:
                    continue
                self.finished = True
                self.store.set_open_round(self.rollout, None)
                if action.reason != "completed":
                    self.stop_reason = action.reason
                    self.store.set_status(self.rollout, "stopped")
                    log.warning("rollout %s stopped before round %d: %s", self.rollout, action.rounds, action.reason)
                else:
                    self.store.set_status(self.rollout, "finished")
                    log.info("rollout %s finished after %d rounds", self.rollout, action.rounds)
                if self.presence is not None:
                    self.presence.flush()  # the process may end now: the inventory as it was at the end
                self.write_metrics()
                self._clear_retained()
        for round_, cells in opened.items():
            if not self.finished and round_ != self._open_recorded and self.role is not None:
                self._open_recorded = round_
                self.store.set_open_round(self.rollout, round_, cells)
                self.observed.round_opened(self.wall_clock())

    def _close(self, closed: RoundClosed) -> None:
        """A closed round: evaluated, its row built, its privacy charged, committed to the store, then
        published (history, Prometheus, log, the metrics file, ``on_round``)."""
        result, ranks = self._evaluate(closed.params)
        row = self._round_row(closed, result, ranks)
        releases, clear = self._charge_privacy(closed, row)
        self._commit(closed, row, releases, clear)
        self._publish(closed, row, result, ranks)
        self._log_round(closed, row, result, ranks)
        self.write_metrics()
        if self.on_round is not None:
            self.on_round(row)

    def _evaluate(self, params: Mapping[str, Any]) -> tuple[EvalResult | None, dict[str, float] | None]:
        """The round's model on the central test set, and its ranking on a binary task (``None`` without)."""
        if self.evaluator is None:
            return None, None
        return self.evaluator(dict(params)), self.evaluator.ranking(dict(params))

    def _round_row(self, closed: RoundClosed, result: EvalResult | None,
                   ranks: dict[str, float] | None) -> dict[str, Any]:
        """The round's metrics row, as metrics.json and the store keep it (``extra_metrics`` included)."""
        wall = self.wall_clock()
        cells = closed.metrics.get("cells", {})
        split_model = self.cfg.traits.split_model
        row: dict[str, Any] = {
            "round": closed.round,
            "accuracy": result.accuracy if result else None,
            "loss": result.loss if result else None,
            **(ranks or {}),
            "federated": closed.metrics.get("federated"),
            "train_loss": closed.metrics.get("train_loss"),
            "model_version": closed.metrics.get("model_version"),
            "devices_reported": sum(len(r) for r in closed.reported.values()),
            "missing": list(closed.missing),
            "bytes": _traffic(cells, self._round_bytes.pop(closed.round, {}), embeddings=split_model),
            # HSGD: eq. (19)'s meter, the values the paper counts, and the same in bytes as encoded on the wire;
            # the vertical path's tensor bytes over every hop.
            **({"paper_values": _cell_sum(cells, "paper_values"), "paper_bytes": _cell_sum(cells, "paper_bytes"),
                "vertical_bytes": _cell_sum(cells, "vertical_bytes")} if split_model else {}),
            "q1": closed.metrics.get("q1"),
            "q2": closed.metrics.get("q2"),
            **({"attack": self.attack_summary()} if self.cfg.attack is not None else {}),
            "config": closed.metrics.get("config"),
            "cells": self._cell_rows(closed, cells),
            "round_s": wall - self._last_close,
            "elapsed_s": wall - self._started_at,
        }
        self._last_close = wall
        if self.extra_metrics is not None:
            row.update(self.extra_metrics(dict(closed.params)))
        return row

    def _cell_rows(self, closed: RoundClosed, cells: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """Each cell of the rollout in a round's row: who reported, who not (and who of them failed to train, and
        why), what it rejected, its bytes; under secure aggregation which phase closed without whom
        (``secagg.waited``) or why the cell aborted."""
        out: dict[str, dict[str, Any]] = {}
        aborts = closed.metrics.get("secagg_aborts", {})
        anywhere = {d for r in closed.reported.values() for d in r}  # roaming: a member may report through another cell
        for c in sorted(self.prepared.cells):
            reported = closed.reported.get(c, ())
            stats = cells.get(c, {})
            out[c] = {"reported": list(reported),
                      "missing": sorted(set(self.prepared.cells.get(c, ()))
                                        - (anywhere if self.cfg.topology.roaming else set(reported))),
                      "rejected": _rejected_counts(stats.get("rejected")),
                      "failed": _failed_devices(stats.get("failed")),
                      "device_up_bytes": int(stats.get("device_up_bytes", 0)),
                      "device_down_bytes": int(stats.get("device_down_bytes", 0)),
                      **({"steps": list(stats["steps"])} if "steps" in stats else {})}  # roaming: [device, j] ids
            abort = aborts.get(c)
            waited = stats.get("secagg_waited") or (abort or {}).get("waited") or {}
            if waited or abort:
                out[c]["secagg"] = {"waited": waited, **({"aborted": {k: v for k, v in abort.items() if k != "waited"}}
                                                         if abort else {})}
        return out

    def _charge_privacy(self, closed: RoundClosed,
                        row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Under a noise plan: the round's releases and clear hops, charged to the ledger and summed up in
        ``row`` (which then has no training loss: cells do not send losses under differential privacy)."""
        if self.ledger is None:
            return [], []
        if self.cfg.traits.asynchronous:  # every release that reached the cloud, as made (ledger.rows_for_releases)
            releases, clear = self.ledger.rows_for_releases(closed.round, closed.metrics.get("releases", ()),
                                                            closed.metrics.get("clear", ()))
        else:
            releases, clear = self.ledger.rows_for_round(closed.round, closed.metrics.get("privacy", {}))
        self.ledger.charge(releases)
        row["train_loss"] = None
        row["privacy"] = {**self.ledger.summary(), "releases": len(releases),
                          "unobserved": sum(1 for r in releases if not r["observed"]), "clear_hops": len(clear),
                          **({"adaptive_clip": closed.metrics["adaptive_clip"]}
                             if closed.metrics.get("adaptive_clip") else {})}
        return releases, clear

    def _commit(self, closed: RoundClosed, row: dict[str, Any], releases: list[dict[str, Any]],
                clear: list[dict[str, Any]]) -> None:
        """The round into the store: model version, row, privacy rows, strategy state; then who contributed."""
        assert self.role is not None  # a round closed: its role runs
        self.store.commit_round(self.rollout, closed.round, int(closed.metrics.get("model_version", 0)),
                                closed.params, row["accuracy"], row["loss"], row, releases=releases, clear=clear,
                                strategy_state=self.role.strategy_state())
        self.store.record_contributions(self.rollout, closed.round, int(closed.metrics.get("model_version", 1)) - 1,
                                        [d for r in closed.reported.values() for d in r])

    def _publish(self, closed: RoundClosed, row: dict[str, Any], result: EvalResult | None,
                 ranks: dict[str, float] | None) -> None:
        """The committed round in the history and the Prometheus gauges."""
        federated = closed.metrics.get("federated")
        self.history.append(row)
        self.metrics.set("fedtier_round", closed.round)
        if result is not None and result.accuracy is not None:
            self.metrics.set("fedtier_accuracy", result.accuracy)
        if federated is not None and federated.get("accuracy") is not None:
            self.metrics.set("fedtier_federated_accuracy", federated["accuracy"])
        if ranks:
            self.metrics.set("fedtier_auroc", ranks["auroc"])
        self.observed.round_closed(row, closed.reported)

    @staticmethod
    def _log_round(closed: RoundClosed, row: dict[str, Any], result: EvalResult | None,
                   ranks: dict[str, float] | None) -> None:
        """The round's log line: test-set accuracy and loss, ranking, federated evaluation, epsilon spent."""
        federated = closed.metrics.get("federated")
        log.info("round %d closed: accuracy %s loss %s%s%s (%d devices)%s", closed.round,
                 _fmt(result.accuracy if result else None), _fmt(result.loss if result else None),
                 "" if not ranks else f" auroc {_fmt(ranks['auroc'])} pauc@0.3 {_fmt(ranks['pauc_0.3'])} "
                                      f"pauc@0.5 {_fmt(ranks['pauc_0.5'])}",
                 "" if federated is None else
                 f"; federated accuracy {_fmt(federated.get('accuracy'))} loss {_fmt(federated['loss'])} "
                 f"on {federated['examples']} held-out rows of {federated['devices']} devices",
                 row["devices_reported"], f", {epsilon_spent(row)}" if row.get("privacy") else "")

    def attack_summary(self) -> dict[str, Any]:
        """What marks every output of an attack run (``[attack]``): the attack and its devices."""
        a = self.cfg.attack
        assert a is not None
        return {"kind": a.kind, "fraction": a.fraction, "scale": a.scale, "devices": self.cfg.attackers(),
                "note": a.describe()}

    def write_metrics(self) -> None:
        doc: dict[str, Any] = {"rollout": self.rollout, "algorithm": self.cfg.algorithm,
                               "rounds_planned": self.cfg.rounds, "finished": self.finished, "rounds": self.history}
        if self.cfg.attack is not None:
            doc["attack"] = self.attack_summary()
        if self.stop_reason is not None:
            doc["stopped"] = self.stop_reason
        if self.prepared.noise_plan is not None:
            doc["noise_plan"] = self.prepared.noise_plan.to_dict()
        write_json_atomic(self.cfg.metrics_path, doc)

    @property
    def params(self) -> dict[str, Any]:
        assert self.role is not None, "no cloud role: the rollout was not started, or is paused between rounds"
        return dict(self.role.params)

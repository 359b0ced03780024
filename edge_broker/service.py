"""The edge service: hosts the edge role of one cell between its cell broker and the cloud.

Per inbound message (on the node's single thread, see ``fedtier.runtime.node_base.run_loop``):

* cloud ``manifest``      -> validate, keep the newest version, relay (retained) to the cell,
                             prefetch the artifacts it lists; an empty one (the coordinator
                             cleared it: the rollout ended) -> clear the cell's copy, forget
                             the rollout's state;
* cloud ``cell_task``     -> role; the accepted task is recorded; the role's device task is
                             broadcast to the cell;
* cloud ``artifact``      -> verify, cache, relay to the cell;
* device ``device_update``-> role; the accepted update is recorded before it is acknowledged;
                             when the role closes the cell, the cell update goes to the cloud;
* device/host ``hsgd_embeddings`` -> role (HSGD: a device's zeta2, the host's Z1 rows and head), recorded
                             like an update; the role's relays go to the host or device on its own topic;
* device ``training_failed`` -> role (the device could not compute its step: the cell goes on without
                             it), recorded like an update, counted by reason
                             (``fedtier_training_failed_total``) and listed in the cell update's
                             ``stats["failed"]``;
* device ``artifact_request`` -> serve from the cache, or ask the cloud;
* device ``status`` (presence, ``ft/v1/status/<cell>/<device>``: this cell's devices only)
                          -> a member that comes online and still owes an update gets the
                             open round's task on its own topic; a change of who is online is
                             summarised for the coordinator (``cell_presence``, at most every
                             ``PRESENCE_SUMMARY_S``, on every running rollout's uplink: the
                             summary crosses a gateway's bridge, devices' presence does not);
* the coordinator's ``status`` -> it (re)connected: the summaries again.

The cell's retained manifests are published again when the edge's connection to the cell broker
comes back (a broker restarted without persistence has lost them), and after a restart of the
edge when the coordinator's manifest shows the rollout still runs — once per connection, not per
device that comes online.

Every rejection is logged with its typed reason and counted (``fedtier_rejected_total``).

After a restart the stored state of each rollout waits until the rollout shows it is still
running — its retained manifest arrives again from the cloud, or a message of it arrives —
and is replayed only then. A rollout that ended while the edge was down (its manifest is no
longer retained) is never replayed, so its last cell update is not sent again to a
coordinator that has moved on.

A rollout whose end the edge saw (its manifest cleared) stays ended, across restarts too
(``EdgeStore.ended``): every later message of it — a replayed ``cell_task`` above all — is
rejected as ``rollout_ended``, never accepted, stored or relayed to the cell, and the cell's
retained manifest of it is cleared again. A different manifest under the same rollout id starts
it again.
"""

from __future__ import annotations

import dataclasses
import json
import hashlib
import logging
import math
import time
from collections import defaultdict
from contextlib import AbstractContextManager
from typing import Any, Mapping, Sequence

from edge_broker.store import EdgeStore
from fedtier import algorithms, wire
from fedtier.algorithms.base import Action, Broadcast, Dropped, EdgeRole, Note, SendToChild, SendToParent
from fedtier.artifacts.cache import ArtifactCache
from fedtier.errors import (
    MissingReleaseError,
    PrivacyViolationError,
    RemoteProtocolError,
    RolloutEndedError,
    UnexpectedMessageError,
)
from fedtier.privacy import audit
from fedtier.privacy.mechanism import NoiseSource
from fedtier.privacy.plan import NoisePlan
from fedtier.runtime.metrics import Metrics
from fedtier.runtime.node_base import ACCEPTED, EXPECTED_DROPS, REJECTED, NodeBase, listed
from fedtier.secagg import messages as secagg_messages
from fedtier.security.manifest import Manifest
from fedtier.security.signing import ManifestGate, open_manifest
from fedtier.storage import npz as npz_file
from fedtier.transport import topics
from fedtier.transport.base import Inbound, Transport
from fedtier.wire import messages
from fedtier.wire.messages import (
    ArtifactBlob,
    ArtifactRequest,
    CellPresence,
    CellTask,
    CellUpdate,
    DeviceGradient,
    DeviceUpdate,
    Embeddings,
    Message,
    PartnerEmbeddings,
    TrainingFailed,
)

log = logging.getLogger("fedtier.edge")

SECAGG_ABORTS = "fedtier_secagg_aborts_total"
"""Cell rounds a secure aggregation aborted, by typed reason (``fedtier.secagg.protocol.Abort``)."""
SECAGG_WAITED = "fedtier_secagg_waited_total"
"""Devices a secure-aggregation phase closed without at its own deadline, by phase (no device labels: which
devices is in the edge's ``secagg_waited`` log line and the cell update's ``stats``)."""
AGGREGATION_SECONDS = "fedtier_edge_aggregation_seconds"
"""Histogram: from a round's cell task arriving to the cell's update leaving for the cloud."""
TRAINING_FAILED = "fedtier_training_failed_total"
"""Devices' ``training_failed`` reports the edge accepted, by reason (crash, error, non_finite)."""
ROUND_INPUTS = (CellTask, DeviceUpdate, DeviceGradient, TrainingFailed, *secagg_messages.UPWARD)
"""Messages a role takes as inputs of its round (stored and replayed), besides HSGD's ``Embeddings``. An
asynchronous rollout's (FedBuff) are kept from its newest checkpoint on (``EdgeNode._save_async_output``)."""



CHECKPOINT_SHARE = 16
CHECKPOINT_MAX = 1024
"""An asynchronous edge stores its role's state with a cell update once the inputs since the last such checkpoint
reach a sixteenth of its cell's devices (at every cell update in a cell of up to 16), and at most 1,024: the state,
which names every device, is then encoded once per that many inputs, and the store holds at most that many."""

PRESENCE_SUMMARY_S = 2.0
"""At most one ``cell_presence`` summary per this many seconds: a cell of thousands of devices that all
connect within a minute sends a few dozen summaries, not one per device."""

ARTIFACT_REREQUEST_S = 5.0
ARTIFACT_RESERVE_S = 0.5
"""A file is sent to each device that asks for it, on the device's own downlink topic (it subscribes to
its cell's broadcasts and its own messages only, ``topics.device_down_filters``): a broadcast would
reach every device of the cell each time one of them asked, which in a cell of thousands that start
over minutes is thousands of copies per device. The same file is sent to the same device at most
once per this many seconds (a device asks again only after ``ARTIFACT_RETRY_S``)."""


class EdgeNode(NodeBase):
    """The edge of cell ``cell``. Transport-agnostic: MQTT in deployment, memory in simulation."""

    def __init__(self, *, cell: str, cell_transport: Transport, cloud_transport: Transport, store: EdgeStore,
                 cache: ArtifactCache, parent: str = "cloud", metrics: Metrics | None = None,
                 max_message_bytes: int = 64 << 20, trusted_keys: Mapping[str, Any] | None = None,
                 noise: NoiseSource | None = None) -> None:
        super().__init__(cell, metrics or Metrics(node=cell, role="edge"), log, max_message_bytes)
        self.noise = noise if noise is not None else NoiseSource()  # OS-seeded; never stored
        self.cell = cell
        self.parent = parent
        self.cell_tx = cell_transport
        self.cloud_tx = cloud_transport
        self.store = store
        self.cache = cache
        self.roles: dict[str, EdgeRole] = {}
        self.manifests: dict[str, Manifest] = {}
        self.gate = ManifestGate(trusted_keys or {})
        self._requested: dict[str, float] = {}
        self._wanted: dict[str, set[tuple[str, str]]] = {}
        """sha -> (rollout, device) of files devices asked for that were not cached yet."""
        self._served: dict[tuple[str, str], float] = {}  # (sha, device) -> when it was last sent
        self._blob_payloads: dict[tuple[str, str], bytes] = {}
        """(rollout, sha) -> the file's encoded message, the same for every device that asks."""
        self._round_bytes: dict[tuple[str, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._asynchronous: set[str] = set()
        """Rollouts of an asynchronous algorithm (FedBuff), known from their first task: the edge state spans every
        model version, so inputs are not pruned when a new one arrives but when a cell update leaves, with the role's
        state stored beside it (``EdgeStore.save_checkpoint``: a restart loads it and replays what came after), and
        bytes are counted per cell update (``_bytes_key``)."""
        self._since_checkpoint: dict[str, int] = {}
        """Asynchronous rollout -> inputs accepted since its last checkpoint (``_save_async_output``)."""
        self._dormant: dict[str, list[bytes]] = {}  # stored inputs of rollouts not yet seen alive after a restart
        self._task_arrived: dict[tuple[str, int], float] = {}
        """When each open round's cell task arrived (monotonic), for ``AGGREGATION_SECONDS``."""
        self._online: set[str] = set()  # nodes seen coming online since this edge started
        self._devices_online: dict[str, bool] = {}
        """The cell's devices whose presence this edge has seen, and whether each is online now."""
        self._live: set[str] = set()
        """Rollouts whose manifest came from the coordinator since this edge started: running now."""
        self._summary_due: set[str] = set()
        """Running rollouts whose coordinator is owed a ``cell_presence`` summary."""
        self._next_summary = -math.inf
        self._presence_seen = False
        self._connects = {"cell": 0, "cloud": 0}
        """Connections of each side seen so far (``MqttTransport.connects``): a new one is a reconnection."""
        self._ended: dict[str, str] = store.ended()
        """Rollouts that ended -> the sha256 of their last manifest: their messages are refused (``rollout_ended``)."""
        self._recleared: set[str] = set()  # ended rollouts whose cell manifest this process cleared again
        self._failures: dict[tuple[str, int], dict[str, str]] = defaultdict(dict)
        """(rollout, round) -> device -> reason of the ``training_failed`` reports the role accepted: sent up in
        the round's cell update (``stats["failed"]``)."""
        self._rejected: dict[str, int] = defaultdict(int)
        """Messages refused (by typed reason) and updates dropped (by reason, duplicates aside) since the
        last cell update: sent up in its ``stats["rejected"]`` for ``fedtier rollout status``."""

    def reject(self, inbound: Inbound, exc: RemoteProtocolError) -> None:
        super().reject(inbound, exc)
        self._rejected[exc.reason] += 1

    def diagnostics(self, actions: Sequence[Action]) -> None:
        super().diagnostics(actions)
        for action in actions:
            if isinstance(action, Dropped) and action.reason not in EXPECTED_DROPS:
                self._rejected[action.reason] += 1

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self, now: float) -> None:
        """Subscribe, then rebuild the open round from the store (after a restart)."""
        self.cloud_tx.subscribe(topics.ALL_MANIFESTS)
        self.cloud_tx.subscribe(topics.cloud_down_filter(self.cell))
        self.cloud_tx.subscribe(topics.status(self.parent))  # the coordinator (re)connected: summaries again
        self.cell_tx.subscribe(topics.cell_up_filter(self.cell))
        self.cell_tx.subscribe(topics.cell_status_filter(self.cell))  # this cell's devices, no other cell's
        for rollout, (_, payload) in self.store.manifests().items():
            try:
                self.manifests[rollout] = open_manifest(payload, {})  # verified when it was stored
                self.gate.installed(self.manifests[rollout], payload)
            except RemoteProtocolError:
                log.warning("ignoring unreadable stored manifest of %s", rollout)
        for rollout, payload in self.store.inputs():
            self._dormant.setdefault(rollout, []).append(payload)
        if self._dormant:
            log.info("kept state of %s: resumed once the coordinator shows it still runs",
                     ", ".join(f"rollout {r} ({len(p)} messages)" for r, p in sorted(self._dormant.items())))

    def _wake(self, rollout: str, now: float) -> None:
        """Replay a rollout's stored round (see the module docstring); a no-op once done."""
        payloads = self._dormant.pop(rollout, None)
        if not payloads:
            return
        decoded = [messages.decode_message(p, max_bytes=self.max_message_bytes) for p in payloads]
        self._restore_strategy_state(rollout, decoded[0])
        for payload, msg in zip(payloads, decoded, strict=True):
            assert isinstance(msg, (*ROUND_INPUTS, Embeddings))
            try:
                self._on_round_message(payload, msg, now, replay=True)
            except RemoteProtocolError as exc:
                # A stored input that no longer applies: e.g. a secure-aggregation phase that closed at
                # its deadline before the restart is open again after it (deadlines are not stored), or an upload
                # of a device outside the new secret sample a sampling trusted edge drew after restarting.
                log.warning("replay of %s skipped: %s", msg.key, exc)
        role = self.roles.get(rollout)
        if role is None:
            return
        log.info("resumed rollout %s from state: round %s, %d updates", rollout, role.round, len(role.reported))
        for node in sorted(self._online):  # members that came online before the replay still get the task
            self._execute(rollout, role.resend(node, now))

    def _restore_strategy_state(self, rollout: str, task: Message) -> None:
        """Give the role what it carried over from the rounds before the stored one (an edge optimizer's
        moments), before that round (``task`` first) is replayed into it: the replay then ends where the edge was."""
        if not isinstance(task, CellTask):
            return
        try:
            role = self._role_for(task)
        except (RemoteProtocolError, PrivacyViolationError) as exc:  # the replay reports it for the task itself
            log.debug("no strategy state restored for %s: %s", rollout, exc)
            return
        # an asynchronous edge's newest checkpoint: its stored inputs are the ones after it (EdgeStore.save_checkpoint)
        saved = (self.store.latest_strategy_state(rollout) if rollout in self._asynchronous
                 else self.store.strategy_state_before(rollout, task.round))
        if saved is not None:
            role.load_strategy_state(npz_file.decode_arrays(saved))

    def _end_rollout(self, rollout: str) -> None:
        """The coordinator cleared the rollout's manifest: the rollout ended (or was retired).

        Clears the cell's retained copy (devices go idle) and forgets the rollout's state, so a
        restart replays nothing of it.
        """
        known = rollout in self.manifests or rollout in self.roles or rollout in self._dormant
        self.manifests.pop(rollout, None)
        self._live.discard(rollout)
        self._summary_due.discard(rollout)
        self.roles.pop(rollout, None)
        self._dormant.pop(rollout, None)
        for table in (self._round_bytes, self._failures):
            for key in [k for k in table if k[0] == rollout]:
                del table[key]
        stored = self.store.manifests().get(rollout)
        sha = hashlib.sha256(stored[1]).hexdigest() if stored is not None else ""
        self.store.forget(rollout, sha)
        self._ended[rollout] = sha or self._ended.get(rollout, "")
        self._recleared.add(rollout)
        self.cell_tx.publish(topics.cell_manifest(rollout, self.cell), b"", retain=True)
        if known:
            log.info("rollout %s ended: cleared its manifest in cell %s; %s", rollout, self.cell,
                     f"still in {', '.join(sorted(self.roles))}" if self.roles else "idle until the next rollout")

    def batch(self) -> AbstractContextManager[None]:
        """Handle the messages waiting in the inbox as one batch: their inputs are recorded in one transaction
        (one fsync instead of one per update) and ``run_loop`` acknowledges them only after it committed."""
        return self.store.batch()

    def tick(self, now: float) -> None:
        self._watch_connections()
        self._send_presence(now)
        for rollout, role in list(self.roles.items()):
            self._execute(rollout, role.tick(now))
            waiting = role.overdue(now)
            if waiting:
                self.report_overdue(f"round {role.round} (step {role.step}) of rollout {rollout} in cell {self.cell}",
                                    (rollout, role.round, role.step), waiting, now)

    # --- inbound ---------------------------------------------------------------------------------

    def handle(self, inbound: Inbound, now: float) -> None:
        parsed = self.parse_topic(inbound)
        if parsed is None:
            return
        if parsed.channel == "status":
            self._on_status(inbound, parsed, now)
        elif parsed.channel == "manifest":
            self._on_manifest(inbound, parsed, now)
        elif parsed.channel in ("cloud_down", "cell_up"):
            msg = self.decode_inbound(inbound, parsed)
            if msg is not None:
                self._on_message(inbound, msg, now)
        # Our own downlink echoes and other channels are not for us.

    def _on_message(self, inbound: Inbound, msg: Message, now: float) -> None:
        if msg.rollout in self._ended:
            self._refuse_ended(inbound, msg)
            return
        self._wake(msg.rollout, now)
        try:
            if isinstance(msg, ArtifactBlob):
                self._on_artifact(msg, now)
            elif isinstance(msg, ArtifactRequest):
                self._on_artifact_request(msg, now)
            elif isinstance(msg, ROUND_INPUTS) or type(msg) is Embeddings:
                self._on_round_message(inbound.payload, msg, now, wire_bytes=inbound.size_on_wire)
            else:
                raise UnexpectedMessageError(f"edge does not accept {msg.KIND}")
        except RemoteProtocolError as exc:
            self.reject(inbound, exc)
        except PrivacyViolationError as exc:
            self.metrics.inc(REJECTED, reason="privacy_violation")
            log.error("refused %s of round %d: %s", msg.KIND, msg.round, exc)

    def _refuse_ended(self, inbound: Inbound, msg: Message) -> None:
        """A message of a rollout that ended: rejected (``rollout_ended``), nothing of it accepted or stored. A task
        of it (a replay) also clears the cell's retained manifest of it once more, in case a broker kept or got
        back a copy: no device installs the rollout again. An asynchronous rollout's devices train until they
        hear it ended, so the deltas they had in flight are expected: counted, and logged at DEBUG."""
        if msg.rollout in self._asynchronous and isinstance(msg, (DeviceUpdate, TrainingFailed)):
            self.metrics.inc(REJECTED, reason="rollout_ended")
            log.debug("%s of %s after rollout %s ended (in flight when it ended)", msg.KIND, msg.sender, msg.rollout)
            return
        self.reject(inbound, RolloutEndedError(f"{msg.KIND} of round {msg.round} of rollout {msg.rollout!r}, which "
                                               "ended (its manifest was cleared)"))
        if isinstance(msg, CellTask) and msg.rollout not in self._recleared:
            self._recleared.add(msg.rollout)
            self.cell_tx.publish(topics.cell_manifest(msg.rollout, self.cell), b"", retain=True)

    def _role_for(self, msg: Message) -> EdgeRole:
        role = self.roles.get(msg.rollout)
        if role is None:
            if not isinstance(msg, CellTask):
                raise UnexpectedMessageError(f"no open round of rollout {msg.rollout!r}")
            module = algorithms.load(str(msg.config.get("algorithm", "")))
            if algorithms.describe(str(msg.config.get("algorithm", ""))).asynchronous:
                self._asynchronous.add(msg.rollout)
            self._check_clear_inputs(msg)
            new: EdgeRole = module.Edge(cell=self.cell, rollout=msg.rollout, parent=self.parent, noise=self.noise)
            role = self.roles[msg.rollout] = new
        return role

    def _check_clear_inputs(self, task: CellTask) -> None:
        """A trusted cell receives clear updates: only over TLS (unless the plan allows otherwise)."""
        privacy = task.config.get("privacy")
        if not isinstance(privacy, Mapping):
            return
        plan = NoisePlan.from_dict(privacy)
        cell = plan.cells.get(self.cell)
        if cell is not None and cell.clear_to_edge and plan.require_tls and not getattr(self.cell_tx, "secure", False):
            raise PrivacyViolationError(f"cell {self.cell} is trusted, so its devices send clear updates, but the "
                                        "cell broker connection has no TLS (configure [cell_broker] tls_*)")

    def _refuse_clear_aggregate(self, rollout: str, msg: CellUpdate) -> bool:
        """Defence in depth: never publish an un-noised aggregate of a trusted cell to the (untrusted) cloud."""
        role = self.roles.get(rollout)
        plan = role.noise_plan if role is not None else None
        if plan is None or not plan.cells[self.cell].trusted:
            return False
        try:  # the audit the cloud will run, before anything leaves the gateway
            audit.check_cell_update(plan, self.cell, msg.round, msg.privacy, msg.reported)
        except MissingReleaseError as exc:
            self.metrics.inc(REJECTED, reason="privacy_violation")
            log.error("refused to publish round %d of %s: %s", msg.round, rollout, exc)
            return True
        return False

    def _on_round_message(self, payload: bytes, msg: Message, now: float,
                          replay: bool = False, wire_bytes: int | None = None) -> None:
        if isinstance(msg, CellTask) and msg.sender != self.parent:
            raise UnexpectedMessageError(f"cell task from {msg.sender!r}, not from parent {self.parent!r}")
        role = self._role_for(msg)
        key = self._bytes_key(msg.rollout, msg.round)  # before the role moves on
        actions = role.receive(msg, now)
        duplicate = any(isinstance(a, Dropped) and a.key == msg.key for a in actions)
        if duplicate and isinstance(msg, CellTask) and not replay:
            self._publish_outputs_again(msg)
        if not duplicate:
            if not replay:
                # Accepted: make it durable before the broker is acknowledged (run_loop confirms
                # only after this returns), so a crash from here on loses nothing.
                self.store.record(msg.rollout, msg.round, msg.KIND, msg.key, payload)
                if isinstance(msg, CellTask) and msg.rollout not in self._asynchronous:
                    self.store.prune(msg.rollout, msg.round)
                self.metrics.inc(ACCEPTED, kind=msg.KIND)
            if isinstance(msg, TrainingFailed):
                self._training_failed(msg, replay)
            if msg.rollout in self._asynchronous and not isinstance(msg, CellTask):  # replayed ones count too
                self._since_checkpoint[msg.rollout] = self._since_checkpoint.get(msg.rollout, 0) + 1
            # the aggregation clock starts with a round's task, or with the first delta of an asynchronous buffer
            if isinstance(msg, CellTask) != (msg.rollout in self._asynchronous):
                self._task_arrived.setdefault(key, time.monotonic())
            if not isinstance(msg, CellTask):
                counts = self._round_bytes[key]
                size = len(payload) if wire_bytes is None else wire_bytes
                counts["device_up_bytes"] += size
                counts["device_up_f32_bytes"] += size - len(payload) + wire.float32_equivalent(payload)
                if msg.KIND == Embeddings.KIND:  # HSGD's vertical path, also counted on its own
                    counts["embedding_up_bytes"] += size
        self._execute(msg.rollout, actions)

    def _bytes_key(self, rollout: str, round: int) -> tuple[str, int]:
        """Where a message's bytes are counted: its round's, or under an asynchronous rollout (whose devices'
        rounds are the versions they started from) the cell update the edge is filling, numbered as it will be."""
        role = self.roles.get(rollout)
        if role is not None and rollout in self._asynchronous:
            return rollout, role.step
        return rollout, round

    def _training_failed(self, msg: TrainingFailed, replay: bool) -> None:
        """A device's ``training_failed`` the role accepted: kept for the round's cell update, counted, logged."""
        self._failures[self._bytes_key(msg.rollout, msg.round)][msg.sender] = msg.reason
        if replay:
            return
        self.metrics.inc(TRAINING_FAILED, reason=msg.reason)
        role = self.roles.get(msg.rollout)
        waiting = sorted(set(role.members) - set(role.reported) - {msg.sender}) if role is not None else []
        log.warning("%s could not train round %d step %d of %s (%s): the cell goes on without it this round%s; "
                    "if it keeps failing, look at its log (a crash of its training runtime, or the model)",
                    msg.sender, msg.round, msg.step, msg.rollout, msg.reason,
                    f" (still waiting for {listed(waiting)})" if waiting else "")

    def _publish_outputs_again(self, task: CellTask) -> None:
        """The coordinator sent the task of a round this cell has answered: publish the same answer again.

        It sends a cell its task again when the edge reconnects and it holds no update of the round from
        the cell: the update was lost after the broker acknowledged it (a broker restarted without
        persistence forgets what it had queued for the coordinator). The stored bytes go out, never a
        second aggregate (a second noisy release); a copy that did arrive is dropped there as a duplicate."""
        # An asynchronous edge's outputs are numbered by its own counter, not by the version: all it still holds
        # (those the cloud said it counted are gone, EdgeStore.prune_outputs; it drops any other it counted).
        payloads = self.store.outputs(task.rollout, None if task.rollout in self._asynchronous else task.round)
        for payload in payloads:
            kind = str(wire.peek_header(payload)["t"])
            self.cloud_tx.publish(topics.edge_up(task.rollout, self.cell, kind), payload)
        if payloads:
            log.info("round %d of %s asked for again: published the cell's %d stored message(s) again",
                     task.round, task.rollout, len(payloads))

    def _execute(self, rollout: str, actions: Sequence[Action]) -> None:
        self.diagnostics(actions)
        for action in actions:
            if isinstance(action, Note) and action.event == "cell_updates_counted":  # never to be sent again
                self.store.prune_outputs(rollout, int(action.fields["before"]))
            elif isinstance(action, Note) and action.event == "secagg_abort":
                self.metrics.inc(SECAGG_ABORTS, reason=action.fields.get("reason", "unknown"))
            elif isinstance(action, Note) and action.event == "secagg_waited":
                for phase, missing in dict(action.fields.get("waited", {})).items():
                    self.metrics.inc(SECAGG_WAITED, len(missing), phase=phase)
            elif isinstance(action, Broadcast):
                payload = action.message.encode(action.encodings)
                sent = self.cell_tx.publish(topics.cell_down(rollout, self.cell, action.message.KIND), payload)
                fanout = len(self.roles[rollout].members) or 1  # a broadcast reaches every member
                self._round_bytes[self._bytes_key(rollout, action.message.round)]["device_down_bytes"] += \
                    (sent or len(payload)) * fanout
            elif isinstance(action, SendToChild):
                payload = action.message.encode(action.encodings)
                sent = self.cell_tx.publish(
                    topics.cell_down(rollout, self.cell, action.message.KIND, action.child), payload)
                counts = self._round_bytes[self._bytes_key(rollout, action.message.round)]
                counts["device_down_bytes"] += sent or len(payload)
                if action.message.KIND == PartnerEmbeddings.KIND:
                    counts["embedding_down_bytes"] += sent or len(payload)
            elif isinstance(action, SendToParent):
                self._send_up(rollout, action)

    def _send_up(self, rollout: str, action: SendToParent) -> None:
        """The role's message for the cloud: its statistics added, stored (with the role's state) before it is
        published, or the stored bytes when a replay made it again; then published and logged."""
        msg = action.message
        role = self.roles.get(rollout)
        stats = dict(self._round_bytes.pop((rollout, msg.round), {}))
        stored = self.store.output(msg.key)
        if stored is None:
            if isinstance(msg, CellUpdate):
                rejected = [[reason, n] for reason, n in sorted(self._rejected.items())]
                self._rejected = defaultdict(int)
                failed = [[device, reason] for device, reason in
                          sorted(self._failures.pop((rollout, msg.round), {}).items())]
                if role is not None and role.sampling_secretly:
                    # byte and reject counts count the sampled devices' messages, a failure names one:
                    # participation stays in the cell
                    stats = dict.fromkeys(("device_up_bytes", "device_up_f32_bytes", "device_down_bytes"), 0)
                    rejected, failed = [], []
                msg = dataclasses.replace(msg, stats={**dict(msg.stats), **stats, "rejected": rejected,
                                                      **({"failed": failed} if failed else {})})
                if self._refuse_clear_aggregate(rollout, msg):
                    return
            stored = msg.encode(action.encodings)
            if rollout in self._asynchronous and isinstance(msg, CellUpdate):
                self._save_async_output(rollout, msg, stored, role)
            else:
                carried = role.strategy_state() if role is not None and isinstance(msg, CellUpdate) else None
                if carried is not None:  # committed with the output below: both or neither survive a crash
                    self.store.save_strategy_state(rollout, msg.round, npz_file.encode_arrays(carried))
                self.store.save_output(rollout, msg.round, msg.key, stored)
        # else: a replay closed the cell again; the same bytes go out, never a second noisy release
        self.cloud_tx.publish(topics.edge_up(rollout, self.cell, msg.KIND), stored)
        arrived = self._task_arrived.pop((rollout, msg.round), None)
        if isinstance(msg, secagg_messages.SecAggAborted):
            log.info("cell %s aborted round %s of %s in secure aggregation phase %s (%s): no update, the "
                     "abort -> cloud", self.cell, msg.round, rollout, msg.phase, msg.reason)
            return
        if arrived is not None:
            self.metrics.observe(AGGREGATION_SECONDS, time.monotonic() - arrived)
        log.info("cell %s closed round %s of %s: %d updates -> cloud", self.cell, msg.round, rollout,
                 len(getattr(msg, "reported", ())))

    def _save_async_output(self, rollout: str, msg: CellUpdate, stored: bytes, role: EdgeRole | None) -> None:
        """An asynchronous rollout's cell update, kept before it is published; with the role's state (a checkpoint:
        the inputs it holds are forgotten) once ``CHECKPOINT_SHARE`` of the cell's devices worth of inputs arrived
        since the last one. The state grows with the devices the edge knows, the inputs it replaces with the time
        since: a checkpoint at every cell update of a cell of 10,000 devices would cost more than its deltas."""
        due = self._since_checkpoint.get(rollout, 0) >= min(len(role.members) // CHECKPOINT_SHARE, CHECKPOINT_MAX) \
            if role is not None else False
        carried = role.strategy_state() if role is not None and due else None
        if carried is None:
            self.store.save_output(rollout, msg.round, msg.key, stored)
            return
        self.store.save_checkpoint(rollout, msg.round, msg.key, stored, npz_file.encode_arrays(carried))
        self._since_checkpoint[rollout] = 0

    # --- presence ---------------------------------------------------------------------------------

    def _on_status(self, inbound: Inbound, parsed: topics.Topic, now: float) -> None:
        if parsed.cell is None:  # a node-level presence topic: the edge follows its parent's only
            if parsed.device == self.parent and self.came_online(inbound, parsed) is not None:
                self._summary_due.update(self._live)  # a coordinator that (re)connected learns who is online
            return
        if parsed.cell != self.cell or parsed.device is None:
            return
        self._note_presence(parsed.device, inbound.payload)
        node = self.came_online(inbound, parsed)
        if node is None:
            return
        self._online.add(node)
        trainer = self.presence_docs.get(node, {}).get("trainer")
        if trainer is not None:  # optional: devices announce their training backend (older ones do not)
            log.info("%s came online (trainer: %s)", node, trainer)
        for rollout, role in list(self.roles.items()):
            self._execute(rollout, role.resend(node, now))

    def _note_presence(self, device: str, payload: bytes) -> None:
        """Keep whether ``device`` is online; a change is owed to the coordinators (``_send_presence``)."""
        if not payload:  # its retained presence was deleted: a device that is gone
            changed = self._devices_online.pop(device, None) is not None
        else:
            try:
                doc = json.loads(payload.decode())
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                return  # came_online rejects and counts it
            online = isinstance(doc, dict) and doc.get("state") == "online"
            changed = self._devices_online.get(device) != online
            self._devices_online[device] = online
        self._presence_seen = True
        if changed:
            self._summary_due.update(self._live)

    def _send_presence(self, now: float) -> None:
        """Tell each running rollout's coordinator which devices of the cell are online (``CellPresence``), at
        most every ``PRESENCE_SUMMARY_S``: the coordinator's ``fedtier_devices_online`` and ``rollout status``
        come from it where devices' own presence does not reach it (a gateway's bridge does not carry it)."""
        due = sorted(self._summary_due & self._live)
        if not due or now < self._next_summary or not self._presence_seen:
            return  # (no device has announced itself here: nothing to tell, e.g. in a simulation)
        self._next_summary = now + PRESENCE_SUMMARY_S
        self._summary_due.clear()
        online = tuple(sorted(d for d, up in self._devices_online.items() if up))
        for rollout in due:
            msg = CellPresence(rollout=rollout, round=0, sender=self.cell, online=online,
                               known=len(self._devices_online))
            self.cloud_tx.publish(topics.edge_up(rollout, self.cell, msg.KIND), msg.encode())
        log.debug("cell %s: %d of %d devices online -> %s", self.cell, len(online), len(self._devices_online),
                  ", ".join(due))

    def _watch_connections(self) -> None:
        """Act on a reconnection of either side (``MqttTransport.connects``; other transports never reconnect).

        Cell side: the broker may have restarted without persistence and lost the retained manifests, so they
        are published again (the same bytes: a device that has one changes nothing). Cloud side: the summaries
        again, in case the broker lost what it had queued for the coordinator.
        """
        for side, tx in (("cell", self.cell_tx), ("cloud", self.cloud_tx)):
            connects = getattr(tx, "connects", 0)
            if not isinstance(connects, int) or connects <= self._connects[side]:
                continue
            again = self._connects[side] > 0
            self._connects[side] = connects
            if again and side == "cell":
                self._republish_manifests()
            elif again:
                self._summary_due.update(self._live)

    # --- manifests and artifacts ------------------------------------------------------------------

    def _on_manifest(self, inbound: Inbound, parsed: topics.Topic, now: float) -> None:
        if parsed.rollout is None:
            return
        if not inbound.payload:
            self._end_rollout(parsed.rollout)
            return
        if parsed.rollout in self._ended:
            if hashlib.sha256(inbound.payload).hexdigest() == self._ended[parsed.rollout]:
                log.debug("the manifest of %s again, which ended: ignored", parsed.rollout)
                return
            log.info("rollout %s ended before; a new manifest of it starts it again", parsed.rollout)
            del self._ended[parsed.rollout]
            self._recleared.discard(parsed.rollout)
            self.store.restarted(parsed.rollout)
        try:
            # With trusted keys: a valid signature, a newer version, not expired — an edge never
            # relays into its cell what its devices would refuse (or what could roll them back).
            manifest = self.gate.check(inbound.payload)
            if manifest is None:
                self._wake(parsed.rollout, now)  # the relayed manifest again: the rollout still runs
                self._seen_running(parsed.rollout)
                return
            if manifest.rollout != parsed.rollout:
                raise UnexpectedMessageError("manifest rollout differs from its topic")
        except RemoteProtocolError as exc:
            self.reject(inbound, exc)
            return
        if self.cell not in manifest.cells:
            return
        known = self.manifests.get(manifest.rollout)
        if known is not None and manifest.version < known.version:
            log.warning("ignoring manifest v%d of %s: have v%d", manifest.version, manifest.rollout, known.version)
            return
        self.manifests[manifest.rollout] = manifest
        self.gate.installed(manifest, inbound.payload)
        self.store.save_manifest(manifest.rollout, manifest.version, inbound.payload)
        self.cell_tx.publish(topics.cell_manifest(manifest.rollout, self.cell), inbound.payload, retain=True)
        log.info("manifest v%d of rollout %s relayed to cell %s", manifest.version, manifest.rollout, self.cell)
        self._live.add(manifest.rollout)
        self._summary_due.add(manifest.rollout)
        self._wake(manifest.rollout, now)
        missing = [d for d in manifest.digests_for(self.cell).values() if not self.cache.has(d)]
        if missing:
            self._request_from_cloud(manifest.rollout, missing, now=None)

    def _seen_running(self, rollout: str) -> None:
        """The coordinator's manifest of an installed rollout, the first time since this edge started: the
        rollout still runs. Its cell copy is published again, once (a gateway that restarted with its broker
        has lost it, and the same bytes change nothing for a device that has them)."""
        if rollout in self._live or rollout not in self.manifests:
            return
        self._live.add(rollout)
        self._summary_due.add(rollout)
        stored = self.store.manifests().get(rollout)
        if stored is not None:
            self.cell_tx.publish(topics.cell_manifest(rollout, self.cell), stored[1], retain=True)

    def _republish_manifests(self) -> None:
        """Publish the cell's retained manifests of running rollouts again (the same bytes) after the edge
        reconnected to its cell broker: a broker restarted without persistence has lost them, and a device that
        (re)starts then would wait for a manifest for ever; devices take the same manifest again as a no-op."""
        again = [(rollout, payload) for rollout, (_, payload) in sorted(self.store.manifests().items())
                 if rollout in self._live]
        for rollout, payload in again:
            self.cell_tx.publish(topics.cell_manifest(rollout, self.cell), payload, retain=True)
        if again:
            log.info("reconnected to the broker of cell %s: published its %d manifest(s) again", self.cell,
                     len(again))

    def _allowed_digests(self, rollout: str) -> set[str]:
        manifest = self.manifests.get(rollout)
        return set(manifest.digests_for(self.cell).values()) if manifest else set()

    def _request_from_cloud(self, rollout: str, digests: list[str], now: float | None) -> None:
        fresh = [d for d in digests if now is None or now - self._requested.get(d, -math.inf) > ARTIFACT_REREQUEST_S]
        if not fresh:
            return
        for d in fresh:
            self._requested[d] = now if now is not None else 0.0
        req = ArtifactRequest(rollout=rollout, round=0, sender=self.cell, digests=tuple(sorted(fresh)))
        self.cloud_tx.publish(topics.edge_up(rollout, self.cell, req.KIND), req.encode())

    def _on_artifact_request(self, req: ArtifactRequest, now: float) -> None:
        allowed = self._allowed_digests(req.rollout)
        unknown = [d for d in req.digests if d not in allowed]
        if unknown:
            raise UnexpectedMessageError(f"request for artifacts not in the manifest: {unknown}")
        manifest = self.manifests[req.rollout]
        names = {sha: name for name, sha in manifest.digests_for(self.cell).items()}
        missing = []
        for sha in req.digests:
            if (req.rollout, sha) in self._blob_payloads:  # sent before: neither read nor hashed again
                self._serve(req.rollout, sha, names[sha], None, now, req.sender)
                continue
            data = self.cache.get(sha)
            if data is None:
                missing.append(sha)
                self._wanted.setdefault(sha, set()).add((req.rollout, req.sender))
                continue
            self._serve(req.rollout, sha, names[sha], data, now, req.sender)
        if missing:
            self._request_from_cloud(req.rollout, missing, now)

    def _serve(self, rollout: str, sha: str, name: str, data: bytes | None, now: float, device: str) -> None:
        """Send file ``sha`` to ``device``. ``data`` is the file's bytes, or None once its message is encoded:
        each of a cell's thousand devices asks for the same files, which are read, checked and encoded once,
        not a thousand times."""
        if now - self._served.get((sha, device), -math.inf) < ARTIFACT_RESERVE_S:
            return  # sent moments ago: the device asked twice before it arrived
        payload = self._blob_payloads.get((rollout, sha))
        if payload is None:
            assert data is not None, "a file's bytes are needed until its message is encoded"
            if len(self._blob_payloads) >= 64:  # files of rollouts long installed
                self._blob_payloads.clear()
            blob = ArtifactBlob(rollout=rollout, round=0, sender=self.cell, sha256=sha, name=name, data=data)
            payload = self._blob_payloads[(rollout, sha)] = blob.encode()
        self.cell_tx.publish(topics.cell_down(rollout, self.cell, ArtifactBlob.KIND, device), payload)
        if len(self._served) >= 100_000:
            self._served = {k: t for k, t in self._served.items() if now - t < ARTIFACT_RESERVE_S}
        self._served[(sha, device)] = now

    def _on_artifact(self, blob: ArtifactBlob, now: float) -> None:
        if blob.sha256 not in self._allowed_digests(blob.rollout):
            raise UnexpectedMessageError(f"artifact {blob.sha256[:12]} is not in the manifest")
        self.cache.put(blob.sha256, blob.data)  # ShaMismatchError (a DecodeError) if the bytes are wrong
        for rollout, device in sorted(self._wanted.pop(blob.sha256, ())):  # devices waiting for it
            self._serve(rollout, blob.sha256, blob.name, blob.data, now, device)

"""The device node: hosts a device role with a trainer, local data and an outbox.

Flow for one rollout:

1. the cell's retained manifest arrives -> the device lists the artifact files it lacks
   and asks its edge for them (``artifact_request``), re-asking every few seconds;
2. each ``artifact`` is verified against its sha256 and cached; once all are present the
   bundle is assembled, verified again as a whole, and a trainer is built from it;
3. a ``device_task`` (broadcast, or on the device's own catch-up topic) goes to the role;
   a task that arrives before the trainer is ready waits (only the newest is kept);
4. the role's ``LocalTrain`` runs on the trainer with minibatches drawn from the named
   RNG stream; the resulting ``device_update`` is written to the outbox, then published,
   and deleted from the outbox when the broker acknowledges it (its bytes stay in the state
   until a newer step's upload, to be sent again if the edge asks for that step again: a
   broker restarted without persistence loses what it acknowledged but had not delivered).

After a restart, a rollout the device had installed (its manifest is in the state) is installed again
only once its edge shows that it still runs — the cell's retained manifest arrives again (the same
bytes, or a newer version) — as the edge does for its own stored rollouts. Until then its tasks wait
(the newest is kept); a cleared manifest ends the rollout and drops them. So a task of a stopped or
ended rollout that the broker redelivers from the device's persistent session is never trained.

Local work is guarded (``DESIGN`` §9, containment): the work in progress is recorded in the state
before the trainer runs and cleared when it is done (``DeviceState.begin_work``). A record still open
at the next start means the agent died in that work (a native crash of the training runtime leaves no
exception to catch); after ``max_task_crashes`` such deaths the work is not started again and the role
reports ``training_failed`` (``crash``) to the edge, which closes the round without this device. An
exception of the trainer (``error``) or a result with NaN or infinity (``non_finite``) is reported the
same way at once. The device takes the next round's task as usual.

A device with held-out rows (``eval_data``: its shard's ``eval/`` directory) tells its role so;
the role then asks for an ``Evaluate`` of each round's incoming global model, which this shell
runs on those rows before the round's training (federated evaluation): loss, rows right and, on a
binary task whose held-out rows hold both classes, the AUROC (numpy, ``fedtier.training.ranking``).

X-risk roles (FeDXL) ask instead for ``ScoreRows`` (score rows drawn by class with the named stream)
and ``ScoreGradient`` (the gradient of a weighted sum of those scores), one pair per local step;
the role keeps the model and does the arithmetic between them.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections import deque
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from device_agent import hybrid
from device_agent.data import LocalData, fit_to_model
from device_agent.faults import Fault
from device_agent.hybrid import SplitProvider
from device_agent.state import DeviceState, MemoryDeviceState
from fedtier import algorithms, rng
from fedtier.algorithms import aggregate
from fedtier.algorithms.base import (
    Action,
    ComputeGradient,
    DeviceRole,
    Embed,
    Evaluate,
    GradientResult,
    LocalResult,
    LocalTrain,
    RowScores,
    ScoreGradient,
    ScoreRows,
    SendToParent,
    SplitTrain,
)
from fedtier.algorithms import hsgd
from fedtier.artifacts import split_bundle
from fedtier.artifacts.bundle import ArtifactBundle
from fedtier.artifacts.cache import ArtifactCache
from fedtier.errors import (
    ArtifactError,
    ConfigError,
    DecodeError,
    LocalProtocolError,
    PrivacyViolationError,
    RemoteProtocolError,
    UnexpectedMessageError,
)
from fedtier.privacy.mechanism import NoiseSource
from fedtier.privacy.plan import NoisePlan
from fedtier.runtime.metrics import Metrics
from fedtier.secagg import messages as secagg_messages
from fedtier.runtime.node_base import REJECTED, NodeBase
from fedtier.security.manifest import Manifest
from fedtier.security.signing import ManifestGate, open_manifest
from fedtier.training import ranking
from fedtier.training.batching import class_rows, minibatch_indices
from fedtier.training.layout import ArchSpec
from fedtier.training.trainer import Trainer
from fedtier.transport import topics
from fedtier.transport.base import Inbound, Transport
from fedtier.wire import envelope
from fedtier.wire.messages import (
    ArtifactBlob,
    ArtifactRequest,
    CellStep,
    DeviceTask,
    EvalStats,
    PartnerEmbeddings,
    TrainingFailed,
)

log = logging.getLogger("fedtier.agent")

ARTIFACT_RETRY_S = 5.0
PENDING_MESSAGES = 16
"""How many role messages (after its task) a node keeps while its trainer loads."""
TrainerProvider = Callable[[ArtifactBundle], Trainer]
TRAINING_FAILED = "fedtier_training_failed_total"
"""Local work a device could not compute and reported as ``training_failed``, by reason (crash, error,
non_finite); an edge counts its devices' reports under the same name."""
LOCAL_WORK = (LocalTrain, ComputeGradient, Evaluate, ScoreRows, ScoreGradient, Embed, SplitTrain)
"""The actions a device shell computes with its trainer (guarded: ``_local_work``)."""
DEFAULT_MAX_TASK_CRASHES = 2


class DeviceNode(NodeBase):
    """Device ``device_id`` of cell ``cell``; transport-agnostic (MQTT, or memory in simulation)."""

    def __init__(self, *, device_id: str, cell: str, transport: Transport, data: LocalData,
                 trainer_provider: TrainerProvider, state: DeviceState | MemoryDeviceState, cache: ArtifactCache,
                 bundles_dir: Path, metrics: Metrics | None = None, max_message_bytes: int = 64 << 20,
                 trusted_keys: Mapping[str, Any] | None = None, noise: NoiseSource | None = None,
                 eval_data: LocalData | None = None, side: str = "device", row_ids: tuple[str, ...] | None = None,
                 split_provider: SplitProvider | None = None, max_task_crashes: int = DEFAULT_MAX_TASK_CRASHES,
                 fault: Fault | None = None) -> None:
        super().__init__(device_id, metrics or Metrics(node=device_id, role=side), log, max_message_bytes)
        self.max_task_crashes = max_task_crashes
        """Deaths in the same work after which it is reported failed instead of started again."""
        self.fault = fault
        """Tests only (``device_agent.faults``): fail on purpose before the trainer runs."""
        if side not in hybrid.SIDES:
            raise ConfigError(f"role must be one of {', '.join(hybrid.SIDES)}, not {side!r}", key="role")
        self.side = side
        """``device``, or ``host``: HSGD's feature party of the cell (its rows are ``row_ids``)."""
        self.row_ids = row_ids if row_ids is not None else (device_id,) * len(data)
        """HSGD: the sample id of each local row (a device's one row is its own id)."""
        self.split_provider = split_provider or hybrid.split_provider("ort")
        self.noise = noise if noise is not None else NoiseSource()  # OS-seeded; never stored
        self.device_id = device_id
        self.cell = cell
        self.tx = transport
        self.data = data
        self.eval_data = eval_data if eval_data is not None and len(eval_data) else None
        self.trainer_provider = trainer_provider
        self.state = state
        self.cache = cache
        self.bundles_dir = Path(bundles_dir)
        self.manifests: dict[str, Manifest] = {}  # installed: their trainers are in use
        self.incoming: dict[str, tuple[Manifest, bytes]] = {}  # accepted, artifacts not yet in
        self.resumable: dict[str, tuple[Manifest, bytes]] = {}
        """Installed before a restart, waiting for the edge's retained manifest to show the rollout still runs."""
        self.gate = ManifestGate(trusted_keys or {}, installed_version=state.manifest_version())
        self.trainers: dict[str, Any] = {}
        """Rollout -> its trainer: a ``Trainer``, or HSGD's split trainer (``embed``, ``train``)."""
        self.roles: dict[str, DeviceRole] = {}
        self._pending_task: dict[str, DeviceTask] = {}
        self._pending_msgs: dict[str, list[Any]] = {}
        """Messages for a role (HSGD's partner rows) that came before its trainer was ready."""
        self._asked: dict[str, float] = {}
        self.rounds_done = 0

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self, now: float) -> None:
        for topic_filter in topics.device_down_filters(self.cell, self.device_id):
            self.tx.subscribe(topic_filter)
        self._report_open_work()
        self._resume_installed(now)
        pending = self.state.pending()
        moved = 0
        for key, topic, payload in pending:
            here = self._here(topic)
            if here != topic:
                self.state.retopic(key, here)  # sent from here: asked for again, it is sent here again
                moved += 1
            self._publish_update(key, here, payload)
        if pending:
            log.info("resent %d unacknowledged update(s) from the outbox%s", len(pending),
                     f" ({moved} queued in another cell: sent to cell {self.cell}, where this device is now)"
                     if moved else "")

    def _here(self, topic: str) -> str:
        """``topic`` of an upload, in the cell this device is in now: an upload queued in another cell (the device
        moved, a roaming rollout) goes to where it is, which is the edge it can reach (and the only uplink its
        broker lets it publish on)."""
        parsed = topics.parse(topic)
        if parsed is None or parsed.channel != "cell_up" or parsed.cell == self.cell or parsed.rollout is None \
                or parsed.kind is None:
            return topic
        return topics.cell_up(parsed.rollout, self.cell, self.device_id, parsed.kind)

    def _report_open_work(self) -> None:
        """Say what the previous run died in: local work recorded as started and never finished."""
        for rollout, round, step, attempts, failed in self.state.open_work():
            if failed is not None:
                continue
            left = self.max_task_crashes - attempts
            log.error("the previous run of this agent died while it trained round %d step %d of %s (%d time(s) "
                      "so far): a crash of the training runtime (its output is in the service's log, e.g. "
                      "journalctl), or a kill; %s", round, step, rollout, attempts,
                      f"it is trained again if asked ({left} more death(s) and it is reported as failed)" if left > 0
                      else "if asked again it is not trained: reported to the edge as training_failed (crash)")

    def _resume_installed(self, now: float) -> None:
        """Install again, from this device's state, the manifests it had installed before a restart, once
        the edge shows each rollout still runs (``_on_manifest``: its retained copy arrives).

        The edge's retained copy of a manifest is the same bytes: the gate takes it for a
        redelivery. Without this, a fleet with signed manifests would refuse it as not newer
        than the installed version, and a restarted device would never train again.
        """
        for rollout, raw in self.state.installed_manifests().items():
            try:
                manifest = open_manifest(raw, self.gate.trusted)
            except RemoteProtocolError as exc:
                log.warning("not resuming rollout %s: its stored manifest does not verify any more (%s)", rollout, exc)
                self.state.forget_manifest(rollout)
                continue
            self.gate.installed(manifest, raw)
            self.resumable[rollout] = (manifest, raw)
            log.info("resuming rollout %s with its installed manifest v%d once its edge shows it still runs (its "
                     "retained manifest); its tasks wait until then", rollout, manifest.version)

    def _confirmed(self, rollout: str, now: float) -> None:
        """The cell's retained manifest of ``rollout`` is the one installed before a restart: it still runs."""
        resumed = self.resumable.pop(rollout, None)
        if resumed is not None:
            self.incoming[rollout] = resumed
            self._ensure_ready(rollout, now)

    def _end_rollout(self, rollout: str) -> None:
        """The edge cleared the rollout's manifest: the rollout ended (or was retired)."""
        known = rollout in self.manifests or rollout in self.incoming or rollout in self.resumable
        dropped = self._pending_task.get(rollout)
        for table in (self.manifests, self.incoming, self.resumable, self.trainers, self.roles, self._pending_task,
                      self._asked, self._pending_msgs):
            table.pop(rollout, None)
        self.state.forget_manifest(rollout)
        if dropped is not None:
            log.info("dropped the waiting task of round %d of %s, which ended: not trained", dropped.round, rollout)
        if known:
            active = sorted(self.manifests)
            log.info("rollout %s ended; %s", rollout,
                     f"still in {', '.join(active)}" if active else "idle until the next rollout")

    def tick(self, now: float) -> None:
        for rollout in list(self.incoming):
            # Files arrive through ``_on_artifact``; a tick only re-asks for the missing ones when due (checking
            # the cache every tick costs a thousand devices of one machine more than their training).
            if now - self._asked.get(rollout, -math.inf) >= ARTIFACT_RETRY_S:
                self._ensure_ready(rollout, now)
        for rollout, role in self.roles.items():
            self._execute(role.tick(now), now, rollout)

    # --- inbound -------------------------------------------------------------------------------------

    def handle(self, inbound: Inbound, now: float) -> None:
        parsed = topics.parse(inbound.topic)
        if parsed is None or parsed.channel not in ("cell_manifest", "cell_down"):
            return  # not for us (our own uplink echo, other channels)
        if parsed.channel == "cell_manifest":
            self._on_manifest(inbound, parsed, now)
            return
        if parsed.device is not None and parsed.device != self.device_id:
            return  # another device's catch-up message
        if parsed.kind == ArtifactRequest.KIND:
            return  # another device's request echoed on a shared broker
        if parsed.kind == ArtifactBlob.KIND and not self._wants_blob(parsed.rollout, inbound.payload):
            return  # another device's download on the shared downlink: dropped before its body is hashed
        msg = self.decode_inbound(inbound, parsed)
        if msg is None:
            return
        try:
            if isinstance(msg, DeviceTask):
                self._on_task(msg, now)
            elif isinstance(msg, (CellStep, PartnerEmbeddings, *secagg_messages.DOWNWARD)):
                role = self.roles.get(msg.rollout)
                if role is None and msg.rollout in self._pending_task:
                    held = self._pending_msgs.setdefault(msg.rollout, [])
                    if len(held) < PENDING_MESSAGES:  # the task came and the trainer is loading: keep it for them
                        held.append(msg)
                        return
                if role is None:
                    raise UnexpectedMessageError(f"{msg.KIND} of rollout {msg.rollout!r}, which this device is not in")
                self._execute(role.receive(msg, now), now, msg.rollout)
            elif isinstance(msg, ArtifactBlob):
                self._on_artifact(msg, now)
            else:
                raise UnexpectedMessageError(f"device does not accept {msg.KIND}")
        except RemoteProtocolError as exc:
            self.reject(inbound, exc)

    def _on_manifest(self, inbound: Inbound, parsed: topics.Topic, now: float) -> None:
        if not inbound.payload:
            if parsed.rollout is not None:
                self._end_rollout(parsed.rollout)
            return
        try:
            manifest = self.gate.check(inbound.payload)
            if manifest is None:  # the installed manifest again (retained redelivery): the rollout still runs
                if parsed.rollout is not None:
                    self._confirmed(parsed.rollout, now)
                return
            if manifest.rollout != parsed.rollout:
                raise UnexpectedMessageError("manifest rollout differs from its topic")
        except RemoteProtocolError as exc:
            self.reject(inbound, exc)
            return
        if self.cell not in manifest.cells:
            log.info("manifest of rollout %s does not include cell %s; ignoring", manifest.rollout, self.cell)
            return
        self.resumable.pop(manifest.rollout, None)  # a newer manifest: the rollout runs, with it
        self.incoming[manifest.rollout] = (manifest, inbound.payload)
        log.info("manifest v%d of rollout %s accepted (%s, bundle %s); fetching artifacts", manifest.version,
                 manifest.rollout, manifest.algorithm,
                 str(manifest.bundle_for(self.cell).get("bundle_id", ""))[:12])
        self._ensure_ready(manifest.rollout, now)

    def _on_task(self, task: DeviceTask, now: float) -> None:
        if task.rollout not in self.trainers:
            # Keep the newest task until artifacts are in; a task of the same round for others (HSGD's broadcast
            # to the selected devices, after the host's own task) must not replace this node's own.
            pending = self._pending_task.get(task.rollout)
            if pending is None or self.device_id in task.members or task.round > pending.round:
                self._pending_task[task.rollout] = task
            return
        self._run_task(task, now)

    def _wants_blob(self, rollout: str | None, payload: bytes) -> bool:
        """Whether an artifact message holds a file this device still needs, from its header alone.

        Edges send each device the files it asked for, but an older edge broadcasts them to its whole
        cell (once per request window); in a cell of 1,000 devices that start over minutes, decoding
        each (a sha256 over its body) costs more than the training. A header that cannot be read is
        decoded, so it is rejected and counted as usual."""
        manifest, _ = self.incoming.get(rollout or "", (None, b""))
        if manifest is None:
            return False
        try:
            sha = envelope.peek_header(payload).get("m", {}).get("sha256")
        except (DecodeError, AttributeError):
            return True
        return sha in manifest.digests_for(self.cell).values() and not self.cache.has(str(sha))

    def _on_artifact(self, blob: ArtifactBlob, now: float) -> None:
        manifest, _ = self.incoming.get(blob.rollout, (None, b""))
        if manifest is None or blob.sha256 not in manifest.digests_for(self.cell).values():
            return  # not something we need (another device's download on the shared downlink)
        if not self.cache.has(blob.sha256):
            self.cache.put(blob.sha256, blob.data)  # ShaMismatchError if the bytes are wrong
        self._ensure_ready(blob.rollout, now)

    # --- artifacts -> trainer ---------------------------------------------------------------------------

    def _ensure_ready(self, rollout: str, now: float) -> None:
        """Fetch what an incoming manifest needs; install it once it is complete and healthy."""
        manifest, raw = self.incoming[rollout]
        missing = sorted({sha for sha in manifest.digests_for(self.cell).values() if not self.cache.has(sha)})
        if missing:
            asked = self._asked.get(rollout, -math.inf)
            if now - asked >= ARTIFACT_RETRY_S:
                self._asked[rollout] = now
                req = ArtifactRequest(rollout=rollout, round=0, sender=self.device_id, digests=tuple(missing))
                self.tx.publish(topics.cell_up(rollout, self.cell, self.device_id, req.KIND), req.encode())
                log.info("requested %d artifact file(s) of rollout %s", len(missing), rollout)
            return
        del self.incoming[rollout]
        if split_bundle.is_split(manifest.bundle_for(self.cell)):
            self._install_split(rollout, manifest, raw, now)
            return
        if self.side == "host":
            log.error("manifest v%d of rollout %s (%s) refused, not taking part: this node is an hsgd host "
                      "(role = \"host\"), and only hsgd has hosts", manifest.version, rollout, manifest.algorithm)
            self.metrics.inc(REJECTED, reason="unusable_artifacts")
            return
        try:
            bundle = self._assemble(manifest)
            data = self._fitted_data(bundle.arch)
            held_out = fit_to_model(self.eval_data, bundle.arch) if self.eval_data is not None else None
            trainer = self.trainer_provider(bundle)
            self._health_check(trainer, data)
        except (ArtifactError, ConfigError) as exc:
            # Whatever was wrong, nothing of the new bundle is in use: the device keeps its
            # previous model (if it had one) and the edge sees it absent from this rollout.
            self.metrics.inc(REJECTED, reason="unusable_artifacts")
            keeping = "keeping the previous model" if rollout in self.trainers else "not taking part"
            log.error("manifest v%d of rollout %s refused, %s: %s", manifest.version, rollout, keeping, exc)
            return
        self.data = data
        self.eval_data = held_out
        self._installed(rollout, manifest, raw, trainer, now)

    def _installed(self, rollout: str, manifest: Manifest, raw: bytes, trainer: Any, now: float) -> None:
        self.trainers[rollout] = trainer
        self.manifests[rollout] = manifest
        self.gate.installed(manifest, raw)
        self.state.set_manifest_version(self.gate.installed_version)
        self.state.save_manifest(rollout, manifest.version, raw)
        log.info("manifest v%d of rollout %s installed; trainer loaded", manifest.version, rollout)
        task = self._pending_task.pop(rollout, None)
        if task is not None:
            self._run_task(task, now)
        for msg in self._pending_msgs.pop(rollout, []):
            role = self.roles.get(rollout)
            try:
                if role is None:
                    raise UnexpectedMessageError(f"{msg.KIND} of rollout {rollout!r}, which this device is not in")
                self._execute(role.receive(msg, now), now, rollout)
            except RemoteProtocolError as exc:
                self.metrics.inc(REJECTED, reason=exc.reason)
                log.warning("rejected a held %s of %s: %s", msg.KIND, rollout, exc)

    def _install_split(self, rollout: str, manifest: Manifest, raw: bytes, now: float) -> None:
        """HSGD: assemble the split bundle, key the local rows by sample id, build this side's trainer."""
        try:
            bundle = split_bundle.assemble(manifest.bundle_for(self.cell), self.cache.path, self.bundles_dir)
            x, y = hybrid.rows_by_id(self.data, self.row_ids, bundle, self.side)
            trainer = self.split_provider(bundle, self.side, x, y)
            hybrid.health_check(trainer, bundle, self.side, self.row_ids)
        except (ArtifactError, ConfigError) as exc:
            self.metrics.inc(REJECTED, reason="unusable_artifacts")
            log.error("manifest v%d of rollout %s refused, not taking part as an hsgd %s: %s", manifest.version,
                      rollout, self.side, exc)
            return
        self._installed(rollout, manifest, raw, trainer, now)

    def _health_check(self, trainer: Trainer, data: LocalData) -> None:
        """The new model loads and one evaluation step on local data gives a finite loss."""
        n = min(len(data), 32)
        try:
            loss = trainer.evaluate(data.x[:n], data.y[:n]).loss
        except (LocalProtocolError, RuntimeError, ValueError) as exc:
            raise ArtifactError(f"health check failed: {exc}") from exc
        if not math.isfinite(loss):
            raise ArtifactError(f"health check failed: loss {loss} on local data")

    def _fitted_data(self, arch: ArchSpec) -> LocalData:
        """Local data checked against the model, laid out as it takes it (``fit_to_model``).

        Raises:
            ConfigError: no samples, examples of the wrong size, or labels that do not fit the loss.
        """
        return fit_to_model(self.data, arch)

    def _assemble(self, manifest: Manifest) -> ArtifactBundle:
        """Lay the cached files out as a bundle directory and verify it as a whole."""
        descriptor = ArtifactBundle.from_json(manifest.bundle_for(self.cell))
        directory = self.bundles_dir / descriptor.bundle_id
        directory.mkdir(parents=True, exist_ok=True)
        for entry in descriptor.files.values():
            target = directory / entry.filename
            if not target.exists():
                source = self.cache.path(entry.sha256)
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copyfile(source, target)
        bundle = ArtifactBundle.from_json(manifest.bundle_for(self.cell), directory=directory)
        try:
            current = ArtifactBundle.load(directory, verify=False).bundle_id
        except ArtifactError:
            current = None
        if current != bundle.bundle_id:
            bundle.save()
        return ArtifactBundle.load(directory, verify=True)

    # --- the round ------------------------------------------------------------------------------------

    def _role(self, task: DeviceTask) -> DeviceRole:
        role = self.roles.get(task.rollout)
        if role is None and task.config.get("algorithm") == hsgd.NAME:
            # HSGD: the host, or a device; an interval's state lives in the edge, which re-sends what a
            # restarted node still owes (so nothing of it is restored here).
            role = (hsgd.Host(host_id=self.device_id, cell=self.cell, rollout=task.rollout) if self.side == "host"
                    else hsgd.Device(device_id=self.device_id, cell=self.cell, rollout=task.rollout))
            self.roles[task.rollout] = role
        if role is None:
            module = algorithms.load(str(task.config.get("algorithm", "")))
            new: DeviceRole = module.Device(device_id=self.device_id, cell=self.cell, rollout=task.rollout,
                                            last_round=self.state.last_round(task.rollout),
                                            last_sent=self.state.last_sent(task.rollout), noise=self.noise,
                                            evaluate=self.eval_data is not None)
            role = self.roles[task.rollout] = new
        return role

    def _run_task(self, task: DeviceTask, now: float) -> None:
        try:
            self._check_privacy(task)
        except (PrivacyViolationError, RemoteProtocolError) as exc:
            reason = getattr(exc, "reason", "privacy_violation")
            self.metrics.inc(REJECTED, reason=reason)
            log.error("refused the task of round %d of %s: %s", task.round, task.rollout, exc)
            return
        self._send_upload_again(task)
        role = self._role(task)
        self._execute(role.receive(task, now), now, rollout=task.rollout)

    def _send_upload_again(self, task: DeviceTask) -> None:
        """The edge asks for a step this device has uploaded already: send the same bytes again.

        The edge sends a member its task again when the member reconnects and it holds no upload of
        the step from it: the upload was lost after the broker acknowledged it (a broker restarted
        without persistence forgets what it had queued for the edge). The role does not train the step
        again (a second noisy release); without these bytes the cell would wait for it for ever. A copy
        that did reach the edge is dropped there as a duplicate."""
        if self.device_id not in task.members:
            return
        kept = self.state.uploads(task.rollout, task.round, task.step)
        if not kept:
            return
        queued = {key for key, _, _ in self.state.pending()}  # still in the outbox: the transport has it
        # Only what went to this cell: an upload another cell's broker acknowledged (the device moved since) was
        # that cell's to deliver; sent here as well, the same device-step would reach two edges.
        again = [(key, topic, payload) for key, topic, payload in kept
                 if key not in queued and self._here(topic) == topic]
        for key, topic, payload in again:
            self._publish_update(key, topic, payload)
        if again:
            log.info("round %d step %d of %s asked for again: sent the same %d upload(s) again", task.round,
                     task.step, task.rollout, len(again))

    def _check_privacy(self, task: DeviceTask) -> None:
        """The task's noise plan must be the signed manifest's (an edge cannot weaken it), and a
        clear update (trusted edge) may only leave over TLS."""
        manifest = self.manifests.get(task.rollout)
        planned = manifest.extra.get("privacy") if manifest is not None else None
        carried = task.config.get("privacy")
        if planned != carried:
            raise UnexpectedMessageError("the task's noise plan differs from the rollout manifest's")
        if carried is None:
            return
        plan = NoisePlan.from_dict(carried)
        cell = plan.cells.get(self.cell)
        if cell is not None and cell.clear_to_edge and plan.require_tls and not getattr(self.tx, "secure", False):
            raise PrivacyViolationError(f"cell {self.cell} is trusted, so updates go to it without noise, but the "
                                        "broker connection has no TLS (configure [broker] tls_*; or set "
                                        "[privacy] require_tls = false on the coordinator for a lab setup)")

    def _execute(self, actions: Sequence[Action], now: float, rollout: str) -> None:
        """Run a role's actions in order; the actions local work answers with run before the rest (depth
        first, as nested calls would), from a queue so that many local steps do not nest Python frames.

        The work records begun here are cleared once every action ran: an exception escaping (a bug, which
        crashes the agent) leaves them open, so the next start counts it as a death in that work."""
        self.diagnostics(actions)
        role = self.roles[rollout]
        queue = deque(actions)
        begun: set[tuple[int, int]] = set()
        while queue:
            action = queue.popleft()
            follow: Sequence[Action] | None = None
            if isinstance(action, LOCAL_WORK):
                follow, failed = self._local_work(role, rollout, action, begun)
                if failed:  # the role gave the round up: the rest of its work is moot
                    queue = deque(a for a in queue if not isinstance(a, LOCAL_WORK))
            elif isinstance(action, SendToParent):
                self._send(role, action, now)
            if follow is not None:
                self.diagnostics(follow)
                queue.extendleft(reversed(follow))
        for round, step in sorted(begun):
            self.state.end_work(rollout, round, step)

    def _send(self, role: DeviceRole, action: SendToParent, now: float) -> None:
        msg = action.message
        topic = topics.cell_up(msg.rollout, self.cell, self.device_id, msg.KIND)
        payload = msg.encode(action.encodings)
        # Written (with the round progress the role reached) before it is published.
        self.state.put_update(msg.key, topic, payload, msg.rollout, role.last_round, now, sent=(msg.round, msg.step))
        self._publish_update(msg.key, topic, payload)
        if role.last_round == msg.round and not isinstance(msg, TrainingFailed):
            self.rounds_done += 1
        log.info("round %d step %d of %s: %s sent (%d bytes)", msg.round, msg.step, msg.rollout, msg.KIND,
                 len(payload))

    def _local_work(self, role: DeviceRole, rollout: str, action: Any,
                    begun: set[tuple[int, int]]) -> tuple[Sequence[Action], bool]:
        """Compute one piece of local work and hand the result to the role: ``(its answer, whether it failed)``.

        The work is recorded in the state before the trainer runs (``DeviceState.begin_work``), so a death in
        it is known at the next start; work that killed the agent ``max_task_crashes`` times, or failed
        before, is not run: the role is told it failed (``training_failed``), as it is when the trainer raises
        or its result is not finite."""
        round, step = int(action.round), int(getattr(action, "step", 0))
        if (round, step) not in begun:
            refused = self.state.begin_work(rollout, round, step, self.max_task_crashes)
            if refused is not None:
                why = (f"the agent died {self.max_task_crashes} time(s) while it trained it (a crash of the training "
                       "runtime: see the service's log)" if refused == "crash" else f"it failed before ({refused})")
                return self._work_failed(role, rollout, round, step, refused, why), True
            begun.add((round, step))
        trainer = self.trainers[rollout]
        try:
            if self.fault is not None:
                self.fault.before(round)
            result = self._compute(trainer, action)
        except Exception as exc:  # noqa: BLE001 - whatever the training runtime raises fails this work, not the agent
            log.debug("the trainer raised in round %d step %d of %s", round, step, rollout, exc_info=exc)
            return self._work_failed(role, rollout, round, step, "error",
                                     f"the trainer raised {type(exc).__name__}: {exc}"), True
        if not _finite(result):
            return self._work_failed(role, rollout, round, step, "non_finite",
                                     "its result holds NaN or infinity (a diverging model or learning rate)"), True
        return self._answer(role, action, result), False

    def _compute(self, trainer: Any, action: Any) -> Any:
        """Run ``action`` on the trainer; the result its answer verb takes (``_answer``)."""
        if isinstance(action, LocalTrain):
            return self.train(trainer, action)
        if isinstance(action, ComputeGradient):
            return self.gradient(trainer, action)
        if isinstance(action, Evaluate):
            return self.evaluate(trainer, action)
        if isinstance(action, ScoreRows):
            return self.score_rows(trainer, action)
        if isinstance(action, ScoreGradient):
            return self.score_gradient(trainer, action)
        if isinstance(action, Embed):
            return trainer.embed(action.block, action.params, action.rows)
        assert isinstance(action, SplitTrain)
        return trainer.train(action.side, action.params, action.frozen, action.partner, action.rows, action.steps,
                             action.lr)

    @staticmethod
    def _answer(role: DeviceRole, action: Any, result: Any) -> Sequence[Action]:
        """Hand a computed result to the role's verb for ``action``."""
        if isinstance(action, LocalTrain):
            return role.trained(action.round, result)
        if isinstance(action, (ComputeGradient, ScoreGradient)):
            return role.gradient_done(action.round, action.step, result)
        if isinstance(action, Evaluate):
            return role.evaluated(action.round, result)
        if isinstance(action, ScoreRows):
            return role.scored(action.round, action.step, result)
        if isinstance(action, Embed):
            return role.embedded(action.round, action.step, result)
        params, loss = result
        return role.split_trained(action.round, action.step, params, loss)

    def _work_failed(self, role: DeviceRole, rollout: str, round: int, step: int, reason: str,
                     why: str) -> Sequence[Action]:
        """Record the failure (a repeated request gets the same answer), count and log it, and tell the role."""
        self.state.fail_work(rollout, round, step, reason)
        self.metrics.inc(TRAINING_FAILED, reason=reason)
        log.error("round %d step %d of %s not trained: %s; reported training_failed (%s) to the edge, which goes "
                  "on without this device; the next round's task is trained as usual", round, step, rollout, why,
                  reason)
        return role.failed(round, step, reason)

    def train(self, trainer: Trainer, request: LocalTrain) -> LocalResult:
        """Execute a ``LocalTrain`` request: set params, run the steps, return the change."""
        trainer.set_parameters(request.params)
        gen = rng.stream(*request.stream)
        batches = [(self.data.x[idx], self.data.y[idx])
                   for idx in minibatch_indices(len(self.data), request.batch_size, request.steps, gen)]
        stats = trainer.train_steps(batches, request.lr)
        delta = aggregate.subtract(trainer.get_parameters(), request.params)
        return LocalResult(delta=delta, num_samples=len(self.data), mean_loss=stats.mean_loss, steps=stats.steps)

    def evaluate(self, trainer: Trainer, request: Evaluate) -> EvalStats | None:
        """Execute an ``Evaluate`` request on the held-out rows; ``None`` if the loss is not finite."""
        assert self.eval_data is not None  # the role asks only when told there are held-out rows
        trainer.set_parameters(request.params)
        result = trainer.evaluate(self.eval_data.x, self.eval_data.y)
        if not math.isfinite(result.loss):
            log.warning("round %d: the global model's loss on the held-out rows is %s; not reported",
                        request.round, result.loss)
            return None
        correct = None if result.accuracy is None else result.accuracy * result.samples
        return EvalStats(loss=max(0.0, float(result.loss)), count=int(result.samples), correct=correct,
                         auroc=None if correct is None else self._held_out_auroc(trainer))

    def _held_out_auroc(self, trainer: Trainer) -> float | None:
        """AUROC of the model (set) on the held-out rows of a binary task (one output, or two classes) when they
        hold both classes; ``None`` otherwise. numpy only (``fedtier.training.ranking``): no scikit-learn here."""
        assert self.eval_data is not None
        labels = ranking.binary_labels(self.eval_data.y)
        if labels is None:  # not 0/1, or one class only: nothing to rank (and no forward pass spent on it)
            return None
        scores = ranking.binary_scores(trainer.predict(self.eval_data.x))
        return None if scores is None else ranking.auroc(labels, scores)

    def gradient(self, trainer: Trainer, request: ComputeGradient) -> GradientResult:
        """Execute a ``ComputeGradient`` request: one minibatch, parameters left as they were."""
        trainer.set_parameters(request.params)
        [idx] = minibatch_indices(len(self.data), request.batch_size, 1, rng.stream(*request.stream))
        grad, loss = trainer.compute_gradient(self.data.x[idx], self.data.y[idx])
        return GradientResult(grad=grad, loss=loss, num_samples=len(self.data))

    def score_rows(self, trainer: Trainer, request: ScoreRows) -> RowScores:
        """Execute a ``ScoreRows`` request: draw rows by class from the named stream, score them."""
        trainer.set_parameters(request.params)
        rows = class_rows(self.data.y, dict(request.per_class), rng.stream(*request.stream))
        labels = sorted(rows)
        scored = trainer.predict(self.data.x[np.concatenate([rows[label] for label in labels])])[:, 0]
        bounds = np.cumsum([0, *(len(rows[label]) for label in labels)])
        outputs = {label: scored[bounds[i]:bounds[i + 1]].copy() for i, label in enumerate(labels)}
        return RowScores(rows=rows, outputs=outputs, num_samples=len(self.data))

    def score_gradient(self, trainer: Trainer, request: ScoreGradient) -> GradientResult:
        """Execute a ``ScoreGradient`` request: the gradient of the weighted sum of the rows' scores."""
        trainer.set_parameters(request.params)
        grad, value = trainer.score_gradient(self.data.x[request.rows], request.weights)
        return GradientResult(grad=grad, loss=value, num_samples=len(self.data))

    def _publish_update(self, key: str, topic: str, payload: bytes) -> None:
        def done(ok: bool) -> None:
            if ok:
                self.state.delete(key)
            else:
                # Refused by the broker (e.g. ACL): retrying cannot help. Logged by the transport.
                log.error("update %s was refused by the broker; dropping it from the outbox", key)
                self.state.delete(key)

        self.tx.publish(topic, payload, on_done=done)


def _finite(result: Any) -> bool:
    """Whether a computed result holds only finite numbers (an evaluation, which the role checks, always does)."""
    if isinstance(result, LocalResult):
        values: list[Any] = [*result.delta.values(), result.mean_loss]
    elif isinstance(result, GradientResult):
        values = [*result.grad.values(), result.loss]
    elif isinstance(result, RowScores):
        values = list(result.outputs.values())
    elif isinstance(result, np.ndarray):
        values = [result]
    elif isinstance(result, tuple):
        params, loss = result
        values = [*params.values(), loss]
    else:
        return True
    return all(bool(np.isfinite(np.asarray(v)).all()) for v in values)

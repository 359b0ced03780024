"""What every upward message discloses, field by field: the allow-list of the privacy audit.

Differential privacy covers what passes the mechanism (clip -> noise -> quantize) and the
ledger. Everything else a device sends to an untrusted edge, or an edge sends to the
(untrusted) cloud, must say nothing about the training records: it must be public by
construction (the topology, the schedule, the plan, who took part, sizes that depend on the
model's shape only), a post-processing of noised values, or withheld (sent as a constant).
Messages a device sends to a *trusted* edge travel in clear over TLS inside the trusted
subtree and are not constrained here; what that edge sends on is.

This module is the single list. ``tests/unit/cloud_coordinator/test_privacy_disclosure.py`` walks every
field of every upward message of real private rollouts against it — a field that is not listed
fails until someone classifies it — and checks each class against two runs with different noise
and one with different data; ``docs/privacy.md``'s table is generated from it
(``python -m commands.config_docs``).

Paths name the wire header (``fedtier.wire.envelope``): ``t``, ``ro``, ``r``, ``st``, ``s``,
``k``, ``sha``, ``ts[].<spec key>``, ``m.<message field>[.<key>...]`` (``[]`` steps into a list
of maps), ``ci``/``cn`` (chunks), and ``body`` for the tensors' bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

PUBLIC = "public"
"""Identical for any two datasets of the same sizes and any noise: fixed by the topology, the
schedule, the noise plan, participation (who reported), or the model's shape."""
NOISED = "noised"
"""The release itself: clipped and noised as the plan says (or an exact mean of such releases)."""
DERIVED = "post-processing"
"""Computed from noised values (and public randomness) only: it may differ with the noise, never
with the data alone."""
WITHHELD = "withheld"
"""A data-dependent value the plan does not account for, sent as a constant (or not at all) under a
noise plan."""

CLASSES = (PUBLIC, NOISED, DERIVED, WITHHELD)


@dataclass(frozen=True, slots=True)
class Field:
    """One field's class (``PUBLIC``, ``NOISED``, ``DERIVED`` or ``WITHHELD``) and why."""

    disclosure: str
    why: str

    def __post_init__(self) -> None:
        if self.disclosure not in CLASSES:
            raise ValueError(f"unknown disclosure class {self.disclosure!r}")


_SCHEDULE = "the protocol's schedule"

HEADER: Mapping[str, Field] = {
    "t": Field(PUBLIC, "message type"),
    "ro": Field(PUBLIC, "rollout id"),
    "r": Field(PUBLIC, f"round index ({_SCHEDULE})"),
    "st": Field(PUBLIC, f"edge round within the round ({_SCHEDULE})"),
    "s": Field(PUBLIC, "sender's node id (topology)"),
    "k": Field(PUBLIC, "idempotency key: type/rollout/round/step/sender"),
    "sha": Field(DERIVED, "sha256 of the body, a function of the released tensors"),
    "dg": Field(PUBLIC, "which digest of the body the header carries (crc32; absent: sha256)"),
    "dv": Field(DERIVED, "the body's digest named by dg, a function of the released tensors"),
    "pd": Field(PUBLIC, "zero bytes that align the body (their number follows from the header's length)"),
    "ts[].n": Field(PUBLIC, "tensor name (the model's layout)"),
    "ts[].e": Field(PUBLIC, "tensor encoding (the config: f32, or qsgd with bits_device / bits_edge)"),
    "ts[].sh": Field(PUBLIC, "tensor shape (the model's layout)"),
    "ts[].nb": Field(PUBLIC, "tensor byte length: fixed by the shape and the encoding (no encoding compresses)"),
    "ts[].b": Field(PUBLIC, "QSGD bit width (bits_device / bits_edge of the config)"),
}

_RELEASE_WHY = "from the noise plan (clip, z, tau, mode) and who reported"
_CLIP_WHY = ("; with adaptive clipping the round's clip bound C_t, which the cloud moves from noised counts, so "
             "post-processing")
_RELEASE: Mapping[str, Field] = {
    "node": Field(PUBLIC, "who added the noise (topology)"),
    "event": Field(PUBLIC, "device or edge release (topology)"),
    "round": Field(PUBLIC, _SCHEDULE),
    "step": Field(PUBLIC, _SCHEDULE),
    "sigma": Field(DERIVED, f"noise std, {_RELEASE_WHY}{_CLIP_WHY}"),
    "sensitivity": Field(DERIVED, f"the sound sensitivity, {_RELEASE_WHY}{_CLIP_WHY}"),
    "z": Field(PUBLIC, f"the charged multiplier sigma / sensitivity, {_RELEASE_WHY}"),
    "protected": Field(PUBLIC, "the devices whose data the noise covers (participation)"),
    "inputs.clip": Field(DERIVED, f"C, from the plan{_CLIP_WHY}"),
    "inputs.reporters": Field(PUBLIC, "how many devices reported (participation)"),
    "inputs.edge_rounds": Field(PUBLIC, "tau, from the plan"),
    "inputs.mode": Field(PUBLIC, "calibration mode, from the plan"),
    "inputs.calibrated_sensitivity": Field(DERIVED, f"what sigma was calibrated against, {_RELEASE_WHY}{_CLIP_WHY}"),
    "inputs.sample_rate": Field(PUBLIC, "device sampling only: q of the amplified release, from the plan"),
    "count": Field(NOISED, "adaptive clipping: the centred unclipped bit(s) b - 1/2 of the release's devices plus "
                           "N(0, count_stddev^2), paid for inside the release's z"),
    "count_stddev": Field(PUBLIC, "adaptive clipping: the count's noise std, z / sqrt(count_share) x its sensitivity "
                                  "(the plan)"),
    "inputs.count_stddev": Field(PUBLIC, "adaptive clipping: as count_stddev, on the ledger"),
    "inputs.population": Field(PUBLIC, "fixed-size device sampling only: the cell's size n, from the plan (0: "
                                       "Poisson)"),
    "inputs.distributed": Field(PUBLIC, "distributed DP only: the release is the cell's sum of its devices' noise "
                                        "shares (from the plan)"),
    "inputs.min_survivors": Field(PUBLIC, "distributed DP only: s_min, from the plan"),
    "inputs.survivors": Field(PUBLIC, "distributed DP only: how many devices' shares the sum holds (participation "
                                      "in the protocol)"),
}


def _prefixed(prefix: str, fields: Mapping[str, Field]) -> dict[str, Field]:
    return {f"{prefix}{path}": field for path, field in fields.items()}


_EVAL_WHY = ("federated evaluation on held-out rows: data-dependent and not covered by the plan, so never sent "
             "under one (devices do not evaluate, edges forward none)")
_EVAL: Mapping[str, Field] = {key: Field(WITHHELD, _EVAL_WHY) for key in ("loss", "count", "devices", "correct")}
_DEVICE_EVAL_WHY = (_EVAL_WHY + ". Federated evaluation is only ever on without a noise plan: then these are clear "
                    "data to their receiver, so an honest-but-curious coordinator learns each device's own held-out "
                    "statistics in a rollout without privacy, and only there")

_BYTES = ("byte count of the cell's traffic in the round: a function of message counts (participation), tensor "
          "shapes, encodings and public header fields (floats are always 8 bytes)")

_SECAGG_KEYS = "a fresh public key of the round's key agreement: protocol randomness, not data"

UPWARD: Mapping[str, Mapping[str, Field]] = {
    # device -> its edge. Classes apply when the edge is untrusted (to a trusted one: clear, over TLS).
    "device_update": {
        **HEADER,
        "body": Field(NOISED, "the delta clipped to C plus N(0, sigma_dev^2 I), then QSGD-quantized (each qsgd "
                              "tensor's norm, its first 4 bytes, is the noised tensor's)"),
        "m.num_samples": Field(PUBLIC, "local sample count: unchanged when one record is replaced (replace-one "
                                       "adjacency), and it weighs nothing (privacy requires uniform weights); it "
                                       "would not be public under add/remove adjacency"),
        "m.train_loss": Field(WITHHELD, "0.0: the training loss is a data-dependent number the plan does not "
                                        "account for"),
        "m.steps": Field(PUBLIC, "local SGD steps run: the task's local_steps"),
        "m.unclipped": Field(WITHHELD, "adaptive clipping's bit (did the update fit C?): never sent to an untrusted "
                                       "edge, where it travels noised in m.release.count; clear to a trusted one"),
        "m.q": Field(DERIVED, "measured QSGD variance of quantizing the noised delta (0 without quantization)"),
        **_prefixed("m.release.", _RELEASE),
        **_prefixed("m.eval.", _EVAL),
        "m.eval.auroc": Field(WITHHELD, _EVAL_WHY + "; auroc is the device's own AUROC on its held-out rows of a "
                                                    "binary task holding both classes"),
    },
    # device -> edge, in place of an upload the device could not compute (its runtime crashed or failed).
    "training_failed": {
        **HEADER,
        "m.reason": Field(PUBLIC, "why the device sent no update (crash, error, non_finite): a fault of its training "
                                  "runtime in place of an upload, like not reporting (participation); nothing of the "
                                  "records is computed into it"),
    },
    # edge -> cloud, from trusted and untrusted edges alike.
    "cell_update": {
        **HEADER,
        "body": Field(NOISED, "trusted edge: its cell's change plus fresh N(0, sigma_edge^2 I); untrusted edge: "
                              "the exact mean of its devices' noised releases (post-processing); then QSGD"),
        "m.weight": Field(PUBLIC, "number of reporting devices (uniform weighting is required under privacy)"),
        "m.reported": Field(PUBLIC, "which devices reported: participation, not data (timing side channels are "
                                    "out of scope)"),
        "m.mean_loss": Field(WITHHELD, "0.0: training losses are data-dependent numbers the plan does not "
                                       "account for"),
        "m.q": Field(DERIVED, "measured QSGD variance of the edge quantizing its noised upload"),
        **_prefixed("m.eval.", _EVAL),
        "m.stats.evaluations.*": Field(WITHHELD, "each reporting device's own federated evaluation [count, loss, "
                                                 "correct, auroc], so the cloud sees the worst devices and not only "
                                                 "the mean. " + _DEVICE_EVAL_WHY),
        "m.stats.device_q": Field(DERIVED, "untrusted cells only: mean of the devices' q, each measured on a "
                                           "noised upload. A trusted cell does not send it: its devices' q are "
                                           "measured on clear deltas"),
        "m.stats.device_up_bytes": Field(PUBLIC, _BYTES),
        "m.stats.device_up_f32_bytes": Field(PUBLIC, _BYTES + " (as float32)"),
        "m.stats.device_down_bytes": Field(PUBLIC, _BYTES),
        "m.stats.rejected": Field(PUBLIC, "how many messages the edge refused since its last update, by typed "
                                          "reason (protocol faults: late, duplicate key, bad signature...), not data"),
        "m.stats.secagg_waited.*": Field(PUBLIC, "secure aggregation: per phase, the members it closed without at "
                                                 "its deadline (participation)"),
        "m.stats.failed": Field(PUBLIC, "the devices that reported training_failed in the round instead of an update, "
                                        "each with its reason: participation and runtime faults, not data"),
        "m.privacy.trusted": Field(PUBLIC, "the cell's trust label, from the plan"),
        "m.privacy.distributed": Field(PUBLIC, "distributed DP (secure aggregation): the cell's release is its "
                                               "devices' noised sum, from the plan"),
        "m.privacy.steps": Field(PUBLIC, "who reported in each edge round (participation)"),
        **_prefixed("m.privacy.releases[].", _RELEASE),
        "m.privacy.clear[].sender": Field(PUBLIC, "a clear hop inside the trusted cell (participation)"),
        "m.privacy.clear[].receiver": Field(PUBLIC, "the trusted cell (topology)"),
        "m.privacy.clear[].step": Field(PUBLIC, _SCHEDULE),
    },
    # device -> edge under secure aggregation (distributed DP): the protocol's messages
    # (fedtier.secagg.protocol). The edge never holds an unmasked individual update.
    "secagg_keys": {
        **HEADER,
        "m.c_pk": Field(DERIVED, _SECAGG_KEYS),
        "m.s_pk": Field(DERIVED, _SECAGG_KEYS),
        "m.b_commit": Field(DERIVED, "commitment to the self-mask seed: a hash of protocol randomness, not data"),
    },
    "secagg_shares": {
        **HEADER,
        "m.shares.*": Field(DERIVED, "per neighbour, shares of the self-mask seed and key encrypted for that "
                                     "neighbour: protocol randomness, not data"),
    },
    "secagg_masked": {
        **HEADER,
        "body": Field(NOISED, "the delta clipped to C plus the device's share N(0, sigma_sum^2 / s_min) of its "
                              "cell's noise, rounded into the ring, plus pairwise and self masks: to the edge, "
                              "uniformly random alone; only the cell's sum is ever unmasked"),
        "m.width": Field(PUBLIC, "bytes per ring element (secagg_bits of the config)"),
    },
    "secagg_reveal": {
        **HEADER,
        "m.shares.*": Field(DERIVED, "per neighbour, one Shamir share of a self-mask seed (survivor) or of a "
                                     "key (dropped): protocol randomness, not data"),
    },
    # edge -> cloud under secure aggregation, instead of a cell update: the round aborted.
    "secagg_aborted": {
        **HEADER,
        "m.phase": Field(PUBLIC, "the protocol phase that closed with too few devices (the schedule)"),
        "m.reason": Field(PUBLIC, "the abort's typed reason (too few keys, shares, inputs or reveals): participation"),
        "m.have": Field(PUBLIC, "how many devices (or revealed shares) the phase had (participation)"),
        "m.need": Field(PUBLIC, "how many it needed: s_min or a threshold t, from the config"),
        "m.waited.*": Field(PUBLIC, "per phase, the members it closed without at its deadline (participation)"),
    },
    # device -> edge, edge -> cloud: artifact files by digest.
    "artifact_request": {
        **HEADER,
        "m.digests": Field(PUBLIC, "sha256 of artifact files listed in the signed manifest"),
    },
    # edge -> cloud: which of the cell's devices are connected (fedtier.wire.messages.CellPresence).
    "cell_presence": {
        **HEADER,
        "m.online": Field(PUBLIC, "the devices of the cell connected to its broker now: presence, as each device's "
                                  "retained status document says (which the cloud reads itself on a shared broker); "
                                  "nothing about data, nor who a round sampled"),
        "m.known": Field(PUBLIC, "how many devices of the cell have announced their presence, online or not"),
    },
    # Any message above the broker's size limit travels as chunks (fedtier.transport.chunking).
    "chunk": {
        **HEADER,
        "body": Field(NOISED, "a slice of the whole message's bytes, classified as that message's fields"),
        "m.wk": Field(PUBLIC, "the whole message's idempotency key"),
        "m.tlen": Field(PUBLIC, "the whole message's length (see ts[].nb)"),
        "m.tsha": Field(DERIVED, "sha256 of the whole message"),
        "ci": Field(PUBLIC, "chunk index: a function of the message's length"),
        "cn": Field(PUBLIC, "chunk count: a function of the message's length"),
    },
}

STATUS: Mapping[str, Field] = {
    "node": Field(PUBLIC, "node id"),
    "role": Field(PUBLIC, "device, edge or cloud"),
    "cell": Field(PUBLIC, "the node's cell (topology)"),
    "state": Field(PUBLIC, "online or offline"),
    "since": Field(PUBLIC, "when the node connected (wall clock; nothing about data)"),
    "instance": Field(PUBLIC, "a random id drawn per process at start (detects two processes under one identity)"),
    "trainer": Field(PUBLIC, "the device's training backend (ort, portable or torch): software, not data"),
    "version": Field(PUBLIC, "the fedtier version the node runs (the device inventory): software, not data"),
}
"""The retained presence document (JSON) every MQTT node publishes on ``ft/v1/status/<node>`` (a device on
``ft/v1/status/<cell>/<device>``, which only its edge reads behind a bridge)."""

_XRISK = ("FeDXL's score lists (every positive's and negative's score, and u values) are data-dependent "
          "releases the mechanism does not cover: a config with [privacy] and algorithm = fedxl is refused, and so "
          "are its roles given a noise plan")

REFUSED: Mapping[str, str] = {
    "device_gradient": "QHetFed's in-cell gradient exchange is not covered by the mechanism: a config with "
                       "[privacy] and algorithm = qhetfed is refused, and so are its roles given a noise plan",
    "xrisk_device_update": _XRISK,
    "xrisk_cell_update": _XRISK,
    "hsgd_embeddings": "HSGD's embeddings (a device's zeta2, a host's Z1 rows) and the host's head theta0 are "
                       "data-dependent releases the mechanism does not cover: a config with [privacy] and "
                       "algorithm = hsgd is refused, and so are its roles given a noise plan",
}
"""Upward message types that never travel under a noise plan."""

DOWNWARD: Mapping[str, str] = {
    "cell_task": "cloud -> edge: the global model (post-processing of noised releases), the config, the members",
    "device_task": "edge -> its devices: the cloud's model or the set model (a trusted cell's stays inside it)",
    "cell_step": "edge -> its devices: the edge round's average (a trusted cell's stays inside it)",
    "artifact": "parent -> children: artifact files listed in the signed manifest",
    "xrisk_cell_task": "cloud -> edge (FeDXL, never under a noise plan): the model, momentum and the merged scores",
    "xrisk_device_task": "edge -> its devices (FeDXL, never under a noise plan): the cloud's task, relayed",
    "hsgd_partner": "edge -> its host (the devices' zeta2 rows) or a device (its Z1 row and theta0) (HSGD, never "
                    "under a noise plan)",
    "secagg_roster": "edge -> one device (secure aggregation): its neighbours' public keys and the roster's size",
    "secagg_bundle": "edge -> one device (secure aggregation): ciphertexts of shares only that device can open",
    "secagg_unmask": "edge -> one device (secure aggregation): which neighbours survived or dropped (participation)",
}
"""Message types that only travel down the tree: nothing of a device's data that has not passed the
mechanism leaves a trusted subtree this way."""


_HIDDEN = ("under device sampling a trusted edge samples in secret, and its noise is amplified only while the cloud "
           "cannot tell who was sampled: ")
SAMPLED: Mapping[str, Mapping[str, Field]] = {
    "cell_update": {
        "m.weight": Field(PUBLIC, _HIDDEN + "the cell's size n (the fixed denominator q n is public), not the "
                                            "number sampled"),
        "m.reported": Field(WITHHELD, _HIDDEN + "the cell's members, not who was sampled or reported"),
        "m.privacy.steps": Field(WITHHELD, _HIDDEN + "the cell's members for its one edge round"),
        "m.privacy.releases[].protected": Field(PUBLIC, _HIDDEN + "every member: the amplified release covers "
                                                                  "the whole cell, sampled or not"),
        "m.privacy.releases[].inputs.reporters": Field(PUBLIC, _HIDDEN + "n, the cell's size"),
        "m.privacy.releases[].inputs.survivors": Field(PUBLIC, "distributed DP: every member takes part in the "
                                                               "protocol, sampled or not, so this is how many "
                                                               "answered, never how many were sampled"),
        "m.stats.secagg_waited.*": Field(PUBLIC, "distributed DP: every member takes part in the protocol, sampled "
                                                 "or not, so these are who did not answer, never who was sampled"),
        "m.privacy.releases[].sigma": Field(DERIVED, _HIDDEN + "z C / (q n): fixed by the plan, whoever reported"
                                                       + _CLIP_WHY),
        "m.privacy.releases[].sensitivity": Field(DERIVED, _HIDDEN + "C / (q n) (2C / round(q n) fixed-size): "
                                                                     "fixed by the plan" + _CLIP_WHY),
        "m.privacy.releases[].inputs.calibrated_sensitivity": Field(DERIVED, _HIDDEN + "the same fixed sensitivity"
                                                                    + _CLIP_WHY),
        "m.privacy.releases[].z": Field(PUBLIC, _HIDDEN + "the plan's edge z: fixed, whoever reported"),
        "m.privacy.clear[].sender": Field(WITHHELD, _HIDDEN + "not sent: the clear hops stay inside the cell"),
        "m.stats.device_up_bytes": Field(WITHHELD, _HIDDEN + "0: it counts the sampled devices' messages"),
        "m.stats.device_up_f32_bytes": Field(WITHHELD, _HIDDEN + "0: it counts the sampled devices' messages"),
        "m.stats.device_down_bytes": Field(WITHHELD, _HIDDEN + "0: it counts the sampled devices' messages"),
        "m.stats.failed": Field(WITHHELD, _HIDDEN + "not sent: a failure names a sampled device"),
        "m.stats.evaluations.*": Field(WITHHELD, _HIDDEN + "not sent: a device's own evaluation names it (and "
                                                           "held-out statistics are never sent under a plan)"),
    },
    "device_update": {
        "m.num_samples": Field(WITHHELD, "user-level adjacency (the unit is a device's whole data, as device "
                                         "sampling's accounting assumes): the dataset size is the device's data, "
                                         "so it is sent as 0 and weighs nothing"),
    },
}
"""How fields of upward messages change class when the plan samples devices (``NoisePlan.sampling``):
what a sampling rollout must send so that the amplification the ledger charges holds. A trusted edge
(``hier_qsgd._EdgeBase``) and the edge service send exactly this; a test runs a sampling rollout three
times (other noise, so another sample; other data) and checks the cloud's view against it; devices under
untrusted cells send ``m.num_samples`` as 0 (``Device._sent_samples``)."""


def classify(kind: str, path: str) -> Field | None:
    """The class of ``path`` in an upward message of type ``kind``; ``None`` if it is not listed. A listed
    path ending in ``.*`` stands for every key of a map keyed by node ids (``m.shares.<neighbour>``)."""
    fields = UPWARD.get(kind, {})
    if path in fields:
        return fields[path]
    head, _, _ = path.rpartition(".")
    return fields.get(f"{head}.*") if head else None


def unlisted(kind: str, flat: Mapping[str, Any]) -> list[str]:
    """The paths of a flattened header (``flatten``) that this module does not classify. An empty list
    of maps (``m.privacy.clear = []``) is fine when its elements' fields are listed."""
    fields = UPWARD.get(kind, {})
    return sorted(path for path, value in flat.items()
                  if classify(kind, path) is None
                  and not (value == [] and any(f.startswith(f"{path}[].") for f in fields)))


def flatten(header: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A wire header as ``path -> value``: maps are walked (``m.stats.device_q``); a list of maps is
    walked once per element with ``[]`` in the path and its values collected into lists in order
    (``m.privacy.releases[].sigma -> [sigma, ...]``); other values (lists of ids included) are leaves."""
    out: dict[str, Any] = {}
    for key, value in header.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{path}."))
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            for item in value:
                for sub, leaf in flatten(item, f"{path}[].").items():
                    out.setdefault(sub, []).append(leaf)
        else:
            out[path] = value
    return out


def markdown_table() -> str:
    """docs/privacy.md's table of every upward field (what ``config_docs`` writes there)."""
    lines = ["| message | field | class | why |", "|---|---|---|---|"]
    for path, field in HEADER.items():
        lines.append(f"| every message | `{path}` | {field.disclosure} | {field.why} |")
    for kind, fields in UPWARD.items():
        for path, field in fields.items():
            if HEADER.get(path) is not field:
                lines.append(f"| {kind} | `{path}` | {field.disclosure} | {field.why} |")
    for kind, fields in SAMPLED.items():
        for path, field in fields.items():
            lines.append(f"| {kind} (device sampling) | `{path}` | {field.disclosure} | {field.why} |")
    for path, field in STATUS.items():
        lines.append(f"| presence (JSON) | `{path}` | {field.disclosure} | {field.why} |")
    for kind, why in REFUSED.items():
        lines.append(f"| {kind} | (all) | never sent under a noise plan | {why} |")
    return "\n".join(lines) + "\n"

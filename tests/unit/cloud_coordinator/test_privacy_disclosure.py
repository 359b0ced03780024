"""Nothing computed from clear data leaves a trusted subtree unless it passed the mechanism (issue 17 A1).

Every field of every upward message of real private rollouts (the simulator: real device, edge and
coordinator shells, ORT training, the wire codec) is walked against the one allow-list,
``fedtier.privacy.disclosure``: a field that is not listed fails until someone classifies it. Each
rollout runs three times — A, B with other noise seeds, C with other training data of the same sizes —
and every message that crosses into an untrusted node (device -> untrusted edge, edge -> cloud) must be
the same message in all three, with:

* ``public`` and ``withheld`` fields identical in A, B and C;
* ``noised`` fields different between A and B (the noise is there);
* no other field identical in A and B (noise-independent) yet different in C (data-dependent): such a
  field is computed from clear data — the signature of the leak the issue found (``stats.device_q`` of
  a trusted cell: the mean QSGD variance of its devices' clear deltas).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import pytest

from fedtier.rollout.config import RolloutConfig
from cloud_coordinator.rollout import PreparedRollout, prepare
from local_fleet.simulate import simulate
from fedtier import wire
from fedtier.privacy import disclosure
from fedtier.privacy.disclosure import DERIVED, NOISED, PUBLIC, WITHHELD
from fedtier.transport import topics
from fedtier.transport.memory import MemoryBroker
from fedtier.wire.messages import MESSAGE_TYPES

SCHEDULE = {"local_steps": 2, "edge_rounds": 2, "lr": 0.1, "batch_size": 16}
ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {"fedavg": SCHEDULE},
    "hier_qsgd": {"algorithm": "hier_qsgd", "hier_qsgd": {**SCHEDULE, "bits_device": 4, "bits_edge": 4}},
    "hist": {"algorithm": "hist", "hist": {**SCHEDULE, "bits_device": 4, "bits_edge": 4}},
}

Capture = dict[tuple[str, str], tuple[dict[str, Any], bytes]]  # (topic, key) -> (flat header, body)


def _run(cfg: RolloutConfig, prepared: PreparedRollout, monkeypatch: pytest.MonkeyPatch) -> Capture:
    """Every upward message of one simulated rollout, as published on the broker."""
    seen: Capture = {}
    publish: Callable[..., None] = MemoryBroker._publish

    def tap(self: MemoryBroker, topic: str, payload: bytes, retain: bool) -> None:
        parsed = topics.parse(topic)
        if parsed is not None and parsed.channel in ("cell_up", "edge_up", "status"):
            assert parsed.channel != "status", "presence is published by MQTT transports only"
            header = wire.peek_header(payload)
            key = (topic, str(header["k"]))
            assert key not in seen, f"{key} published twice"
            seen[key] = (disclosure.flatten(header), payload[-_body_length(header):] if _body_length(header) else b"")
        publish(self, topic, payload, retain)

    with monkeypatch.context() as m:
        m.setattr(MemoryBroker, "_publish", tap)
        simulate(cfg, prepared=prepared)
    return seen


def _body_length(header: dict[str, Any]) -> int:
    return sum(int(spec["nb"]) for spec in header.get("ts", ()))


def _other_data(prepared: PreparedRollout) -> PreparedRollout:
    """Every device's records changed, their number kept (what replace-one adjacency keeps public)."""
    train = {d: (np.ascontiguousarray(0.5 * x[::-1]), y[::-1].copy()) for d, (x, y) in prepared.data.train.items()}
    return dataclasses.replace(prepared, data=dataclasses.replace(prepared.data, train=train))


def _receiver_untrusted(topic: str, prepared: PreparedRollout) -> bool:
    parsed = topics.parse(topic)
    assert parsed is not None and prepared.noise_plan is not None
    if parsed.channel == "edge_up":
        return True  # the cloud is never trusted
    return not prepared.noise_plan.cells[str(parsed.cell)].trusted


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_upward_field_is_public_noised_or_post_processing(small_rollout, monkeypatch: pytest.MonkeyPatch,
                                                                algorithm: str) -> None:
    def config(noise_seed: int) -> RolloutConfig:
        return small_rollout(rounds=2, topology={"cells": 2, "devices_per_cell": 2, "trusted": {"cell-a": True}},
                             privacy={"epsilon": 8.0, "clip": 1.0, "require_tls": False, "noise_seed": noise_seed},
                             **ALGORITHMS[algorithm])

    prepared = prepare(config(1))
    a = _run(config(1), prepared, monkeypatch)
    b = _run(config(2), prepared, monkeypatch)
    c = _run(config(1), _other_data(prepared), monkeypatch)
    assert a.keys() == b.keys() == c.keys()  # the same messages: which are sent is public
    kinds = {str(header["t"]) for header, _ in a.values()}
    assert {"device_update", "cell_update"} <= kinds

    problems: list[str] = []
    checked = {PUBLIC: 0, WITHHELD: 0, NOISED: 0, DERIVED: 0}
    for key, (header, body) in sorted(a.items()):
        kind = str(header["t"])
        problems += [f"{key[1]}: {path} is not classified in fedtier.privacy.disclosure"
                     for path in disclosure.unlisted(kind, header)]
        if not _receiver_untrusted(key[0], prepared):
            continue  # clear, over TLS, inside the trusted subtree
        runs = {"a": (header, body), "b": b[key], "c": c[key]}
        paths = set(header) | set(b[key][0]) | set(c[key][0]) | ({"body"} if body else set())
        for path in sorted(paths):
            field = disclosure.classify(kind, path)
            if field is None:
                continue  # reported above
            va, vb, vc = (run[1] if path == "body" else run[0].get(path) for run in runs.values())
            checked[field.disclosure] += 1
            where = f"{key[1]} {path}"
            if field.disclosure in (PUBLIC, WITHHELD) and not va == vb == vc:
                problems.append(f"{where} is {field.disclosure} but differs between runs: {va!r} {vb!r} {vc!r}")
            elif field.disclosure == NOISED and va == vb:
                problems.append(f"{where} is the same with other noise: the noise is missing")
            elif va == vb and va != vc:
                problems.append(f"{where} changes with the data but not with the noise: computed from clear data")
    assert problems == []
    assert all(checked.values()), checked  # every class was exercised


def test_every_message_type_is_classified() -> None:
    import fedtier.secagg.messages  # noqa: F401  (registers secure aggregation's kinds)

    classified = set(disclosure.UPWARD) | set(disclosure.REFUSED) | set(disclosure.DOWNWARD)
    assert set(MESSAGE_TYPES) | {"chunk"} == classified
    assert not set(disclosure.UPWARD) & set(disclosure.DOWNWARD)


def test_message_types_refused_under_privacy_are() -> None:
    from fedtier.algorithms import fedxl, hsgd, qhetfed, secure_fedavg

    assert not qhetfed.Device.SUPPORTS_PRIVACY and not qhetfed.Edge.SUPPORTS_PRIVACY
    assert not fedxl.Device.SUPPORTS_PRIVACY and not fedxl.Edge.SUPPORTS_PRIVACY
    assert not any(r.SUPPORTS_PRIVACY for r in (hsgd.Device, hsgd.Host, hsgd.Edge))
    assert secure_fedavg.Device.SUPPORTS_PRIVACY and secure_fedavg.Edge.SUPPORTS_PRIVACY  # distributed DP
    assert set(disclosure.REFUSED) == {"device_gradient", "xrisk_device_update", "xrisk_cell_update",
                                       "hsgd_embeddings"}


def test_federated_evaluations_fields_are_classified_withheld(small_rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without privacy devices with held-out rows send their evaluation (with an AUROC on a binary task) and edges
    forward each device's own: every such field is listed, as withheld (a noise plan turns them off)."""
    cfg = small_rollout(rounds=1, model={"hidden": []}, data={"dataset": "rare_event", "partition": "iid",
                                                              "samples": 400, "features": 10, "holdout": 0.3})
    seen = _run(cfg, prepare(cfg), monkeypatch)

    assert [f"{key}: {path}" for (_, key), (header, _) in sorted(seen.items())
            for path in disclosure.unlisted(str(header["t"]), header)] == []
    paths = {(str(header["t"]), path) for header, _ in seen.values() for path in header}
    evaluation = {(kind, path) for kind, path in paths if path.startswith(("m.eval.", "m.stats.evaluations."))}
    assert ("device_update", "m.eval.auroc") in evaluation
    assert sum(1 for kind, path in evaluation if path.startswith("m.stats.evaluations.")) == 4  # one per device
    assert {disclosure.classify(kind, path).disclosure for kind, path in evaluation} == {WITHHELD}  # type: ignore


def test_chunk_headers_are_classified() -> None:
    from fedtier.transport import chunking
    from fedtier.wire.messages import DeviceUpdate

    update = DeviceUpdate(rollout="r", round=0, sender="d", delta={"w": np.ones(4096, np.float32)}, num_samples=3)
    parts = chunking.split(update.encode(), 4096)
    assert len(parts) > 1
    for part in parts:
        header = wire.peek_header(part)
        assert header["t"] == "chunk" and disclosure.unlisted("chunk", disclosure.flatten(header)) == []


def test_the_presence_document_is_classified() -> None:
    # What device_agent/run.py, edge_broker/run.py and cloud_coordinator/run.py pass as `status`, plus the
    # transport's state and since (fedtier.transport.mqtt).
    import inspect

    from cloud_coordinator import run as cloud_run
    from device_agent import run as device_run
    from edge_broker import run as edge_run

    import ast

    for module in (device_run, edge_run, cloud_run):
        # Every dict literal passed as ``status=`` or assigned to ``status``: its keys are the document's.
        tree = ast.parse(inspect.getsource(module))
        literals = [node.value for node in ast.walk(tree)
                    if isinstance(node, ast.keyword) and node.arg == "status" and isinstance(node.value, ast.Dict)]
        literals += [node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "status" for t in node.targets)
                     and isinstance(node.value, ast.Dict)]
        assert literals, module.__name__
        keys = {k.value for d in literals for k in d.keys if isinstance(k, ast.Constant)}
        assert keys <= set(disclosure.STATUS), (module.__name__, keys)
    mqtt_source = inspect.getsource(__import__("fedtier.transport.mqtt", fromlist=["x"]))
    assert '"state": "online", "since": time.time()' in mqtt_source
    assert '"instance": self.instance' in mqtt_source
    assert {"state", "since", "instance"} <= set(disclosure.STATUS)


@pytest.mark.parametrize("adaptive", [False, True])
def test_under_device_sampling_the_cloud_cannot_tell_who_was_sampled(small_rollout, monkeypatch: pytest.MonkeyPatch,
                                                                     adaptive: bool) -> None:
    """A trusted cell samples in secret: with another noise seed (so another sample) or other data, everything
    the cloud receives is identical except the noised release and what is computed from it. The untrusted cell's
    devices are sampled by the cloud (public) and send no sample count. With adaptive clipping the noised counts
    and the clip bound the cloud moves with them are noised or post-processing too."""
    def config(noise_seed: int) -> RolloutConfig:
        return small_rollout(rounds=3, topology={"cells": 2, "devices_per_cell": 3, "trusted": {"cell-a": True}},
                             privacy={"epsilon": 8.0, "clip": 1.0, "require_tls": False, "noise_seed": noise_seed,
                                      "device_sampling": "poisson", "sample_rate": 0.5, "adaptive_clip": adaptive},
                             fedavg={**SCHEDULE, "edge_rounds": 1})

    prepared = prepare(config(1))
    runs = [_run(config(1), prepared, monkeypatch), _run(config(2), prepared, monkeypatch),
            _run(config(1), _other_data(prepared), monkeypatch)]
    up = [{k: v for k, v in run.items() if _receiver_untrusted(k[0], prepared)} for run in runs]
    assert up[0].keys() == up[1].keys() == up[2].keys()  # the same cell updates, whoever was sampled
    assert "cell_update" in {str(h["t"]) for h, _ in up[0].values()}
    inside = [sorted(k for k, (h, _) in run.items() if h["t"] == "device_update" and
                     not _receiver_untrusted(k[0], prepared)) for run in runs]
    assert inside[0] != inside[1]  # the trusted cell's sample did change with the (secret) seed
    assert {"cell_update", "device_update"} <= {str(h["t"]) for h, _ in up[0].values()}  # cell-b: local DP
    problems: list[str] = []
    for key, (header, body) in sorted(up[0].items()):
        kind = str(header["t"])
        for path in sorted(set(header) | ({"body"} if body else set())):
            field = disclosure.SAMPLED.get(kind, {}).get(path) or disclosure.classify(kind, path)
            if field is None:
                assert header.get(path) == [], (kind, path)  # an empty list of maps (no tensors) is fine
                continue
            values = [run[key][1] if path == "body" else run[key][0].get(path) for run in up]
            if field.disclosure in (PUBLIC, WITHHELD) and not values[0] == values[1] == values[2]:
                problems.append(f"{key[1]} {path} is {field.disclosure} but differs: {values!r}")
            elif field.disclosure == NOISED and values[0] == values[1]:
                problems.append(f"{key[1]} {path} is the same with other noise")
    assert problems == []


def test_under_distributed_dp_every_field_is_classified_and_the_masked_inputs_carry_noise(
        small_rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Secure aggregation with [privacy]: every upward field of the protocol and of the cell updates is listed;
    what a device sends differs with the noise (its share is in the masked input), never with the data alone
    except through the noised values; the cell updates' privacy reports are public."""
    def config(noise_seed: int) -> RolloutConfig:
        return small_rollout(rounds=2, topology={"cells": 2, "devices_per_cell": 3, "trusted": {"cell-a": True}},
                             privacy={"epsilon": 8.0, "clip": 1.0, "require_tls": False, "noise_seed": noise_seed},
                             fedavg={**SCHEDULE, "edge_rounds": 1, "weighting": "uniform",
                                     "secure_aggregation": True, "secagg_min_survivors": 2})

    prepared = prepare(config(1))
    a = _run(config(1), prepared, monkeypatch)
    b = _run(config(2), prepared, monkeypatch)
    c = _run(config(1), _other_data(prepared), monkeypatch)
    assert a.keys() == b.keys() == c.keys()
    kinds = {str(header["t"]) for header, _ in a.values()}
    assert {"secagg_keys", "secagg_shares", "secagg_masked", "secagg_reveal", "cell_update"} <= kinds, kinds
    assert "device_update" not in kinds  # no individual update ever reaches an edge

    problems: list[str] = []
    for key, (header, body) in sorted(a.items()):
        kind = str(header["t"])
        problems += [f"{key[1]}: {path} is not classified" for path in disclosure.unlisted(kind, header)]
        for path in sorted(set(header) | ({"body"} if body else set())):
            field = disclosure.classify(kind, path)
            va, vb, vc = (run[1] if path == "body" else run[0].get(path) for run in (a[key], b[key], c[key]))
            if field is not None and field.disclosure == PUBLIC and not va == vb == vc:
                problems.append(f"{key[1]} {path} is public but differs between runs")
            if field is not None and field.disclosure == NOISED and va == vb:
                problems.append(f"{key[1]} {path} is the same with other noise: the noise is missing")
    assert problems == []
    updates = [h for h, _ in a.values() if h["t"] == "cell_update"]
    assert all(h["m.privacy.distributed"] is True for h in updates)
    assert all(h["m.privacy.releases[].inputs.survivors"] == [3] for h in updates)

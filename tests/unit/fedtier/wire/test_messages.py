"""fedtier.wire.messages: typed messages, their round trip through bytes, and idempotency keys."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedtier import wire
from fedtier.errors import DecodeError, LocalProtocolError, MalformedHeaderError, UnknownMessageTypeError
from fedtier.wire import Envelope, TensorEncoding, messages
from fedtier.wire.messages import (
    ArtifactBlob,
    ArtifactRequest,
    CellPresence,
    CellStep,
    CellTask,
    CellUpdate,
    DeviceGradient,
    DeviceTask,
    DeviceUpdate,
    Embeddings,
    Message,
    PartnerEmbeddings,
    ScorePool,
    TrainingFailed,
    XRiskCellTask,
    XRiskCellUpdate,
    XRiskDeviceTask,
    XRiskDeviceUpdate,
    decode_message,
    make_key,
    messages_equal,
)

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

PARAMS = {"w": np.array([[1.0, 2.0], [-0.5, 0.25]], np.float32), "b": np.array([0.0, 3.0], np.float32)}
POOL = ScorePool(round=1, pos=np.array([0.75, 0.5, 0.25], np.float32), neg=np.array([0.125, 0.0625], np.float32),
                 u=np.array([1.0, 1.25, 2.0], np.float32), sources=(("d1", 2, 0), ("d3", 1, 2)))
BLOB = b"\x00onnx-bytes\xff" * 3
BLOB_SHA = hashlib.sha256(BLOB).hexdigest()


def examples() -> list[Message]:
    """One instance of every message type, with every field set to a non-default value."""
    return [
        CellTask(rollout="r1", round=2, sender="cloud", params=PARAMS, members=("d1", "d2"),
                 config={"lr": 0.1, "local_steps": 5, "quorum": 0.5, "names": ["a", "b"], "sub": {"x": None}},
                 model_version=7),
        DeviceTask(rollout="r1", round=2, sender="edge-1", params=PARAMS, config={"lr": 0.1, "batch": 16},
                   members=("d1", "d2", "d3")),
        DeviceUpdate(rollout="r1", round=2, sender="d1", delta=PARAMS, num_samples=40, train_loss=0.75, steps=5),
        CellUpdate(rollout="r1", round=2, sender="edge-1", delta=PARAMS, weight=3.0, reported=("d1", "d3"),
                   mean_loss=0.5, stats={"bytes_in": 1024, "dropped": 1}),
        ArtifactRequest(rollout="r1", round=0, sender="d1", digests=(BLOB_SHA, "0" * 64)),
        ArtifactBlob(rollout="r1", round=0, sender="edge-1", sha256=BLOB_SHA, name="model.onnx", data=BLOB),
        DeviceGradient(rollout="r1", round=2, sender="d1", step=3, grad=PARAMS, model_sha="ab" * 32, loss=0.4,
                       num_samples=12, q=1.5),
        CellStep(rollout="r1", round=2, sender="edge-1", step=3, tensors_=PARAMS, kind="delta",
                 model_sha="cd" * 32, reported=("d1", "d2")),
        XRiskCellTask(rollout="r1", round=2, sender="cloud", params=PARAMS, members=("d1", "d2"),
                      config={"lr": 0.1}, model_version=7, momentum=PARAMS, pool=POOL),
        XRiskDeviceTask(rollout="r1", round=2, sender="edge-1", params=PARAMS, config={"lr": 0.1},
                        members=("d1", "d2"), pool=POOL),
        XRiskDeviceUpdate(rollout="r1", round=2, sender="d1", delta=PARAMS, num_samples=40, train_loss=0.75, steps=5,
                          momentum=PARAMS, scores=ScorePool(round=2, pos=np.array([0.5], np.float32),
                                                            neg=np.array([0.25, 0.125], np.float32),
                                                            u=np.array([1.5], np.float32), sources=(("d1", 1, 2),))),
        XRiskCellUpdate(rollout="r1", round=2, sender="edge-1", delta=PARAMS, weight=3.0, reported=("d1", "d3"),
                        mean_loss=0.5, scores=dataclasses.replace(POOL, u=None, round=2)),
        Embeddings(rollout="r1", round=2, sender="h1", step=1, zeta=np.array([[0.5, 1.0], [2.0, 0.0]], np.float32),
                   rows=("d1", "d3"), params={"theta0/w": PARAMS["w"]}),
        PartnerEmbeddings(rollout="r1", round=2, sender="edge-1", step=1, zeta=np.array([[0.5, 1.0]], np.float32),
                          rows=("d1",)),
        CellPresence(rollout="r1", round=0, sender="edge-1", online=("d1", "d3"), known=4),
        TrainingFailed(rollout="r1", round=2, sender="d1", step=1, reason="crash"),
    ]


def ids(msgs: list[Message]) -> list[str]:
    return [type(m).__name__ for m in msgs]


def reencode(msg: Message, **meta_changes: Any) -> bytes:
    """Encode ``msg`` with some ``meta`` fields changed (``...`` deletes one), keeping its key."""
    env = msg.to_envelope()
    meta = {**env.meta, **meta_changes}
    meta = {k: v for k, v in meta.items() if v is not ...}
    return wire.encode(dataclasses.replace(env, meta=meta))


def test_every_message_type_is_registered_under_its_kind() -> None:
    import fedtier.secagg.messages  # noqa: F401  (registers secure aggregation's kinds)

    assert set(messages.MESSAGE_TYPES) == {"cell_task", "device_task", "device_update", "cell_update",
                                           "artifact_request", "artifact", "device_gradient", "cell_step",
                                           "xrisk_cell_task", "xrisk_device_task", "xrisk_device_update",
                                           "xrisk_cell_update", "hsgd_embeddings", "hsgd_partner", "secagg_keys",
                                           "secagg_roster", "secagg_shares", "secagg_bundle", "secagg_masked",
                                           "secagg_unmask", "secagg_reveal", "secagg_aborted", "cell_presence",
                                           "training_failed"}
    for kind, cls in messages.MESSAGE_TYPES.items():
        assert cls.KIND == kind


@pytest.mark.parametrize("msg", examples(), ids=ids(examples()))
def test_round_trip_through_bytes(msg: Message) -> None:
    # Execute
    out = decode_message(msg.encode())

    # Assert
    assert type(out) is type(msg)
    assert messages_equal(out, msg)
    assert out.key == msg.key


@pytest.mark.parametrize("msg", examples()[:4], ids=ids(examples()[:4]))
def test_round_trip_with_f16_tensors(msg: Message) -> None:
    # PARAMS' values are exact in float16.
    encodings = {name: TensorEncoding("f16") for name in PARAMS}

    out = decode_message(msg.encode(encodings))

    assert messages_equal(out, msg)
    assert all(s["e"] == "f16" for s in wire.decode(msg.encode(encodings)).tensor_specs)


def test_decoded_tensors_are_read_only() -> None:
    out = decode_message(examples()[2].encode())

    assert isinstance(out, DeviceUpdate)
    assert not out.delta["w"].flags.writeable


def test_messages_equal_notices_each_field() -> None:
    base = examples()[3]
    assert isinstance(base, CellUpdate)
    variants = [
        dataclasses.replace(base, round=3),
        dataclasses.replace(base, sender="edge-2"),
        dataclasses.replace(base, weight=4.0),
        dataclasses.replace(base, reported=("d1",)),
        dataclasses.replace(base, stats={}),
        dataclasses.replace(base, delta={**PARAMS, "b": np.array([0.0, 3.5], np.float32)}),
        dataclasses.replace(base, delta={"w": PARAMS["w"]}),
        dataclasses.replace(base, delta={}),
    ]

    assert messages_equal(base, examples()[3])
    for v in variants:
        assert not messages_equal(base, v)
        assert not messages_equal(v, base)
    assert not messages_equal(examples()[0], examples()[1])


# --- idempotency keys -------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(len(examples())), ids=ids(examples()))
def test_keys_are_deterministic(index: int) -> None:
    a, b = examples()[index], examples()[index]

    assert a is not b
    assert a.key == b.key
    assert wire.decode(a.encode()).key == a.key


def test_key_format_is_kind_rollout_round_step_sender() -> None:
    assert make_key("device_update", "r1", 2, 0, "d1") == "device_update/r1/2/0/d1"
    assert examples()[2].key == "device_update/r1/2/0/d1"
    assert examples()[0].key == "cell_task/r1/2/0/cloud"


def test_keys_ignore_payload_but_not_identity() -> None:
    """A resend of the same update (even recomputed) has the same key; another round or
    sender does not."""
    upd = examples()[2]
    assert isinstance(upd, DeviceUpdate)

    assert dataclasses.replace(upd, train_loss=9.0, delta={}).key == upd.key
    assert dataclasses.replace(upd, round=3).key != upd.key
    assert dataclasses.replace(upd, sender="d2").key != upd.key
    assert dataclasses.replace(upd, rollout="r2").key != upd.key
    assert CellUpdate(rollout="r1", round=2, sender="d1", weight=1.0).key != upd.key


def test_a_training_failure_names_one_of_the_bounded_reasons() -> None:
    """The reason is a metric label at the edge: a sender cannot make up one (a label per device, say)."""
    failed = TrainingFailed(rollout="r1", round=2, sender="d1", step=1, reason="non_finite")
    assert failed.key == "training_failed/r1/2/1/d1"
    with pytest.raises(LocalProtocolError):
        TrainingFailed(rollout="r1", round=2, sender="d1", reason="d1 exploded")
    with pytest.raises(MalformedHeaderError):
        decode_message(reencode(failed, reason="d1 exploded"))
    with pytest.raises(MalformedHeaderError):
        decode_message(reencode(failed, reason=7))


def test_artifact_keys_follow_content() -> None:
    req = examples()[4]
    blob = examples()[5]
    assert isinstance(req, ArtifactRequest) and isinstance(blob, ArtifactBlob)

    assert dataclasses.replace(req, digests=(BLOB_SHA,)).key != req.key
    assert dataclasses.replace(req, sender="d2").key != req.key
    # The same file relayed by another node or in another round is the same blob.
    assert dataclasses.replace(blob, sender="cloud", round=5).key == blob.key
    assert dataclasses.replace(blob, sha256="0" * 64).key != blob.key


@pytest.mark.parametrize("msg", examples(), ids=ids(examples()))
def test_a_key_that_does_not_match_the_content_is_rejected(msg: Message) -> None:
    env = msg.to_envelope()
    forged = dataclasses.replace(env, key=env.key + "x")

    with pytest.raises(MalformedHeaderError, match="idempotency key"):
        decode_message(wire.encode(forged))


def test_a_replayed_update_with_a_rewritten_round_is_rejected() -> None:
    """Changing the round without the key (a naive replay) does not pass as a new message."""
    env = examples()[2].to_envelope()

    with pytest.raises(MalformedHeaderError):
        decode_message(wire.encode(dataclasses.replace(env, round=3)))


def test_these_types_have_no_steps_so_a_step_1_key_is_rejected() -> None:
    env = examples()[0].to_envelope()
    stepped = dataclasses.replace(env, step=1, key=make_key("cell_task", "r1", 2, 1, "cloud"))

    with pytest.raises(MalformedHeaderError):
        decode_message(wire.encode(stepped))


def test_stepped_types_carry_their_step_into_the_key() -> None:
    for msg in (DeviceUpdate(rollout="r1", round=2, sender="d1", step=4, delta=PARAMS, num_samples=1),
                examples()[6], examples()[7]):
        out = decode_message(msg.encode())
        assert out.step == msg.step and out.key == make_key(msg.KIND, "r1", 2, msg.step, msg.sender)


# --- field validation -------------------------------------------------------------------------

REQUIRED = {
    "CellTask": ["members", "config", "model_version"],
    "DeviceTask": ["config", "members"],
    "DeviceUpdate": ["num_samples", "train_loss", "steps"],
    "CellUpdate": ["weight", "reported", "mean_loss", "stats"],
    "ArtifactRequest": ["digests"],
    "ArtifactBlob": ["sha256", "name"],
    "DeviceGradient": ["model_sha", "loss", "num_samples", "q"],
    "CellStep": ["kind", "model_sha", "reported"],
    "XRiskCellTask": ["members", "config", "model_version", "pool"],
    "XRiskDeviceTask": ["config", "members", "pool"],
    "XRiskDeviceUpdate": ["num_samples", "train_loss", "steps", "pool"],
    "XRiskCellUpdate": ["weight", "reported", "mean_loss", "stats", "pool"],
    "Embeddings": ["rows"],
    "PartnerEmbeddings": ["rows"],
    "CellPresence": ["online", "known"],
    "TrainingFailed": ["reason"],
}


@pytest.mark.parametrize(("index", "field"), [(i, f) for i, m in enumerate(examples())
                                              for f in REQUIRED[type(m).__name__]])
def test_missing_field(index: int, field: str) -> None:
    data = reencode(examples()[index], **{field: ...})

    with pytest.raises(MalformedHeaderError, match=field):
        decode_message(data)


@pytest.mark.parametrize(("index", "field", "value"), [
    (0, "members", "d1"), (0, "members", ["d1", 2]), (0, "config", [1]), (0, "model_version", "7"),
    (0, "model_version", True), (0, "model_version", 7.0),
    (1, "config", "lr=0.1"), (1, "members", None),
    (2, "num_samples", "40"), (2, "num_samples", True), (2, "num_samples", 40.0), (2, "train_loss", "0.5"),
    (2, "train_loss", True), (2, "train_loss", float("nan")), (2, "train_loss", float("inf")), (2, "steps", None),
    (3, "weight", "3"), (3, "weight", False), (3, "weight", float("nan")), (3, "reported", [1]),
    (3, "mean_loss", None), (3, "stats", []),
    (4, "digests", BLOB_SHA), (4, "digests", [1]),
    (5, "sha256", 5), (5, "name", None),
])
def test_mistyped_field(index: int, field: str, value: Any) -> None:
    data = reencode(examples()[index], **{field: value})

    with pytest.raises(MalformedHeaderError):
        decode_message(data)


@pytest.mark.parametrize("meta", [{"online": ["d1", "d1"]}, {"known": 1}, {"known": -1}, {"online": "d1"}])
def test_a_presence_summary_that_contradicts_itself_is_refused(meta: dict[str, Any]) -> None:
    with pytest.raises(MalformedHeaderError):
        decode_message(reencode(CellPresence(rollout="r1", round=0, sender="c1", online=("d1", "d2"), known=3),
                                **meta))


def test_int_fields_accept_ints_for_floats() -> None:
    """msgpack may carry a whole-number loss as an int; float fields accept it."""
    msg = examples()[2]

    out = decode_message(reencode(msg, train_loss=1))

    assert isinstance(out, DeviceUpdate)
    assert out.train_loss == 1.0 and isinstance(out.train_loss, float)


@pytest.mark.parametrize("n", [-1, -(2**40)])
def test_negative_num_samples_is_rejected(n: int) -> None:
    msg = DeviceUpdate(rollout="r1", round=2, sender="d1", delta=PARAMS, num_samples=n, train_loss=0.5, steps=5)

    with pytest.raises(MalformedHeaderError, match="num_samples"):
        decode_message(msg.encode())


def test_zero_num_samples_is_accepted() -> None:
    msg = DeviceUpdate(rollout="r1", round=2, sender="d1", delta=PARAMS, num_samples=0, train_loss=0.5, steps=5)

    out = decode_message(msg.encode())

    assert messages_equal(out, msg)


@pytest.mark.parametrize("weight", [0.0, -1.0, -1e-300])
def test_non_positive_cell_weight_is_rejected(weight: float) -> None:
    msg = CellUpdate(rollout="r1", round=2, sender="edge-1", delta=PARAMS, weight=weight)

    with pytest.raises(MalformedHeaderError, match="weight"):
        decode_message(msg.encode())


@pytest.mark.parametrize("digest", [
    BLOB_SHA.upper(), BLOB_SHA[:-1], BLOB_SHA + "0", "g" * 64, "", " " + BLOB_SHA[1:], "../" + BLOB_SHA[3:],
])
def test_artifact_request_digests_must_be_lowercase_hex_sha256(digest: str) -> None:
    msg = ArtifactRequest(rollout="r1", round=0, sender="d1", digests=(BLOB_SHA, digest))

    with pytest.raises(MalformedHeaderError, match="digests"):
        decode_message(msg.encode())


def test_artifact_request_with_no_digests_round_trips() -> None:
    msg = ArtifactRequest(rollout="r1", round=0, sender="d1", digests=())

    assert messages_equal(decode_message(msg.encode()), msg)


def test_artifact_blob_needs_a_1d_u8_data_tensor() -> None:
    blob = examples()[5]
    env = blob.to_envelope()

    for tensors, encodings in [({}, {}),
                               ({"data": np.zeros(3, np.float32)}, {}),
                               ({"data": np.zeros((2, 2), np.uint8)}, {"data": TensorEncoding("u8")})]:
        with pytest.raises(MalformedHeaderError):
            decode_message(wire.encode(dataclasses.replace(env, tensors=tensors, encodings=encodings)))


def test_empty_artifact_blob_round_trips() -> None:
    msg = ArtifactBlob(rollout="r1", round=0, sender="e", sha256=hashlib.sha256(b"").hexdigest(), name="x", data=b"")

    assert messages_equal(decode_message(msg.encode()), msg)


def test_unknown_type_is_rejected() -> None:
    env = Envelope(type="gossip", rollout="r1", round=0, sender="d1", key="gossip/r1/0/0/d1")

    with pytest.raises(UnknownMessageTypeError):
        decode_message(wire.encode(env))


def test_chunk_envelopes_are_not_messages() -> None:
    env = Envelope(type="chunk", rollout="r1", round=0, sender="d1", key="k#0/2", chunk_index=0, chunk_count=2)

    with pytest.raises(UnknownMessageTypeError):
        decode_message(wire.encode(env))


def test_decode_message_honours_max_bytes() -> None:
    data = examples()[0].encode()

    with pytest.raises(DecodeError):
        decode_message(data, max_bytes=len(data) - 1)


def test_config_must_be_plain_data() -> None:
    msg = CellTask(rollout="r1", round=0, sender="cloud", config={"x": object()})

    with pytest.raises(LocalProtocolError, match="config.x"):
        msg.encode()


def test_register_message_refuses_to_reuse_a_kind() -> None:
    @dataclasses.dataclass(frozen=True, slots=True, eq=False)
    class Impostor(Message):
        KIND = "device_update"

    with pytest.raises(LocalProtocolError):
        messages.register_message(Impostor)
    assert messages.MESSAGE_TYPES["device_update"] is DeviceUpdate
    # Registering the class that already owns the kind is a no-op.
    assert messages.register_message(DeviceUpdate) is DeviceUpdate


# --- property: any valid DeviceUpdate / CellUpdate round-trips ------------------------------------

_ids = st.text("abcdefghijklmnopqrstuvwxyz0123456789_.-", min_size=1, max_size=20)
_finite = st.floats(allow_nan=False, allow_infinity=False)


@SETTINGS
@given(rollout=_ids, rnd=st.integers(0, 2**40), sender=_ids, n=st.integers(0, 2**40), loss=_finite,
       steps=st.integers(0, 10_000), values=st.lists(st.floats(-1e6, 1e6, width=32), max_size=6))
def test_device_update_round_trip_property(rollout: str, rnd: int, sender: str, n: int, loss: float, steps: int,
                                           values: list[float]) -> None:
    msg = DeviceUpdate(rollout=rollout, round=rnd, sender=sender, delta={"v": np.array(values, np.float32)},
                       num_samples=n, train_loss=loss, steps=steps)

    out = decode_message(msg.encode())

    assert messages_equal(out, msg)
    assert out.key == make_key("device_update", rollout, rnd, 0, sender)


@SETTINGS
@given(rollout=_ids, sender=_ids, weight=st.floats(min_value=1e-300, allow_infinity=False),
       reported=st.lists(_ids, max_size=4).map(tuple), loss=_finite)
def test_cell_update_round_trip_property(rollout: str, sender: str, weight: float, reported: tuple[str, ...],
                                         loss: float) -> None:
    msg = CellUpdate(rollout=rollout, round=1, sender=sender, delta={"v": np.ones(2, np.float32)}, weight=weight,
                     reported=reported, mean_loss=loss, stats={"n": len(reported)})

    assert messages_equal(decode_message(msg.encode()), msg)

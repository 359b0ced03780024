"""Every exception fedtier raises on purpose, under one abstract base.

The split follows h11: an error has a *direction*.

* ``LocalProtocolError`` — the caller (our own shell, or a user of the library) asked a role
  to do something illegal in its current state. It is a bug on our side of the wire.
* ``RemoteProtocolError`` — a peer sent something we must not accept: garbage bytes, a
  truncated envelope, a wrong round, an unknown sender, a NaN tensor. The runtime shells
  drop such a message, log the typed reason and count it in a metric; they never crash.
* ``ConfigError`` — a configuration file or option is invalid; the message names the key.

Any other exception escaping a role is a bug and is allowed to crash loudly.

Every ``RemoteProtocolError`` subclass has a short, stable ``reason`` string. Shells use it
as the metric label (``fedtier_rejected_total{reason="sha_mismatch"}``), so never rename one.
"""

from __future__ import annotations


class FedtierError(Exception):
    """Abstract base of every error fedtier raises deliberately."""

    def __new__(cls, *args: object, **kwargs: object) -> "FedtierError":
        if cls is FedtierError:
            raise TypeError("FedtierError is abstract; raise a subclass")
        return super().__new__(cls, *args)


class LocalProtocolError(FedtierError):
    """The caller misused a role or codec (wrong state, bad argument). A bug on our side."""


class RemoteProtocolError(FedtierError):
    """A peer sent something that must be rejected. Shells drop, log and count these."""

    reason = "remote_protocol_error"


# --- decoding (fedtier.wire) -------------------------------------------------------------


class DecodeError(RemoteProtocolError):
    """Bytes from the wire could not be turned into a valid message."""

    reason = "decode_error"


class BadMagicError(DecodeError):
    """The bytes do not start with the fedtier envelope magic."""

    reason = "bad_magic"


class UnsupportedVersionError(DecodeError):
    """The envelope's schema version is newer (or older) than this build understands."""

    reason = "unsupported_version"


class TruncatedError(DecodeError):
    """The envelope ends before the lengths in its header say it should."""

    reason = "truncated"


class MalformedHeaderError(DecodeError):
    """The header is not a valid msgpack map with the required typed fields."""

    reason = "malformed_header"


class ShaMismatchError(DecodeError):
    """The body's digest (sha256, or the one ``dg`` names) differs from the value carried in the header."""

    reason = "sha_mismatch"


class UnknownDigestError(DecodeError):
    """The header names a body digest (``dg``) this build does not check."""

    reason = "unknown_digest"


class TensorSpecError(DecodeError):
    """A tensor's shape, dtype, encoding or byte length is inconsistent or unexpected."""

    reason = "tensor_spec"


class NonFiniteTensorError(DecodeError):
    """A tensor holds NaN or infinity."""

    reason = "non_finite"


class UnknownMessageTypeError(DecodeError):
    """The header names a message type this build does not know."""

    reason = "unknown_type"


class OversizeError(DecodeError):
    """A message or reassembled chunk set exceeds the configured size limit."""

    reason = "oversize"


class ChunkError(DecodeError):
    """A chunk is inconsistent with the other chunks of its message."""

    reason = "chunk"


class ManifestError(DecodeError):
    """A rollout manifest is not valid JSON or lacks/mistypes a required field."""

    reason = "bad_manifest"


class ManifestSignatureError(DecodeError):
    """A manifest's signature does not verify (or a signed manifest was required and absent)."""

    reason = "bad_signature"


class UnknownSigningKeyError(DecodeError):
    """A manifest is signed by a key this node does not trust."""

    reason = "unknown_key"


class StaleManifestError(RemoteProtocolError):
    """A manifest whose version is not newer than the one installed (a replay or a rollback)."""

    reason = "stale_manifest"


class ExpiredManifestError(RemoteProtocolError):
    """A manifest past its expiry time."""

    reason = "expired_manifest"


# --- protocol state (fedtier.algorithms) --------------------------------------------------


class WrongRoundError(RemoteProtocolError):
    """A message for a round (or step) other than the one the receiver is in."""

    reason = "wrong_round"


class UnknownSenderError(RemoteProtocolError):
    """A message from a node that is not a member of this round."""

    reason = "unknown_sender"


class LateMessageError(RemoteProtocolError):
    """A message for a round the receiver has already closed (a straggler)."""

    reason = "late"


class RolloutEndedError(RemoteProtocolError):
    """A message of a rollout the receiver saw end (its manifest cleared): a replay, or a straggler of a
    stopped rollout. Nothing of it is accepted, stored or trained."""

    reason = "rollout_ended"


class SenderMismatchError(RemoteProtocolError):
    """The envelope's sender differs from the node id its topic (and ACL identity) names."""

    reason = "sender_mismatch"


class UnexpectedMessageError(RemoteProtocolError):
    """A message of a type the receiver does not accept in its current state."""

    reason = "unexpected_message"


class LayoutMismatchError(RemoteProtocolError):
    """A message's tensors do not match the model layout of the rollout."""

    reason = "layout_mismatch"


class ScoreListError(RemoteProtocolError):
    """An X-risk score list (FeDXL's ``pos_scores``/``neg_scores``/``pos_u``) of the wrong length,
    out of its range, or not aligned with its partner list."""

    reason = "bad_scores"


class StaleScoresError(RemoteProtocolError):
    """X-risk scores computed in another round than the one they are offered for (FeDXL's passive
    pool must be exactly one round old; a device's uploaded scores are of the round it reports)."""

    reason = "stale_scores"


class MissingReleaseError(RemoteProtocolError):
    """A payload that the noise plan says must carry differential-privacy noise has no (or a
    too weak) release record: it may be a clear model, so it is refused (M2FDP audit)."""

    reason = "missing_release"


class EmbeddingWidthError(RemoteProtocolError):
    """HSGD: an embedding (``zeta2``, ``Z1``) whose width or row count is not the model's."""

    reason = "embedding_width"


class EmbeddingNonFiniteError(RemoteProtocolError):
    """HSGD: an embedding holding NaN or infinity (it would poison the partner's every step)."""

    reason = "embedding_non_finite"


class EmbeddingEncodingError(RemoteProtocolError):
    """HSGD: an embedding or head not in the vertical path's compressed form (``bits_embedding`` with its
    ``compressor``): the edge relays what it receives re-encoded, so it must already be on that grid."""

    reason = "embedding_encoding"


class UnselectedDeviceError(RemoteProtocolError):
    """HSGD: an embedding or model from a device the edge did not select for this interval."""

    reason = "unselected_device"


class StaleIntervalError(RemoteProtocolError):
    """HSGD: an embedding or model for an interval (round, step) other than the open one."""

    reason = "stale_interval"


class PrivacyViolationError(FedtierError):
    """This node was about to send something the noise plan forbids (a clear aggregate to an
    untrusted parent, a clear update without TLS). Nothing is sent; the operator must look."""


# --- configuration --------------------------------------------------------------------------


class ConfigError(FedtierError):
    """A configuration file or option is invalid. ``key`` names the offending key."""

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None):
        self.message = message
        self.key = key
        self.source = source
        where = ""
        if source:
            where += f"{source}: "
        if key:
            where += f"[{key}] "
        super().__init__(f"{where}{message}")


# --- artifacts and runtime ------------------------------------------------------------------


class ArtifactError(FedtierError):
    """A model artifact is missing, corrupt (digest mismatch) or cannot be loaded."""


class TransportError(FedtierError):
    """The transport could not do what was asked (not connected, payload over the limit)."""


class MalformedShareError(RemoteProtocolError):
    """A secure-aggregation share, key or ciphertext that does not parse, decrypt or verify."""

    reason = "malformed_share"


class WrongPhaseError(RemoteProtocolError):
    """A secure-aggregation message for a protocol phase the receiver is not in."""

    reason = "wrong_phase"

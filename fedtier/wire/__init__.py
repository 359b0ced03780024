"""The wire format: what one message is in bytes, and the typed messages built on it.

``envelope`` is the binary envelope (msgpack header + named tensors, digest-checked, validated on
decode); its API is re-exported here, so ``from fedtier import wire; wire.decode(data)`` reads as
what it does. ``quant`` is the b-bit QSGD codec the envelope uses for ``qsgd`` tensors;
``messages`` maps each message kind of the hierarchy onto an envelope.

May import: ``fedtier.errors`` only (and its own modules). No I/O.
"""

from fedtier.wire.envelope import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DIGESTS,
    ENCODINGS,
    FLOAT_ENCODINGS,
    MAGIC,
    MAX_DIM,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    MAX_TENSORS,
    PREFIX_SIZE,
    SCHEMA_VERSION,
    SHA256,
    DecodedTensors,
    Digest,
    EncodedTensor,
    Encoding,
    Envelope,
    TensorEncoding,
    decode,
    encode,
    envelopes_equal,
    float32_equivalent,
    peek_header,
    register_encoding,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES", "DIGESTS", "ENCODINGS", "FLOAT_ENCODINGS", "MAGIC", "MAX_DIM", "MAX_HEADER_BYTES",
    "MAX_NDIM", "MAX_TENSORS", "PREFIX_SIZE", "SCHEMA_VERSION", "SHA256", "DecodedTensors", "Digest",
    "EncodedTensor", "Encoding", "Envelope", "TensorEncoding", "decode", "encode", "envelopes_equal",
    "float32_equivalent", "peek_header", "register_encoding",
]

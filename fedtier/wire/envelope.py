"""The wire envelope: a small msgpack header plus a body of named tensors (DESIGN §5).

Layout of one envelope::

    offset  size  field
    0       4     magic  b"FTEN"
    4       1     schema version (currently 1)
    5       4     header length H, unsigned big-endian
    9       H     header: a msgpack map (keys below)
    9+H     ...   body: the tensors' bytes, concatenated in header order

Header keys (short, because small devices pay for every byte):

    t    message type (str)          ro   rollout id (str)
    r    round (int >= 0)            st   step within the round (int >= 0)
    s    sender node id (str)        k    idempotency key (str)
    sha  sha256 of the body (32 B)   m    message fields (map of plain values)
    ts   tensor specs: list of maps {n: name, e: encoding, sh: shape, nb: byte length, ...}
    ci, cn  chunk index / count (only on ``chunk`` envelopes, see ``fedtier.transport.chunking``)
    dg, dv  the body's digest by another algorithm than sha256: its name (``DIGESTS``) and value,
            in place of ``sha``. Absent: ``sha`` holds the sha256 (what every sender before them sent).
    pd   0-3 zero bytes that make the body start at a multiple of 4 (``BODY_ALIGN``), so that a
         receiver's f32 tensors are views of the message; receivers ignore it (old ones too).

The digest guards against accidental damage between two nodes (a broker, a store or a reassembly
that hands on other bytes than were sent), not against an attacker, who could recompute any
unkeyed digest: TLS and signed manifests do that. ``crc32`` (4 bytes) detects every burst of up to
32 bits and misses random damage with probability 2^-32, at about three times sha256's speed;
``docs/protocol.md`` says which messages carry which, and the upgrade order.

Tensor encodings are a registry (``ENCODINGS``): ``f32`` and ``f16`` (little-endian IEEE),
``u8`` (opaque bytes, e.g. an artifact file), ``qsgd`` (a float32 norm and ``b``-bit QSGD
codes, see ``fedtier.wire.quant``; the spec map carries ``b``), ``qrows`` (QSGD row by row, a float32
scale per row; spec ``b``) and ``topk`` (each row's ``k`` kept entries as indices and float32 values;
spec ``k``) — the last two HSGD's compressed embeddings, which an edge relays by re-encoding them.

``decode`` is the only way in from the wire. It validates everything and raises a subclass
of ``DecodeError``: never pickle, never trust a length. Decoded arrays are read-only.

Schema evolution follows dp_accounting's rule: never remove or reuse a message type or
header key; new keys are optional; a change of meaning gets a new type and a version bump.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import msgpack
import numpy as np

from fedtier.errors import (
    BadMagicError,
    LocalProtocolError,
    MalformedHeaderError,
    NonFiniteTensorError,
    OversizeError,
    ShaMismatchError,
    TensorSpecError,
    TruncatedError,
    UnknownDigestError,
    UnsupportedVersionError,
)
from fedtier.wire import quant

MAGIC = b"FTEN"
SCHEMA_VERSION = 1
_PREFIX = struct.Struct(">4sBI")
PREFIX_SIZE = _PREFIX.size  # 9

MAX_TENSORS = 4096
MAX_NDIM = 8
MAX_DIM = 1 << 31
"""Largest extent of one axis; numpy refuses far smaller products, even for empty arrays."""
MAX_HEADER_BYTES = 1 << 20
MAX_BIN_BYTES = 4096
"""Largest single bytes value in a header (secure aggregation's keys, ciphertexts and shares)."""
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20

# Plain values allowed in the ``m`` map (msgpack types, no extension types, no bytes > limit).
MetaValue = Any


# --- body digests --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Digest:
    """An integrity check of the body: its header name, its size in bytes and how it is computed."""

    name: str
    size: int
    compute: Callable[[bytes | memoryview], bytes]


def _crc32(data: bytes | memoryview) -> bytes:
    return zlib.crc32(data).to_bytes(4, "big")


DIGESTS: dict[str, Digest] = {
    "sha256": Digest("sha256", 32, lambda data: hashlib.sha256(data).digest()),
    "crc32": Digest("crc32", 4, _crc32),  # CRC-32 of zlib (ISO 3309), big-endian
}
"""Digests a receiver of this version checks; names are never reused with another meaning."""

SHA256 = "sha256"
"""The digest of a header without ``dg`` (every sender before ``dg`` existed sends it under ``sha``)."""

BODY_ALIGN = 4
"""Senders pad the header (``pd``) so that the body starts at a multiple of this: float32 bodies decode as views."""


# --- tensor encodings ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """A tensor in wire form: the spec map that goes into the header plus its body bytes."""

    spec: dict[str, Any]
    data: bytes


@dataclass(frozen=True, slots=True)
class Encoding:
    """How one tensor encoding turns arrays into bytes and back.

    ``decode`` receives the validated shape, the spec map and a read-only view of exactly ``nb``
    bytes of the message (what it returns may be a view of them only if the message is an immutable
    ``bytes``: ``f32`` does that when they are aligned, and copies otherwise), and returns a float32
    (or uint8 for ``u8``) array; it raises ``TensorSpecError`` /
    ``NonFiniteTensorError`` on bad input. ``checks_finite``: its ``decode`` already refuses NaN and
    infinity (``NonFiniteTensorError``), so ``decode`` of the envelope does not look again. ``defer``
    (optional): validates like ``decode`` and returns an object with ``shape``, ``finite`` and ``values()``
    that makes the array only when it is read (``DecodedTensors``).
    """

    name: str
    encode: Callable[[np.ndarray, Mapping[str, Any]], EncodedTensor]
    decode: Callable[[tuple[int, ...], Mapping[str, Any], memoryview], np.ndarray]
    expected_nbytes: Callable[[tuple[int, ...], Mapping[str, Any]], int]
    checks_finite: bool = False
    defer: Callable[[tuple[int, ...], Mapping[str, Any], memoryview], Any] | None = None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_finite(name: str, arr: np.ndarray) -> None:
    if not arr.size:
        return
    if arr.dtype == np.float32:
        # The sum of squares is NaN or infinite if any value is (squares are >= 0: no inf - inf), and it is
        # one read of the array (BLAS's dot) instead of a boolean array the size of the tensor. Only an
        # overflow of finite values (|x| > 1.8e19) makes it infinite too: then the exact check decides.
        flat = arr.reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.dot(flat, flat)):
                return
    if not np.isfinite(arr).all():
        raise NonFiniteTensorError(f"tensor {name!r} contains NaN or infinity")


def _raw_float(dtype: str, itemsize: int) -> Encoding:
    np_dtype = np.dtype(dtype).newbyteorder("<")

    def encode(arr: np.ndarray, params: Mapping[str, Any]) -> EncodedTensor:
        with np.errstate(over="ignore"):
            a = np.ascontiguousarray(arr, dtype=np_dtype)
        if a.size and not np.isfinite(a).all():
            # e.g. 70000.0 as f16 becomes inf: every receiver would reject it, so refuse here.
            raise LocalProtocolError(f"values overflow {dtype} (largest finite: {np.finfo(np_dtype).max})")
        return EncodedTensor(spec={}, data=a.tobytes())

    def decode(shape: tuple[int, ...], spec: Mapping[str, Any], data: memoryview) -> np.ndarray:
        if np_dtype == np.dtype(np.float32) and sys.byteorder == "little":
            view = np.frombuffer(data, dtype=np.float32)
            if view.flags.aligned and isinstance(data, memoryview) and isinstance(data.obj, bytes):
                # No copy: a read-only view of the received message, which is immutable and which the
                # array keeps alive (an edge holds every update of its cell until the cell closes).
                return view.reshape(shape)
            out = np.empty(len(data) // itemsize, dtype=np.float32)  # a plain aligned copy (astype from an
            out.view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)  # unaligned buffer is several times slower)
            return out.reshape(shape)
        return np.frombuffer(data, dtype=np_dtype).reshape(shape).astype(np.float32)

    def nbytes(shape: tuple[int, ...], spec: Mapping[str, Any]) -> int:
        return _numel(shape) * itemsize

    return Encoding(name=dtype, encode=encode, decode=decode, expected_nbytes=nbytes)


def _u8() -> Encoding:
    def encode(arr: np.ndarray, params: Mapping[str, Any]) -> EncodedTensor:
        return EncodedTensor(spec={}, data=np.ascontiguousarray(arr, dtype=np.uint8).tobytes())

    def decode(shape: tuple[int, ...], spec: Mapping[str, Any], data: memoryview) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).reshape(shape).copy()

    def nbytes(shape: tuple[int, ...], spec: Mapping[str, Any]) -> int:
        return _numel(shape)

    return Encoding(name="u8", encode=encode, decode=decode, expected_nbytes=nbytes)


ENCODINGS: dict[str, Encoding] = {}


def register_encoding(encoding: Encoding) -> None:
    """Add a tensor encoding (e.g. ``qsgd``). Names are never reused with another meaning."""
    if encoding.name in ENCODINGS and ENCODINGS[encoding.name] is not encoding:
        raise LocalProtocolError(f"encoding {encoding.name!r} is already registered")
    ENCODINGS[encoding.name] = encoding


def _qsgd() -> Encoding:
    """QSGD levels (``fedtier.wire.quant``): float32 norm, then ``b``-bit codes; spec ``{"b": bits}``.

    Encoding is lossless: the tensor must already be ``Q(x)`` (``quant.qsgd``), and the
    encoding params carry its ``bits`` and ``norm``. Decoding rejects bit widths out of range,
    code lengths that do not match, negative or non-finite norms and unused codes.
    """

    def bits_of(spec: Mapping[str, Any]) -> int:
        bits = spec.get("b")
        if not isinstance(bits, int) or isinstance(bits, bool) or not quant.MIN_BITS <= bits <= quant.MAX_BITS:
            raise TensorSpecError(f"qsgd bits {bits!r} outside [{quant.MIN_BITS}, {quant.MAX_BITS}]")
        return bits

    def encode(arr: np.ndarray, params: Mapping[str, Any]) -> EncodedTensor:
        bits, norm = params["bits"], np.float32(params["norm"])
        signed = quant.to_levels(arr, norm, bits)
        return EncodedTensor(spec={"b": bits}, data=struct.pack("<f", norm) + quant.pack(signed, bits))

    def check(shape: tuple[int, ...], spec: Mapping[str, Any], data: memoryview) -> quant.Codes:
        bits = bits_of(spec)
        (norm,) = struct.unpack_from("<f", data, 0)
        if not np.isfinite(norm):
            raise NonFiniteTensorError(f"qsgd norm is {norm}")
        if norm < 0:
            raise TensorSpecError(f"qsgd norm is negative ({norm})")
        codes: bytes | memoryview = data[4:]
        if not (isinstance(data, memoryview) and isinstance(data.obj, bytes)):
            codes = bytes(codes)  # a mutable buffer may change after decoding: keep a copy, not a view of it
        try:
            return quant.Codes.check(codes, np.float32(norm), bits, shape)
        except ValueError as exc:
            raise TensorSpecError(f"qsgd codes: {exc}") from None

    def decode(shape: tuple[int, ...], spec: Mapping[str, Any], data: memoryview) -> np.ndarray:
        codes = check(shape, spec, data)
        values = codes.values()
        if not codes.finite and values.size and not np.isfinite(values).all():
            raise NonFiniteTensorError(f"qsgd values overflow float32 (norm {codes.norm})")
        return values

    def nbytes(shape: tuple[int, ...], spec: Mapping[str, Any]) -> int:
        return quant.encoded_size(_numel(shape), bits_of(spec))

    return Encoding(name="qsgd", encode=encode, decode=decode, expected_nbytes=nbytes, checks_finite=True,
                    defer=check)


def _bits_of(spec: Mapping[str, Any], what: str) -> int:
    bits = spec.get("b")
    if not isinstance(bits, int) or isinstance(bits, bool) or not quant.MIN_BITS <= bits <= quant.MAX_BITS:
        raise TensorSpecError(f"{what} bits {bits!r} outside [{quant.MIN_BITS}, {quant.MAX_BITS}]")
    return bits


def _qrows() -> Encoding:
    """QSGD per row with each row's largest magnitude as its scale (``fedtier.wire.quant.qrows``): a float32
    scale per row, then ``b``-bit codes of every entry; spec ``{"b": bits}``.

    Encoding is lossless and a pure function of the values (a relay re-encodes what it received into the
    same bytes): the tensor must already be on the grid (``quant.qrows``). Decoding rejects bit widths out
    of range, negative, non-finite or subnormal scales, unused codes, and rows not in canonical form (a
    row with a positive scale has an entry on the top level; a row with scale 0 has only zeros).
    """

    def encode(arr: np.ndarray, params: Mapping[str, Any]) -> EncodedTensor:
        bits = params["bits"]
        scales, signed = quant.qrows_levels(arr, bits)
        return EncodedTensor(spec={"b": bits},
                             data=scales.astype("<f4").tobytes() + quant.pack(signed.ravel(), bits))

    def decode(shape: tuple[int, ...], spec: Mapping[str, Any], data: memoryview) -> np.ndarray:
        bits = _bits_of(spec, "qrows")
        s = quant.levels(bits)
        rows, width = quant.rows_of(shape)
        scales = np.frombuffer(data[:4 * rows], dtype="<f4").astype(np.float32)
        if not np.isfinite(scales).all():
            raise NonFiniteTensorError("a qrows scale is not finite")
        if np.any(scales < 0) or np.any((scales > 0) & (scales < np.finfo(np.float32).tiny)):
            raise TensorSpecError("a qrows scale is negative or subnormal")
        try:
            signed = quant.unpack(data[4 * rows:], bits, rows * width).reshape(rows, width)
        except ValueError as exc:
            raise TensorSpecError(f"qrows codes: {exc}") from None
        top = np.abs(signed).max(axis=1) if width else np.zeros(rows, np.int16)
        if np.any((scales > 0) & (top != s)) or np.any((scales == 0) & (top != 0)):
            raise TensorSpecError("a qrows row is not in canonical form (its largest level must be the top one, "
                                  "or every level 0 with scale 0)")
        return quant.qrows_dequantize(scales, signed, s).reshape(shape)

    def nbytes(shape: tuple[int, ...], spec: Mapping[str, Any]) -> int:
        return quant.qrows_size(shape, _bits_of(spec, "qrows"))

    return Encoding(name="qrows", encode=encode, decode=decode, expected_nbytes=nbytes)


TOPK_MAX_EXPANSION = 64
"""A ``topk`` tensor's dense float32 form may weigh at most this many times its body (plus 4 KiB): a small
message must not decode into a huge array."""


def _topk() -> Encoding:
    """Top-k sparsification row by row (``fedtier.wire.quant.topk_rows``): per row ``k`` indices (uint16 for
    rows up to 65,536 wide, else uint32) in increasing order, then the ``k`` float32 values of every row;
    spec ``{"k": k}``. A row with fewer than ``k`` non-zeros is padded with zeros at its lowest unused indices,
    so the bytes are a pure function of the values (a relay re-encodes them unchanged).

    Decoding rejects ``k`` outside ``[0, width]``, indices out of range or not strictly increasing within a
    row, and tensors whose dense form would exceed ``TOPK_MAX_EXPANSION`` times their bytes.
    """

    def k_of(shape: tuple[int, ...], spec: Mapping[str, Any]) -> int:
        k = spec.get("k")
        _, width = quant.rows_of(shape)
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= width:
            raise TensorSpecError(f"top-k count {k!r} outside [0, {width}]")
        return k

    def encode(arr: np.ndarray, params: Mapping[str, Any]) -> EncodedTensor:
        k = params["k"]
        _, width = quant.rows_of(np.shape(arr))
        idx, vals = quant.topk_entries(arr, k)
        index_type = "<u2" if quant.topk_index_bytes(width) == 2 else "<u4"
        return EncodedTensor(spec={"k": k}, data=idx.astype(index_type).tobytes() + vals.astype("<f4").tobytes())

    def decode(shape: tuple[int, ...], spec: Mapping[str, Any], data: memoryview) -> np.ndarray:
        k = k_of(shape, spec)
        rows, width = quant.rows_of(shape)
        if 4 * rows * width > TOPK_MAX_EXPANSION * len(data) + 4096:
            raise TensorSpecError(f"top-k tensor of shape {shape} would expand {len(data)} bytes beyond "
                                  f"{TOPK_MAX_EXPANSION}x")
        ib = quant.topk_index_bytes(width)
        idx = np.frombuffer(data[:rows * k * ib], dtype="<u2" if ib == 2 else "<u4").astype(np.int64)
        idx = idx.reshape(rows, k)
        vals = np.frombuffer(data[rows * k * ib:], dtype="<f4").astype(np.float32).reshape(rows, k)
        if idx.size and (int(idx.max()) >= width or (k > 1 and np.any(np.diff(idx, axis=1) <= 0))):
            raise TensorSpecError("top-k indices out of range or not strictly increasing within a row")
        out = np.zeros((rows, width), np.float32)
        np.put_along_axis(out, idx, vals, axis=1)
        return out.reshape(shape)

    def nbytes(shape: tuple[int, ...], spec: Mapping[str, Any]) -> int:
        return quant.topk_size(shape, k_of(shape, spec))

    return Encoding(name="topk", encode=encode, decode=decode, expected_nbytes=nbytes)


for _enc in (_raw_float("float32", 4), _raw_float("float16", 2), _u8(), _qsgd(), _qrows(), _topk()):
    register_encoding(_enc)
# Short wire names for the float encodings.
ENCODINGS["f32"] = ENCODINGS.pop("float32")
ENCODINGS["f16"] = ENCODINGS.pop("float16")
FLOAT_ENCODINGS = ("f32", "f16")


@dataclass(frozen=True, slots=True)
class TensorEncoding:
    """Which encoding to use for a tensor when sending, with its parameters (e.g. bits)."""

    name: str = "f32"
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in ENCODINGS:
            raise LocalProtocolError(f"unknown tensor encoding {self.name!r}; known: {sorted(ENCODINGS)}")


F32 = TensorEncoding("f32")


# --- the envelope --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class Envelope:
    """One decoded (or to-be-encoded) wire message.

    ``tensors`` maps names to arrays; encode uses ``encodings`` (name -> TensorEncoding,
    default f32) for each. ``meta`` holds the message type's scalar fields.
    """

    type: str
    rollout: str
    round: int
    sender: str
    key: str
    step: int = 0
    meta: Mapping[str, MetaValue] = field(default_factory=dict)
    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)
    encodings: Mapping[str, TensorEncoding] = field(default_factory=dict)
    chunk_index: int | None = None
    chunk_count: int | None = None
    tensor_specs: tuple[Mapping[str, Any], ...] = ()
    """The header specs as received (decode only): carries per-tensor side data such as
    a quantizer's measured relative variance. Empty on envelopes built for sending."""
    digest: str = SHA256
    """The body's digest (a name in ``DIGESTS``): the one to send with, or the one it arrived with."""

    def __post_init__(self) -> None:
        if not isinstance(self.type, str) or not self.type:
            raise LocalProtocolError("envelope type must be a non-empty string")
        if self.digest not in DIGESTS:
            raise LocalProtocolError(f"unknown digest {self.digest!r}; known: {sorted(DIGESTS)}")
        if not isinstance(self.round, int) or self.round < 0:
            raise LocalProtocolError(f"round must be an int >= 0, got {self.round!r}")
        if not isinstance(self.step, int) or self.step < 0:
            raise LocalProtocolError(f"step must be an int >= 0, got {self.step!r}")
        if len(self.tensors) > MAX_TENSORS:
            raise LocalProtocolError(f"too many tensors ({len(self.tensors)} > {MAX_TENSORS})")


def encode(env: Envelope) -> bytes:
    """Serialize an envelope. Raises ``LocalProtocolError`` for values that cannot be sent."""
    specs: list[dict[str, Any]] = []
    parts: list[bytes] = []
    for name, arr in env.tensors.items():
        enc = env.encodings.get(name, F32)
        arr = np.asarray(arr)
        if enc.name in FLOAT_ENCODINGS and arr.size and not np.isfinite(arr).all():
            raise LocalProtocolError(f"refusing to send non-finite tensor {name!r}")
        if arr.ndim > MAX_NDIM:
            raise LocalProtocolError(f"tensor {name!r} has {arr.ndim} dims (max {MAX_NDIM})")
        encoded = ENCODINGS[enc.name].encode(arr, enc.params)
        spec = {"n": name, "e": enc.name, "sh": [int(d) for d in arr.shape], "nb": len(encoded.data)}
        spec.update(encoded.spec)
        specs.append(spec)
        parts.append(encoded.data)
    body = b"".join(parts)
    header: dict[str, Any] = {
        "t": env.type,
        "ro": env.rollout,
        "r": env.round,
        "st": env.step,
        "s": env.sender,
        "k": env.key,
        "m": dict(env.meta),
        "ts": specs,
    }
    value = DIGESTS[env.digest].compute(body)
    if env.digest == SHA256:
        header["sha"] = value  # the header every receiver reads, old ones included
    else:
        header.update(dg=env.digest, dv=value)
    if env.chunk_index is not None:
        header["ci"] = env.chunk_index
        header["cn"] = env.chunk_count
    try:
        packed = msgpack.packb(header, use_bin_type=True)
        if (PREFIX_SIZE + len(packed)) % BODY_ALIGN:
            # "pd" and a bin of n bytes add 5 + n bytes (the map stays below 16 keys, a fixmap)
            header["pd"] = bytes(-(PREFIX_SIZE + len(packed) + 5) % BODY_ALIGN)
            packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"header not serializable: {exc}") from exc
    return _PREFIX.pack(MAGIC, SCHEMA_VERSION, len(packed)) + packed + body


def peek_header(data: bytes) -> dict[str, Any]:
    """Parse and type-check only the prefix and header (no body checks)."""
    header, _ = _split(data, DEFAULT_MAX_MESSAGE_BYTES)
    return header


def _split(data: bytes, max_bytes: int) -> tuple[dict[str, Any], memoryview]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedHeaderError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise OversizeError(f"message of {len(data)} bytes exceeds limit {max_bytes}")
    if len(data) < PREFIX_SIZE:
        raise TruncatedError(f"{len(data)} bytes is shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, hlen = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise BadMagicError(f"bad magic {bytes(magic)!r}")
    if version != SCHEMA_VERSION:
        raise UnsupportedVersionError(f"schema version {version}; this build reads {SCHEMA_VERSION}")
    if hlen > MAX_HEADER_BYTES:
        raise MalformedHeaderError(f"header length {hlen} exceeds {MAX_HEADER_BYTES}")
    if PREFIX_SIZE + hlen > len(data):
        raise TruncatedError(f"header claims {hlen} bytes, only {len(data) - PREFIX_SIZE} present")
    view = memoryview(data)
    try:
        header = msgpack.unpackb(
            view[PREFIX_SIZE:PREFIX_SIZE + hlen],
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=MAX_BIN_BYTES,
            max_str_len=1 << 16,
            # Containers as long as the header can hold (an element takes a byte at least, a map entry two): a cell
            # task lists its members, a cell update its reporters and their evaluations, a roaming task the
            # rollout's devices. Tighter fixed limits (16,384 items, 4,096 keys) refused every message of a cell of
            # 16,384 devices, and every cell update with more than 4,096 devices' evaluations.
            max_array_len=hlen,
            max_map_len=hlen // 2,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, ValueError, ...)
        raise MalformedHeaderError(f"header is not valid msgpack: {exc}") from exc
    _check_header(header)
    return header, view[PREFIX_SIZE + hlen:]


def _require(header: Mapping[str, Any], key: str, typ: type | tuple[type, ...]) -> Any:
    if key not in header:
        raise MalformedHeaderError(f"header lacks required key {key!r}")
    value = header[key]
    if isinstance(value, bool) and typ is int:
        raise MalformedHeaderError(f"header key {key!r} must be int, got bool")
    if not isinstance(value, typ):
        raise MalformedHeaderError(f"header key {key!r} has type {type(value).__name__}")
    return value


def _check_header(header: Any) -> None:
    if not isinstance(header, dict):
        raise MalformedHeaderError("header is not a map")
    if not _require(header, "t", str):
        raise MalformedHeaderError("header key 't' (message type) is empty")
    _require(header, "ro", str)
    _require(header, "s", str)
    _require(header, "k", str)
    for key in ("r", "st"):
        if _require(header, key, int) < 0:
            raise MalformedHeaderError(f"header key {key!r} is negative")
    _digest_of(header)
    _require(header, "m", dict)
    specs = _require(header, "ts", list)
    if len(specs) > MAX_TENSORS:
        raise TensorSpecError(f"{len(specs)} tensors exceed the limit of {MAX_TENSORS}")
    for spec in specs:
        if not isinstance(spec, dict):
            raise MalformedHeaderError("tensor spec is not a map")
    if ("ci" in header) != ("cn" in header):
        raise MalformedHeaderError("chunk index and count must come together")
    if "ci" in header:
        ci, cn = _require(header, "ci", int), _require(header, "cn", int)
        if not (0 <= ci < cn):
            raise MalformedHeaderError(f"chunk index {ci} outside [0, {cn})")


def _digest_of(header: Mapping[str, Any]) -> tuple[Digest, bytes]:
    """The header's digest and its value: ``dg`` and ``dv`` if present, else the sha256 in ``sha``."""
    if "dg" not in header:
        name, key = SHA256, "sha"
    else:
        name, key = _require(header, "dg", str), "dv"
        if name not in DIGESTS:
            raise UnknownDigestError(f"body digest {name[:32]!r}; this build checks {', '.join(sorted(DIGESTS))}")
    digest = DIGESTS[name]
    value = _require(header, key, bytes)
    if len(value) != digest.size:
        raise MalformedHeaderError(f"header {key} is {len(value)} bytes; a {name} digest is {digest.size}")
    return digest, value


class DecodedTensors(Mapping[str, np.ndarray]):
    """A decoded envelope's tensors, in header order, when some are deferred (QSGD's): those were validated
    with the envelope and become read-only arrays when first read (kept from then on).

    ``deferred(name)`` gives a reader that can use them as they are their ``quant.Codes`` instead (the edge
    adds them to its running sum without making the values); ``shape_of(name)`` reads no values. Pickled or
    copied, it is a plain dict of arrays.
    """

    def __init__(self, arrays: dict[str, np.ndarray], deferred: dict[str, Any], order: list[str]) -> None:
        self._arrays = arrays
        self._deferred = deferred
        self._order = order

    def __getitem__(self, name: str) -> np.ndarray:
        arr = self._arrays.get(name)
        if arr is None:
            arr = self._deferred[name].values()
            arr.setflags(write=False)
            self._arrays[name] = arr
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:  # without making the values (Mapping's would read them)
        return name in self._arrays or name in self._deferred

    def deferred(self, name: str) -> Any | None:
        """The validated encoded form of tensor ``name`` (``quant.Codes``), or ``None`` if it was decoded whole."""
        return self._deferred.get(name)

    def shape_of(self, name: str) -> tuple[int, ...]:
        deferred = self._deferred.get(name)
        return tuple(deferred.shape) if deferred is not None else tuple(self._arrays[name].shape)

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self.items()),)

    def __repr__(self) -> str:
        return f"DecodedTensors({', '.join(self._order)}; deferred: {', '.join(self._deferred) or '-'})"


def _decode_specs(specs: list[dict[str, Any]], body: memoryview) -> Mapping[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    deferred: dict[str, Any] = {}
    order: list[str] = []
    offset = 0
    for spec in specs:
        name, enc_name, shape_list, nb = spec.get("n"), spec.get("e"), spec.get("sh"), spec.get("nb")
        if not isinstance(name, str) or not name:
            raise TensorSpecError("tensor spec has no name")
        if name in tensors or name in deferred:
            raise TensorSpecError(f"tensor {name!r} appears twice")
        if not isinstance(enc_name, str) or enc_name not in ENCODINGS:
            raise TensorSpecError(f"tensor {name!r}: unknown encoding {enc_name!r}")
        if (not isinstance(shape_list, list) or len(shape_list) > MAX_NDIM
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM
                           for d in shape_list)):
            raise TensorSpecError(f"tensor {name!r}: bad shape {shape_list!r}")
        if not isinstance(nb, int) or isinstance(nb, bool) or nb < 0:
            raise TensorSpecError(f"tensor {name!r}: bad byte length {nb!r}")
        shape = tuple(shape_list)
        encoding = ENCODINGS[enc_name]
        expected = encoding.expected_nbytes(shape, spec)
        if nb != expected:
            raise TensorSpecError(f"tensor {name!r}: {nb} bytes, but shape {shape} as {enc_name} needs {expected}")
        if offset + nb > len(body):
            raise TruncatedError(f"body ends inside tensor {name!r}")
        order.append(name)
        data = body[offset:offset + nb]  # a view: the decoders copy what they keep
        offset += nb
        if encoding.defer is not None:
            later = encoding.defer(shape, spec, data)
            if later.finite:
                deferred[name] = later
                continue
        arr = encoding.decode(shape, spec, data)
        if arr.dtype.kind == "f" and not encoding.checks_finite:
            _check_finite(name, arr)
        arr.setflags(write=False)
        tensors[name] = arr
    if offset != len(body):
        raise TensorSpecError(f"body has {len(body) - offset} bytes beyond its tensors")
    return DecodedTensors(tensors, deferred, order) if deferred else tensors


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Envelope:
    """Parse and validate an envelope received from the wire.

    Args:
        data: the raw bytes.
        max_bytes: refuse anything larger (``OversizeError``).

    Returns:
        The envelope, with read-only float32 (or uint8) tensors; QSGD tensors are made when first read
        (``DecodedTensors``), everything about them checked already.

    Raises:
        DecodeError: a subclass naming what is wrong (bad magic/version, truncated,
            malformed header, unknown digest, digest mismatch, tensor spec, NaN/inf, oversize).
    """
    header, body = _split(data, max_bytes)
    # Verify the digest before decoding any tensor: a corrupted body must never reach numpy.
    digest, value = _digest_of(header)
    if digest.compute(body) != value:
        raise ShaMismatchError(f"body {digest.name} does not match the header")
    tensors = _decode_specs(header["ts"], body)
    chunk_index = header.get("ci")
    chunk_count = header.get("cn")
    return Envelope(
        type=header["t"],
        rollout=header["ro"],
        round=header["r"],
        step=header["st"],
        sender=header["s"],
        key=header["k"],
        meta=header["m"],
        tensors=tensors,
        chunk_index=chunk_index,
        chunk_count=chunk_count,
        tensor_specs=tuple(header["ts"]),
        digest=digest.name,
    )


def float32_equivalent(data: bytes) -> int:
    """What an envelope would weigh with every tensor in float32: the baseline for savings.

    Reads only the header: ``len(data) + sum(4 * numel - nb)`` over its tensors.
    """
    header = peek_header(data)
    extra = 0
    for spec in header["ts"]:
        shape, nb = spec.get("sh", []), spec.get("nb", 0)
        if isinstance(shape, list) and isinstance(nb, int) and spec.get("e") != "u8":
            extra += 4 * _numel(tuple(int(d) for d in shape)) - nb
    return len(data) + extra


def envelopes_equal(a: Envelope, b: Envelope) -> bool:
    """Value equality for envelopes (test helper): same header fields and equal tensors."""
    same_header = (a.type, a.rollout, a.round, a.step, a.sender, a.key, dict(a.meta),
                   a.chunk_index, a.chunk_count) == (b.type, b.rollout, b.round, b.step, b.sender,
                                                    b.key, dict(b.meta), b.chunk_index, b.chunk_count)
    if not same_header or set(a.tensors) != set(b.tensors):
        return False
    return all(np.array_equal(a.tensors[n], b.tensors[n]) for n in a.tensors)

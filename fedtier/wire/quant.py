"""QSGD quantization with ``b`` bits per coordinate (Alistarh et al., NeurIPS 2017; seed 003 §3).

``qsgd(x, bits, rng)`` returns ``Q(x) = sign(x) · ‖x‖ · k/s`` with ``s = 2^(b−1) − 1`` levels and
``k`` stochastically rounded so that ``E[Q(x)] = x`` (eqs. (13)–(14)), plus the exact relative
variance ``q_exact = E‖Q(x)−x‖²/‖x‖² = Σ v_i(1−v_i)/s²`` of that vector, which senders put
in their message so the coordinator can estimate q1 for the planner.

Quantization happens where the algorithm says (inside the sans-I/O roles, with the sender's
own RNG stream); the wire then carries the result losslessly: each coordinate's signed level
``k ∈ {−s..s}`` as the code ``k + s`` in ``b`` bits, bit-packed, after a float32 norm — so a
``d``-vector costs ``4 + ceil(d·b/8)`` bytes. Both ends compute values with ``dequantize``, so
what the receiver decodes is bit-identical to what the sender computed.

``b = 1`` has no level (``s = 0``); the smallest encoding is ternary ``b = 2`` (``s = 1``).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import numpy as np

from fedtier.errors import LocalProtocolError

MIN_BITS = 2
MAX_BITS = 8


def levels(bits: int) -> int:
    """``s = 2^(bits−1) − 1``: 1 sign bit plus ``bits − 1`` bits of magnitude (digest §3.3)."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not MIN_BITS <= bits <= MAX_BITS:
        raise LocalProtocolError(f"QSGD bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
    return 2 ** (bits - 1) - 1


def dequantize(norm: np.float32, signed_levels: np.ndarray, s: int) -> np.ndarray:
    """Values ``norm · k / s`` in float32, computed the same way by sender and receiver."""
    return (np.float32(norm) * signed_levels.astype(np.float32)) / np.float32(s)


@dataclass(frozen=True, slots=True, eq=False)
class Quantized:
    """``Q(x)`` as float32 values on the grid, with what it takes to encode and judge it."""

    values: np.ndarray
    norm: np.float32
    bits: int
    q_exact: float


def qsgd(x: np.ndarray, bits: int, rng: np.random.Generator) -> Quantized:
    """Quantize ``x`` with QSGD at ``bits`` bits per coordinate.

    Args:
        x: any float array (treated as one vector).
        bits: 2..8.
        rng: the sender's own stream (never shared between senders: the analysis needs the
            quantization errors of different devices to be independent, digest §3.1).

    Returns:
        ``Quantized`` with ``values`` of ``x``'s shape; ``Q(0) = 0``.
    """
    s = levels(bits)
    flat = np.asarray(x, dtype=np.float64).ravel()
    norm = float(np.sqrt(np.dot(flat, flat)))
    norm32 = np.float32(norm)
    if norm32 == 0 or not np.isfinite(norm32):
        if not np.isfinite(norm):
            raise LocalProtocolError("cannot quantize a vector with NaN or infinite entries")
        return Quantized(np.zeros(np.shape(x), np.float32), np.float32(0.0), bits, 0.0)
    scaled = np.abs(flat) / norm * s
    lower = np.floor(scaled)
    frac = scaled - lower
    k = np.minimum(lower + (rng.random(flat.shape) < frac), s)  # |x_i| <= ‖x‖: the cap only guards rounding
    signed = (np.sign(flat) * k).astype(np.int16)
    q = float(np.dot(frac, 1.0 - frac) / s**2)
    return Quantized(dequantize(norm32, signed, s).reshape(np.shape(x)), norm32, bits, q)


def q_exact(x: np.ndarray, bits: int) -> float:
    """``E‖Q(x)−x‖²/‖x‖²`` for QSGD at ``bits`` bits (0 for the zero vector)."""
    s = levels(bits)
    flat = np.asarray(x, dtype=np.float64).ravel()
    norm = float(np.linalg.norm(flat))
    if norm == 0:
        return 0.0
    scaled = np.abs(flat) / norm * s
    frac = scaled - np.floor(scaled)
    return float(np.dot(frac, 1.0 - frac) / s**2)


def variance_bound(d: int, bits: int) -> float:
    """Lemma 3.1 of Alistarh et al.: ``q <= min(d/s², √d/s)``."""
    s = levels(bits)
    return min(d / s**2, np.sqrt(d) / s)


def combined_q(parts: list[Quantized]) -> float:
    """Relative variance of several independently quantized tensors taken as one vector:
    ``Σ q_t ‖x_t‖² / Σ ‖x_t‖²`` (each tensor is quantized with its own norm)."""
    weights = [float(p.norm) ** 2 for p in parts]
    total = sum(weights)
    if total == 0:
        return 0.0
    return sum(p.q_exact * w for p, w in zip(parts, weights, strict=True)) / total


# --- codes and bit packing -------------------------------------------------------------------


def encoded_size(numel: int, bits: int) -> int:
    """Body bytes of a ``numel``-element tensor: float32 norm plus packed codes."""
    return 4 + (numel * bits + 7) // 8


def to_levels(values: np.ndarray, norm: np.float32, bits: int) -> np.ndarray:
    """Recover the signed levels of ``values`` (which must lie exactly on the grid).

    Raises:
        LocalProtocolError: ``values`` are not ``dequantize(norm, k, s)`` for integer ``k``
            (the caller forgot to quantize, or quantized with another norm or bit width).
    """
    s = levels(bits)
    flat = np.asarray(values, dtype=np.float32).ravel()
    if norm == 0:
        if np.any(flat != 0):
            raise LocalProtocolError("non-zero values with a zero QSGD norm")
        return np.zeros(flat.shape, np.int16)
    k = np.rint(flat.astype(np.float64) * s / float(norm)).astype(np.int64)
    if np.any(np.abs(k) > s) or not np.array_equal(dequantize(norm, k, s), flat):
        raise LocalProtocolError("tensor is not on the QSGD grid of its norm and bit width; quantize it first")
    return k.astype(np.int16)


def pack(signed_levels: np.ndarray, bits: int) -> bytes:
    """Codes ``k + s`` in ``bits`` bits each, most significant bit first, zero-padded."""
    s = levels(bits)
    codes = (signed_levels.astype(np.int16) + s).astype(np.uint8)
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint8)
    bit_matrix = (codes[:, None] >> shifts) & 1
    return np.packbits(bit_matrix.astype(np.uint8).ravel()).tobytes()


_WORD = {1: np.int16, 2: np.int32, 4: np.int64}
"""A row of ``_byte_levels`` (1, 2 or 4 int16 levels) as one word: a 1-D gather is several times faster."""


@functools.lru_cache(maxsize=None)
def _byte_levels(bits: int) -> np.ndarray:
    """For ``bits`` dividing 8: each byte value's ``8 / bits`` codes, most significant first, as signed
    levels ``code - s`` (int16, shape ``(256, 8 / bits)``; read-only, shared)."""
    shifts = np.arange(8 - bits, -1, -bits)
    codes = (np.arange(256)[:, None] >> shifts) & ((1 << bits) - 1)
    table = (codes - levels(bits)).astype(np.int16)
    table.setflags(write=False)
    return table


_GATHER_CHUNK = 8192
"""Bytes looked up per ``numpy.take`` in ``Codes.values``: its index buffer (intp) and output stay in cache."""
_FOLD_CHUNK = 16384
"""Bytes per run in ``Codes.add_to`` (index buffer, gathered float64 rows and the sum's slice in cache; measured
faster than 8192 or 32768 at 4 bits)."""



def decode_values(data: bytes | memoryview, norm: np.float32, bits: int, numel: int) -> tuple[np.ndarray, bool]:
    """``dequantize(norm, unpack(data, bits, numel), s)`` without the int16 levels in between: ``(values, finite)``.

    ``Codes.check`` then ``Codes.values`` (which says how); ``finite`` is ``Codes.finite``.

    Raises:
        ValueError: as ``unpack`` — wrong length, an unused code, non-zero padding.
    """
    codes = Codes.check(data, norm, bits, (numel,))
    return codes.values(), codes.finite


@dataclass(frozen=True, slots=True, eq=False)
class Codes:
    """One tensor's QSGD codes as they arrived, checked, and turned into values only when asked.

    ``values`` computes them with ``dequantize``'s own float32 operations, so bit for bit what the
    sender computed: at 2 and 4 bits through a 256-row table of each byte value's ``8 / bits`` values,
    every byte looked up in it a cache-sized run at a time through one reused index buffer; at 8 bits (one
    code a byte) by that arithmetic on the bytes themselves; other widths through ``unpack``. ``add_to``
    adds them, times a factor, to a float64 sum without making them first (the edge's fold).
    """

    data: bytes | memoryview
    """The code bytes (kept by reference: an immutable message's own bytes)."""
    norm: np.float32
    bits: int
    shape: tuple[int, ...]
    finite: bool
    """Every value is finite (``False`` only for a norm so large that ``norm * k`` overflows float32)."""

    @classmethod
    def check(cls, data: bytes | memoryview, norm: np.float32, bits: int, shape: tuple[int, ...]) -> "Codes":
        """Validate ``data`` as the codes of a tensor of ``shape``.

        Raises:
            ValueError: as ``unpack`` — wrong length, an unused code, non-zero padding.
        """
        s = levels(bits)
        numel = 1
        for extent in shape:
            numel *= extent
        if 8 % bits:
            unpack(data, bits, numel)  # checks length, codes and padding
        else:
            expected = (numel * bits + 7) // 8
            if len(data) != expected:
                raise ValueError(f"{len(data)} code bytes for {numel} values at {bits} bits (need {expected})")
            raw = np.frombuffer(data, dtype=np.uint8)
            if raw.size:
                _check_codes(raw, bits, numel)
        with np.errstate(over="ignore"):  # |norm * k| <= norm * s, rounded monotonically: the largest product
            finite = bool(np.isfinite(np.float32(norm) * np.float32(s)))
        return cls(data, np.float32(norm), bits, tuple(shape), finite)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def values(self) -> np.ndarray:
        """The float32 values, of ``shape`` (a new array, or a view of a slightly longer one)."""
        s, norm, bits = levels(self.bits), self.norm, self.bits
        with np.errstate(over="ignore"):
            if 8 % bits:
                return dequantize(norm, unpack(self.data, bits, self.size), s).reshape(self.shape)
            raw = np.frombuffer(self.data, dtype=np.uint8)
            if bits == 8:
                values = raw.astype(np.float32)  # code c, exactly; c - s is the level k, exactly
                np.subtract(values, np.float32(s), out=values)
                np.multiply(norm, values, out=values)
                np.divide(values, np.float32(s), out=values)
                return values.reshape(self.shape)
            table = dequantize(norm, _byte_levels_f32(bits), s)  # (256, 8 / bits) float32
        words: np.ndarray = np.ascontiguousarray(table).view(_ROW_WORD[table.itemsize * table.shape[1]]).ravel()
        out = _gather(words, raw)
        return out.view(np.float32)[:self.size].reshape(self.shape)

    def add_to(self, acc: np.ndarray, factors: tuple[float, ...] = ()) -> None:
        """``acc += values * factors[0] * factors[1] ...``, ``acc`` a float64 array of ``shape``, with the float64
        operations numpy does on the float32 values (each ``np.multiply`` by a float64 factor in turn, then the
        add), through a table of each byte value's products a cache-sized run of bytes at a time: the values
        are never made."""
        if 8 % self.bits or self.bits == 2 or not acc.flags.c_contiguous:
            values = self.values()
            for factor in factors:
                values = np.multiply(values, np.float64(factor))
            np.add(acc, values, out=acc)
            return
        with np.errstate(over="ignore"):
            table = dequantize(self.norm, _byte_levels_f32(self.bits), levels(self.bits)).astype(np.float64)
        for factor in factors:
            np.multiply(table, np.float64(factor), out=table)
        per = table.shape[1]  # (256, 8 / bits) float64
        words: np.ndarray = np.ascontiguousarray(table).view(_ROW_WORD[8 * per]).ravel()
        raw = np.frombuffer(self.data, dtype=np.uint8)
        flat = acc.reshape(-1)
        index = np.empty(min(raw.size, _FOLD_CHUNK), dtype=np.intp)
        rows = np.empty(min(raw.size, _FOLD_CHUNK), dtype=words.dtype)
        for start in range(0, raw.size, _FOLD_CHUNK):
            part = raw[start:start + _FOLD_CHUNK]
            n = part.size
            np.copyto(index[:n], part)
            np.take(words, index[:n], out=rows[:n], mode="clip")  # indices are bytes: never clipped
            target = flat[start * per:(start + n) * per]  # the last run stops at the last value
            np.add(target, rows[:n].view(np.float64)[:target.size], out=target)


_ROW_WORD = {4: np.uint32, 8: np.uint64, 16: np.complex128}
"""A table row (``8 / bits`` values of 4 or 8 bytes) as one item ``numpy.take`` copies whole."""


def _gather(words: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """``words[raw]``, a cache-sized run of bytes at a time through one reused index buffer."""
    out = np.empty(raw.size, dtype=words.dtype)
    index = np.empty(min(raw.size, _GATHER_CHUNK), dtype=np.intp)
    for start in range(0, raw.size, _GATHER_CHUNK):
        part = raw[start:start + _GATHER_CHUNK]
        n = part.size
        np.copyto(index[:n], part)
        np.take(words, index[:n], out=out[start:start + n], mode="clip")  # indices are bytes: never clipped
    return out


def _check_codes(raw: np.ndarray, bits: int, numel: int) -> None:
    """Refuse non-zero padding and the unused code ``2^bits - 1`` anywhere (``bits`` divides 8)."""
    per = 8 // bits
    padding = (per - numel % per) % per  # codes after the last one, in the last byte's low bits
    if padding and int(raw[-1]) & ((1 << (bits * padding)) - 1):
        raise ValueError("non-zero padding bits after the last code")
    if bits == 8:
        unused = bool((raw == 0xFF).any())
    elif bits == 4:
        unused = bool(raw.max() >= 0xF0 or ((raw & 0x0F) == 0x0F).any())
    else:  # 2 bits: a code is 0b11 iff its low bit survives AND-ing the byte with itself shifted by one
        unused = bool((raw & (raw >> 1) & 0x55).any())
    if unused:
        raise ValueError(f"code above {2 * levels(bits)} (the largest level) at {bits} bits")


@functools.lru_cache(maxsize=None)
def _byte_levels_f32(bits: int) -> np.ndarray:
    """``_byte_levels(bits)`` as float32 (exact: small integers), what ``dequantize`` converts them to."""
    table = _byte_levels(bits).astype(np.float32)
    table.setflags(write=False)
    return table


def unpack(data: bytes | memoryview, bits: int, numel: int) -> np.ndarray:
    """Signed levels from packed codes.

    Raises:
        ValueError: wrong length, a code above ``2s`` (unused), or non-zero padding bits.
    """
    s = levels(bits)
    expected = (numel * bits + 7) // 8
    if len(data) != expected:
        raise ValueError(f"{len(data)} code bytes for {numel} values at {bits} bits (need {expected})")
    raw = np.frombuffer(data, dtype=np.uint8)
    if 8 % bits == 0:
        # 2, 4 or 8 bits: whole codes per byte, so one table lookup per byte gives its signed levels
        # (the edge's hot path: one gather instead of a bit matrix)
        table = _byte_levels(bits)  # each row's 8 / bits int16 levels viewed as one 2-, 4- or 8-byte word
        every = np.take(table.view(_WORD[table.shape[1]]).ravel(), raw).view(np.int16)
        if np.any(every[numel:] != -s):  # padding codes must be 0, i.e. level -s
            raise ValueError("non-zero padding bits after the last code")
        signed = every[:numel]
        if numel and int(signed.max()) > s:
            raise ValueError(f"code above {2 * s} (the largest level) at {bits} bits")
        return signed
    else:
        all_bits = np.unpackbits(raw)
        if np.any(all_bits[numel * bits:]):
            raise ValueError("non-zero padding bits after the last code")
        bit_matrix = all_bits[: numel * bits].reshape(numel, bits)
        # left-pad each code to a byte and pack it back: one uint8 per code
        codes = np.packbits(np.pad(bit_matrix, ((0, 0), (8 - bits, 0))), axis=1).ravel().astype(np.int16)
    if np.any(codes > 2 * s):
        raise ValueError(f"code above {2 * s} (the largest level) at {bits} bits")
    return (codes - s).astype(np.int16)


# --- per-row codecs of embeddings (HSGD's vertical path) ------------------------------------------
#
# An embedding matrix crosses two hops (device -> edge -> host, host -> edge -> device), and the edge
# relays rows: it stacks the devices' rows into Z2 and hands each device its row of Z1. A codec whose
# encoding is a pure function of the values it carries lets the edge re-encode what it relays without
# a second loss. Both codecs below are such: every row is coded on its own (``rows_of``: axis 0 of a
# 2-D or higher tensor, the whole tensor when it is 0- or 1-D), and encoding a row already on its grid
# (or already sparse) gives back the same bytes.


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, width)`` of a tensor coded row by row: axis 0 for two or more dimensions, else one row."""
    if len(shape) <= 1:
        return 1, int(shape[0]) if shape else 1
    width = 1
    for d in shape[1:]:
        width *= int(d)
    return int(shape[0]), width


def _row_view(x: np.ndarray) -> np.ndarray:
    rows, width = rows_of(np.shape(x))
    return np.asarray(x).reshape(rows, width)


def qrows_dequantize(scales: np.ndarray, signed_levels: np.ndarray, s: int) -> np.ndarray:
    """Values ``scale_r * (k / s)`` in float32 (``(rows, width)``), the same on both ends; ``k = ±s`` gives
    exactly ``±scale_r``."""
    return np.asarray(scales, np.float32)[:, None] * (signed_levels.astype(np.float32) / np.float32(s))


def qrows(x: np.ndarray, bits: int, rng: np.random.Generator) -> np.ndarray:
    """QSGD with each row's largest magnitude as its scale (QSGD's max-norm variant, row by row).

    Each entry becomes ``sign(x) scale k / s`` with ``k`` stochastically rounded between the two levels
    around ``|x| / scale * s`` (unbiased: ``E[Q(x)] = x``), ``s = 2^(bits-1) - 1``; the row's largest
    entry lands exactly on ``±scale``. Returns float32 values of ``x``'s shape, on the grid (``qrows_levels``
    recovers the levels exactly)."""
    s = levels(bits)
    flat = _row_view(np.asarray(x, np.float64))
    if not np.isfinite(flat).all():
        raise LocalProtocolError("cannot quantize a tensor with NaN or infinite entries")
    scales = np.abs(flat).max(axis=1) if flat.shape[1] else np.zeros(flat.shape[0])
    scales32 = scales.astype(np.float32)
    if not np.isfinite(scales32).all():
        raise LocalProtocolError("a row's largest magnitude overflows float32")
    scales32[scales32 < np.finfo(np.float32).tiny] = 0  # subnormal scales: the row is sent as zeros
    safe = np.where(scales32 > 0, scales32.astype(np.float64), 1.0)
    scaled = np.abs(flat) / safe[:, None] * s
    lower = np.floor(scaled)
    k = np.minimum(lower + (rng.random(flat.shape) < scaled - lower), s)
    k[np.abs(flat) == scales[:, None]] = s  # the largest entry is exactly on the top level
    signed = (np.sign(flat) * k).astype(np.int16)
    signed[scales32 == 0] = 0
    return qrows_dequantize(scales32, signed, s).reshape(np.shape(x))


def qrows_levels(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``(scales, signed levels)`` of ``values`` on the ``qrows`` grid: each row's scale is its largest
    magnitude, and its levels reproduce it bit for bit.

    Raises:
        LocalProtocolError: ``values`` are not on that grid (not quantized with ``qrows`` at ``bits``).
    """
    s = levels(bits)
    flat = _row_view(np.asarray(values, np.float32))
    if not np.isfinite(flat).all():
        raise LocalProtocolError("non-finite values cannot be on the qrows grid")
    scales = np.abs(flat).max(axis=1) if flat.shape[1] else np.zeros(flat.shape[0], np.float32)
    if np.any((scales > 0) & (scales < np.finfo(np.float32).tiny)):
        raise LocalProtocolError("a row's scale is subnormal: not on the qrows grid")
    safe = np.where(scales > 0, scales.astype(np.float64), 1.0)
    k = np.rint(flat.astype(np.float64) / safe[:, None] * s).astype(np.int64)
    if np.any(np.abs(k) > s) or not np.array_equal(qrows_dequantize(scales, k, s), flat):
        raise LocalProtocolError(f"tensor is not on the {bits}-bit qrows grid; quantize it with quant.qrows first")
    return scales.astype(np.float32), k.astype(np.int16)


def on_qrows_grid(values: np.ndarray, bits: int) -> bool:
    """Whether ``values`` are on the ``qrows`` grid at ``bits`` (what an edge checks before relaying)."""
    try:
        qrows_levels(values, bits)
    except LocalProtocolError:
        return False
    return True


def qrows_size(shape: tuple[int, ...], bits: int) -> int:
    """Body bytes of a ``qrows`` tensor: a float32 scale per row, then every code packed at ``bits``."""
    rows, width = rows_of(shape)
    return 4 * rows + (rows * width * bits + 7) // 8


def topk_count(width: int, bits: int) -> int:
    """Entries a top-k row keeps at the compression level ``bits``: the paper's ratio ``log2(b) / 32`` of
    them (``bits = log2 b``; C-HSGD's b = 128 keeps 7/32), rounded up, at least one of a non-empty row."""
    if width == 0:
        return 0
    return max(1, min(width, -(-width * bits // 32)))


def topk_rows(x: np.ndarray, k: int) -> np.ndarray:
    """Top-k sparsification row by row: each row keeps its ``k`` largest magnitudes (ties: the lower index),
    the rest become 0. Deterministic; float32 of ``x``'s shape."""
    flat = _row_view(np.asarray(x, np.float32))
    out = np.zeros_like(flat)
    if flat.shape[1] and k > 0:
        keep = np.argsort(-np.abs(flat), axis=1, kind="stable")[:, :k]
        np.put_along_axis(out, keep, np.take_along_axis(flat, keep, axis=1), axis=1)
    return out.reshape(np.shape(x))


def topk_entries(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, values)``, each ``(rows, k)``: every row's non-zero entries, padded with zeros at its lowest
    unused indices, in increasing index order (what the ``topk`` encoding sends).

    Raises:
        LocalProtocolError: a row has more than ``k`` non-zero entries (sparsify it with ``topk_rows`` first).
    """
    flat = _row_view(np.asarray(values, np.float32))
    rows, width = flat.shape
    if not 0 <= k <= width:
        raise LocalProtocolError(f"top-k keeps {k} of {width} entries per row")
    nonzero = flat != 0
    if np.any(nonzero.sum(axis=1) > k):
        raise LocalProtocolError(f"a row has more than {k} non-zero entries; sparsify it with quant.topk_rows first")
    # non-zeros first, then the lowest indices: a stable sort on "is zero" keeps index order within each group
    order = np.argsort(~nonzero, axis=1, kind="stable")[:, :k]
    idx = np.sort(order, axis=1)
    return idx, np.take_along_axis(flat, idx, axis=1)


def is_topk(values: np.ndarray, k: int) -> bool:
    """Whether every row of ``values`` has at most ``k`` non-zero entries (what an edge checks before relaying)."""
    flat = _row_view(np.asarray(values))
    return bool(0 <= k <= flat.shape[1] and not np.any((flat != 0).sum(axis=1) > k))


def topk_index_bytes(width: int) -> int:
    """Bytes of one index: 2 for rows up to 65,536 wide, else 4."""
    return 2 if width <= 1 << 16 else 4


def topk_size(shape: tuple[int, ...], k: int) -> int:
    """Body bytes of a ``topk`` tensor: ``k`` indices and ``k`` float32 values per row."""
    rows, width = rows_of(shape)
    return rows * k * (topk_index_bytes(width) + 4)

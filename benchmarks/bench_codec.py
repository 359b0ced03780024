"""Wire codec and edge aggregation throughput, against plain numpy in the same run.

Three measurements, each the median of ``--reps`` repetitions with the spread:

* **codec**: a device update of ``--params`` float32 coordinates encoded to bytes
  (``DeviceUpdate.encode``: header, tensor encoding, body digest) and decoded back
  (``decode_message``: parsing, checks, decoding, every tensor read as an array), for f32 (with the CRC-32
  devices send now, and with sha256), f16 and QSGD at 2, 4 and 8 bits, and for f32 and 4-bit QSGD by the
  decoder as it was before, in MB/s of float32 payload. Baseline:
  ``ndarray.tobytes`` + ``np.frombuffer(...).copy()`` of the same array (a memory copy each way).
* **digests**: MB/s of each body digest in Python's standard library over 1 kB to 10 MB.
* **aggregation**: what an edge does with ``n`` updates of ``d`` parameters, decode included, as a
  fraction of a plain numpy sum of the same ``n`` float32 arrays already in memory (``acc += a``:
  the memory-bandwidth bound), for f32 and 4-bit QSGD. Two paths, timed in turn within each
  repetition: the **old** one (sha256-checked messages with unaligned headers, QSGD decoded through ``unpack`` +
  ``dequantize``, every NaN check a boolean array, every update kept until the end, then
  ``weighted_mean`` in sender order) and the **new** one (CRC-32-checked messages as devices send
  them now, decoded by ``decode_message`` and folded one by one into the edge's
  ``strategies.Collector``). A fraction is the median over repetitions of (numpy sum time / path
  time), both taken in the same repetition. Beside them, what bounds the new path: the CRC-32 and
  the sha256 of the bodies alone, and the float64 fold alone (of the decoded f32 arrays; of the QSGD
  codes, decoded beforehand). Sizes with
  ``n * d`` above ``--max-elements`` are skipped (memory).

    python -m benchmarks codec                        # the tables in docs/benchmarks.md
    python -m benchmarks codec --reps 1 --params 1000 --sizes 2x100   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import statistics
import struct
import sys
import time
import zlib
from typing import Any, Callable

import msgpack
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import spread, write  # noqa: E402

from fedtier import wire  # noqa: E402
from fedtier.algorithms import strategies  # noqa: E402
from fedtier.algorithms.aggregate import weighted_mean  # noqa: E402
from fedtier.algorithms.common import quantize  # noqa: E402
from fedtier.wire import quant  # noqa: E402
from fedtier.wire.messages import DeviceUpdate, decode_message, from_envelope  # noqa: E402

ENCODINGS = ("f32", "f32 sha256", "f16", "qsgd2", "qsgd4", "qsgd8")
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""``--clock``: wall time, or the process's CPU time (all its threads; steadier on a shared machine, where
the wall clock also counts the time other jobs hold the cores)."""
CLOCK = [time.perf_counter]
OLD_DECODER = ("f32", "qsgd4")
"""Encodings also decoded by the decoder as it was before issue 32 (``_legacy_decode``), from the old bytes."""


def _message(values: np.ndarray, encoding: str, sender: str = "d0") -> tuple[DeviceUpdate, dict[str, Any]]:
    """A device update of one tensor ``w`` in ``encoding`` (QSGD: quantized first, as a device does)."""
    delta = {"w": values}
    encodings: dict[str, Any] = {}
    if encoding == "f16":
        encodings = {"w": wire.TensorEncoding("f16")}
    elif encoding.startswith("qsgd"):
        delta, encodings, _ = quantize(delta, int(encoding[4:]), 0, "bench", sender)
    return DeviceUpdate(rollout="bench", round=0, sender=sender, delta=delta, num_samples=1), encodings


def _encode(msg: DeviceUpdate, encodings: dict[str, Any], digest: str | None = None) -> bytes:
    """The message's bytes, with the digest devices send (``None``) or another one."""
    env = msg.to_envelope(encodings)
    return wire.encode(env if digest is None else dataclasses.replace(env, digest=digest))


def _as_before(blob: bytes) -> bytes:
    """``blob`` as a sender before body alignment made it: the header without ``pd`` (so a quarter of the f32
    bodies start 4-aligned, and the others are copied when decoded)."""
    header = wire.peek_header(blob)
    _, _, hlen = struct.unpack_from(">4sBI", blob, 0)
    header.pop("pd", None)
    packed = msgpack.packb(header, use_bin_type=True)
    return blob[:5] + struct.pack(">I", len(packed)) + packed + blob[wire.PREFIX_SIZE + hlen:]


def _read(msg: Any) -> list[np.ndarray]:
    """Every tensor of a decoded update, as arrays (what a reader other than the edge's fold gets)."""
    return [np.asarray(t) for t in msg.delta.values()]


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = CLOCK[0]()
        fn()
        out.append(CLOCK[0]() - start)
    return out


def _stats(times: list[float]) -> dict[str, float]:
    return {f"{key}_s": value for key, value in spread(times).items()}


def codec(params: int, reps: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    values = rng.normal(scale=0.01, size=params).astype(np.float32)
    mb = values.nbytes / 1e6
    base_enc = _timed(lambda: values.tobytes(), reps)
    raw = values.tobytes()
    base_dec = _timed(lambda: np.frombuffer(raw, dtype=np.float32).copy(), reps)
    out: dict[str, Any] = {"params": params, "baseline": {"encode": _stats(base_enc), "decode": _stats(base_dec)}}
    for encoding in ENCODINGS:
        msg, encodings = _message(values, encoding.split()[0])
        digest = encoding.split()[1] if " " in encoding else None
        blob = _encode(msg, encodings, digest)
        enc = _timed(lambda m=msg, e=encodings, g=digest: _encode(m, e, g), reps)  # type: ignore[misc]
        dec = _timed(lambda b=blob: _read(decode_message(b)), reps)  # type: ignore[misc]
        out[encoding] = {"bytes": len(blob), "encode": _stats(enc), "decode": _stats(dec),
                         "encode_mb_s": mb / statistics.median(enc), "decode_mb_s": mb / statistics.median(dec)}
    for encoding in OLD_DECODER:
        msg, encodings = _message(values, encoding)
        blob = _as_before(_encode(msg, encodings, "sha256"))
        dec = _timed(lambda b=blob: _read(_legacy_decode(b)), reps)  # type: ignore[misc]
        out[f"{encoding} old decoder"] = {"bytes": len(blob), "decode": _stats(dec),
                                          "decode_mb_s": mb / statistics.median(dec)}
    out["baseline"]["encode_mb_s"] = mb / statistics.median(base_enc)
    out["baseline"]["decode_mb_s"] = mb / statistics.median(base_dec)
    return out


DIGEST_SIZES = (1_000, 100_000, 1_000_000, 10_000_000)
DIGEST_FUNCTIONS: dict[str, Callable[[bytes], Any]] = {
    "sha256 (the old one)": lambda b: hashlib.sha256(b).digest(),
    "crc32 (the new one)": zlib.crc32,
    "adler32": zlib.adler32,
    "md5": lambda b: hashlib.md5(b).digest(),
    "sha1": lambda b: hashlib.sha1(b).digest(),
    "blake2b, 16 bytes": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
    "blake2s": lambda b: hashlib.blake2s(b).digest(),
}
"""The candidates for the body digest that need nothing beyond Python's standard library."""


def digests(reps: int) -> dict[str, Any]:
    """MB/s of each candidate digest over random bodies of 1 kB to 10 MB (median of ``reps``, each repetition
    hashing about 20 MB; the candidates take turns within a repetition)."""
    out: dict[str, Any] = {}
    for size in DIGEST_SIZES:
        body = np.random.default_rng(size).bytes(size)
        loops = max(1, 20_000_000 // size)
        times: dict[str, list[float]] = {name: [] for name in DIGEST_FUNCTIONS}
        for _ in range(reps):
            for name, fn in DIGEST_FUNCTIONS.items():
                start = CLOCK[0]()
                for _ in range(loops):
                    fn(body)
                times[name].append((CLOCK[0]() - start) / loops)
        out[str(size)] = {name: size / 1e6 / statistics.median(t) for name, t in times.items()}
    return out


# --- the edge's aggregation, old and new ------------------------------------------------------------


def _legacy_decode(blob: bytes) -> DeviceUpdate:
    """The decoder as it was before streaming: sha256 of the body, QSGD through ``unpack`` + ``dequantize``
    (an int16 array, then float32 arithmetic), an f32 body a view when aligned, every float tensor checked
    with ``np.isfinite(...).all()``."""
    _, _, hlen = struct.unpack_from(">4sBI", blob, 0)
    header = wire.peek_header(blob)
    body = memoryview(blob)[wire.PREFIX_SIZE + hlen:]
    if hashlib.sha256(body).digest() != header["sha"]:
        raise ValueError("sha256 mismatch")
    tensors, offset = {}, 0
    for spec in header["ts"]:
        shape, nb, data = tuple(spec["sh"]), spec["nb"], body[offset:offset + spec["nb"]]
        if spec["e"] == "qsgd":
            (norm,) = struct.unpack_from("<f", data, 0)
            signed = quant.unpack(data[4:], spec["b"], int(np.prod(shape)))
            arr = quant.dequantize(np.float32(norm), signed, quant.levels(spec["b"])).reshape(shape)
        else:
            arr = wire.ENCODINGS[spec["e"]].decode(shape, spec, data)
        if arr.size and not np.isfinite(arr).all():
            raise ValueError("non-finite")
        tensors[spec["n"]] = arr
        offset += nb
    env = wire.Envelope(type=header["t"], rollout=header["ro"], round=header["r"], step=header["st"],
                        sender=header["s"], key=header["k"], meta=header["m"], tensors=tensors)
    msg = from_envelope(env)
    assert isinstance(msg, DeviceUpdate)
    return msg


def _old_edge(blobs: list[bytes]) -> dict[str, np.ndarray]:
    """Decode and keep every update, then the weighted mean in sender order."""
    updates = {u.sender: u for u in (_legacy_decode(b) for b in blobs)}
    return weighted_mean([(updates[s].delta, 1.0) for s in sorted(updates)])


def _new_edge(blobs: list[bytes], like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Decode each update and fold it into the edge's collector as it arrives; nothing is kept."""
    collector = strategies.Collector(strategies.Mean(), like, len(blobs))
    senders = []
    for blob in blobs:
        msg = decode_message(blob)
        assert isinstance(msg, DeviceUpdate)
        collector.add(msg.sender, msg.delta, 1.0)
        senders.append(msg.sender)
    return collector.combine(sorted(senders), [1.0] * len(senders))


def _bodies(blobs: list[bytes]) -> list[memoryview]:
    return [memoryview(b)[wire.PREFIX_SIZE + struct.unpack_from(">4sBI", b, 0)[2]:] for b in blobs]


def aggregation(n: int, d: int, reps: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    arrays = [rng.normal(scale=0.01, size=d).astype(np.float32) for _ in range(n)]
    like = {"w": arrays[0]}

    def numpy_sum() -> np.ndarray:
        acc = np.zeros(d, dtype=np.float32)
        for a in arrays:
            acc += a
        return acc

    def fold_alone() -> None:
        acc = np.zeros(d, dtype=np.float64)
        for a in arrays:
            np.add(acc, a, out=acc)

    paths: dict[str, Callable[[], Any]] = {"numpy_sum": numpy_sum, "fold_alone": fold_alone}
    for encoding in ("f32", "qsgd4"):
        messages = [_message(a, encoding, sender=f"d{i}") for i, a in enumerate(arrays)]
        old_blobs = [_as_before(_encode(m, e, "sha256")) for m, e in messages]
        new_blobs = [_encode(m, e) for m, e in messages]
        assert wire.decode(new_blobs[0]).digest == "crc32"
        paths[f"{encoding}_old"] = lambda b=old_blobs: _old_edge(b)  # type: ignore[misc]
        paths[encoding] = lambda b=new_blobs: _new_edge(b, like)  # type: ignore[misc]
        bodies = _bodies(new_blobs)
        paths[f"crc32_{encoding}"] = lambda b=bodies: [zlib.crc32(x) for x in b]  # type: ignore[misc]
        paths[f"sha256_{encoding}"] = lambda b=bodies: [hashlib.sha256(x).digest() for x in b]  # type: ignore[misc]
        if encoding == "qsgd4":  # the fold of the codes alone, decoded before the clock starts
            codes = [decode_message(b).delta.deferred("w") for b in new_blobs]  # type: ignore[attr-defined]

            def codes_fold_alone(codes: list[Any] = codes) -> None:
                acc = np.zeros(d, dtype=np.float64)
                for c in codes:
                    c.add_to(acc)

            paths["codes_fold_alone"] = codes_fold_alone
        if encoding == "qsgd4":  # the same edge mean, whichever path: checked once here
            for pair in ((f"{encoding}_old", encoding), ("f32_old", "f32")):
                old, new = paths[pair[0]](), paths[pair[1]]()
                np.testing.assert_allclose(new["w"], old["w"], rtol=0, atol=1e-7)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(reps):  # every path once per repetition, in turn: ratios are taken within a repetition
        for name, fn in paths.items():
            start = CLOCK[0]()
            fn()
            times[name].append(CLOCK[0]() - start)
    out: dict[str, Any] = {"n": n, "d": d}
    for name, t in times.items():
        ratios = [b / x for b, x in zip(times["numpy_sum"], t, strict=True)]
        out[name] = {**_stats(t), "fraction_of_numpy": statistics.median(ratios),
                     "fraction_min": min(ratios), "fraction_max": max(ratios)}
    return out


def _load() -> str:
    try:
        return "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    except OSError:
        return "load average unknown"


def table(results: dict[str, Any]) -> str:
    c = results["codec"]
    lines = [f"Codec, one update of {c['params']:,} float32 parameters (MB/s of float32 payload, median of "
             f"{results['reps']}):", "", "| encoding | bytes on the wire | encode MB/s | decode MB/s | encode × copy |"
             " decode × copy |", "|---|---|---|---|---|---|"]
    b = c["baseline"]
    lines.append(f"| memory copy (baseline) | {4 * c['params']:,} | {b['encode_mb_s']:.0f} | {b['decode_mb_s']:.0f} "
                 "| 1 | 1 |")
    for e in ENCODINGS:
        r = c[e]
        label = e if " " in e else f"{e} (crc32)"
        lines.append(f"| {label} | {r['bytes']:,} | {r['encode_mb_s']:.0f} | {r['decode_mb_s']:.0f} | "
                     f"{r['encode_mb_s'] / b['encode_mb_s']:.3f} | {r['decode_mb_s'] / b['decode_mb_s']:.3f} |")
    for e in OLD_DECODER:
        r = c.get(f"{e} old decoder")
        if r is not None:
            lines.append(f"| {e}, the old decoder (sha256) | {r['bytes']:,} | | {r['decode_mb_s']:.0f} | | "
                         f"{r['decode_mb_s'] / b['decode_mb_s']:.3f} |")

    def frac(r: dict[str, Any]) -> str:
        return f"{r['fraction_of_numpy']:.3f} ({r['fraction_min']:.3f}–{r['fraction_max']:.3f})"

    folds = {"f32": ("fold_alone", "float64 fold of the arrays alone"),
             "qsgd4": ("codes_fold_alone", "float64 fold of the codes alone")}
    for encoding, title in (("f32", "f32"), ("qsgd4", "4-bit QSGD")):
        fold_key, fold_title = folds[encoding]
        lines += ["", f"Edge aggregation, {title}, decode included, as a fraction of a plain numpy sum of the same "
                  "float32 arrays (1.0 = the bound; fraction: median, min–max over repetitions):", "",
                  "| n updates | d parameters | numpy sum, ms | old path, ms | old fraction | new path, ms "
                  f"| new fraction | new ÷ old time | CRC-32 of the bodies alone | sha256 alone | {fold_title} |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["aggregation"]:
            if "skipped" in r:
                lines.append(f"| {r['n']:,} | {r['d']:,} | skipped: {r['skipped']} | | | | | | | | |")
                continue
            old, new = r[f"{encoding}_old"], r[encoding]
            lines.append(f"| {r['n']:,} | {r['d']:,} | {1e3 * r['numpy_sum']['median_s']:.2f} | "
                         f"{1e3 * old['median_s']:.1f} | {frac(old)} | {1e3 * new['median_s']:.1f} | {frac(new)} | "
                         f"{new['median_s'] / old['median_s']:.2f} | {r[f'crc32_{encoding}']['fraction_of_numpy']:.3f} "
                         f"| {r[f'sha256_{encoding}']['fraction_of_numpy']:.3f} | "
                         f"{r[fold_key]['fraction_of_numpy']:.3f} |")
    d = results["digests"]
    lines += ["", f"Body digests, MB/s (median of {results['reps']}):", "",
              "| digest | " + " | ".join(f"{int(size):,} B" for size in d) + " |",
              "|---|" + "---|" * len(d)]
    for name in DIGEST_FUNCTIONS:
        lines.append(f"| {name} | " + " | ".join(f"{d[size][name]:.0f}" for size in d) + " |")
    lines += ["", f"Clock: {results.get('clock', 'wall')}. Machine load: {results['load_before']} before, "
              f"{results['load_after']} after."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--params", type=int, default=1_000_000, help="coordinates of the codec's update")
    ap.add_argument("--sizes", default="10x10000,100x10000,1000x10000,10x100000,100x100000,1000x100000,"
                                       "10x1000000,100x1000000,1000x1000000",
                    help="aggregation sizes, NxD comma-separated")
    ap.add_argument("--max-elements", type=float, default=1e8, help="skip sizes with n * d above this (memory)")
    ap.add_argument("--name", default="codec", help="results/<name>.json")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="what a time is (see CLOCKS)")
    args = ap.parse_args(argv)
    CLOCK[0] = CLOCKS[args.clock]
    results: dict[str, Any] = {"reps": args.reps, "clock": args.clock, "load_before": _load(),
                               "codec": codec(args.params, args.reps), "aggregation": []}
    for size in args.sizes.split(","):
        n, d = (int(x) for x in size.split("x"))
        if n * d > args.max_elements:
            results["aggregation"].append({"n": n, "d": d, "skipped": f"n·d > {args.max_elements:.0e} (memory)"})
            continue
        results["aggregation"].append(aggregation(n, d, args.reps))
        print(f"aggregation {n}x{d} done ({_load()})", flush=True)
    results["digests"] = digests(args.reps)
    results["load_after"] = _load()
    path = write(args.name, results)
    print(table(results))
    print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    main()

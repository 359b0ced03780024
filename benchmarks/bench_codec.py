"""Wire codec and edge aggregation throughput, against plain numpy in the same run.

Two measurements, each the median of ``--reps`` repetitions with the spread:

* **codec**: a device update of ``--params`` float32 coordinates encoded to bytes
  (``DeviceUpdate.encode``: header, tensor encoding, sha256) and decoded back
  (``decode_message``: parsing, checks, decoding), for f32, f16 and QSGD at 2, 4 and 8 bits, in
  MB/s of float32 payload. Baseline: ``ndarray.tobytes`` + ``np.frombuffer(...).copy()`` of the
  same array (a memory copy each way).
* **aggregation**: what an edge does with ``n`` updates of ``d`` parameters — decode each message
  and take the weighted mean (``fedtier.algorithms.aggregate.weighted_mean``) — as a fraction of a
  plain numpy sum of the same ``n`` float32 arrays (``acc += a``: the memory-bandwidth bound), for
  f32 and 4-bit QSGD. Sizes with ``n * d`` above ``--max-elements`` are skipped (memory).

    python benchmarks/bench_codec.py                       # the table in docs/benchmarks.md
    python benchmarks/bench_codec.py --reps 1 --params 1000 --sizes 2x100   # a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import spread, write  # noqa: E402

from fedtier.algorithms.aggregate import weighted_mean  # noqa: E402
from fedtier.algorithms.common import quantize  # noqa: E402
from fedtier.wire.messages import DeviceUpdate, decode_message  # noqa: E402

ENCODINGS = ("f32", "f16", "qsgd2", "qsgd4", "qsgd8")


def _message(values: np.ndarray, encoding: str, sender: str = "d0") -> tuple[DeviceUpdate, dict[str, Any]]:
    """A device update of one tensor ``w`` in ``encoding`` (QSGD: quantized first, as a device does)."""
    delta = {"w": values}
    encodings: dict[str, Any] = {}
    if encoding == "f16":
        from fedtier.wire.envelope import TensorEncoding

        encodings = {"w": TensorEncoding("f16")}
    elif encoding.startswith("qsgd"):
        delta, encodings, _ = quantize(delta, int(encoding[4:]), 0, "bench", sender)
    return DeviceUpdate(rollout="bench", round=0, sender=sender, delta=delta, num_samples=1), encodings


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
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
        msg, encodings = _message(values, encoding)
        blob = msg.encode(encodings)
        enc = _timed(lambda m=msg, e=encodings: m.encode(e), reps)  # type: ignore[misc]
        dec = _timed(lambda b=blob: decode_message(b), reps)  # type: ignore[misc]
        out[encoding] = {"bytes": len(blob), "encode": _stats(enc), "decode": _stats(dec),
                         "encode_mb_s": mb / statistics.median(enc), "decode_mb_s": mb / statistics.median(dec)}
    out["baseline"]["encode_mb_s"] = mb / statistics.median(base_enc)
    out["baseline"]["decode_mb_s"] = mb / statistics.median(base_dec)
    return out


def aggregation(n: int, d: int, reps: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    arrays = [rng.normal(scale=0.01, size=d).astype(np.float32) for _ in range(n)]

    def numpy_sum() -> np.ndarray:
        acc = np.zeros(d, dtype=np.float32)
        for a in arrays:
            acc += a
        return acc

    out: dict[str, Any] = {"n": n, "d": d, "numpy_sum": _stats(_timed(numpy_sum, reps))}
    for encoding in ("f32", "qsgd4"):
        blobs = []
        for i, a in enumerate(arrays):
            msg, encodings = _message(a, encoding, sender=f"d{i}")
            blobs.append(msg.encode(encodings))
        if encoding == "f32":  # the integrity check every decode does: sha256 of each body
            sha = _timed(lambda blobs=blobs: [hashlib.sha256(b).digest() for b in blobs], reps)  # type: ignore[misc]
            out["sha256_f32"] = {**_stats(sha), "fraction_of_numpy": out["numpy_sum"]["median_s"] /
                                 statistics.median(sha)}

        def edge(blobs: list[bytes] = blobs) -> dict[str, np.ndarray]:
            updates = [decode_message(b) for b in blobs]
            return weighted_mean([(u.delta, 1.0) for u in updates])

        times = _timed(edge, reps)
        out[encoding] = {**_stats(times),
                         "fraction_of_numpy": out["numpy_sum"]["median_s"] / statistics.median(times)}
        if encoding == "f32":  # the same messages in mutable buffers: every body copied (as before zero-copy)
            mutable = [bytearray(b) for b in blobs]
            copying = _timed(lambda m=mutable: edge(m), reps)  # type: ignore[misc]
            # the bodies decoded without a copy: those that start 4-aligned inside their message
            aligned = sum(np.shares_memory(decode_message(b).delta["w"], np.frombuffer(b, np.uint8))
                          for b in blobs[:50])
            out["f32_copying"] = {**_stats(copying), "fraction_of_numpy": out["numpy_sum"]["median_s"] /
                                  statistics.median(copying), "zero_copy_share": aligned / len(blobs[:50])}
    return out


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
        lines.append(f"| {e} | {r['bytes']:,} | {r['encode_mb_s']:.0f} | {r['decode_mb_s']:.0f} | "
                     f"{r['encode_mb_s'] / b['encode_mb_s']:.3f} | {r['decode_mb_s'] / b['decode_mb_s']:.3f} |")
    lines += ["", "Edge aggregation (decode every update + weighted mean) as a fraction of a plain numpy sum of the "
              "same float32 arrays (1.0 = the memory-bandwidth bound; median with min–max of the edge's time):", "",
              "| n updates | d parameters | numpy sum, ms | f32 edge, ms | f32 fraction | f32 fraction, every body "
              "copied | sha256 of the f32 bodies alone, fraction | QSGD-4 edge, ms | QSGD-4 fraction |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results["aggregation"]:
        if "skipped" in r:
            lines.append(f"| {r['n']:,} | {r['d']:,} | skipped: {r['skipped']} | | | | | | |")
            continue
        f, q = r["f32"], r["qsgd4"]
        lines.append(f"| {r['n']:,} | {r['d']:,} | {1e3 * r['numpy_sum']['median_s']:.1f} | "
                     f"{1e3 * f['median_s']:.1f} ({1e3 * f['min_s']:.1f}–{1e3 * f['max_s']:.1f}) | "
                     f"{f['fraction_of_numpy']:.3f} | {r['f32_copying']['fraction_of_numpy']:.3f} | "
                     f"{r['sha256_f32']['fraction_of_numpy']:.3f} | "
                     f"{1e3 * q['median_s']:.1f} ({1e3 * q['min_s']:.1f}–"
                     f"{1e3 * q['max_s']:.1f}) | {q['fraction_of_numpy']:.3f} |")
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
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"reps": args.reps, "codec": codec(args.params, args.reps), "aggregation": []}
    for size in args.sizes.split(","):
        n, d = (int(x) for x in size.split("x"))
        if n * d > args.max_elements:
            results["aggregation"].append({"n": n, "d": d, "skipped": f"n·d > {args.max_elements:.0e} (memory)"})
            continue
        results["aggregation"].append(aggregation(n, d, args.reps))
        print(f"aggregation {n}x{d} done", flush=True)
    path = write(args.name, results)
    print(table(results))
    print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    main()

"""Cost of hardened noise (``[privacy] secure_noise``) against the default PCG64 draw.

Both draws go through ``NoiseSource.add`` exactly as a device or trusted edge does (fresh labels
per call, float32 out), on a model-sized delta. Repetitions alternate the two modes in the same
process; the ratio is of the medians.

    python benchmarks/bench_secure_noise.py --reps 9 --params 100000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write  # noqa: E402

from fedtier.privacy.mechanism import NoiseSource  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--params", type=int, default=100_000, help="coordinates per release")
    ap.add_argument("--releases", type=int, default=20, help="releases timed per repetition")
    args = ap.parse_args(argv)
    source = NoiseSource()
    delta = {"w": np.zeros(args.params, dtype=np.float32)}
    times: dict[str, list[float]] = {"default": [], "secure": []}
    label = 0
    for _ in range(args.reps):
        for mode in ("default", "secure"):
            start = time.perf_counter()
            for _ in range(args.releases):
                label += 1
                source.add(delta, 1.0, "bench", label, secure=mode == "secure")
            times[mode].append((time.perf_counter() - start) / args.releases)
    med = {m: statistics.median(t) for m, t in times.items()}
    out = {"params": args.params, "reps": args.reps, "releases_per_rep": args.releases,
           "load_average": os.getloadavg(),
           "seconds_per_release": {m: {"median": med[m], "min": min(t), "max": max(t)} for m, t in times.items()},
           "ratio_secure_over_default": med["secure"] / med["default"],
           "mcoords_per_s": {m: args.params / med[m] / 1e6 for m in med}}
    path = write("secure_noise", out)
    for m in ("default", "secure"):
        t = times[m]
        print(f"{m:8s} {med[m] * 1e3:8.2f} ms/release (min {min(t) * 1e3:.2f}, max {max(t) * 1e3:.2f}); "
              f"{out['mcoords_per_s'][m]:.1f} M coordinates/s")
    print(f"secure / default: {out['ratio_secure_over_default']:.2f}x  ({path})")
    return out


if __name__ == "__main__":
    main()

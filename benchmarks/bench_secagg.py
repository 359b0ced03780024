"""Secure aggregation's overhead per round and cell: bytes and time against plain FedAvg.

One cell of n devices (10, 100, 1,000) runs one round of ``secure_fedavg`` and one of ``fedavg``
through the real sans-I/O roles, every message encoded to bytes and decoded again as the wire
does (no broker: what is measured is the protocol, not Mosquitto). Local training is replaced by a
fixed random delta of the digits MLP's size (64-64-10: 4,810 parameters), so both runs do the same
non-protocol work. Reported per configuration, median of ``--reps`` repetitions in the same run:

* device -> edge bytes per device, and edge -> device bytes delivered per device (a broadcast
  counts once per member, as the broker delivers it to each);
* CPU seconds of the whole round (all devices and the edge, in this one process) and of the edge
  alone.

    python benchmarks/bench_secagg.py            # writes benchmarks/results/secagg_bits48.json
    python benchmarks/bench_secagg.py --sizes 10,100 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write  # noqa: E402

from fedtier.algorithms import fedavg, secure_fedavg  # noqa: E402
from fedtier.algorithms.base import Broadcast, LocalResult, LocalTrain, SendToChild, SendToParent  # noqa: E402
from fedtier.wire.messages import CellTask, decode_message  # noqa: E402

PARAMS = {"w1": np.zeros((64, 64), np.float32), "b1": np.zeros(64, np.float32),
          "w2": np.zeros((64, 10), np.float32), "b2": np.zeros(10, np.float32)}


def one_round(n: int, secure: bool, degree: int, seed: int, bits: int = 48) -> dict[str, float]:
    module: Any = secure_fedavg if secure else fedavg
    config = (secure_fedavg.SecureFedAvgConfig(secagg_min_survivors=max(1, n - n // 10), secagg_degree=degree,
                                               secagg_clip=100.0, secagg_bits=bits, local_steps=1)
              if secure else fedavg.FedAvgConfig(local_steps=1))
    ids = [f"d{i:04d}" for i in range(n)]
    edge = module.Edge(cell="e", rollout="bench")
    devices = {d: module.Device(device_id=d, cell="e", rollout="bench") for d in ids}
    rng = np.random.default_rng(seed)
    deltas = {d: {k: rng.normal(scale=0.01, size=v.shape).astype(np.float32) for k, v in PARAMS.items()} for d in ids}
    up = down = 0
    edge_cpu = 0.0
    start = time.process_time()

    def at_edge(call: Any) -> list[Any]:
        nonlocal edge_cpu
        t0 = time.process_time()
        out = call()
        edge_cpu += time.process_time() - t0
        return [("edge", a) for a in out]

    task = CellTask(rollout="bench", round=0, sender="cloud", params=PARAMS, members=tuple(ids),
                    config=config.to_dict())
    queue: deque[tuple[str, Any]] = deque(at_edge(lambda: edge.receive(task, 0.0)))
    forwarded = False
    while queue:
        origin, action = queue.popleft()
        if origin == "edge" and isinstance(action, SendToParent):
            forwarded = True
        elif origin == "edge" and isinstance(action, (Broadcast, SendToChild)):
            payload = action.message.encode(action.encodings)
            targets = [action.child] if isinstance(action, SendToChild) else ids
            down += len(payload) * len(targets)
            for d in targets:
                queue.extend((d, a) for a in devices[d].receive(decode_message(payload), 0.0))
        elif isinstance(action, LocalTrain):
            result = LocalResult(delta=deltas[origin], num_samples=10, mean_loss=0.0, steps=1)
            queue.extend((origin, a) for a in devices[origin].trained(action.round, result))
        elif isinstance(action, SendToParent):
            payload = action.message.encode(action.encodings)
            up += len(payload)
            queue.extend(at_edge(lambda p=payload: edge.receive(decode_message(p), 0.0)))
    assert forwarded, "the cell did not close its round"
    return {"up_per_device": up / n, "down_per_device": down / n, "cpu_s": time.process_time() - start,
            "edge_cpu_s": edge_cpu}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--degree", type=int, default=8)
    parser.add_argument("--bits", type=int, default=48, help="the ring Z_{2^bits} (48: 6 bytes per coordinate)")
    args = parser.parse_args(argv)
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for rep in range(args.reps):
            for secure in (False, True):
                runs[secure].append(one_round(n, secure, args.degree, rep, args.bits))
        med = {s: {k: statistics.median(r[k] for r in runs[s]) for k in runs[s][0]} for s in runs}
        spread = {s: {k: [min(r[k] for r in runs[s]), max(r[k] for r in runs[s])] for k in ("cpu_s", "edge_cpu_s")}
                  for s in runs}
        row = {"devices": n, "degree": args.degree, "bits": args.bits, "plain": med[False], "secure": med[True],
               "plain_min_max": spread[False], "secure_min_max": spread[True]}
        rows.append(row)
        p, s = med[False], med[True]
        print(f"n={n:5d}  up/device {p['up_per_device']:9.0f} -> {s['up_per_device']:9.0f} B "
              f"(x{s['up_per_device'] / p['up_per_device']:.2f})  down/device {p['down_per_device']:9.0f} -> "
              f"{s['down_per_device']:9.0f} B (x{s['down_per_device'] / p['down_per_device']:.2f})  "
              f"cpu {p['cpu_s']:.3f} -> {s['cpu_s']:.3f} s  edge cpu {p['edge_cpu_s']:.3f} -> {s['edge_cpu_s']:.3f} s",
              flush=True)
    parameters = int(sum(v.size for v in PARAMS.values()))
    out = {"reps": args.reps, "parameters": parameters, "rows": rows}
    path = write(f"secagg_bits{args.bits}", out)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()

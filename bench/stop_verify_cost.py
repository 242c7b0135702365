"""What re-reading held replicas at a stop costs an agent (``PeerStore.verify``): a store
holding two ranks' replicas of ``--size-mib`` in two slots each, the newer one above the
step committed in tier 1 (so both are read, as after a failure between a step's
snapshot and its commit), timed reading every rank's (``None``: every stop before
12-05), one rank's (a lost node's), and none (a failed worker's, since 12-05).

    .venv/bin/python bench/stop_verify_cost.py --size-mib 384 > bench/stop-verify-cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from tierswap.checksum import checksum_chunks
from tierswap.layout import Layout, TensorEntry
from tierswap.tiers.replicas import PeerStore

RANKS, STEPS = (3, 4), (6, 7)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    n = args.size_mib << 20
    layout = Layout(entries=(TensorEntry("w", "U8", (n,), 0, n),), nbytes=n)
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    checksum = checksum_chunks([memoryview(data)])
    store = PeerStore(f"bench-verify-{os.getpid()}", len(STEPS), 0, lambda m, g: None)
    cases: dict[str, list[int] | None] = {"every rank": None, "one rank": [RANKS[1]], "none": []}
    times: dict[str, list[float]] = {c: [] for c in cases}
    try:
        for rank in RANKS:
            for step in STEPS:
                got = store.slot(rank, step, layout)
                assert isinstance(got, tuple), got
                token, buf = got
                buf[:] = memoryview(data)
                store.written(rank, token, True, step, layout, {}, checksum)
            store.rings[rank].set_committed(STEPS[0])
        for _ in range(args.repeats):
            for name, ranks in cases.items():
                t = time.perf_counter()
                bad = store.verify(ranks)
                times[name].append(time.perf_counter() - t)
                assert not bad, bad
    finally:
        store.close()
    out = {
        "size_mib": args.size_mib,
        "replicas_per_rank": len(STEPS),
        "ranks": len(RANKS),
        "seconds": {
            c: {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": v}
            for c, v in times.items()
        },
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Section 4 of ``tierswap bench snapshot``, its 1-thread half only, for long runs.

    python bench/step_overhead_1thread.py PAIRS OUT.json

Run on 2026-12-01 with 100 pairs (the count chosen before it ran); blocks of 5 steps as in
the bench. Sections 1 to 3 are replaced by no-ops: the rig (agent process, ring, copy
thread) is the bench's own.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from tierswap.bench import measure, steps
from tierswap.bench.rig import Rig


def only_one_thread(rig: Rig, size_mib: int, pairs: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    loop = steps._Loop.make(size_mib)
    return {"threads_1": {"threads": 1, **steps.step_overhead(loop, rig, pairs)}}


def main() -> None:
    pairs, out = int(sys.argv[1]), sys.argv[2]
    measure._bench_throughput = lambda *a: {"compute_s": 0.0}  # type: ignore[assignment]
    measure._bench_blocking = lambda *a: {}  # type: ignore[assignment]
    measure.make_state = lambda size: {}  # type: ignore[assignment]
    measure.ratios = lambda res: {}  # type: ignore[assignment]
    measure.bench_steps = only_one_thread
    res = measure.run(1024, pairs)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    t = res["step"]["threads_1"]
    o = t["overhead"]
    print(
        f"pairs {len(o['samples'])}: median {100 * o['median']:+.2f} %, "
        f"quartiles {100 * o['q1']:+.2f} - {100 * o['q3']:+.2f} %; step medians "
        f"{1e3 * t['with_snapshot']['step_s']['median']:.1f} / "
        f"{1e3 * t['without']['step_s']['median']:.1f} ms; "
        f"stall {1e3 * t['with_snapshot']['stall_s']['median']:.2f} ms"
    )


if __name__ == "__main__":
    main()

"""Section 4 of `tierswap bench snapshot`, its 1-thread half only, for long runs:
`python bench/step_overhead_1thread.py PAIRS OUT.json` (run 2026-12-01 with 100 pairs,
declared before it ran; blocks of 5 steps)."""
import json, sys, statistics
import torch
from tierswap.bench import measure, steps
from tierswap.bench.common import interleave, stats

def only_threads_1(rig, size_mib, repeats):
    loop = steps._Loop.make(size_mib)
    torch.set_num_threads(1)
    methods = {"with_snapshot": lambda: steps._block(loop, rig, True),
               "without": lambda: steps._block(loop, rig, False)}
    ab = interleave(methods, repeats, rig.sync, alternate=True)
    w, wo = (ab[k]["step_s"]["samples"] for k in ("with_snapshot", "without"))
    return {"threads_1": {**ab, "overhead": stats([a / b - 1 for a, b in zip(w, wo)])}}

measure._bench_throughput = lambda rig, state, tmp, repeats: {"compute_s": 0.0}
measure._bench_blocking = lambda *a: {}
measure.make_state = lambda size: {}
measure.ratios = lambda res: {}
measure.bench_steps = only_threads_1
res = measure.run(1024, int(sys.argv[1]))
json.dump(res, open(sys.argv[2], "w"), indent=1)
t = res["step"]["threads_1"]; o = t["overhead"]
print(f"pairs {len(o['samples'])}: median {100*o['median']:+.2f} % q1 {100*o['q1']:+.2f} q3 {100*o['q3']:+.2f}; "
      f"step medians {1e3*t['with_snapshot']['step_s']['median']:.1f} / {1e3*t['without']['step_s']['median']:.1f} ms; "
      f"stall {1e3*t['with_snapshot']['stall_s']['median']:.2f} ms")

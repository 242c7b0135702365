"""Tier 1 sending each replica from its slot's file with ``sendfile`` (8ac32e3, reverted)
against sending it from the slot's mapping with ``sendall``: ``bench overhead``'s plain
and tiers 0+1 jobs, unpinned, at 384 MiB per rank, the two codes alternating round by
round (order flipped every round). Each code is a checkout, put first on the jobs'
``PYTHONPATH`` (so the tree being worked on can change while this runs).

    git worktree add /tmp/wt-old bbf10ab; git worktree add /tmp/wt-new 8ac32e3
    .venv/bin/python bench/sendfile_ab.py --old /tmp/wt-old/src --new /tmp/wt-new/src \
        --rounds 3 --out bench/sendfile-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tierswap.bench import overhead

FIELDS = ("step_s", "stall_s", "gate_s", "agents_cpu_s_per_gib", "overhead", "agents_vs_tcp")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="src folder of the code before")
    ap.add_argument("--new", required=True, help="src folder of the code with sendfile")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=384)
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args()
    for src in (args.old, args.new):
        if not os.path.isdir(os.path.join(src, "tierswap")):
            ap.error(f"{src} has no tierswap package")
    runs: dict[str, list[dict[str, Any]]] = {"sendall": [], "sendfile": []}
    before = os.environ.get("PYTHONPATH")
    try:
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(runs)[::-1]
            for name in order:
                os.environ["PYTHONPATH"] = args.old if name == "sendall" else args.new
                res = overhead.run(args.size_mib, 1, modes=("plain", "tier01"), pinned=False)
                keep = {"plain_step_s": res["plain"]["step_s"]["median"]}
                keep.update({k: res["tier01"].get(k) for k in FIELDS})
                runs[name].append(keep)
                print(name, r, json.dumps(keep), file=sys.stderr, flush=True)
    finally:
        os.environ.pop("PYTHONPATH", None)
        if before is not None:
            os.environ["PYTHONPATH"] = before
    with open(args.out, "w") as f:
        json.dump({"size_mib": args.size_mib, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

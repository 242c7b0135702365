"""The step overhead of tiers 0+1 with the defaults before 12-05 (3 + 3 slots, full copies)
and since (2 + 2; full copies on these 2 nodes), unpinned and pinned, each round's two
runs back to back, the order flipped every round (``bench overhead``'s jobs, with the old
defaults given as TIERSWAP_* variables).

    .venv/bin/python bench/defaults_overhead_ab.py --rounds 2 > bench/defaults-overhead-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tierswap.bench import overhead

OLD = {"TIERSWAP_SLOTS": "3", "TIERSWAP_PEER_SLOTS": "3", "TIERSWAP_PEER_PARITY": "0"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size-mib", type=int, default=384)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"before-12-05": [], "defaults": []}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:
            for k in OLD:
                os.environ.pop(k, None)
            if name == "before-12-05":
                os.environ.update(OLD)
            res = overhead.run(args.size_mib, 1, modes=("plain", "tier01"), pinned=True)
            fields = ("step_s", "stall_s", "overhead", "stall_of_step")
            keep = {m: {k: res[m].get(k) for k in fields} for m in ("tier01", "tier01_pinned")}
            runs[name].append(keep)
            print(name, r, json.dumps(keep), file=sys.stderr, flush=True)
    for k in OLD:
        os.environ.pop(k, None)
    json.dump({"size_mib": args.size_mib, "runs": runs}, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The defaults before 12-05 (3 + 3 slots, full copies) against the defaults since (2 + 2,
tier 1 as parity where it applies) over the simulation's seeded scenarios, each seed with
the shape and chaos it was drawn with before 12-05 (``test_sim.scenario(seed,
since_12_05=False)``); per mode and per ``--max-redo``: snapshots skipped, replicas
refused, steps committed in tiers 0 and 1, runs finished, and those that stopped with why.

    .venv/bin/python bench/sim_slots.py 0 1000 > bench/sim-slots-<date>.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_sim import _explained, scenario
from tierswap.control.sim import Sim

COUNTED = ("skipped", "rejected", "tier0", "tier1")


def counts(sim: Sim) -> dict[str, int]:
    c = dict.fromkeys(COUNTED, 0)
    for _, event, fields in sim.log:
        if event == "snapshot_skipped":
            c["skipped"] += 1
        elif event == "replica_rejected":
            c["rejected"] += 1
        elif event == "snapshot_committed" and fields.get("tier") in (0, 1):
            c[f"tier{fields['tier']}"] += 1
    return c


def main() -> int:
    lo, hi = int(sys.argv[1]), int(sys.argv[2])
    out: dict[str, Any] = {"seeds": [lo, hi]}
    for mode in ("before-12-05", "defaults"):
        tot: dict[str, Any] = {"finished": 0, "explained": 0, "parity_jobs": 0, "stopped": []}
        for s in range(lo, hi):
            base = scenario(s, since_12_05=False)
            cfg = base.cfg  # 3 + 3, full copies: the defaults these seeds were drawn with
            if mode == "defaults":
                cfg = dataclasses.replace(cfg, slots=None, peer_slots=2, peer_parity=None)
            sim = Sim(cfg, seed=s, steps=base.steps, chaos=base.chaos, step_time=base.step_time)
            outcome = sim.run()
            sub = tot.setdefault(f"max_redo_{cfg.max_redo}", dict.fromkeys(("jobs", *COUNTED), 0))
            sub["jobs"] += 1
            for k, v in counts(sim).items():
                sub[k] += v
            tot["finished"] += outcome == "finished"
            tot["explained"] += _explained(outcome)
            tot["parity_jobs"] += cfg.parity_group > 0
            if outcome != "finished":
                tot["stopped"].append([s, outcome[:100]])
        out[mode] = tot
    json.dump(out, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

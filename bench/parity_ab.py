"""Tier 1 as copies or as parity, at 384 MiB per rank: a node kill with a spare host,
interleaved, and the host memory each mode holds.

    .venv/bin/python bench/parity_ab.py --rounds 3 > bench/parity-ab-<date>.json
    .venv/bin/python bench/parity_ab.py --nodes 2 --modes full,defaults > bench/defaults-ab.json

Modes: ``full``, full replicas with 3 tier-0 and 3 tier-1 slots (the defaults before
12-05, 6x); ``parity``, the same slots with tier 1 as parity over groups of 3 (4.5x);
``parity-3x``, ``--peer-parity 3 --slots 2 --peer-slots 2`` (3x); ``defaults``, no option
at all (since 12-05: the ``parity-3x`` mode on 3 nodes or more, 2 + 2 full copies on 2).
Each job is the reference model
(``examples/train_mlp.py``, 1 torch thread a worker, steps slowed by 50 ms as in ``bench
recovery``), node 1 killed at step 8 of 14, the order of the modes rotated every round.
Per job: the coordinator's account of the recovery (``recovery.account``: seconds, its
phases, the lost rank's fetch / verify / load), the tier the lost rank came back from,
snapshots skipped and replicas refused, and per node the memory its agent allocated as a
multiple of its rank's state (``bench memory``'s reading). Three ranks of plain DDP are not
bit-exact through a rewrap (``make_exact``); ``tests/test_tier1.py`` holds the bits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tierswap.bench.common import run_bounded
from tierswap.bench.hostmem import node_memory
from tierswap.bench.recovery import MLP, account
from tierswap.examples import job_command

MODES: dict[str, list[str]] = {
    "full": ["--peer-parity", "0", "--slots", "3", "--peer-slots", "3"],
    "parity": ["--peer-parity", "3", "--slots", "3", "--peer-slots", "3"],
    "parity-3x": ["--peer-parity", "3", "--slots", "2", "--peer-slots", "2"],
    "defaults": [],
}


def job(work: Path, name: str, extra: list[str], size_mib: int, nodes: int) -> dict[str, Any]:
    run_dir = work / name
    cmd = job_command(
        run_dir,
        ["--nodes", str(nodes), "--spares", "1", "--inject", "kill:node=1:step=8", *extra],
        ["--steps", "14", "--size-mib", str(size_mib), "--sleep", "0.05"],
        script=MLP,
    )
    code = run_bounded(cmd, work / f"{name}.log", work, 900, run_dir)
    if code != 0:
        return {"failed": (work / f"{name}.log").read_text()[-2000:]}
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    mem = node_memory(evs)
    count = {k: sum(e["event"] == k for e in evs) for k in ("snapshot_skipped", "replica_rejected")}
    commits = [e for e in evs if e["event"] == "snapshot_committed"]
    count["committed_tier1"] = len({e["step"] for e in commits if e.get("tier") == 1})
    return {
        **account(run_dir),
        **count,
        "memory_x": {n: round(m["total_x"], 3) for n, m in mem.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=384)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--modes", default="full,parity,parity-3x", help="of " + ",".join(MODES))
    args = ap.parse_args()
    names = args.modes.split(",")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in names}
    with tempfile.TemporaryDirectory(prefix="tierswap-parity-ab-") as tmp:
        for r in range(args.rounds):
            for m in names[r % len(names) :] + names[: r % len(names)]:
                res = job(Path(tmp), f"{m}-{r}", MODES[m], args.size_mib, args.nodes)
                runs[m].append(res)
                print(m, r, res.get("seconds", "failed"), file=sys.stderr, flush=True)
    summary = {}
    for m, rs in runs.items():
        ok = [x for x in rs if "failed" not in x]
        summary[m] = {
            "args": MODES[m],
            "failed": len(rs) - len(ok),
            "recovery_s": _med([x["seconds"] for x in ok]),
            "restore_s": _med([x["phases"]["restore"] for x in ok]),
            "lost_fetch_s": _med([x["lost"].get("fetch", 0.0) for x in ok]),
            "step_s": _med([x["step_s"] for x in ok]),
            "snapshot_skipped": sum(x["snapshot_skipped"] for x in ok),
            "replica_rejected": sum(x["replica_rejected"] for x in ok),
            "memory_x": max((v for x in ok for v in x["memory_x"].values()), default=None),
        }
    out = {"size_mib": args.size_mib, "nodes": args.nodes, "summary": summary, "runs": runs}
    json.dump(out, sys.stdout, indent=1)
    return 0


def _med(xs: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


if __name__ == "__main__":
    sys.exit(main())

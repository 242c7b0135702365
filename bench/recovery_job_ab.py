"""A worker kill at 384 MiB run the way a GPU host is built, an older commit against this
checkout, rounds alternated: ``tierswap run --agent-cpus 1 --worker-cpus 0`` (the trainers
on core 0; the agents, the launcher and the workers' helper threads on core 1; or, with
``--unpinned``, every process on every core) with a parked spare worker, the kill at step
8; the recovery and its phases from the ``resumed`` event. Lighter than
``recovery_ab.py`` (one job a round, no node kill, no limits), for more rounds. The old
code runs from a checkout of it on ``PYTHONPATH`` (``--old``)::

    git worktree add /tmp/old-650740a 650740a
    .venv/bin/python bench/recovery_job_ab.py --old /tmp/old-650740a --rounds 4 \\
        --label ahead > bench/ahead-pinned-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

JOB = ["--nodes", "2", "--spare-workers", "1", "--inject", "kill:rank=1:step=8"]
PINNED = ["--agent-cpus", "1", "--worker-cpus", "0"]
SCRIPT = ["src/tierswap/examples/train_mlp.py", "--steps", "14", "--size-mib", "384"]


def once(old: Path | None, pinned: bool) -> dict[str, Any]:
    """One job, by the old code where ``old`` is given; what its ``resumed`` event says."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if old is not None:
        env["PYTHONPATH"] = str(old / "src")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "tierswap.cli", "run", "--threads", "1",
               "--run-dir", str(run_dir), *JOB, *(PINNED if pinned else []), *SCRIPT]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        lines = (run_dir / "events.jsonl").read_text().splitlines()
        resumed = next(e for e in map(json.loads, lines) if e["event"] == "resumed")
    return {k: resumed[k] for k in ("seconds", "phases", "ranks")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--label", default="since")
    ap.add_argument("--unpinned", action="store_true")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"before": [], args.label: []}
    for i in range(args.rounds):
        for arm in ("before", args.label)[:: -1 if i % 2 else 1]:
            r = once(args.old if arm == "before" else None, not args.unpinned)
            runs[arm].append(r)
            phases = {k: round(v, 3) for k, v in r["phases"].items()}
            print(arm, round(r["seconds"], 3), phases, file=sys.stderr, flush=True)
    for arm, rs in runs.items():
        med = {k: round(statistics.median(r["phases"][k] for r in rs), 3) for k in rs[0]["phases"]}
        rec = statistics.median(r["seconds"] for r in rs)
        print(f"{arm}: median recovery {rec:.3f} s, phases {med}", file=sys.stderr)
    how = "unpinned" if args.unpinned else " ".join(PINNED)
    what = (f"worker kill at 384 MiB, {how}, rounds alternated: "
            f"{args.old} (before) against this checkout ({args.label!r})")  # fmt: skip
    json.dump({"what": what, "runs": runs}, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``bench recovery`` at one size, an older commit against this checkout, interleaved:
each round runs both arms' ``tierswap bench recovery --size-mib N --repeats 1`` (a worker
kill with a parked spare worker and a node kill with a spare host), the order alternated.
The old code runs from a checkout of it, first on ``PYTHONPATH`` for the bench and the
jobs it starts alike.

    git worktree add /tmp/old-5c0c852 5c0c852
    .venv/bin/python bench/recovery_ab.py --old /tmp/old-5c0c852 --label stop-verify \\
        --rounds 3 > bench/stop-verify-ab.json
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

PHASES = ("detect", "decide", "rebuild", "restore", "resume")


def run_arm(old: Path | None, size: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if old is not None:
        env["PYTHONPATH"] = str(old / "src")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "res.json"
        cmd = [sys.executable, "-m", "tierswap.cli", "bench", "recovery",
               "--size-mib", str(size), "--repeats", "1", "--json", str(out)]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, stdout=sys.stderr)
        res: dict[str, Any] = json.loads(out.read_text())
    return res["sizes"][str(size)]


def summary(runs: list[dict[str, Any]], kill: str) -> dict[str, Any]:
    done = [r[kill] for r in runs if kill in r and "phases" in r[kill]]
    return {
        "seconds": [round(r["seconds"]["median"], 3) for r in done],
        **{ph: [round(r["phases"][ph], 3) for r in done] for ph in PHASES},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--label", default="since")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=384)
    args = ap.parse_args()
    arms: dict[str, Path | None] = {"before": args.old, args.label: None}
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for r in range(args.rounds):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for name in order:
            runs[name].append(run_arm(arms[name], args.size_mib))
    out: dict[str, Any] = {"size_mib": args.size_mib, "old": str(args.old), "arms": {}}
    for name, rs in runs.items():
        out["arms"][name] = {kill: summary(rs, kill) for kill in ("worker", "node")}
        for kill, s in out["arms"][name].items():
            if s["seconds"]:
                med = {k: statistics.median(v) for k, v in s.items() if v}
                print(f"{name:>12} {kill}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()),
                      file=sys.stderr)  # fmt: skip
    out["runs"] = runs
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

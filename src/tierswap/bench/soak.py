"""``tierswap bench soak``: the example GPT through many random failures.

Each seed is one job (2 simulated nodes and a spare, a spare worker per node, tier 2 on)
run with ``--chaos SEED:RATE:COUNT``, which kills random nodes and workers while it trains,
and one run of the same job without failures. Reported per seed and in all: failures
survived, steps redone, whether the final state is bit for bit the uninterrupted run's,
what ``tierswap verify`` says of tier 2 (a committed part that does not verify is bytes
lost), and processes or shared-memory segments left behind.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from tierswap.events import job_events
from tierswap.examples import differing, job_command, load_final
from tierswap.shm import PREFIX, SHM_DIR

RATE = 90.0
"""Failures a minute while the job trains (chaos waits for a step between two)."""


def _job(work: Path, name: str, steps: int, run_args: list[str]) -> tuple[int, float]:
    cmd = job_command(
        work / name,
        ["--nodes", "2", *run_args],
        [
            "--steps",
            str(steps),
            "--mode",
            "ddp",
            "--sleep",
            "0.05",
            "--out",
            str(work / f"{name}-final"),
        ],
    )
    t0 = time.monotonic()
    with (work / f"{name}.log").open("w") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=work, timeout=3600)
    return code, time.monotonic() - t0


def one_seed(work: Path, seed: int, failures: int) -> dict[str, Any]:
    steps = max(200, 20 * failures)
    base_code, base_seconds = _job(work, f"base{seed}", steps, [])
    persist = work / f"ckpt{seed}"
    code, seconds = _job(
        work,
        f"soak{seed}",
        steps,
        [
            "--spares", "1", "--spare-workers", "1", "--chaos", f"{seed}:{RATE}:{failures}",
            "--max-restarts", str(4 * failures), "--persist", str(persist), "--persist-every", "5",
        ],
    )  # fmt: skip
    run_dir = work / f"soak{seed}"
    verify = subprocess.run(
        [sys.executable, "-m", "tierswap.cli", "verify", str(persist)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    diff = differing(load_final(work / f"base{seed}-final"), load_final(work / f"soak{seed}-final"))
    resumed = job_events(run_dir, "resumed")
    redone = [int(r["redone"]) for r in resumed]
    agents = [e["pid"] for e in job_events(run_dir, "node_joined")]
    left = [p for p in agents if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    return {
        "seed": seed,
        "exit_code": code,
        "baseline_exit_code": base_code,
        "steps": steps,
        "seconds": seconds,
        "baseline_seconds": base_seconds,
        "failures_injected": len(job_events(run_dir, "fault_injected")),
        "failures_detected": len(job_events(run_dir, "failure_detected")),
        "recoveries": len(resumed),
        "steps_redone": sum(redone),
        "most_redone_in_one_recovery": max(redone, default=0),
        "recovery_seconds": sorted(round(float(r["seconds"]), 3) for r in resumed),
        "bit_exact": code == 0 and base_code == 0 and not diff,
        "tensors_differing": len(diff),
        "tier2_problems": [] if verify.returncode == 0 else verify.stdout.splitlines(),
        "processes_left": left,
    }


def main(args: Any) -> int:
    """``tierswap bench soak [--repeats SEEDS] [--failures N] [--json PATH]``."""
    seeds = max(1, args.repeats)
    per_seed = max(1, -(-int(args.failures) // seeds))
    before = {p.name for p in SHM_DIR.glob(f"{PREFIX}*")}
    runs = []
    with tempfile.TemporaryDirectory(prefix="tierswap-bench-soak-") as tmp:
        for seed in range(seeds):
            r = one_seed(Path(tmp), seed, per_seed)
            runs.append(r)
            print(
                f"seed {seed}: {r['failures_injected']} failures injected, "
                f"{r['recoveries']} recoveries, {r['steps_redone']} steps redone "
                f"(at most {r['most_redone_in_one_recovery']} in one), "
                f"bit-exact {r['bit_exact']}, tier-2 problems {len(r['tier2_problems'])}, "
                f"processes left {len(r['processes_left'])}, {r['seconds']:.0f} s",
                flush=True,
            )
    left_segments = sorted({p.name for p in SHM_DIR.glob(f"{PREFIX}*")} - before)
    every = sorted(t for r in runs for t in r["recovery_seconds"])
    total = {
        "seeds": seeds,
        "failures_injected": sum(r["failures_injected"] for r in runs),
        "recoveries": sum(r["recoveries"] for r in runs),
        "steps_redone": sum(r["steps_redone"] for r in runs),
        "most_redone_in_one_recovery": max(r["most_redone_in_one_recovery"] for r in runs),
        "recovery_seconds_median": statistics.median(every) if every else None,
        "recovery_seconds_max": max(every, default=None),
        "all_bit_exact": all(r["bit_exact"] for r in runs),
        "tier2_problems": sum(len(r["tier2_problems"]) for r in runs),
        "processes_left": sum(len(r["processes_left"]) for r in runs),
        "segments_left": len(left_segments),
    }
    print(json.dumps(total))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "total": total}, indent=2) + "\n")
    ok = total["all_bit_exact"] and not total["tier2_problems"] and not total["processes_left"]
    return 0 if ok and not left_segments else 1

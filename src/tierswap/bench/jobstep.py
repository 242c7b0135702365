"""Step time of a real job with tier-1 replication on and off, interleaved.

Runs ``tierswap run --nodes 2`` on the example GPT with ``--replicas 1`` and
``--replicas 0`` in alternating order, and reads each step's end from rank 0's ``report``
events: the step time is the gap between consecutive reports, the first steps (slot
allocation, warm-up) dropped. Everything else — tier-0 snapshots every step — is on in
both, so the difference is what replication costs the training loop.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tierswap.demo import EXAMPLE, job_command

WARMUP_STEPS = 5


def _step_times(run_dir: Path) -> list[float]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    times = [e["time"] for e in map(json.loads, lines) if e["event"] == "report"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return gaps[WARMUP_STEPS:]


def _run(work: Path, name: str, replicas: int, steps: int, layers: int) -> list[float]:
    run_dir = work / name
    cmd = job_command(
        run_dir,
        ["--nodes", "2", "--replicas", str(replicas)],
        ["--steps", str(steps), "--layers", str(layers)],
    )
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark job {name} failed:\n{done.stderr[-2000:]}")
    return _step_times(run_dir)


def replication_overhead(repeats: int, steps: int = 40, layers: int = 4) -> dict[str, Any]:
    """Median step time with and without replication, and the overhead with its spread."""
    if not EXAMPLE.is_file():
        raise RuntimeError(f"the job benchmark needs the repository's examples/ ({EXAMPLE})")
    medians: dict[int, list[float]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="tierswap-bench-job-") as tmp:
        for i in range(repeats):
            order = (1, 0) if i % 2 else (0, 1)
            for replicas in order:
                gaps = _run(Path(tmp), f"r{i}-{replicas}", replicas, steps, layers)
                medians[replicas].append(statistics.median(gaps))
    ratios = [a / b - 1 for a, b in zip(medians[1], medians[0], strict=True)]
    return {
        "step_s": {"replicas_0": medians[0], "replicas_1": medians[1]},
        "overhead": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "samples": ratios,
        },
        "config": {
            "nodes": 2,
            "threads": 1,
            "steps": steps,
            "layers": layers,
            "warmup_steps": WARMUP_STEPS,
        },
    }


def main(args: Any) -> int:
    """``tierswap bench job-replication [--repeats N] [--json PATH]``."""
    from rich.console import Console
    from rich.table import Table

    res = replication_overhead(max(args.repeats, 1))
    table = Table(title="step time of a 2-node job (example GPT), tier 0 every step in both")
    for col in ("replicas", "median step per run (ms)"):
        table.add_column(col)
    for key in ("replicas_0", "replicas_1"):
        table.add_row(key[-1], ", ".join(f"{s * 1e3:.1f}" for s in res["step_s"][key]))
    o = res["overhead"]
    table.add_row(
        "overhead",
        f"median {o['median']:+.1%} (min {o['min']:+.1%}, max {o['max']:+.1%}); target <= +2%",
    )
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0

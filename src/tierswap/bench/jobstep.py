"""Step time of a real job with tier-1 replication on and off, interleaved.

Runs ``tierswap run --nodes 2`` on the example GPT in three modes, in a rotating order:
tier 0 only (``--replicas 0``), tier 1 with the default bound on lost work
(``--max-redo 1``: an optimizer step waits until tier 1 holds the step before) and tier 1
unbounded (``--max-redo 0``). Each step's end is read from rank 0's ``report`` events: the
step time is the gap between consecutive reports, the first steps (slot allocation,
warm-up) dropped. Tier-0 snapshots every step are on in all three, so the differences are
what replication costs the training loop. The lag is how many steps tier 1's newest
commit trails each reported step: what a node failure at that moment would redo.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tierswap.examples import job_command

WARMUP_STEPS = 5

MODES: dict[str, tuple[str, ...]] = {
    "tier 0 only": ("--replicas", "0"),
    "tier 1, --max-redo 1": ("--replicas", "1", "--max-redo", "1"),
    "tier 1, --max-redo 0": ("--replicas", "1", "--max-redo", "0"),
}
BASELINE = "tier 0 only"


def _timeline(run_dir: Path) -> tuple[list[float], list[int]]:
    """Step times after the warm-up, and tier 1's lag at each reported step."""
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    committed, lags, times = -1, [], []
    for e in map(json.loads, lines):
        if e["event"] == "snapshot_committed" and e["tier"] == 1:
            committed = max(committed, int(e["step"]))
        elif e["event"] == "report":
            times.append(e["time"])
            lags.append(int(e["step"]) - committed)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return gaps[WARMUP_STEPS:], lags[WARMUP_STEPS + 1 :]


def _run(work: Path, name: str, mode: tuple[str, ...], steps: int, layers: int) -> Any:
    run_dir = work / name
    cmd = job_command(
        run_dir,
        ["--nodes", "2", *mode],
        ["--steps", str(steps), "--layers", str(layers)],
    )
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark job {name} failed:\n{done.stderr[-2000:]}")
    return _timeline(run_dir)


def replication_overhead(repeats: int, steps: int = 40, layers: int = 4) -> dict[str, Any]:
    """Median step time per mode, each tier-1 mode's overhead over tier 0 alone (with its
    spread over the runs), and tier 1's lag behind training."""
    names = list(MODES)
    medians: dict[str, list[float]] = {m: [] for m in names}
    lags: dict[str, list[int]] = {m: [] for m in names}
    with tempfile.TemporaryDirectory(prefix="tierswap-bench-job-") as tmp:
        for i in range(repeats):
            for j, mode in enumerate(names[i % len(names) :] + names[: i % len(names)]):
                gaps, lag = _run(Path(tmp), f"r{i}-{j}", MODES[mode], steps, layers)
                medians[mode].append(statistics.median(gaps))
                lags[mode].extend(lag)
    out: dict[str, Any] = {"step_s": medians, "overhead": {}, "tier1_lag": {}}
    for mode in names:
        if mode == BASELINE:
            continue
        ratios = [a / b - 1 for a, b in zip(medians[mode], medians[BASELINE], strict=True)]
        out["overhead"][mode] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "samples": ratios,
        }
        out["tier1_lag"][mode] = {"median": statistics.median(lags[mode]), "max": max(lags[mode])}
    out["config"] = {
        "nodes": 2,
        "threads": 1,
        "steps": steps,
        "layers": layers,
        "warmup_steps": WARMUP_STEPS,
        "repeats": repeats,
    }
    return out


def main(args: Any) -> int:
    """``tierswap bench job-replication [--repeats N] [--json PATH]``."""
    from rich.console import Console
    from rich.table import Table

    res = replication_overhead(max(args.repeats, 1))
    table = Table(title="step time of a 2-node job (example GPT), tier 0 every step in all")
    for col in ("mode", "median step per run (ms)", "overhead vs tier 0", "tier-1 lag"):
        table.add_column(col)
    for mode, steps in res["step_s"].items():
        o, lag = res["overhead"].get(mode), res["tier1_lag"].get(mode)
        table.add_row(
            mode,
            ", ".join(f"{s * 1e3:.1f}" for s in steps),
            "" if o is None else f"{o['median']:+.1%} ({o['min']:+.1%} – {o['max']:+.1%})",
            "" if lag is None else f"median {lag['median']:g}, max {lag['max']} steps",
        )
    Console().print(table)
    Console().print("target: tier 1 within +2 % of tier 0 alone")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0

"""``tierswap bench goodput``: does ``tierswap simulate`` predict real runs?

For each job size (``--nodes``, default 2 and 4, one rank per node, one parked spare, the
killed hosts rebooted as spares), real jobs of the example GPT, interleaved per round:

- ``clean``: no failure. Its training wall time (first generation started to job
  finished) over its steps is the step time;
- ``workers``: two worker kills; ``nodes``: two node kills with two spares parked. What
  each kind costs is the wall time it adds to ``clean``, per failure. No worker is parked
  (no ``--spare-workers``, as in the chaos runs): a killed worker's rank waits for a new
  process to start and import torch (seconds), while a killed node's goes to a spare
  host's parked worker at once, which is why a worker failure costs more here;
- ``boot``: one node kill with no spare: a killed host is rebooted as a spare when the job
  needs one (not before), so what it adds beyond a node kill's cost is the boot;
- ``chaos``: ``--chaos`` strikes at random moments, workers and nodes, one spare parked.

The simulator's tierswap accounting (:func:`tierswap.goodput.tierswap`) is then fed these
costs and the chaos run's own failure trace (when each strike came, and its kind) and
asked how long the run takes; the report gives that against the chaos run's measured
wall time. The costs come from the other runs, never from the chaos run itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tierswap.bench.common import run_bounded
from tierswap.examples import job_command
from tierswap.goodput import Failure, Model, tierswap

STEPS = 60
SLEEP = ("--sleep", "0.05")
CHAOS_RATE = 60.0
"""Strikes a minute while training goes on."""


def _events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def training_wall(evs: list[dict[str, Any]]) -> float:
    """Seconds from the first generation's start to the job's end."""
    start = next(e["time"] for e in evs if e["event"] == "generation_started")
    end = next(e["time"] for e in evs if e["event"] == "job_finished")
    return float(end - start)


def strikes(evs: list[dict[str, Any]]) -> list[tuple[float, bool]]:
    """(seconds after the first generation started, a node's) of each injected fault."""
    start = next(e["time"] for e in evs if e["event"] == "generation_started")
    return [(e["time"] - start, "node=" in e["spec"])
            for e in evs if e["event"] == "fault_injected"]  # fmt: skip


def predict(
    nodes: int, steps: int, step_s: float, worker_s: float, node_s: float, boot_s: float,
    trace: list[tuple[float, bool]], spares: int = 1,
) -> float:  # fmt: skip
    """The simulator's wall time for ``steps`` steps through ``trace``. A failure's cost
    there is its recovery plus one step redone, so the measured cost less a step is the
    recovery. A host here is rebooted when the job needs a spare and has none: the
    simulator's node "from the cluster" after ``boot_s``, with no repaired ones."""
    model = Model(
        gpus=nodes, gpus_per_node=1, mtbf_hours=1e9, hours=1e9, step_s=step_s,
        ts_overhead=0.0, ts_stall_s=0.0, ts_swap_s=max(0.0, node_s - step_s),
        ts_worker_s=max(0.0, worker_s - step_s), repair_h=1e12, replace_s=boot_s,
    )  # fmt: skip
    failures = [Failure(t / 3600.0, 0, node) for t, node in trace]
    out = tierswap(model, failures, spares, work_h=steps * step_s / 3600.0)
    assert out.wall_h is not None
    return out.wall_h * 3600.0


def _run(tmp: Path, name: str, nodes: int, spares: int, extra: list[str]) -> list[dict[str, Any]]:
    run_dir = tmp / name
    cmd = job_command(run_dir, ["--nodes", str(nodes), "--spares", str(spares), *extra],
                      ["--steps", str(STEPS), *SLEEP])  # fmt: skip
    code = run_bounded(cmd, tmp / f"{name}.log", tmp, 300, run_dir)
    if code != 0:
        raise RuntimeError(f"{name}: exit code {code}: "
                           f"{(tmp / f'{name}.log').read_text()[-1500:]}")  # fmt: skip
    return _events(run_dir)


def measure(nodes: int, repeats: int, seed: int = 7) -> dict[str, Any]:
    early, late = STEPS // 9, STEPS - STEPS // 9
    runs = {  # name -> (spares, faults)
        "clean": (1, []),
        "workers": (1, ["--inject", f"kill:rank=0:step={early}", "--inject",
                        f"kill:rank={nodes - 1}:step={late}"]),
        "nodes": (2, ["--inject", f"kill:node=1:step={early}", "--inject",
                      f"kill:node=0:step={late}"]),
        "boot": (0, ["--inject", f"kill:node=1:step={early}"]),
    }  # fmt: skip
    walls: dict[str, list[float]] = {k: [] for k in (*runs, "chaos")}
    chaos: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tierswap-goodput-") as tmp_s:
        tmp = Path(tmp_s)
        for r in range(repeats):
            for kind, (spares, faults) in runs.items():
                evs = _run(tmp, f"{kind}-{nodes}-{r}", nodes, spares, faults)
                walls[kind].append(training_wall(evs))
            spec = f"{seed + r}:{CHAOS_RATE:g}:4"
            evs = _run(tmp, f"chaos-{nodes}-{r}", nodes, 1, ["--chaos", spec])
            walls["chaos"].append(training_wall(evs))
            chaos.append({"spec": spec, "wall_s": training_wall(evs), "trace": strikes(evs)})
    med = {k: statistics.median(v) for k, v in walls.items()}
    step_s = med["clean"] / STEPS
    worker_s = (med["workers"] - med["clean"]) / 2
    node_s = (med["nodes"] - med["clean"]) / 2
    boot_s = max(0.0, med["boot"] - med["clean"] - node_s)
    for c in chaos:
        c["predicted_s"] = predict(nodes, STEPS, step_s, worker_s, node_s, boot_s, c["trace"])
        c["error"] = c["predicted_s"] / c["wall_s"] - 1
    return {
        "nodes": nodes, "steps": STEPS, "repeats": repeats, "walls": walls,
        "step_s": step_s, "worker_failure_s": worker_s, "node_failure_s": node_s,
        "boot_s": boot_s, "chaos": chaos,
    }  # fmt: skip


def report(res: list[dict[str, Any]]) -> str:
    lines = [
        "| job | step | a worker failure (a new process) | a node failure (a parked spare "
        "host) | boot | chaos run: strikes (nodes) | measured | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res:
        for c in r["chaos"]:
            hw = sum(1 for _, node in c["trace"] if node)
            lines.append(
                f"| {r['nodes']} nodes | {r['step_s'] * 1e3:.0f} ms | "
                f"{r['worker_failure_s']:.2f} s | {r['node_failure_s']:.2f} s | "
                f"{r['boot_s']:.1f} s | {len(c['trace'])} ({hw}) | {c['wall_s']:.1f} s | "
                f"{c['predicted_s']:.1f} s | {c['error']:+.1%} |"
            )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    sizes = args.nodes or [2, 4]
    seed = 7 if args.seed is None else args.seed
    res = [measure(n, max(1, args.repeats), seed) for n in sizes]
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0

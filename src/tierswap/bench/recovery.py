"""``tierswap bench recovery``: kill to the first step completed after resuming.

tierswap: ``tierswap run --nodes N --spares 1 --inject kill:node=1:step=K`` on the
example GPT; the coordinator's ``resumed`` event gives the time from the kill to the
moment every rank finished its first step again, split into detect / decide / rebuild /
restore / resume, and the steps redone.

Baseline, the same model in the same run, interleaved: ``torchrun --max-restarts 1``
(tierswap/examples/torchrun_gpt.py), which restarts every worker and loads the newest
``torch.distributed.checkpoint``; the time from the kill to the last rank's first step
after the restart.

Then the curve: the job grown to 4 and 8 simulated nodes, and the state grown (wider
models), with the restore part and the failed rank's state size reported side by side.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tierswap.bench.common import run_bounded, stats
from tierswap.config import Config
from tierswap.examples import EXAMPLE, job_command

BASELINE = EXAMPLE.parent / "torchrun_gpt.py"
STEPS, KILL = 14, 8
SLEEP = ("--sleep", "0.05")
"""Steps long enough that replication keeps up on 2 busy cores (both sides sleep)."""


def _run(cmd: list[str], cwd: Path, log: Path, timeout: float) -> tuple[int, str]:
    """Run a job in its own session; on timeout its whole group is killed."""
    return run_bounded(cmd, log, cwd, timeout), log.read_text()[-3000:]


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def tierswap_once(work: Path, name: str, nodes: int, width: int) -> dict[str, Any]:
    run_dir = work / name
    cmd = job_command(
        run_dir,
        ["--nodes", str(nodes), "--spares", "1", "--inject", f"kill:node=1:step={KILL}"],
        ["--steps", str(STEPS), "--width", str(width), *SLEEP],
    )
    code, out = _run(cmd, work, work / f"{name}.log", 600)
    if code != 0:
        raise RuntimeError(f"benchmark job {name} failed:\n{out}")
    (resumed,) = _events(run_dir, "resumed")
    slots = Config().slots  # the job runs with the default
    ring = max(e["bytes"] for e in _events(run_dir, "memory") if e["rank"] == 1)
    return {
        "seconds": resumed["seconds"],
        "phases": resumed["phases"],
        "redone": resumed["redone"],
        "kept": resumed["kept"],
        "rank_state_bytes": ring // slots,
    }


def baseline_once(work: Path, name: str, nodes: int, width: int) -> float:
    """Seconds from the kill to the last rank's first step after torchrun's restart.

    torchrun's restarted attempt sometimes hangs on this machine (its rendezvous after
    a failure); such a try is given up after 120 s, counted, and run again."""
    for attempt in range(3):
        try:
            return _baseline_try(work, f"{name}-{attempt}", nodes, width)
        except RuntimeError as e:
            BASELINE_FAILURES.append(f"{name}-{attempt}: {str(e)[-300:]}")
    raise RuntimeError(f"torchrun baseline {name} failed 3 times: {BASELINE_FAILURES[-1]}")


BASELINE_FAILURES: list[str] = []


def _baseline_try(work: Path, name: str, nodes: int, width: int) -> float:
    folder = work / name
    folder.mkdir()
    times = folder / "times.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nodes}",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        str(BASELINE),
        "--steps",
        str(STEPS),
        "--kill-step",
        str(KILL),
        "--width",
        str(width),
        "--ckpt",
        str(folder / "ckpt"),
        "--times",
        str(times),
        *SLEEP,
    ]
    code, out = _run(cmd, folder, folder / "output.log", 120)
    if code != 0:
        raise RuntimeError(f"torchrun baseline {name} exited with {code}:\n{out}")
    notes = [json.loads(line) for line in times.read_text().splitlines()]
    killed = next(n["killed"] for n in notes if "killed" in n)
    resumed = max(n["resumed"] for n in notes if "resumed" in n)
    return float(resumed - killed)


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "seconds": stats([r["seconds"] for r in runs]),
        "phases": {k: statistics.median(r["phases"][k] for r in runs) for k in runs[0]["phases"]},
        "redone": max(r["redone"] for r in runs),
        "rank_state_bytes": runs[0]["rank_state_bytes"],
    }


def run(repeats: int, nodes_curve: tuple[int, ...], widths: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": STEPS, "kill_step": KILL}
    with tempfile.TemporaryDirectory(prefix="tierswap-bench-recovery-") as tmp:
        work = Path(tmp)
        ours: list[dict[str, Any]] = []
        theirs: list[float] = []
        for i in range(repeats):  # interleaved, order flipped every other round
            order = ("b", "t") if i % 2 else ("t", "b")
            for who in order:
                if who == "t":
                    ours.append(tierswap_once(work, f"t{i}", 2, 128))
                else:
                    theirs.append(baseline_once(work, f"b{i}", 2, 128))
        head = _summary(ours)
        ratios = [b / t["seconds"] for b, t in zip(theirs, ours, strict=True)]
        out["headline"] = {
            "nodes": 2,
            "width": 128,
            "tierswap": head,
            "torchrun": stats(theirs),
            "speedup": stats(ratios),
            "torchrun_tries_given_up": list(BASELINE_FAILURES),
        }
        out["nodes"] = {
            str(n): _summary([tierswap_once(work, f"n{n}-{i}", n, 128) for i in range(repeats)])
            for n in nodes_curve
        }
        out["state"] = {
            str(w): _summary([tierswap_once(work, f"w{w}-{i}", 2, w) for i in range(repeats)])
            for w in widths
        }
    return out


def _row(label: str, s: dict[str, Any]) -> tuple[str, ...]:
    sec = s["seconds"]
    ph = s["phases"]
    return (
        label,
        f"{s['rank_state_bytes'] / 2**20:.1f}",
        f"{sec['median']:.2f} ({sec['min']:.2f}–{sec['max']:.2f})",
        " / ".join(f"{ph[k]:.2f}" for k in ("detect", "decide", "rebuild", "restore", "resume")),
        str(s["redone"]),
    )


def main(args: Any) -> int:
    """``tierswap bench recovery [--repeats N] [--json PATH]``."""
    from rich.console import Console
    from rich.table import Table

    repeats = max(1, args.repeats)
    res = run(repeats, (2, 4, 8), (256, 512))
    table = Table(title="recovery: kill to the first step completed after resuming (s)")
    for col in ("job", "MiB/rank", "tierswap", "detect/decide/rebuild/restore/resume", "redone"):
        table.add_column(col)
    h = res["headline"]
    table.add_row(*_row("2 nodes, width 128", h["tierswap"]))
    tr = h["torchrun"]
    table.add_row(
        "  torchrun --max-restarts + DCP",
        "",
        f"{tr['median']:.2f} ({tr['min']:.2f}–{tr['max']:.2f})",
        f"speedup {h['speedup']['median']:.1f}x (min {h['speedup']['min']:.1f}x); "
        "targets: <= 2 s, >= 5x",
        "",
    )
    for n, s in res["nodes"].items():
        table.add_row(*_row(f"{n} nodes, width 128", s))
    for w, s in res["state"].items():
        table.add_row(*_row(f"2 nodes, width {w}", s))
    Console(width=160).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0

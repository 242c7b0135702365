"""``tierswap bench recovery``: kill to the first step completed after resuming.

tierswap: ``tierswap run --nodes N --spares 1 --inject kill:node=1:step=K`` on the
example GPT; the coordinator's ``resumed`` event gives the time from the kill to the
moment every rank finished its first step again, split into detect / decide / rebuild /
restore / resume, and the steps redone.

Baseline, the same model in the same run, interleaved: ``torchrun --max-restarts 1``
(tierswap/examples/torchrun_gpt.py), which restarts every worker and loads the newest
``torch.distributed.checkpoint``; the time from the kill to the last rank's first step
after the restart.

Then the curves: the job grown to 4 and 8 simulated nodes; and the state grown, on the
reference model (``examples/train_mlp.py``, 384 MiB per rank at its usual size) through a
worker kill with a parked spare worker and a node kill with a spare host, interleaved,
each rank's own account of its way back (``Job.timeline``: re-entering ``train``, plan,
fetch, verify, load, waiting for the others, the first step, its snapshot) beside the
floor of each part on this machine: the bytes over memcpy, xxh3 and loopback TCP speed
measured in the same run (``bench/limits.py``), and the job's own step time.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tierswap.bench import limits
from tierswap.bench.common import run_bounded, state_bytes, stats
from tierswap.examples import EXAMPLE, FOLDER, job_command

MLP = FOLDER / "train_mlp.py"

BASELINE = EXAMPLE.parent / "torchrun_gpt.py"
STEPS, KILL = 14, 8
SLEEP = ("--sleep", "0.05")
"""Steps long enough that replication keeps up on 2 busy cores (both sides sleep)."""


def _run(cmd: list[str], cwd: Path, log: Path, timeout: float) -> tuple[int, str]:
    """Run a job in its own session; on timeout it is killed, all it started too."""
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
    return {
        "seconds": resumed["seconds"],
        "phases": resumed["phases"],
        "redone": resumed["redone"],
        "kept": resumed["kept"],
        "rank_state_bytes": state_bytes(_events(run_dir, "memory"), 1),
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


KILLS = {
    "worker": ("--spare-workers", "1", "--inject", f"kill:rank=1:step={KILL}"),
    "node": ("--spares", "1", "--inject", f"kill:node=1:step={KILL}"),
}
"""A worker killed (a parked spare worker of its node takes its rank, its node's memory
holds its state) and a node killed (a parked spare host takes it, its ranks' state comes
from a peer's memory)."""
BIG_MIB = 768
"""From this size on a rank, the job runs with ``--slots 3 --replicas 0`` and only the
worker kill: 3 hosts x 2 tiers x 3 slots of 1 GiB do not fit in this machine's memory."""
PHASES = ("detect", "decide", "rebuild", "restore", "resume")
SIZES = (5, 75, 384)
"""MiB of state per rank of the size curve (``--size-mib`` picks others)."""
PARTS = ("enter", "plan", "fetch", "verify", "waited", "load", "sync", "step", "snapshot")
"""A rank's own account of its way back, in order (``Job.timeline``)."""


def mlp_once(work: Path, name: str, size_mib: int, kind: str) -> dict[str, Any]:
    """One run of the reference model with one kill; what its events say of the recovery."""
    run_dir = work / name
    extra = ("--slots", "3", "--replicas", "0") if size_mib >= BIG_MIB else ()
    cmd = job_command(
        run_dir,
        ["--nodes", "2", *KILLS[kind], *extra],
        ["--steps", str(STEPS), "--size-mib", str(size_mib)],
        script=MLP,
    )
    code, out = _run(cmd, work, work / f"{name}.log", 900)
    if code != 0:
        raise RuntimeError(f"benchmark job {name} failed:\n{out}")
    return account(run_dir)


def account(run_dir: Path) -> dict[str, Any]:
    """What the events of a finished job of the reference model with one kill say of its
    recovery. ``bench peers`` reads its tierswap recoveries with this too."""
    (resumed,) = _events(run_dir, "resumed")
    restored = _events(run_dir, "restored")[-1]
    tiers = restored["tiers"]
    replaced = set(resumed["replaced"])
    lost = [t for r, t in resumed["ranks"].items() if int(r) in resumed["replaced"]]
    kept = [t for r, t in resumed["ranks"].items() if int(r) not in resumed["replaced"]]
    reports = {e["step"]: e["time"] for e in _events(run_dir, "report")}
    steady = [reports[s + 1] - reports[s] for s in range(2, KILL - 1) if s + 1 in reports]
    return {
        "seconds": resumed["seconds"],
        "phases": resumed["phases"],
        "redone": resumed["redone"],
        "lost": _slowest(lost),
        "kept": _slowest(kept),
        "step_s": statistics.median(steady) if steady else float("nan"),
        "lost_tiers": sorted({tiers[str(r)] for r in resumed["replaced"]}),
        "kept_live": set(restored.get("live", [])) >= {int(r) for r in tiers} - replaced,
        "rank_state_bytes": state_bytes(_events(run_dir, "memory"), 1),
    }


def _slowest(timelines: list[dict[str, float]]) -> dict[str, float]:
    """Per part, the longest any of these ranks took."""
    return {k: max(t.get(k, 0.0) for t in timelines) for k in PARTS} if timelines else {}


def floors(nbytes: int, kind: str, lim: dict[str, Any], step_s: float) -> dict[str, float]:
    """What each part of a rank's way back costs at least here: its bytes over the
    machine's speed for the way they move (a worker's state is mapped from its node's
    memory, a node's comes over one TCP stream), and the job's step for the first step."""
    speed = {k: lim[k]["median"] for k in ("memcpy", "xxh3", "tcp")}
    fetch = 0.0 if kind == "worker" else nbytes / speed["tcp"]
    out = {"fetch": fetch, "verify": nbytes / speed["xxh3"], "load": nbytes / speed["memcpy"]}
    out["restore"] = out["fetch"] + out["verify"] + out["load"]
    out["step"] = step_s
    return out


def size_curve(work: Path, sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """Each size: worker and node kills interleaved (order flipped every round), and the
    machine's limits at that size measured between them."""
    out: dict[str, Any] = {}
    for mib in sizes:
        kinds = ("worker",) if mib >= BIG_MIB else tuple(KILLS)
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for i in range(repeats):
            for kind in kinds[:: -1 if i % 2 else 1]:
                runs[kind].append(mlp_once(work, f"mlp{mib}-{kind}-{i}", mib, kind))
        nbytes = runs[kinds[0]][0]["rank_state_bytes"]
        entry = size_entry(runs, limits.measure(nbytes, max(3, repeats), work))
        if mib >= BIG_MIB:
            entry["node"] = {"skipped": f"{mib} MiB per rank: 3 hosts x 2 tiers x 3 slots "
                             "do not fit in this machine's memory"}  # fmt: skip
        out[str(mib)] = entry
    return out


def size_entry(runs: dict[str, list[dict[str, Any]]], lim: dict[str, Any]) -> dict[str, Any]:
    """One size of the curve: per kill (``runs``: its jobs' :func:`account`) the medians of
    its parts beside their floors at this machine's limits ``lim``, measured at that size
    beside the runs."""
    first = next(iter(runs.values()))
    entry: dict[str, Any] = {"rank_state_bytes": first[0]["rank_state_bytes"], "limits": lim}
    for kind, rs in runs.items():
        summary = _summary(rs)
        for side in ("lost", "kept"):
            summary[side] = {k: statistics.median(r[side][k] for r in rs) for k in PARTS}
        summary["step_s"] = statistics.median(r["step_s"] for r in rs)
        summary["lost_tiers"] = sorted({t for r in rs for t in r["lost_tiers"]})
        # the share of runs whose surviving ranks all took their own state as the step
        # (``live.py``), reading nothing
        summary["kept_live"] = sum(bool(r.get("kept_live")) for r in rs) / len(rs)
        summary["floors"] = floors(entry["rank_state_bytes"], kind, lim, summary["step_s"])
        lost = summary["lost"]
        work_s = lost["fetch"] + lost["verify"] + lost["load"]
        summary["restore_vs_floor"] = work_s / summary["floors"]["restore"]
        entry[kind] = summary
    return entry


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "seconds": stats([r["seconds"] for r in runs]),
        "phases": {k: statistics.median(r["phases"][k] for r in runs) for k in runs[0]["phases"]},
        "redone": max(r["redone"] for r in runs),
        "rank_state_bytes": runs[0]["rank_state_bytes"],
    }


def run(repeats: int, nodes_curve: tuple[int, ...], sizes: tuple[int, ...]) -> dict[str, Any]:
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
        out["sizes"] = size_curve(work, sizes, repeats)
    return out


def _row(label: str, s: dict[str, Any]) -> tuple[str, ...]:
    sec = s["seconds"]
    ph = s["phases"]
    return (
        label,
        f"{s['rank_state_bytes'] / 2**20:.1f}",
        f"{sec['median']:.2f} ({sec['min']:.2f}–{sec['max']:.2f})",
        " / ".join(f"{ph[k]:.2f}" for k in PHASES),
        str(s["redone"]),
    )


def _sizes_table(curve: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="recovery of the reference model by state size (s): the replaced "
                  "rank's own parts beside their floors on this machine")  # fmt: skip
    cols = ("MiB/rank", "kill", "recovery", "detect/decide/rebuild/restore/resume",
            "lost rank: " + "/".join(PARTS), "floor: fetch/verify/load, step",
            "fetch+verify+load / floor")  # fmt: skip
    for col in cols:
        table.add_column(col)
    for mib, entry in curve.items():
        for kind in KILLS:
            s = entry.get(kind, {})
            if "skipped" in s or not s:
                table.add_row(mib, kind, "not run", s.get("skipped", ""), "", "", "")
                continue
            sec, ph, lost, fl = s["seconds"], s["phases"], s["lost"], s["floors"]
            table.add_row(
                f"{entry['rank_state_bytes'] / 2**20:.0f}",
                kind,
                f"{sec['median']:.2f} ({sec['min']:.2f}–{sec['max']:.2f})",
                " / ".join(f"{ph[k]:.2f}" for k in PHASES),
                " / ".join(f"{lost[k]:.2f}" for k in PARTS),
                f"{fl['fetch']:.2f} / {fl['verify']:.2f} / {fl['load']:.2f}, {fl['step']:.2f}",
                f"{s['restore_vs_floor']:.1f}x",
            )
    return table


def main(args: Any) -> int:
    """``tierswap bench recovery [--size-mib N ...] [--repeats N] [--json PATH]``: with
    ``--size-mib`` only the size curve, at those sizes."""
    from rich.console import Console
    from rich.table import Table

    repeats = max(1, args.repeats)
    console = Console(width=200)
    if args.size_mib:
        if min(args.size_mib) < 1:
            raise ValueError(f"--size-mib {args.size_mib}: sizes are MiB per rank, >= 1")
        with tempfile.TemporaryDirectory(prefix="tierswap-bench-recovery-") as tmp:
            res: dict[str, Any] = {"steps": STEPS, "kill_step": KILL}
            res["sizes"] = size_curve(Path(tmp), tuple(args.size_mib), repeats)
        console.print(_sizes_table(res["sizes"]))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        return 0
    res = run(repeats, (2, 4, 8), SIZES)
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
    console.print(table)
    console.print(_sizes_table(res["sizes"]))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0

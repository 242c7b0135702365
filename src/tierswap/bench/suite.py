"""``tierswap bench all [--quick]``: every benchmark in one run, one report; and
``tierswap bench report``, the report again from a run's JSON.

``all`` first reads the machine (cores, memory, torch, the commit) and measures its limits
(memcpy, an xxh3 pass, one loopback TCP stream, a sequential write with fsync; medians of
interleaved repetitions), then runs each benchmark of :data:`PLAN` in a process of its own
with a deadline, its JSON and its output in ``bench/results/<date>-<commit>/``, then the
goodput projection, then writes the report (:mod:`tierswap.bench.writeup`):
``BENCHMARKS.md`` at the checkout's root and PNG plots beside the JSON. A benchmark that
fails or runs past its deadline is reported as such, with its output's tail; the others
still run. ``--quick`` runs the same benchmarks at small sizes and single repetitions:
minutes, a check that everything runs, not figures to quote. The run keeps to a budget
(:data:`RUN_BUDGET_S`, ``--budget-s``) by cutting the rounds of ``bench peers``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tierswap
from tierswap.bench import limits
from tierswap.bench.common import run_bounded
from tierswap.tunables import nt_tunables


@dataclass(frozen=True, slots=True)
class Bench:
    """One benchmark of the run: ``tierswap bench <what> <args> --json <name>.json``."""

    name: str
    """Its results file's stem."""
    what: str
    quick: tuple[str, ...]
    """Its arguments in a ``--quick`` run."""
    full: tuple[str, ...]
    """Its arguments in a full run."""
    minutes: float
    """Its deadline in a full run (a quick run's is a third of it, at least 3 minutes)."""
    typical: float
    """Minutes a full run of it took on a quiet day here (12-05 and 12-06): what a budgeted
    benchmark before it leaves it, at the pace of the run so far."""
    quick_too: bool = True
    """Whether a ``--quick`` run has it (those that cannot be made small are left out)."""


PLAN: tuple[Bench, ...] = (
    Bench("snapshot", "snapshot", ("--size-mib", "16", "--repeats", "1"),
          ("--size-mib", "384", "--repeats", "3"), 10, 1.0),
    Bench("recovery", "recovery", ("--size-mib", "5", "--repeats", "1"),
          ("--size-mib", "5", "75", "1024", "--repeats", "3"), 15, 3.4),
    Bench("peers", "peers", ("--size-mib", "8", "--repeats", "1"),  # 16 before the stream
          ("--size-mib", "384", "--repeats", "3"), 30, 18.0),  # control's 2 jobs a round
    Bench("replication", "replication", ("--size-mib", "16", "--repeats", "1"),
          ("--size-mib", "256", "--repeats", "5"), 6, 0.2),
    Bench("control-plane", "control-plane", ("--nodes", "256", "--repeats", "1"),
          ("--nodes", "256", "2048", "--repeats", "3"), 6, 0.1),
    Bench("memory", "memory", (), (), 6, 1.2, quick_too=False),
    Bench("dcp", "dcp", ("--size-mib", "8", "--repeats", "1"),
          ("--size-mib", "256", "--repeats", "3"), 8, 0.5, quick_too=False),
    Bench("job-replication", "job-replication", ("--repeats", "1"), ("--repeats", "3"), 8,
          1.4, quick_too=False),
    Bench("delta", "delta", ("--repeats", "1"), ("--repeats", "2"), 10, 2.7, quick_too=False),
    Bench("goodput", "goodput", ("--nodes", "2", "--repeats", "1"), ("--nodes", "2", "4",
          "--repeats", "2"), 15, 6.0, quick_too=False),
)  # fmt: skip
"""What ``bench all`` runs, in this order: the headline's first. ``peers`` keeps its place
though its rounds are the ones a budget cuts (:data:`RUN_BUDGET_S`): it gets what is left
less what the benchmarks after it typically take, at the run's pace. (Run last on 12-06,
after the durable-write and chaos benchmarks, it measured the highest step overheads yet,
+76 % pinned with tiers 0+1 against +28 % at most before: a change of conditions that is
not worth having.) ``bench overhead``'s jobs are among ``peers``' rounds, its figures in
``peers.json`` (``overhead``); so are the recovery curve's jobs at the peers' size
(``recovery_curve``), which ``recovery`` leaves out and the report puts in the curve."""

BUDGETED = frozenset({"peers"})
"""Benchmarks that take ``--budget-s``: past their deadline a run of them would lose all
its rounds (``bench peers`` ran 30 minutes and was killed on a slow day, 12-04)."""
RUN_BUDGET_S = (270.0, 38 * 60.0)
"""The seconds a ``--quick`` run and a full run should take, its report included (the
targets are 5 and 40 minutes; the report and its plots take seconds): a budgeted
benchmark gets what is left of it when its turn comes, less the typical minutes of those
after it (:attr:`Bench.typical`) scaled by the run's pace. ``--budget-s`` overrides it."""
PACE_RANGE = (0.8, 2.0)
"""The pace (the benchmarks run so far against their typical minutes) is kept within this:
the whole run took 0.9x to 1.5x its quiet time on the days measured."""
BUDGET_MARGIN_S = 240.0
"""Of a budgeted benchmark's deadline, what is kept for its last round running long and
its summary: a round of ``bench peers`` at 384 MiB took 7 to 10 minutes (12-04; the
`memcpy` control added two jobs of about 15 s each on 12-06, the `stream` control two
more)."""
RUN_MARGIN_S = 60.0
"""Of what is left of the run's budget, what a budgeted benchmark leaves for its summary
and the report: a round past the budget costs minutes of the target, not the results,
so the margin is the deadline's smaller one."""

LIMITS_MIB = (64, 384)
"""The bytes per pass of the machine's limits: a quick run's, a full run's."""

SWEEP_GPUS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000)
"""GPU counts of the goodput projection's curve."""


def checkout() -> Path:
    """The checkout this package runs from, or the working directory for an installed
    wheel (its results then go under ``./bench/results``)."""
    root = Path(tierswap.__file__).resolve().parents[2]
    return root if (root / ".git").exists() else Path.cwd()


def results_root() -> Path:
    return checkout() / "bench" / "results"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", "-C", str(checkout()), *args], capture_output=True,
                             text=True, timeout=30, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def machine() -> dict[str, Any]:
    """What the figures were measured on: cores, memory, software and the commit."""
    import psutil
    import torch
    import xxhash

    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(dirty),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_bytes": psutil.virtual_memory().total,
        "shm_bytes": shutil.disk_usage("/dev/shm").total if Path("/dev/shm").exists() else 0,
        "torch": torch.__version__,
        "xxhash": xxhash.VERSION,  # its xxh3 is every checksum's speed: SIMD by version
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def default_folder(m: dict[str, Any]) -> Path:
    """``bench/results/<date>-<commit>[-dirty]``."""
    day = m["date"][:10]
    name = f"{day}-{m['commit'][:10]}" + ("-dirty" if m["dirty"] else "")
    return results_root() / name


def newest_folder() -> Path:
    """The results folder whose ``index.json`` was written last."""
    found = sorted(results_root().glob("*/index.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(
            f"tierswap bench report: no results under {results_root()}: run `tierswap bench "
            "all` first, or name a folder with --results"
        )
    return found[-1].parent


WORKER_SIDE = frozenset({"snapshot"})
"""Benchmarks whose process does a worker's part (``bench snapshot``'s copy is the
worker's snapshot copy): run with the glibc settings the agent gives its workers
(:func:`tierswap.tunables.nt_tunables`), as their jobs are."""


def run_one(
    bench: Bench, folder: Path, quick: bool, left_s: float = float("inf")
) -> dict[str, Any]:
    """Run one benchmark in a process of its own; what it did, for the index. ``left_s``:
    what is left of the run's budget, the most a budgeted benchmark is given."""
    args = bench.quick if quick else bench.full
    deadline = 60.0 * (max(3.0, bench.minutes / 3) if quick else bench.minutes)
    budget: float | None = None
    if bench.what in BUDGETED:  # it stops between rounds in time, its rounds kept
        hard = max(60.0, deadline - BUDGET_MARGIN_S)  # the rounds that always run, too
        budget = max(60.0, min(hard, left_s - RUN_MARGIN_S))
        args = (*args, "--budget-s", f"{budget:.0f}", "--deadline-s", f"{hard:.0f}")
    cmd = [sys.executable, "-m", "tierswap.cli", "bench", bench.what, *args,
           "--json", str(folder / f"{bench.name}.json")]  # fmt: skip
    log = folder / f"{bench.name}.log"
    print(f"bench all: {bench.name}: {' '.join(cmd[3:])}", flush=True)
    # a benchmark that stands in for a worker runs under what the agent gives workers
    env = nt_tunables(dict(os.environ)) if bench.what in WORKER_SIDE else None
    t0 = time.monotonic()
    code = run_bounded(cmd, log, folder, deadline, env=env)
    seconds = time.monotonic() - t0
    timed_out = code == -9 and seconds >= deadline  # -9 is also a SIGKILL from elsewhere
    status = "ok" if code == 0 else "timed out" if timed_out else f"failed ({code})"
    print(f"bench all: {bench.name}: {status} in {seconds:.0f} s", flush=True)
    done = {"what": bench.what, "args": list(args), "status": status, "seconds": seconds,
            "deadline_s": deadline, "log": log.name}  # fmt: skip
    return done if budget is None else done | {"budget_s": budget}


def project(folder: Path) -> dict[str, Any]:
    """The goodput curve (``tierswap simulate --sweep``), its JSON beside the others."""
    from tierswap import goodput

    t0 = time.monotonic()
    rows = goodput.sweep(goodput.Model(), SWEEP_GPUS, seeds=3)
    (folder / "simulate.json").write_text(json.dumps(rows, indent=1) + "\n")
    return {"what": "simulate", "args": ["--sweep", *map(str, SWEEP_GPUS), "--seeds", "3"],
            "status": "ok", "seconds": time.monotonic() - t0}  # fmt: skip


def run_all(
    folder: Path, quick: bool, only: list[str] | None, budget_s: float | None = None
) -> dict[str, Any]:
    plan = [b for b in PLAN if (b.name in only if only else b.quick_too or not quick)]
    budget = RUN_BUDGET_S[0 if quick else 1] if budget_s is None else budget_s
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    index: dict[str, Any] = {"machine": machine(), "quick": quick, "benches": {},
                             "budget_s": budget, "only": only}  # fmt: skip
    if only is not None and (folder / "index.json").exists():  # a rerun of some: keep the rest
        old = json.loads((folder / "index.json").read_text())
        if bool(old.get("quick")) != quick:
            raise SystemExit(f"tierswap bench all --only into {folder}: that run was "
                             f"{'quick' if old.get('quick') else 'full'}, this one is not; "
                             "use another --results folder")  # fmt: skip
        index["benches"] = old["benches"]
    with tempfile.TemporaryDirectory(prefix="tierswap-bench-limits-") as tmp:
        size = LIMITS_MIB[0 if quick else 1] << 20
        index["limits"] = limits.measure(size, 3 if quick else 5, Path(tmp))
    _write(folder, index)
    for i, bench in enumerate(plan):
        left = (
            budget
            - (time.monotonic() - t0)
            - 60.0 * _pace(plan[:i], index) * sum(b.typical for b in plan[i + 1 :])
        )
        index["benches"][bench.name] = run_one(bench, folder, quick, left)
        _write(folder, index)
    if only is None or "simulate" in only:
        index["benches"]["simulate"] = project(folder)
    index["left_out"] = [b.name for b in PLAN if b.name not in index["benches"]]
    index["wall_s"] = time.monotonic() - t0
    _write(folder, index)
    return index


def _pace(done: list[Bench], index: dict[str, Any]) -> float:
    """How much longer than typical the benchmarks run so far took, those that ended well,
    within :data:`PACE_RANGE`; 1 before any. It overestimates a slow day's remainder (on
    12-06 snapshot and recovery ran at 1.44x, the rest at 1.1x): the peers' two rounds
    that always run bound what that costs them."""
    # not a quick failure; a time-out is the slowest kind of result
    ok = [b for b in done if not index["benches"][b.name]["status"].startswith("failed")]
    typical = 60.0 * sum(b.typical for b in ok)
    if not typical:
        return 1.0
    took = float(sum(index["benches"][b.name]["seconds"] for b in ok))
    return min(max(took / typical, PACE_RANGE[0]), PACE_RANGE[1])


def _write(folder: Path, index: dict[str, Any]) -> None:
    tmp = folder / "index.json.tmp"
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    tmp.replace(folder / "index.json")


def main(args: argparse.Namespace) -> int:
    """``tierswap bench all [--quick] [--results DIR] [--only NAME ...] [--budget-s S]`` and
    ``tierswap bench report [--results DIR]``."""
    from tierswap.bench import writeup

    known = {b.name for b in PLAN} | {"simulate"}
    if args.what == "report":
        folder = Path(args.results) if args.results else newest_folder()
        if not (folder / "index.json").exists():
            raise SystemExit(f"tierswap bench report: {folder} has no index.json: not the "
                             "folder of a `tierswap bench all` run")  # fmt: skip
    else:
        if "overhead" in (args.only or ()):
            raise SystemExit("tierswap bench all --only overhead: its jobs run in bench peers' "
                             "rounds now; use --only peers")  # fmt: skip
        unknown = sorted(set(args.only or ()) - known)
        if unknown:
            raise SystemExit(f"tierswap bench all --only {' '.join(unknown)}: not a benchmark "
                             f"of the run; pick from {', '.join(sorted(known))}")  # fmt: skip
        folder = Path(args.results) if args.results else default_folder(machine())
        budget = getattr(args, "budget_s", None)
        if budget is not None and budget <= 0:
            raise SystemExit(
                f"tierswap bench all --budget-s {budget:g}: the run's seconds "
                "must be more than 0 (the default is 38 minutes, 270 s quick)"
            )
        index = run_all(folder, args.quick, args.only, budget)
        failed = [n for n, b in index["benches"].items() if b["status"] != "ok"]
        if failed:
            print(f"bench all: not ok: {', '.join(failed)} (see their logs in {folder})")
    md = writeup.write(folder, checkout() / "BENCHMARKS.md")
    print(f"bench: report written to {md}, from {folder}")
    full = not json.loads((folder / "index.json").read_text()).get("quick")
    if full and writeup.sync_readme(checkout() / "README.md", folder):
        print("bench: README's headline table rewritten from the same run")
    return 0

"""What every measurement shares: rounds of the methods in turn, warm-up left out, the
stats of what they return, the width of a state of a given size, and running a job with
a deadline."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tierswap.shm import remove_job_segments

WARMUP = 1  # rounds of each measurement run first and left out

Sample = dict[str, float]
Stats = dict[str, Any]


def stats(xs: Sequence[float]) -> Stats:
    """Median, quartiles (q1, q3), min, max and the samples themselves."""
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "min": min(xs),
            "max": max(xs), "samples": list(xs)}  # fmt: skip


def interleave(
    methods: Mapping[str, Callable[[], Sample]],
    repeats: int,
    between: Callable[[], None],
    *,
    alternate: bool = False,
) -> dict[str, dict[str, Stats]]:
    """``WARMUP + repeats`` rounds of the methods in turn (order reversed every other round
    with ``alternate``); the stats of every number they return, warm-up left out."""
    samples: dict[str, list[Sample]] = {name: [] for name in methods}
    for r in range(WARMUP + repeats):
        order = list(methods)[:: -1 if alternate and r % 2 else 1]
        for name in order:
            between()
            sample = methods[name]()
            if r >= WARMUP:
                samples[name].append(sample)
    return {n: {k: stats([s[k] for s in ss]) for k in ss[0]} for n, ss in samples.items()}


def width(size_mib: float, depth: int) -> int:
    """Width of ``depth`` square layers holding ``size_mib`` MiB with AdamW (12 B/param)."""
    return max(8, int(math.sqrt(size_mib * 2**20 / 12 / depth)))


def run_and_report(
    args: Any,
    default_mib: int,
    run: Callable[[int, int], dict[str, Any]],
    report: Callable[[dict[str, Any]], None],
) -> int:
    """Validate ``--size-mib``/``--repeats``, measure, print, and write ``--json``."""
    import json
    from pathlib import Path

    given = args.size_mib
    sizes = [default_mib] if given is None else [given] if isinstance(given, int) else list(given)
    if len(sizes) != 1:
        raise ValueError(f"--size-mib {' '.join(map(str, sizes))}: this bench takes one size")
    size = sizes[0]
    if size < 1 or args.repeats < 1:
        raise ValueError(f"--size-mib {size}, --repeats {args.repeats}: use >= 1 each")
    res = run(size, args.repeats)
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def kill_descendants(pid: int) -> None:
    """SIGKILL every process under ``pid``, each by its id: a launcher's workers in
    sessions of their own, which a kill of its group misses. ``pid`` and all under it are
    stopped first (SIGSTOP), listed again until no new one appears, so that none starts
    another meanwhile (torchrun with ``--max-restarts`` would restart its ranks); ``pid``
    is left stopped for the caller to kill, the others are not waited for, each staying a
    zombie until its parent dies."""
    import psutil

    try:
        top = psutil.Process(pid)
        top.suspend()
    except psutil.Error:
        return
    seen: dict[int, psutil.Process] = {}
    for _ in range(10):  # a few passes settle it: a stopped process starts nothing
        try:
            new = [p for p in top.children(recursive=True) if p.pid not in seen]
        except psutil.Error:
            break
        if not new:
            break
        for each in new:
            seen[each.pid] = each
            with contextlib.suppress(psutil.Error):
                each.suspend()
    for each in seen.values():
        with contextlib.suppress(psutil.Error):
            each.kill()  # psutil checks it is still the process it listed


def _hosts(run_dir: Path | None) -> tuple[list[int], list[str]]:
    """From a tierswap run's events: its hosts' pids and its jobs' ids."""
    hosts: list[int] = []
    jobs: list[str] = []
    events = None if run_dir is None else run_dir / "events.jsonl"
    try:
        lines = [] if events is None else events.read_text(errors="replace").splitlines()
    except OSError:  # none, or unreadable: no hosts to add
        return hosts, jobs
    for line in lines:
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            e = json.loads(line)
            if e.get("event") == "node_joined":
                hosts.append(int(e["pid"]))
            elif e.get("event") == "job_started":
                jobs.append(str(e["job_id"]))
    return hosts, jobs


def run_bounded(
    cmd: list[str],
    log: Path,
    cwd: Path,
    timeout: float,
    run_dir: Path | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run a job in a session of its own (in ``env``, else this process's environment),
    its output to ``log``; its exit code, or -9 past ``timeout``. What is left of the
    launcher's group is killed either way, and past the timeout every process under the
    launcher (by pid: torchrun's ranks run in sessions of their own), every host it started
    (each a session of its own, their ids from ``run_dir``'s events) and the job's shared
    memory removed, so that nothing holds memory or a GPU for the next job."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                start_new_session=True, env=env)  # fmt: skip
        timed_out = False
        try:
            code = proc.wait(max(1.0, timeout))
        except subprocess.TimeoutExpired:
            code, timed_out = -9, True
        hosts: list[int] = []
        jobs: list[str] = []
        try:
            if timed_out:  # (a pid already reaped may be another process's by now)
                kill_descendants(proc.pid)
            if code == -9:
                hosts, jobs = _hosts(run_dir)
        finally:  # the launcher, stopped above, is killed whatever went wrong there
            for pid in [proc.pid, *hosts]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            proc.wait()
    for job in jobs:  # a killed job leaves its tier-0 memory: no agent lived to unlink it
        remove_job_segments(job)
    return code


def ring_slots(event: Mapping[str, Any]) -> int:
    """The slots of the ring a ``memory`` event reports (one segment each): a rank's
    state is the tier-0 ring's bytes over them, whatever ``--slots`` the job picked."""
    if not event.get("slots"):
        raise ValueError(f"a memory event without its ring's slots (older than 12-07): {event}")
    return int(event["slots"])


def state_bytes(events: Sequence[Mapping[str, Any]], rank: int) -> int:
    """``rank``'s state in bytes, off its largest tier-0 ring in a job's events."""
    rings = [e for e in events if e["event"] == "memory" and e["rank"] == rank and not e["tier"]
             and e.get("scope", "rank") == "rank"]  # fmt: skip
    if not rings:
        raise ValueError(f"no tier-0 memory event of rank {rank}")
    ring = max(rings, key=lambda e: int(e["bytes"]))
    return int(ring["bytes"]) // ring_slots(ring)

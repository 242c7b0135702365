"""``tierswap bench overhead``: what a snapshot every step costs the reference model's
training, as a whole job, the plain way and pinned the way a GPU host is built.

Runs of ``tierswap run --nodes 2 --threads 1 examples/train_mlp.py`` (384 MiB of state per
rank by default), interleaved, order flipped every round:

- ``plain``: the same job, trained without ``job.steps`` (no restore, no snapshot): the
  baseline;
- ``tier0``: a snapshot every step into the node's memory (``--replicas 0``);
- ``tier01``: and replicated into the other node's memory (the default).

each unpinned, and pinned: the trainers on their cores and tierswap's own work (agents,
launcher, the workers' copy threads) on a core of its own (``--agent-cpus`` /
``--worker-cpus``; on a 2-core machine both trainers share core 0, the rest core 1, so
its step times are not the unpinned ones: only ratios against the same pinning count).

Per run, from the trainers' own step times (``--times``): the median step (steps 4 to
the second last: the first snapshot allocates its slots), the stall per step (fence,
synchronous part, tier-1 wait), the copy threads' CPU seconds per GiB, and the agents'
CPU seconds per GiB snapshotted in that window, sampled from ``/proc``; beside them the
CPU seconds per GiB of a plain memcpy on this machine (``bench/limits.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tierswap.bench import limits
from tierswap.bench.common import stats
from tierswap.examples import FOLDER, job_command
from tierswap.shm import remove_job_segments

MLP = FOLDER / "train_mlp.py"
MODES = {"plain": ("--replicas", "0"), "tier0": ("--replicas", "0"), "tier01": ()}
FIRST = 4
"""Steps before this one are left out: the first snapshots allocate their slots."""
CLK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float | None:
    """User + system CPU seconds of a process so far, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK


class _Sampler:
    """Samples the CPU time of the job's agents (their pids from the event log)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.samples: dict[int, list[tuple[float, float]]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _pids(self) -> list[int]:
        try:
            lines = (self.run_dir / "events.jsonl").read_text().splitlines()
        except OSError:
            return []
        evs = [json.loads(x) for x in lines if '"node_joined"' in x]
        return [int(e["pid"]) for e in evs]

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            now = time.monotonic()
            for pid in self._pids():
                if (cpu := _cpu(pid)) is not None:
                    self.samples.setdefault(pid, []).append((now, cpu))

    def between(self, t0: float, t1: float) -> float:
        """CPU seconds all agents spent from ``t0`` to ``t1`` (nearest samples)."""
        total = 0.0
        for series in self.samples.values():
            before = [c for t, c in series if t <= t0]
            after = [c for t, c in series if t >= t1]
            if before and after:
                total += after[0] - before[-1]
        return total

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def once(
    work: Path, name: str, mode: str, pinned: bool, size_mib: int, steps: int
) -> dict[str, float]:
    run_dir = work / name
    times = work / f"{name}.times"
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError("bench overhead needs 2 CPUs or more: one for the agents, one for work")
    others = ",".join(map(str, cpus[:-1]))
    pin = ("--agent-cpus", str(cpus[-1]), "--worker-cpus", others)
    script = ["--steps", str(steps), "--size-mib", str(size_mib), "--times", str(times)]
    cmd = job_command(
        run_dir,
        ["--nodes", "2", *MODES[mode], *(pin if pinned else ())],
        [*script, *(["--plain"] if mode == "plain" else [])],
        script=MLP,
    )
    sampler = _Sampler(run_dir)
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=work, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            code = proc.wait()
        finally:
            sampler.close()
    if code != 0:
        tail = (work / f"{name}.log").read_text()[-2000:]
        _free(run_dir)
        raise RuntimeError(f"benchmark job {name} exited with {code}:\n{tail}")
    notes = [json.loads(x) for x in times.read_text().splitlines()]
    ends = {n["step"]: n["t"] for n in notes if n["rank"] == 0}
    window = range(FIRST, steps - 1)
    step_s = [ends[s] - ends[s - 1] for s in window if s in ends and s - 1 in ends]
    stall = [n["stall"] for n in notes if n["step"] in window]
    copy_cpu = [n["copy_cpu"] for n in notes if n["step"] in window]
    t0, t1 = ends[FIRST - 1], ends[steps - 2]
    state = size_mib * 2**20
    snapshotted = 0 if mode == "plain" else 2 * state * (steps - 1 - FIRST)  # both ranks
    agents = sampler.between(t0, t1)
    return {
        "step_s": statistics.median(step_s),
        "stall_s": statistics.median(stall),
        "copy_cpu_s_per_gib": (statistics.median(copy_cpu) / (state / 2**30))
        if mode != "plain"
        else 0.0,
        "agents_cpu_s": agents,
        "agents_sampled": float(len(sampler.samples)),
        "agents_cpu_s_per_gib": agents / (snapshotted / 2**30) if snapshotted else 0.0,
    }


def _free(run_dir: Path) -> None:
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return
    for e in map(json.loads, lines):
        if e["event"] == "job_started":
            remove_job_segments(e["job_id"])


def run(
    size_mib: int,
    repeats: int,
    steps: int = 14,
    modes: tuple[str, ...] = tuple(MODES),
    pinnings: tuple[bool, ...] = (False, True),
) -> dict[str, Any]:
    """Every mode in ``modes`` (``plain`` among them: the baseline) under each pinning,
    interleaved, ``repeats`` times."""
    if unknown := sorted(set(modes) - set(MODES)):
        raise ValueError(f"modes {unknown} are not among {sorted(MODES)}")
    if "plain" not in modes:
        raise ValueError(f"modes {modes} leave out 'plain', the baseline of the others")
    out: dict[str, Any] = {
        "size_mib": size_mib,
        "steps": steps,
        "cpus": len(os.sched_getaffinity(0)),
    }
    with tempfile.TemporaryDirectory(prefix="tierswap-bench-overhead-") as tmp:
        work = Path(tmp)
        runs: dict[str, list[dict[str, Any]]] = {}
        for i in range(repeats):
            for pinned in pinnings:
                order = list(modes)[:: -1 if i % 2 else 1]
                for mode in order:
                    key = f"{mode}{'_pinned' if pinned else ''}"
                    runs.setdefault(key, []).append(
                        once(work, f"{key}-{i}", mode, pinned, size_mib, steps)
                    )
        lim = limits.measure(size_mib * 2**20, 3, work)
    memcpy_cpu = 2**30 / lim["memcpy"]["median"]  # one core: CPU seconds per GiB
    out["memcpy_cpu_s_per_gib"] = memcpy_cpu
    for key, rs in runs.items():
        pinned = key.endswith("_pinned")
        base = runs["plain_pinned" if pinned else "plain"]
        entry = {k: stats([r[k] for r in rs]) for k in rs[0]}
        ratios = [r["step_s"] / b["step_s"] - 1 for r, b in zip(rs, base, strict=True)]
        entry["overhead"] = stats(ratios)
        entry["stall_of_step"] = entry["stall_s"]["median"] / entry["step_s"]["median"]
        entry["agents_vs_memcpy"] = entry["agents_cpu_s_per_gib"]["median"] / memcpy_cpu
        entry["copy_vs_memcpy"] = entry["copy_cpu_s_per_gib"]["median"] / memcpy_cpu
        out[key] = entry
    return out


TARGETS = {"tier0": 0.05, "tier01": 0.10, "tier0_pinned": 0.02, "tier01_pinned": 0.03}
"""Step overhead targets (the "fast at real sizes" issue)."""


def report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"snapshot every step, {res['size_mib']} MiB per rank, 2 ranks: step-time overhead "
        f"against the same job without snapshots ({res['cpus']} CPUs)"
    )
    table = Table(title=title)
    for col in ("run", "step", "overhead (min–max)", "target", "stall / step",
                "copy CPU-s/GiB", "agents CPU-s/GiB", "vs memcpy (agents)"):  # fmt: skip
        table.add_column(col)
    for key in ("plain", "tier0", "tier01", "plain_pinned", "tier0_pinned", "tier01_pinned"):
        if key not in res:
            continue
        e = res[key]
        o = e["overhead"]
        table.add_row(
            key.replace("_", ", "),
            f"{e['step_s']['median'] * 1e3:.0f} ms",
            ""
            if key.startswith("plain")
            else f"{o['median'] * 100:+.1f} % ({o['min'] * 100:+.1f} – {o['max'] * 100:+.1f})",
            f"<= {TARGETS[key] * 100:.0f} %" if key in TARGETS else "",
            f"{e['stall_of_step'] * 100:.2f} %",
            f"{e['copy_cpu_s_per_gib']['median']:.3f}",
            f"{e['agents_cpu_s_per_gib']['median']:.3f}",
            "" if key.startswith("plain") else f"{e['agents_vs_memcpy']:.2f}x",
        )
    Console(width=180).print(table)
    print(f"a plain memcpy here: {res['memcpy_cpu_s_per_gib']:.3f} CPU-s/GiB")


def main(args: Any) -> int:
    from tierswap.bench.common import run_and_report

    return run_and_report(args, 384, lambda size, rep: run(size, rep), report)

"""When the agents' core is busy in one pinned ``bench overhead`` job: each step, from its
end (rank 0's ``--times``) to tier 1's commit of it (the job's events) and on to the next
step's end, how busy that core was (``/proc/stat``, sampled every 10 ms), and how long
rank 0's next optimizer step waited for tier 1; beside it, how busy the trainers' core
(the other CPUs) was over each step (``trainers_busy``). Written for the 12-06 finding that the
pinned tiers 0+1 job waits for tier 1 because that core has more to do per step than the
trainers' forward and backward leave it (docs/measurements.md, "The agents' core per step, pinned").

    .venv/bin/python bench/agent_core_trace.py tier01-pinned [--steps 30] > trace.json

A system's name is ``bench peers``' (``tier01-pinned``, ``stream-pinned``, ...). Where
the core's time goes was read beside it with ``perf record -C <agents' CPU> -F 999 -g --
sleep 8`` started 20 s into a 30-step job, ``perf report --no-children --sort sym``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tierswap.bench import overhead, peerjobs


def trace(system: str, steps: int) -> dict[str, Any]:
    (cpu,) = overhead.agent_cpus()
    others = sorted(set(os.sched_getaffinity(0)) - {cpu})
    with tempfile.TemporaryDirectory(prefix="tierswap-trace-") as tmp:
        folder = Path(tmp)
        cmds = peerjobs.Commands(steps=steps, size_mib=384, python=sys.executable,
                                 scripts=peerjobs.peers_folder())  # fmt: skip
        cmd = cmds.tierswap_cmd(system, folder)
        # wall, monotonic, the agents' core's busy seconds, the trainers' cores'
        samples: list[tuple[float, float, float, float]] = []
        with (folder / "output.log").open("w") as log:
            env = {**os.environ, **peerjobs.same_env()}
            job = subprocess.Popen(cmd, cwd=folder, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            while job.poll() is None:
                now = overhead.cpu_times()  # (busy, steal) per CPU
                trainers = sum(now[c][0] for c in others)
                samples.append((time.time(), time.monotonic(), now[cpu][0], trainers))
                time.sleep(0.01)
        if job.returncode != 0:
            raise RuntimeError(f"{system}: exit {job.returncode}")
        notes = [json.loads(x) for x in (folder / "times.jsonl").read_text().splitlines()]
        path = folder / "run" / "events.jsonl"
        evs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    ends = {n["step"]: n["t"] for n in notes if n["rank"] == 0}
    gates = {n["step"]: n["gate"] for n in notes if n["rank"] == 0}
    to_wall = statistics.median(w - m for w, m, _, _ in samples)  # events carry wall time

    def busy(a: float, b: float, which: int = 2) -> float | None:
        """The share of ``a`` to ``b`` the agents' core (``which`` 3: the trainers'
        cores, per core) was busy."""
        xs = [s for s in samples if a <= s[0] <= b]
        if len(xs) < 2 or xs[-1][1] == xs[0][1]:
            return None
        share = (xs[-1][which] - xs[0][which]) / (xs[-1][1] - xs[0][1])
        return share / len(others) if which == 3 else share

    def commit(tier: int, step: int) -> float | None:
        at = [e["time"] for e in evs if e["event"] == "snapshot_committed"
              and e["tier"] == tier and e["step"] == step]  # fmt: skip
        return at[0] if at else None

    rows = []
    for s in range(overhead.FIRST, steps - 1):
        t, nxt = ends[s] + to_wall, ends[s + 1] + to_wall
        row: dict[str, Any] = {"step": s, "len_s": nxt - t, "next_gate_s": gates.get(s + 1)}
        if (c0 := commit(0, s)) is not None:
            row["tier0_commit_after_s"] = c0 - t
        if (c1 := commit(1, s)) is not None and c1 < nxt:
            row["tier1_commit_after_s"] = c1 - t
            row["busy_until_tier1"], row["busy_after_tier1"] = busy(t, c1), busy(c1, nxt)
        row["busy"] = busy(t, nxt)
        row["trainers_busy"] = busy(t, nxt, 3)
        rows.append(row)
    return {"system": system, "steps": steps, "agents_cpu": cpu, "trainers_cpus": others,
            "sample_s": 0.01, "rows": rows}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("system")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    json.dump(trace(args.system, args.steps), sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

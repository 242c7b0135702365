"""The step overhead of tiers 0+1 with ``--max-redo 1`` (the default, 2 + 2 slots) against
``--max-redo 2`` with a slot more in each ring (``--slots 3 --peer-slots 3``), as the
coordinator's ``tier1_behind`` advice has it, unpinned and pinned; ``bench overhead``'s
jobs (plain and tier01, each with its own plain baseline), each round's two arms back to
back, the order flipped every round, the arm's settings given as TIERSWAP_* variables.

With ``--max-redo 2`` step t's optimizer step waits for tier 1 to commit step t - 2, so
tier 1 has two forward and backward passes for a step instead of one; a node failure then
redoes up to two steps. Each tier01 job's own events say how many steps tier 1 committed
and how many snapshots were skipped, so that a lower overhead bought by replicating fewer
steps shows as such.

``--burn F`` runs, for the whole bench, a process pinned to the agents' core that spins F
of each ~10 ms cycle and sleeps the rest: a core that other work shares (a data loader,
say), so that tier 1 falls behind the next forward and backward as on a slower machine;
the share of the core it got is measured (``burn_cpu_share``).

    .venv/bin/python bench/max_redo_ab.py --rounds 3 [--burn 0.35] \
        > bench/max-redo-ab-$(date +%F).json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from tierswap.bench import overhead

ARMS = {
    "max-redo 1, 2 + 2 slots": {"TIERSWAP_MAX_REDO": "1"},
    "max-redo 2, 3 + 3 slots": {
        "TIERSWAP_MAX_REDO": "2", "TIERSWAP_SLOTS": "3", "TIERSWAP_PEER_SLOTS": "3",
    },
}  # fmt: skip
EVENTS: dict[str, dict[str, int]] = {}
"""Per job sampled (by its folder's name: ``003-tier01-checkpoint``), what its events say
of its snapshots."""


class Counting(overhead.Sampler):
    """``bench overhead``'s sampler, which also counts the job's snapshot events when the
    job is over (its run folder is kept until the whole bench ends)."""

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(kind, e, tb)
        EVENTS[self.run_dir.parent.name] = count(self.run_dir / "events.jsonl")


def count(path: Path) -> dict[str, int]:
    out = {"tier0_committed": 0, "tier1_committed": 0, "skipped": 0, "rejected": 0}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        ev = json.loads(line)
        name = ev.get("event")
        if name == "snapshot_committed" and ev.get("tier") in (0, 1):
            out[f"tier{ev['tier']}_committed"] += 1
        elif name == "snapshot_skipped":
            out["skipped"] += 1
        elif name == "replica_rejected":
            out["rejected"] += 1
    return out


BURN = """
import ctypes, os, signal, sys, time
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with us
os.sched_setaffinity(0, {int(sys.argv[1])})
share, period = float(sys.argv[2]), 0.01
while True:
    start = time.monotonic()
    while time.monotonic() - start < share * period:
        pass
    time.sleep(period * (1 - share))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=384)
    ap.add_argument("--burn", type=float, default=0.0)
    args = ap.parse_args()
    if not 0 <= args.burn < 1:
        ap.error(f"--burn {args.burn}: give the share of the core to take, from 0 up to 1")
    burner = None
    if args.burn:
        (cpu,) = overhead.agent_cpus()
        burner = subprocess.Popen([sys.executable, "-c", BURN, str(cpu), str(args.burn)])
    try:
        return measure(args, burner)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()


def measure(args: argparse.Namespace, burner: subprocess.Popen[bytes] | None) -> int:
    start = time.monotonic()
    burnt = overhead._cpu(burner.pid) if burner is not None else None
    overhead.Sampler = Counting  # type: ignore[misc]
    names = sorted({k for env in ARMS.values() for k in env})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ARMS}
    fields = ("step_s", "stall_s", "gate_s", "overhead", "stall_of_step", "gate_of_step",
              "agent_core_s", "agents_cpu_s_per_gib")  # fmt: skip
    for r in range(args.rounds):
        order = list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]
        for name in order:
            for k in names:
                os.environ.pop(k, None)
            os.environ.update(ARMS[name])
            EVENTS.clear()
            with contextlib.redirect_stdout(sys.stderr):  # its progress; the JSON is ours
                res = overhead.run(args.size_mib, 1, modes=("plain", "tier01"), pinned=True)
            keep = {m: {k: res[m].get(k) for k in fields if k in res[m]}
                    for m in ("tier01", "tier01_pinned")}  # fmt: skip
            keep["events"] = dict(EVENTS)  # every job sampled, plain ones included
            if burner is not None and burner.poll() is not None:
                raise RuntimeError(f"the burner ended (exit {burner.returncode})")
            runs[name].append(keep)
            print(name, r, json.dumps(keep), file=sys.stderr, flush=True)
    for k in names:
        os.environ.pop(k, None)
    out: dict[str, Any] = {"size_mib": args.size_mib, "burn": args.burn, "arms": ARMS}
    if burner is not None and burnt is not None and (now := overhead._cpu(burner.pid)):
        out["burn_cpu_share"] = (now - burnt) / (time.monotonic() - start)
    out["runs"] = runs
    json.dump(out, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

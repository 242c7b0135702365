"""Reading a ``tierswap bench peers`` job's output: its times file (the median step and
stall of a checkpoint job, the seconds a recovery took), the moment tierswap's injected kill
fired, whether its final state is bit for bit the uninterrupted run's, and why it failed.

Functions of the files a job leaves (or of their entries), apart from the rounds that
run the jobs (:mod:`tierswap.bench.peers`), so that each definition can be tested on
entries built by hand.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierswap.bench.peerjobs import FIRST, KILL, STEPS, VICTIM
from tierswap.examples import differing, load_final


def read_notes(folder: Path) -> list[dict[str, Any]]:
    """The entries of the times file in a job's ``folder``, one a step and rank."""
    return [json.loads(x) for x in (folder / "times.jsonl").read_text().splitlines() if x.strip()]


def recovery_seconds(
    notes: Sequence[dict[str, Any]],
    kill_t: float | None = None,
    victim: int = VICTIM,
    kill: int = KILL,
) -> float:
    """Seconds from the kill to the last rank's first step completed after it.

    The kill is the victim's own end of step ``kill`` (its entry, written just before it
    dies); per rank, the first entry after its own step-``kill`` entry, in file order (a
    restarted process appends to the same file). Where the victim's entries died with it
    (a script that buffers its times file), ``kill_t`` gives the moment from elsewhere;
    then per rank the first entry later than it."""
    if kill_t is None:
        own = next((n for n in notes if n["rank"] == victim and n["step"] == kill), None)
        if own is None:
            raise ValueError(f"rank {victim} wrote no step-{kill} entry and no kill time is given")
        kill_t = float(own["t"])
        seen: set[int] = set()
        after: dict[int, float] = {}
        for n in notes:
            rank = int(n["rank"])
            if rank in seen and rank not in after:
                after[rank] = float(n["t"])
            elif n["step"] == kill:
                seen.add(rank)
        ranks = seen
    else:
        after = {}
        for n in notes:
            if float(n["t"]) > kill_t:
                after.setdefault(int(n["rank"]), float(n["t"]))
        ranks = {int(n["rank"]) for n in notes}
    if missing := sorted(ranks - set(after)):
        raise ValueError(f"ranks {missing} completed no step after the kill")
    return max(after.values()) - kill_t


def injected_kill(run_dir: Path) -> float | None:
    """The ``time.monotonic()`` at which tierswap's injected kill fired (its
    ``fault_injected`` event, wall clock, taken to the monotonic clock), or None."""
    events = run_dir / "events.jsonl"
    if not events.exists():
        return None
    offset = time.time() - time.monotonic()
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "fault_injected" and str(e.get("spec", "")).startswith("kill:"):
            return float(e["time"]) - offset
    return None


def same_bits(ref: Path, run: Path) -> tuple[list[str], list[str]]:
    """The model and optimizer tensors that differ between two ``--out`` folders, and
    apart from them the RNG states that do (tierswap's script saves those too)."""
    diff = differing(load_final(ref), load_final(run))
    rng = [d for d in diff if "__rng__" in d]
    return [d for d in diff if "__rng__" not in d], rng


def checkpoint_costs(notes: Sequence[dict[str, Any]], steps: int = STEPS) -> dict[str, float]:
    """The median step (rank 0's step ends) and the median stall per checkpoint (per step
    the longest any rank spent in it), over steps ``FIRST`` to the second last."""
    window = range(FIRST, steps - 1)
    ends = {n["step"]: float(n["t"]) for n in notes if n["rank"] == 0}
    step_s = [ends[s] - ends[s - 1] for s in window if s in ends and s - 1 in ends]
    stall: dict[int, float] = {}
    for n in notes:
        if n["step"] in window:
            stall[n["step"]] = max(stall.get(n["step"], 0.0), float(n["stall"]))
    if not step_s:
        raise ValueError(f"no step ends of rank 0 in steps {FIRST} to {steps - 2}")
    return {"step_s": statistics.median(step_s), "stall_s": statistics.median(stall.values())}


def failure_text(log: str, chars: int = 1500) -> str:
    """What a failed job's output says of why: the error its first Python traceback ends
    with, first, so that a shortened report keeps it; then that traceback where the end of
    the output does not hold it (a launcher's summary of a failed child, after the child's
    own traceback), then the end of the output."""
    tail = log[-chars:]
    first = log.find("Traceback (most recent call last)")
    if first < 0:
        return tail
    end = log.find("\n\n", first)
    block = log[first : end if end > 0 else first + chars][:chars]
    why = _raised(block)
    head = f"{why}\n" if why else ""
    if first >= len(log) - chars:
        return head + tail
    return f"{head}first traceback:\n{block}\n[...]\nend of its output:\n{tail}"


def _raised(block: str) -> str | None:
    """The ``SomeError: message`` line a traceback ends with (a rank's ``[rank0]:``
    prefix, as torchrun writes them, taken off); None where there is none."""
    for line in reversed(block.splitlines()):
        text = re.sub(r"^\[rank\d+\]:\s*", "", line)
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b", text):
            return text
    return None

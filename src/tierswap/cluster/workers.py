"""An agent's worker processes: started parked, given ranks per generation, told to leave,
watched for silence, replaced when they die.

Driven from the agent's event loop (single-threaded), except ``heard``, which reader
threads set as messages arrive. Telling the coordinator is the agent's business.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tierswap.wire import Channel


@dataclass(slots=True)
class Worker:
    """One worker process of this node, by its local index."""

    local: int
    proc: subprocess.Popen[bytes]
    ctl: Channel | None = None
    """Its control connection, once it has attached."""
    rank: int | None = None
    generation: int = -1
    state: str = "starting"
    """starting, parked, assigned (running a generation), leaving, finished."""
    seen: float = field(default_factory=time.monotonic)
    deadline: float = float("inf")
    """When a leaving worker that has not parked yet is killed."""


class Workers:
    def __init__(
        self, script: list[str], env: Mapping[str, str], post: Callable[..., None]
    ) -> None:
        self.script = script
        self.env = dict(env)
        """The environment of every worker (TIERSWAP_* of the job and of this agent)."""
        self.post = post
        self.procs: dict[int, Worker] = {}
        """By local index."""
        self.by_rank: dict[int, Worker] = {}
        """The workers assigned in this generation."""
        self.spent: set[int] = set()
        """Ranks whose worker died in this generation: their replacement waits for the next."""
        self.heard: dict[Channel, float] = {}
        """When each worker connection was last heard from (set by its reader thread)."""
        self.generation = -1
        self.assignment: dict[str, Any] = {}
        self.local_ranks: dict[int, int] = {}
        self.stopping = False
        self.all_attached = False
        """Every worker of the node's start attached once (replacements do not count)."""

    def spawn(self, local: int) -> None:
        """Start a parked worker: it imports the script and waits for a rank."""
        env = dict(self.env, TIERSWAP_LOCAL=str(local))
        proc = subprocess.Popen([sys.executable, *self.script], env=env)
        self.procs[local] = Worker(local, proc)

        def watch() -> None:
            code = proc.wait()
            self.post("exited", local=local, pid=proc.pid, code=code)

        threading.Thread(target=watch, name=f"tierswap-watch-{local}", daemon=True).start()

    def start(self, generation: int, ranks: list[int], assignment: dict[str, Any]) -> None:
        """Hand out this node's ranks for a generation: a survivor keeps its rank; the
        others go to parked workers first (spare workers, ready now), then to workers
        still starting, in local order."""
        self.generation, self.assignment, self.stopping = generation, assignment, False
        self.spent.clear()
        self.by_rank.clear()
        for w in [w for w in self.procs.values() if w.state == "finished"]:
            # It finished an earlier generation and exits (or has); another rank failed
            # before the job ended, so this generation needs a worker for its rank again.
            if w.proc.poll() is None:
                w.proc.kill()  # the watcher's report names the old pid and is ignored
            self.spawn(w.local)
        alive = list(self.procs.values())
        for w in alive:
            if w.rank in ranks and w.state == "parked":
                self.by_rank[w.rank] = w
        rest = [r for r in ranks if r not in self.by_rank]
        free = [w for w in alive if w not in self.by_rank.values()]
        free.sort(key=lambda w: (w.state != "parked", w.local))
        for rank, w in zip(rest, free, strict=False):
            self.by_rank[rank] = w
        self.local_ranks = {r: i for i, r in enumerate(ranks)}
        for rank, w in self.by_rank.items():
            w.rank = rank
            self.assign(w)

    def assign(self, w: Worker) -> None:
        """Send a parked worker its rank of this generation (once it has attached)."""
        if w.state != "parked" or w.ctl is None or w.rank is None:
            return
        if self.by_rank.get(w.rank) is not w or self.stopping or w.rank in self.spent:
            return
        w.state, w.generation = "assigned", self.generation
        fields = dict(self.assignment, generation=self.generation, rank=w.rank)
        send(w.ctl, "assign", local_rank=self.local_ranks[w.rank], **fields)

    def settled(self, generation: int, step: int) -> None:
        """Tier 1 is done with ``step`` (``--max-redo``): tell the assigned workers, and
        the ones assigned later through their assignment."""
        if step <= int(self.assignment.get("settled", -1)):
            return
        self.assignment["settled"] = step
        for w in self.procs.values():
            if w.state == "assigned" and w.generation == generation and w.ctl is not None:
                send(w.ctl, "settled", generation=generation, step=step)

    def attach(self, chan: Channel, local: int, pid: int) -> bool:
        """A worker's control connection is up: it is parked. True when this was the
        last one the node waited for at its start (once: a replacement that attaches
        later does not make the node ready again)."""
        w = self.procs.get(local)
        if w is None or w.proc.pid != pid:
            return False
        w.ctl, w.state, w.seen = chan, "parked", time.monotonic()
        self.assign(w)
        if self.all_attached or any(x.ctl is None for x in self.procs.values()):
            return False
        self.all_attached = True
        return True

    def of(self, chan: Channel) -> Worker | None:
        return next((w for w in self.procs.values() if w.ctl is chan), None)

    def abort(self, deadline: float) -> None:
        """End the generation: every assigned worker is told to leave by ``deadline``."""
        self.stopping = True
        for w in self.procs.values():
            if w.state == "assigned" and w.ctl is not None:
                w.state, w.deadline = "leaving", deadline
                send(w.ctl, "abort", generation=w.generation)

    def leaving(self) -> bool:
        return any(w.state == "leaving" for w in self.procs.values())

    def overdue(self, now: float, lease: float) -> list[tuple[Worker, str]]:
        """Live workers silent past ``lease`` (a hang) or not gone by their deadline."""
        out = []
        for w in self.procs.values():
            if w.ctl is not None:
                w.seen = max(w.seen, self.heard.get(w.ctl, 0.0))
            silent = w.ctl is not None and now - w.seen > lease
            late = w.state == "leaving" and now > w.deadline
            if (silent or late) and w.proc.poll() is None:
                why = f"no heartbeat for {now - w.seen:.1f} s" if silent else "did not leave"
                out.append((w, why))
        return out

    def kill_all(self) -> None:
        for w in self.procs.values():
            if w.proc.poll() is None:
                w.proc.kill()
        for w in self.procs.values():
            w.proc.wait()
        self.procs.clear()
        self.by_rank.clear()


def send(chan: Channel, op: str, **fields: Any) -> None:
    """Tell a worker; one that died meanwhile is noticed by its exit watcher."""
    try:
        chan.send(op, **fields)
    except OSError:
        pass

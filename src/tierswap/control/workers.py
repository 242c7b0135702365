"""An agent's worker processes, as bookkeeping: started parked, given ranks per generation,
told to leave, watched for silence, replaced when they die.

No processes here: :class:`WorkerTable` says what to do (spawn, kill, send), its agent's
shell does it. A worker is named by its local index and an *incarnation* (a fresh one for
each process started in that place), which its attach and its exit carry, so a message of
a process that was replaced can never be taken for its successor's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierswap.control import protocol as p
from tierswap.control.states import WORKER_STATES, Machine, WorkerState


@dataclass(slots=True)
class Worker:
    """One worker process of this node, by its local index."""

    local: int
    incarnation: int
    seen: float
    machine: Machine[WorkerState] = field(init=False)
    ctl: int | None = None
    """Its control connection, once it has attached."""
    pid: int | None = None
    rank: int | None = None
    generation: int = -1
    deadline: float = float("inf")
    """When a leaving worker that has not parked yet is killed."""

    def __post_init__(self) -> None:
        name = f"worker {self.local} (incarnation {self.incarnation})"
        self.machine = Machine(name, WorkerState.STARTING, WORKER_STATES)

    def move(self, to: WorkerState) -> None:
        self.machine.move(to)

    @property
    def state(self) -> WorkerState:
        return self.machine.state


@dataclass(frozen=True, slots=True)
class Spawn:
    local: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class Kill:
    local: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class Tell:
    """A message to a worker's control connection (the envelope's generation ``gen``)."""

    conn: int
    msg: p.Message
    gen: int


WorkerCommand = Spawn | Kill | Tell


class WorkerTable:
    def __init__(self) -> None:
        self.procs: dict[int, Worker] = {}
        """By local index."""
        self.by_rank: dict[int, Worker] = {}
        """The workers assigned in this generation."""
        self.spent: set[int] = set()
        """Ranks whose worker died in this generation: their replacement waits for the next."""
        self.generation = -1
        self.assignment: dict[str, Any] = {}
        self.local_ranks: dict[int, int] = {}
        self.accepting = False
        """Whether ranks are handed out (a generation runs); False from a stop to the next
        start, so a worker that attaches late is not handed the generation that ended."""
        self.all_attached = False
        """Every worker of the node's start attached once (replacements do not count)."""
        self._incarnations = 0
        self.out: list[WorkerCommand] = []
        self.deferred: set[int] = set()
        """Local indexes whose replacement waits: a parked spare worker took the dead one's
        rank, and a new process importing torch (seconds of CPU) would slow the recovery
        down. Started once every rank of the node has stepped again, or at the next start
        if that needs them."""
        self.stepped: set[int] = set()
        """Ranks that completed their first step of this generation."""
        self.reserve_bytes = 0
        self.reserve_slots: tuple[str, ...] = ()
        """What a parked worker faults in and maps ahead for a restore (``p.Reserve``)."""

    def take(self) -> list[WorkerCommand]:
        out, self.out = self.out, []
        return out

    def replace(self, local: int, now: float) -> None:
        """A worker died: a fresh parked one in its place, now, or (while a parked spare
        worker is at hand for its rank) once the recovery is over."""
        spares = [
            w for w in self.procs.values()
            if w.local != local and w.state is WorkerState.PARKED and w.rank is None
        ]  # fmt: skip
        if not spares:
            self.spawn(local, now)
            return
        del self.procs[local]
        self.deferred.add(local)

    def spawn_deferred(self, now: float) -> None:
        for local in sorted(self.deferred):
            self.spawn(local, now)
        self.deferred.clear()

    def first_step(self, rank: int, now: float) -> None:
        """``rank`` completed its first step of the generation; once all have, the held
        back replacements start."""
        self.stepped.add(rank)
        if self.deferred and set(self.by_rank) <= self.stepped:
            self.spawn_deferred(now)

    def spawn(self, local: int, now: float) -> None:
        """Start a parked worker: it imports the script and waits for a rank."""
        self._incarnations += 1
        self.procs[local] = Worker(local, self._incarnations, seen=now)
        self.out.append(Spawn(local, self._incarnations))

    def start(
        self,
        generation: int,
        ranks: list[int],
        assignment: dict[str, Any],
        now: float,
        local_ranks: dict[int, int] | None = None,
    ) -> None:
        """Hand out this node's ranks for a generation: a survivor keeps its rank; the
        others go to parked workers first (spare workers, ready now), then to workers
        still starting, in local order."""
        self.generation, self.assignment, self.accepting = generation, assignment, True
        self.spent.clear()
        self.by_rank.clear()
        self.stepped.clear()
        if self.deferred and len(self.procs) < len(ranks):
            self.spawn_deferred(now)  # the ranks need them (a second failure came first)
        for w in [w for w in self.procs.values() if w.state is WorkerState.FINISHED]:
            # It finished an earlier generation and exits (or has); another rank failed
            # before the job ended, so this generation needs a worker for its rank again.
            self.out.append(Kill(w.local, w.incarnation))
            self.spawn(w.local, now)
        alive = list(self.procs.values())
        for w in alive:
            if w.rank in ranks and w.state is WorkerState.PARKED:
                self.by_rank[w.rank] = w
        rest = [r for r in ranks if r not in self.by_rank]
        free = [w for w in alive if w not in self.by_rank.values()]
        free.sort(key=lambda w: (w.state is not WorkerState.PARKED, w.local))
        for rank, w in zip(rest, free, strict=False):
            self.by_rank[rank] = w
        self.local_ranks = local_ranks or {r: i for i, r in enumerate(ranks)}
        for rank, w in self.by_rank.items():
            w.rank = rank
            self.assign(w)

    def assign(self, w: Worker) -> None:
        """Send a parked worker its rank of this generation (once it has attached)."""
        if w.state is not WorkerState.PARKED or w.ctl is None or w.rank is None:
            return
        if self.by_rank.get(w.rank) is not w or not self.accepting or w.rank in self.spent:
            return
        w.move(WorkerState.ASSIGNED)
        w.generation = self.generation
        msg = p.Assign(rank=w.rank, local_rank=self.local_ranks[w.rank], **self.assignment)
        self.out.append(Tell(w.ctl, msg, self.generation))

    def reserve(self, nbytes: int, slots: tuple[str, ...] = ()) -> None:
        """Parked workers hold ``nbytes`` ready for a restore from now on, and the tier-0
        slots ``slots`` mapped: tell those parked now, and each one as it parks."""
        if (nbytes, slots) == (self.reserve_bytes, self.reserve_slots):
            return
        self.reserve_bytes, self.reserve_slots = nbytes, slots
        for w in self.procs.values():
            self.tell_reserve(w)

    def tell_reserve(self, w: Worker) -> None:
        """A worker that is parked (and stays so) is told what to hold ready."""
        if w.state is WorkerState.PARKED and w.ctl is not None:
            msg = p.Reserve(nbytes=self.reserve_bytes, slots=self.reserve_slots)
            self.out.append(Tell(w.ctl, msg, self.generation))

    def settled(self, step: int) -> None:
        """Tier 1 is done with ``step`` (``--max-redo``): tell the assigned workers, and
        the ones assigned later through their assignment."""
        if step <= int(self.assignment.get("settled", -1)):
            return
        self.assignment["settled"] = step
        for w in self.procs.values():
            if (
                w.state is WorkerState.ASSIGNED
                and w.generation == self.generation
                and w.ctl is not None
            ):
                self.out.append(Tell(w.ctl, p.Settled(step=step), self.generation))

    def attach(self, conn: int, local: int, incarnation: int, pid: int, now: float) -> bool:
        """A worker's control connection is up: it is parked. True when this was the
        last one the node waited for at its start (once: a replacement that attaches
        later does not make the node ready again)."""
        w = self.procs.get(local)
        if w is None or w.incarnation != incarnation or w.state is not WorkerState.STARTING:
            return False
        w.ctl, w.pid, w.seen = conn, pid, now
        w.move(WorkerState.PARKED)
        self.assign(w)
        if self.reserve_bytes:
            self.tell_reserve(w)
        if self.all_attached or any(x.ctl is None for x in self.procs.values()):
            return False
        self.all_attached = True
        return True

    def of(self, conn: int) -> Worker | None:
        return next((w for w in self.procs.values() if w.ctl == conn), None)

    def abort(self, deadline: float) -> None:
        """End the generation: every assigned worker is told to leave by ``deadline``."""
        self.accepting = False
        for w in self.procs.values():
            if w.state is WorkerState.ASSIGNED and w.ctl is not None:
                w.move(WorkerState.LEAVING)
                w.deadline = deadline
                self.out.append(Tell(w.ctl, p.Abort(), w.generation))

    def leaving(self) -> bool:
        return any(w.state is WorkerState.LEAVING for w in self.procs.values())

    def overdue(self, now: float, lease: float) -> list[tuple[Worker, str]]:
        """Live workers silent past ``lease`` (a hang) or not gone by their deadline."""
        out = []
        for w in self.procs.values():
            if w.state is WorkerState.FINISHED:
                continue  # it exits, or has: nothing to beat for
            silent = w.ctl is not None and now - w.seen > lease
            late = w.state is WorkerState.LEAVING and now > w.deadline
            if silent or late:
                why = f"no heartbeat for {now - w.seen:.1f} s" if silent else "did not leave"
                out.append((w, why))
        return out

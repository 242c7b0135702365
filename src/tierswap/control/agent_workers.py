"""An agent's side of its workers: their requests, their exits, and the watch on their
leases (functions of a :class:`~tierswap.control.agent.AgentCore`, whose state they read
and change; no I/O).

A worker attaches, beats and parks at any time; every other request is admitted only
from a worker running in the current generation (``from_worker``), and answered with
``Reply`` where the worker waits for one. The requests drive tier 0: a layout allocates
a rank's ring (``alloc``), a snapshot asks for a slot (``slot``) and says when it is in
(``written``), a restore asks where its state is (``plan``). A worker's exit is a crash,
a failed boot or a finished rank's exit (``exited``); a worker silent past its lease is
killed (``watch``). The table of worker processes itself is ``control/workers.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierswap.control import agent_tiers
from tierswap.control import protocol as p
from tierswap.control.agent_events import Checked, Checksum, FromWorker, Reply
from tierswap.control.states import AgentPhase, WorkerState
from tierswap.control.workers import Kill, Worker
from tierswap.errors import UsageError

if TYPE_CHECKING:
    from tierswap.control.agent import AgentCore

BOOT_RETRIES = 3
"""Replacement workers of one place that may die before they attach, in a row, before the
agent takes the script for broken and the job stops."""


def from_worker(core: AgentCore, event: FromWorker, now: float) -> None:
    """A worker's message: an attach, a beat or a park from any worker; any other request
    only from one running in this generation (a stale call is answered with an error)."""
    msg, conn = event.env.msg, event.conn
    match msg:
        case p.Attach(local=local, incarnation=incarnation, pid=pid):
            core.boot_failures.pop(local, None)
            if core.workers.attach(conn, local, incarnation, pid, event.at):
                pids = sorted(w.pid for w in core.workers.procs.values() if w.pid)
                core.ready = p.Ready(replica=core.replica_address, workers=pids)
                core._tell(core.ready)
            return
        case p.Beat():
            if (w := core.workers.of(conn)) is not None:
                w.seen = max(w.seen, event.at)
            return
        case p.Parked():
            if (w := core.workers.of(conn)) is not None:
                w.seen = max(w.seen, event.at)
                _parked(core, w, msg)
            return
    rank = getattr(msg, "rank", -1)
    w = core.workers.by_rank.get(rank)
    current = core.door.admit(event.env)
    if not current or w is None or w.state not in (WorkerState.ASSIGNED, WorkerState.LEAVING):
        if msg.call:  # from a worker of a stopped generation: its slots were reclaimed
            _reply(core, conn, p.Error(message=f"generation {event.env.gen} has ended"))
        return
    try:
        _request(core, conn, w, msg, now)
    except (ValueError, KeyError, OSError) as e:  # UsageError is a ValueError
        if msg.call:
            _reply(core, conn, p.Error(message=f"{type(e).__name__}: {e}"))
        else:
            core._tell(p.AgentError(rank=rank, request=p.tag_of(msg), error=str(e)))


def _reply(core: AgentCore, conn: int, msg: p.Message) -> None:
    core.out.append(Reply(conn, msg, core.generation))


def _request(core: AgentCore, conn: int, w: Worker, msg: p.Message, now: float) -> None:
    match msg:
        case p.Alloc():
            _alloc(core, conn, msg)
        case p.SlotRequest():
            _slot(core, conn, msg)
        case p.Written():
            _written(core, msg)
        case p.PlanRequest(rank=rank):
            _reply(core, conn, _plan(core, rank))
        case p.Restored(rank=rank):
            core.rings.restored(rank)
            core._tell(msg)
        case p.Initialized():
            core._tell(msg)
        case p.Finished():
            w.move(WorkerState.FINISHED)
            core._tell(msg)
            _reply(core, conn, p.Ack())
            core._maybe_stopped()  # a stop that came first counted on it to leave
        case p.Fatal() | p.Raised() | p.Corrupt() | p.InjectFired():
            core._tell(msg)
            _reply(core, conn, p.Ack())
        case p.Stepped(rank=rank):
            core._tell(msg)
            core.workers.first_step(rank, now)
        case p.Report() | p.Joined() | p.Lagging():
            core._tell(msg)
        case _:
            raise ValueError(f"unexpected request {p.tag_of(msg)!r}")


def _parked(core: AgentCore, w: Worker, msg: p.Parked) -> None:
    if w.state not in (WorkerState.ASSIGNED, WorkerState.LEAVING):
        return  # a worker parks once per generation it was given
    leaving = w.state is WorkerState.LEAVING
    w.move(WorkerState.PARKED)
    if core.workers.reserve_bytes:  # its state is gone: memory for the next restore
        core.workers.tell_reserve(w)
    if not leaving and msg.generation == core.generation:
        # it left on its own: a collective failed under it, or its source is bad
        core._tell(p.Left(rank=msg.rank, reason=msg.reason, why=msg.why))
    core._maybe_stopped()


def _alloc(core: AgentCore, conn: int, msg: p.Alloc) -> None:
    msg.layout.check()
    ring = core.rings[msg.rank]
    try:  # the first slot now, the others on a thread (the first snapshot needs one)
        alloc = ring.allocate(msg.layout, now=1)
    except OSError as e:
        why = f"{e} (slots of {msg.layout.nbytes:,} bytes)"
        raise UsageError(core._no_room(0, msg.rank, why)) from e
    core.holds.lost()  # the layout changed: steps of the old slots are gone
    sizes = [msg.layout.nbytes] * len(alloc.names)
    core._tell(p.Memory(rank=msg.rank, tier=0, nbytes=ring.nbytes(), segments=sizes))
    _reply(core, conn, p.Allocated(alloc=alloc.id, segments=list(alloc.names)))
    reserve(core)


def reserve(core: AgentCore, sizes: tuple[int, ...] = ()) -> None:
    """What parked workers hold ready for a restore: the largest state of this node's
    ranks (or, on a spare host, of the segments a node holds, ``sizes``), and this node's
    tier-0 slots made so far, mapped (told again as slots are made and rings change)."""
    if not core.cfg.warm_spares:
        return
    ranks = [r.alloc.layout.nbytes for _, r in core.rings.items() if r.alloc is not None]
    core.workers.reserve(max((*ranks, *sizes), default=0), _slots(core))


def map_slots(core: AgentCore) -> None:
    """This node's tier-0 slots changed (one was made, a ring went): parked workers map
    the ones there are now, holding what memory they hold."""
    if core.cfg.warm_spares:
        core.workers.reserve(core.workers.reserve_bytes, _slots(core))


def _slots(core: AgentCore) -> tuple[str, ...]:
    """The segment names of this node's tier-0 slots made so far."""
    allocs = [r.alloc for _, r in core.rings.items() if r.alloc is not None]
    return tuple(sorted(s.segment.path.name for a in allocs for s in a.slots))


def _slot(core: AgentCore, conn: int, msg: p.SlotRequest) -> None:
    if core.phase != AgentPhase.SERVING:
        raise ValueError(f"generation {core.generation} is ending: no new snapshots")
    ring = core.rings[msg.rank]
    slot, _ = ring.begin_write(msg.step, msg.alloc)
    filling = slot is None and msg.wait and ring.filling()  # it asks again: no skip
    _reply(core, conn, p.SlotGranted(slot=slot, filling=filling))
    if ring.gave_way is not None:  # that step's snapshot is gone before it committed
        core._tell(p.Skipped(rank=msg.rank, step=ring.gave_way))
    if ring.hold_in_way is not None:
        core.holds.ask_to_let_go(ring.hold_in_way)
    if filling:
        return
    if slot is None and not msg.retry and core.last_skipped.get(msg.rank) != msg.step:
        core.last_skipped[msg.rank] = msg.step
        core._tell(p.Skipped(rank=msg.rank, step=msg.step))


def _written(core: AgentCore, msg: p.Written) -> None:
    ring = core.rings[msg.rank]
    slot = ring.written(msg.slot, msg.step, msg.alloc, msg.tree)
    core.checks += 1
    if msg.checksum:  # hashed by the worker's copy as it wrote: no second read here
        agent_tiers.checked(core, Checked(msg.rank, msg.step, slot, msg.checksum))
    else:
        core.out.append(Checksum(msg.rank, msg.step, slot, ring.layout()))
    if msg.step > core.progress_step or msg.rank == 0:
        core.progress_step = max(core.progress_step, msg.step)
        mine = msg.rank == 0
        gate = msg.gate if mine else None
        core._tell(p.Progress(step=msg.step, stall=msg.stall if mine else None, gate=gate))


def _plan(core: AgentCore, rank: int) -> p.PlanReply:
    plan = core.plans.get(rank, p.RankPlan(step=None))
    if plan.step is None:
        return p.PlanReply(step=None, init=core.init)
    if not isinstance(plan.source, p.FromMemory):
        assert plan.source is not None
        return p.PlanReply(step=plan.step, source=plan.source)
    slot = core.rings.lease_for_restore(rank, plan.step)
    if slot is None:
        raise ValueError(f"rank {rank}: tier 0 no longer holds step {plan.step}")
    source = p.FromSlot(
        segment=slot.segment.path.name,
        layout=core.rings[rank].layout(),
        tree=slot.tree,
        checksum=slot.checksum,
    )
    return p.PlanReply(step=plan.step, source=source)


def exited(core: AgentCore, local: int, incarnation: int, code: int, now: float) -> None:
    """A worker process ended: reported (a crash of a running rank, a spare's worker, a
    finished rank's non-zero exit), and replaced by a fresh parked one; a worker that died
    before it attached is started again a few times before the script counts as broken."""
    w = core.workers.procs.get(local)
    if w is None or w.incarnation != incarnation:
        return
    if w.state is WorkerState.FINISHED:  # its state is saved; a crash at exit is reported
        if code != 0 and w.rank is not None:
            core._tell(p.ExitedAfterFinish(rank=w.rank, code=code))
        return
    if w.state is WorkerState.STARTING:  # it never attached
        failures = core.boot_failures[local] = core.boot_failures.get(local, 0) + 1
        if not core.workers.all_attached or failures > BOOT_RETRIES:
            core._tell(p.StartFailed(local=local, code=code))  # the script itself fails
            return
        # a replacement killed while it imported (the node's first workers did attach):
        # another one, a few times, before this counts as the script failing
        core.workers.spawn(local, now)
        return
    running = w.state in (WorkerState.ASSIGNED, WorkerState.LEAVING)
    if running and w.generation == core.generation and w.rank is not None:
        core.workers.spent.add(w.rank)
        core._tell(p.Exited(rank=w.rank, code=code))
    elif core.node is None or w.rank is None:
        core._tell(p.SpareWorkerExited(local=local, code=code))
    core.workers.replace(local, now)  # a fresh parked worker, for this rank or a spare
    core._maybe_stopped()


def watch(core: AgentCore, now: float) -> None:
    """Kill a worker that is silent past its lease (a hang) or that does not leave its
    generation in time; its exit is then handled as a crash. After a pause of this
    process (ticks far apart) its workers get fresh leases instead."""
    gap, core.last_tick = now - core.last_tick, now
    if gap > core.cfg.lease / 2:
        core._tell(p.Paused(seconds=gap))
        for w in core.workers.procs.values():
            w.seen = max(w.seen, now)
            w.deadline += gap
    for w, why in core.workers.overdue(now, core.cfg.lease):
        core._tell(p.Hung(rank=-1 if w.rank is None else w.rank, pid=w.pid or -1, why=why))
        core.out.append(Kill(w.local, w.incarnation))
        w.deadline = w.seen = float("inf")

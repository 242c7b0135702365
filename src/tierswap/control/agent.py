"""An agent's decisions, as a core with no I/O: its workers, its tier-0 rings, the replicas
it holds for peers, what to replicate and what to persist.

``AgentCore.handle(event, now)`` takes what happened (a message from the coordinator or a
worker, a worker's exit, a checksum computed, a replica sent) and returns what to do
(``control/agent_events.py``). The rings hold shared-memory segments made by an injected
factory, so the simulation runs the same core on plain memory.

Workers start parked (script imported, no rank) and are assigned ranks by the
coordinator's ``Start``; a ``Stop`` ends their generation without ending their processes.
A spare is an agent with parked workers and no node yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierswap.config import Config
from tierswap.control import protocol as p
from tierswap.control.agent_events import (
    AgentEvent,
    AnswerAsk,
    Ask,
    Boot,
    Checked,
    Checksum,
    ConfigureReplication,
    CoordinatorClosed,
    FromCoordinator,
    FromWorker,
    MakeSegment,
    PartWritten,
    Rejoined,
    Replicated,
    ReplicationFailed,
    Reply,
    SegmentMade,
    Shutdown,
    Tick,
    ToCoordinator,
    WarmRefused,
    WarmSegments,
    WorkerExited,
    WritePart,
)
from tierswap.control.holds import Holds
from tierswap.control.replication_queue import ReplicationQueue
from tierswap.control.states import AGENT_PHASES, AgentPhase, Machine, WorkerState
from tierswap.control.workers import Kill, Worker, WorkerTable
from tierswap.errors import UsageError
from tierswap.faults import FaultPlan
from tierswap.shm import SHM_DIR
from tierswap.tiers.durable_deltas import Part
from tierswap.tiers.memory import NodeRings, Slot
from tierswap.tiers.replicas import PeerStore


@dataclass(slots=True)
class PendingParts:
    """This node's parts of one tier-2 step, as they are written."""

    step: int
    ranks: set[int]
    parts: dict[int, Any] = field(default_factory=dict)
    """rank -> its PartInfo, once written."""
    errors: dict[int, str] = field(default_factory=dict)


BOOT_RETRIES = 3
"""Replacement workers of one place that may die before they attach, in a row, before the
agent takes the script for broken and the job stops."""


def _unread(asked: list[int] | None, read: list[int] | None) -> list[int] | None:
    """Of the ranks ``asked`` to read again, those a report made after reading ``read``
    did not cover (None: every rank, when asked for all and not all were read)."""
    if read is None:
        return []
    return None if asked is None else sorted(set(asked) - set(read))


class AgentCore:
    def __init__(
        self,
        host: int,
        cfg: Config,
        *,
        rings: NodeRings,
        peers: PeerStore,
        replica_address: p.Address,
        coord_host: str,
        simulated: bool = False,
        devices: int = 0,
    ) -> None:
        self.host = host
        self.cfg = cfg
        self.coord_host = coord_host
        """Where this host reaches the coordinator (and the store workers meet at)."""
        self.simulated = simulated
        """One of the nodes ``tierswap run --nodes`` simulates on one machine: the job's
        ranks all run on this machine, and a rank's local rank is its rank (modulo the
        machine's ``devices`` GPUs, where it has some: ranks share them)."""
        self.devices = devices
        self.exit_code = 0
        """What this host's agent exits with: the job's outcome (``Exit``), or 1 when the
        coordinator went away."""
        self.coordinator_gone = False
        self.ready: p.Ready | None = None
        """What this host said once its workers were parked (said again on a rejoin)."""
        self.stopped: p.Stopped | None = None
        """Its report of the newest stop (said again to a coordinator that asks again)."""
        self.verify: list[int] | None = None
        """The ranks whose replicas the newest stop has read again before the report."""
        self.replica_address = replica_address
        self.node: int | None = None
        """The job's node this agent serves; None while it is a spare."""
        self.warm = False
        """Segments were made ahead for this host while it was a spare: freed (those not
        taken) once a step it holds as a member is committed in tier 1 (0 without it)."""
        self.door = p.Door()
        self.phase = Machine(f"agent of host {host}", AgentPhase.IDLE, AGENT_PHASES)
        self.rings = rings
        self.peers = peers
        peers.report = self._report
        peers.later = True  # a ring's slots after its first are made off the loop
        self.workers = WorkerTable()
        self.queue = ReplicationQueue()
        self.plans: dict[int, p.RankPlan] = {}
        self.init: p.InitFrom | None = None
        self.ranks: list[int] = []
        self.faults = FaultPlan()
        self.holds = Holds(rings, peers, self._tell, lambda: self.phase == AgentPhase.SERVING)
        self.last_skipped: dict[int, int] = {}
        self.progress_step = -1
        self.checks = 0
        """Checksums in flight: a stop is reported once none is."""
        self.persisting: dict[int, PendingParts] = {}
        self.boot_failures: dict[int, int] = {}
        """local index -> its workers that died before they attached, in a row."""
        self.exiting = False
        self.last_tick = 0.0
        self.out: list[Any] = []

    @property
    def generation(self) -> int:
        return self.door.generation

    # ---------------------------------------------------------------- the door

    def handle(self, event: AgentEvent, now: float) -> list[Any]:
        if self.exiting:
            if isinstance(event, SegmentMade) and event.segment is not None:
                event.segment.unlink()  # made for a ring that is gone with the agent
            return []
        match event:
            case FromWorker():
                self._from_worker(event, now)
            case FromCoordinator(env=env):
                if self.door.admit(env):
                    self._from_coordinator(env, now)
            case Checked():
                self._checked(event)
            case Replicated(rank=rank, step=step, slot=slot, generation=gen, sent=sent):
                self.rings.unlease(slot)
                if sent is not None:
                    stats = p.ReplicaSent(
                        rank=rank, step=step, kind=sent.kind, nbytes=sent.nbytes,
                        full=sent.full, encode_s=sent.encode_s,
                    )  # fmt: skip
                    self._tell(stats)
                self._add(self.queue.done(rank, step, gen, self.rings[rank]))
            case ReplicationFailed(rank=rank, step=step, peer=to, error=error, generation=gen):
                self._tell(p.ReplicateFailed(rank=rank, step=step, peer=to, error=error), gen)
            case PartWritten():
                self._part_written(event)
            case Ask():
                self._ask(event)
            case WorkerExited(local=local, incarnation=incarnation, code=code):
                self._exited(local, incarnation, code, now)
            case Tick():
                self._watch(now)
            case SegmentMade():
                self._segment_made(event)
            case WarmRefused(why=why):  # the spare makes them when it takes a node
                self._tell(p.AgentError(rank=-1, request="warm", error=why))
            case Boot():
                self.last_tick = now
                for local in range(self.cfg.nproc_per_node + self.cfg.spare_workers):
                    self.workers.spawn(local, now)
            case Rejoined():
                for said in (
                    self.ready,
                    self.stopped if self.phase == AgentPhase.STOPPED else None,
                ):
                    if said is not None:
                        self._tell(said)
            case CoordinatorClosed():
                self.coordinator_gone = True
                self.exit_code = 1  # the job did not end: its coordinator is gone
                self._shutdown()
        self._make_wanted()
        self.out.extend(self.workers.take())
        out, self.out = self.out, []
        return out

    def _make_wanted(self) -> None:
        """Slots the rings left to be made off the loop: one command each."""
        for tier, rings in ((0, self.rings.by_rank), (1, self.peers.rings)):
            for rank, ring in rings.items():
                for alloc, index, name, nbytes in ring.take_wanted():
                    self.out.append(MakeSegment(tier, rank, alloc, index, name, nbytes))

    def _segment_made(self, event: SegmentMade) -> None:
        rings = self.rings.by_rank if event.tier == 0 else self.peers.rings
        ring = rings.get(event.rank)
        error = event.error and self._no_room(event.tier, event.rank, event.error)
        # a tier-0 ring short of a slot stops the job (its next snapshot says why); a
        # replica ring goes on with the slots it has, and the loss is reported
        fatal = event.tier == 0
        kept = ring is not None and ring.add(event.alloc, event.index, event.segment, error, fatal)
        if not kept and event.segment is not None:  # its allocation went meanwhile
            event.segment.unlink()
        if error and kept:
            self._tell(p.AgentError(rank=event.rank, request="alloc", error=error))

    def _no_room(self, tier: int, rank: int, error: str) -> str:
        n, what, flag = (
            (self.cfg.tier0_slots, "tier-0 slots", "--slots")
            if tier == 0
            else (self.cfg.peer_slots, "tier-1 replica slots", "--peer-slots")
        )
        return (
            f"node {self.node} cannot allocate its {n} {what} for rank {rank} "
            f"in {SHM_DIR}: {error}. Free or enlarge {SHM_DIR} (a container's --shm-size), "
            f"or use fewer {flag}."
        )

    def _add(self, cmd: Any) -> None:
        if cmd is not None:
            self.out.append(cmd)

    def _tell(self, msg: p.Message, gen: int | None = None) -> None:
        self.out.append(ToCoordinator(msg, self.generation if gen is None else gen))

    def _report(self, msg: p.Message, gen: int) -> None:
        """The replica store's reports to the coordinator."""
        self._tell(msg, gen)

    def _shutdown(self) -> None:
        self.exiting = True
        self.out.append(Shutdown())

    # ---------------------------------------------------------------- coordinator

    def _from_coordinator(self, env: p.Envelope[Any], now: float) -> None:
        match env.msg:
            case p.Start() if env.gen > self.generation or self.phase == AgentPhase.IDLE:
                self._start(env.gen, env.msg, now)
            case p.Start():
                pass  # this generation's start again: it runs already
            case p.Stop() if self.phase == AgentPhase.IDLE:
                # a spare given a node whose generation never started here: it holds
                # nothing of the job, and says so
                nothing = p.Stopped(holdings={}, peer={}, peer_deltas={}, verified=None)
                self._tell(nothing, env.gen)
            case p.Stop(verify=verify) if (
                self.phase == AgentPhase.STOPPED and self.stopped is not None
            ):
                # asked again: by a coordinator that took over, maybe in a generation its
                # predecessor recorded and never started here (answered in the asking one),
                # or after a node was lost since the report, whose ranks' replicas are read
                # now and the report made anew
                unread = _unread(verify, self.verify)
                if unread is None or unread:
                    self.verify = p.ranks_union(self.verify, verify)
                    self.stopped = self._holdings(unread, env.gen)
                self._tell(self.stopped, env.gen)
            case p.Stop(verify=verify) if self.phase in (
                AgentPhase.STOPPING,
                AgentPhase.STOPPED,
            ):
                # a stop again: it is stopping, and reports once it has, reading these too
                self.verify = p.ranks_union(self.verify, verify)
            case p.Stop(verify=verify):
                self.phase.move(AgentPhase.STOPPING)
                self.verify = verify
                self.workers.abort(now + self.cfg.collective_timeout)
                self._maybe_stopped()
            case p.Committed(tier=tier, step=step):
                self._committed(tier, step)
            case p.Release(tier=tier, step=step):
                self.holds.release(tier, step)
            case p.Settled(step=step):
                self.workers.settled(step)
                self.peers.settled(step)
            case p.Persist():
                self._persist(env.msg)
            case p.Warm(segments=sizes) if self.node is None:
                self.warm = bool(sizes)
                self.out.append(WarmSegments(tuple(sizes)))
                self._reserve(tuple(sizes))
            case p.Warm():
                pass  # a member already: it made its own
            case p.Exit(code=code):
                self.exit_code = code
                self._shutdown()
            case p.Welcome():
                pass  # the shell's business, before the core exists

    def _start(self, generation: int, msg: p.Start, now: float) -> None:
        self.door.generation = generation
        self.node, self.ranks, self.plans = msg.node, list(msg.ranks), dict(msg.plans)
        self.init = msg.init
        self.faults = FaultPlan.parse(msg.inject)
        self.last_skipped.clear()  # a restore may replay a step skipped before: report it
        self.progress_step = msg.restart_step
        restart, (memory, replicated) = msg.restart_step, msg.committed
        self.rings.serve(self.ranks, restart, memory, replicated)
        self.peers.generation, self.peers.open = generation, True
        self.peers.discard_after(restart, replicated)
        self.peers.protects = list(msg.protects)
        self.peers.set_parity(msg.parity)
        self.peers.keep_only(self.peers.protects)
        self.peers.corrupt = self.faults.corruptions()
        self.holds.start(memory, replicated, restart)
        self.persisting.clear()
        targets = {r: tuple(t) for r, t in msg.placement.items()}
        self.queue.reset(generation, targets)
        self.out.append(
            ConfigureReplication(
                targets=targets,
                addresses=dict(msg.peers),
                generation=generation,
                restart=restart,
                delay=self.faults.delay_of(self.node),
                announce=self.faults.watches_transfers(),
                world_size=msg.world_size,
            )
        )
        if self.simulated:  # every rank of the job runs on this machine
            local = {r: r % self.devices if self.devices else r for r in self.ranks}
            local_world = msg.world_size
        else:
            local = {r: i for i, r in enumerate(self.ranks)}
            local_world = len(self.ranks)
        assignment = {
            "node": msg.node,
            "local_world_size": local_world,
            "world_size": msg.world_size,
            "store": f"{self.coord_host}:{msg.store.rsplit(':', 1)[1]}",
            "inject": list(msg.inject),
            "backend": msg.backend,
            "max_redo": msg.max_redo,
            "settled": replicated,
        }
        self.phase.move(AgentPhase.SERVING)
        # a step tier 0 holds here above the generation's commit (the restored one, where a
        # new node lacks it) is offered at once: at a job's last step no snapshot comes
        # after it to offer it, and a node holding another step releases it (commits.py)
        self.holds.maybe(0)
        self.workers.start(generation, self.ranks, assignment, now, local)

    def _maybe_stopped(self) -> None:
        """Report what the rings hold once every worker of the stopped generation has
        parked or died and no checksum is in flight (once per stop)."""
        if self.phase != AgentPhase.STOPPING or self.workers.leaving() or self.checks:
            return
        self.rings.let_go()
        self.stopped = self._holdings(self.verify, self.generation)
        self._tell(self.stopped)
        self.peers.open = False  # what it reported stays so until the next start
        self.phase.move(AgentPhase.STOPPED)

    def _holdings(self, verify: list[int] | None, gen: int) -> p.Stopped:
        """What the rings hold, once the replicas of ``verify`` (None: of every rank) were
        read again and the corrupt ones dropped and reported (in generation ``gen``, the
        asking stop's)."""
        for rank, step in self.peers.verify(verify, gen):
            self._tell(p.ReplicaRejected(rank=rank, step=step, why="corrupt in memory"), gen)
        return p.Stopped(
            holdings=self.rings.holdings(),
            peer=self.peers.holdings(),
            peer_deltas=self.peers.kinds(),
            verified=self.verify,
        )

    # ---------------------------------------------------------------- commits

    def _committed(self, tier: int, step: int) -> None:
        if self.warm and tier == (1 if self.cfg.replicas else 0):
            # a spare that took a node holds its rings by now: the rest is not needed
            self.warm = False
            self.out.append(WarmSegments(()))
        if tier == 0:
            self.rings.commit(step)
        else:
            self.peers.committed(step)
            self.rings.peer_committed(step)
            self.workers.settled(step)
        self.holds.committed(tier, step)

    # ---------------------------------------------------------------- workers

    def _from_worker(self, event: FromWorker, now: float) -> None:
        msg, conn = event.env.msg, event.conn
        match msg:
            case p.Attach(local=local, incarnation=incarnation, pid=pid):
                self.boot_failures.pop(local, None)
                if self.workers.attach(conn, local, incarnation, pid, event.at):
                    pids = sorted(w.pid for w in self.workers.procs.values() if w.pid)
                    self.ready = p.Ready(replica=self.replica_address, workers=pids)
                    self._tell(self.ready)
                return
            case p.Beat():
                if (w := self.workers.of(conn)) is not None:
                    w.seen = max(w.seen, event.at)
                return
            case p.Parked():
                if (w := self.workers.of(conn)) is not None:
                    w.seen = max(w.seen, event.at)
                    self._parked(w, msg)
                return
        rank = getattr(msg, "rank", -1)
        w = self.workers.by_rank.get(rank)
        current = self.door.admit(event.env)
        if not current or w is None or w.state not in (WorkerState.ASSIGNED, WorkerState.LEAVING):
            if msg.call:  # from a worker of a stopped generation: its slots were reclaimed
                self._reply(conn, p.Error(message=f"generation {event.env.gen} has ended"))
            return
        try:
            self._request(conn, w, msg, now)
        except (ValueError, KeyError, OSError) as e:  # UsageError is a ValueError
            if msg.call:
                self._reply(conn, p.Error(message=f"{type(e).__name__}: {e}"))
            else:
                self._tell(p.AgentError(rank=rank, request=p.tag_of(msg), error=str(e)))

    def _reply(self, conn: int, msg: p.Message) -> None:
        self.out.append(Reply(conn, msg, self.generation))

    def _request(self, conn: int, w: Worker, msg: p.Message, now: float) -> None:
        match msg:
            case p.Alloc():
                self._alloc(conn, msg)
            case p.SlotRequest():
                self._slot(conn, msg)
            case p.Written():
                self._written(msg)
            case p.PlanRequest(rank=rank):
                self._reply(conn, self._plan(rank))
            case p.Restored(rank=rank):
                self.rings.restored(rank)
                self._tell(msg)
            case p.Initialized():
                self._tell(msg)
            case p.Finished():
                w.move(WorkerState.FINISHED)
                self._tell(msg)
                self._reply(conn, p.Ack())
                self._maybe_stopped()  # a stop that came first counted on it to leave
            case p.Fatal() | p.Corrupt() | p.InjectFired():
                self._tell(msg)
                self._reply(conn, p.Ack())
            case p.Stepped(rank=rank):
                self._tell(msg)
                self.workers.first_step(rank, now)
            case p.Report() | p.Joined() | p.Lagging():
                self._tell(msg)
            case _:
                raise ValueError(f"unexpected request {p.tag_of(msg)!r}")

    def _parked(self, w: Worker, msg: p.Parked) -> None:
        if w.state not in (WorkerState.ASSIGNED, WorkerState.LEAVING):
            return  # a worker parks once per generation it was given
        leaving = w.state is WorkerState.LEAVING
        w.move(WorkerState.PARKED)
        if self.workers.reserve_bytes:  # its state is gone: memory for the next restore
            self.workers.tell_reserve(w)
        if not leaving and msg.generation == self.generation:
            # it left on its own: a collective failed under it, or its source is bad
            self._tell(p.Left(rank=msg.rank, reason=msg.reason, why=msg.why))
        self._maybe_stopped()

    def _alloc(self, conn: int, msg: p.Alloc) -> None:
        msg.layout.check()
        ring = self.rings[msg.rank]
        try:  # the first slot now, the others on a thread (the first snapshot needs one)
            alloc = ring.allocate(msg.layout, now=1)
        except OSError as e:
            why = f"{e} (slots of {msg.layout.nbytes:,} bytes)"
            raise UsageError(self._no_room(0, msg.rank, why)) from e
        self.holds.lost()  # the layout changed: steps of the old slots are gone
        sizes = [msg.layout.nbytes] * len(alloc.names)
        self._tell(p.Memory(rank=msg.rank, tier=0, nbytes=ring.nbytes(), segments=sizes))
        self._reply(conn, p.Allocated(alloc=alloc.id, segments=list(alloc.names)))
        self._reserve()

    def _reserve(self, sizes: tuple[int, ...] = ()) -> None:
        """What parked workers hold ready for a restore: the largest state of this node's
        ranks (or, on a spare host, of the segments a node holds, ``sizes``)."""
        if not self.cfg.warm_spares:
            return
        ranks = [r.alloc.layout.nbytes for _, r in self.rings.items() if r.alloc is not None]
        self.workers.reserve(max((*ranks, *sizes), default=0))

    def _slot(self, conn: int, msg: p.SlotRequest) -> None:
        if self.phase != AgentPhase.SERVING:
            raise ValueError(f"generation {self.generation} is ending: no new snapshots")
        ring = self.rings[msg.rank]
        slot, _ = ring.begin_write(msg.step, msg.alloc)
        filling = slot is None and msg.wait and ring.filling()  # it asks again: no skip
        self._reply(conn, p.SlotGranted(slot=slot, filling=filling))
        if ring.gave_way is not None:  # that step's snapshot is gone before it committed
            self._tell(p.Skipped(rank=msg.rank, step=ring.gave_way))
        if ring.hold_in_way is not None:
            self.holds.ask_to_let_go(ring.hold_in_way)
        if filling:
            return
        if slot is None and not msg.retry and self.last_skipped.get(msg.rank) != msg.step:
            self.last_skipped[msg.rank] = msg.step
            self._tell(p.Skipped(rank=msg.rank, step=msg.step))

    def _written(self, msg: p.Written) -> None:
        ring = self.rings[msg.rank]
        slot = ring.written(msg.slot, msg.step, msg.alloc, msg.tree)
        self.checks += 1
        if msg.checksum:  # hashed by the worker's copy as it wrote: no second read here
            self._checked(Checked(msg.rank, msg.step, slot, msg.checksum))
        else:
            self.out.append(Checksum(msg.rank, msg.step, slot, ring.layout()))
        if msg.step > self.progress_step or msg.rank == 0:
            self.progress_step = max(self.progress_step, msg.step)
            stall = msg.stall if msg.rank == 0 else None
            self._tell(p.Progress(step=msg.step, stall=stall))

    def _plan(self, rank: int) -> p.PlanReply:
        plan = self.plans.get(rank, p.RankPlan(step=None))
        if plan.step is None:
            return p.PlanReply(step=None, init=self.init)
        if not isinstance(plan.source, p.FromMemory):
            assert plan.source is not None
            return p.PlanReply(step=plan.step, source=plan.source)
        slot = self.rings.lease_for_restore(rank, plan.step)
        if slot is None:
            raise ValueError(f"rank {rank}: tier 0 no longer holds step {plan.step}")
        source = p.FromSlot(
            segment=slot.segment.path.name,
            layout=self.rings[rank].layout(),
            tree=slot.tree,
            checksum=slot.checksum,
        )
        return p.PlanReply(step=plan.step, source=source)

    def _tier0_lease(self, rank: int, step: int) -> Slot | None:
        """A tier-0 snapshot read by a peer's worker rebuilding a rank of its parity set;
        given back with ``tier0_unlease``."""
        ring = self.rings.by_rank.get(rank)
        return None if ring is None else ring.lease(step)

    def _exited(self, local: int, incarnation: int, code: int, now: float) -> None:
        w = self.workers.procs.get(local)
        if w is None or w.incarnation != incarnation:
            return
        if w.state is WorkerState.FINISHED:  # its state is saved; a crash at exit is reported
            if code != 0 and w.rank is not None:
                self._tell(p.ExitedAfterFinish(rank=w.rank, code=code))
            return
        if w.state is WorkerState.STARTING:  # it never attached
            failures = self.boot_failures[local] = self.boot_failures.get(local, 0) + 1
            if not self.workers.all_attached or failures > BOOT_RETRIES:
                self._tell(p.StartFailed(local=local, code=code))  # the script itself fails
                return
            # a replacement killed while it imported (the node's first workers did attach):
            # another one, a few times, before this counts as the script failing
            self.workers.spawn(local, now)
            return
        running = w.state in (WorkerState.ASSIGNED, WorkerState.LEAVING)
        if running and w.generation == self.generation and w.rank is not None:
            self.workers.spent.add(w.rank)
            self._tell(p.Exited(rank=w.rank, code=code))
        elif self.node is None or w.rank is None:
            self._tell(p.SpareWorkerExited(local=local, code=code))
        self.workers.replace(local, now)  # a fresh parked worker, for this rank or a spare
        self._maybe_stopped()

    def _watch(self, now: float) -> None:
        """Kill a worker that is silent past its lease (a hang) or that does not leave its
        generation in time; its exit is then handled as a crash. After a pause of this
        process (ticks far apart) its workers get fresh leases instead."""
        gap, self.last_tick = now - self.last_tick, now
        if gap > self.cfg.lease / 2:
            self._tell(p.Paused(seconds=gap))
            for w in self.workers.procs.values():
                w.seen = max(w.seen, now)
                w.deadline += gap
        for w, why in self.workers.overdue(now, self.cfg.lease):
            self._tell(p.Hung(rank=-1 if w.rank is None else w.rank, pid=w.pid or -1, why=why))
            self.out.append(Kill(w.local, w.incarnation))
            w.deadline = w.seen = float("inf")

    # ---------------------------------------------------------------- background results

    def _checked(self, event: Checked) -> None:
        self.checks -= 1
        ring = self.rings[event.rank]
        if event.error is not None:  # the snapshot is not kept: its slot is free again
            ring.abandon(event.slot)
            why = f"checksum of step {event.step}: {event.error}"
            self._tell(p.AgentError(rank=event.rank, request="written", error=why))
            self._maybe_stopped()
            return
        ring.checked(event.slot, event.checksum)
        self._add(self.queue.offer(event.rank, ring))
        self.holds.maybe(0)
        if self.peers.parity:  # a parity complete before its step was in tier 0 here
            self.holds.maybe(1)
        self._maybe_stopped()

    def _persist(self, msg: p.Persist) -> None:
        if msg.token in self.persisting:
            return  # the same request again: its parts are being written
        lost = sorted(r for r, node in msg.replicas.items() if node == self.node)
        pending = PendingParts(msg.step, {*self.ranks, *lost})
        self.persisting[msg.token] = pending
        if self.faults.fails_persist(msg.step):
            pending.errors = {r: "tier-2 write refused (injected)" for r in pending.ranks}
        for rank in [] if pending.errors else sorted(pending.ranks):
            # a lost node's rank is written from the replica this node holds (full only)
            ring = self.peers.rings.get(rank) if rank in lost else self.rings.by_rank.get(rank)
            slot = None if ring is None else ring.lease(msg.step)
            if slot is None or ring is None:
                where = "tier 1 (full replicas)" if rank in lost else "tier 0"
                pending.errors[rank] = f"{where} no longer holds it"
                continue
            part = Part(msg.root, msg.step, rank, msg.world_size, ring.layout(), slot, msg.token)
            self.out.append(WritePart(part, msg.bases, self.faults.persist_delay()))
        self._maybe_parts(msg.token)

    def _part_written(self, event: PartWritten) -> None:
        if not self.rings.unlease(event.slot):  # a lost rank's part, from a replica
            self.peers.unlease(event.rank, event.slot)
        pending = self.persisting.get(event.token)
        if pending is None:
            return  # asked before a restart: not wanted any more
        if event.part is not None:
            pending.parts[event.rank] = event.part
        else:
            pending.errors[event.rank] = event.error or "not written"
        self._maybe_parts(event.token)

    def _maybe_parts(self, token: int) -> None:
        pending = self.persisting[token]
        if len(pending.parts) + len(pending.errors) < len(pending.ranks):
            return
        del self.persisting[token]
        parts = [pending.parts[r] for r in sorted(pending.parts)]
        msg = p.Parts(token=token, step=pending.step, parts=parts, errors=pending.errors)
        self._tell(msg)

    def _ask(self, event: Ask) -> None:
        """A replica-server thread's request, run here where the replica store lives."""
        handlers: dict[str, Any] = {
            "replica_slot": self.peers.slot,
            "replica_received": self.peers.received,
            "replica_written": self.peers.written,
            "replica_lease": self.peers.lease,
            "replica_unlease": self.peers.unlease,
            "replica_base": self.peers.base,
            "replica_delta_written": self.peers.delta_written,
            "parity_slot": self.peers.parity_slot,
            "parity_added": self.peers.parity_added,
            "parity_checked": self.peers.parity_checked,
            "tier0_lease": self._tier0_lease,
            "tier0_unlease": self.rings.unlease,
        }
        if event.op == "replica_served":
            self._tell(p.ReplicaServed(**event.fields))
            self.out.append(AnswerAsk(event.answer, None))
            return
        try:
            value = handlers[event.op](**event.fields)
        except Exception as e:  # handed to the asking thread, which fails its transfer
            self.out.append(AnswerAsk(event.answer, None, e))
            return
        self.out.append(AnswerAsk(event.answer, value))
        self.holds.lost()
        self.holds.maybe(1)

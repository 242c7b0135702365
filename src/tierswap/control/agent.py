"""An agent's decisions, as a core with no I/O: its workers, its tier-0 rings, the replicas
it holds for peers, what to replicate and what to persist.

``AgentCore.handle(event, now)`` takes what happened (a message from the coordinator or a
worker, a worker's exit, a checksum computed, a replica sent) and returns what to do
(``control/agent_events.py``). The rings hold shared-memory segments made by an injected
factory, so the simulation runs the same core on plain memory.

The core keeps the door, the coordinator's messages, the stop and its report, and the
commits; its workers' requests, exits and leases are ``control/agent_workers.py``, and a
snapshot's way on from tier 0 (checksum, replication, the replica server's requests, the
tier-2 parts) is ``control/agent_tiers.py``, each a set of functions of the core.

Workers start parked (script imported, no rank) and are assigned ranks by the
coordinator's ``Start``; a ``Stop`` ends their generation without ending their processes.
A spare is an agent with parked workers and no node yet.
"""

from __future__ import annotations

from typing import Any

from tierswap.config import Config
from tierswap.control import agent_tiers, agent_workers
from tierswap.control import protocol as p
from tierswap.control.agent_events import (
    AgentEvent,
    Ask,
    Boot,
    Checked,
    ConfigureReplication,
    CoordinatorClosed,
    FromCoordinator,
    FromWorker,
    MakeSegment,
    PartWritten,
    Rejoined,
    Replicated,
    ReplicationFailed,
    SegmentMade,
    Shutdown,
    Tick,
    ToCoordinator,
    WarmRefused,
    WarmSegments,
    WorkerExited,
)
from tierswap.control.agent_tiers import PendingParts
from tierswap.control.holds import Holds
from tierswap.control.replication_queue import ReplicationQueue
from tierswap.control.states import AGENT_PHASES, AgentPhase, Machine
from tierswap.control.workers import WorkerTable
from tierswap.faults import FaultPlan
from tierswap.shm import SHM_DIR
from tierswap.tiers.memory import NodeRings
from tierswap.tiers.replicas import PeerStore


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
                agent_workers.from_worker(self, event, now)
            case FromCoordinator(env=env):
                if self.door.admit(env):
                    self._from_coordinator(env, now)
            case Checked():
                agent_tiers.checked(self, event)
            case Replicated():
                agent_tiers.replicated(self, event)
            case ReplicationFailed(peer=to, generation=gen) as f:
                msg = p.ReplicateFailed(rank=f.rank, step=f.step, peer=to, error=f.error, cut=f.cut)
                self._tell(msg, gen)
            case PartWritten():
                agent_tiers.part_written(self, event)
            case Ask():
                agent_tiers.ask(self, event)
            case WorkerExited(local=local, incarnation=incarnation, code=code):
                agent_workers.exited(self, local, incarnation, code, now)
            case Tick():
                agent_workers.watch(self, now)
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
        if kept and event.tier == 0:  # parked workers map it ahead
            agent_workers.map_slots(self)
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
                agent_tiers.persist(self, env.msg)
            case p.Warm(segments=sizes) if self.node is None:
                self.warm = bool(sizes)
                self.out.append(WarmSegments(tuple(sizes)))
                agent_workers.reserve(self, tuple(sizes))
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
        agent_workers.map_slots(self)  # rings of ranks no longer served went
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

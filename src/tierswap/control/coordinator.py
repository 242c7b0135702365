"""The coordinator's decisions, as a core with no I/O: membership, generations, commits,
recovery.

``CoordinatorCore.handle(event, now)`` takes what happened (a message from an agent, a
connection closed, time passing) and returns what to do (messages to send, hosts to start
or fence, lines for the event log). Its shell (``cluster/coordinator.py``) does the I/O;
the simulation (``control/sim.py``) and the tests drive the same core with generated
events. Tier 2 is reached through the small ``Tier2`` interface (``control/ports.py``).

A *node* is a place in the job (node i runs ranks i*P .. i*P+P-1, and placement is in
nodes); a *host* is an agent process that serves a node, or waits parked as a spare. When
a host fails, a spare host takes its node, and the survivors keep their processes.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from tierswap.config import Config
from tierswap.control import (
    draining,
    failures,
    generation,
    membership,
    progress,
    resize,
    settling,
    takeover,
)
from tierswap.control import protocol as p
from tierswap.control.commands import (
    AgentClosed,
    AgentMessage,
    Begin,
    Broadcast,
    CoordinatorEvent,
    Drain,
    DurableLost,
    End,
    HostExited,
    JobStopped,
    Out,
    Send,
    TakeOver,
    Tick,
)
from tierswap.control.commits import TierCommits
from tierswap.control.hosts import Hosts
from tierswap.control.persistence import Persistence
from tierswap.control.ports import Tier2
from tierswap.control.recovery import RecoveryClock
from tierswap.control.restore import Reports
from tierswap.control.states import PHASES, Machine, Phase
from tierswap.control.traffic import Traffic
from tierswap.control.warm import SpareMemory
from tierswap.faults import Chaos, FaultPlan
from tierswap.plan import Plan, Tier
from tierswap.tiers import parity, peer


def _fields(msg: p.Message, *names: str) -> dict[str, Any]:
    return {n: getattr(msg, n) for n in names}


class CoordinatorCore:
    def __init__(
        self,
        cfg: Config,
        *,
        job_id: str,
        script: list[str],
        address: p.Address,
        store: str,
        tier2: Tier2 | None,
        now: float,
        multihost: bool = False,
        rdzv_id: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.multihost = multihost
        """A multi-host launch (``--rdzv-endpoint``): hosts come by themselves, one per
        machine; none is simulated, started or revived here."""
        self.rdzv_id = rdzv_id
        self.job_id = job_id
        self.script = script
        self.address = address
        """Where agents reach this coordinator."""
        self.join_hint = f"tierswap run --join {address[0]}:{address[1]}"
        """The command that adds a host to the job, as the console says it (the launcher
        adds how the host finds the job's key: :func:`tierswap.cluster.coordinator.join_hint`)."""
        self.store = store
        """host:port of the store workers rendezvous on (``store.py``)."""
        self.out = Out()
        self.door = p.Door()
        self.hosts = Hosts(cfg.nodes, cfg.spares)
        self.local: set[int] = set()
        """Hosts this launcher started (simulated ones, which it can start again)."""
        self.booting: set[int] = set()
        """Revived hosts started and not ready yet."""
        self.to_revive = 0
        """Simulated hosts lost and to be started again as spares, as rebooted machines
        would come back: when the job needs one (a vacant node and no spare parked), not
        earlier, so that booting (seconds of imports) never competes with training and
        replication for this machine's cores."""
        self.waiting_since: float | None = None
        self.boot_failures = 0
        """Hosts started in place of lost ones that exited before they joined."""
        self.clock = RecoveryClock(cfg.world_size)
        self.faults = FaultPlan(cfg.inject)
        self.now = now
        """The time of the event being handled."""
        self.chaos = None if cfg.chaos is None else Chaos.parse(cfg.chaos)
        self.chaos_rng = random.Random(None if self.chaos is None else self.chaos.seed)
        self.chaos_kills = 0
        self.chaos_step = -1
        """The newest step when chaos last struck: it waits for training to go on."""
        self.chaos_generation = -1
        """The generation the last strike hit: once it ended, the strike was found."""
        self.phase = Machine("coordinator", Phase.STARTING, PHASES)
        self.generation = -1
        self.restarts = 0
        self.draining: Drain | None = None
        """The signal that stops the job, once one came (``control/draining.py``)."""
        self.drain_step = -1
        self.drain_deadline = float("inf")
        self.drained = False
        self.raised: dict[int, tuple[int, str]] = {}
        """rank -> the step after which its ``train(job)`` last raised, and the error."""
        self.nodes = cfg.nodes
        """Nodes of the job now: ``cfg.nodes``, fewer while shrunk (``--on-no-spare
        shrink``)."""
        self.replicas = 0
        self.targets: dict[int, tuple[int, ...]] = {}
        self.protects: dict[int, list[int]] = {}
        """node -> the ranks whose replicas it holds (with ``--peer-parity``, the keys of
        the parities it holds)."""
        self.protectors: frozenset[int] = frozenset()
        """Nodes that hold replicas of some rank: the voters of tier 1."""
        self.parity: parity.Placement | None = None
        """``--peer-parity``: where every rank's stripes go, which parities each node holds."""
        self.reports = Reports(cfg.world_size, tier2)
        self._place()
        self.shrink_refused = False
        """A shrink was refused and said so (once, until one is done)."""
        self.salvage: int | None = None
        """The step being written to tier 2 before the job shrinks."""
        self.salvage_tried = False
        """Whether this failure's shrink tried that already."""
        self.resharded_from: int | None = None
        """The tier-2 step this generation started from, resharded (no tier holds a step
        of this size): what it has trained when it trains no step past it."""
        self.resized: tuple[int, int] | None = None
        """The job was just resized: the tier-2 step (step, world size) the next
        generation starts from."""
        self.grow_after: int | None = None
        """Shrunk, with hosts parked to grow back: the newest step tier 0 had committed when
        they came; a tier-2 step that new is where the job grows from."""
        self.tiers = {0: TierCommits(0), 1: TierCommits(1)}
        self.settled = -1
        """The newest step tier 1 committed or gave up on in this generation."""
        self.doubted: dict[tuple[int, int], float] = {}
        """(generation, step) -> when tier 1 gives the step up (``settling.doubt``)."""
        self.ever_committed = False
        self.ever_protected = False
        """A step was ever committed in a tier that outlives a node (tier 1 or 2): before
        that a loss that leaves no step to restore starts the job over, as a new job."""
        self.plan: Plan | None = None
        self.restored: dict[int, p.Restored] = {}
        self.initialized: dict[int, p.Initialized] = {}
        self.reshard: tuple[int, int] | None = None
        """(step, world size): tier 2's newest step written by this job at another world
        size (set by the shell from ``check_durable``). Steps of this size up to it are
        superseded; a generation with no newer step of its own starts from it, resharded."""
        self.finished: set[int] = set()
        self.stopping: set[int] = set()
        self.verify: list[int] | None = []
        """The ranks whose replicas this recovery's stops asked the nodes to read again
        before they report (None: every rank's)."""
        self.tier2 = tier2
        self.traffic = Traffic()
        """Delta mode: what replication sent, logged as ``replica_traffic`` at the end."""
        self.spare_memory = SpareMemory()
        """The segments a node's rings take, as agents reported them: what spares make."""
        self.persister = Persistence(cfg, tier2, self.out, self._broadcast_persist)
        self.last_step = -1
        self.last_loss: float | None = None
        self.tier1_lag = progress.Tier1Lag()
        """Whether training keeps waiting for tier 1, said once while it does."""
        self.total: int | None = None
        self.totals: dict[tuple[int, int], dict[int, int]] = {}
        """(generation, step before the first) -> rank -> its ``job.steps`` total."""
        self.deadline = now + cfg.startup_timeout
        self.last_tick = now
        """When time was last looked at: a long gap is a pause of this process."""
        self.expected: set[int] | None = None
        """Taking over from another coordinator: the hosts it had, not reconnected yet."""
        self.old_host: int | None = None
        self.takeover_deadline = 0.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.cfg.nproc_per_node

    def _place(self) -> None:
        """Where each rank's replicas go, for the job's size now."""
        self.replicas = min(self.cfg.replicas, self.nodes - 1)
        self.parity = None
        if self.cfg.parity_group and self.replicas:
            self.parity = parity.placement(
                self.nodes, self.cfg.nproc_per_node, self.cfg.parity_group
            )
            self.targets = dict(self.parity.targets)
            self.protects = {n: sorted(held) for n, held in self.parity.holds.items()}
        else:
            self.targets = peer.placement(self.nodes, self.cfg.nproc_per_node, self.replicas)
            self.protects = {}
            for rank, nodes in sorted(self.targets.items()):
                for n in nodes:
                    self.protects.setdefault(n, []).append(rank)
        self.protectors = frozenset(self.protects)
        self.reports.parity = self.parity

    # ---------------------------------------------------------------- the door

    def handle(self, event: CoordinatorEvent, now: float) -> list[Any]:
        """What to do about ``event``; the commands in order."""
        if self.phase.state in (Phase.DONE, Phase.FAILED):
            return []
        self.now = now
        try:
            match event:
                case AgentMessage():
                    self._message(event, now)
                case AgentClosed(conn=conn):
                    if (host := self.hosts.host_of(conn)) is not None:
                        failures.host_lost(self, host, "agent connection lost", now)
                case Tick(heard=heard):
                    self._tick(now, heard)
                case HostExited(host=host, code=code):
                    failures.host_exited(self, host, code, now)
                case DurableLost(why=why):
                    self.persister.lost(why)
                    draining.written(self, None)
                    if self.salvage is not None:
                        resize.salvaged(self, None, now)
                case Begin():
                    membership.begin(self, event, now)
                case Drain():
                    draining.drain(self, event, now)
                case TakeOver(record=record, old_host=old_host, ignored=ignored):
                    takeover.adopt(self, record, old_host, now, ignored)
        except JobStopped as e:
            self.phase.move(Phase.FAILED)
            self.out.log("job_failed", reason=str(e))
            self.out.say(f"job stopped: {e}")
            self.out.add(End(1, str(e)))
        return self.out.take()

    @property
    def done(self) -> bool:
        return self.phase.state in (Phase.DONE, Phase.FAILED)

    def _message(self, event: AgentMessage, now: float) -> None:
        msg = event.env.msg
        host = self.hosts.host_of(event.conn)
        if host is None:
            if isinstance(msg, p.Hello):
                membership.hello(self, event.conn, msg, now)
            return  # a host already declared lost (fenced): what it says no longer counts
        if self.expected is not None and not isinstance(msg, p.Ready):
            return  # taking over: what hosts say of the old leader's generation waits
        self.hosts.heard[host] = max(self.hosts.heard.get(host, event.at), event.at)
        if not self.door.admit(event.env):
            return
        node = self.hosts.node_of(host)
        match msg:
            case p.Beat():
                pass
            case p.Ready():
                membership.ready(self, host, msg, now)
            case p.Held(tier=tier, step=step) if node is not None:
                settling.held(self, node, tier, step)
            case p.Unheld(tier=tier, step=step) if node is not None and tier in self.tiers:
                self.tiers[tier].dropped(node, step)
                if tier == 1 and self.parity is not None and step > self.tiers[1].committed:
                    # a parity node asks to let a hold go (its tier 0 needs the slot): it
                    # will never hold that step again, and gets its answer
                    settling.never(self, step, tiers=(1,))
                    self._send_node(node, p.Release(tier=1, step=step))
            case p.Progress() if node is not None:
                progress.progress(self, msg, now, event.at)
            case p.Skipped(rank=rank, step=step):
                self.out.log("snapshot_skipped", node=node, rank=rank, step=step)
                settling.never(self, step, tiers=(0, 1))
            case p.ReplicaRejected(rank=rank, step=step, why=why):
                self.out.log("replica_rejected", node=node, rank=rank, step=step, why=why)
                if why.endswith(p.CUT_OFF):
                    settling.doubt(self, step, now)
                else:
                    settling.never(self, step, tiers=(1,))
            case p.ReplicateFailed(rank=rank, step=step, peer=to, error=error, cut=cut):
                self.out.log(
                    "replicate_failed",
                    node=node,
                    rank=rank,
                    step=step,
                    peer=to,
                    error=error,
                    cut=cut,
                )
                if to is None:  # a base to tier 2: nothing tier 1 waits for
                    pass
                elif cut:
                    settling.doubt(self, step, now)
                else:
                    settling.never(self, step, tiers=(1,))
            case p.Stopped() if node is not None:
                failures.stopped(self, node, msg, now)
            case p.Parts(token=token, step=step, parts=parts, errors=errors):
                # a node to kill once its parts are written (only one this launcher runs)
                if host in self.local and (due := self.faults.at_parts(node, step)):
                    progress.inject_nodes(self, due, now)  # the parts are written; no COMMIT comes
                    return
                self._parts(token, parts, errors)
            case p.Exited(rank=rank, code=code):
                if not (code == 0 and rank in self.finished) and self.phase == Phase.RUNNING:
                    failures.failure(self, "worker", node, [rank], f"exit code {code}", now)
            case p.Left(rank=rank, reason=reason, why=why):
                if self.phase == Phase.RUNNING:
                    failures.failure(self, reason, node, [rank], why, now)
            case p.Hung(rank=rank, pid=pid, why=why):
                self.out.log("worker_hung", node=node, rank=rank, pid=pid, why=why)
                self.out.say(f"rank {rank} (pid {pid}) killed: {why}")
            case p.StartFailed(code=code):
                failures.start_failed(self, host, code, now)
            case p.SpareWorkerExited(code=code):
                self.out.log("spare_worker_exited", host=host, code=code)
            case p.Paused(seconds=seconds):
                self.out.log("agent_paused", node=node, host=host, seconds=seconds)
            case p.ExitedAfterFinish(rank=rank, code=code):
                self.out.log("worker_exited_after_finish", node=node, rank=rank, code=code)
            case p.PeerMemoryExceeded():
                self._peer_memory_exceeded(node, msg)
            case p.Replicating(step=step, peer=to):
                progress.inject_nodes(self, self.faults.at_transfer(node, to, step), now)
            case p.ReplicaSent():
                self.traffic.add(msg.kind, msg.nbytes, msg.full, msg.encode_s)
            case p.ReplicaServed():
                self.out.log(
                    "replica_served", node=node, **_fields(msg, "rank", "step", "kind", "base_step")
                )
            case p.ReplicaBaseLost():
                self.out.log("replica_base_lost", node=node, **_fields(msg, "rank", "step", "kept"))
            case p.AgentError():
                self.out.log("agent_error", node=node, **_fields(msg, "rank", "request", "error"))
            case p.Memory(rank=rank, tier=tier, nbytes=nbytes, scope=scope, segments=segs):
                extra: dict[str, Any] = {} if scope == "rank" else {"scope": scope}
                if segs:  # a ring, a segment per slot: what a bench reads a state's size off
                    extra["slots"] = len(segs)
                self.out.log("memory", node=node, rank=rank, tier=tier, bytes=nbytes, **extra)
                if segs and node is not None and self.spare_memory.noted(node, tier, rank, segs):
                    membership.warm_spares(self)
            case p.Lagging(rank=rank, step=step, seconds=seconds):
                self.out.log("tier1_wait_timeout", node=node, rank=rank, step=step, seconds=seconds)
            case p.Restored() if self.phase == Phase.RUNNING:
                self._restored(msg, now)
            case p.Initialized() if self.phase == Phase.RUNNING:
                generation.initialized(self, msg)
            case p.Joined(rank=rank, pid=pid) if self.phase == Phase.RUNNING:
                rebuilt = self.clock.worker_joined(rank, pid, now)
                if rebuilt is not None:
                    self.out.log("rebuilt", generation=self.generation, **rebuilt)
            case p.Stepped(rank=rank, phases=phases) if self.phase == Phase.RUNNING:
                self._stepped(rank, now, phases)
            case p.Corrupt():
                self._corrupt(msg)
            case p.Fatal(rank=rank, message=message):
                raise JobStopped(f"rank {rank}: {message}")
            case p.Raised(rank=rank, step=step, error=error):
                failures.raised(self, node, rank, step, error)
            case p.InjectFired(spec=spec):
                self.clock.fault(now)
                self.faults.fired(spec)
                self.out.log("fault_injected", spec=spec)
            case p.Report():
                progress.report(self, msg)
            case p.Finished(rank=rank, step=step):
                progress.finished(self, rank, step, now)
            case p.Hello():
                pass  # a second hello on a connection that has a host: nothing new
            case _:
                pass  # a node-level message from a host that serves no node (yet)

    def _tick(self, now: float, heard: Mapping[int, float]) -> None:
        for conn, at in heard.items():
            if (host := self.hosts.host_of(conn)) is not None:
                self.hosts.heard[host] = max(self.hosts.heard.get(host, at), at)
        gap, self.last_tick = now - self.last_tick, now
        if gap > self.cfg.lease / 2:
            # Ticks this far apart: this process did not run (SIGSTOP, a suspended VM,
            # a stalled loop). The hosts' silence is its own: fresh leases, not fencing.
            self.out.log("coordinator_paused", seconds=gap)
            self.out.say(f"the coordinator did not run for {gap:.1f} s: hosts' leases renewed")
            for host in self.hosts.conns:
                self.hosts.heard[host] = now
            self.deadline += gap
        if self.expected is not None and now >= self.takeover_deadline:
            takeover.resume(self, now)
        for quiet_host, quiet in self.hosts.silent(now, self.cfg.lease):
            failures.host_lost(
                self, quiet_host, f"no heartbeat for {quiet:.1f} s (lease expired)", now
            )
        settling.given_up(self, now, gap)
        draining.overdue(self, now)
        progress.chaos(self, min(gap, 1.0), now)
        if now > self.deadline and not self.done:
            raise JobStopped(f"timed out {progress.waiting_for(self)} ({self._timeout_option()})")

    # ---------------------------------------------------------------- sending

    def _send_node(self, node: int, msg: p.Message) -> None:
        host = self.hosts.members.get(node)
        conn = None if host is None else self.hosts.conns.get(host)
        if conn is not None:
            self.out.add(Send(conn, msg, self.generation))

    def _broadcast_persist(self, msg: p.Message) -> None:
        """Ask the agents to write a step to tier 2; a node to be killed as it writes is
        killed right after the request (``kill:node=I:step=S:during=persist``)."""
        self._broadcast(msg)
        if isinstance(msg, p.Persist):
            local = {n for n, h in self.hosts.members.items() if h in self.local}
            progress.inject_nodes(self, self.faults.at_persist(msg.step, local), self.now)

    def _broadcast(self, msg: p.Message) -> None:
        """To every member's agent; a dead one is noticed by its connection, not here."""
        conns = self.hosts.member_conns()
        if conns:
            self.out.add(Broadcast(conns, msg, self.generation))

    # ---------------------------------------------------------------- taking over (etcd)

    def record(self) -> dict[str, Any]:
        """What a coordinator that takes this one's place needs (``takeover.record``)."""
        return takeover.record(self)

    def _ranks_of(self, node: int) -> list[int]:
        per = self.cfg.nproc_per_node
        return list(range(node * per, (node + 1) * per))

    def durable_steps(self) -> frozenset[int]:
        """Tier 2's restorable steps of this world size that this job may resume from."""
        if self.tier2 is None:
            return frozenset()
        try:
            steps = self.tier2.restorable_steps(self.world_size)
            if self.reshard is not None:  # older than a step of another size: superseded
                steps = frozenset(s for s in steps if s > self.reshard[0])
            return steps
        except OSError as e:
            self.persister.failing(f"cannot list {self.tier2.url}: {e}")
            return frozenset()

    def _bad_commit(self, step: int, why: str) -> None:
        self.out.log("corrupt_part", step=step, tier=2, where="COMMIT", why=why)
        self.persister.forget(step)

    def _restored(self, msg: p.Restored, now: float) -> None:
        self.restored[msg.rank] = msg
        if len(self.restored) < self.world_size:
            return
        tiers = {str(r): m.tier for r, m in sorted(self.restored.items())}
        seconds = max(m.seconds for m in self.restored.values())
        step = next(iter(self.restored.values())).step
        live = sorted(r for r, m in self.restored.items() if m.live)
        self.out.log(
            "restored",
            step=step,
            tiers=tiers,
            live=live,
            seconds=seconds,
            generation=self.generation,
        )
        by_tier = sorted(set(tiers.values()))
        self.out.say(f"restored step {step} (tiers {by_tier}) in {seconds:.2f} s")
        self.clock.restored(now)

    def _stepped(self, rank: int, now: float, phases: dict[str, float]) -> None:
        """A worker finished its first step of this generation."""
        step = -1 if self.plan is None or self.plan.step is None else self.plan.step
        if self.resharded_from is not None:
            step = self.resharded_from
        resumed = self.clock.worker_stepped(rank, step, now, phases)
        if resumed is None:
            return
        self.out.log("resumed", generation=self.generation, step=step, **resumed)
        text = ", ".join(f"{k} {v:.2f}" for k, v in resumed["phases"].items())
        self.out.say(f"resumed in {resumed['seconds']:.2f} s ({text})")

    def _corrupt(self, msg: p.Corrupt) -> None:
        rank, step, tier = msg.rank, msg.step, msg.tier
        if self.reshard is not None and (step, tier) == (self.reshard[0], Tier.DURABLE):
            raise JobStopped(
                f"rank {rank}: {msg.where}: {msg.why}. Step {step} of world size "
                f"{self.reshard[1]} is what this job would resume from at world size "
                f"{self.world_size}; `tierswap verify {self.cfg.persist}` lists what is "
                "damaged. Resume at the world size that wrote it, or remove the step."
            )
        if step is not None and tier is not None:
            self.reports.bad.add((Tier(tier), step, rank))
            if tier == Tier.DURABLE:
                self.persister.forget(step)
        self.out.log("corrupt_part", rank=rank, where=msg.where, why=msg.why, step=step, tier=tier)
        self.out.say(f"rank {rank}: {msg.where}: {msg.why}; trying an older step")

    def _peer_memory_exceeded(self, node: int | None, msg: p.PeerMemoryExceeded) -> None:
        if self.parity is not None:
            held = self.parity.holds.get(-1 if node is None else node, {})
            sets = sorted({r for key in msg.ranks for r in held.get(key, [])})
            raise JobStopped(
                f"node {node} must hold {msg.need:,} bytes of parity for ranks {sets} "
                f"({self.cfg.peer_slots} peer slots each, --peer-parity {self.cfg.parity_group}), "
                f"more than --max-peer-memory {msg.limit:,}. Raise --max-peer-memory, use "
                "fewer --peer-slots, or a larger --peer-parity group (smaller parities)."
            )
        raise JobStopped(
            f"node {node} must hold {msg.need:,} bytes of replicas for ranks {msg.ranks} "
            f"({self.cfg.peer_slots} peer slots each, --memory-tiers {self.cfg.memory_tiers}), "
            f"more than --max-peer-memory {msg.limit:,}. Raise --max-peer-memory, add nodes, "
            "or lower --replicas or --peer-slots."
        )

    # ---------------------------------------------------------------- commits

    def _committed(self) -> dict[str, int]:
        """The newest committed step per tier, by name, where there is one."""
        named = {
            "memory": self.tiers[0].committed,
            "peer": self.tiers[1].committed,
            "durable": self.persister.committed,
        }
        return {k: v for k, v in named.items() if v >= 0}

    def _committed_said(self) -> str:
        """The newest committed step of each tier, in words; a durable root given and
        never written says so."""
        said = [f"{tier} {step}" for tier, step in self._committed().items()]
        if self.cfg.persist is not None and self.persister.committed < 0:
            said.append("durable none")
        return ", ".join(said) or "none"

    def _timeout_option(self) -> str:
        """The option whose time ran out."""
        if self.waiting_since is not None:
            return f"--join-timeout {self.cfg.join_timeout:g} s"
        startup = self.cfg.startup_timeout
        if self.phase.state == Phase.FINISHING or self.salvage is not None:  # a write to tier 2
            return f"the larger of 600 s and --startup-timeout {startup:g} s"
        return f"--startup-timeout {startup:g} s"

    def _commits_open(self) -> bool:
        return self.phase.state in (Phase.RUNNING, Phase.FINISHING)

    def _parts(self, token: int, parts: list[Any], errors: dict[int, str]) -> None:
        step = self.persister.on_parts(token, parts, errors)
        if step is not None:
            self.ever_committed = self.ever_protected = True
            self.reports.durable_good(step)
            resize.maybe_grow(self, self.now)
        if self.salvage is not None and self.persister.inflight is None:
            resize.salvaged(self, step, self.now)
        draining.written(self, step)
        progress.maybe_done(self)

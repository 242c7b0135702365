"""A deterministic simulation of the whole control plane, for tests that generate failures.

The coordinator and every agent run as their real cores (``control/coordinator.py``,
``control/agent.py``) with the real codec between them; workers run as small models of
``worker.py`` and ``job.py`` that speak the same protocol (attach, park, rendezvous,
restore, train with a collective per step, snapshot, finish). Time, the network and
process deaths are a seeded scheduler: every message goes through a link that delivers
in order with a random latency (so messages on different connections are reordered),
a process killed loses what it had not sent and its links close after what it had, and
a chaos plan kills hosts and workers, freezes hosts and cuts links at random moments.
The same seed replays the same run exactly.

The state a worker trains is one integer per rank, updated each step from its own value
and the sum over all ranks (the step's collective), so a restore that mixed steps or
lost one would end with other numbers than a run without failures: the same oracle as
the end-to-end tests, at the cost of microseconds a step.

:meth:`Sim.check` states the invariants; a violation raises :class:`Violation` naming the
seed and the time.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import mmap
import random
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierswap.checksum import checksum_chunks
from tierswap.config import Config
from tierswap.control import agent_events as ae
from tierswap.control import commands as cc
from tierswap.control import protocol as p
from tierswap.control.agent import AgentCore
from tierswap.control.coordinator import CoordinatorCore
from tierswap.control.states import AgentPhase, Phase, WorkerState
from tierswap.control.workers import Kill, Spawn, Tell
from tierswap.errors import CorruptPartError
from tierswap.shm import Segment
from tierswap.state import Layout, TensorEntry
from tierswap.tiers.durable import PartInfo
from tierswap.tiers.memory import FILLING, NodeRings
from tierswap.tiers.peer import Lease
from tierswap.tiers.replicas import PeerStore

LAYOUT = Layout(entries=(TensorEntry("v", "I64", (1,), 0, 8, deferred=True),), nbytes=8)
"""A simulated rank's state: one 64-bit integer."""
MASK = (1 << 63) - 1
FROM_WORKER = p.Codec(p.WorkerToAgent)
TO_WORKER = p.Codec(p.AgentToWorker)
FROM_AGENT = p.Codec(p.AgentToCoordinator)
TO_AGENT = p.Codec(p.CoordinatorToAgent)


class Violation(AssertionError):
    """An invariant of the control plane does not hold."""


def advance(value: int, step: int, total: int) -> int:
    """A rank's state after ``step``, from its own and the sum of all ranks' before it."""
    return (value * 6364136223846793005 + total * 1442695040888963407 + step) & MASK


def reference(world_size: int, steps: int) -> list[int]:
    """Every rank's final state in a run without failures."""
    values = [r + 1 for r in range(world_size)]
    for step in range(steps):
        total = sum(values) & MASK
        values = [advance(v, step, total) for v in values]
    return values


# ==================================================================== memory and tier 2


class MemorySegment(Segment):
    """A segment on plain memory (the simulation's /dev/shm)."""

    def __init__(self, name: str, size: int, registry: dict[str, MemorySegment]) -> None:
        super().__init__(Path(name), size, mmap.mmap(-1, max(size, 1)))
        self.registry = registry
        registry[name] = self

    def unlink(self) -> None:
        self.close()
        self.registry.pop(self.path.name, None)


class FakeTier2:
    """Tier 2 in memory: parts and COMMITs; ``fail`` makes every write raise OSError."""

    def __init__(self, url: str = "sim://tier2") -> None:
        self.url = url
        self.parts: dict[tuple[int, int], bytes] = {}
        self.commits: dict[int, tuple[int, dict[int, PartInfo]]] = {}
        self.fail = False

    def write_part(self, step: int, rank: int, data: bytes) -> PartInfo:
        if self.fail:
            raise OSError(f"{self.url}: write refused (injected)")
        self.parts[(step, rank)] = bytes(data)
        return PartInfo(rank, checksum_chunks([data]), "sim", len(data))

    def read_part(self, step: int, rank: int, expected: PartInfo) -> bytes:
        data = self.parts.get((step, rank))
        if data is None or checksum_chunks([data]) != expected.data:
            raise CorruptPartError(f"{self.url} step {step} rank {rank}", "missing or corrupt")
        return data

    def restorable_steps(self, world_size: int) -> frozenset[int]:
        return frozenset(s for s, (ws, _) in self.commits.items() if ws == world_size)

    def read_commit(self, step: int) -> dict[int, PartInfo]:
        if step not in self.commits:
            raise CorruptPartError(f"{self.url} step {step}", "no COMMIT")
        return dict(self.commits[step][1])

    def write_commit(self, step: int, world_size: int, parts: Mapping[int, PartInfo]) -> None:
        if self.fail:
            raise OSError(f"{self.url}: COMMIT refused (injected)")
        self.commits[step] = (world_size, dict(parts))

    def discard(self, step: int) -> bool:
        if self.fail:
            raise OSError(f"{self.url}: delete refused (injected)")
        if step in self.commits:
            return False
        before = len(self.parts)
        self.parts = {k: v for k, v in self.parts.items() if k[0] != step}
        return len(self.parts) < before

    def retain(self, keep: int) -> list[int]:
        gone = sorted(self.commits)[:-keep]
        for step in gone:
            del self.commits[step]
            self.parts = {k: v for k, v in self.parts.items() if k[0] != step}
        return gone


# ==================================================================== the scheduler


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    action: Callable[[], None] = field(compare=False)


class Link:
    """One direction of a connection: in order, each message after a random latency;
    ``close`` delivers EOF after what was sent before it."""

    def __init__(
        self, sim: Sim, deliver: Callable[[bytes | None], None], duplicates: bool = False
    ) -> None:
        self.sim = sim
        self.deliver = deliver
        self.duplicates = duplicates
        """Whether chaos may deliver a message twice here (agent <-> coordinator, the
        messages a reconnecting sender would send again; not request/reply streams)."""
        self.last = 0.0
        self.closed = False

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        self._schedule(data)
        if self.duplicates and self.sim.rng.random() < self.sim.chaos.duplicate:
            self._schedule(data)  # a message delivered twice

    def _schedule(self, data: bytes | None) -> None:
        self.last = max(self.last, self.sim.now + self.sim.latency())
        self.sim.at(self.last, lambda: self.deliver(data))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._schedule(None)


@dataclass(slots=True)
class Chaos:
    """What may go wrong, and how often (per simulated second of the run)."""

    host_kills: float = 0.0
    worker_kills: float = 0.0
    freezes: float = 0.0
    link_cuts: float = 0.0
    duplicate: float = 0.0
    """Probability that a message between an agent and the coordinator is delivered
    twice (what a sender that reconnects and sends again would cause)."""
    until: float = 30.0
    """No new fault after this simulated time, so every run can end."""


# ==================================================================== hosts


class SimHost:
    """An agent process: its connection to the coordinator, its core, its workers."""

    def __init__(self, sim: Sim, host: int) -> None:
        self.sim = sim
        self.host = host
        self.address: p.Address = ("sim", host)
        self.alive = True
        self.frozen = False
        self.core: AgentCore | None = None
        self.conn = next(sim.conns)
        self.up = Link(sim, lambda data: sim.to_coordinator(self, data), duplicates=True)
        self.down = Link(sim, self._from_coordinator, duplicates=True)
        self.workers: dict[tuple[int, int], SimWorker] = {}
        self.links: dict[int, tuple[Link, SimWorker]] = {}
        """conn -> the link to that worker connection."""
        self.targets: dict[int, tuple[int, ...]] = {}
        self.addresses: dict[int, p.Address] = {}
        self.generation = -1
        sim.coordinator_connected(self)
        self.up.send(p.Codec.encode(p.Hello(host=host, pid=1000 + host), -1))
        self._beat()

    def _beat(self) -> None:
        if not self.alive:
            return
        if not self.frozen:
            self.up.send(p.Codec.encode(p.Beat(), -1))
        self.sim.after(self.sim.cfg.heartbeat, self._beat)

    def _tick(self) -> None:
        if self.alive:
            self.feed(ae.Tick())
            self.sim.after(self.sim.cfg.heartbeat, self._tick)

    def _from_coordinator(self, data: bytes | None) -> None:
        if not self.alive:
            return
        if self.frozen:
            self.sim.after(0.5, lambda: self._from_coordinator(data))  # read once thawed
            return
        if data is None:
            self.feed(ae.CoordinatorClosed())
            return
        env = TO_AGENT.decode(data)
        if isinstance(env.msg, p.Welcome) and self.core is None:
            self._welcome(env.msg)  # read once, before the core exists (as agent.main does)
            return
        self.feed(ae.FromCoordinator(env))

    def _welcome(self, w: p.Welcome) -> None:
        cfg, segs = self.sim.cfg, self.sim.segments
        peers = PeerStore(
            w.job_id, cfg.peer_slots, cfg.max_peer_memory, lambda m, g: None,
            create=lambda n, s: MemorySegment(n, s, segs),
        )  # fmt: skip
        rings = NodeRings(w.job_id, cfg.slots, create=lambda n, s: MemorySegment(n, s, segs))
        self.core = AgentCore(
            w.host, cfg, rings=rings, peers=peers, replica_address=self.address, coord_host="sim"
        )
        self.feed(ae.Boot())
        self._tick()

    def feed(self, event: Any) -> None:
        """Hand the core an event now, and carry out what it says."""
        if not self.alive or self.core is None:
            if isinstance(event, ae.Ask):  # the asking connection sees this host die
                event.answer(None, ProcessDied())
            return
        if self.frozen:
            self.sim.after(0.5, lambda: self.feed(event))
            return
        for cmd in self.core.handle(event, self.sim.now):
            self._carry_out(cmd)

    def _carry_out(self, cmd: Any) -> None:
        sim = self.sim
        match cmd:
            case ae.ToCoordinator(msg=msg, gen=gen):
                self.up.send(p.Codec.encode(msg, gen))
            case ae.Reply(conn=conn, msg=msg, gen=gen) | Tell(conn=conn, msg=msg, gen=gen):
                if conn in self.links:
                    self.links[conn][0].send(p.Codec.encode(msg, gen))
            case Spawn(local=local, incarnation=incarnation):
                sim.after(sim.boot_time(), lambda: self._spawn(local, incarnation))
            case Kill(local=local, incarnation=incarnation):
                worker = self.workers.get((local, incarnation))
                if worker is not None:
                    worker.die(-9)
            case ae.Checksum(rank=rank, step=step, slot=slot, layout=layout):
                digest = checksum_chunks(layout.chunks(slot.segment.buf))
                sim.after(sim.latency(), lambda: self.feed(ae.Checked(rank, step, slot, digest)))
            case ae.Replicate():
                sim.start(lambda: self.alive, self._replicate(cmd))
            case ae.ConfigureReplication(targets=targets, addresses=addresses, generation=gen):
                self.targets, self.addresses, self.generation = targets, dict(addresses), gen
            case ae.WritePart(part=part):
                sim.after(sim.latency(), lambda: self._write_part(part))
            case ae.AnswerAsk(answer=answer, value=value, error=error):
                answer(value, error)
            case ae.MakeSegment(tier=tier, rank=rank, alloc=alloc, index=index):
                seg = MemorySegment(cmd.name, cmd.nbytes, sim.segments)
                made = ae.SegmentMade(tier, rank, alloc, index, seg)
                sim.after(sim.latency(), lambda: self._made(made))
            case ae.WarmSegments():
                pass  # simulated segments cost nothing to make
            case ae.Shutdown():
                self.die()

    def _made(self, made: ae.SegmentMade) -> None:
        if self.alive and self.core is not None:
            self.feed(made)
        elif made.segment is not None:  # the host died meanwhile, and its memory with it
            made.segment.unlink()

    def _spawn(self, local: int, incarnation: int) -> None:
        if self.alive:
            self.workers[(local, incarnation)] = SimWorker(self, local, incarnation)

    def _write_part(self, part: Any) -> None:
        if not self.alive:
            return
        tier2 = self.sim.tier2
        try:
            assert tier2 is not None
            info = tier2.write_part(part.step, part.rank, bytes(part.slot.segment.buf[:8]))
            event = ae.PartWritten(part.rank, part.step, part.token, part.slot, info)
        except OSError as e:
            event = ae.PartWritten(part.rank, part.step, part.token, part.slot, None, str(e))
        self.feed(event)

    def _replicate(self, job: ae.Replicate) -> Generator[Any, Any, None]:
        """The replicator: the replica to each peer in turn, then ``Replicated``."""
        sim, buf = self.sim, bytes(job.slot.segment.buf[: job.layout.nbytes])
        fields = {"rank": job.rank, "step": job.step, "generation": job.generation}
        peer, token = None, None
        try:
            yield sim.latency()
            for node in self.targets.get(job.rank, ()):
                if job.generation != self.generation:
                    break  # queued before a restore went back
                peer = sim.host_at(self.addresses.get(node))
                if peer is None:
                    self._failed(job, node, "refused")
                    continue
                ask = {**fields, "layout": job.layout, "wait": True}
                while (got := (yield Ask(peer, "replica_slot", ask))) == FILLING:
                    yield 0.005
                if got is Dead:
                    self._failed(job, node, "peer gone")
                if got is Dead or got is None:
                    continue
                token, room = got
                yield sim.latency()  # the bytes on the wire
                if not peer.alive:
                    self._failed(job, node, "peer gone")
                    continue
                room[: len(buf)] = buf
                done = yield Ask(peer, "replica_written", {
                    **fields, "token": token, "ok": True, "layout": job.layout,
                    "tree": job.slot.tree, "checksum": job.slot.checksum,
                })  # fmt: skip
                token = None
                if done is Dead:
                    self._failed(job, node, "cut off")
            self.feed(ae.Replicated(job.rank, job.step, job.slot, job.generation))
        except ProcessDied:  # the sender died mid-transfer: the peer sees it cut off
            if peer is not None and token is not None:
                cut = {**fields, "token": token, "ok": False, "why": "transfer cut off"}
                peer.ask("replica_written", cut)
            raise

    def _failed(self, job: ae.Replicate, node: int, error: str) -> None:
        self.feed(ae.ReplicationFailed(job.rank, job.step, node, error, job.generation))

    def ask(
        self, op: str, fields: dict[str, Any], then: Callable[[Any], None] | None = None
    ) -> None:
        """A replica-server thread asks this host's loop; ``then(value)`` gets the answer
        (``Dead`` if this host died first)."""

        def answer(value: Any, error: BaseException | None) -> None:
            if then is not None:
                self.sim.after(self.sim.latency(), lambda: then(Dead if error else value))

        def deliver() -> None:
            if not self.alive:
                if then is not None:
                    then(Dead)
                return
            self.feed(ae.Ask(op, fields, answer))

        self.sim.after(self.sim.latency(), deliver)

    def die(self) -> None:
        """SIGKILL of the host's process group: agent and workers."""
        if not self.alive:
            return
        self.alive = False
        self.up.close()
        for worker in list(self.workers.values()):
            worker.die(-9, tell_agent=False)
        if self.core is not None:
            self.core.rings.close()
            self.core.peers.close()


class ProcessDied(Exception):
    """Thrown into a simulated process's coroutine when the process is killed."""


class _DeadType:
    def __repr__(self) -> str:
        return "Dead"


Dead = _DeadType()
"""What a wait on a process that died returns."""


@dataclass(frozen=True, slots=True)
class Ask:
    """Wait for ``host``'s answer to a replica-store request."""

    host: SimHost
    op: str
    fields: dict[str, Any]


# ==================================================================== workers


class SimWorker:
    """A worker process, as ``worker.py`` and ``job.py`` behave, on the protocol."""

    def __init__(self, host: SimHost, local: int, incarnation: int) -> None:
        self.sim = host.sim
        self.host = host
        self.local = local
        self.incarnation = incarnation
        self.pid = next(self.sim.pids)
        self.alive = True
        self.value: int | None = None
        self.ended: set[int] = set()
        """Generations whose Abort arrived."""
        self.settled: dict[int, int] = {}
        self.inbox: list[p.Envelope[Any]] = []
        self.replies: list[p.Envelope[Any]] = []
        self.wake: Callable[[], None] | None = None
        self.rank = -1
        """Its rank in the generation it is in."""
        self.ctl_conn, self.req_conn = next(self.sim.conns), next(self.sim.conns)
        self.ctl = Link(self.sim, lambda d: self._to_agent(self.ctl_conn, d))
        self.req = Link(self.sim, lambda d: self._to_agent(self.req_conn, d))
        host.links[self.ctl_conn] = (Link(self.sim, self._on_control), self)
        host.links[self.req_conn] = (Link(self.sim, self._on_reply), self)
        self.send_ctl(p.Attach(local=local, incarnation=incarnation, pid=self.pid), -1)
        self._beat()
        self.sim.start(lambda: self.alive and host.alive, self._life())

    # ------------------------------------------------------------ plumbing

    def _to_agent(self, conn: int, data: bytes | None) -> None:
        if data is not None and self.host.alive:
            env = FROM_WORKER.decode(data)
            self.host.feed(ae.FromWorker(conn, env, self.sim.now))

    def send_ctl(self, msg: p.Message, gen: int) -> None:
        if self.alive:
            self.ctl.send(p.Codec.encode(msg, gen))

    def send(self, msg: p.Message, gen: int) -> None:
        if self.alive:
            self.req.send(p.Codec.encode(msg, gen))

    def _beat(self) -> None:
        if self.alive:
            if not self.host.frozen:
                self.send_ctl(p.Beat(), -1)
            self.sim.after(self.sim.cfg.heartbeat, self._beat)

    def _on_control(self, data: bytes | None) -> None:
        if not self.alive or data is None:
            return
        env = TO_WORKER.decode(data)
        match env.msg:
            case p.Abort():
                self.ended.add(env.gen)
            case p.Settled(step=step):
                self.settled[env.gen] = max(self.settled.get(env.gen, -1), step)
            case p.Exit():
                self.die(0)
                return
            case p.Assign(settled=settled):
                self.settled[env.gen] = max(self.settled.get(env.gen, -1), settled)
                self.inbox.append(env)
        self.poke()

    def _on_reply(self, data: bytes | None) -> None:
        if self.alive and data is not None:
            self.replies.append(TO_WORKER.decode(data))
            self.poke()

    def poke(self) -> None:
        if self.wake is not None:
            wake, self.wake = self.wake, None
            wake()

    def die(self, code: int, tell_agent: bool = True) -> None:
        if not self.alive:
            return
        self.alive = False
        self.ctl.close()
        self.req.close()
        self.sim.left(self)
        if tell_agent and self.host.alive:
            event = ae.WorkerExited(self.local, self.incarnation, code)
            self.sim.after(self.sim.latency(), lambda: self.host.feed(event))

    # ------------------------------------------------------------ its life

    def _life(self) -> Generator[Any, Any, None]:
        while self.alive:
            yield Until(self, lambda: bool(self.inbox))
            env = self.inbox.pop(0)
            assign: p.Assign = env.msg
            outcome = yield from self._generation(env.gen, assign)
            if outcome == "finished":
                self.die(0)
                return

    def _call(self, msg: p.Message, gen: int) -> Generator[Any, Any, p.Message]:
        self.send(msg, gen)
        yield Until(self, lambda: bool(self.replies))
        reply: p.Message = self.replies.pop(0).msg
        return reply

    def _generation(self, gen: int, a: p.Assign) -> Generator[Any, Any, str]:
        sim, rank = self.sim, a.rank
        self.rank = rank
        sim.arrive(gen, rank, self)
        yield Until(self, lambda: sim.arrived(gen) >= a.world_size or gen in self.ended)
        if gen in self.ended:
            self.send_ctl(p.Parked(generation=gen, rank=rank, reason="ended", why="at start"), gen)
            return "parked"
        yield sim.latency()
        self.send(p.Joined(rank=rank, pid=self.pid, seconds=0.01), gen)
        reply = yield from self._call(p.PlanRequest(rank=rank), gen)
        if isinstance(reply, p.Error):
            return (yield from self._leave(gen, rank, "collective", reply.message))
        assert isinstance(reply, p.PlanReply), reply
        start = 0
        self.value = rank + 1
        if reply.step is not None:
            loaded = yield from self._load(reply, rank)
            if loaded is None:
                where = f"rank {rank} step {reply.step}"
                bad = p.Corrupt(
                    rank=rank, where=where, why="unreadable", step=reply.step, tier=reply.tier
                )
                yield from self._call(bad, gen)
                return (yield from self._leave(gen, rank, "corrupt", "unreadable source"))
            self.value, start = loaded, reply.step + 1
            tier = reply.tier
            assert tier is not None
            sim.restored(gen, rank, reply.step)
            self.send(p.Restored(rank=rank, step=reply.step, tier=tier, seconds=0.01), gen)
        self.send(p.Report(rank=rank, step=start - 1, total=sim.steps), gen)
        alloc: p.Allocated | None = None
        last = -1
        for step in range(start, sim.steps):
            if gen in self.ended:
                return (yield from self._leave(gen, rank, "ended", "generation ended"))
            # the optimizer step waits until tier 1 is done with the step max_redo back
            if a.max_redo > 0 and last >= 0:
                target = last - (a.max_redo - 1)
                yield Until(self, functools.partial(self._settled, gen, target))
                if gen in self.ended:
                    return (yield from self._leave(gen, rank, "ended", "generation ended"))
            yield sim.step_time  # forward and backward: the abort is seen at the boundary
            total = yield from sim.collective(self, gen, step, a.world_size)
            if total is None:
                return (yield from self._leave(gen, rank, "collective", "a peer is gone"))
            assert self.value is not None
            self.value = advance(self.value, step, total)
            if alloc is None:
                got = yield from self._call(p.Alloc(rank=rank, layout=LAYOUT), gen)
                if not isinstance(got, p.Allocated):
                    return (yield from self._leave(gen, rank, "collective", str(got)))
                alloc = got
            deadline = sim.now + (60.0 if step == sim.steps - 1 else 0.0)  # as Job.steps
            while True:  # the last step waits for a slot; a refusal then is no skip yet
                retry = sim.now < deadline
                request = p.SlotRequest(rank=rank, step=step, alloc=alloc.alloc, retry=retry)
                granted = yield from self._call(request, gen)
                if not isinstance(granted, p.SlotGranted) or granted.slot is not None:
                    break
                if not (retry or granted.filling) or gen in self.ended:
                    break
                yield 0.005
            if isinstance(granted, p.SlotGranted) and granted.slot is not None:
                seg = sim.segments.get(alloc.segments[granted.slot])
                if seg is not None and seg.buf is not None:
                    seg.buf[:8] = self.value.to_bytes(8, "little")
                yield sim.latency()
                written = p.Written(rank=rank, step=step, slot=granted.slot, alloc=alloc.alloc,
                                    tree={"step": step}, stall=0.0)  # fmt: skip
                self.send(written, gen)
                last = step
            if step == start:
                self.send(p.Stepped(rank=rank, step=step), gen)
            yield sim.latency()
            if sim.fault_after(self, rank, step):
                return "killed"
        sim.finished(rank, self.value)  # its state is final (and snapshotted)
        done = yield from self._call(p.Finished(rank=rank, step=sim.steps - 1), gen)
        if not isinstance(done, p.Ack):
            return (yield from self._leave(gen, rank, "ended", "finished too late"))
        sim.left(self)
        return "finished"

    def _settled(self, gen: int, target: int) -> bool:
        return self.settled.get(gen, -1) >= target or gen in self.ended

    def _leave(self, gen: int, rank: int, reason: str, why: str) -> Generator[Any, Any, str]:
        self.sim.left(self)
        yield self.sim.latency()
        reason = "ended" if gen in self.ended else reason
        self.send_ctl(p.Parked(generation=gen, rank=rank, reason=reason, why=why), gen)
        return "parked"

    def _load(self, plan: p.PlanReply, rank: int) -> Generator[Any, Any, int | None]:
        source, step = plan.source, plan.step
        assert step is not None
        data: bytes | None = None
        match source:
            case p.FromSlot(segment=name, checksum=checksum):
                seg = self.sim.segments.get(name)
                if seg is not None and checksum_chunks(LAYOUT.chunks(seg.buf)) == checksum:
                    data = bytes(seg.buf[:8])
            case p.FromPeer(address=address):
                peer = self.sim.host_at(address)
                lease = None
                if peer is not None:
                    lease = yield Ask(peer, "replica_lease", {"rank": rank, "step": step})
                if isinstance(lease, Lease):
                    try:
                        buf = lease.read()
                        if checksum_chunks(lease.layout.chunks(buf)) == lease.checksum:
                            data = bytes(buf[:8])
                    except (CorruptPartError, ValueError):  # ValueError: the peer died
                        data = None
                    assert peer is not None
                    peer.ask("replica_unlease", {"rank": rank, "token": lease.token})
            case p.FromDurable(part=part):
                tier2 = self.sim.tier2
                try:
                    assert tier2 is not None
                    data = tier2.read_part(step, rank, part)
                except CorruptPartError:
                    data = None
        yield self.sim.latency()
        return None if data is None else int.from_bytes(data, "little")


@dataclass(frozen=True, slots=True)
class Until:
    """Wait until ``ready()`` holds (re-checked when the worker gets a message or time
    passes)."""

    worker: SimWorker
    ready: Callable[[], bool]


# ==================================================================== the world


class Sim:
    """The whole job, simulated. ``run()`` until it ends; ``check()`` after every event."""

    def __init__(
        self,
        cfg: Config,
        seed: int,
        steps: int = 10,
        chaos: Chaos | None = None,
        tier2: FakeTier2 | None = None,
        step_time: float = 0.005,
    ) -> None:
        self.cfg = cfg
        self.seed = seed
        self.step_time = step_time
        """Simulated seconds of a training step's compute."""
        self.rng = random.Random(seed)
        self.steps = steps
        self.chaos = chaos or Chaos()
        self.now = 0.0
        self._heap: list[_Due] = []
        self._seq = itertools.count()
        self.conns = itertools.count(1)
        self.pids = itertools.count(50_000)
        self.segments: dict[str, MemorySegment] = {}
        self.tier2 = tier2 if tier2 is not None or cfg.persist is None else FakeTier2(cfg.persist)
        self.hosts: dict[int, SimHost] = {}
        self.by_conn: dict[int, SimHost] = {}
        self.log: list[tuple[float, str, dict[str, Any]]] = []
        self.said: list[str] = []
        self.ended: cc.End | None = None
        self.final: dict[int, int] = {}
        self._arrived: dict[int, set[int]] = {}
        self._restored: dict[int, dict[int, int]] = {}
        self._members: dict[int, dict[int, SimWorker]] = {}
        self._contrib: dict[tuple[int, int], dict[int, int]] = {}
        self.training: dict[SimWorker, int] = {}
        """Workers inside a generation (arrived, not parked), by generation."""
        self.committed: dict[int, int] = {0: -1, 1: -1}
        self.events = 0
        self.paused_until = 0.0
        """The coordinator does nothing before this time (``pause_coordinator``)."""
        self.kills: dict[tuple[str, int], int] = {}
        """("rank" or "node", index) -> the step after which it is killed (once)."""
        self.coordinator = CoordinatorCore(
            cfg,
            job_id=f"sim{seed}",
            script=["train.py"],
            address=("sim", 0),
            store="sim:1",
            tier2=self.tier2,
            now=0.0,
        )
        self._coordinate(cc.Begin())
        self._coordinator_tick()
        self._schedule_chaos()

    # ------------------------------------------------------------ scheduling

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, _Due(when, next(self._seq), action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def latency(self) -> float:
        return self.rng.uniform(0.0001, 0.005)

    def boot_time(self) -> float:
        return self.rng.uniform(0.2, 3.0)  # imports: a worker or agent ready in seconds

    def start(self, alive: Callable[[], bool], coroutine: Generator[Any, Any, Any]) -> None:
        """Run a process's coroutine: it yields delays, ``Ask`` or ``Until``. Once
        ``alive()`` is false it gets ``ProcessDied`` thrown in, to clean up what a real
        peer would see of its death."""

        def step(value: Any = None) -> None:
            try:
                wait = coroutine.send(value) if alive() else coroutine.throw(ProcessDied())
            except (StopIteration, ProcessDied):
                return
            match wait:
                case float() | int():
                    self.after(float(wait), step)
                case Ask(host=peer, op=op, fields=fields):
                    peer.ask(op, fields, step)
                case Until(worker=w, ready=ready):
                    self._until(w, ready, step)
                case _:
                    raise TypeError(f"a simulated process waits on {wait!r}")

        self.after(0.0, step)

    def _until(self, w: SimWorker, ready: Callable[[], bool], go: Callable[[Any], None]) -> None:
        """Resume ``go`` once ``ready()`` holds: re-checked whenever the worker is poked
        (a message for it, a peer arriving at or leaving a generation)."""

        def check() -> None:
            if not w.alive:
                return
            if ready():
                go(None)
            else:
                w.wake = check

        check()

    def run(self, horizon: float = 900.0) -> str:
        """Until the job ends; a job still going at ``horizon`` simulated seconds hangs.
        Returns :meth:`outcome`."""
        self.run_for(horizon - self.now)
        if self.ended is None:
            raise Violation(self._where(f"the job neither finished nor stopped by t={horizon:g} s"))
        return self.outcome()

    def run_for(self, seconds: float) -> None:
        """Every event of the next ``seconds``, each followed by :meth:`check`."""
        until = self.now + seconds
        while self._heap and self.ended is None and self._heap[0].at <= until:
            due = heapq.heappop(self._heap)
            self.now = due.at
            due.action()
            self.events += 1
            self.check()
        if self.ended is None:
            self.now = max(self.now, until)

    def _where(self, what: str) -> str:
        return f"seed {self.seed}, t={self.now:.3f} s: {what}"

    # ------------------------------------------------------------ the coordinator

    def _coordinate(self, event: Any) -> None:
        if self.ended is not None:
            return
        if self.now < self.paused_until:  # SIGSTOP of the launcher: it reads on later
            self.at(self.paused_until, lambda: self._coordinate(event))
            return
        for cmd in self.coordinator.handle(event, self.now):
            self._coordinator_does(cmd)

    def _coordinator_tick(self) -> None:
        if self.ended is None:
            self._coordinate(cc.Tick())
            self.after(min(0.5, self.cfg.heartbeat / 2), self._coordinator_tick)

    def coordinator_connected(self, host: SimHost) -> None:
        self.by_conn[host.conn] = host

    def to_coordinator(self, host: SimHost, data: bytes | None) -> None:
        if data is None:
            self._coordinate(cc.AgentClosed(host.conn))
            return
        env = FROM_AGENT.decode(data)
        self._coordinate(cc.AgentMessage(host.conn, env, self.now))

    def _coordinator_does(self, cmd: Any) -> None:
        match cmd:
            case cc.Send(conn=conn, msg=msg, gen=gen):
                self._down(conn, p.Codec.encode(msg, gen))
            case cc.Broadcast(conns=conns, msg=msg, gen=gen):
                data = p.Codec.encode(msg, gen)
                for conn in conns:
                    self._down(conn, data)
            case cc.StartHost(host=host):
                self.after(self.boot_time(), lambda: self._boot(host))
            case cc.KillHost(host=host):
                if host in self.hosts:
                    self.hosts[host].die()
            case cc.KillProcess(pid=pid):
                for sim_host in self.hosts.values():
                    for w in list(sim_host.workers.values()):
                        if w.pid == pid:
                            w.die(-9)
            case cc.FreezeHost(host=host):
                if host in self.hosts:
                    self.hosts[host].frozen = True
            case cc.Close(conn=conn):
                if conn in self.by_conn:
                    self.by_conn[conn].down.close()
            case cc.Log(event=event, fields=fields):
                self.log.append((self.now, event, fields))
                self._logged(event, fields)
            case cc.Say(text=text):
                self.said.append(text)
            case cc.End():
                self.ended = cmd

    def _down(self, conn: int, data: bytes) -> None:
        host = self.by_conn.get(conn)
        if host is not None:
            host.down.send(data)

    def _boot(self, host: int) -> None:
        if self.ended is None:
            self.hosts[host] = SimHost(self, host)

    def host_at(self, address: p.Address | None) -> SimHost | None:
        if address is None:
            return None
        host = self.hosts.get(address[1])
        return host if host is not None and host.alive and not host.frozen else None

    # ------------------------------------------------------------ what workers share

    def arrive(self, gen: int, rank: int, w: SimWorker) -> None:
        """The generation's rendezvous (its store prefix)."""
        self._arrived.setdefault(gen, set()).add(rank)
        self._members.setdefault(gen, {})[rank] = w
        self.training[w] = gen
        self._wake_all()

    def arrived(self, gen: int) -> int:
        return len(self._arrived.get(gen, ()))

    def restored(self, gen: int, rank: int, step: int) -> None:
        steps = self._restored.setdefault(gen, {})
        steps[rank] = step
        if len(set(steps.values())) > 1:
            raise Violation(self._where(f"generation {gen} restored mixed steps {steps}"))

    def collective(
        self, w: SimWorker, gen: int, step: int, world_size: int
    ) -> Generator[Any, Any, int | None]:
        """The step's all-reduce: the sum of every rank's state before ``step``; None when
        a member of the generation died or left it (its sockets closed) first."""
        key = (gen, step)
        contrib = self._contrib.setdefault(key, {})
        assert w.value is not None
        contrib[w.rank] = w.value
        self._wake_all()
        yield Until(w, lambda: len(contrib) >= world_size or self._broken(gen))
        if len(contrib) < world_size:
            return None
        return sum(contrib.values()) & MASK

    def _broken(self, gen: int) -> bool:
        return any(not w.alive or self.training.get(w) != gen for w in self._members[gen].values())

    def left(self, w: SimWorker) -> None:
        """A worker left its generation (parked, finished or died)."""
        self.training.pop(w, None)
        self._wake_all()

    def kill_after(self, what: str, index: int, step: int) -> None:
        """Kill rank ``index``'s worker, or node ``index``'s host, once a worker of it has
        done ``step`` (as ``--inject kill:rank=R:step=S`` does)."""
        self.kills[(what, index)] = step

    def pause_coordinator(self, at: float, seconds: float) -> None:
        """Freeze the launcher (SIGSTOP) from ``at`` for ``seconds``: what arrives meanwhile
        waits in its sockets, and no tick runs."""
        self.at(at, lambda: setattr(self, "paused_until", at + seconds))

    def kill_at_generation(self, node: int, generation: int) -> None:
        """Kill the host serving ``node`` as soon as ``generation`` starts."""
        self.kills[("gen", generation)] = node

    def fault_after(self, w: SimWorker, rank: int, step: int) -> bool:
        if self.kills.get(("rank", rank)) == step:
            del self.kills[("rank", rank)]
            w.die(-9)
            return True
        node = w.host.core.node if w.host.core is not None else None
        if node is not None and self.kills.get(("node", node)) == step:
            del self.kills[("node", node)]
            w.host.die()
            return True
        return False

    def finished(self, rank: int, value: int) -> None:
        self.final[rank] = value

    def _wake_all(self) -> None:
        for host in self.hosts.values():
            for w in host.workers.values():
                if w.wake is not None:
                    self.after(0.0, w.poke)

    # ------------------------------------------------------------ chaos

    def _schedule_chaos(self) -> None:
        kinds = [
            ("host", self.chaos.host_kills),
            ("worker", self.chaos.worker_kills),
            ("freeze", self.chaos.freezes),
            ("cut", self.chaos.link_cuts),
        ]
        for kind, rate in kinds:
            t = 0.0
            while rate > 0:
                t += self.rng.expovariate(rate)
                if t > self.chaos.until:
                    break
                self.at(t, functools.partial(self._fault, kind))

    def _fault(self, kind: str) -> None:
        live = [h for h in self.hosts.values() if h.alive]
        if not live or self.ended is not None:
            return
        host = self.rng.choice(live)
        match kind:
            case "host":
                host.die()
            case "freeze":
                host.frozen = True
            case "cut":
                host.up.close()
            case "worker":
                workers = [w for w in host.workers.values() if w.alive]
                if workers:
                    self.rng.choice(workers).die(-9)

    # ------------------------------------------------------------ invariants

    def _logged(self, event: str, fields: dict[str, Any]) -> None:
        if event == "snapshot_committed" and fields.get("tier") in (0, 1):
            self.committed[fields["tier"]] = max(self.committed[fields["tier"]], fields["step"])
        elif event == "generation_started":
            self._check_plan(fields.get("step"))
            self.committed = {t: self.coordinator.tiers[t].committed for t in (0, 1)}
            node = self.kills.pop(("gen", fields["generation"]), None)
            host = None if node is None else self.hosts.get(fields["members"][str(node)])
            if host is not None:
                host.die()

    def _check_plan(self, step: int | None) -> None:
        """A step committed in a tier that still holds it on every rank is never planned
        away for an older one."""
        planned = -1 if step is None else step
        ws = self.cfg.world_size
        for tier, committed in self.committed.items():
            if committed > planned and self._holds(tier, committed, ws):
                raise Violation(self._where(
                    f"step {committed} is committed in tier {tier} and still held there on "
                    f"every rank, but generation starts from {step}"
                ))  # fmt: skip
        if self.tier2 is not None:
            newest = max(self.tier2.restorable_steps(ws), default=-1)
            if newest > planned:
                raise Violation(self._where(f"tier 2 holds step {newest}, restart is {step}"))

    def _holds(self, tier: int, step: int, ws: int) -> bool:
        cores = [h.core for h in self.hosts.values() if h.alive and not h.frozen and h.core]
        if tier == 0:
            held = {r for c in cores if c.node is not None for r, ring in c.rings.items()
                    if step in ring.held() and r in c.ranks}  # fmt: skip
        else:
            held = {r for c in cores if c.node is not None for r, s in c.peers.holdings().items()
                    if step in s}  # fmt: skip
        return held >= set(range(ws))

    def check(self) -> None:
        """The invariants, after every event."""
        coord = self.coordinator
        members, spares = set(coord.hosts.members.values()), set(coord.hosts.spares)
        if members & spares:
            raise Violation(self._where(f"hosts {members & spares} are both member and spare"))
        if len(members) != len(coord.hosts.members):
            raise Violation(self._where(f"a host serves two nodes: {coord.hosts.members}"))
        running: dict[int, set[int]] = {}
        for host in self.hosts.values():
            if not host.alive or host.core is None:
                continue
            for w in host.core.workers.procs.values():
                if w.state is WorkerState.ASSIGNED and w.rank is not None:
                    running.setdefault(w.generation, set())
                    if w.rank in running[w.generation]:
                        raise Violation(self._where(f"rank {w.rank} has two workers in "
                                                    f"generation {w.generation}"))  # fmt: skip
                    running[w.generation].add(w.rank)
        if len(running) > 1:
            raise Violation(self._where(f"generations {sorted(running)} run at once"))
        if coord.phase == Phase.RUNNING:
            for host in self.hosts.values():
                core = host.core
                if core is None or not host.alive or core.phase != AgentPhase.SERVING:
                    continue
                if core.ranks and set(core.workers.by_rank) != set(core.ranks):
                    raise Violation(self._where(
                            f"host {host.host} serves ranks {core.ranks} with workers for "
                            f"{sorted(core.workers.by_rank)}"
                        ))  # fmt: skip

    def outcome(self) -> str:
        """ "finished" (the final state checked against a run without failures) or the
        reason the job stopped."""
        assert self.ended is not None
        if self.ended.code != 0:
            return self.ended.reason or "stopped without a reason"
        want = reference(self.cfg.world_size, self.steps)
        got = [self.final.get(r) for r in range(self.cfg.world_size)]
        if got != want:
            raise Violation(self._where(f"finished with {got}, a run without failures ends {want}"))
        return "finished"


def spare_of(hosts: Iterable[SimHost]) -> list[SimHost]:
    return [h for h in hosts if h.alive and h.core is not None and h.core.node is None]

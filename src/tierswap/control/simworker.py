"""A simulated worker (``control/sim.py``): ``worker.py`` and ``job.py`` as a coroutine on
the protocol, and what such a coroutine yields to wait (an agent's answer, a condition,
a delay)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierswap.checksum import checksum_chunks
from tierswap.control import agent_events as ae
from tierswap.control import protocol as p
from tierswap.control.simworld import (
    FROM_WORKER,
    LAYOUT,
    TO_WORKER,
    Link,
    advance,
)
from tierswap.errors import CorruptPartError
from tierswap.tiers.parity import xor_into
from tierswap.tiers.peer import Lease

if TYPE_CHECKING:
    from tierswap.control.simhost import SimHost


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


@dataclass(frozen=True, slots=True)
class Until:
    """Wait until ``ready()`` holds (re-checked when the worker gets a message or time
    passes)."""

    worker: SimWorker
    ready: Callable[[], bool]


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
        start, tier = 0, None
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
        if 0 < start == sim.steps and tier != 0:  # as Job.steps: the last step, restored
            alloc, _ = yield from self._snapshot(gen, rank, start - 1, alloc)  # from elsewhere
            if alloc is None:
                return (yield from self._leave(gen, rank, "collective", "no slots"))
        for step in range(start, sim.steps):
            if gen in self.ended:
                return (yield from self._leave(gen, rank, "ended", "generation ended"))
            yield sim.step_time  # forward and backward: the abort is seen at the boundary
            total = yield from sim.collective(self, gen, step, a.world_size)
            if total is None:
                return (yield from self._leave(gen, rank, "collective", "a peer is gone"))
            if sim.fault_mid(self, step):
                return "killed"
            # then the optimizer step, which waits (its pre-hook, after the gradients were
            # exchanged) until tier 1 is done with the step max_redo back
            gated_at = sim.now
            if a.max_redo > 0 and last >= 0:
                target = last - (a.max_redo - 1)
                yield Until(self, functools.partial(self._settled, gen, target))
                if gen in self.ended:
                    return (yield from self._leave(gen, rank, "ended", "generation ended"))
            gate = sim.now - gated_at  # the step's wait for tier 1, reported with its snapshot
            assert self.value is not None
            self.value = advance(self.value, step, total)
            alloc, took = yield from self._snapshot(gen, rank, step, alloc, gate)
            if alloc is None:
                return (yield from self._leave(gen, rank, "collective", "no slots"))
            last = step if took else last
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

    def _snapshot(
        self, gen: int, rank: int, step: int, alloc: p.Allocated | None, gate: float = 0.0
    ) -> Generator[Any, Any, tuple[p.Allocated | None, bool]]:
        """Snapshot the value as ``step`` (its slots allocated if not yet; ``gate``: the
        step's wait for tier 1): the allocation (None if refused) and whether a slot was
        granted."""
        sim = self.sim
        if alloc is None:
            got = yield from self._call(p.Alloc(rank=rank, layout=LAYOUT), gen)
            if not isinstance(got, p.Allocated):
                return None, False
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
        if not (isinstance(granted, p.SlotGranted) and granted.slot is not None):
            return alloc, False
        seg = sim.segments.get(alloc.segments[granted.slot])
        assert self.value is not None
        if seg is not None and seg.buf is not None:
            seg.buf[:8] = self.value.to_bytes(8, "little")
        yield sim.latency()
        written = p.Written(rank=rank, step=step, slot=granted.slot, alloc=alloc.alloc,
                            tree={"step": step}, stall=gate, gate=gate)  # fmt: skip
        self.send(written, gen)
        return alloc, True

    def _rebuild(
        self, source: p.FromParity, rank: int, step: int
    ) -> Generator[Any, Any, bytes | None]:
        """``parity.rebuild`` on the simulated network: each stripe from the parity its
        holder leases out, XORed with the other members' stripes from their tier 0; None
        where anything is missing or the result fails its checksum."""
        sim, out, mine = self.sim, bytearray(LAYOUT.nbytes), None
        for j, (key, holder) in enumerate(zip(source.keys, source.holders, strict=True)):
            peer = sim.host_at(holder)
            lease = (
                None
                if peer is None
                else (yield Ask(peer, "replica_lease", {"rank": key, "step": step}))
            )
            if not isinstance(lease, Lease):
                return None
            assert peer is not None
            try:
                buf = bytes(lease.read())
                members = {m.rank: m for m in lease.tree.get("members", [])}
            except ValueError:  # the peer died
                return None
            finally:
                peer.ask("replica_unlease", {"rank": key, "token": lease.token})
            mine = members.get(rank)
            if checksum_chunks(lease.layout.chunks(memoryview(buf))) != lease.checksum:
                return None
            if mine is None or mine.stripe != j:
                return None
            start = j * mine.unit
            out[start : start + mine.nbytes] = buf[: mine.nbytes]
            for q, m in members.items():
                n = min(m.nbytes, mine.nbytes)
                if q == rank or n == 0:
                    continue
                host = sim.host_at(source.members.get(q))
                slot = (
                    None
                    if host is None
                    else (yield Ask(host, "tier0_lease", {"rank": q, "step": step}))
                )
                if slot is None or slot is Dead or slot.segment.buf is None:
                    return None
                assert host is not None
                theirs = bytes(slot.segment.buf[m.stripe * m.unit : m.stripe * m.unit + n])
                host.ask("tier0_unlease", {"slot": slot})
                xor_into(memoryview(out)[start : start + n], memoryview(theirs))
        if mine is None or checksum_chunks(LAYOUT.chunks(memoryview(out))) != mine.checksum:
            return None
        return bytes(out[:8])

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
            case p.FromParity():
                data = yield from self._rebuild(source, rank, step)
            case p.FromDurable(part=part):
                tier2 = self.sim.tier2
                try:
                    assert tier2 is not None
                    data = tier2.read_part(step, rank, part)
                except CorruptPartError:
                    data = None
        yield self.sim.latency()
        return None if data is None else int.from_bytes(data, "little")

"""A simulated host (``control/sim.py``): an agent process, its real core, and the
commands of that core carried out on the simulated network."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from tierswap.checksum import checksum_chunks
from tierswap.control import agent_events as ae
from tierswap.control import protocol as p
from tierswap.control.agent import AgentCore
from tierswap.control.simworker import Ask, Dead, ProcessDied, SimWorker
from tierswap.control.simworld import TO_AGENT, Link, MemorySegment
from tierswap.control.workers import Kill, Spawn, Tell
from tierswap.tiers import parity
from tierswap.tiers.memory import FILL_LIMIT_S, FILLING, NodeRings
from tierswap.tiers.replicas import PeerStore

if TYPE_CHECKING:
    from tierswap.control.sim import Sim


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
        rings = NodeRings(w.job_id, cfg.tier0_slots, create=lambda n, s: MemorySegment(n, s, segs))
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
            case ae.Replicate() if sim.cfg.parity_group:
                sim.start(lambda: self.alive, self._send_stripes(cmd))
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
                ask = {**fields, "layout": job.layout, "wait": True}
                found = yield from self._room(job, node, "replica_slot", ask)
                if found is None:
                    continue
                peer, (token, room) = found
                yield sim.latency()  # the bytes on the wire
                if not peer.alive:
                    self._failed(job, node, "peer gone")
                    continue
                room[: len(buf)] = buf
                written = {**fields, "token": token, "ok": True, "layout": job.layout,
                           "tree": job.slot.tree, "checksum": job.slot.checksum}  # fmt: skip
                token = None  # the bytes are in: the peer's to hold, whatever befalls this one
                done = yield Ask(peer, "replica_written", written)
                if done is Dead:
                    self._failed(job, node, "cut off")
            self.feed(ae.Replicated(job.rank, job.step, job.slot, job.generation))
        except ProcessDied:  # the sender died mid-transfer: the peer sees it cut off
            if peer is not None and token is not None:
                peer.ask("replica_written", self._cut(job, {}, token))
            raise

    def _send_stripes(self, job: ae.Replicate) -> Generator[Any, Any, None]:
        """The replicator with ``--peer-parity``: stripe ``j`` of the snapshot to the
        ``j``-th target, folded into the parity it holds; the stripe that completes one
        checksums it there. A stripe refused or lost ends the step's sending, as the real
        sender's does."""
        sim, buf = self.sim, bytes(job.slot.segment.buf[: job.layout.nbytes])
        targets = self.targets.get(job.rank, ())
        unit = parity.stripe_unit(len(buf), len(targets))
        fields = {"rank": job.rank, "step": job.step, "generation": job.generation}
        peer, acc, room, stage = None, None, memoryview(b""), ""
        try:
            yield sim.latency()
            for j, node in enumerate(targets):
                if job.generation != self.generation:
                    break
                ask = {**fields, "unit": unit, "wait": True}
                found = yield from self._room(job, node, "parity_slot", ask)
                if found is None:
                    break
                peer, (acc, room) = found
                stage = "bytes"
                yield sim.latency()  # the bytes on the wire
                if not peer.alive:
                    self._failed(job, node, "peer gone")
                    break
                start, stop = parity.stripe(len(buf), len(targets), j)
                if stop > start:
                    acc.fold(room, 0, memoryview(buf[start:stop]))
                member = p.ParityMember(
                    rank=job.rank, stripe=j, nbytes=stop - start, unit=unit, layout=job.layout,
                    tree=job.slot.tree, checksum=job.slot.checksum,
                )  # fmt: skip
                stage = "added"  # the bytes are in: the peer's server goes on without us
                done = yield Ask(peer, "parity_added", {
                    **fields, "acc": acc, "member": member, "ok": True,
                })  # fmt: skip
                stage = "checked"
                if done is True:
                    done = yield from self._checked(peer, job, acc, room)
                acc, stage = None, ""
                if done is Dead:  # (False: folded in, the parity not complete yet)
                    self._failed(job, node, "cut off")
                    break
            self.feed(ae.Replicated(job.rank, job.step, job.slot, job.generation))
        except ProcessDied as died:  # the sender died: what the peer's server then does
            if peer is not None and acc is not None and stage == "bytes":
                peer.ask("parity_added", self._cut(job, {"unit": unit}, acc))
            answer = died.args[0] if died.args else None
            if peer is not None and acc is not None and stage == "added" and answer is True:
                sim.start(lambda: peer.alive, self._checked(peer, job, acc, room))
            raise

    def _checked(
        self, peer: SimHost, job: ae.Replicate, acc: Any, room: memoryview
    ) -> Generator[Any, Any, Any]:
        """The peer's server checksums the parity a stripe completed and hands it over."""
        if not peer.alive:  # its memory went with it
            return Dead
        checked = {"acc": acc, "checksum": acc.finish(room), "generation": job.generation}
        yield Ask(peer, "parity_checked", checked)
        return True

    def _room(
        self, job: ae.Replicate, node: int, op: str, ask: dict[str, Any]
    ) -> Generator[Any, Any, tuple[SimHost, Any] | None]:
        """Ask ``node``'s host for room (``op``), again while its slots are being made:
        the host and its answer, or None (refused, or the host is gone: reported)."""
        peer = self.sim.host_at(self.addresses.get(node))
        if peer is None:
            self._failed(job, node, "refused")
            return None
        since = self.sim.now
        while True:
            if self.sim.now - since >= FILL_LIMIT_S:  # as the real server: the last refuses
                ask = {**ask, "wait": False}
            try:
                got = yield Ask(peer, op, ask)
            except ProcessDied as died:  # the room it was given goes back, as its
                room = died.args[0] if died.args else None  # connection closes there
                if isinstance(room, tuple):
                    token = room[0]
                    done = "replica_written" if op == "replica_slot" else "parity_added"
                    peer.ask(done, self._cut(job, ask, token))
                raise
            if got != FILLING:
                break
            yield 0.005
        if got is Dead:
            self._failed(job, node, "peer gone")
        return None if got is Dead or got is None else (peer, got)

    def _cut(self, job: ae.Replicate, ask: dict[str, Any], token: Any) -> dict[str, Any]:
        """What a peer's server tells its loop of a transfer its sender died in."""
        fields = {"rank": job.rank, "step": job.step, "generation": job.generation}
        cut = {**fields, "ok": False, "why": p.CUT_OFF}
        if "unit" not in ask:  # a replica's slot
            return {**cut, "token": token}
        member = p.ParityMember(rank=job.rank, stripe=-1, nbytes=0, unit=ask["unit"],
                                layout=job.layout, tree={}, checksum="")  # fmt: skip
        return {**cut, "acc": token, "member": member}

    def _failed(self, job: ae.Replicate, node: int, error: str) -> None:
        self.feed(ae.ReplicationFailed(job.rank, job.step, node, error, job.generation, cut=True))

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

"""The agent's tier-1 parts: the replicas it holds for peers, and the sender of its own.

Both are driven from the agent's event loop (ring bookkeeping is single-threaded); bytes
move on the replica server's connection threads and on the replicator's pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from tierswap.checksum import checksum_chunks
from tierswap.config import Injection
from tierswap.shm import populated
from tierswap.state import Layout
from tierswap.tiers import durable
from tierswap.tiers.deltas import Base, BaseKeeper, DeltaRing, Entry
from tierswap.tiers.memory import RankRing, Slot, SlotState
from tierswap.tiers.peer import Lease, push, push_delta
from tierswap.wire import Address, Channel

SEND_LIMIT_S = 30.0
"""A replica send to a peer that stopped acknowledging fails after this long (a host gone
without a reset): the transfer is reported failed and the rank's next one can go."""

Report = Callable[..., None]
"""``report(op, **fields)``: tell the coordinator."""


class PeerStore:
    """Replicas this node holds for ranks of other nodes: per rank a ring of full
    snapshots in shared memory (``--memory-tiers full``) or a base and its deltas
    (``delta``)."""

    def __init__(
        self,
        job_id: str,
        nslots: int,
        max_bytes: int,
        report: Report,
        mode: str = "full",
        threshold: float = 0.5,
    ) -> None:
        self.job_id = job_id
        self.nslots = nslots
        self.max_bytes = max_bytes
        self.report = report
        self.delta = mode == "delta"
        self.threshold = threshold
        self.rings: dict[int, RankRing] = {}
        self.drings: dict[int, DeltaRing] = {}
        self.protects: list[int] = []
        self.corrupt: list[Injection] = []
        self.peak = 0
        self.generation = -1
        """Replicas sent in an older generation are refused: they may be of a timeline a
        restore went back from, and would arrive after :meth:`discard_after`."""

    def _all(self) -> list[RankRing | DeltaRing]:
        return [*self.rings.values(), *self.drings.values()]

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self._all())

    def _fits(self, rank: int, layout: Layout) -> bool:
        """Whether the replicas of every protected rank fit ``--max-peer-memory``: full
        snapshots in every slot, or two bases (one being renewed) and deltas at most
        ``threshold`` of a snapshot in every slot."""
        per_rank = self.nslots if not self.delta else 2 + self.nslots * self.threshold
        need = int(per_rank * layout.nbytes * max(len(self.protects), 1))
        if self.max_bytes and need > self.max_bytes:
            self.report(
                "peer_memory_exceeded",
                rank=rank,
                need=need,
                limit=self.max_bytes,
                ranks=self.protects,
            )
            return False
        return True

    def _stale(self, rank: int, step: int, generation: int) -> bool:
        if generation >= self.generation:
            return False
        self._rejected(
            rank, step, f"sent in generation {generation}, now {self.generation}", generation
        )
        return True

    def slot(
        self, rank: int, step: int, layout: Layout, generation: int = -1
    ) -> tuple[Any, memoryview] | None:
        """Where to receive a full replica of ``step`` of ``rank``: (token, buffer), or None
        (no room, or sent in an ended generation: skipped). The token goes back to
        :meth:`written`."""
        if self._stale(rank, step, generation):
            return None
        if self.delta:
            dring = self.drings.get(rank)
            if (dring is None or dring.layout() != layout) and not self._fits(rank, layout):
                return None
            buf = populated(layout.nbytes)
            return buf, buf
        ring = self.rings.setdefault(rank, RankRing(self.job_id, rank, self.nslots))
        if ring.alloc is None or ring.alloc.layout != layout:
            if not self._fits(rank, layout):
                return None
            ring.allocate(layout)
            self.report("memory", rank=rank, tier=1, nbytes=ring.nbytes())
        assert ring.alloc is not None
        index, dropped = ring.begin_write(step, ring.alloc.id)
        if dropped:
            self.report("replica_dropped", rank=rank, steps=dropped)
        if index is None:
            self._rejected(rank, step, "no free slot", generation)
            return None
        slot = ring.alloc.slots[index]
        return slot, slot.segment.buf

    def received(self, rank: int, step: int, buf: memoryview) -> None:
        """Bytes are in, checksum not yet checked: where in-flight corruption is injected."""
        self._inject(rank, step, buf, "flight")

    def written(
        self,
        rank: int,
        token: Any,
        ok: bool,
        step: int,
        layout: Layout | None = None,
        tree: dict[str, Any] | None = None,
        checksum: str = "",
        why: str = "",
        generation: int = -1,
    ) -> None:
        """A full replica arrived (``ok``: its checksum matched): hold it, or free its room."""
        if ok and generation < self.generation:  # a generation ended while it was in flight
            ok, why = False, f"sent in generation {generation}, now {self.generation}"
        if self.delta:
            if ok and layout is not None:
                self._put(rank, Entry(step, Base(step, layout, token, checksum, tree or {}),
                                      None, tree or {}, checksum))  # fmt: skip
                self._inject(rank, step, token, "base")
                self._inject(rank, step, token, "memory")
            else:
                self._rejected(rank, step, why or "checksum mismatch", generation)
            return
        slot: Slot = token
        ring = self.rings[rank]
        if not ok or ring.alloc is None or slot not in ring.alloc.slots:
            slot.state, slot.step = SlotState.FREE, -1
            why = why or ("checksum mismatch" if not ok else "slot gone")
            self._rejected(rank, step, why, generation)
            return
        ring.written(slot.index, step, ring.alloc.id, tree or {})
        ring.checked(slot, checksum)
        self._inject(rank, step, slot.segment.buf, "memory")
        self.report("replica_held", rank=rank, step=step)

    def base(self, rank: int, step: int, checksum: str, generation: int = -1) -> Base | None:
        """The base a delta of ``rank`` is made against, if held (else the sender sends it)."""
        if generation < self.generation:
            return None
        dring = self.drings.get(rank)
        return None if dring is None else dring.base(step, checksum)

    def delta_written(
        self,
        rank: int,
        step: int,
        base: Base,
        data: bytearray,
        tree: dict[str, Any],
        checksum: str,
        ok: bool,
        why: str = "",
        generation: int = -1,
        base_durable: str | None = None,
    ) -> None:
        """A delta arrived (``ok``: its own checksum matched): hold it against ``base``,
        which tier 2 also holds under ``base_durable`` once the sender wrote it there."""
        if ok and generation < self.generation:
            ok, why = False, f"sent in generation {generation}, now {self.generation}"
        if not ok:
            self._rejected(rank, step, why, generation)
            return
        if base_durable and base.durable is None:
            base.durable = base_durable
        self._put(rank, Entry(step, base, data, tree, checksum))
        self._inject(rank, step, memoryview(data), "memory")

    def _put(self, rank: int, entry: Entry) -> None:
        dring = self.drings.setdefault(rank, DeltaRing(rank, self.nslots))
        dropped = dring.put(entry)
        if entry.step in dropped:
            self.report("replica_dropped", rank=rank, steps=dropped)
            return
        if dropped:
            self.report("replica_dropped", rank=rank, steps=dropped)
        held = self.nbytes()
        if self.max_bytes and held > self.max_bytes:  # bases pinned by old steps, say
            del dring.entries[entry.step]
            why = f"--max-peer-memory {self.max_bytes:,} reached"
            self._rejected(rank, entry.step, why, self.generation)
            return
        if held > self.peak:  # the peak is what a node must have room for
            self.peak = held
            self.report("memory", rank=rank, tier=1, nbytes=held, scope="node")
        self.report("replica_held", rank=rank, step=entry.step)

    def _rejected(self, rank: int, step: int, why: str, generation: int) -> None:
        """A replica of ``step`` sent in ``generation`` is not held here: the coordinator
        logs it and, in that generation, stops waiting for the step in tier 1."""
        self.report("replica_rejected", rank=rank, step=step, why=why, generation=generation)

    def _inject(self, rank: int, step: int, buf: memoryview, where: str) -> None:
        for inj in self.corrupt:
            if inj.where == where and inj.index == rank and step >= inj.step and len(buf):
                buf[len(buf) // 2] ^= 0xFF

    def lease(self, rank: int, step: int) -> Lease | None:
        """A held replica to serve to a restoring worker; give it back with :meth:`unlease`."""
        if self.delta:
            dring = self.drings.get(rank)
            entry = None if dring is None else dring.entries.get(step)
            if entry is None:
                return None
            where = f"tier-1 delta of rank {rank} step {step} (base step {entry.base.step})"
            return Lease(
                entry.base.layout,
                entry.tree,
                entry.checksum,
                partial(entry.rebuild, rank, where),
                kind=entry.kind,
                base_step=entry.base.step,
            )
        ring = self.rings.get(rank)
        slot = None if ring is None else ring.lease(step)
        if slot is None or ring is None:
            return None
        buf = slot.segment.buf
        return Lease(ring.layout(), slot.tree, slot.checksum, lambda: buf, slot)

    def unlease(self, rank: int, token: Any) -> None:
        if isinstance(token, Slot):
            self.rings[rank].unlease(token)

    def holdings(self) -> dict[str, dict[str, str]]:
        out = {
            str(r): {str(s): x.checksum for s, x in ring.held().items()}
            for r, ring in self.rings.items()
        }
        for r, dring in self.drings.items():
            out[str(r)] = {str(s): c for s, c in dring.held().items()}
        return out

    def kinds(self) -> dict[str, dict[str, str]]:
        """rank -> step -> "delta" or "delta+durable" for the replicas a restore must decode
        first (the second after reading its base back from tier 2)."""
        return {
            str(r): {str(s): k for s, k in d.kinds().items() if k != "base"}
            for r, d in self.drings.items()
        }

    def verify(self) -> list[tuple[int, int]]:
        """Check every held replica; a corrupt one is freed and returned (rank, step)."""
        bad = []
        for rank, ring in self.rings.items():
            for step, slot in ring.held().items():
                if checksum_chunks(ring.layout().chunks(slot.segment.buf)) != slot.checksum:
                    slot.state, slot.step = SlotState.FREE, -1
                    bad.append((rank, step))
        for rank, dring in self.drings.items():
            in_memory = [b for b in dring.bases() if b.buf is not None]
            bad.extend((rank, step) for step in dring.verify())
            for b in in_memory:
                if b.buf is None:
                    kept = sorted(s for s, e in dring.entries.items() if e.base is b)
                    self.report("replica_base_lost", rank=rank, step=b.step, kept=kept)
        return bad

    def propose(self, step: int, ranks: list[int]) -> bool:
        held: dict[int, RankRing | DeltaRing] = {**self.rings, **self.drings}
        ok = all(r in held and held[r].propose(step) for r in ranks)
        if not ok:
            self.abort(step)
        return ok

    def committed(self, step: int) -> None:
        for ring in self._all():
            ring.set_committed(step)

    def abort(self, step: int) -> None:
        for ring in self._all():
            ring.abort(step)

    def discard_after(self, step: int, committed: int) -> None:
        for ring in self._all():
            ring.discard_after(step)
            ring.protect(committed)

    def close(self) -> None:
        for ring in self._all():
            ring.close()


class Replicator:
    """Sends each rank's newest snapshot to its peers; one transfer in flight per rank."""

    def __init__(
        self,
        secret: bytes,
        node: int,
        post: Callable[..., None],
        threads: int,
        keeper: BaseKeeper | None = None,
        base_root: str | None = None,
        world_size: int = 0,
    ) -> None:
        self.secret = secret
        self.keeper = keeper
        """Set for ``--memory-tiers delta``: each rank's base, and when to renew it."""
        self.base_root = base_root
        """Delta mode with ``--persist``: every base is also written to tier 2 here (in this
        thread, after it went to the peers), so a peer that loses it can read it back."""
        self.world_size = world_size
        self.persisted: dict[int, list[int]] = {}
        """rank -> base steps written under ``base_root``, oldest first (two are kept)."""
        self.node = node
        self.post = post
        self.targets: dict[int, tuple[int, ...]] = {}
        self.addresses: dict[int, Address] = {}
        self.busy: set[int] = set()
        self.pending: set[int] = set()
        self.announce: Callable[..., None] | None = None
        """Called as each transfer starts (fault injection cuts transfers in flight)."""
        self.sent: dict[int, int] = {}
        self.generation = -1
        self.delay = 0.0
        """Seconds each transfer is held before it goes (``--inject delay:...``, tests)."""
        self._chans: dict[tuple[int, int], tuple[Address, Channel]] = {}
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(
            max_workers=max(threads, 1), thread_name_prefix="tierswap-replicate"
        )

    def configure(
        self, targets: dict[int, tuple[int, ...]], addresses: Mapping[int, Address]
    ) -> None:
        self.targets, self.addresses = targets, dict(addresses)
        with self._lock:  # a node replaced or gone: a transfer stuck on it fails now
            gone = [k for k, (a, _) in self._chans.items() if self.addresses.get(k[1]) != a]
            stale = [self._chans.pop(k)[1] for k in gone]
        for chan in stale:
            chan.close()

    def offer(self, rank: int, ring: RankRing) -> None:
        """A new snapshot of ``rank`` is held: send the newest one when the line is free."""
        if not self.targets.get(rank):
            return
        if rank in self.busy:
            self.pending.add(rank)
            return
        held = ring.held()
        step = max(held, default=-1)
        if step <= self.sent.get(rank, -1):
            return
        slot = ring.lease(step)
        assert slot is not None
        self.busy.add(rank)
        epoch = None if self.keeper is None else self.keeper.epoch
        self.pool.submit(self._send, rank, step, slot, ring.layout(), epoch, self.generation)

    def done(self, rank: int, step: int, ring: RankRing, generation: int) -> None:
        self.busy.discard(rank)
        if generation == self.generation:  # a step of an ended generation was not sent now
            self.sent[rank] = max(self.sent.get(rank, -1), step)
        if rank in self.pending:
            self.pending.discard(rank)
            self.offer(rank, ring)

    def reset(self, restart: int, generation: int) -> None:
        """A new generation that restarts from ``restart``: the same steps may be sent
        again, a base taken after ``restart`` is of an abandoned timeline, and a transfer
        queued before now is not sent (peers would refuse it anyway)."""
        self.generation = generation
        self.sent.clear()
        if self.keeper is not None:
            self.keeper.discard_after(restart)

    def _send(
        self, rank: int, step: int, slot: Slot, layout: Layout, epoch: int | None, generation: int
    ) -> None:
        results: dict[int, bool] = {}
        stats: dict[str, Any] = {}
        try:
            time.sleep(self.delay)
            if generation != self.generation:
                return  # queued before a restore went back: maybe of an abandoned timeline
            try:
                send, base = self._sender(rank, step, slot, layout, epoch, generation, stats)
            except Exception as e:  # the encode failed (memory, say): reported, not fatal
                stats.clear()
                for node in self.targets.get(rank, ()):
                    results[node] = False
                    self.post(
                        "replicate_failed",
                        rank=rank,
                        step=step,
                        node=node,
                        error=f"{e!r}",
                        generation=generation,
                    )
                return
            for node in self.targets.get(rank, ()):
                try:
                    chan = self._channel(rank, node)
                    if self.announce is not None:
                        self.announce(rank=rank, step=step, peer=node)
                    results[node] = send(chan)
                except Exception as e:  # any failure: a fresh connection next time, reported
                    self._drop(rank, node)
                    results[node] = False
                    error = f"{type(e).__name__}: {e}"
                    self.post(
                        "replicate_failed",
                        rank=rank,
                        step=step,
                        node=node,
                        error=error,
                        generation=generation,
                    )
            if base is not None and base.step == step and self.base_root is not None:
                self._persist_base(rank, base)
        finally:  # always: the slot is unleased and the rank's next snapshot can go
            self.post(
                "replicated",
                rank=rank,
                step=step,
                slot=slot,
                results=results,
                generation=generation,
                **stats,
            )

    def _sender(
        self,
        rank: int,
        step: int,
        slot: Slot,
        layout: Layout,
        epoch: int | None,
        generation: int,
        stats: dict[str, Any],
    ) -> tuple[Callable[[Channel], bool], Base | None]:
        """How ``step`` of ``rank`` goes to each peer: the full snapshot, or (delta mode) a
        delta against the rank's base, preceded by the base for a peer that lacks it. The
        delta is encoded once, here, in the agent; ``stats`` gets its size and time."""
        buf, g = slot.segment.buf, generation
        if self.keeper is None:
            return (
                lambda chan: push(chan, rank, step, layout, slot.tree, slot.checksum, buf, g)
            ), None
        base, new = self.keeper.base_for(rank, step, layout, buf, slot.checksum, slot.tree, epoch)
        if new:
            stats.update(full=layout.nbytes, kind="base", nbytes=layout.nbytes)
            return (
                lambda chan: push(chan, rank, step, layout, slot.tree, slot.checksum, buf, g)
            ), base
        t0 = time.perf_counter()
        data = self.keeper.encode(rank, base, buf)
        stats.update(
            full=layout.nbytes, kind="delta", nbytes=len(data), encode_s=time.perf_counter() - t0
        )

        def send(chan: Channel) -> bool:
            ok = push_delta(chan, rank, step, base, data, slot.tree, slot.checksum, g)
            if ok is None:  # the peer lacks the base (new, or it dropped it): base first
                b = base
                assert b.buf is not None
                if not push(chan, rank, b.step, b.layout, b.tree, b.checksum, b.buf, g):
                    return False
                ok = push_delta(chan, rank, step, base, data, slot.tree, slot.checksum, g)
            return bool(ok)

        return send, base

    def _persist_base(self, rank: int, base: Base) -> None:
        """Write a new base to tier 2 (``base_root``) and drop the one before the last."""
        assert self.base_root is not None and base.buf is not None
        try:
            durable.write_part(
                self.base_root, base.step, rank, self.world_size, base.layout, base.tree,
                base.buf, base.checksum,
            )  # fmt: skip
            base.durable = self.base_root
            steps = self.persisted.setdefault(rank, [])
            steps.append(base.step)
            while len(steps) > 2:  # peers may still hold steps on the previous one
                durable.remove_part(self.base_root, steps.pop(0), rank)
        except Exception as e:  # reported; the peers still hold the base in memory
            error = f"base to tier 2: {e!r}"
            self.post("replicate_failed", rank=rank, step=base.step, node=-1, error=error)

    def _channel(self, rank: int, node: int) -> Channel:
        address = self.addresses[node]
        with self._lock:
            cached = self._chans.get((rank, node))
        if cached is not None and cached[0] == address:
            return cached[1]
        if cached is not None:
            cached[1].close()
        chan = Channel.connect(address, self.secret)
        chan.give_up_after(SEND_LIMIT_S)
        with self._lock:
            self._chans[(rank, node)] = (address, chan)
        return chan

    def _drop(self, rank: int, node: int) -> None:
        with self._lock:
            cached = self._chans.pop((rank, node), None)
        if cached is not None:
            cached[1].close()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for _, chan in self._chans.values():
                chan.close()
            self._chans.clear()

"""The agent's tier-1 parts: the replicas it holds for peers, and the sender of its own.

Both are driven from the agent's event loop (ring bookkeeping is single-threaded); bytes
move on the replica server's connection threads and on the replicator's pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tierswap.checksum import checksum_chunks
from tierswap.config import Injection
from tierswap.state import Layout
from tierswap.tiers.memory import RankRing, Slot, SlotState
from tierswap.tiers.peer import push
from tierswap.wire import Address, Channel

Report = Callable[..., None]
"""``report(op, **fields)``: tell the coordinator."""


class PeerStore:
    """Replicas this node holds for ranks of other nodes: one slot ring per rank."""

    def __init__(self, job_id: str, nslots: int, max_bytes: int, report: Report) -> None:
        self.job_id = job_id
        self.nslots = nslots
        self.max_bytes = max_bytes
        self.report = report
        self.rings: dict[int, RankRing] = {}
        self.protects: list[int] = []
        self.corrupt: list[Injection] = []

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self.rings.values())

    def slot(self, rank: int, step: int, layout: Layout) -> Slot | None:
        """A slot to receive ``step`` of ``rank`` into, or None (no room: skipped)."""
        ring = self.rings.setdefault(rank, RankRing(self.job_id, rank, self.nslots))
        if ring.alloc is None or ring.alloc.layout != layout:
            need = self.nslots * layout.nbytes * max(len(self.protects), 1)
            if self.max_bytes and need > self.max_bytes:
                self.report(
                    "peer_memory_exceeded",
                    rank=rank,
                    need=need,
                    limit=self.max_bytes,
                    ranks=self.protects,
                )
                return None
            ring.allocate(layout)
            self.report("memory", rank=rank, tier=1, nbytes=ring.nbytes())
        assert ring.alloc is not None
        index, dropped = ring.begin_write(step, ring.alloc.id)
        if dropped:
            self.report("replica_dropped", rank=rank, steps=dropped)
        return None if index is None else ring.alloc.slots[index]

    def received(self, rank: int, step: int, slot: Slot) -> None:
        """Bytes are in, checksum not yet checked: where in-flight corruption is injected."""
        self._inject(rank, step, slot, "flight")

    def written(
        self,
        rank: int,
        slot: Slot,
        ok: bool,
        step: int,
        tree: dict[str, Any] | None = None,
        checksum: str = "",
        why: str = "",
    ) -> None:
        ring = self.rings[rank]
        if not ok or ring.alloc is None or slot not in ring.alloc.slots:
            slot.state, slot.step = SlotState.FREE, -1
            self.report(
                "replica_rejected",
                rank=rank,
                step=step,
                why=why or ("checksum mismatch" if not ok else "slot gone"),
            )
            return
        ring.written(slot.index, step, ring.alloc.id, tree or {})
        ring.checked(slot, checksum)
        self._inject(rank, step, slot, "memory")
        self.report("replica_held", rank=rank, step=step)

    def _inject(self, rank: int, step: int, slot: Slot, where: str) -> None:
        for inj in self.corrupt:
            if inj.where == where and inj.index == rank and step >= inj.step:
                slot.segment.buf[slot.segment.size // 2] ^= 0xFF

    def lease(self, rank: int, step: int) -> tuple[Slot, Layout] | None:
        ring = self.rings.get(rank)
        slot = None if ring is None else ring.lease(step)
        return None if slot is None or ring is None else (slot, ring.layout())

    def unlease(self, rank: int, slot: Slot) -> None:
        self.rings[rank].unlease(slot)

    def holdings(self) -> dict[str, dict[str, str]]:
        return {
            str(r): {str(s): x.checksum for s, x in ring.held().items()}
            for r, ring in self.rings.items()
        }

    def verify(self) -> list[tuple[int, int]]:
        """Check every held replica; a corrupt one is freed and returned (rank, step)."""
        bad = []
        for rank, ring in self.rings.items():
            for step, slot in ring.held().items():
                if checksum_chunks(ring.layout().chunks(slot.segment.buf)) != slot.checksum:
                    slot.state, slot.step = SlotState.FREE, -1
                    bad.append((rank, step))
        return bad

    def propose(self, step: int, ranks: list[int]) -> bool:
        ok = all(r in self.rings and self.rings[r].propose(step) for r in ranks)
        if not ok:
            self.abort(step)
        return ok

    def committed(self, step: int) -> None:
        for ring in self.rings.values():
            ring.set_committed(step)

    def abort(self, step: int) -> None:
        for ring in self.rings.values():
            ring.abort(step)

    def discard_after(self, step: int, committed: int) -> None:
        for ring in self.rings.values():
            ring.discard_after(step)
            ring.protect(committed)

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()


class Replicator:
    """Sends each rank's newest snapshot to its peers; one transfer in flight per rank."""

    def __init__(self, secret: bytes, node: int, post: Callable[..., None], threads: int) -> None:
        self.secret = secret
        self.node = node
        self.post = post
        self.targets: dict[int, tuple[int, ...]] = {}
        self.addresses: dict[int, Address] = {}
        self.busy: set[int] = set()
        self.pending: set[int] = set()
        self.announce: Callable[..., None] | None = None
        """Called as each transfer starts (fault injection cuts transfers in flight)."""
        self.sent: dict[int, int] = {}
        self._chans: dict[tuple[int, int], tuple[Address, Channel]] = {}
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(
            max_workers=max(threads, 1), thread_name_prefix="tierswap-replicate"
        )

    def configure(
        self, targets: dict[int, tuple[int, ...]], addresses: Mapping[int, Address]
    ) -> None:
        self.targets, self.addresses = targets, dict(addresses)

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
        self.pool.submit(self._send, rank, step, slot, ring.layout())

    def done(self, rank: int, step: int, ring: RankRing) -> None:
        self.busy.discard(rank)
        self.sent[rank] = max(self.sent.get(rank, -1), step)
        if rank in self.pending:
            self.pending.discard(rank)
            self.offer(rank, ring)

    def reset(self) -> None:
        """A new generation: the same steps may be sent again."""
        self.sent.clear()

    def _send(self, rank: int, step: int, slot: Slot, layout: Layout) -> None:
        results = {}
        try:
            for node in self.targets.get(rank, ()):
                try:
                    chan = self._channel(rank, node)
                    if self.announce is not None:
                        self.announce(rank=rank, step=step, peer=node)
                    results[node] = push(
                        chan, rank, step, layout, slot.tree, slot.checksum, slot.segment.buf
                    )
                except Exception as e:  # any failure: a fresh connection next time, reported
                    self._drop(rank, node)
                    results[node] = False
                    self.post(
                        "replicate_failed", rank=rank, node=node, error=f"{type(e).__name__}: {e}"
                    )
        finally:  # always: the slot is unleased and the rank's next snapshot can go
            self.post("replicated", rank=rank, step=step, slot=slot, results=results)

    def _channel(self, rank: int, node: int) -> Channel:
        address = self.addresses[node]
        with self._lock:
            cached = self._chans.get((rank, node))
        if cached is not None and cached[0] == address:
            return cached[1]
        if cached is not None:
            cached[1].close()
        chan = Channel.connect(address, self.secret)
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

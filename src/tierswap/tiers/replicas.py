"""Tier 1, a node's side: the replicas it holds for ranks of other nodes.

Per protected rank, a ring of full snapshots in shared memory (``--memory-tiers full``) or
a base and its deltas (``delta``). Driven from the agent's event loop (the bookkeeping is
single-threaded); the bytes move on the replica server's connection threads, which ask
the loop for room and hand it what arrived. A step is *complete* here once every
protected rank holds it; the agent holds one complete step at a time for tier 1's commit
(``control/commits.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial
from typing import Any

from tierswap.checksum import checksum_chunks
from tierswap.control import protocol as p
from tierswap.faults import Injection
from tierswap.layout import Layout
from tierswap.shm import Segment, populated
from tierswap.tiers.deltas import Base, DeltaRing, Entry
from tierswap.tiers.memory import FILLING, RankRing, SegmentFactory, Slot, SlotState
from tierswap.tiers.parity import Accumulation, parity_layout
from tierswap.tiers.peer import Lease

Report = Callable[[p.Message, int], None]
"""``report(message, generation)``: tell the coordinator."""


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
        create: SegmentFactory = Segment.create,
    ) -> None:
        self.job_id = job_id
        self.create = create
        self.nslots = nslots
        self.max_bytes = max_bytes
        self.report = report
        self.delta = mode == "delta"
        self.threshold = threshold
        self.rings: dict[int, RankRing] = {}
        self.drings: dict[int, DeltaRing] = {}
        self.left: list[RankRing] = []
        """Rings of ranks this node no longer protects (the job was resized), kept only
        while a slot of theirs is leased."""
        self.protects: list[int] = []
        self.corrupt: list[Injection] = []
        self.peak = 0
        self.later = False
        """Make a ring's first slot at once and leave the others in its ``wanted``, as
        tier 0 does (set by the agent's core, which has them made on a thread)."""
        self.generation = -1
        """Replicas sent in an older generation are refused: they may be of a timeline a
        restore went back from, and would arrive after :meth:`discard_after`."""
        self.open = True
        """False from the moment the node reported what it holds at a generation's end
        until the next generation starts: a late replica then is refused, since taking its
        room could drop a step the coordinator is planning a restore from."""
        self.parity: dict[int, list[int]] = {}
        """``--peer-parity``: key of each parity held here -> the ranks it is the XOR of
        (its ring is ``rings[key]``)."""
        self.accs: dict[int, dict[int, Accumulation]] = {}
        """key -> step -> a parity being made as its stripes arrive."""
        self.done = -1
        """The newest step tier 1 is done with here (committed or settled): a stripe of it
        or an older one is refused (``--peer-parity``)."""
        self.dropped: set[tuple[int, int]] = set()
        """(key, step) of parities given up in this generation: a late stripe of one would
        begin it anew, and it could never be complete."""
        self.units: dict[int, int] = {}
        """key -> the longest stripe unit seen: the size its slots are made at (ranks of a
        set may hold states of different sizes; the first step that shows it is lost)."""

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
            msg = p.PeerMemoryExceeded(
                rank=rank, need=need, limit=self.max_bytes, ranks=list(self.protects)
            )
            self.report(msg, self.generation)
            return False
        return True

    def _refusal(self, generation: int) -> str | None:
        """Why a replica sent in ``generation`` is not taken now, or None."""
        if generation < self.generation:
            return f"sent in generation {generation}, now {self.generation}"
        if not self.open:
            return "arrived after this node reported its holdings, before the next generation"
        return None

    def _stale(self, rank: int, step: int, generation: int) -> bool:
        why = self._refusal(generation)
        if why is not None:
            self._rejected(rank, step, why, generation)
        return why is not None

    def slot(
        self, rank: int, step: int, layout: Layout, generation: int = -1, wait: bool = False
    ) -> tuple[Any, memoryview] | str | None:
        """Where to receive a full replica of ``step`` of ``rank``: (token, buffer), or None
        (no room, or sent in an ended generation: skipped). The token goes back to
        :meth:`written`. With ``wait``, :data:`FILLING` when no slot is free only because
        the ring's slots are still being made or one is held for a commit: the server asks
        again (for at most ``FILL_LIMIT_S``)."""
        if self._stale(rank, step, generation):
            return None
        if self.delta:
            dring = self.drings.get(rank)
            if (dring is None or dring.layout() != layout) and not self._fits(rank, layout):
                return None
            buf = populated(layout.nbytes)
            return buf, buf
        ring = self.rings.get(rank)
        if ring is None:
            ring = self.rings[rank] = RankRing(self.job_id, rank, self.nslots, self.create)
        if (ring.alloc is None or ring.alloc.layout != layout) and not self._made(ring, layout):
            return None
        slot = self._begin(ring, rank, step, generation, wait)
        return slot if not isinstance(slot, Slot) else (slot, slot.segment.buf)

    def _made(self, ring: RankRing, layout: Layout) -> bool:
        """``ring``'s slots made anew for ``layout`` (reported), if they fit."""
        if not self._fits(ring.rank, layout):
            return False
        ring.allocate(layout, now=1 if self.later else None)
        sizes = [layout.nbytes] * self.nslots
        self.report(
            p.Memory(rank=ring.rank, tier=1, nbytes=ring.nbytes(), segments=sizes), self.generation
        )
        return True

    def _begin(
        self, ring: RankRing, rank: int, step: int, generation: int, wait: bool
    ) -> Slot | str | None:
        """A slot of ``ring`` to write ``step`` (of ``rank``) into; FILLING, or None
        (refused, and reported so)."""
        assert ring.alloc is not None
        index, _ = ring.begin_write(step, ring.alloc.id)
        if ring.gave_way is not None:  # held for no commit yet: it can no longer be
            self._rejected(rank, ring.gave_way, f"gave way to step {step}", generation)
        if index is None and wait and (ring.filling() or ring.proposed):
            # slots still being made, or one held for a commit whose answer is on its way:
            # the committed step's slot is free once it comes (a ring of 2 met a replica
            # that came before its peer heard of the commit, and refused it)
            return FILLING
        if index is None:
            self._rejected(rank, step, "no free slot", generation)
            return None
        return ring.slot(ring.alloc.id, index)

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
        refused = self._refusal(generation)  # a generation ended while it was in flight
        if ok and refused is not None:
            ok, why = False, refused
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

    def base(self, rank: int, step: int, checksum: str, generation: int = -1) -> Base | None:
        """The base a delta of ``rank`` is made against, if held (else the sender sends it)."""
        if self._refusal(generation) is not None:
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
        refused = self._refusal(generation)
        if ok and refused is not None:
            ok, why = False, refused
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
            return
        held = self.nbytes()
        if self.max_bytes and held > self.max_bytes:  # bases pinned by old steps, say
            del dring.entries[entry.step]
            why = f"--max-peer-memory {self.max_bytes:,} reached"
            self._rejected(rank, entry.step, why, self.generation)
            return
        if held > self.peak:  # the peak is what a node must have room for
            self.peak = held
            self.report(p.Memory(rank=rank, tier=1, nbytes=held, scope="node"), self.generation)

    def _rejected(self, rank: int, step: int, why: str, generation: int) -> None:
        """A replica of ``step`` sent in ``generation`` is not held here: the coordinator
        logs it and, in that generation, stops waiting for the step in tier 1."""
        self.report(p.ReplicaRejected(rank=rank, step=step, why=why), generation)

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
        if not isinstance(token, Slot):
            return
        for ring in [r for r in (self.rings.get(rank), *self.left) if r is not None]:
            allocs = [a for a in (ring.alloc, *ring.retired) if a is not None]
            if any(token in a.slots for a in allocs):
                ring.unlease(token)
                break
        self.left = [ring for ring in self.left if ring.retired]

    def keep_only(self, ranks: list[int]) -> None:
        """Drop the replicas of ranks this node no longer protects (the job was resized,
        its ranks placed anew): full slots go once no transfer leases them; a delta
        ring's memory once no reader holds it."""
        for key in [k for k in self.accs if k not in ranks]:
            for s in list(self.accs[key]):
                self._drop_parity(key, s, None)
            del self.accs[key]
        for r in [r for r in self.rings if r not in ranks]:
            ring = self.rings.pop(r)
            ring.retire()
            if ring.retired:
                self.left.append(ring)
        for r in [r for r in self.drings if r not in ranks]:
            del self.drings[r]

    def holdings(self) -> dict[int, dict[int, str]]:
        out = {r: {s: x.checksum for s, x in ring.held().items()} for r, ring in self.rings.items()}
        for r, dring in self.drings.items():
            out[r] = dring.held()
        return out

    def kinds(self) -> dict[int, dict[int, str]]:
        """rank -> step -> "delta" or "delta+durable" for the replicas a restore must decode
        first (the second after reading its base back from tier 2)."""
        return {
            r: {s: k for s, k in d.kinds().items() if k != "base"} for r, d in self.drings.items()
        }

    def holds_everywhere(self, step: int) -> bool:
        """Whether every protected rank holds ``step``."""
        held: dict[int, RankRing | DeltaRing] = {**self.rings, **self.drings}
        return all(r in held and step in held[r].held() for r in self.protects)

    def newest_complete(self) -> int:
        """The newest step held for every protected rank (-1 when there is none)."""
        return max(self.complete(), default=-1)

    def complete(self) -> set[int]:
        """The steps held for every protected rank (or parity)."""
        held: dict[int, RankRing | DeltaRing] = {**self.rings, **self.drings}
        common: set[int] | None = None
        for rank in self.protects:
            ring = held.get(rank)
            steps = set() if ring is None else set(ring.held())
            common = steps if common is None else common & steps
            if not common:
                return set()
        return common or set()

    def verify(
        self, ranks: Collection[int] | None = None, gen: int | None = None
    ) -> list[tuple[int, int]]:
        """Check held replicas of ``ranks`` (``None``: of every rank) before the node
        reports them; a corrupt one is freed and returned (rank, step). Of full replicas,
        each rank's newest ones down to the first sound one at or below the step committed
        in tier 1: a restore takes the newest step every rank holds, which is that one or
        a newer one; of parities, those a rank of ``ranks`` is in. A replica not checked
        here and found corrupt by the worker that fetches it (which checks every replica as
        it arrives) costs a generation, never a wrong bit; each one checked here is a read
        of all its bytes on the recovery's critical path, so the coordinator names only
        the ranks of a lost node: a failed worker's rank comes back from its node's tier 0.
        Delta replicas are all checked, whatever ``ranks``: a corrupt base dropped here is
        what makes its sender send a new one (until then every delta made against it is
        unusable). A base lost is reported in generation ``gen`` (the asking stop's; by
        default this store's)."""
        wanted = None if ranks is None else set(ranks)
        bad = []
        for rank, ring in self.rings.items():
            if wanted is not None and wanted.isdisjoint(self.parity.get(rank, [rank])):
                continue
            for step, slot in sorted(ring.held().items(), reverse=True):
                if checksum_chunks(ring.layout().chunks(slot.segment.buf)) == slot.checksum:
                    if step <= ring.committed:
                        break
                    continue
                slot.state, slot.step = SlotState.FREE, -1
                bad.append((rank, step))
        for rank, dring in self.drings.items():  # every one: see above
            in_memory = [b for b in dring.bases() if b.buf is not None]
            bad.extend((rank, step) for step in dring.verify())
            for b in in_memory:
                if b.buf is None:
                    kept = sorted(s for s, e in dring.entries.items() if e.base is b)
                    msg = p.ReplicaBaseLost(rank=rank, step=b.step, kept=kept)
                    self.report(msg, self.generation if gen is None else gen)
        return bad

    def propose(self, step: int, ranks: list[int] | None = None) -> bool:
        """Hold ``step`` of ``ranks`` (every protected rank by default) for a commit; if one
        does not hold it, none keeps it."""
        held: dict[int, RankRing | DeltaRing] = {**self.rings, **self.drings}
        ranks = self.protects if ranks is None else ranks
        ok = all(r in held and held[r].propose(step) for r in ranks)
        if not ok:
            self.abort(step)
        return ok

    def committed(self, step: int) -> None:
        for ring in self._all():
            ring.set_committed(step)
        self._done(step, committed=True)

    def settled(self, step: int) -> None:
        """Tier 1 is done with ``step``: it will never be committed (a stripe of it was
        skipped, refused or lost). A parity of it still being made gives its slot back,
        and so does one of an older step, which this node then gives up on (reported, so
        that no node holds it waiting for this one)."""
        self._done(step, committed=False)

    def _done(self, step: int, committed: bool) -> None:
        self.done = max(self.done, step)
        self.dropped = {(k, s) for k, s in self.dropped if s > self.done}
        for key, accs in self.accs.items():
            for s in [s for s in accs if s <= step]:
                quiet = committed or s == step
                self._drop_parity(key, s, None if quiet else f"tier 1 settled step {step}")

    def abort(self, step: int) -> None:
        for ring in self._all():
            ring.abort(step)

    def discard_after(self, step: int, committed: int) -> None:
        for key in list(self.accs):  # a new generation: its stripes come anew
            for s in list(self.accs[key]):
                self._drop_parity(key, s, None)
        self.done, self.dropped = committed, set()
        for ring in self._all():
            ring.discard_after(step)
            ring.protect(committed)

    def close(self) -> None:
        for ring in [*self._all(), *self.left]:
            ring.close()

    # ------------------------------------------------------------ parity (--peer-parity)

    def set_parity(self, held: dict[int, list[int]]) -> None:
        """The parities this node holds in this generation: key -> the ranks in it."""
        self.parity = {k: list(v) for k, v in held.items()}

    def _key(self, rank: int) -> int | None:
        """The parity held here that ``rank``'s stripes go into."""
        for key, ranks in self.parity.items():
            if rank in ranks:
                return key
        return None

    def parity_slot(
        self, rank: int, step: int, unit: int, generation: int = -1, wait: bool = False
    ) -> tuple[Accumulation, memoryview] | str | None:
        """Where a stripe of ``rank``'s ``step`` is folded in: the parity of that step,
        begun here by its first stripe, and its buffer; None when it is not taken (and
        reported so). The caller hands it back with :meth:`parity_added`."""
        if self._stale(rank, step, generation):
            return None
        key = self._key(rank)
        if key is None or step <= self.done or (key, step) in self.dropped:
            why = (
                "this node holds no parity of it"
                if key is None
                else "tier 1 is done with that step"
                if step <= self.done
                else "its parity was given up"
            )
            self._rejected(rank, step, why, generation)
            return None
        accs = self.accs.setdefault(key, {})
        need = self.units[key] = max(unit, self.units.get(key, 0))
        acc = accs.get(step)
        if acc is not None and len(acc.slot.segment.buf) < unit:
            why = f"a stripe of {unit:,} bytes is over its slot: made larger from the next step"
            self._drop_parity(key, step, why, rank)
            return None
        if acc is not None:
            if rank in acc.members or rank in acc.sending:  # the parity being made is kept
                self._rejected(rank, step, "its stripe came twice", generation)
                return None
            acc.sending.add(rank)
            acc.slot.leases += 1
            return acc, acc.slot.segment.buf
        ring = self.rings.get(key)
        if ring is None:
            ring = self.rings[key] = RankRing(self.job_id, key, self.nslots, self.create)
        if step in ring.held():
            self._rejected(rank, step, "its parity is made already", generation)
            return None
        if ring.alloc is None or ring.alloc.layout.nbytes < need:
            for s in list(accs):  # of the old slots
                self._drop_parity(key, s, "its slots were made anew, larger")
            if not self._made(ring, parity_layout(need)):
                return None
        slot = self._begin(ring, rank, step, generation, wait)
        if not isinstance(slot, Slot):
            return slot
        acc = Accumulation(step, slot, frozenset(self.parity[key]), generation)
        acc.sending.add(rank)
        slot.leases += 1
        accs[step] = acc
        return acc, slot.segment.buf

    def parity_added(
        self,
        rank: int,
        step: int,
        acc: Accumulation,
        member: p.ParityMember,
        ok: bool,
        why: str = "",
        generation: int = -1,
    ) -> bool:
        """``rank``'s stripe is folded into ``acc`` (``ok``: its checksum matched). True
        when it completed the parity: the caller then checksums it (:meth:`parity_checked`)."""
        refused = self._refusal(generation)
        if ok and refused is not None:
            ok, why = False, refused
        acc.sending.discard(rank)
        key = self._key(rank)
        ring = None if key is None else self.rings.get(key)
        if ring is None or key is None or acc.dropped or acc.slot not in ring.held_or_made():
            self._give_back(acc.slot)
            return False
        if not ok:  # the parity holds part of a stripe now: it can never be right
            self._drop_parity(key, step, why, rank)
            self._give_back(acc.slot)
            return False
        acc.members[rank] = member
        acc.slot.leases -= 1
        if set(acc.members) != acc.expected:
            return False
        assert ring.alloc is not None
        members = [acc.members[r] for r in sorted(acc.members)]
        ring.written(acc.slot.index, step, ring.alloc.id, {"members": members})
        del self.accs[key][step]
        return True

    def parity_checked(self, acc: Accumulation, checksum: str, generation: int = -1) -> None:
        """A complete parity's checksum: it is held, and older ones still being made can
        no longer be of use."""
        slot = acc.slot
        key = next((k for k, r in self.rings.items() if slot in r.held_or_made()), None)
        stale = self._refusal(generation) is not None or slot.state is not SlotState.CHECKING
        if key is None or stale or slot.step != acc.step:
            slot.state = SlotState.ABANDONED  # freed as its lease goes
            self._give_back(slot)
            return
        self.rings[key].checked(slot, checksum)
        for s in [s for s in self.accs.get(key, {}) if s < acc.step]:
            self._drop_parity(key, s, f"step {acc.step} was complete first")
        self._inject(-1 - key, acc.step, slot.segment.buf, "parity")

    def _drop_parity(self, key: int, step: int, why: str | None, rank: int | None = None) -> None:
        """A parity being made is given up (``why`` reported, for ``rank`` or a rank of it;
        None: silently): its slot is free once no stripe is arriving into it, and a late
        stripe of it is refused."""
        self.dropped.add((key, step))
        acc = self.accs.get(key, {}).pop(step, None)
        if acc is None:
            return
        acc.dropped = True
        slot = acc.slot
        slot.state = SlotState.ABANDONED if slot.leases else SlotState.FREE
        if not slot.leases:
            slot.step, slot.checksum, slot.tree = -1, "", {}
        if why is not None:
            who = min(acc.expected, default=key) if rank is None else rank
            self._rejected(who, step, f"parity not made: {why}", acc.generation)

    def _give_back(self, slot: Slot) -> None:
        """A lease on a parity's slot, whichever ring (kept, or left by a resize) has it."""
        for ring in [*self.rings.values(), *self.left]:
            if slot in ring.held_or_made():
                ring.unlease(slot)
                break
        else:
            slot.leases = max(0, slot.leases - 1)
        self.left = [ring for ring in self.left if ring.retired]

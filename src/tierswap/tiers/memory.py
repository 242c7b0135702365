"""Tier 0, the agent's side: the ring of shared-memory slots of each rank on this node.

Invariants (DESIGN.md): a slot being written, checksummed, persisted or restored from is
leased and never handed out; the newest committed step is never overwritten before a
newer one is committed (with one exception: in a ring of two, tier 0's own commit gives
way to tier 1's older one, see :meth:`RankRing.begin_write`); when no slot is free the
step is skipped, never waited for (except while the ring's slots are still being made,
for at most ``FILL_LIMIT_S``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tierswap.errors import UsageError
from tierswap.layout import Layout
from tierswap.shm import Segment, segment_name

SegmentFactory = Callable[[str, int], Segment]
"""``create(name, nbytes)``: a new shared-memory segment (``Segment.create``; tests and
the simulation hand in one backed by plain memory)."""


FILLING = "filling"
"""A replica store's answer when it has no free slot only because its ring's slots are
still being made (:meth:`RankRing.allocate`): the sender's bytes wait for one."""
FILL_LIMIT_S = 30.0
"""The longest a snapshot or a replica waits for a slot that is still being made (then it
is skipped, and reported so): making one is an allocation of shared memory, seconds at
most. Under the 60 s a replica's sender waits for room."""
FILL_POLL_S = 0.01
"""How often a waiting writer asks again (each ask is a turn of the agent's loop)."""


class SlotState(Enum):
    FREE = "free"
    WRITING = "writing"
    CHECKING = "checking"
    HELD = "held"
    ABANDONED = "abandoned"
    """Of a timeline a restore went back from; freed when its last lease goes."""


@dataclass(slots=True)
class Slot:
    index: int
    segment: Segment
    state: SlotState = SlotState.FREE
    step: int = -1
    checksum: str = ""
    tree: dict[str, Any] = field(default_factory=dict)
    leases: int = 0


@dataclass(slots=True)
class Allocation:
    id: int
    layout: Layout
    slots: list[Slot]
    """The slots made so far (in the order they were made); the rest are being made
    (``filling``)."""
    names: list[str] = field(default_factory=list)
    """Every slot's segment name, made or not, by index."""
    error: str | None = None
    """Why a slot could not be made (a full /dev/shm): the ring cannot be used."""

    def release(self) -> None:
        for s in self.slots:
            s.segment.unlink()

    @property
    def filling(self) -> bool:
        return len(self.slots) < sum(map(bool, self.names)) and self.error is None


_alloc_ids = itertools.count(1)


class CommitVotes:
    """A rank's side of a tier's commits: a step held for a commit (``propose``) is
    protected until it or a newer step is committed, or it is released (``abort``); the
    committed step is never dropped before a newer one is."""

    committed: int
    proposed: set[int]

    def held(self) -> Mapping[int, Any]:
        raise NotImplementedError

    def propose(self, step: int) -> bool:
        """Hold ``step`` for a commit: protect it, if held."""
        if step not in self.held():
            return False
        self.proposed.add(step)
        return True

    def protect(self, step: int) -> None:
        """A new generation starts: ``step`` is the committed one, whatever came before."""
        self.committed = step
        self.proposed.clear()

    def set_committed(self, step: int) -> None:
        self.proposed = {p for p in self.proposed if p > step}
        self.committed = max(self.committed, step)

    def abort(self, step: int) -> None:
        self.proposed.discard(step)


class RankRing(CommitVotes):
    """The slots of one rank. Driven by the agent's single event loop (no locks)."""

    def __init__(
        self, job_id: str, rank: int, nslots: int, create: SegmentFactory = Segment.create
    ) -> None:
        self.job_id = job_id
        self.rank = rank
        self.nslots = nslots
        self.create = create
        self.alloc: Allocation | None = None
        self.retired: list[Allocation] = []
        self.committed = -1
        self.proposed: set[int] = set()
        self.peer_committed = -1
        """The step committed in tier 1: kept here too, so that after a node loss the
        survivors still hold the step its ranks come back with from peers."""
        self.peer_held = -1
        """With tier 1 as parity, the step this node holds for tier 1's commit: kept here
        too from the hold on, since a lost rank of its set is rebuilt from it."""
        self.hold_in_way: int | None = None
        """The tier-1 hold (``peer_held``) that kept the last :meth:`begin_write` from a
        slot: the caller asks for it to be let go."""
        self.skipped = 0
        self.gave_way: int | None = None
        """The step the last :meth:`begin_write` wrote over although it was this rank's
        newest: the node can no longer hold it for a commit, which the caller reports
        (as a skip in tier 0, a refusal in tier 1), so that no other node keeps a hold of
        it waiting for this one."""
        self.wanted: list[tuple[int, int, str, int]] = []
        """Slots to be made off the loop: (allocation, index, name, bytes) each, taken by
        the agent's core (``take_wanted``) and handed back made (``add``)."""

    # ------------------------------------------------------------ allocation

    def allocate(self, layout: Layout, now: int | None = None) -> Allocation:
        """Slots for ``layout``: the current ones when it is unchanged (a restarted worker
        keeps what its predecessor held), else new ones; old ones go once unleased.

        ``now`` slots are made here (all by default); the others are left in ``wanted``,
        to be made on a thread and handed back with :meth:`add`. Making 4 slots of 384 MiB
        took 6 s on a loaded 2-core machine: made all at once here they stalled the
        agent's loop, and the trainer's first snapshot, for all of it."""
        if self.alloc is not None and self.alloc.layout == layout:
            return self.alloc
        aid = next(_alloc_ids)
        names = [segment_name(self.job_id, self.rank, i, aid) for i in range(self.nslots)]
        first = self.nslots if now is None else max(1, min(now, self.nslots))
        slots = []
        try:
            for i in range(first):
                slots.append(Slot(i, self.create(names[i], layout.nbytes)))
        except BaseException:
            for s in slots:
                s.segment.unlink()
            raise
        if self.alloc is not None:
            self.retired.append(self.alloc)
        self.alloc = Allocation(aid, layout, slots, names)
        self.wanted = [(aid, i, names[i], layout.nbytes) for i in range(first, self.nslots)]
        self._drop_retired()
        return self.alloc

    def take_wanted(self) -> list[tuple[int, int, str, int]]:
        wanted, self.wanted = self.wanted, []
        return wanted

    def add(
        self,
        alloc_id: int,
        index: int,
        segment: Segment | None,
        error: str = "",
        fatal: bool = True,
    ) -> bool:
        """A slot made off the loop (``segment``), or why it could not be (``error``):
        ``fatal``, the ring's next write raises it; else the ring goes on without that
        slot. False when its allocation is no longer this ring's: the caller unlinks it."""
        a = self.alloc
        if a is None or a.id != alloc_id:
            return False
        if not 0 <= index < len(a.names) or any(s.index == index for s in a.slots):
            raise ValueError(f"rank {self.rank}: slot {index} of allocation {alloc_id} twice")
        if segment is None and not fatal:
            a.names[index] = ""  # never made: the ring holds one slot fewer
            return True
        if segment is None:
            a.error = a.error or error or f"slot {index} could not be made"
            return True
        a.slots.append(Slot(index, segment))
        return True

    def filling(self) -> bool:
        """Some slots of the current allocation are still being made."""
        return self.alloc is not None and self.alloc.filling

    def _drop_retired(self) -> None:
        keep = []
        for a in self.retired:
            if any(s.leases for s in a.slots):
                keep.append(a)
            else:
                a.release()
        self.retired = keep

    # ------------------------------------------------------------ the write path

    def begin_write(self, step: int, alloc_id: int) -> tuple[int | None, list[int]]:
        """A slot for ``step``, or None to skip it; also the steps whose slot it reuses.

        Never reused: a leased slot, the committed step (of this tier, and in tier 0 also
        tier 1's), a step proposed for commit, in tier 0 with parity the step held for tier
        1's commit, and this rank's newest snapshot (so ranks that run in step always share
        one to commit). When every slot is kept, and once the ring's slots are all made,
        one gives way, in this order, rather than every later step be skipped:

        - the newest, proposed for no commit: were it kept, a ring of 3 whose newest step
          parted from the other ranks' of its node (a snapshot skipped on one of them)
          would keep every slot and never hold a step in common with them again;
        - in a ring of two, tier 0's own commit where tier 1's older one is kept too
          (:meth:`_tier0_gives_way`);
        - none yet where one is kept for tier 1's commit (parity, ``peer_held``): the step
          is skipped and the caller asks for that hold to be let go (``hold_in_way``); a
          hold the other nodes could not meet kept a slot for ever.
        """
        a = self.alloc
        if a is None or a.id != alloc_id:
            raise ValueError(f"rank {self.rank}: unknown slot allocation {alloc_id}")
        if a.error is not None:
            raise UsageError(a.error)
        live = [s.step for s in a.slots if s.state in (SlotState.HELD, SlotState.CHECKING)]
        newest = max(live, default=-1)
        kept = {self.committed, *self.proposed, self.peer_committed, self.peer_held}
        keep = kept | {newest}
        free = [s for s in a.slots if s.state is SlotState.FREE and not s.leases]
        stale = [
            s for s in a.slots if s.state is SlotState.HELD and s.step not in keep and not s.leases
        ]
        candidates = free or sorted(stale, key=lambda s: s.step)
        self.gave_way = None
        if not candidates and not a.filling and newest not in kept:
            candidates = [
                s
                for s in a.slots
                if s.state is SlotState.HELD and s.step == newest and not s.leases
            ]
            self.gave_way = newest if candidates else None
        if not candidates and not a.filling and self._tier0_gives_way(live):
            # two slots holding the two tiers' commits, and nothing else: every later step
            # would be skipped, and the commits could never move. Tier 0's own commit gives
            # way. Tier 1 behind: tier 1's step, kept, was committed in tier 0 too, so a
            # restore from tier 0 still finds a step every rank holds, and a lost node's
            # ranks theirs in tier 1. Tier 0 behind (a restart that brought a rank back from
            # tier 1, so tier 0's commit of the generation is older): every rank reaches
            # tier 1's newer step, which the planner takes first
            candidates = [
                s
                for s in a.slots
                if s.state is SlotState.HELD and s.step == self.committed and not s.leases
            ]
        h = self.peer_held
        self.hold_in_way = None
        if not candidates and not a.filling and h != self.peer_committed and h in live:
            # every slot kept, one of them for a tier-1 hold (parity) that has not come to a
            # commit: the caller asks the coordinator to let it go rather than skip every
            # later step (a hold the other nodes cannot meet kept it for ever); it stays
            # kept until the answer, since a commit of it may be on its way
            self.hold_in_way = h
        if not candidates:  # (while slots are still being made the writer waits: no skip)
            self.skipped += 0 if a.filling else 1
            return None, []
        slot = candidates[0]
        dropped = [slot.step] if slot.state is SlotState.HELD else []
        slot.state, slot.step, slot.checksum, slot.tree = SlotState.WRITING, step, "", {}
        return slot.index, dropped

    def _tier0_gives_way(self, live: list[int]) -> bool:
        """A ring of two holds tier 0's commit and tier 1's, another step, and nothing else
        (``--slots 2``, the rule above)."""
        b, c = self.peer_committed, self.committed
        kept = c in self.proposed or c == self.peer_held
        return self.nslots == 2 and 0 <= b != c and b in live and not kept

    def written(self, slot_index: int, step: int, alloc_id: int, tree: dict[str, Any]) -> Slot:
        """The worker finished copying; the slot waits for its checksum (leased)."""
        slot = self.slot(alloc_id, slot_index)
        if slot.state is not SlotState.WRITING or slot.step != step:
            raise ValueError(f"rank {self.rank}: slot {slot_index} is not being written")
        slot.state, slot.tree = SlotState.CHECKING, tree
        slot.leases += 1
        return slot

    def checked(self, slot: Slot, checksum: str) -> None:
        slot.leases -= 1
        slot.checksum = checksum
        slot.state = SlotState.HELD

    def abandon(self, slot: Slot) -> None:
        """A slot whose checksum could not be computed: free again, never held."""
        slot.leases = max(0, slot.leases - 1)
        slot.state, slot.step, slot.checksum, slot.tree = SlotState.FREE, -1, "", {}

    def retire(self) -> None:
        """The node no longer serves this rank (the job shrank and its ranks were numbered
        anew): its slots go, each once its leases are returned."""
        self.discard_after(-1)
        if self.alloc is not None:
            self.retired.append(self.alloc)
            self.alloc = None
        self._drop_retired()

    def abandon_writes(self) -> None:
        """The worker died: slots it was writing are free again."""
        if self.alloc is not None:
            for s in self.alloc.slots:
                if s.state is SlotState.WRITING:
                    s.state, s.step = SlotState.FREE, -1

    def discard_after(self, step: int) -> list[int]:
        """A restore went back to ``step``: snapshots of later steps belong to an abandoned
        timeline and must never be mixed with the new one. Returns the steps dropped."""
        dropped = []
        if self.alloc is not None:
            for s in self.alloc.slots:
                if s.state is SlotState.HELD and s.step > step:
                    dropped.append(s.step)
                    s.state = SlotState.ABANDONED if s.leases else SlotState.FREE
                    if not s.leases:
                        s.step, s.checksum, s.tree = -1, "", {}
        self.committed = min(self.committed, step)
        self.proposed.clear()
        return dropped

    # ------------------------------------------------------------ readers

    def held(self) -> dict[int, Slot]:
        """step -> slot, for every checksummed snapshot of this rank."""
        if self.alloc is None:
            return {}
        return {s.step: s for s in self.alloc.slots if s.state is SlotState.HELD}

    def lease(self, step: int) -> Slot | None:
        slot = self.held().get(step)
        if slot is not None:
            slot.leases += 1
        return slot

    def unlease(self, slot: Slot) -> None:
        slot.leases = max(0, slot.leases - 1)
        if slot.state is SlotState.ABANDONED and not slot.leases:
            slot.state, slot.step, slot.checksum, slot.tree = SlotState.FREE, -1, "", {}
        self._drop_retired()

    def held_or_made(self) -> list[Slot]:
        """Every slot of this ring, of its allocation and of retired ones still leased."""
        return [s for a in ([self.alloc] if self.alloc else []) + self.retired for s in a.slots]

    def layout(self) -> Layout:
        assert self.alloc is not None
        return self.alloc.layout

    def slot(self, alloc_id: int, index: int) -> Slot:
        """Slot ``index`` of allocation ``alloc_id``, made."""
        found = [] if self.alloc is None or self.alloc.id != alloc_id else self.alloc.slots
        for slot in found:
            if slot.index == index:
                return slot
        raise ValueError(f"rank {self.rank}: no slot {index} in allocation {alloc_id}")

    def close(self) -> None:
        for a in [*self.retired, *([self.alloc] if self.alloc else [])]:
            a.release()
        self.retired, self.alloc = [], None

    def nbytes(self) -> int:
        return 0 if self.alloc is None else self.alloc.layout.nbytes * self.nslots


class NodeRings:
    """Tier 0 of one node: a ring per rank it serves, and the slots leased to restores."""

    def __init__(self, job_id: str, nslots: int, create: SegmentFactory = Segment.create) -> None:
        self.job_id, self.nslots, self.create = job_id, nslots, create
        self.by_rank: dict[int, RankRing] = {}
        self.restore_leases: dict[int, Slot] = {}
        self.left: list[RankRing] = []
        """Rings of ranks this node served before the job was resized, kept only while a
        slot of theirs is leased (a part being written)."""

    def __getitem__(self, rank: int) -> RankRing:
        return self.by_rank[rank]

    def items(self) -> list[tuple[int, RankRing]]:
        return list(self.by_rank.items())

    def serve(self, ranks: list[int], restart: int, committed: int, peer_committed: int) -> None:
        """A generation starts from ``restart``; ``committed`` is tier 0's newest commit and
        ``peer_committed`` tier 1's."""
        for r in [r for r in self.by_rank if r not in ranks]:
            ring = self.by_rank.pop(r)
            ring.retire()
            if ring.retired:
                self.left.append(ring)
        for r in ranks:
            if r not in self.by_rank:
                self.by_rank[r] = RankRing(self.job_id, r, self.nslots, self.create)
        for ring in self.by_rank.values():
            ring.discard_after(restart)
            ring.protect(committed)
            ring.peer_committed, ring.peer_held = peer_committed, -1

    def holds_everywhere(self, step: int) -> bool:
        return all(step in ring.held() for ring in self.by_rank.values())

    def newest_complete(self) -> int:
        """The newest step every ring holds (-1 when there is none)."""
        return max(self.complete(), default=-1)

    def complete(self) -> set[int]:
        """The steps every ring holds."""
        common: set[int] | None = None
        for ring in self.by_rank.values():
            steps = set(ring.held())
            common = steps if common is None else common & steps
            if not common:
                return set()
        return common or set()

    def peer_hold(self, step: int) -> None:
        """Keep ``step`` (-1: none) while this node holds it for tier 1's commit."""
        for ring in self.by_rank.values():
            ring.peer_held = step

    def propose(self, step: int) -> bool:
        """Every ring holds ``step`` (and keeps it); if one does not, none keeps it."""
        ok = all(ring.propose(step) for ring in self.by_rank.values())
        if not ok:
            self.abort(step)
        return ok

    def commit(self, step: int) -> None:
        for ring in self.by_rank.values():
            ring.set_committed(step)

    def abort(self, step: int) -> None:
        for ring in self.by_rank.values():
            ring.abort(step)

    def peer_committed(self, step: int) -> None:
        for ring in self.by_rank.values():
            ring.peer_committed = step

    def holdings(self) -> dict[int, dict[int, str]]:
        """Rank -> step -> checksum of every held snapshot, as the coordinator reads it."""
        return {
            r: {step: s.checksum for step, s in ring.held().items()}
            for r, ring in self.by_rank.items()
        }

    def unlease(self, slot: Slot) -> bool:
        """Return a lease on ``slot``, whichever ring (or retired allocation) it is of;
        False when it is of none of this node's rings."""
        found = False
        for ring in [*self.by_rank.values(), *self.left]:
            allocs = [ring.alloc, *ring.retired] if ring.alloc is not None else ring.retired
            if any(slot in a.slots for a in allocs):
                ring.unlease(slot)
                found = True
                break
        self.left = [ring for ring in self.left if ring.retired]
        return found

    def lease_for_restore(self, rank: int, step: int) -> Slot | None:
        slot = self.by_rank[rank].lease(step)
        if slot is not None:
            self.restore_leases[rank] = slot
        return slot

    def restored(self, rank: int) -> None:
        slot = self.restore_leases.pop(rank, None)
        if slot is not None:
            self.unlease(slot)

    def let_go(self) -> None:
        """The workers left: restore leases are returned and slots being written abandoned."""
        for slot in self.restore_leases.values():
            self.unlease(slot)
        self.restore_leases.clear()
        for ring in self.by_rank.values():
            ring.abandon_writes()

    def close(self) -> None:
        for ring in [*self.by_rank.values(), *self.left]:
            ring.close()

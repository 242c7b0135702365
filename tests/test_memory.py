"""Tier 0, the agent's ring of shared-memory slots per rank: which slot a step may reuse."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierswap.errors import UsageError
from tierswap.shm import PREFIX, SHM_DIR, Segment
from tierswap.state import Layout, TensorEntry
from tierswap.tiers.memory import NodeRings, RankRing, Slot, SlotState

pytestmark = pytest.mark.timeout(60)


def _layout(n: int = 16) -> Layout:
    entry = TensorEntry("w", "F32", (n,), 0, 4 * n)
    return Layout(entries=(entry,), nbytes=4 * n)


def _segments(job_id: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}{job_id}-*"))


@pytest.fixture
def make_ring() -> Iterator[Callable[..., RankRing]]:
    """Rings of a job of their own; every segment is gone after the test."""
    job_id = uuid.uuid4().hex[:12]
    rings: list[RankRing] = []

    def make(nslots: int = 3, rank: int = 0) -> RankRing:
        ring = RankRing(job_id, rank, nslots)
        rings.append(ring)
        return ring

    yield make
    for ring in rings:
        ring.close()
    assert _segments(job_id) == []


@pytest.fixture
def two_ranks() -> Iterator[NodeRings]:
    """A node's rings of 3 slots for ranks 0 and 1, allocated; every segment is gone after
    the test."""
    job_id = uuid.uuid4().hex[:12]
    node = NodeRings(job_id, nslots=3)
    node.serve([0, 1], restart=-1, committed=-1, peer_committed=-1)
    for rank in (0, 1):
        node[rank].allocate(_layout())
    yield node
    node.close()
    assert _segments(job_id) == []


def _write(ring: RankRing, step: int) -> tuple[int | None, list[int]]:
    """One whole snapshot of ``step``: slot handed out, written, checksummed."""
    assert ring.alloc is not None
    index, dropped = ring.begin_write(step, ring.alloc.id)
    if index is not None:
        ring.checked(ring.written(index, step, ring.alloc.id, {"step": step}), f"cs{step}")
    return index, dropped


def _states(ring: RankRing) -> list[SlotState]:
    assert ring.alloc is not None
    return [s.state for s in ring.alloc.slots]


def test_consecutive_steps_take_free_slots_then_the_oldest(
    make_ring: Callable[..., RankRing],
) -> None:
    ring = make_ring(3)
    ring.allocate(_layout())
    assert [_write(ring, s) for s in range(3)] == [(0, []), (1, []), (2, [])]
    assert _write(ring, 3) == (0, [0])
    assert _write(ring, 4) == (1, [1])
    assert sorted(ring.held()) == [2, 3, 4]
    assert ring.held()[4].tree == {"step": 4} and ring.held()[4].checksum == "cs4"
    assert ring.skipped == 0


def test_committed_and_proposed_steps_are_never_reused(make_ring: Callable[..., RankRing]) -> None:
    ring = make_ring(3)
    ring.allocate(_layout())
    for s in range(3):
        _write(ring, s)
    ring.set_committed(0)
    ring.peer_committed = 1  # tier 1's commit, kept in tier 0 for a node loss
    assert ring.propose(2)
    assert not ring.propose(7)  # not held: a vote against
    assert _write(ring, 3) == (None, [])  # 0 committed, 1 committed in tier 1, 2 proposed
    assert ring.skipped == 1 and sorted(ring.held()) == [0, 1, 2]
    ring.set_committed(2)  # 2 committed: 0 may go now
    assert _write(ring, 3) == (0, [0])
    assert ring.committed == 2 and ring.proposed == set()


def test_a_ring_of_two_holding_both_tiers_commits_lets_tier_0s_own_go_either_way(
    make_ring: Callable[..., RankRing],
) -> None:
    """Two slots, one tier 0's commit and one tier 1's, another step: tier 0's own gives way
    to the next step, whichever is older. Tier 0 behind came from a restart that brought a
    rank back from tier 1 (the generation's tier-0 commit older than its tier-1 one): kept
    both, every later snapshot was skipped and a job hung finishing (review, 12-05)."""
    for tier0, tier1 in ((5, 3), (3, 5)):
        ring = make_ring(2)
        ring.allocate(_layout())
        for s in sorted((tier0, tier1)):
            _write(ring, s)
        ring.set_committed(tier0)
        ring.peer_committed = tier1
        assert _write(ring, 6)[1] == [tier0], (tier0, tier1)
        assert sorted(ring.held()) == [tier1, 6] and ring.skipped == 0
    ring = make_ring(2)  # the same steps, but tier 0's commit proposed anew: kept
    ring.allocate(_layout())
    _write(ring, 3), _write(ring, 5)
    ring.set_committed(3)
    ring.peer_committed = 5
    ring.peer_held = 3
    assert _write(ring, 6) == (None, []) and ring.skipped == 1


def test_newest_held_step_is_reused_only_when_every_other_slot_is_kept(
    make_ring: Callable[..., RankRing],
) -> None:
    ring = make_ring(3)
    ring.allocate(_layout())
    for s in range(3):
        _write(ring, s)
    ring.set_committed(0)
    slot = ring.lease(1)
    assert slot is not None
    assert _write(ring, 3) == (2, [2])  # only the newest is unprotected: it gives way
    assert ring.gave_way == 2
    ring.unlease(slot)
    assert _write(ring, 4) == (1, [1])  # an older step is free: the newest (3) is kept
    assert sorted(ring.held()) == [0, 3, 4]
    assert ring.gave_way is None
    assert ring.propose(4) and _write(ring, 5) == (2, [3]) and ring.gave_way is None  # stale
    ring.set_committed(4)  # ... and a newest held for a commit is never reused
    ring.peer_committed = 0
    assert ring.propose(5) and _write(ring, 6) == (None, []) and ring.skipped == 1


def test_two_ranks_whose_newest_steps_parted_meet_again_in_rings_of_3(
    two_ranks: NodeRings,
) -> None:
    """Found by the simulation with 3 slots and tier 1 on: rank 1 skipped step 2 (its
    slots were leased), so the node held 2 for rank 0 only; with the committed step and
    tier 1's kept, rank 0's ring then had every slot protected and refused every later
    step, and the node never held a step in common again (tier 0 stopped committing)."""
    node = two_ranks
    for rank in (0, 1):
        _write(node[rank], 0)
        _write(node[rank], 1)
    node.commit(1)
    node.peer_committed(0)
    _write(node[0], 2)  # rank 1's snapshot of step 2 is skipped:
    leased = [node[1].lease(0), node[1].lease(1)]
    node[1].alloc.slots[2].leases += 1  # type: ignore[union-attr]
    assert _write(node[1], 2) == (None, []) and node[1].skipped == 1
    for slot in [*leased, node[1].alloc.slots[2]]:  # type: ignore[union-attr]
        assert slot is not None
        node[1].unlease(slot)
    assert sorted(node[0].held()) == [0, 1, 2] and sorted(node[1].held()) == [0, 1]
    # rank 0 keeps 0 (tier 1), 1 (tier 0) and its newest, 2, which only it holds
    for step in (3, 4):  # both go on; rank 0's newest gives way each time
        assert _write(node[0], step) == (2, [step - 1])
        assert _write(node[1], step)[0] is not None
    assert node.newest_complete() == 4 and node.propose(4)


def test_leased_slot_is_never_reused(make_ring: Callable[..., RankRing]) -> None:
    ring = make_ring(3)
    ring.allocate(_layout())
    for s in range(3):
        _write(ring, s)
    slot = ring.lease(0)
    assert slot is not None and slot.leases == 1
    assert _write(ring, 3) == (1, [1])
    assert _write(ring, 4) == (2, [2])
    assert _write(ring, 5) == (1, [3])
    assert ring.held()[0] is slot and slot.step == 0
    ring.unlease(slot)
    assert _write(ring, 6) == (0, [0])


def test_slot_being_written_is_not_reused(make_ring: Callable[..., RankRing]) -> None:
    ring = make_ring(3)
    alloc = ring.allocate(_layout())
    index, _ = ring.begin_write(0, alloc.id)
    assert index == 0 and _states(ring)[0] is SlotState.WRITING
    _write(ring, 1)
    _write(ring, 2)
    assert _write(ring, 3) == (1, [1])
    ring.abandon_writes()  # the worker died mid-copy: its slot is free again
    assert _states(ring)[0] is SlotState.FREE
    assert _write(ring, 4) == (0, [])


def test_slot_being_checksummed_is_leased(make_ring: Callable[..., RankRing]) -> None:
    ring = make_ring(3)
    alloc = ring.allocate(_layout())
    _write(ring, 0)
    index, _ = ring.begin_write(1, alloc.id)
    assert index is not None
    checking = ring.written(index, 1, alloc.id, {})
    assert checking.state is SlotState.CHECKING and checking.leases == 1
    assert 1 not in ring.held()
    _write(ring, 2)
    assert _write(ring, 3) == (0, [0])
    ring.checked(checking, "cs1")
    assert checking.leases == 0 and ring.held()[1] is checking


def test_skipped_steps_are_counted(make_ring: Callable[..., RankRing]) -> None:
    ring = make_ring(3)
    ring.allocate(_layout())
    for s in range(3):
        _write(ring, s)
    leases = [ring.lease(s) for s in range(3)]
    assert [_write(ring, s) for s in (3, 4, 5)] == [(None, [])] * 3
    assert ring.skipped == 3
    for slot in leases:
        assert slot is not None
        ring.unlease(slot)
    assert _write(ring, 6) == (0, [0])


def test_discard_after_frees_later_steps(make_ring: Callable[..., RankRing]) -> None:
    ring = make_ring(4)
    ring.allocate(_layout())
    for s in range(4):
        _write(ring, s)
    ring.set_committed(2)
    ring.propose(3)
    assert sorted(ring.discard_after(1)) == [2, 3]
    assert sorted(ring.held()) == [0, 1]
    assert ring.committed == 1 and ring.proposed == set()
    assert _write(ring, 2) == (2, [])  # the replayed timeline takes the freed slots
    assert ring.held()[2].checksum == "cs2"


def test_abandoned_step_is_never_served_after_discard(make_ring: Callable[..., RankRing]) -> None:
    ring = make_ring(3)
    ring.allocate(_layout())
    for s in range(3):
        _write(ring, s)
    persisting = ring.lease(2)  # the persister still reads step 2 of the old timeline
    assert persisting is not None
    ring.discard_after(0)
    assert persisting.state is SlotState.ABANDONED
    _write(ring, 1)  # the new timeline replays steps 1 and 2 while the old 2 is still read
    _write(ring, 2)
    served = ring.lease(2)
    assert served is not None and served is not persisting
    ring.unlease(persisting)
    assert persisting.state is SlotState.FREE, "an abandoned slot is freed by its last lease"


def test_same_layout_keeps_the_allocation(make_ring: Callable[..., RankRing]) -> None:
    ring = make_ring(3)
    first = ring.allocate(_layout(16))
    _write(ring, 0)
    again = ring.allocate(_layout(16))  # equal, not the same object: a restarted worker
    assert again is first and sorted(ring.held()) == [0]
    assert all(s.segment.path.exists() for s in first.slots)
    assert ring.nbytes() == 3 * 64


def test_new_layout_retires_old_slots_once_unleased(make_ring: Callable[..., RankRing]) -> None:
    ring = make_ring(3)
    old = ring.allocate(_layout(16))
    _write(ring, 0)
    slot = ring.lease(0)
    assert slot is not None
    new = ring.allocate(_layout(32))
    assert new.id != old.id and ring.retired == [old]
    assert ring.held() == {}  # the new layout holds nothing yet
    assert all(s.segment.path.exists() for s in old.slots)  # a reader still uses step 0
    with pytest.raises(ValueError, match=f"unknown slot allocation {old.id}"):
        ring.begin_write(1, old.id)
    ring.unlease(slot)
    assert ring.retired == []
    assert not any(s.segment.path.exists() for s in old.slots)
    assert all(s.segment.path.exists() for s in new.slots)
    newer = ring.allocate(_layout(8))  # nothing leased: the old ones go at once
    assert not any(s.segment.path.exists() for s in new.slots) and newer.slots


def _make(ring: RankRing) -> None:
    """What the agent's shell does with the ring's ``wanted``: make them, hand them in."""
    for alloc, index, name, nbytes in ring.take_wanted():
        assert ring.add(alloc, index, Segment.create(name, nbytes))


def test_slots_after_the_first_are_made_later_and_waited_for_not_skipped(
    make_ring: Callable[..., RankRing],
) -> None:
    """``allocate(now=1)``: one slot at once, the others left to be made off the loop; until
    they are in, a step with no free slot waits (``filling``) and is not counted skipped."""
    ring = make_ring(4)
    alloc = ring.allocate(_layout(), now=1)
    assert len(alloc.slots) == 1 and len(alloc.names) == 4 and ring.filling()
    assert ring.nbytes() == 4 * 64  # what the ring will hold, made or not
    assert _write(ring, 0)[0] == 0
    assert _write(ring, 1) == (None, []) and ring.skipped == 0  # slot 0 holds the newest
    wanted = ring.take_wanted()
    assert [(a, i) for a, i, _, _ in wanted] == [(alloc.id, 1), (alloc.id, 2), (alloc.id, 3)]
    assert ring.take_wanted() == []  # handed out once
    for a, i, name, nbytes in reversed(wanted):  # made in any order
        assert ring.add(a, i, Segment.create(name, nbytes))
    assert not ring.filling()
    assert sorted(_write(ring, s)[0] or 0 for s in (1, 2, 3)) == [1, 2, 3]
    assert ring.held().keys() == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="slot 1 of allocation"):
        ring.add(alloc.id, 1, None)


def test_a_slot_made_for_a_replaced_allocation_is_refused(
    make_ring: Callable[..., RankRing],
) -> None:
    ring = make_ring(3)
    old = ring.allocate(_layout(16), now=1)
    ((aid, index, name, nbytes), _) = ring.take_wanted()
    ring.allocate(_layout(32), now=1)  # the layout changed while slot 1 was being made
    seg = Segment.create(name, nbytes)
    assert not ring.add(aid, index, seg) and aid == old.id  # the caller unlinks it
    seg.unlink()
    _make(ring)
    assert not ring.filling()


def test_a_slot_that_could_not_be_made_fails_the_next_write_with_the_reason(
    make_ring: Callable[..., RankRing],
) -> None:
    ring = make_ring(3)
    alloc = ring.allocate(_layout(), now=1)
    assert _write(ring, 0)[0] == 0
    aid, index, _, _ = ring.take_wanted()[0]
    assert ring.add(aid, index, None, "no space left in /dev/shm: enlarge it")
    assert not ring.filling() and alloc.error is not None
    with pytest.raises(UsageError, match="enlarge it"):
        ring.begin_write(1, alloc.id)


def test_a_replica_slot_that_could_not_be_made_leaves_the_ring_one_short(
    make_ring: Callable[..., RankRing],
) -> None:
    """Tier 1 (``fatal=False``): the ring goes on with the slots it has, no longer filling."""
    ring = make_ring(3)
    alloc = ring.allocate(_layout(), now=1)
    (aid, i1, n1, size), (_, i2, _, _) = ring.take_wanted()
    assert ring.add(aid, i2, None, "ENOSPC", fatal=False) and ring.filling()
    assert ring.add(aid, i1, Segment.create(n1, size))
    assert not ring.filling() and alloc.error is None
    assert [_write(ring, s)[0] for s in (0, 1)] == [0, 1]
    assert _write(ring, 2) == (0, [0]) and ring.skipped == 0  # two slots take turns


def test_written_checks_its_slot(make_ring: Callable[..., RankRing]) -> None:
    ring = make_ring(3)
    alloc = ring.allocate(_layout())
    with pytest.raises(ValueError, match="slot 0 is not being written"):
        ring.written(0, 5, alloc.id, {})
    with pytest.raises(ValueError, match="no slot 3"):
        ring.written(3, 5, alloc.id, {})


# ---------------------------------------------------------------- random schedules

OP_NAMES = "write write write begin finish commit propose abort lease unlease discard abandon"
OPS = st.lists(
    st.tuples(st.sampled_from(OP_NAMES.split()), st.integers(min_value=0, max_value=7)),
    max_size=40,
)


def _protected(ring: RankRing) -> set[int]:
    assert ring.alloc is not None
    live = [s.step for s in ring.alloc.slots if s.state in (SlotState.HELD, SlotState.CHECKING)]
    return {ring.committed, *ring.proposed, max(live, default=-1)}


def _eligible(ring: RankRing) -> list[Slot]:
    assert ring.alloc is not None
    keep = _protected(ring)
    found = [
        s
        for s in ring.alloc.slots
        if not s.leases
        and (s.state is SlotState.FREE or (s.state is SlotState.HELD and s.step not in keep))
    ]
    held = [s for s in ring.alloc.slots if s.state in (SlotState.HELD, SlotState.CHECKING)]
    newest = max(held, key=lambda s: s.step, default=None)
    committed = {ring.committed, *ring.proposed, ring.peer_committed}
    if found or newest is None or newest.step in committed or ring.filling():
        return found
    # every other slot kept: the newest, held for no commit, gives way unless leased
    return [newest] if newest.state is SlotState.HELD and not newest.leases else []


def _check_begin(ring: RankRing, step: int) -> tuple[int | None, Any]:
    """``begin_write`` through the rules of DESIGN.md, checked against an oracle."""
    assert ring.alloc is not None
    before = {s.index: (s.state, s.step) for s in ring.alloc.slots}
    eligible = _eligible(ring)
    skipped = ring.skipped
    index, dropped = ring.begin_write(step, ring.alloc.id)
    if not eligible:
        assert (index, dropped, ring.skipped) == (None, [], skipped + 1)
        return None, None
    assert index is not None and ring.skipped == skipped
    assert index in {s.index for s in eligible}, (before, index)
    state, old = before[index]
    free = [s for s in eligible if before[s.index][0] is SlotState.FREE]
    if free:
        assert state is SlotState.FREE and dropped == []
    else:
        assert old == min(before[s.index][1] for s in eligible) and dropped == [old]
    return index, step


@settings(max_examples=120, deadline=None)
@given(nslots=st.integers(min_value=3, max_value=5), ops=OPS)
def test_random_schedules_keep_the_invariants(nslots: int, ops: list[tuple[str, int]]) -> None:
    ring = RankRing(f"h{uuid.uuid4().hex[:12]}", 0, nslots)
    try:
        alloc = ring.allocate(_layout())
        step = 0
        pending: list[tuple[int, int]] = []
        leased: list[tuple[Slot, int]] = []
        for op, k in ops:
            held = sorted(ring.held())
            pick = held[k % len(held)] if held else None
            if op in ("write", "begin"):
                index, s = _check_begin(ring, step)
                step += 1
                if index is not None:
                    pending.append((index, s))
                if op == "write" and index is not None:
                    ring.checked(ring.written(index, s, alloc.id, {}), "cs")
                    pending.pop()
            elif op == "finish" and pending:
                index, s = pending.pop(0)
                ring.checked(ring.written(index, s, alloc.id, {}), "cs")
            elif op == "commit" and pick is not None:
                ring.set_committed(pick)
            elif op == "propose" and pick is not None:
                assert ring.propose(pick)
            elif op == "abort" and pick is not None:
                ring.abort(pick)
            elif op == "lease" and pick is not None:
                slot = ring.lease(pick)
                assert slot is not None
                leased.append((slot, pick))
            elif op == "unlease" and leased:
                ring.unlease(leased.pop(k % len(leased))[0])
            elif op == "discard" and pick is not None:
                ring.discard_after(pick)
                later = [s for s in alloc.slots if s.state is SlotState.HELD and s.step > pick]
                assert not later, "no later step stays servable"
                step = pick + 1
            elif op == "abandon":
                ring.abandon_writes()
                pending.clear()
            for slot, s in leased:  # a leased slot keeps its bytes (held, or abandoned)
                assert slot.state in (SlotState.HELD, SlotState.ABANDONED) and slot.step == s
    finally:
        ring.close()
    assert _segments(ring.job_id) == []


def test_a_node_commits_a_step_only_when_every_rank_holds_it(two_ranks: NodeRings) -> None:
    """``NodeRings``: a step missing from one rank's ring is aborted in all; a restore's
    lease is returned when the rank restored or when the workers let go."""
    node = two_ranks
    for rank in (0, 1):
        _write(node[rank], 1)
    _write(node[0], 2)  # rank 1 never got step 2
    assert node.propose(1) and not node.propose(2)
    node.commit(1)
    assert node.holdings() == {0: {1: "cs1", 2: "cs2"}, 1: {1: "cs1"}}
    slot = node.lease_for_restore(1, 1)
    assert slot is not None and slot.leases == 1
    node.restored(1)
    assert slot.leases == 0 and not node.restore_leases
    slot = node.lease_for_restore(0, 1)
    assert slot is not None
    node.let_go()
    assert slot.leases == 0 and not node.restore_leases
    assert node.lease_for_restore(1, 2) is None


# ---------------------------------------------------------------- faulting pages in


class _Mapping:
    """Records the madvise calls :func:`fault_in` makes; each populate takes the time the
    test says (huge pages or 4 KiB pages, per page of the call)."""

    def __init__(self, clock: list[float], huge_s: Callable[[int], float], small_s: float):
        self.clock, self.huge_s, self.small_s = clock, huge_s, small_s
        self.small: list[tuple[int, int]] = []
        self.populated: list[tuple[int, int, bool]] = []

    def _is_small(self, start: int) -> bool:
        return any(a <= start < a + n for a, n in self.small)

    def madvise(self, option: int, start: int = 0, length: int = 0) -> None:
        import mmap

        from tierswap import shm

        if option == mmap.MADV_NOHUGEPAGE:
            self.small.append((start, length))
        elif option == shm.MADV_POPULATE_WRITE:
            small = self._is_small(start)
            self.clock[0] += self.small_s if small else self.huge_s(len(self.populated))
            self.populated.append((start, length, not small))


def _faulted_in(
    monkeypatch: pytest.MonkeyPatch, huge_s: Callable[[int], float], strides: int = 8
) -> _Mapping:
    from tierswap import shm

    clock = [0.0]
    monkeypatch.setattr(shm.time, "perf_counter", lambda: clock[0])
    m = _Mapping(clock, huge_s, small_s=1.0)
    shm.fault_in(m, strides * 4096, stride=4096, huge=True)  # type: ignore[arg-type]
    assert [(s, n) for s, n, _ in m.populated] == [(i * 4096, 4096) for i in range(strides)]
    return m


def test_pages_are_faulted_in_a_stride_per_call_in_huge_pages_while_they_are_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CPython holds the GIL through each madvise: a GiB in one call stopped an agent's
    heartbeat for 9 s on a day huge pages came slowly. And on such a day 4 KiB pages are
    the faster, so the rest is made in them once a huge stride is slower than the trial."""
    fast = _faulted_in(monkeypatch, huge_s=lambda i: 0.3)
    assert [h for _, _, h in fast.populated] == [True, False] + [True] * 6

    slow = _faulted_in(monkeypatch, huge_s=lambda i: 20.0)
    assert [h for _, _, h in slow.populated] == [True] + [False] * 7

    slowing = _faulted_in(monkeypatch, huge_s=lambda i: 0.3 if i < 4 else 20.0)
    assert [h for _, _, h in slowing.populated] == [True, False, True, True, True] + [False] * 3


def test_faulted_in_memory_and_segments_are_whole_and_writable() -> None:
    from tierswap.shm import populated

    n = 3 * (16 << 20) + 12345  # past the trial, with a partial last stride
    buf = populated(n)
    assert len(buf) == n and not any(buf[:: 1 << 20])
    buf[-1] = 7
    seg = Segment.create(f"test-{uuid.uuid4().hex[:12]}", n)
    try:
        assert len(seg.buf) == n and not any(seg.buf[:: 1 << 20])
        seg.buf[-1] = 9
        other = Segment.attach(seg.path.name, n)
        assert other.buf[-1] == 9
        other.close()
    finally:
        seg.unlink()
    buf.release()


OWNED = """
import sys
from tierswap.shm import Owner, Segment, segment_name
owner = Owner(sys.argv[1])
seg = Segment.create(segment_name(sys.argv[1], 0, 0, 1), 4096)
print(owner.path.name, seg.path.name, flush=True)
sys.stdin.read()  # until the test closes it, or kills this process
"""


def test_segments_of_a_killed_agent_are_swept_and_a_live_ones_kept() -> None:
    """An agent killed with its launcher (an OOM kill, a scheduler's SIGKILL) leaves its
    segments; the next agent on the machine unlinks them, and only them: not those of a
    live agent, not files without an owner, not another user's."""
    import os
    import signal
    import subprocess
    import sys

    from tierswap.shm import sweep_dead

    job = f"sweep{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-c", OWNED, job]
    live, dead = (
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    )
    stray = SHM_DIR / f"{PREFIX}{job}-p1-r00000-s0-a1"  # no owner file: never touched
    foreign = SHM_DIR / f"{PREFIX}{job}-p2-owner"  # another user's claim: not ours to act on
    try:
        names = {proc.pid: proc.stdout.readline().split() for proc in (live, dead)}  # type: ignore[union-attr]
        stray.write_bytes(b"x")
        if os.getuid() == 0:
            foreign.write_bytes(b"")
            os.chown(foreign, 4242, -1)
        sweep_dead()
        before = _segments(job)
        assert all(n in before for ns in names.values() for n in ns), "both agents live"
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait()
        sweep_dead()
        after = _segments(job)
        assert set(before) - set(after) == set(names[dead.pid]), "the killed agent's, all"
        assert stray.name in after
        assert os.getuid() != 0 or foreign.name in after
    finally:
        live.stdin.close()  # type: ignore[union-attr]
        live.wait(timeout=30)
        for path in SHM_DIR.glob(f"{PREFIX}{job}-*"):
            path.unlink()
    assert _segments(job) == []

"""The restore planner: one step for all ranks, the fastest good source for each."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierswap.plan import Holdings, Plan, Source, Tier, plan_restore

pytestmark = pytest.mark.timeout(60)

STEPS = st.integers(min_value=0, max_value=12)


@st.composite
def holdings(draw: st.DrawFn) -> Holdings:
    """Random holdings: some ranks lost their memory, some parts are bad."""
    world_size = draw(st.integers(min_value=1, max_value=16))
    per_node = draw(st.integers(min_value=1, max_value=4))
    ranks = range(world_size)
    memory = {
        r: frozenset(draw(st.sets(STEPS, max_size=4)))
        for r in ranks
        if draw(st.booleans()) or draw(st.booleans())  # about a quarter of ranks lost
    }
    durable = frozenset(draw(st.sets(STEPS, max_size=4)))
    held = {(Tier.MEMORY, s, r) for r, steps in memory.items() for s in steps}
    held |= {(Tier.DURABLE, s, r) for s in durable for r in ranks}
    bad = draw(st.sets(st.sampled_from(sorted(held)), max_size=6)) if held else set()
    return Holdings(
        world_size=world_size,
        memory=memory,
        memory_node={r: r // per_node for r in memory},
        durable=durable,
        bad=frozenset(bad),
    )


def _good(h: Holdings, tier: Tier, step: int, rank: int) -> bool:
    """Does ``tier`` hold a good part of ``step`` for ``rank``? (the oracle)"""
    if (tier, step, rank) in h.bad:
        return False
    if tier == Tier.MEMORY:
        return step in h.memory.get(rank, frozenset())
    return step in h.durable


def _reachable(h: Holdings, step: int) -> bool:
    return all(
        _good(h, Tier.MEMORY, step, r) or _good(h, Tier.DURABLE, step, r)
        for r in range(h.world_size)
    )


def _all_steps(h: Holdings) -> set[int]:
    return set(h.durable).union(*h.memory.values())


def _parse_ranges(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@settings(max_examples=250, deadline=None)
@given(holdings())
def test_plan_properties(h: Holdings) -> None:
    plan = plan_restore(h)
    reachable = {s for s in _all_steps(h) if _reachable(h, s)}

    # step is None iff no step is reachable by every rank; else it is the newest such step
    assert (plan.step is None) == (not reachable)
    if plan.step is None:
        assert plan.sources == {}
    else:
        assert plan.step == max(reachable)
        assert not any(s > plan.step for s in reachable)
        # sources cover exactly ranks 0..world_size-1
        assert sorted(plan.sources) == list(range(h.world_size))

    for rank, src in plan.sources.items():
        assert plan.step is not None
        # each source holds the chosen step, and holds a good part of it
        assert _good(h, src.tier, plan.step, rank), (rank, src)
        assert (src.tier, plan.step, rank) not in h.bad
        # memory wins over durable whenever it holds a good part
        if _good(h, Tier.MEMORY, plan.step, rank):
            assert src == Source(Tier.MEMORY, h.memory_node[rank])
        else:
            assert src == Source(Tier.DURABLE)

    # every newer step is passed over, newest first, naming exactly the ranks it lacks
    newer = sorted((s for s in _all_steps(h) if plan.step is None or s > plan.step), reverse=True)
    assert [s for s, _ in plan.skipped] == newer
    for step, reason in plan.skipped:
        lacking = [
            r
            for r in range(h.world_size)
            if not (_good(h, Tier.MEMORY, step, r) or _good(h, Tier.DURABLE, step, r))
        ]
        m = re.fullmatch(r"no tier holds a good part of ranks ([\d,-]+)", reason)
        assert m is not None, reason
        assert _parse_ranges(m.group(1)) == lacking


def test_node_lost_without_durable_plans_nothing() -> None:
    # two nodes of two ranks; node 1 (ranks 2, 3) died with its memory, nothing persisted
    h = Holdings(
        world_size=4,
        memory={0: frozenset({5, 6}), 1: frozenset({5, 6})},
        memory_node={0: 0, 1: 0},
    )
    plan = plan_restore(h)
    assert plan.step is None and plan.sources == {}
    assert [s for s, _ in plan.skipped] == [6, 5]
    assert all(reason.endswith("ranks 2-3") for _, reason in plan.skipped)


def test_corrupt_newest_durable_falls_back_to_older_commit() -> None:
    # a fresh start from tier 2 only: step 20's part of rank 1 is corrupt
    h = Holdings(world_size=3, durable=frozenset({10, 20}), bad=frozenset({(Tier.DURABLE, 20, 1)}))
    plan = plan_restore(h)
    assert plan.step == 10
    assert plan.ranks_from(Tier.DURABLE) == [0, 1, 2]
    assert plan.skipped == ((20, "no tier holds a good part of ranks 1"),)


def test_mixed_sources_survivors_from_memory_spare_from_durable() -> None:
    # node 1 (ranks 2, 3) was replaced by a spare; step 8 is in tier 2, step 9 only in memory
    h = Holdings(
        world_size=4,
        memory={0: frozenset({8, 9}), 1: frozenset({8, 9})},
        memory_node={0: 0, 1: 0},
        durable=frozenset({4, 8}),
    )
    plan = plan_restore(h)
    assert plan.step == 8
    assert plan.ranks_from(Tier.MEMORY) == [0, 1]
    assert plan.ranks_from(Tier.DURABLE) == [2, 3]
    assert plan.sources[0] == Source(Tier.MEMORY, node=0)
    assert plan.skipped == ((9, "no tier holds a good part of ranks 2-3"),)


def test_corrupt_memory_part_is_served_from_durable() -> None:
    h = Holdings(
        world_size=2,
        memory={0: frozenset({3}), 1: frozenset({3})},
        memory_node={0: 0, 1: 1},
        durable=frozenset({3}),
        bad=frozenset({(Tier.MEMORY, 3, 1)}),
    )
    plan = plan_restore(h)
    assert plan == Plan(3, {0: Source(Tier.MEMORY, 0), 1: Source(Tier.DURABLE)})


def test_nothing_held_anywhere() -> None:
    assert plan_restore(Holdings(world_size=2)) == Plan(None, {})


def test_rank_ranges_in_reasons_stay_short() -> None:
    lost = [0, 1, 2, 5, 7, 8]
    memory = {r: frozenset({1}) for r in range(10) if r not in lost}
    plan = plan_restore(Holdings(world_size=10, memory=memory))
    assert plan.skipped == ((1, "no tier holds a good part of ranks 0-2,5,7-8"),)


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        plan_restore(Holdings(world_size=0))

"""Commits of steps in the memory tiers, from what nodes hold.

A step is committed in a tier when every node that must hold it does: tier 0, every
member node for all its ranks; tier 1, every node that protects ranks, for all of those.
A node reports ``Held(tier, step)`` once the step is complete there, and from then keeps
it (it is never dropped) until the coordinator commits that step or a newer one, or
releases it. A node holds one such step per tier at a time, so the coordinator knows, for
each node, the one step it can count on, and a report is also the vote: a commit costs
one message per node and one broadcast, with no round of proposals and votes.

When every node holds a step but not the same one, the older ones can never all meet:
they are released, and their nodes report a newer step. A step that some node will
never hold (a snapshot skipped, a replica refused) releases the holds of it at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class Outcome:
    """What a report changed: a commit, and holds to release (node, step)."""

    committed: int | None = None
    released: list[tuple[int, int]] = field(default_factory=list)


class TierCommits:
    """The commits of one memory tier within a generation."""

    def __init__(self, tier: int) -> None:
        self.tier = tier
        self.committed = -1
        self.voters: frozenset[int] = frozenset()
        """Nodes that must hold a step for it to commit."""
        self.holds: dict[int, int] = {}
        """node -> the step it holds for a commit."""
        self.count: Counter[int] = Counter()
        """step -> how many nodes hold it."""
        self.broken = False
        """A voter is gone: nothing commits until the next generation."""
        self.dead: set[int] = set()
        """Steps some node will never hold in this generation: a hold of one is let go."""

    def reset(self, committed: int, voters: Iterable[int]) -> None:
        """A generation starts: ``committed`` is the tier's newest commit, whatever came
        before, and nothing is held yet."""
        self.committed = committed
        self.voters = frozenset(voters)
        self.holds.clear()
        self.count.clear()
        self.broken = False
        self.dead.clear()

    def held(self, node: int, step: int) -> Outcome:
        """``node`` holds ``step`` and keeps it for us."""
        out = Outcome()
        if self.broken or node not in self.voters or step <= self.committed:
            return out  # a step older than a commit it had not heard of yet: it lets go
        if self.holds.get(node) == step:
            return out
        self._drop(node)
        if step in self.dead:  # it can never commit: the node holds a newer one instead
            out.released.append((node, step))
            return out
        self.holds[node] = step
        self.count[step] += 1
        if self.count[step] == len(self.voters):
            self.committed = step
            self.holds.clear()
            self.count.clear()
            out.committed = step
        elif len(self.holds) == len(self.voters):
            # every node holds something but not the same step: all but the newest are
            # behind a node that has passed them, and can never be common
            newest = max(self.holds.values())
            out.released = self._release(lambda s: s < newest)
        return out

    def never(self, step: int) -> Outcome:
        """Some node will never hold ``step``: the holds of it can never commit (older
        ones still may: that node may yet hold them)."""
        if self.broken:
            return Outcome()
        self.dead.add(step)
        return Outcome(released=self._release(lambda s: s == step))

    def dropped(self, node: int, step: int) -> None:
        """``node`` no longer holds ``step`` (its slots were reallocated for a new layout)."""
        if self.holds.get(node) == step:
            self._drop(node)

    def lost(self, node: int) -> None:
        """A voter is gone: no step can commit on every rank in this generation."""
        if node in self.voters:
            self.broken = True
            self._drop(node)

    def _release(self, which: Callable[[int], bool]) -> list[tuple[int, int]]:
        gone = [(n, s) for n, s in self.holds.items() if which(s)]
        for node, _ in gone:
            self._drop(node)
        return gone

    def _drop(self, node: int) -> None:
        old = self.holds.pop(node, None)
        if old is not None:
            self.count[old] -= 1
            if not self.count[old]:
                del self.count[old]


def newest_in_memory(world_size: int, memory: Mapping[int, Iterable[int]], upto: int) -> int:
    """The newest step up to ``upto`` every rank's own node holds: tier 0's commit at a
    start."""
    return max(in_memory(world_size, memory, upto), default=-1)


def in_memory(world_size: int, memory: Mapping[int, Iterable[int]], upto: int) -> set[int]:
    """The steps up to ``upto`` every rank's own node holds."""
    common: set[int] | None = None
    for rank in range(world_size):
        steps = {s for s in memory.get(rank, ()) if s <= upto}
        common = steps if common is None else common & steps
        if not common:
            return set()
    return common or set()


def newest_replicated(
    world_size: int,
    peer: Mapping[int, Mapping[int, Iterable[int]]],
    targets: Mapping[int, tuple[int, ...]],
    live: set[int],
    upto: int,
) -> int:
    """The newest step up to ``upto`` every rank has in tier 1: all of its replicas where
    every target node is up, else at least one (tier 1's commit at a start)."""
    if not any(targets.values()):
        return -1
    candidates: set[int] | None = None
    for rank in range(world_size):
        counts: Counter[int] = Counter()
        for node, steps in peer.get(rank, {}).items():
            if node in live:
                counts.update(s for s in steps if s <= upto)
        rank_targets = targets.get(rank, ())
        need = len(rank_targets) if all(n in live for n in rank_targets) else 1
        ok = {s for s, n in counts.items() if n >= need}
        candidates = ok if candidates is None else candidates & ok
        if not candidates:
            return -1
    return max(candidates or (), default=-1)


def newest_parity(
    held: Mapping[int, Mapping[int, Iterable[int]]],
    holds: Mapping[int, Mapping[int, Iterable[int]]],
    live: set[int],
    upto: int,
    memory: Mapping[int, Iterable[int]],
    world_size: int,
) -> int:
    """``--peer-parity``: the newest step up to ``upto`` whose every parity is complete at
    its holder, every holder up, and which every rank's own tier 0 holds, which a rebuild
    reads (tier 1's commit at a start). ``held``: key -> node -> steps held; ``holds``:
    node -> the keys it holds; ``memory``: rank -> the steps its tier 0 holds."""
    candidates = in_memory(world_size, memory, upto)
    for node, keys in holds.items():
        if node not in live:
            return -1
        for key in keys:
            candidates &= set(held.get(key, {}).get(node, ()))
    return max(candidates, default=-1)

"""What the memory tiers hold, and two-phase commits of steps in them.

A step is committed in tier 0 when every rank's own node holds it, and in tier 1 when
every rank's part is held by enough live peers (all R when the rank's peers are all up,
else at least one). Before it counts, each holder must confirm it still holds the step
and protect it (a vote); a "no" aborts. So a commit never names a step a holder dropped
at the same moment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Send = Callable[..., None]
"""``send(node, op, **fields)``."""


@dataclass(slots=True)
class _Proposal:
    step: int
    voters: dict[int, list[int]]
    """node -> ranks it must hold the step for."""
    votes: set[int] = field(default_factory=set)


class Commits:
    def __init__(self, world_size: int, targets: dict[int, tuple[int, ...]], send: Send) -> None:
        self.world_size = world_size
        self.targets = targets
        self.send = send
        self.held: dict[int, set[int]] = {r: set() for r in range(world_size)}
        self.peer: dict[int, dict[int, set[int]]] = {r: {} for r in range(world_size)}
        self.committed = {0: -1, 1: -1}
        self.proposals: dict[int, _Proposal | None] = {0: None, 1: None}
        self.live: set[int] = set()

    # ------------------------------------------------------------ what is held

    def held_add(self, rank: int, step: int) -> None:
        self.held.setdefault(rank, set()).add(step)

    def dropped(self, rank: int, steps: list[int]) -> None:
        self.held.setdefault(rank, set()).difference_update(steps)

    def replica_add(self, rank: int, node: int, step: int) -> None:
        self.peer.setdefault(rank, {}).setdefault(node, set()).add(step)

    def replica_dropped(self, rank: int, node: int, steps: list[int]) -> None:
        self.peer.setdefault(rank, {}).get(node, set()).difference_update(steps)

    def node_lost(self, node: int) -> None:
        self.live.discard(node)
        for holders in self.peer.values():
            holders.pop(node, None)
        for tier, p in self.proposals.items():
            if p is not None and node in p.voters:
                self.proposals[tier] = None

    def reset(
        self, restart: int, memory: dict[int, set[int]], peer: dict[int, dict[int, set[int]]]
    ) -> None:
        """A new generation restored ``restart``: later steps are gone everywhere."""
        self.held = {
            r: {s for s in memory.get(r, set()) if s <= restart} for r in range(self.world_size)
        }
        self.peer = {
            r: {n: {s for s in steps if s <= restart} for n, steps in peer.get(r, {}).items()}
            for r in range(self.world_size)
        }
        self.proposals = {0: None, 1: None}
        self.committed = {0: self._candidate(0)[0], 1: self._candidate(1)[0]}

    # ------------------------------------------------------------ commit

    def _required(self, rank: int) -> int:
        targets = self.targets.get(rank, ())
        return len(targets) if all(n in self.live for n in targets) else 1

    def _candidate(self, tier: int) -> tuple[int, dict[int, list[int]]]:
        """The newest step the tier could commit, and which node must vote for which ranks."""
        if tier == 0:
            common = set.intersection(*(self.held.get(r, set()) for r in range(self.world_size)))
            return max(common, default=-1), {}
        if not any(self.targets.values()):
            return -1, {}
        steps = {s for h in self.peer.values() for ss in h.values() for s in ss}
        for step in sorted(steps, reverse=True):
            voters: dict[int, list[int]] = {}
            for rank in range(self.world_size):
                holders = [
                    n for n, ss in self.peer.get(rank, {}).items() if step in ss and n in self.live
                ]
                if len(holders) < self._required(rank):
                    break
                for n in holders:
                    voters.setdefault(n, []).append(rank)
            else:
                return step, voters
        return -1, {}

    def maybe_propose(self, tier: int) -> None:
        if self.proposals[tier] is not None:
            return
        step, voters = self._candidate(tier)
        if step <= self.committed[tier]:
            return
        if tier == 0:
            voters = {n: [] for n in self.live}
        self.proposals[tier] = _Proposal(step, voters)
        for node, ranks in voters.items():
            self.send(node, "propose", tier=tier, step=step, ranks=ranks)

    def vote(self, tier: int, node: int, step: int, ok: bool) -> int | None:
        """Record a vote; returns the step when this vote completed its commit."""
        p = self.proposals[tier]
        if p is None or p.step != step or node not in p.voters:
            return None
        if not ok:
            self.proposals[tier] = None
            for n in p.voters:
                self.send(n, "abort", tier=tier, step=step)
            return None
        p.votes.add(node)
        if p.votes < set(p.voters):
            return None
        self.proposals[tier] = None
        self.committed[tier] = step
        for n in self.live:
            self.send(n, "committed", tier=tier, step=step)
        return step

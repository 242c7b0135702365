"""What an agent replicates and when: one transfer in flight per rank, always of its
newest snapshot (the bytes are the shell's ``cluster/replication.py``). A part of the
agent's core (``control/agent.py``): no I/O."""

from __future__ import annotations

from tierswap.control.agent_events import Replicate
from tierswap.tiers.memory import RankRing


class ReplicationQueue:
    """One transfer in flight per rank, always of its newest snapshot."""

    def __init__(self) -> None:
        self.targets: dict[int, tuple[int, ...]] = {}
        self.busy: set[int] = set()
        self.pending: set[int] = set()
        self.sent: dict[int, int] = {}
        self.generation = -1

    def offer(self, rank: int, ring: RankRing) -> Replicate | None:
        """A new snapshot of ``rank`` is held: send the newest one when the line is free."""
        if not self.targets.get(rank):
            return None
        if rank in self.busy:
            self.pending.add(rank)
            return None
        step = max(ring.held(), default=-1)
        if step <= self.sent.get(rank, -1):
            return None
        slot = ring.lease(step)
        assert slot is not None
        self.busy.add(rank)
        return Replicate(rank, step, slot, ring.layout(), self.generation)

    def done(self, rank: int, step: int, generation: int, ring: RankRing) -> Replicate | None:
        self.busy.discard(rank)
        if generation == self.generation:  # a step of an ended generation was not sent now
            self.sent[rank] = max(self.sent.get(rank, -1), step)
        if rank in self.pending:
            self.pending.discard(rank)
            return self.offer(rank, ring)
        return None

    def reset(self, generation: int, targets: dict[int, tuple[int, ...]]) -> None:
        """A new generation: the same steps may be sent again (a restore went back)."""
        self.generation, self.targets = generation, targets
        self.sent.clear()

"""The simulation's world (``control/sim.py``): the oracle's arithmetic, shared memory and
tier 2 held in memory, links that deliver after a random latency, and how often chaos
strikes."""

from __future__ import annotations

import mmap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tierswap.checksum import checksum_chunks
from tierswap.control import protocol as p
from tierswap.errors import CorruptPartError
from tierswap.shm import Segment
from tierswap.state import Layout, TensorEntry
from tierswap.tiers.durable import PartInfo

if TYPE_CHECKING:
    from tierswap.control.sim import Sim

LAYOUT = Layout(entries=(TensorEntry("v", "I64", (1,), 0, 8, deferred=True),), nbytes=8)
"""A simulated rank's state: one 64-bit integer."""
MASK = (1 << 63) - 1
FROM_WORKER = p.Codec(p.WorkerToAgent)
TO_WORKER = p.Codec(p.AgentToWorker)
FROM_AGENT = p.Codec(p.AgentToCoordinator)
TO_AGENT = p.Codec(p.CoordinatorToAgent)


class Violation(AssertionError):
    """An invariant of the control plane does not hold."""


def advance(value: int, step: int, total: int) -> int:
    """A rank's state after ``step``, from its own and the sum of all ranks' before it."""
    return (value * 6364136223846793005 + total * 1442695040888963407 + step) & MASK


def reference(world_size: int, steps: int) -> list[int]:
    """Every rank's final state in a run without failures."""
    values = [r + 1 for r in range(world_size)]
    for step in range(steps):
        total = sum(values) & MASK
        values = [advance(v, step, total) for v in values]
    return values


# ==================================================================== memory and tier 2


class MemorySegment(Segment):
    """A segment on plain memory (the simulation's /dev/shm)."""

    def __init__(self, name: str, size: int, registry: dict[str, MemorySegment]) -> None:
        super().__init__(Path(name), size, mmap.mmap(-1, max(size, 1)))
        self.registry = registry
        registry[name] = self

    def unlink(self) -> None:
        self.close()
        self.registry.pop(self.path.name, None)


class FakeTier2:
    """Tier 2 in memory: parts and COMMITs; ``fail`` makes every write raise OSError."""

    def __init__(self, url: str = "sim://tier2") -> None:
        self.url = url
        self.parts: dict[tuple[int, int], bytes] = {}
        self.commits: dict[int, tuple[int, dict[int, PartInfo]]] = {}
        self.fail = False

    def write_part(self, step: int, rank: int, data: bytes) -> PartInfo:
        if self.fail:
            raise OSError(f"{self.url}: write refused (injected)")
        self.parts[(step, rank)] = bytes(data)
        return PartInfo(rank, checksum_chunks([data]), "sim", len(data))

    def read_part(self, step: int, rank: int, expected: PartInfo) -> bytes:
        data = self.parts.get((step, rank))
        if data is None or checksum_chunks([data]) != expected.data:
            raise CorruptPartError(f"{self.url} step {step} rank {rank}", "missing or corrupt")
        return data

    def restorable_steps(self, world_size: int) -> frozenset[int]:
        return frozenset(s for s, (ws, _) in self.commits.items() if ws == world_size)

    def read_commit(self, step: int) -> dict[int, PartInfo]:
        if step not in self.commits:
            raise CorruptPartError(f"{self.url} step {step}", "no COMMIT")
        return dict(self.commits[step][1])

    def write_commit(self, step: int, world_size: int, parts: Mapping[int, PartInfo]) -> None:
        if self.fail:
            raise OSError(f"{self.url}: COMMIT refused (injected)")
        self.commits[step] = (world_size, dict(parts))

    def discard(self, step: int) -> bool:
        if self.fail:
            raise OSError(f"{self.url}: delete refused (injected)")
        if step in self.commits:
            return False
        before = len(self.parts)
        self.parts = {k: v for k, v in self.parts.items() if k[0] != step}
        return len(self.parts) < before

    def retain(self, keep: int) -> list[int]:
        gone = sorted(self.commits)[:-keep]
        for step in gone:
            del self.commits[step]
            self.parts = {k: v for k, v in self.parts.items() if k[0] != step}
        return gone


# ==================================================================== the scheduler


class Link:
    """One direction of a connection: in order, each message after a random latency;
    ``close`` delivers EOF after what was sent before it."""

    def __init__(
        self, sim: Sim, deliver: Callable[[bytes | None], None], duplicates: bool = False
    ) -> None:
        self.sim = sim
        self.deliver = deliver
        self.duplicates = duplicates
        """Whether chaos may deliver a message twice here (agent <-> coordinator, the
        messages a reconnecting sender would send again; not request/reply streams)."""
        self.last = 0.0
        self.closed = False

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        self._schedule(data)
        if self.duplicates and self.sim.rng.random() < self.sim.chaos.duplicate:
            self._schedule(data)  # a message delivered twice

    def _schedule(self, data: bytes | None) -> None:
        self.last = max(self.last, self.sim.now + self.sim.latency())
        self.sim.at(self.last, lambda: self.deliver(data))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._schedule(None)


@dataclass(slots=True)
class Chaos:
    """What may go wrong, and how often (per simulated second of the run)."""

    host_kills: float = 0.0
    worker_kills: float = 0.0
    freezes: float = 0.0
    link_cuts: float = 0.0
    duplicate: float = 0.0
    """Probability that a message between an agent and the coordinator is delivered
    twice (what a sender that reconnects and sends again would cause)."""
    until: float = 30.0
    """No new fault after this simulated time, so every run can end."""

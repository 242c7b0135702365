"""What the coordinator's core needs of tier 2, as a small interface.

The core lists committed steps, reads a COMMIT when it plans a restore, and writes COMMIT
and applies retention once every part of a step is durable. :class:`DurableRoot` does it
on a real fsspec root (``tiers/durable.py``); tests and the simulation hand the core an
in-memory fake that can fail on command.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from tierswap.tiers import catalog, durable
from tierswap.tiers.durable import PartInfo


class Tier2(Protocol):
    url: str

    def restorable_steps(self, world_size: int) -> frozenset[int]:
        """Steps committed by a job of this world size, with every base their delta parts
        need. Raises OSError."""

    def read_commit(self, step: int) -> dict[int, PartInfo]:
        """Each rank's part of ``step`` as COMMIT records it. Raises CorruptPartError or
        OSError."""

    def write_commit(self, step: int, world_size: int, parts: Mapping[int, PartInfo]) -> None:
        """Write ``step``'s COMMIT (its parts are durable). Raises OSError."""

    def retain(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` restorable steps; the steps deleted. Raises
        OSError."""

    def discard(self, step: int) -> bool:
        """Delete what was written of ``step`` unless it is committed. Raises OSError."""


class DurableRoot:
    """Tier 2 on an fsspec root, for the job named ``job`` (its COMMITs say so)."""

    def __init__(self, url: str, job: str | None = None) -> None:
        self.url = url
        self.job = job

    def restorable_steps(self, world_size: int) -> frozenset[int]:
        return frozenset(
            s.step
            for s in catalog.list_steps(self.url)
            if s.restorable and s.world_size == world_size
        )

    def read_commit(self, step: int) -> dict[int, PartInfo]:
        return durable.read_commit(self.url, step)[1]

    def write_commit(self, step: int, world_size: int, parts: Mapping[int, PartInfo]) -> None:
        durable.write_commit(self.url, step, world_size, parts, job=self.job)

    def retain(self, keep: int) -> list[int]:
        return catalog.retain(self.url, keep)

    def discard(self, step: int) -> bool:
        return catalog.discard(self.url, step)


class FencedRoot(DurableRoot):
    """A durable root written (COMMITs) and pruned (retention, discards) only while
    ``confirm`` (the etcd leader's guarded write, ``cluster/election.py``) says this
    coordinator leads: a deposed one raises there and changes nothing."""

    def __init__(self, url: str, job: str | None, confirm: Callable[[str, Any], None]) -> None:
        super().__init__(url, job)
        self.confirm = confirm

    def write_commit(self, step: int, world_size: int, parts: Mapping[int, PartInfo]) -> None:
        self.confirm("durable", step)
        super().write_commit(step, world_size, parts)

    def retain(self, keep: int) -> list[int]:
        self.confirm("retain", keep)  # deletes steps: only while this coordinator leads
        return super().retain(keep)

    def discard(self, step: int) -> bool:
        self.confirm("discard", step)
        return super().discard(step)

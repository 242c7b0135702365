"""Tier 1 in delta form (``--memory-tiers delta``), the peer's side: it holds one full
*base* snapshot of a rank and each later step as a delta against it (:mod:`tierswap.delta`).

A restore from here rebuilds base + one delta: deltas are never chained. The sender (the
protected rank's agent, :class:`~tierswap.tiers.delta_sender.BaseKeeper`) keeps its own
copy of the base to encode against, and takes a new one every ``base_every`` steps or once
a delta grew past ``threshold`` of the full size. The peer's bookkeeping
(:class:`DeltaRing`) runs on its agent's event loop, like
:class:`~tierswap.tiers.memory.RankRing`: the same holds for commits, the same rule that
the step committed in tier 1 and the newest one are never dropped, the same discard of a
timeline a restore went back from. Its bytes are immutable once stored (a base is never
written after it is checked, a delta is ``bytes``), so a server thread reads them without a
lease.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from tierswap import delta
from tierswap.checksum import checksum_chunks
from tierswap.errors import CorruptPartError
from tierswap.layout import Layout, itemsize
from tierswap.shm import populated
from tierswap.tiers import durable
from tierswap.tiers.memory import CommitVotes

MEMORY_BASES = "memory-bases"
"""Folder under the ``--persist`` root where delta mode writes tier 1's bases: one part per
rank and base step (``memory-bases/step-N/rank-R.*``), no COMMIT; never a restorable step."""


def itemsize_of(layout: Layout) -> int:
    """The element width that covers most of the snapshot's bytes: the delta codec splits
    byte planes by it (a wrong one costs ratio, never correctness)."""
    weights: Counter[int] = Counter()
    for e in layout.entries:
        weights[itemsize(e.dtype)] += e.nbytes
    return max(weights, key=lambda k: (weights[k], k)) if weights else 4


@dataclass(slots=True)
class Base:
    """A full snapshot that deltas are made against."""

    step: int
    layout: Layout
    buf: memoryview | None
    """Its bytes in memory; None once only tier 2 holds them (see ``durable``)."""
    checksum: str
    tree: dict[str, Any]
    durable: str | None = None
    """The tier-2 root its part was written under (``--persist``): where a peer that lost
    the bytes reads them back."""

    def verify(self) -> bool:
        """Whether its bytes are intact (a base only in tier 2 is checked when read)."""
        return self.buf is None or checksum_chunks(self.layout.chunks(self.buf)) == self.checksum

    def bytes(self, rank: int, where: str) -> memoryview:
        """Its bytes: from memory, or read back from tier 2 into the slot layout."""
        if self.buf is not None:
            return self.buf
        if self.durable is None:
            raise CorruptPartError(where, f"base step {self.step} is gone from memory and disk")
        try:
            flayout, _, data = durable.read_part(self.durable, self.step, rank)
        except (CorruptPartError, OSError) as e:
            raise CorruptPartError(where, f"base step {self.step} in tier 2: {e}") from e
        if flayout.signature() != self.layout.signature():
            raise CorruptPartError(where, f"base step {self.step} in tier 2 has another layout")
        out = spread(self.layout, data)
        if checksum_chunks(self.layout.chunks(out)) != self.checksum:
            raise CorruptPartError(where, f"base step {self.step} in tier 2 is not this base")
        return out


@dataclass(slots=True)
class Entry:
    """One restorable step: the base itself (``data`` None) or a delta against it."""

    step: int
    base: Base
    data: bytes | bytearray | None
    tree: dict[str, Any]
    checksum: str
    """Checksum of the full snapshot (tierswap.checksum over the layout's tensors)."""

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else len(self.data)

    @property
    def kind(self) -> str:
        """ "base", "delta", or "delta+durable" (its base must be read from tier 2 first)."""
        if self.data is None:
            return "base"
        return "delta" if self.base.buf is not None else "delta+durable"

    def rebuild(self, rank: int, where: str) -> memoryview:
        """The full snapshot. Raises CorruptPartError when it cannot be rebuilt bit for bit."""
        if self.data is None:
            if self.base.buf is None:
                raise CorruptPartError(where, "the base itself is no longer held")
            return self.base.buf
        base = self.base.bytes(rank, where)
        d = delta.Delta.from_bytes(self.data, where=where)
        out = populated(self.base.layout.nbytes)
        delta.decode_into(base, d, out, where=where)
        if checksum_chunks(self.base.layout.chunks(out)) != self.checksum:
            raise CorruptPartError(where, "the rebuilt snapshot does not match its checksum")
        return out


def spread(layout: Layout, data: memoryview) -> memoryview:
    """The inverse of :func:`contiguous`: a data section back into ``layout``'s offsets
    (padding zero, as in a fresh slot)."""
    out = populated(layout.nbytes)
    offset = 0
    for e in layout.entries:
        out[e.offset : e.offset + e.nbytes] = data[offset : offset + e.nbytes]
        offset += e.nbytes
    return out


class DeltaRing(CommitVotes):
    """The replicas of one rank held in delta form. Driven by one event loop (no locks)."""

    def __init__(self, rank: int, nslots: int) -> None:
        self.rank = rank
        self.nslots = nslots
        self.entries: dict[int, Entry] = {}
        self.latest: Base | None = None
        """The newest base received: what the sender's next deltas are made against, kept
        even when its own step is no longer held."""
        self.committed = -1
        self.proposed: set[int] = set()

    # ------------------------------------------------------------ the write path

    def base(self, step: int, checksum: str) -> Base | None:
        """The base of ``step`` if held and it is the one named (same checksum)."""
        for b in self.bases():
            if b.step == step and b.checksum == checksum and b.buf is not None:
                return b
        return None

    def put(self, entry: Entry) -> list[int]:
        """Hold ``entry``; returns the steps dropped to make room (maybe ``entry``'s own)."""
        old = self.entries.get(entry.step)
        if old is not None and old.checksum == entry.checksum and old.base is entry.base:
            return []
        self.entries[entry.step] = entry
        if entry.data is None:  # the sender's current base: its next deltas are against it
            self.latest = entry.base
        dropped = []
        while len(self.entries) > self.nslots:
            keep = {self.committed, *self.proposed, max(self.entries)}
            stale = sorted(s for s in self.entries if s not in keep)
            if not stale:
                break
            del self.entries[stale[0]]
            dropped.append(stale[0])
        return dropped

    def discard_after(self, step: int) -> list[int]:
        """A restore went back to ``step``: later steps (and a base taken after it) belong to
        an abandoned timeline."""
        dropped = sorted(s for s in self.entries if s > step)
        for s in dropped:
            del self.entries[s]
        for s, e in list(self.entries.items()):
            if e.base.step > step:
                del self.entries[s]
                dropped.append(s)
        if self.latest is not None and self.latest.step > step:
            self.latest = None
        self.committed = min(self.committed, step)
        self.proposed.clear()
        return dropped

    # ------------------------------------------------------------ readers

    def held(self) -> dict[int, str]:
        return {s: e.checksum for s, e in self.entries.items()}

    def kinds(self) -> dict[int, str]:
        """step -> :attr:`Entry.kind`: what a restore of it costs."""
        return {s: e.kind for s, e in self.entries.items()}

    def bases(self) -> list[Base]:
        """The bases still needed by a held step, and the latest one (each once)."""
        seen: dict[int, Base] = {} if self.latest is None else {id(self.latest): self.latest}
        for e in self.entries.values():
            seen.setdefault(id(e.base), e.base)
        return list(seen.values())

    def verify(self) -> list[int]:
        """Check every base and every delta's own checksum; drop what is corrupt. A corrupt
        base in memory is dropped from memory: its deltas stay when tier 2 holds it (read
        back for a restore), and go with it when not. Returns the steps dropped."""
        for b in self.bases():
            if not b.verify():
                b.buf = None  # the durable copy, if any, is checked when it is read
        if self.latest is not None and self.latest.buf is None:
            self.latest = None  # the sender sends it again
        bad = []
        for s, e in list(self.entries.items()):
            ok = e.base.buf is not None or (e.data is not None and e.base.durable is not None)
            if ok and e.data is not None:
                try:
                    delta.Delta.from_bytes(e.data)
                except CorruptPartError:
                    ok = False
            if not ok:
                del self.entries[s]
                bad.append(s)
        return sorted(bad)

    def nbytes(self) -> int:
        return sum(b.layout.nbytes for b in self.bases() if b.buf is not None) + sum(
            e.nbytes for e in self.entries.values()
        )

    def layout(self) -> Layout | None:
        bases = self.bases()
        return bases[-1].layout if bases else None

    def close(self) -> None:
        self.entries.clear()
        self.latest = None

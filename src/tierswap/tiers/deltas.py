"""Tier 1 in delta form (``--memory-tiers delta``): a peer holds one full *base* snapshot of a
rank and each later step as a delta against it (:mod:`tierswap.delta`).

A restore from here rebuilds base + one delta: deltas are never chained. The sender (the
protected rank's agent, :class:`BaseKeeper`) keeps its own copy of the base to encode against,
and takes a new one every ``base_every`` steps or once a delta grew past ``threshold`` of the
full size. The peer's bookkeeping (:class:`DeltaRing`) runs on its agent's event loop, like
:class:`~tierswap.tiers.memory.RankRing`: the same commit votes, the same rule that the step
committed in tier 1 and the newest one are never dropped, the same discard of a timeline a
restore went back from. Its bytes are immutable once stored (a base is never written after it
is checked, a delta is ``bytes``), so a server thread reads them without a lease.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierswap import delta
from tierswap.checksum import checksum_chunks
from tierswap.errors import CorruptPartError
from tierswap.shm import populated
from tierswap.state import Layout, torch_dtype
from tierswap.tiers import durable
from tierswap.tiers.durable import PartInfo
from tierswap.tiers.memory import CommitVotes, Slot

MEMORY_BASES = "memory-bases"
"""Folder under the ``--persist`` root where delta mode writes tier 1's bases: one part per
rank and base step (``memory-bases/step-N/rank-R.*``), no COMMIT; never a restorable step."""


def itemsize_of(layout: Layout) -> int:
    """The element width that covers most of the snapshot's bytes: the delta codec splits
    byte planes by it (a wrong one costs ratio, never correctness)."""
    weights: Counter[int] = Counter()
    for e in layout.entries:
        weights[torch_dtype(e.dtype).itemsize] += e.nbytes
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


class BaseKeeper:
    """The sender's side: the base each of its ranks encodes against, and when to renew it.

    Used by one replication thread per rank at a time (one transfer in flight per rank).
    """

    def __init__(self, base_every: int, threshold: float) -> None:
        self.base_every = base_every
        self.threshold = threshold
        self.bases: dict[int, Base] = {}
        self.renew: set[int] = set()
        """Ranks whose last delta grew past the threshold: their next snapshot is a base."""
        self.epoch = 0
        """Bumped by :meth:`discard_after`: a transfer begun before it keeps no new base."""
        self._lock = threading.Lock()
        """Replication threads decide and store bases; the event loop discards them."""

    def base_for(
        self,
        rank: int,
        step: int,
        layout: Layout,
        buf: memoryview,
        checksum: str,
        tree: Any,
        epoch: int | None = None,
    ) -> tuple[Base, bool]:
        """The base to send ``step`` against, and whether it is new (``step`` itself).
        ``epoch`` is :attr:`epoch` when the transfer was queued."""
        with self._lock:
            b = self.bases.get(rank)
            if not (
                b is None
                or b.layout != layout
                or step <= b.step
                or step - b.step >= self.base_every
                or rank in self.renew
            ):
                return b, False
        copy = populated(layout.nbytes)
        copy[:] = buf[: layout.nbytes]
        b = Base(step, layout, copy, checksum, dict(tree))
        with self._lock:
            if epoch is None or epoch == self.epoch:
                self.bases[rank] = b
                self.renew.discard(rank)
        return b, True

    def encode(self, rank: int, b: Base, buf: memoryview) -> bytes:
        """The delta of ``buf`` against ``b``; a large one renews the base next time."""
        assert b.buf is not None  # the sender's own bases are always in memory
        d = delta.encode(b.buf, buf[: b.layout.nbytes], itemsize=itemsize_of(b.layout))
        if d.nbytes > self.threshold * b.layout.nbytes:
            with self._lock:
                self.renew.add(rank)
        return d.to_bytes()

    def discard_after(self, step: int) -> None:
        """A restore went back to ``step``: a base taken later is of an abandoned timeline."""
        with self._lock:
            self.epoch += 1
            for rank in [r for r, b in self.bases.items() if b.step > step]:
                del self.bases[rank]

    def nbytes(self) -> int:
        return sum(b.layout.nbytes for b in self.bases.values())


class Traffic:
    """The coordinator's tally of what delta-mode replication sent, for the event log."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.full = 0
        self.encode_s = 0.0

    def add(self, kind: str, nbytes: int, full: int, encode_s: float) -> None:
        self.count[kind] += 1
        self.sent[kind] += nbytes
        self.full += full
        self.encode_s += encode_s

    def summary(self) -> dict[str, Any]:
        """Deltas and bases sent, their bytes against full snapshots, and encode speed."""
        deltas = self.count["delta"]
        return {
            "deltas": deltas,
            "bases": self.count["base"],
            "bytes_sent": sum(self.sent.values()),
            "bytes_full": self.full,
            "ratio": sum(self.sent.values()) / self.full if self.full else None,
            "encode_s": round(self.encode_s, 4),
        }


# ---------------------------------------------------------------- incremental tier 2


@dataclass(frozen=True, slots=True)
class Part:
    """One rank's part of a step to persist, from its leased tier-0 slot."""

    root: str
    step: int
    rank: int
    world_size: int
    layout: Layout
    slot: Slot
    token: int


def contiguous(layout: Layout, buf: memoryview) -> memoryview:
    """The layout's tensors back to back: a safetensors data section."""
    out = populated(layout.data_nbytes)
    offset = 0
    for chunk in layout.chunks(buf):
        out[offset : offset + len(chunk)] = chunk
        offset += len(chunk)
    return out


@dataclass(frozen=True, slots=True)
class DurableBase:
    step: int
    layout: Layout
    data: memoryview
    """The data section of the full part written at ``step``."""
    checksum: str
    """Its data checksum, as in that step's COMMIT."""


class DurableBases:
    """``--persist-deltas``, in the agent's tier-2 writer threads: each rank's part is written
    as a delta against the data section of the rank's newest full part when that step is
    still committed with these very bytes (its COMMIT's data checksum), younger than
    ``base_every`` steps and the delta is at most ``threshold`` of the data; else it is
    written full and becomes the base."""

    def __init__(self, base_every: int, threshold: float) -> None:
        self.base_every = base_every
        self.threshold = threshold
        self.bases: dict[int, DurableBase] = {}

    def write(self, p: Part, committed: Mapping[int, Mapping[int, str]]) -> PartInfo:
        """Write ``p``, as a delta where it pays. ``committed``: step -> rank -> data checksum
        of the full parts in tier 2 that a base may be."""
        data = contiguous(p.layout, p.slot.segment.buf)
        b = self.bases.get(p.rank)
        if (
            b is not None
            and committed.get(b.step, {}).get(p.rank) == b.checksum
            and b.layout == p.layout
            and 0 < p.step - b.step < self.base_every
        ):
            d = delta.encode(b.data, data, itemsize=itemsize_of(p.layout))
            if d.nbytes <= self.threshold * len(data):
                return durable.write_delta_part(
                    p.root, p.step, p.rank, p.world_size, p.layout, p.slot.tree,
                    p.slot.checksum, b.step, d.to_bytes(), b.checksum,
                )  # fmt: skip
        info = durable.write_part(
            p.root, p.step, p.rank, p.world_size, p.layout, p.slot.tree, p.slot.segment.buf,
            p.slot.checksum,
        )  # fmt: skip
        self.bases[p.rank] = DurableBase(p.step, p.layout, data, p.slot.checksum)
        return info

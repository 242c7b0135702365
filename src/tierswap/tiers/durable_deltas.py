"""Incremental tier 2 (``--persist-deltas``), in the agent's tier-2 writer threads: a rank's
part written as a delta against its part of an older committed full step, where it pays."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tierswap import delta
from tierswap.layout import Layout
from tierswap.shm import populated
from tierswap.tiers import durable
from tierswap.tiers.deltas import itemsize_of
from tierswap.tiers.durable import PartInfo
from tierswap.tiers.memory import Slot


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

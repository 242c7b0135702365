"""Where the tensors of a snapshot lie in one flat buffer: plain data, no torch.

The agent, the replica servers and the tier-2 writer move and check snapshots by their
:class:`Layout` alone; keeping it apart from ``state.py`` (which flattens torch objects)
keeps torch out of those processes: an agent starts in a fraction of a second instead of
the two of importing torch, and holds a fifth of the memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tierswap.errors import StateMismatchError

ALIGN = 64
"""Every tensor of a layout starts at a multiple of this many bytes."""

ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
"""Bytes per element of each dtype, by its safetensors name (the durable format's)."""


def itemsize(code: str) -> int:
    """Bytes per element of the dtype named ``code``."""
    try:
        return ITEMSIZE[code]
    except KeyError:
        raise StateMismatchError(f"unknown tensor dtype {code!r} in a snapshot") from None


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a snapshot: where its bytes sit and what they mean."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    deferred: bool = False
    """Copied off the critical path (parameters, optimizer state), fenced by optimizer.step."""
    global_shape: tuple[int, ...] | None = None
    """For a DTensor shard: the shape of the whole tensor."""
    placements: tuple[str, ...] | None = None
    """For a DTensor shard: its placements, e.g. ``("Shard(dim=0)",)``."""
    mesh_coord: tuple[int, ...] | None = None
    """For a DTensor shard: this rank's coordinate in the device mesh."""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "deferred": self.deferred,
        }
        if self.global_shape is not None:
            d["global_shape"] = list(self.global_shape)
            d["placements"] = list(self.placements or ())
            d["mesh_coord"] = list(self.mesh_coord or ())
        return d

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> TensorEntry:
        gs = d.get("global_shape")
        return TensorEntry(
            key=str(d["key"]),
            dtype=str(d["dtype"]),
            shape=tuple(int(x) for x in d["shape"]),
            offset=int(d["offset"]),
            nbytes=int(d["nbytes"]),
            deferred=bool(d.get("deferred", False)),
            global_shape=None if gs is None else tuple(int(x) for x in gs),
            placements=None if gs is None else tuple(str(x) for x in d["placements"]),
            mesh_coord=None if gs is None else tuple(int(x) for x in d["mesh_coord"]),
        )


@dataclass(frozen=True, slots=True)
class Layout:
    """Where every tensor of a snapshot lies in one flat buffer of ``nbytes`` bytes."""

    entries: tuple[TensorEntry, ...]
    nbytes: int

    def signature(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        return tuple((e.key, e.dtype, e.shape) for e in self.entries)

    def to_json(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes, "entries": [e.to_json() for e in self.entries]}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Layout:
        layout = Layout(
            entries=tuple(TensorEntry.from_json(e) for e in d["entries"]),
            nbytes=int(d["nbytes"]),
        )
        layout.check()
        return layout

    def check(self) -> None:
        """Raise StateMismatchError if the entries do not fit the buffer (crafted input)."""
        for e in self.entries:
            want = math.prod(e.shape) * itemsize(e.dtype)
            negative = any(d < 0 for d in e.shape)
            if negative or e.nbytes != want or e.offset < 0 or e.offset + e.nbytes > self.nbytes:
                raise StateMismatchError(f"layout entry {e.key!r} does not fit its buffer")

    def chunks(self, buf: memoryview) -> Iterator[memoryview]:
        """The bytes of each tensor in order: what checksums and files are made of."""
        for e in self.entries:
            yield buf[e.offset : e.offset + e.nbytes]

    @property
    def data_nbytes(self) -> int:
        """Bytes of tensor data, without alignment padding."""
        return sum(e.nbytes for e in self.entries)

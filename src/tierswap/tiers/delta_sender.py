"""Tier 1 in delta form, the sender's side: the base each rank encodes its replicas against
(``--memory-tiers delta``), and when to renew it. The peer's side is
:mod:`tierswap.tiers.deltas`."""

from __future__ import annotations

import threading
from typing import Any

from tierswap import delta
from tierswap.layout import Layout
from tierswap.shm import populated
from tierswap.tiers.deltas import Base, itemsize_of


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

"""The agent's tier-2 writer: its ranks' parts of a step to persist, on threads of their
own (a slow disk must not hold up checksums or replication), full or, with
``--persist-deltas``, as deltas against an older full part (:class:`DurableBases`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tierswap.config import Config
from tierswap.control.agent_events import PartWritten
from tierswap.tiers import durable
from tierswap.tiers.durable_deltas import DurableBases, Part

Bases = dict[int, dict[int, str]]
"""step -> rank -> data checksum of the full parts committed in tier 2 (delta bases)."""


class PartWriter:
    def __init__(self, cfg: Config, post: Callable[[Any], None]) -> None:
        self.post = post
        """Posts ``PartWritten`` once per part, written or failed, with its slot."""
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierswap-persist")
        self.bases = DurableBases(cfg.base_every, cfg.delta_threshold)
        self.deltas = cfg.persist_deltas

    def submit(self, part: Part, bases: Bases, delay: float = 0.0) -> None:
        self.pool.submit(self._write, part, bases, delay)

    def _write(self, p: Part, bases: Bases, delay: float = 0.0) -> None:
        try:
            time.sleep(delay)  # injected slow storage
            if self.deltas:
                info = self.bases.write(p, bases)
            else:
                info = durable.write_part(
                    p.root, p.step, p.rank, p.world_size, p.layout, p.slot.tree,
                    p.slot.segment.buf, p.slot.checksum,
                )  # fmt: skip
            self.post(PartWritten(p.rank, p.step, p.token, p.slot, info))
        except Exception as e:  # reported: the job keeps training on the memory tiers
            error = f"{type(e).__name__}: {e}"
            self.post(PartWritten(p.rank, p.step, p.token, p.slot, None, error))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

"""Tier 2 from the coordinator's side: when to persist, collecting parts, writing COMMIT.

Agents write the parts (never the trainer); the coordinator writes ``COMMIT`` last, once
every part is durable, then applies retention. Failures to write never stop training:
they are reported as ``durability_failing`` until a later step makes it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from tierswap.config import Config
from tierswap.control.commands import Out
from tierswap.control.ports import Tier2
from tierswap.control.protocol import Persist
from tierswap.tiers.durable import PartInfo

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""Errors of a full root: no space, a quota (the usual "full" of a shared filesystem), a
file over its limit."""


def _full(error: str) -> bool:
    """Whether an agent's error text names a full root (its errno, or its strerror)."""
    return any(f"[Errno {n}]" in error or os.strerror(n) in error for n in FULL)


@dataclass(slots=True)
class Request:
    step: int
    token: int
    """Tells this request's parts from those of one abandoned at a failure."""
    parts: dict[int, PartInfo] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    answered: set[int] = field(default_factory=set)
    """Ranks whose part was written or failed."""


class Persistence:
    def __init__(
        self, cfg: Config, tier2: Tier2 | None, out: Out, broadcast: Callable[[Persist], None]
    ) -> None:
        self.cfg = cfg
        self.world_size = cfg.world_size
        """Ranks of a step: ``cfg.world_size``, fewer while the job is shrunk."""
        self.tier2 = tier2
        self.out = out
        self.broadcast = broadcast
        self.inflight: Request | None = None
        self.last_request = -1
        self.token = 0
        self.committed = -1
        self.ok = True
        self.gone: str | None = None
        """Why tier 2 is not this job's any more (another job took the root over)."""
        self.held: dict[int, dict[int, str]] = {}
        """Steps of this timeline committed in tier 2 and kept by retention, with each full
        part's data checksum: what a delta part may be made against (``--persist-deltas``)."""
        self.newest = -1
        """The newest step of this timeline in tier 2 (committed by this run, or the step
        it resumed from): what tier 2 trailing behind is counted from."""
        self.deferred: int | None = None
        """A step that came due while another was being written: the newest step is
        written in its place once that write is done (tier 0 keeps no older one)."""

    def maybe_persist(self, step: int, final: bool = False) -> None:
        """Ask the agents to write ``step`` (committed in tier 0) when it is due. A step
        due while another is being written is deferred (and one deferred before it, never
        written, skipped); each is logged and said, never silent."""
        every = self.cfg.persist_every
        due = self.last_request < 0 or step // every > self.last_request // every
        if self.tier2 is None or self.gone is not None or not (due or final):
            return
        if self.inflight is not None:
            if due and (self.deferred is None or step // every > self.deferred // every):
                self._defer(step // every * every, self.inflight.step)
            return
        if step <= self.committed:
            return
        if self.deferred is not None:
            self.out.log("durable_step_deferred_written", due=self.deferred, step=step)
            self.deferred = None
        self._request(step, {s: dict(parts) for s, parts in self.held.items()}, {})

    def salvage(self, step: int, replicas: dict[int, int]) -> None:
        """Write ``step`` now, whatever is due or being written: the lost ranks' parts
        from the replicas the nodes in ``replicas`` (rank -> node) hold, full parts only."""
        self.deferred = None
        self._request(step, {}, replicas)

    def _request(
        self, step: int, bases: dict[int, dict[int, str]], replicas: dict[int, int]
    ) -> None:
        assert self.tier2 is not None
        self.last_request = step
        self.token += 1
        self.inflight = Request(step, self.token)
        self.broadcast(
            Persist(
                step=step,
                root=self.tier2.url,
                world_size=self.world_size,
                token=self.token,
                bases=bases,
                replicas=dict(replicas),
            )
        )

    def _defer(self, due: int, writing: int) -> None:
        """Step ``due`` came due while step ``writing`` is still being written."""
        if self.deferred is not None:
            self.out.log("durable_step_skipped", step=self.deferred, superseded_by=due)
            self.out.say(
                f"tier 2 is behind: step {self.deferred} was never persisted (step "
                f"{writing} is still being written, and step {due} is due now)"
            )
        self.deferred = due
        behind = due - self.newest
        self.out.log("durable_step_deferred", step=due, writing=writing, newest=self.newest)
        self.out.say(
            f"tier 2 is behind: step {due} is due while step {writing} is still being "
            f"written; the newest step is written once it is done (tier 2 trails tier 0 by "
            f"{behind} steps)"
        )

    def trailing(self, newest: int) -> int:
        """Steps tier 2 trails ``newest`` by while it cannot keep up (a due step waits);
        0 while it keeps to ``--persist-every``."""
        if self.deferred is None:
            return 0
        return newest - self.newest

    def cancel(self, restart: int | None = None, durable: frozenset[int] = frozenset()) -> None:
        """A failure: parts of a dead node never come; the next due step is asked anew.
        ``durable``: the steps tier 2 holds (the newest up to ``restart`` is this
        timeline's)."""
        self.inflight = None
        self.deferred = None  # the steps after the restart are trained again
        if restart is not None:
            self.newest = max((s for s in durable if s <= restart), default=-1)
            self.last_request = restart
            self.held = {s: p for s, p in self.held.items() if s <= restart}

    def forget(self, step: int) -> None:
        """``step`` of tier 2 proved unreadable: never a base again."""
        self.held.pop(step, None)

    def on_parts(self, token: int, parts: list[PartInfo], errors: dict[int, str]) -> int | None:
        """A node's parts are written (or failed). Returns the step when it got committed."""
        p = self.inflight
        if p is None or token != p.token:
            return None  # a write requested before a failure
        for part in parts:
            p.answered.add(part.rank)
            p.parts[part.rank] = part
        for rank, error in sorted(errors.items()):
            p.answered.add(rank)
            p.errors.append(f"rank {rank}: {error}")
        if len(p.answered) < self.world_size:
            return None
        self.inflight = None
        if p.errors:
            self.failing(f"step {p.step} not persisted: {p.errors[0]}")
            self._clean_up_after(p)
            return None
        return self._commit(p)

    def _clean_up_after(self, p: Request) -> None:
        """A step that failed leaves nothing behind: the parts that were written would take
        room for nothing. On a full root, older committed steps beyond the newest go too,
        so that the next step fits: tier 2 moves on instead of staying at the last step
        that fit (the newest committed step is never deleted)."""
        assert self.tier2 is not None
        try:
            discarded = self.tier2.discard(p.step)
        except OSError as e:
            self.out.log("discard_failed", step=p.step, error=str(e))
            return
        if not any(_full(e) for e in p.errors):
            if discarded:
                self.out.log("step_discarded", step=p.step, tier=2)
            return
        try:
            # only once this run committed a step of its own: retention keeps the newest
            # committed step by its number, which may be another world size's, or a step
            # this run fell back from (a resumed run's restart step would go)
            deleted = self.tier2.retain(1) if self.committed >= 0 else []
        except OSError as e:
            deleted = []
            self.out.log("retention_failed", error=str(e))
        for gone in deleted:
            self.held.pop(gone, None)
        self.out.log("durable_root_full", step=p.step, discarded=discarded, deleted=deleted)
        if deleted:
            self.out.say(
                f"durable root full: step {p.step} discarded, older step(s) "
                f"{', '.join(map(str, deleted))} deleted to make room (step {self.committed} "
                "is kept)"
            )

    def _commit(self, p: Request) -> int | None:
        assert self.tier2 is not None
        if self.gone is not None:
            return None
        try:
            self.tier2.write_commit(p.step, self.world_size, p.parts)
        except OSError as e:
            self.failing(f"step {p.step}: COMMIT not written: {e}")
            p.errors.append(f"COMMIT: {e}")
            self._clean_up_after(p)  # its parts, and room on a full root
            return None
        try:
            deleted = self.tier2.retain(self.cfg.keep)
        except OSError as e:
            deleted = []
            self.out.log("retention_failed", error=str(e))
        self.committed = self.newest = p.step
        self.held[p.step] = {r: part.data for r, part in p.parts.items() if part.base is None}
        for gone in deleted:
            self.held.pop(gone, None)
        deltas = sum(1 for part in p.parts.values() if part.base is not None)
        self.out.log(
            "snapshot_committed",
            tier=2,
            step=p.step,
            deleted=deleted,
            **({"delta_parts": deltas} if deltas else {}),
        )
        if not self.ok:
            self.ok = True
            self.out.say(f"durability restored: step {p.step} is in {self.tier2.url}")
        return p.step

    def lost(self, why: str) -> None:
        """The root is another job's now: nothing more is written there."""
        self.gone = why
        self.inflight = None
        self.failing(f"{why}; no more steps are written there")

    def failing(self, why: str) -> None:
        self.ok = False
        self.out.log("durability_failing", reason=why)
        self.out.say(f"durability failing, training goes on in memory: {why}")

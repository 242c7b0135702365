"""Commits and what tier 1 is done with: the coordinator core's decisions about a step
that nodes hold, or never will (functions of a
:class:`~tierswap.control.coordinator.CoordinatorCore`, whose state they read and change;
no I/O).

A step is committed in a tier once every voter holds it (``held``; the counting is
:class:`~tierswap.control.commits.TierCommits`'), which is broadcast and starts the
durable write; a step some node will never hold releases the holds of it (``never``).
Tier 1 is *done* with a step once it committed it or gave it up (``settle``): the
trainers' ``optimizer.step()`` waits for that (``--max-redo``). A replica transfer that
broke off is given up only a heartbeat later (``doubt``, ``given_up``), since the node
at its other end may be dying.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierswap.control import progress, resize
from tierswap.control import protocol as p

if TYPE_CHECKING:
    from tierswap.control.coordinator import CoordinatorCore


def held(core: CoordinatorCore, node: int, tier: int, step: int) -> None:
    """``node`` holds ``step`` in ``tier``: the step commits once every voter does."""
    if not core._commits_open() or tier not in core.tiers:
        return
    outcome = core.tiers[tier].held(node, step)
    released(core, tier, outcome.released)
    if outcome.committed is not None:
        commit(core, tier, outcome.committed)


def never(core: CoordinatorCore, step: int, tiers: tuple[int, ...]) -> None:
    """``step`` will never be complete in these tiers (a skipped snapshot, a replica
    refused or not sent): tier 1 is done with it, and holds of it are released."""
    if not core._commits_open():
        return
    for tier in tiers:
        released(core, tier, core.tiers[tier].never(step).released)
    if 1 in tiers:
        settle(core, step)


def doubt(core: CoordinatorCore, step: int, now: float) -> None:
    """A transfer of ``step``'s replica broke off between two nodes. Most often one of
    them is dying, and its connection here says so a moment later; giving the step up
    in tier 1 at once would let the trainers' next optimizer step go on without it, so
    that the failure, found then, costs one step more than ``--max-redo``. The step is
    given up a heartbeat later, if this generation still runs (a peer that lives on
    has only held training back that long)."""
    core.doubted.setdefault((core.generation, step), now + core.cfg.heartbeat)


def given_up(core: CoordinatorCore, now: float, gap: float) -> None:
    """Steps doubted a heartbeat ago: tier 1 is done with them, if their generation
    still runs. Not on a tick that came late (``gap``): the loop was held up, and a
    lost connection may be waiting in its queue behind the tick."""
    if gap > core.cfg.heartbeat:
        return
    for key, due in list(core.doubted.items()):
        if now >= due:
            del core.doubted[key]
            if key[0] == core.generation and core._commits_open():
                core.out.log("tier1_given_up", step=key[1], generation=key[0])
                never(core, key[1], tiers=(1,))


def released(core: CoordinatorCore, tier: int, steps: list[tuple[int, int]]) -> None:
    """Each node of ``steps`` lets its hold of that step go; tier 1 is done with them."""
    for node, step in steps:
        core._send_node(node, p.Release(tier=tier, step=step))
    if tier == 1 and steps:
        settle(core, max(s for _, s in steps))


def commit(core: CoordinatorCore, tier: int, step: int) -> None:
    core.ever_committed = True
    core.ever_protected = core.ever_protected or tier == 1
    core.out.log("snapshot_committed", tier=tier, step=step)
    core._broadcast(p.Committed(tier=tier, step=step))
    if tier == 1:
        core.settled = max(core.settled, step)  # agents take a tier-1 commit as settled
    else:
        if core.draining is None:  # (a stopping job writes its one step, no other)
            core.persister.maybe_persist(step)
        resize.maybe_grow(core, core.now)
    progress.maybe_done(core)


def settle(core: CoordinatorCore, step: int) -> None:
    """Tier 1 is done with ``step`` without committing it: agents tell their trainers,
    whose ``optimizer.step()`` waits for it (``--max-redo``)."""
    if step > core.settled:
        core.settled = step
        core._broadcast(p.Settled(step=step))

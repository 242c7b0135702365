"""``--on-no-spare shrink``: the coordinator core's resizing, apart from the rest of its
decisions (functions of a :class:`~tierswap.control.coordinator.CoordinatorCore`, whose state
they read and change; no I/O).

A node lost with no spare parked: the newest step memory holds is written to tier 2
first (``salvage``, a lost rank's part from a replica), then the nodes left are numbered
anew and the job goes on resharded (``shrink``); a spare parking later makes it grow back
at a step boundary from a fresh tier-2 step (``maybe_grow``, ``grow``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierswap.control import failures, membership
from tierswap.control.restore import Reports
from tierswap.control.states import Phase
from tierswap.plan import Tier

if TYPE_CHECKING:
    from tierswap.control.coordinator import CoordinatorCore

RESHARD_POLICY = (
    "parameters and optimizer state resharded by torch.distributed.checkpoint; every "
    "other value (data cursors, counters) taken from old rank 0 by every rank; RNG "
    "streams left as the script seeded them"
)
"""What a resume at another world size does with each kind of value (README, docs)."""


def shrink(core: CoordinatorCore, lost: list[int]) -> bool:
    """``--on-no-spare shrink``: the nodes left go on by themselves, numbered anew,
    from tier 2's newest step resharded to their world size. False (the job waits, as
    with "wait") where tier 2 holds no step of this job yet or no node is left."""
    gone = core.persister.gone
    source = None if gone is not None else newest_durable(core)
    left = len(core.hosts.members)
    if source is None or not left:
        if not core.shrink_refused:
            core.shrink_refused = True
            why = "no node is left" if not left else gone or f"{core.cfg.persist} holds no step yet"
            core.out.log("shrink_refused", nodes=lost, reason=why)
            core.out.say(f"cannot shrink past nodes {lost}: {why}; waiting instead")
        return False
    core.shrink_refused = False
    before, redone = core.world_size, max(0, core.last_step - source[0])
    moved = core.hosts.close_ranks()
    resize(core, left, source)
    core.out.log(
        "shrank",
        nodes=left,
        world_size=core.world_size,
        from_world_size=before,
        lost=lost,
        renumbered={str(old): new for old, new in sorted(moved.items()) if old != new},
        step=source[0],
        redone=redone,
        reason=f"no spare for nodes {lost} (--on-no-spare shrink)",
        policy=RESHARD_POLICY,
    )
    core.out.say(
        f"no spare for nodes {lost}: going on with {left} nodes ({core.world_size} "
        f"ranks) from tier-2 step {source[0]} ({redone} step(s) trained again). The run "
        "leaves the bit-exact path: its batches and resharded state differ from a run at "
        f"{before} ranks. It grows back once hosts join."
    )
    return True


def salvage(core: CoordinatorCore) -> bool:
    """Before shrinking: write to tier 2 the newest step the memory tiers hold for
    every rank, a lost rank's part from the replica a live node holds, so that the job
    goes on a step or so back, as a hot-swap would, not from an older tier-2 step.
    False (shrink from what tier 2 has) where no newer step is held so, or with delta
    replicas, or once tried for this failure."""
    if core.salvage_tried or core.tier2 is None or core.persister.gone is not None:
        return False
    core.salvage_tried = True
    if core.cfg.memory_tiers != "full" or core.parity is not None:
        return False  # a lost rank's part is written from a whole replica only
    _, plan, _ = core.reports.plan(core.durable_steps, core.hosts.address_of, core._bad_commit)
    newest = newest_durable(core)
    if plan.step is None or (newest is not None and plan.step <= newest[0]):
        return False
    live = {r for n in core.hosts.members for r in core._ranks_of(n)}
    replicas: dict[int, int] = {}
    for rank, src in plan.sources.items():
        if (src.tier == Tier.MEMORY) != (rank in live) or src.tier == Tier.DURABLE:
            return False  # only a rank's own node writes it from tier 0
        if src.tier == Tier.PEER:
            assert src.node is not None
            replicas[rank] = src.node
    core.salvage = plan.step
    core.deadline = core.now + max(core.cfg.startup_timeout, 600.0)  # a whole step to write
    core.out.log("salvaging", step=plan.step, replicas={str(r): n for r, n in replicas.items()})
    core.out.say(
        f"writing step {plan.step} to tier 2 before shrinking (ranks {sorted(replicas)} "
        "from their replicas)"
    )
    core.persister.salvage(plan.step, replicas)
    return True


def salvaged(core: CoordinatorCore, committed: int | None, now: float) -> None:
    """The step written before a shrink is committed (or failed: the shrink goes on
    from what tier 2 had)."""
    step, core.salvage = core.salvage, None
    core.deadline = now + core.cfg.startup_timeout
    if committed is None:
        core.out.say(f"step {step} could not be written to tier 2; shrinking from an older one")
    failures.maybe_start(core, now)


def newest_durable(core: CoordinatorCore) -> tuple[int, int] | None:
    """(step, world size) of tier 2's newest step this job may go on from."""
    steps = core.durable_steps()
    if steps:
        return max(steps), core.world_size
    return core.reshard


def maybe_grow(core: CoordinatorCore, now: float) -> None:
    """Shrunk, with hosts parked: grow back at a step boundary, from a tier-2 step at
    least as new as the newest step tier 0 had committed when they came (asked for at
    once, whatever ``--persist-every`` says)."""
    if core.nodes >= core.cfg.nodes or not core.hosts.spares or core.phase != Phase.RUNNING:
        return
    if core.expected is not None:
        return  # taking over: the generation the hosts had is stopped first
    if core.total is not None and core.tiers[0].committed >= core.total - 1:
        return  # every step is trained: nothing to grow for
    if core.grow_after is None:
        core.grow_after = core.tiers[0].committed
        core.out.log("grow_pending", spares=list(core.hosts.spares), after=core.grow_after)
    floor = -1 if core.reshard is None else core.reshard[0]
    durable, memory = core.persister.committed, core.tiers[0].committed
    if durable > floor and durable >= core.grow_after:
        grow(core, durable, now)
    elif core.persister.inflight is None and memory > max(durable, floor):
        core.persister.maybe_persist(memory, final=True)


def grow(core: CoordinatorCore, step: int, now: float) -> None:
    """End the shrunk generation and start one at the size the spares allow."""
    before, nodes = core.world_size, min(core.cfg.nodes, core.nodes + len(core.hosts.spares))
    core.out.log("growing", nodes=nodes, from_world_size=before, step=step)
    core.out.say(
        f"hosts {core.hosts.spares[: nodes - core.nodes]} joined: growing back to {nodes} "
        f"nodes from tier-2 step {step}"
    )
    core.phase.move(Phase.RECOVERING)
    core.persister.cancel()
    core.deadline = now + core.cfg.startup_timeout
    failures.stop_nodes(core, [])  # it goes on from tier 2: no replica is read
    core.hosts.vacant = set(range(core.nodes, nodes))
    resize(core, nodes, (step, before))


def resize(core: CoordinatorCore, nodes: int, source: tuple[int, int]) -> None:
    """The job runs on ``nodes`` nodes from now on, its next generation started from
    ``source`` (step, world size) in tier 2, resharded. What memory tiers hold is of
    the old ranks and is dropped; the old size's tier-2 steps up to it are superseded."""
    set_size(core, nodes)
    core.reshard = core.resized = source
    core.grow_after = None
    core.persister.held = {}  # delta bases: parts of the old ranks
    membership.announce_placement(core)


def set_size(core: CoordinatorCore, nodes: int) -> None:
    core.nodes = nodes
    core.reports = Reports(core.world_size, core.tier2)
    core._place()
    core.clock.world_size = core.persister.world_size = core.world_size
    core.spare_memory.resized(nodes)


def nothing_newer(core: CoordinatorCore, step: int) -> bool:
    """Whether tier 2 lists no step of this world size newer than ``step`` (one that a
    restore passed over as unreadable would be a timeline to keep, not to go back
    past), and could be listed."""
    if core.tier2 is None:
        return False
    try:
        return not any(s > step for s in core.tier2.restorable_steps(core.world_size))
    except OSError:
        return False

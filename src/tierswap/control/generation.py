"""A generation's start: the coordinator core's side of it, apart from the rest of its
decisions (functions of a :class:`~tierswap.control.coordinator.CoordinatorCore`, whose
state they read and change; no I/O).

Once every member stopped and reported what it holds, :func:`start` plans the restore
(``control/restore.py`` and ``plan.py``), resets each tier's commit to what the holdings
still have, and sends each member its ``start``: its ranks, their plans, where their
replicas go and whose it holds. A generation with no step of its world size starts
from tier 2's step of another size, resharded, or from ``--init-from``
(:func:`init_from`); :func:`initialized` reports what that load lacked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierswap.control import progress, resize
from tierswap.control import protocol as p
from tierswap.control.commands import JobStopped, Send
from tierswap.control.commits import newest_in_memory, newest_parity, newest_replicated
from tierswap.control.restore import lost_message, memory_lost
from tierswap.control.states import Phase
from tierswap.errors import listed
from tierswap.plan import Holdings, Plan

if TYPE_CHECKING:
    from tierswap.control.coordinator import CoordinatorCore


def start(core: CoordinatorCore, now: float) -> None:
    """Plan the restore from what the nodes reported and start the next generation on
    every member: the step, each rank's source, each tier's commit; or start over, or
    stop the job when no step reaches every rank and something protected was lost."""
    if core.resized is not None:
        core.reports.forget()  # what the memory tiers hold is of the old ranks
    holdings, plan, plans = core.reports.plan(
        core.durable_steps, core.hosts.address_of, core._bad_commit
    )
    for step, why in plan.skipped:
        core.out.log("restore_skipped", step=step, reason=why)
    # with tier 1 or 2 on, a loss before either ever committed a step costs only the
    # steps since the start: the job starts over rather than stop
    beyond = core.cfg.persist is not None or (core.cfg.replicas > 0 and core.nodes > 1)
    protected = core.ever_protected if beyond else core.ever_committed
    if plan.step is None and (protected or holdings.durable):
        if core.reshard is None or not resize.nothing_newer(core, core.reshard[0]):
            raise JobStopped(lost_message(plan, core.cfg.persist))
        if core.resized is None:  # nothing of this size is left: where it started
            why = f"no step of world size {core.world_size} is left in any tier"
            core.out.log("restore_fallback", step=core.reshard[0], tier=2, reason=why)
            core.out.say(f"going on from tier-2 step {core.reshard[0]} again: {why}")
    elif plan.step is None and core.ever_committed and core.reshard is None:
        why = "no tier that outlives a node had committed a step yet"
        core.out.log("started_over", reason=why, skipped=[s for s, _ in plan.skipped])
        core.out.say(f"starting the job over from its first step: {why}")
    core.resized = None
    core.resharded_from = (
        core.reshard[0] if plan.step is None and core.reshard is not None else None
    )
    say_fallback(core, holdings, plan)
    core.plan = plan
    core.generation += 1
    core.door.generation = core.generation
    core.phase.move(Phase.RUNNING)
    core.restored.clear()
    core.initialized.clear()
    core.finished.clear()
    restart = -1 if plan.step is None else plan.step
    committed = reset_commits(core, holdings, restart)
    core.persister.cancel(restart, holdings.durable)
    # parts of later steps will be written anew by this timeline
    core.reports.restarted(restart)
    core.deadline = float("inf")
    core.clock.generation_started(now)
    for node, conn in sorted(core.hosts.agents().items()):
        msg = start_message(core, node, plans, restart, committed)
        core.out.add(Send(conn, msg, core.generation))
    core.out.log(
        "generation_started",
        generation=core.generation,
        step=plan.step,
        members={str(n): h for n, h in sorted(core.hosts.members.items())},
        spares=list(core.hosts.spares),
        world_size=core.world_size,
        stale_dropped=core.door.take_counts(),
    )
    progress.inject_nodes(core, core.faults.at_generation(core.generation), now)


def reset_commits(core: CoordinatorCore, holdings: Holdings, restart: int) -> tuple[int, int]:
    """A new generation restored ``restart``: later steps are gone everywhere; each
    tier's commit is the newest step its holdings still have for every rank."""
    ws = core.world_size
    live = set(core.hosts.members)
    if core.parity is not None:
        replicated = newest_parity(
            holdings.parity_held, core.parity.holds, live, restart, holdings.memory, ws
        )
    else:
        replicated = newest_replicated(ws, holdings.peer, core.targets, live, restart)
    committed = (newest_in_memory(ws, holdings.memory, restart), replicated)
    core.tiers[0].reset(committed[0], core.hosts.members)
    core.tiers[1].reset(committed[1], core.protectors & live)
    core.settled = committed[1]
    return committed


def start_message(
    core: CoordinatorCore,
    node: int,
    plans: dict[int, p.RankPlan],
    restart: int,
    committed: tuple[int, int],
) -> p.Start:
    ranks = core._ranks_of(node)
    placement = {r: list(core.targets[r]) for r in ranks}
    peers: dict[int, p.Address] = {}
    for to in {n for t in placement.values() for n in t}:
        if (address := core.hosts.address_of(to)) is not None:
            peers[to] = address
    return p.Start(
        node=node,
        world_size=core.world_size,
        ranks=ranks,
        store=core.store,
        backend=core.cfg.backend,
        plans={r: plans[r] for r in ranks},
        inject=core.faults.specs(),
        restart_step=restart,
        committed=committed,
        max_redo=core.cfg.max_redo if core.replicas else 0,
        placement=placement,
        protects=core.protects.get(node, []),
        peers=peers,
        init=init_from(core) if restart < 0 else None,
        parity={} if core.parity is None else core.parity.holds.get(node, {}),
    )


def init_from(core: CoordinatorCore) -> p.InitFrom | None:
    """What a generation with no step of this world size starts from: tier 2's step of
    another world size, else ``--init-from``, else nothing."""
    if core.reshard is not None and core.tier2 is not None:
        step, world_size = core.reshard
        return p.InitFrom(path=core.tier2.url, step=step, world_size=world_size)
    path = core.cfg.init_from
    return None if path is None else p.InitFrom(path=path, step=core.cfg.init_step)


def initialized(core: CoordinatorCore, msg: p.Initialized) -> None:
    """Every rank loaded ``--init-from``: one event and one line, naming what it lacked."""
    core.initialized[msg.rank] = msg
    if len(core.initialized) < core.world_size:
        return
    got = list(core.initialized.values())
    missing = sorted({k for m in got for k in m.missing})
    step, seconds = got[0].step, max(m.seconds for m in got)
    init = init_from(core)
    assert init is not None
    ws = core.world_size
    if init.world_size is not None:
        core.out.log("resharded", path=init.path, step=step, world_size=ws,
                     from_world_size=init.world_size, missing=missing, seconds=seconds,
                     generation=core.generation, policy=resize.RESHARD_POLICY)  # fmt: skip
        core.out.say(
            f"resumed step {step} of world size {init.world_size} at world size {ws} "
            f"in {seconds:.2f} s: {resize.RESHARD_POLICY}"
        )
    else:
        core.out.log("initialized", path=init.path, step=step, missing=missing,
                     seconds=seconds, generation=core.generation)  # fmt: skip
        core.out.say(
            f"started from {init.path} (step {step}; the job goes on at step "
            f"{step + 1}) in {seconds:.2f} s"
        )
    if missing:
        core.out.say(f"not in {init.path}, left as built: {listed(missing)}")


def say_fallback(core: CoordinatorCore, holdings: Holdings, plan: Plan) -> None:
    """Name the ranks a restore takes from tier 2 because memory lost them."""
    gone = memory_lost(holdings, plan) if plan.step is not None and core.ever_committed else []
    if gone:
        why = "no live node holds their snapshots in memory (own node and replicas lost)"
        core.out.log("restore_fallback", step=plan.step, ranks=gone, tier=2, reason=why)
        core.out.say(f"ranks {gone} restored from tier 2 at step {plan.step}: {why}")

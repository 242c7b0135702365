"""A host lost, a failure, the stop that follows and the start after it: the coordinator
core's recovery decisions, apart from the rest (functions of a
:class:`~tierswap.control.coordinator.CoordinatorCore`, whose state they read and change;
no I/O).

A failure moves the job to RECOVERING and stops every node (``stop_nodes``), naming the
ranks whose replicas are read again; each node's ``stopped`` report is counted once it
covers what the recovery's stops asked; once every node reported and every vacancy has a
host (a parked spare, a host started again, or one that joined), the next generation
starts (``maybe_start``); with no spare left, ``--on-no-spare`` decides (``no_spare``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierswap.control import draining, generation, progress, resize
from tierswap.control import protocol as p
from tierswap.control.commands import Close, FreeSegments, JobStopped, KillHost, StartHost
from tierswap.control.states import Phase

if TYPE_CHECKING:
    from tierswap.control.coordinator import CoordinatorCore

BOOT_RETRIES = 3
"""Hosts started in place of lost ones that may exit before joining before the job stops."""


def host_lost(core: CoordinatorCore, host: int, why: str, now: float) -> None:
    """A host is gone (its connection closed or its lease expired): fence it, let its
    node be taken by a spare, and start a fresh host in its place when simulating."""
    spare = host in core.hosts.spares
    core.booting.discard(host)
    if host in core.hosts.waiting:  # a first host lost before it was ready
        core.hosts.waiting.discard(host)
        core.hosts.vacant.add(host)  # its node (host i serves node i) waits for another
        core.out.log("failure_detected", what="host", host=host, node=None, ranks=[],
                     detail=f"host {host} lost while starting: {why}",
                     generation=core.generation)  # fmt: skip
    conn, node = core.hosts.lost(host)
    core.out.add(KillHost(host))  # fencing: a host declared lost must not come back
    if host in core.hosts.pids:
        core.out.add(FreeSegments(core.hosts.pids[host], core.hosts.tags.get(host, "")))
    if conn is not None:
        core.out.add(Close(conn))
    if not core.done and core.cfg.revive and host in core.local:
        core.to_revive += 1  # once the job runs again, or at once when it waits for one
    if spare:
        core.out.log("spare_lost", host=host, reason=why)
        core.out.say(f"spare host {host} lost: {why}")
    elif node is not None:
        node_lost(core, node, host, why, now)
    else:  # a host still booting: one waited for may need starting again
        maybe_start(core, now)


def host_exited(core: CoordinatorCore, host: int, code: int, now: float) -> None:
    """A host this launcher started exited before it said hello: a first one stops
    the job (the script or its environment is broken); one started in place of a lost
    host is started again, a few times."""
    if host in core.hosts.conns:
        return  # it had joined: its connection's close says it is lost
    if host in core.hosts.waiting:
        raise JobStopped(
            f"host {host}'s agent exited with code {code} before joining the job; its "
            "output above says why"
        )
    if host not in core.booting:
        return
    core.booting.discard(host)
    core.boot_failures += 1
    if core.boot_failures > BOOT_RETRIES:
        raise JobStopped(
            f"{core.boot_failures} hosts started in place of lost ones exited before "
            f"joining, the last (host {host}) with code {code}; its output above says why"
        )
    core.out.log("host_boot_failed", host=host, code=code)
    core.to_revive += 1
    maybe_start(core, now)


def start_failed(core: CoordinatorCore, host: int, code: int, now: float) -> None:
    """A host's worker exited before it was ready, again and again: before the job
    ever ran, the script is broken and the job stops; once it has run, that host is
    lost (a spare or a host booting later takes its place, a few times)."""
    why = f"a worker of host {host} exited with code {code} before it was ready"
    if core.generation < 0:
        where = "on that host's console" if core.multihost else "above"
        hint = (
            " (a script that exits 0 before it is ready never called tierswap.launch(train))"
            if code == 0
            else ""
        )
        raise JobStopped(f"{why}; the script's output {where} says why{hint}")
    core.boot_failures += 1
    if core.boot_failures > BOOT_RETRIES:
        raise JobStopped(f"{why}, {core.boot_failures} times; its output above says why")
    host_lost(core, host, why, now)


def revive(core: CoordinatorCore, needed: int) -> None:
    """Start lost simulated hosts again, as many as ``needed`` beyond those booting."""
    for _ in range(min(needed - len(core.booting), core.to_revive)):
        core.to_revive -= 1
        host = core.hosts.new_id()
        core.booting.add(host)
        core.local.add(host)
        core.out.add(StartHost(host))


def node_lost(core: CoordinatorCore, node: int, host: int, why: str, now: float) -> None:
    for tier in core.tiers.values():
        tier.lost(node)
    phase = core.phase.state
    if phase != Phase.RUNNING:  # finishing, or a second failure while recovering
        core.out.log(
            "failure_detected",
            what="node",
            node=node,
            host=host,
            ranks=core._ranks_of(node),
            detail=f"host {host}: {why} (during {phase.value})",
            generation=core.generation,
        )
        core.out.say(f"node {node} (host {host}) lost during {phase.value}: {why}")
    if phase == Phase.FINISHING:
        core.persister.cancel()
        core.persister.ok = False  # finish with what is committed; say what is not
        core.out.say(f"finishing with the steps already committed: {core._committed_said()}")
        core.last_step = min(core.last_step, core.tiers[0].committed)
        progress.maybe_done(core)
        return
    core.hosts.vacant.add(node)
    core.stopping.discard(node)
    core.reports.forget(node)
    if core.salvage is not None:  # its parts never come: plan again with who is left
        core.persister.cancel()
        core.salvage, core.salvage_tried = None, False
    if phase == Phase.RUNNING:
        failure(core, "node", node, core._ranks_of(node), f"host {host}: {why}", now, host)
    elif phase == Phase.RECOVERING and core.resized is None:
        # lost after the stop went out (a second failure, or a dead host noticed after
        # a survivor's failed collective): its ranks may now come from replicas, which
        # are read again first (a regrow goes on from tier 2: nothing to read)
        ask_again(core, core._ranks_of(node), now)
    maybe_start(core, now)


def stop_nodes(core: CoordinatorCore, verify: list[int] | None) -> None:
    """Stop every node, which reads the replicas of ``verify`` (None: of every rank)
    again and reports what it holds; a report that does not cover what this
    recovery's stops asked is not counted (an answer to an earlier stop, crossed)."""
    core.verify = verify
    core.stopping = set(core.hosts.agents())
    core.reports.forget()
    core._broadcast(p.Stop(verify=verify))


def ask_again(core: CoordinatorCore, verify: list[int] | None, now: float) -> None:
    """Stop every node again during a recovery, with ``verify`` read too; the reports
    get the time a stop gets, and a longer wait (for a host to join) stays."""
    stop_nodes(core, p.ranks_union(core.verify, verify))
    core.deadline = max(core.deadline, now + core.cfg.startup_timeout)


def failure(
    core: CoordinatorCore,
    what: str,
    node: int | None,
    ranks: list[int],
    detail: str,
    now: float,
    host: int | None = None,
) -> None:
    if core.draining is not None:  # the job is stopping: no recovery, the stop now
        core.out.log("failure_detected", what=what, node=node, ranks=ranks, detail=detail)
        draining.end(core, f"not written: a failure came first ({what}: {detail})")
        return
    detect = core.clock.failed(core.last_step, now)
    if host is None and node is not None:
        host = core.hosts.members.get(node)
    core.out.log(
        "failure_detected",
        what=what,
        node=node,
        host=host,
        ranks=ranks,
        detail=detail,
        generation=core.generation,
        seconds=detect,
    )
    core.out.say(f"failure: {what} (node {node}, ranks {ranks}): {detail}")
    core.restarts += 1
    if core.restarts > core.cfg.max_restarts:
        raise JobStopped(
            f"{core.restarts} failures, more than --max-restarts {core.cfg.max_restarts}; "
            f"committed: {core._committed_said()}.{resume_hint(core)}"
        )
    core.phase.move(Phase.RECOVERING)
    core.persister.cancel()
    core.salvage_tried = False
    core.deadline = now + core.cfg.startup_timeout
    # a lost node's ranks may be restored from replicas: they are read again first; a
    # failed worker's rank comes back from its node's tier 0; a coordinator that took
    # over cannot tell what its predecessor lost, and has every replica read
    stop_nodes(core, ranks if what == "node" else None if what == "coordinator" else [])


def resume_hint(core: CoordinatorCore) -> str:
    """What a job started again would go on from, said after why this one stopped."""
    if core.cfg.persist is None:
        return " Without --persist, memory tiers end with the job: it starts over."
    newest = max(core.durable_steps(), default=-1 if core.reshard is None else core.reshard[0])
    if newest < 0:
        return f" {core.cfg.persist} holds no step to resume from yet: the job starts over."
    return f" Started again with --persist {core.cfg.persist}, it resumes from step {newest}."


def raised(core: CoordinatorCore, node: int | None, rank: int, step: int, error: str) -> None:
    """``rank``'s ``train(job)`` raised ``error`` in ``step``; its worker exits next, and
    that exit is the failure. A restore gives the rank back its state bit for bit, so the
    same error in the same step a second time is the script's, not the machine's: a
    restart would raise it again, up to ``--max-restarts`` times. The job stops then. Not
    for an error before the first step (-1): that says nothing of the state restored."""
    where = f"in step {step}" if step >= 0 else "before its first step"
    core.out.log("worker_raised", node=node, rank=rank, step=step, error=error)
    core.out.say(f"rank {rank}: train(job) raised {error} {where}")
    if step >= 0 and core.raised.get(rank) == (step, error):
        raise JobStopped(
            f"rank {rank}: train(job) raised {error} {where} again, with the same state "
            "(a restore gives it back bit for bit): the script's error, not a failure of "
            f"the machine (a restart would raise it again). Fix the script.{resume_hint(core)}"
        )
    core.raised[rank] = (step, error)


def stopped(core: CoordinatorCore, node: int, msg: p.Stopped, now: float) -> None:
    if node not in core.stopping or not p.covers(msg.verified, core.verify):
        return  # once per stop; one that read less answered an earlier stop
    core.stopping.discard(node)
    core.reports.stopped(node, msg.holdings, msg.peer, msg.peer_deltas)
    maybe_start(core, now)


def maybe_start(core: CoordinatorCore, now: float) -> None:
    if core.phase.state not in (Phase.STARTING, Phase.RECOVERING):
        return
    if core.expected is not None:
        return  # taking over: the hosts it had come back first (``takeover.resume`` starts)
    if core.salvage is not None:
        return  # the newest step is being written before a shrink: ``resize.salvaged`` starts
    if core.hosts.waiting or core.stopping:
        # a host for a vacancy no spare will fill boots meanwhile (seconds of imports)
        revive(core, len(core.hosts.vacant) - len(core.hosts.spares))
        return
    for node, host in core.hosts.fill_vacancies():
        core.out.log(
            "spare_assigned",
            node=node,
            host=host,
            pid=core.hosts.pids[host],
            ranks=core._ranks_of(node),
            spares_left=len(core.hosts.spares),
        )
        core.out.say(f"spare host {host} takes node {node}")
    if core.hosts.vacant:
        no_spare(core, now)
        return
    core.waiting_since = None
    generation.start(core, now)


def no_spare(core: CoordinatorCore, now: float) -> None:
    nodes = sorted(core.hosts.vacant)
    if core.cfg.on_no_spare == "fail":
        hint = (
            f" Tier 2 at {core.cfg.persist} keeps step {core.persister.committed}: run the "
            "job again with the same --persist to resume."
            if core.persister.committed >= 0
            else " Nothing was written to tier 2 (no --persist, or no step persisted yet):"
            " memory tiers end with the job. Run with --persist and --spares to survive this."
        )
        raise JobStopped(
            f"nodes {nodes} failed and no spare is left (--on-no-spare fail); "
            f"committed: {core._committed_said()}.{hint}"
        )
    revive(core, len(nodes))
    if core.cfg.on_no_spare == "shrink":
        if resize.salvage(core):
            return  # the newest step goes to tier 2 first; its commit comes back here
        if resize.shrink(core, nodes):
            core.waiting_since = None
            generation.start(core, now)
            return
    if core.waiting_since is None:
        core.waiting_since = now
        core.deadline = now + core.cfg.join_timeout
        core.out.log("waiting_for_node", nodes=nodes, timeout=core.cfg.join_timeout)
        booting = f"{len(core.booting)} host(s) started again here, or " if core.booting else ""
        core.out.say(
            f"no spare for nodes {nodes}: waiting up to {core.cfg.join_timeout:g} s "
            f"(--join-timeout) for {booting}a host to join: {core.join_hint}"
        )

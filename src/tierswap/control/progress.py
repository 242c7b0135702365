"""Training's progress and the job's end: the coordinator core's decisions about them,
apart from the rest (functions of a :class:`~tierswap.control.coordinator.CoordinatorCore`,
whose state they read and change; no I/O).

Progress and finished ranks move the last step on; faults due at a step, a transfer, a
persist or a generation fire (``inject_nodes``; ``--chaos`` strikes at random moments);
reports carry the loss; once every rank has finished,
the last step's commit and durable write end the job (``finished``, ``maybe_done``); a
deadline missed says what the job was waiting for (``waiting_for``); training that keeps
waiting for tier 1 is told why (:class:`Tier1Lag`).
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from typing import TYPE_CHECKING

from tierswap.control import protocol as p
from tierswap.control.commands import (
    End,
    FreezeHost,
    JobStopped,
    KillHost,
    KillProcess,
    ShowProgress,
)
from tierswap.control.states import Phase
from tierswap.faults import Injection

if TYPE_CHECKING:
    from tierswap.control.coordinator import CoordinatorCore


LAG_STEPS = 10
"""Steps whose waits for tier 1 are weighed together (:class:`Tier1Lag`)."""
LAG_SHARE = 0.05
"""The share of a step spent waiting for tier 1 that is said, where most steps wait that
long: more than a failure's redone step costs a job that fails less than every 20 steps."""
LAG_MIN_S = 0.005
"""Waits for tier 1 shorter than this are not said, whatever their share of a step: a few
milliseconds are the commit's own round trip (an agent's hold to the coordinator and its
commit back), which neither CPUs nor bandwidth shorten; only steps of toy size see them
as a share worth saying."""


class Tier1Lag:
    """Whether training keeps waiting for tier 1: rank 0's wait for it in each step (as its
    node's agent reports them with ``progress``) against that step's time (between two
    reports' arrivals; a skipped snapshot makes one share span two steps), over the last
    :data:`LAG_STEPS` steps. Said once when most of them (their lower median) waited
    :data:`LAG_SHARE` of a step or more, and again only after that fell below half. A
    median: a single long wait (the first replica of a generation, which makes its peer's
    slots) is no lasting lack of CPU or bandwidth. Each generation starts a new window;
    a warning already given stands across it until the waits fall."""

    def __init__(self) -> None:
        self._seen: deque[tuple[float, float]] = deque(maxlen=LAG_STEPS + 1)
        self._generation = -1
        self.behind = False

    def add(self, generation: int, at: float, gate: float) -> float | None:
        """Rank 0's step, its report arrived at ``at``, with its wait ``gate``: the share of
        a step most of the last steps waited, when that is newly too much, else None."""
        if generation != self._generation:
            self._generation = generation
            self._seen.clear()
        self._seen.append((at, gate))
        if len(self._seen) <= LAG_STEPS:
            return None
        pairs = itertools.pairwise(self._seen)
        shares = [g / (t - t0) if t > t0 and g >= LAG_MIN_S else 0.0 for (t0, _), (t, g) in pairs]
        share = statistics.median_low(shares)  # most steps waited at least that long
        if self.behind:
            self.behind = share >= LAG_SHARE / 2
            return None
        self.behind = share >= LAG_SHARE
        return share if self.behind else None


def progress(core: CoordinatorCore, msg: p.Progress, now: float, at: float) -> None:
    """A node's newest step (``now``: the time of the event; ``at``: when the message
    arrived, which the coordinator's queue does not delay)."""
    inject_nodes(core, core.faults.at_step(msg.step), now)
    core.last_step = max(core.last_step, msg.step)
    if msg.gate is not None:
        share = core.tier1_lag.add(core.generation, at, msg.gate)
        if share is not None:
            cfg = core.cfg
            redo, cpus = cfg.max_redo, cfg.agent_cpus
            core.out.log("tier1_behind", step=msg.step, share=round(share, 3), steps=LAG_STEPS)
            if core.multihost:  # each host pins by its own line's lists
                more = "more CPUs on each host (its --agent-cpus)"
            elif cpus:
                more = f"more CPUs (--agent-cpus, now {cpus})"
            else:
                more = "CPUs of their own (--agent-cpus)"
            # trailing further needs a slot more in each ring, or steps are skipped instead
            trail = (f"--max-redo {redo + 1} --slots {cfg.tier0_slots + 1} --peer-slots "
                     f"{cfg.peer_slots + 1}")  # fmt: skip
            core.out.say(
                f"tier 1 is behind: most of the last {LAG_STEPS} steps waited for it "
                f"{share:.0%} of a step or more (--max-redo {redo}: a step's replicas must be "
                f"in before the optimizer step {redo} step(s) later). The network or the "
                f"agents' CPUs cannot carry this state every step: give the agents {more}, "
                f"or let tier 1 trail further ({trail}: "
                f"a node failure then redoes up to {redo + 1} steps, and each ring holds a "
                "snapshot more)"
            )
    if msg.stall is not None:
        core.out.add(
            ShowProgress(
                msg.step,
                core.last_loss,
                msg.stall,
                core._committed(),
                core.total,
                core.persister.trailing(core.tiers[0].committed),
            )
        )


def chaos(core: CoordinatorCore, seconds: float, now: float) -> None:
    """``--chaos``: strike, at about ``rate`` a minute, while training goes on (the last
    strike was found and its recovery ended with a step, and a step was done since): a
    random node of this machine, or one worker. (Until 12-06 a strike needed only a step
    reported since the last one, which a dying generation's last report could be: the
    next strike then hit a generation before its first step, both nodes of a 2-node job
    were lost within one recovery, and it went back to tier 2.)"""
    c = core.chaos
    if c is None or core.phase != Phase.RUNNING or core.last_step <= core.chaos_step:
        return
    found = core.clock.fault_time is None or core.generation != core.chaos_generation
    if not found or core.clock.record is not None:
        return  # the last strike not found yet, or its recovery not over
    if c.count is not None and core.chaos_kills >= c.count:
        return
    if core.chaos_rng.random() >= min(1.0, c.rate / 60.0 * seconds):
        return
    local = {n: h for n, h in core.hosts.members.items() if h in core.local}
    workers = {
        r: pid for r, pid in core.clock.pids.items() if r // core.cfg.nproc_per_node in local
    }
    if not local:
        return
    core.chaos_kills += 1
    core.chaos_step, core.chaos_generation = core.last_step, core.generation
    core.clock.fault(now)
    if core.chaos_rng.random() < 0.5 or not workers:
        node = core.chaos_rng.choice(sorted(local))
        spec = f"chaos:kill:node={node}"
        core.out.log("fault_injected", spec=spec, host=local[node], step=core.last_step)
        core.out.add(KillHost(local[node]))
    else:
        rank = core.chaos_rng.choice(sorted(workers))
        spec = f"chaos:kill:rank={rank}"
        core.out.log("fault_injected", spec=spec, pid=workers[rank], step=core.last_step)
        core.out.add(KillProcess(workers[rank]))


def inject_nodes(core: CoordinatorCore, due: list[Injection], now: float) -> None:
    """Fault injection: kill (or freeze) the hosts serving these nodes, at once."""
    for fault in due:
        host = core.hosts.members.get(fault.index)
        if host is None:  # a node the job does not have now (it shrank)
            core.out.log("fault_skipped", spec=str(fault), reason=f"no node {fault.index}")
            continue
        core.out.log("fault_injected", spec=str(fault), host=host)
        core.clock.fault(now)
        core.out.add(KillHost(host) if fault.action == "kill" else FreezeHost(host))


def report(core: CoordinatorCore, msg: p.Report) -> None:
    if msg.total is not None:
        same_total(core, msg.rank, msg.step, msg.total)
        core.total = msg.total
    if msg.rank == 0 and msg.metrics:
        core.last_loss = msg.metrics.get("loss", core.last_loss)
        core.out.log("report", step=msg.step, **msg.metrics)


def same_total(core: CoordinatorCore, rank: int, start: int, total: int) -> None:
    """Every rank's ``job.steps`` from the same step must run to the same ``total``: a
    rank that stops short leaves the others in their next collective, a failure that a
    restart brings back each time (``start`` is the step before its first)."""
    key = (core.generation, start)
    totals = core.totals.setdefault(key, {})
    totals[rank] = total
    for old in [k for k in core.totals if k[0] < core.generation]:
        del core.totals[old]
    if len(set(totals.values())) > 1:
        said = ", ".join(f"rank {r}: {t}" for r, t in sorted(totals.items()))
        raise JobStopped(
            f"the ranks call job.steps(total=...) with different totals ({said}): every "
            "rank must run the same steps, or those that stop first leave the others "
            "waiting in their next collective. Give every rank the same total (the same "
            "arguments and environment on every host)"
        )


def finished(core: CoordinatorCore, rank: int, step: int, now: float) -> None:
    if core.phase != Phase.RUNNING:  # a generation being torn down: the next reruns it
        return
    if core.total is not None and 0 <= step < core.total - 1:  # (-1: restored at its end)
        core.out.say(f"rank {rank} returned from train(job) after step {step} of {core.total}")
    core.finished.add(rank)
    core.last_step = max(core.last_step, step)
    if len(core.finished) == core.world_size:
        core.phase.move(Phase.FINISHING)
        # the last step's checksums, commit and durable write: a slow disk is no failure
        core.deadline = now + max(core.cfg.startup_timeout, 600.0)
        maybe_done(core)


def maybe_done(core: CoordinatorCore) -> None:
    memory = max(
        core.tiers[0].committed, -1 if core.resharded_from is None else core.resharded_from
    )
    if core.phase != Phase.FINISHING or memory < core.last_step or core.drained:
        return
    if core.persister.inflight is not None:
        return
    if core.persister.ok and core.persister.committed < memory:
        core.persister.maybe_persist(memory, final=True)
        if core.persister.inflight is not None:
            return
    core.phase.move(Phase.DONE)
    if core.traffic.full:
        core.out.log("replica_traffic", **core.traffic.summary())
    core.out.log(
        "job_finished",
        step=core.last_step,
        generation=core.generation,
        restarts=core.restarts,
        stale_dropped=core.door.take_counts(),
    )
    core.out.say(
        f"finished step {core.last_step + 1} "
        f"after {core.restarts} recoveries; newest step committed: {core._committed_said()}"
    )
    if unfired := core.faults.unfired():  # (a step past the job's end, a node it never had)
        core.out.log("faults_unfired", specs=unfired)
        core.out.say(f"--inject that never fired before the job ended: {', '.join(unfired)}")
    core.out.add(End(0))


def waiting_for(core: CoordinatorCore) -> str:
    if core.hosts.waiting:
        return f"waiting for nodes {sorted(core.hosts.waiting)} to join"
    if core.hosts.vacant:
        vacant = sorted(core.hosts.vacant)
        return f"waiting for a node to join to take the place of nodes {vacant} (no spare left)"
    if core.stopping:
        return f"waiting for nodes {sorted(core.stopping)} to stop their workers"
    if core.salvage is not None:
        return (
            f"waiting for step {core.salvage} to be written to {core.cfg.persist} before "
            "the job shrinks"
        )
    if core.persister.inflight is not None:
        step = core.persister.inflight.step
        return f"waiting for step {step} to be written to {core.cfg.persist}"
    return (
        f"in phase {core.phase.state.value!r} waiting for step {core.last_step} to be "
        f"committed in memory (committed: {core._committed_said()})"
    )

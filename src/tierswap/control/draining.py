"""A job stopped from outside: its newest step in memory written to tier 2 before it ends
(functions of a :class:`~tierswap.control.coordinator.CoordinatorCore`; no I/O).

A signal to the coordinator's launcher (Ctrl-C at its terminal, ``kill`` of its pid, a
container runtime's SIGTERM to its main process, SIGKILL following a grace period later)
stops the job. Tier 2 holds the step of the last ``--persist-every``, while tier 0 holds
one of the last second: written first, it is what a job started again resumes from, and
the steps since the last durable one are not lost. The workers train on meanwhile (their
steps after it are lost either way). ``--stop-grace`` bounds the wait; a failure
meanwhile, a write that fails, or a second signal (the shell's) ends the job at once,
with the durable steps it has. (A scheduler that signals every process of the job, as
Slurm does, stops the agents too: their loss ends the wait.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierswap.control.commands import Drain, End
from tierswap.control.states import Phase

if TYPE_CHECKING:
    from tierswap.control.coordinator import CoordinatorCore


def drain(core: CoordinatorCore, event: Drain, now: float) -> None:
    """Write tier 0's newest step to tier 2 where tier 2 lacks it, then end with the
    signal's code; end at once where there is nothing to write or nowhere to."""
    if core.draining is not None:
        return
    if core.phase.state == Phase.FINISHING:  # its last step is being written: it ends so
        core.out.say(
            f"{event.signal}: the job is finishing, once its last step is written (a second "
            "signal stops it at once)"
        )
        return
    core.draining = event
    step, p = core.tiers[0].committed, core.persister
    if (
        core.cfg.stop_grace <= 0
        or p.tier2 is None
        or p.gone is not None
        or core.expected is not None  # taking the job over: no parts are taken meanwhile
        or core.phase.state != Phase.RUNNING
        or step <= max(p.committed, p.newest)
    ):
        end(core, None)
        return
    core.drain_step, core.drain_deadline = step, now + core.cfg.stop_grace
    core.out.log("draining", signal=event.signal, step=step, grace=core.cfg.stop_grace)
    core.out.say(
        f"{event.signal}: writing step {step} to {core.cfg.persist} before the job stops "
        f"(up to --stop-grace {core.cfg.stop_grace:g} s; a second signal stops it at once)"
    )
    if p.inflight is None or p.inflight.step != step:  # (one of that step: waited for)
        p.salvage(step, {})  # now, whatever else is due or being written


def written(core: CoordinatorCore, step: int | None) -> None:
    """Tier 2's write in flight ended (``step``: committed, None: it failed)."""
    if core.draining is None or core.drain_step < 0 or core.persister.inflight is not None:
        return
    end(core, None if step is not None and step >= core.drain_step else "its write failed")


def overdue(core: CoordinatorCore, now: float) -> None:
    """Past ``--stop-grace``: the job ends with the durable steps it has."""
    if core.draining is not None and core.drain_step >= 0 and now > core.drain_deadline:
        end(core, f"not written within --stop-grace {core.cfg.stop_grace:g} s")


def end(core: CoordinatorCore, failed: str | None) -> None:
    """The drained job's end, once: its signal's exit code."""
    assert core.draining is not None
    if core.drained or core.phase.state in (Phase.DONE, Phase.FAILED):
        return
    core.drained = True
    if failed is not None:
        core.out.log("drain_failed", step=core.drain_step, why=failed)
        core.out.say(f"step {core.drain_step} {failed}: stopping with tier 2 as it is")
    core.out.add(End(core.draining.code, f"stopped by {core.draining.signal}"))

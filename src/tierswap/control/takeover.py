"""A coordinator taking over from one whose host died: the coordinator core's side of it,
apart from the rest of its decisions (functions of a
:class:`~tierswap.control.coordinator.CoordinatorCore`, whose state they read and change;
no I/O). Its shell writes :func:`record` to etcd before it carries out each event's
commands; the candidate that wins the election next adopts the newest one.

The new leader waits for the hosts the old one had to reconnect (:func:`rejoin`), each
with the id, pid and tag it had; a host that was fenced, or another process under an old
id, is refused. Once all are back, or the wait is over, the missing ones are lost and the
old leader's generation ends as a failure would end it (:func:`resume`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tierswap.control import failures, membership, resize
from tierswap.control import protocol as p
from tierswap.control.states import Phase

if TYPE_CHECKING:
    from tierswap.control.coordinator import CoordinatorCore

OLD_HOST_GRACE_S = 0.5
"""How long the old leader's own host is waited for once every other host is back."""


def record(core: CoordinatorCore) -> dict[str, Any]:
    """What a coordinator that takes this one's place needs (JSON-able): membership,
    generation, each tier's commit, the settled step, spares, the hosts fenced, and the
    options the job runs with (``candidate.job_config``)."""
    return {
        "job_id": core.job_id,
        "config": core.cfg.to_env(),
        "generation": core.generation,
        **core.hosts.record(),
        "committed": {str(t): c.committed for t, c in core.tiers.items()},
        "settled": core.settled,
        "durable": core.persister.committed,
        "restarts": core.restarts,
        "total": core.total,
        "ever_committed": core.ever_committed,
        "ever_protected": core.ever_protected,
        "nodes": core.nodes,
        "reshard": None if core.reshard is None else list(core.reshard),
    }


def adopt(
    core: CoordinatorCore,
    rec: Mapping[str, Any],
    old_host: int | None,
    now: float,
    ignored: tuple[str, ...] = (),
) -> None:
    """Lead the job another coordinator led: its hosts, as it last recorded them,
    reconnect (:func:`rejoin`); then the generation it ran is stopped and a new one
    started from what the hosts hold, as after any failure. ``ignored``: options of this
    leader's own launch that differ from the job's (it runs with the job's)."""
    core.hosts.adopt(rec)
    core.generation = int(rec["generation"])
    core.door.generation = core.generation
    for tier, step in rec["committed"].items():
        core.tiers[int(tier)].committed = step
    core.settled = rec["settled"]
    core.persister.committed = core.persister.newest = rec["durable"]
    core.persister.last_request = rec["durable"]
    core.restarts = rec["restarts"]
    core.total = rec["total"]
    core.ever_committed = rec["ever_committed"]
    core.ever_protected = rec.get("ever_protected", rec["ever_committed"])
    if rec.get("reshard") is not None:
        core.reshard = (int(rec["reshard"][0]), int(rec["reshard"][1]))
    if rec.get("nodes", core.nodes) != core.nodes:  # it led the job shrunk
        resize.set_size(core, int(rec["nodes"]))
    # every host it had that was not fenced: members, spares, and hosts still starting
    h = core.hosts
    core.expected = {host for host in h.pids if host not in h.fenced}
    core.old_host = old_host
    core.takeover_deadline = now + max(2.0, 2 * core.cfg.heartbeat)
    if core.generation >= 0:
        core.phase.move(Phase.RUNNING)
    core.out.log(
        "coordinator_took_over",
        job_id=core.job_id,
        generation=core.generation,
        expected=sorted(core.expected),
        old_host=old_host,
        ignored=list(ignored),
    )
    core.out.say(
        f"this host's coordinator took the job over (generation {core.generation}); "
        f"waiting for hosts {sorted(core.expected)} to reconnect"
    )
    if ignored:
        flags = ", ".join("--" + name.replace("_", "-") for name in ignored)
        core.out.say(
            f"it runs the job with the options the job was started with: this host's "
            f"launch gave {flags} otherwise, and those are not used"
        )


def rejoin(core: CoordinatorCore, conn: int, msg: p.Hello, now: float) -> None:
    """A host of the old coordinator reconnects, with the id and pid it had."""
    h = core.hosts
    if core.expected is None or msg.host not in core.expected:
        why = (
            f"host {msg.host} was declared lost and fenced"
            if msg.host in h.fenced
            else f"host {msg.host} is not one this coordinator took over"
        )
        membership.refuse(core, conn, msg.pid, f"{why}; start it again to join as a spare")
        return
    if (h.pids.get(msg.host), h.tags.get(msg.host, "")) != (msg.pid, msg.tag):
        membership.refuse(core, conn, msg.pid, f"host {msg.host} was another process")
        return
    core.expected.discard(msg.host)
    h.conns[msg.host] = conn
    h.by_conn[conn] = msg.host
    h.heard[msg.host] = now
    membership.welcome(core, conn, msg.host)
    core.out.log("host_rejoined", host=msg.host, pid=msg.pid)
    if not core.expected - {core.old_host}:
        # everyone but the old leader's own host is back: it gets a moment more (alive,
        # its coordinator paused, say), not the whole wait (its machine may be gone)
        core.takeover_deadline = min(core.takeover_deadline, now + OLD_HOST_GRACE_S)
    if not core.expected:
        resume(core, now)


def resume(core: CoordinatorCore, now: float) -> None:
    """Every host that will reconnect has (or the wait is over): the others are lost,
    and the old leader's generation ends like one a failure ended."""
    assert core.expected is not None
    missing, core.expected = sorted(core.expected), None
    core.out.log("takeover_complete", missing=missing)
    for host in missing:
        failures.host_lost(core, host, "did not reconnect to the coordinator that took over", now)
    # what its predecessor lost cannot be told (a node it recorded vacant, its stop never
    # sent): every replica is read again before the nodes report
    if core.phase == Phase.RUNNING:  # nothing failed meanwhile: the generation ends
        failures.failure(core, "coordinator", None, [], "the coordinator that led it is gone", now)
    elif core.phase == Phase.RECOVERING:
        # a host lost: those that rejoined after its stop went out never had it, and the
        # reports of those that had were not taken while the hosts were awaited
        failures.ask_again(core, None, now)
    elif core.phase == Phase.STARTING:
        failures.maybe_start(core, now)

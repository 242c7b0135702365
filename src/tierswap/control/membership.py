"""Who is in the job: the coordinator core's membership decisions, apart from the rest
(functions of a :class:`~tierswap.control.coordinator.CoordinatorCore`, whose state they
read and change; no I/O).

The job begins (``begin``: the placement announced, simulated hosts started, or hosts
awaited); a host says hello and is welcomed with its id, the job's config and script, or
refused saying why (``hello``, ``welcome``, ``refuse``); once its workers are parked it is
``ready``: a member of the first generation or a spare, and spares are told what memory
to make ahead (``warm_spares``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tierswap.control import failures, resize, takeover
from tierswap.control import protocol as p
from tierswap.control.commands import Begin, Close, Send, StartHost
from tierswap.control.hosts import refusal
from tierswap.tiers import parity, peer

if TYPE_CHECKING:
    from tierswap.control.coordinator import CoordinatorCore


def begin(core: CoordinatorCore, event: Begin, now: float) -> None:
    core.out.log(
        "job_started",
        world_size=core.cfg.world_size,
        nodes=core.cfg.nodes,
        persist=core.cfg.persist,
        job_id=core.job_id,
    )
    if event.durable_warning:
        core.persister.failing(f"cannot write {core.cfg.persist}: {event.durable_warning}")
    elif core.cfg.persist is not None and core.reshard is None and not core.durable_steps():
        # (a typo in a root's name trains from step 0 too: said, not silent)
        fresh = "from --init-from" if core.cfg.init_from else "from step 0"
        core.out.say(f"{core.cfg.persist} holds no step of this job: it starts {fresh}")
    if (advice := core.cfg.slot_advice()) is not None:
        core.out.log("slots_short", slots=core.cfg.tier0_slots, max_redo=core.cfg.max_redo)
        core.out.say(advice)
    announce_placement(core)
    if core.multihost:
        core.out.say(
            f"waiting for {core.cfg.nodes} hosts at {core.address[0]}:{core.address[1]} "
            f"(--nnodes {core.cfg.nodes} --nproc-per-node {core.cfg.nproc_per_node})"
        )
        return
    for host in range(core.cfg.nodes + core.cfg.spares):
        core.local.add(host)
        core.out.add(StartHost(host))


def announce_placement(core: CoordinatorCore) -> None:
    if not core.replicas:
        why = "--replicas 0" if core.cfg.replicas == 0 else "replicas need at least 2 nodes"
        core.out.say(f"tier 1 off: {why}")
        return
    core.out.log(
        "placement",
        replicas=core.replicas,
        targets={str(r): list(t) for r, t in core.targets.items()},
        parity=core.cfg.parity_group if core.parity is not None else 0,
    )
    if core.parity is not None:
        text = parity.describe(core.parity, core.cfg.nproc_per_node)
        groups = parity.groups(core.nodes, core.cfg.parity_group)
        sizes = ", ".join(str(len(g)) for g in groups)
        core.out.say(f"tier-1 placement, parity over groups of {sizes} nodes:\n{text}")
        return
    text = peer.describe(core.targets, core.cfg.nproc_per_node)
    core.out.say(f"tier-1 placement, {core.replicas} replica(s):\n{text}")


def hello(core: CoordinatorCore, conn: int, msg: p.Hello, now: float) -> None:
    """A host connected: give it its id, the job's config and script (or say why
    it is not taken)."""
    if msg.rejoin:
        takeover.rejoin(core, conn, msg, now)
        return
    why = refusal(msg, core.cfg.nodes, core.cfg.nproc_per_node, core.rdzv_id)
    if why is not None:
        refuse(core, conn, msg.pid, why)
        return
    host = core.hosts.connected(msg.host, msg.pid, conn, now, spare=msg.spare)
    core.hosts.tags[host] = msg.tag
    if core.multihost and 0 <= msg.host != host:
        # a first-generation host's id is its node: host msg.host claimed that node
        role = f"serves node {host}" if host < core.cfg.nodes else "parks as a spare"
        core.out.log("node_rank_taken", asked=msg.host, host=host, pid=msg.pid)
        core.out.say(
            f"a host (pid {msg.pid}) asked for node {msg.host} (--node-rank), which "
            f"host {msg.host} has claimed already: it {role}"
        )
    welcome(core, conn, host)


def welcome(core: CoordinatorCore, conn: int, host: int) -> None:
    script = [str(Path(core.script[0]).resolve()), *core.script[1:]]
    msg = p.Welcome(host=host, config=core.cfg.to_env(), job_id=core.job_id, script=script)
    core.out.add(Send(conn, msg, core.generation))


def refuse(core: CoordinatorCore, conn: int, pid: int, why: str) -> None:
    core.out.log("host_refused", pid=pid, why=why)
    core.out.say(f"a host (pid {pid}) was refused: {why}")
    core.out.add(Send(conn, p.Refused(why=why), core.generation))
    core.out.add(Close(conn))


def ready(core: CoordinatorCore, host: int, msg: p.Ready, now: float) -> None:
    """Its agent runs and its workers are parked: a member of the first generation,
    or a spare."""
    core.booting.discard(host)
    pid = core.hosts.pids[host]
    seen = {"host": host, "pid": pid, "address": msg.replica[0], "workers": msg.workers}
    role = core.hosts.ready(host, msg.replica)
    if role is None:
        return
    if role:
        core.out.log("node_joined", node=host, role="member", **seen)
        if core.multihost:
            core.out.say(f"host {host} at {msg.replica[0]} (pid {pid}) serves node {host}")
    else:
        core.out.log("node_joined", node=None, role="spare", **seen)
        core.out.say(f"spare host {host} (pid {pid}) parked")
        warm_spares(core)
        resize.maybe_grow(core, now)
    failures.maybe_start(core, now)


def warm_spares(core: CoordinatorCore) -> None:
    """Tell each parked spare the segments a node holds, to make them ahead."""
    if not core.cfg.warm_spares:
        return
    for host in [h for h in core.spare_memory.sent if h not in core.hosts.spares]:
        core.spare_memory.forget(host)
    for host in core.hosts.spares:
        conn = core.hosts.conns.get(host)
        sizes = core.spare_memory.to_send(host) if conn is not None else None
        if conn is not None and sizes is not None:
            core.out.add(Send(conn, p.Warm(segments=sizes), core.generation))
            core.out.log("spare_warm", host=host, segments=len(sizes), bytes=sum(sizes))

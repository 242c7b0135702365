"""What an agent does with a snapshot once a worker wrote it into tier 0: the work its
shell runs off the loop for the tiers, and the results that come back (functions of a
:class:`~tierswap.control.agent.AgentCore`, whose state they read and change; no I/O).

A snapshot's checksum coming back keeps it in tier 0 and offers it for replication
(``checked``); a replica sent frees its tier-0 lease and lets the next one go
(``replicated``); the replica server's threads ask for tier-1 slots and leases, run here
where the replica store lives (``ask``); the coordinator's ``Persist`` has this node's
parts of a step written to tier 2, each reported back as written or failed, and all of
them together once every one is (``persist``, ``part_written``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from tierswap.control import protocol as p
from tierswap.control.agent_events import (
    AnswerAsk,
    Ask,
    Checked,
    PartWritten,
    Replicated,
    WritePart,
)
from tierswap.tiers.durable_deltas import Part
from tierswap.tiers.memory import Slot

if TYPE_CHECKING:
    from tierswap.control.agent import AgentCore


@dataclass(slots=True)
class PendingParts:
    """This node's parts of one tier-2 step, as they are written."""

    step: int
    ranks: set[int]
    parts: dict[int, Any] = field(default_factory=dict)
    """rank -> its PartInfo, once written."""
    errors: dict[int, str] = field(default_factory=dict)


def checked(core: AgentCore, event: Checked) -> None:
    """A tier-0 snapshot's checksum: kept and offered for replication, or, where it could
    not be computed, its slot freed and the loss reported."""
    core.checks -= 1
    ring = core.rings[event.rank]
    if event.error is not None:  # the snapshot is not kept: its slot is free again
        ring.abandon(event.slot)
        why = f"checksum of step {event.step}: {event.error}"
        core._tell(p.AgentError(rank=event.rank, request="written", error=why))
        core._maybe_stopped()
        return
    ring.checked(event.slot, event.checksum)
    core._add(core.queue.offer(event.rank, ring))
    core.holds.maybe(0)
    if core.peers.parity:  # a parity complete before its step was in tier 0 here
        core.holds.maybe(1)
    core._maybe_stopped()


def replicated(core: AgentCore, event: Replicated) -> None:
    """A rank's replica went to its peers (or was given up): its tier-0 slot is let go,
    what was sent is reported, and the rank's next snapshot is replicated if one waits."""
    core.rings.unlease(event.slot)
    sent = event.sent
    if sent is not None:
        stats = p.ReplicaSent(
            rank=event.rank, step=event.step, kind=sent.kind, nbytes=sent.nbytes,
            full=sent.full, encode_s=sent.encode_s,
        )  # fmt: skip
        core._tell(stats)
    core._add(core.queue.done(event.rank, event.step, event.generation, core.rings[event.rank]))


def persist(core: AgentCore, msg: p.Persist) -> None:
    """Write this node's parts of a step to tier 2: its own ranks' from tier 0, and a lost
    node's it holds full replicas of from tier 1; a part it cannot write is an error."""
    if msg.token in core.persisting:
        return  # the same request again: its parts are being written
    lost = sorted(r for r, node in msg.replicas.items() if node == core.node)
    pending = PendingParts(msg.step, {*core.ranks, *lost})
    core.persisting[msg.token] = pending
    if core.faults.fails_persist(msg.step):
        pending.errors = {r: "tier-2 write refused (injected)" for r in pending.ranks}
    for rank in [] if pending.errors else sorted(pending.ranks):
        # a lost node's rank is written from the replica this node holds (full only)
        ring = core.peers.rings.get(rank) if rank in lost else core.rings.by_rank.get(rank)
        slot = None if ring is None else ring.lease(msg.step)
        if slot is None or ring is None:
            where = "tier 1 (full replicas)" if rank in lost else "tier 0"
            pending.errors[rank] = f"{where} no longer holds it"
            continue
        part = Part(msg.root, msg.step, rank, msg.world_size, ring.layout(), slot, msg.token)
        core.out.append(WritePart(part, msg.bases, core.faults.persist_delay()))
    _maybe_parts(core, msg.token)


def part_written(core: AgentCore, event: PartWritten) -> None:
    """One tier-2 part written (or failed): its slot is let go and the part counted."""
    if not core.rings.unlease(event.slot):  # a lost rank's part, from a replica
        core.peers.unlease(event.rank, event.slot)
    pending = core.persisting.get(event.token)
    if pending is None:
        return  # asked before a restart: not wanted any more
    if event.part is not None:
        pending.parts[event.rank] = event.part
    else:
        pending.errors[event.rank] = event.error or "not written"
    _maybe_parts(core, event.token)


def _maybe_parts(core: AgentCore, token: int) -> None:
    """Report a persist request's parts once every one of them is written or failed."""
    pending = core.persisting[token]
    if len(pending.parts) + len(pending.errors) < len(pending.ranks):
        return
    del core.persisting[token]
    parts = [pending.parts[r] for r in sorted(pending.parts)]
    msg = p.Parts(token=token, step=pending.step, parts=parts, errors=pending.errors)
    core._tell(msg)


def ask(core: AgentCore, event: Ask) -> None:
    """A replica-server thread's request, run here where the replica store lives."""
    handlers: dict[str, Any] = {
        "replica_slot": core.peers.slot,
        "replica_received": core.peers.received,
        "replica_written": core.peers.written,
        "replica_lease": core.peers.lease,
        "replica_unlease": core.peers.unlease,
        "replica_base": core.peers.base,
        "replica_delta_written": core.peers.delta_written,
        "parity_slot": core.peers.parity_slot,
        "parity_added": core.peers.parity_added,
        "parity_checked": core.peers.parity_checked,
        "tier0_lease": partial(_tier0_lease, core),
        "tier0_unlease": core.rings.unlease,
    }
    if event.op == "replica_served":
        core._tell(p.ReplicaServed(**event.fields))
        core.out.append(AnswerAsk(event.answer, None))
        return
    try:
        value = handlers[event.op](**event.fields)
    except Exception as e:  # handed to the asking thread, which fails its transfer
        core.out.append(AnswerAsk(event.answer, None, e))
        return
    core.out.append(AnswerAsk(event.answer, value))
    core.holds.lost()
    core.holds.maybe(1)


def _tier0_lease(core: AgentCore, rank: int, step: int) -> Slot | None:
    """A tier-0 snapshot read by a peer's worker rebuilding a rank of its parity set;
    given back with ``tier0_unlease``."""
    ring = core.rings.by_rank.get(rank)
    return None if ring is None else ring.lease(step)

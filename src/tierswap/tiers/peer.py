"""Tier 1: replicas of every rank's snapshots in other nodes' memory.

Placement is a pure function of the job's shape. Every agent runs a :class:`ReplicaServer`
that accepts only peers of its own job (HMAC handshake with the job's secret), receives
replicas into rings of shared memory, checks the checksum of each one, and serves them
back to a restoring worker. The ring bookkeeping stays on the agent's event loop: the
server's connection threads ask it through ``ask``; the bytes move outside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierswap import delta
from tierswap.checksum import checksum_chunks
from tierswap.control import protocol as p
from tierswap.errors import CorruptPartError
from tierswap.layout import Layout
from tierswap.serving import Server
from tierswap.shm import populated
from tierswap.tiers import parity
from tierswap.tiers.memory import FILL_LIMIT_S, FILL_POLL_S, FILLING
from tierswap.wire import BULK_IDLE_S, Address, Channel

if TYPE_CHECKING:
    from tierswap.tiers.deltas import Base

Ask = Callable[..., Any]
"""``ask(op, **fields)``: run ``op`` on the agent's event loop and return its result."""


def placement(nodes: int, nproc_per_node: int, replicas: int) -> dict[int, tuple[int, ...]]:
    """rank -> the peer nodes that hold its replicas.

    Node n's local rank i goes to nodes ``n + 1 + (i + j) mod (nodes - 1)`` for
    j < replicas: never its own node, R distinct peers (so any R node failures leave one
    copy), and the ranks of one node spread over distinct peers, which restores them in
    parallel.
    """
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    if replicas > nodes - 1:
        raise ValueError(
            f"--replicas {replicas} needs at least {replicas + 1} nodes (a replica never "
            f"lands on the node it protects); this job has {nodes}"
        )
    out: dict[int, tuple[int, ...]] = {}
    for node in range(nodes):
        for i in range(nproc_per_node):
            peers = ((node + 1 + (i + j) % (nodes - 1)) % nodes for j in range(replicas))
            out[node * nproc_per_node + i] = tuple(peers)
    return out


def describe(pl: dict[int, tuple[int, ...]], nproc_per_node: int) -> str:
    """One line per node: where its ranks' replicas go."""
    lines = []
    for node in range(len(pl) // max(nproc_per_node, 1)):
        ranks = range(node * nproc_per_node, (node + 1) * nproc_per_node)
        parts = ", ".join(f"rank {r} -> node {'/'.join(map(str, pl[r]))}" for r in ranks)
        lines.append(f"node {node}: {parts}")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Lease:
    """A held replica, leased to be served: ``read()`` gives its full snapshot (a slot's
    bytes, or base + delta rebuilt; CorruptPartError if that fails)."""

    layout: Layout
    tree: dict[str, Any]
    checksum: str
    read: Callable[[], memoryview]
    token: Any = None
    """Handed back to ``replica_unlease``."""
    kind: str = "full"
    """"full" (a whole snapshot), "base" (the base itself) or "delta" (base + delta)."""
    base_step: int = -1


class ReplicaServer(Server):
    """Receives replicas from peers and serves them to restoring workers."""

    incoming = p.AgentToAgent
    name = "tierswap-replica"

    def __init__(self, bind: str, secret: bytes, ask: Ask, tls: str = "off") -> None:
        self.ask = ask
        super().__init__(bind, secret, tls)

    def handle(self, chan: Channel) -> None:
        while (env := chan.recv()) is not None:
            match env.msg:
                case p.Replica():
                    self._receive(chan, env.msg, env.gen)
                case p.ReplicaDelta():
                    self._receive_delta(chan, env.msg, env.gen)
                case p.Fetch():
                    self._send(chan, env.msg)
                case p.ParityPart():
                    parity.receive(self.ask, chan, env.msg, env.gen, lambda: self.closed)
                case p.FetchParity():
                    parity.serve(self.ask, chan, env.msg)
                case p.FetchRange():
                    parity.serve_range(self.ask, chan, env.msg)
                case _:
                    chan.send(p.Error(message=f"unexpected {p.tag_of(env.msg)!r}"))

    def _receive(self, chan: Channel, msg: p.Replica, generation: int) -> None:
        rank, step, layout = msg.rank, msg.step, msg.layout
        layout.check()
        fields = {"rank": rank, "step": step, "layout": layout, "generation": generation}
        deadline = time.monotonic() + FILL_LIMIT_S
        while (got := self.ask("replica_slot", **fields, wait=True)) == FILLING:
            if time.monotonic() >= deadline or self.closed:  # (the last ask refuses)
                got = self.ask("replica_slot", **fields)
                break
            time.sleep(FILL_POLL_S)
        if got is None:
            chan.send(p.Room(ok=False))
            return
        token, room = got
        buf = room[: layout.nbytes]
        try:  # from here on the slot is the transfer's: freed if anything goes wrong
            chan.send(p.Room(ok=True))
            chan.recv_raw_into(buf, idle=BULK_IDLE_S)
        except BaseException:
            self.ask(
                "replica_written",
                rank=rank,
                token=token,
                ok=False,
                step=step,
                why=p.CUT_OFF,
                generation=generation,
            )
            raise
        self.ask("replica_received", rank=rank, step=step, buf=buf)  # fault injection
        ok = checksum_chunks(layout.chunks(buf)) == msg.checksum
        self.ask(
            "replica_written",
            rank=rank,
            token=token,
            ok=ok,
            step=step,
            layout=layout,
            tree=msg.tree,
            checksum=msg.checksum,
            why="" if ok else "checksum mismatch",
            generation=generation,
        )
        chan.send(p.Accepted(ok=ok))

    def _receive_delta(self, chan: Channel, msg: p.ReplicaDelta, generation: int) -> None:
        rank, step = msg.rank, msg.step
        base = self.ask(
            "replica_base",
            rank=rank,
            step=msg.base_step,
            checksum=msg.base_checksum,
            generation=generation,
        )
        chan.send(p.Room(ok=base is not None, need="base" if base is None else ""))
        if base is None:
            return
        data = bytearray(msg.nbytes)
        fields = {
            "rank": rank,
            "step": step,
            "base": base,
            "data": data,
            "generation": generation,
            "base_durable": msg.base_durable,
        }
        try:
            chan.recv_raw_into(memoryview(data), idle=BULK_IDLE_S)
        except BaseException:
            self.ask(
                "replica_delta_written",
                ok=False,
                why=p.CUT_OFF,
                tree={},
                checksum="",
                **fields,
            )
            raise
        self.ask("replica_received", rank=rank, step=step, buf=memoryview(data))
        why = ""
        try:  # its own checksum; a delta is checked against its base when it is rebuilt
            delta.Delta.from_bytes(data, where=f"delta of rank {rank} step {step}")
        except CorruptPartError as e:
            why = e.why
        self.ask(
            "replica_delta_written",
            ok=not why,
            why=why,
            tree=msg.tree,
            checksum=msg.checksum,
            **fields,
        )
        chan.send(p.Accepted(ok=not why))

    def _send(self, chan: Channel, msg: p.Fetch) -> None:
        rank, step = msg.rank, msg.step
        lease: Lease | None = self.ask("replica_lease", rank=rank, step=step)
        if lease is None:
            chan.send(p.Missing())
            return
        try:
            try:
                buf = lease.read()
            except CorruptPartError as e:
                chan.send(p.Missing(why=str(e)))
                return
            chan.send(p.Serving(layout=lease.layout, tree=lease.tree, checksum=lease.checksum))
            chan.send_raw(buf[: lease.layout.nbytes])
            self.ask(
                "replica_served", rank=rank, step=step, kind=lease.kind, base_step=lease.base_step
            )
        finally:
            self.ask("replica_unlease", rank=rank, token=lease.token)


def connect(address: Address, secret: bytes, tls: str = "off") -> Channel:
    """A channel to a peer's replica server (over TLS where ``tls`` wants it)."""
    return Channel.connect(address, secret, p.AgentToAgent, tls=tls)


def push(
    chan: Channel,
    rank: int,
    step: int,
    layout: Layout,
    tree: dict[str, Any],
    checksum: str,
    buf: memoryview,
    generation: int = -1,
) -> bool:
    """Send one replica to a peer; True when it was stored and its checksum matched."""
    msg = p.Replica(rank=rank, step=step, layout=layout, tree=tree, checksum=checksum)
    chan.send(msg, generation)
    room = chan.expect(p.Room, f"replica of rank {rank} step {step}")
    if not room.ok:
        return False
    return _send_bytes(chan, buf[: layout.nbytes], f"replica of rank {rank} step {step}")


def push_delta(
    chan: Channel,
    rank: int,
    step: int,
    base: Base,
    data: bytes,
    tree: dict[str, Any],
    checksum: str,
    generation: int = -1,
) -> bool | None:
    """Send one replica as a delta against ``base``: True when stored, False when refused,
    None when the peer does not hold ``base`` (send it first)."""
    msg = p.ReplicaDelta(
        rank=rank,
        step=step,
        base_step=base.step,
        base_checksum=base.checksum,
        base_durable=base.durable,
        nbytes=len(data),
        tree=tree,
        checksum=checksum,
    )
    chan.send(msg, generation)
    room = chan.expect(p.Room, f"delta of rank {rank} step {step}")
    if not room.ok:
        return None if room.need == "base" else False
    return _send_bytes(chan, memoryview(data), f"delta of rank {rank} step {step}")


def _send_bytes(chan: Channel, data: memoryview, what: str) -> bool:
    """The bytes a ``Room`` reply asked for; True when the peer accepted them."""
    chan.send_raw(data)
    return chan.expect(p.Accepted, what, timeout=300).ok


def fetch(
    address: Address,
    secret: bytes,
    rank: int,
    step: int,
    tls: str = "off",
    timeline: dict[str, float] | None = None,
    room: Callable[[int], memoryview] = populated,
) -> tuple[Layout, dict[str, Any], memoryview]:
    """A worker pulls its replica of ``step`` from a peer into memory ``room`` gives it
    (at least the replica's bytes, faulted in); the checksum is verified. ``timeline``
    gets the seconds of ``fetch`` and ``verify``."""
    t0 = time.monotonic()
    where = f"tier-1 replica of rank {rank} step {step} at {address}"
    try:
        chan = connect(address, secret, tls)
    except (OSError, EOFError) as e:
        raise CorruptPartError(where, f"peer unreachable: {e}") from e
    try:
        reply = chan.call(p.Fetch(rank=rank, step=step), (p.Serving, p.Missing), timeout=60)
        if isinstance(reply, p.Missing):
            raise CorruptPartError(where, reply.why)
        assert isinstance(reply, p.Serving)
        layout = reply.layout
        layout.check()
        buf = room(layout.nbytes)
        chan.recv_raw_into(buf[: layout.nbytes])
    except (OSError, EOFError, TimeoutError, RuntimeError, ValueError) as e:
        raise CorruptPartError(where, f"transfer failed: {type(e).__name__}: {e}") from e
    finally:
        chan.close()
    t1 = time.monotonic()
    if checksum_chunks(layout.chunks(buf)) != reply.checksum:
        raise CorruptPartError(where, "checksum mismatch")
    if timeline is not None:
        timeline.update(fetch=t1 - t0, verify=time.monotonic() - t1)
    return layout, reply.tree, buf

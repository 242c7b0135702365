"""Tier 1 as parity (``--peer-parity G``): a node holds the XOR of stripes of other nodes'
snapshots instead of whole copies of them.

The job's nodes form groups of ``G`` (a job's last nodes join the group before them, so a
group has ``G`` to ``2G - 1`` nodes; a job of fewer nodes is one group). Within a group of
``s`` nodes, the ranks with the same local index form a *set*. Each rank's snapshot is cut
into ``s - 1`` stripes; the rank at position ``a`` of the group sends stripe ``j`` to the
node at position ``(a + 1 + j) mod s``, so each node of the group receives one stripe from
every other member of the set and holds their XOR: its *parity* of the set, named by a
*key* (:func:`key_of` the holder's own rank of the set, which is not in it). A node then
holds ``peer_slots / (s - 1)`` times its ranks' state for others instead of
``peer_slots``.

A lost rank is rebuilt stripe by stripe: stripe ``j`` is the parity its holder keeps
XORed with the stripes of the same step the set's other members hold in their own tier 0
(which keeps the step committed in tier 1, as for full replicas). So one lost node per
group is survived; two in one group are not (the planner falls back to tier 2). The
rebuilt snapshot is checked against the rank's own checksum, which every stripe carries.

Here: the placement (pure functions), the stripes' arithmetic, a parity being made as its
stripes arrive (:class:`Accumulation`, folded in by the replica server's connection
threads), the sender's push, the server's three handlers, and the worker's rebuild.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tierswap.checksum import checksum_bytes, checksum_chunks, hasher
from tierswap.control import protocol as p
from tierswap.errors import CorruptPartError
from tierswap.layout import Layout, TensorEntry
from tierswap.shm import populated
from tierswap.tiers.memory import FILL_LIMIT_S, FILL_POLL_S, FILLING, Slot
from tierswap.wire import BULK_IDLE_S, Address, Channel

ALIGN = 4096
"""A stripe starts at a multiple of this many bytes of its snapshot."""
CHUNK = 16 << 20
"""Bytes received, hashed and folded into a parity at a time (one ``recv`` call)."""

Ask = Callable[..., Any]


# ---------------------------------------------------------------------------- placement


def key_of(holder_rank: int) -> int:
    """The key of the parity a node holds for the set of its rank ``holder_rank``:
    negative, so that it never names a rank where ranks and keys meet (holdings)."""
    return -1 - holder_rank


def is_key(key: int) -> bool:
    return key < 0


def groups(nodes: int, size: int) -> list[list[int]]:
    """The job's nodes in groups of ``size`` (the last one takes the nodes left over, so
    every group has at least ``size``; fewer nodes than that are one group). A job of one
    node has none."""
    if size < 2:
        raise ValueError(f"a parity group needs at least 2 nodes, got {size}")
    if nodes < 2:
        return []
    k = max(1, nodes // size)
    out = [list(range(g * size, (g + 1) * size)) for g in range(k - 1)]
    out.append(list(range((k - 1) * size, nodes)))
    return out


@dataclass(frozen=True, slots=True)
class Placement:
    """Where every rank's stripes go and which parities every node holds."""

    targets: dict[int, tuple[int, ...]]
    """rank -> the node holding the parity of each of its stripes, in stripe order."""
    holds: dict[int, dict[int, list[int]]]
    """node -> key of each parity it holds -> the ranks whose stripes it is the XOR of."""
    keys: dict[int, tuple[int, ...]]
    """rank -> the key of the parity of each of its stripes, in stripe order."""
    members: dict[int, tuple[int, ...]]
    """rank -> the other ranks of its set (whose tier 0 a rebuild of it reads)."""

    def holder_of(self, key: int) -> int:
        for node, held in self.holds.items():
            if key in held:
                return node
        raise KeyError(key)


def placement(nodes: int, nproc_per_node: int, size: int) -> Placement:
    """The parity placement of a job of ``nodes`` nodes of ``nproc_per_node`` ranks."""
    targets: dict[int, tuple[int, ...]] = {}
    holds: dict[int, dict[int, list[int]]] = {}
    keys: dict[int, tuple[int, ...]] = {}
    members: dict[int, tuple[int, ...]] = {}
    for group in groups(nodes, size):
        s = len(group)
        for i in range(nproc_per_node):
            ranks = [n * nproc_per_node + i for n in group]
            for a, rank in enumerate(ranks):
                to = [(a + 1 + j) % s for j in range(s - 1)]
                targets[rank] = tuple(group[m] for m in to)
                keys[rank] = tuple(key_of(ranks[m]) for m in to)
                members[rank] = tuple(r for r in ranks if r != rank)
            for m, node in enumerate(group):
                holds.setdefault(node, {})[key_of(ranks[m])] = [
                    r for b, r in enumerate(ranks) if b != m
                ]
    return Placement(targets, holds, keys, members)


def describe(pl: Placement, nproc_per_node: int) -> str:
    """One line per node: where its ranks' stripes go."""
    lines = []
    for node in sorted({r // nproc_per_node for r in pl.targets}):
        ranks = range(node * nproc_per_node, (node + 1) * nproc_per_node)
        parts = ", ".join(
            f"rank {r} -> parity at node {'/'.join(map(str, pl.targets[r]))}" for r in ranks
        )
        lines.append(f"node {node}: {parts}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- stripes


def stripe_unit(nbytes: int, stripes: int) -> int:
    """The length of a snapshot's stripes (its last may be shorter): a multiple of
    :data:`ALIGN`, at least one."""
    per = -(-nbytes // max(stripes, 1))
    return max(ALIGN, -(-per // ALIGN) * ALIGN)


def stripe(nbytes: int, stripes: int, j: int) -> tuple[int, int]:
    """Where stripe ``j`` of a snapshot of ``nbytes`` lies: (start, stop)."""
    unit = stripe_unit(nbytes, stripes)
    return min(j * unit, nbytes), min((j + 1) * unit, nbytes)


def parity_layout(nbytes: int) -> Layout:
    """A parity's slot, as the rings see it: one buffer of bytes."""
    return Layout((TensorEntry("parity", "U8", (nbytes,), 0, nbytes),), nbytes)


def xor_into(dst: memoryview, src: memoryview) -> None:
    """``dst ^= src`` (equal lengths), at memory speed."""
    import numpy as np  # the agent imports numpy only with parity on

    a = np.frombuffer(dst, dtype=np.uint8)
    np.bitwise_xor(a, np.frombuffer(src, dtype=np.uint8), out=a)


_local = threading.local()


def scratch(nbytes: int = CHUNK) -> memoryview:
    """This thread's buffer for a chunk in flight, made once (faulted in)."""
    buf: memoryview | None = getattr(_local, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.buf = populated(max(nbytes, CHUNK))
    return buf[:nbytes]


@dataclass(slots=True, eq=False)
class Accumulation:
    """A parity of one step being made as its stripes arrive. Its bookkeeping (who sent,
    who is sending) belongs to the agent's loop; :meth:`fold` and :meth:`finish` run on
    the connection threads that receive the stripes, under the lock."""

    step: int
    slot: Slot
    expected: frozenset[int]
    generation: int
    members: dict[int, p.ParityMember] = field(default_factory=dict)
    sending: set[int] = field(default_factory=set)
    """Ranks whose stripe is arriving now (each holds a lease on the slot)."""
    dropped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    touched: bytearray = field(default_factory=bytearray)
    """Per chunk of the slot: whether a stripe has been folded in (the first one is
    copied, so the slot needs no zeroing first)."""

    def fold(self, buf: memoryview, start: int, data: memoryview) -> None:
        """XOR ``data`` (a chunk of a stripe, ``start`` a multiple of :data:`CHUNK`) into
        the parity ``buf``; the first stripe to reach a chunk is copied, the rest of that
        chunk zeroed."""
        c, n = start // CHUNK, len(data)
        with self.lock:
            if len(self.touched) <= c:
                self.touched.extend(bytes(c + 1 - len(self.touched)))
            if self.touched[c]:
                xor_into(buf[start : start + n], data)
                return
            buf[start : start + n] = data
            end = min(start + CHUNK, len(buf))
            buf[start + n : end] = bytes(end - start - n)
            self.touched[c] = 1

    def finish(self, buf: memoryview) -> str:
        """Zero the chunks no stripe reached (past the longest); the parity's checksum."""
        with self.lock:
            for c, start in enumerate(range(0, len(buf), CHUNK)):
                if c >= len(self.touched) or not self.touched[c]:
                    end = min(start + CHUNK, len(buf))
                    buf[start:end] = bytes(end - start)
        return checksum_chunks(parity_layout(len(buf)).chunks(buf))


# ---------------------------------------------------------------------------- sender


def push(
    chan: Channel, step: int, member: p.ParityMember, data: memoryview, generation: int
) -> bool:
    """Send one stripe to the peer holding its parity; True when it was folded in and its
    checksum matched."""
    what = f"stripe {member.stripe} of rank {member.rank} step {step}"
    msg = p.ParityPart(member=member, step=step, stripe_checksum=checksum_bytes(data))
    chan.send(msg, generation)
    if not chan.expect(p.Room, what).ok:
        return False
    chan.send_raw(data)
    return chan.expect(p.Accepted, what, timeout=300).ok


# ---------------------------------------------------------------------------- server


def receive(
    ask: Ask, chan: Channel, msg: p.ParityPart, generation: int, closed: Callable[[], bool]
) -> None:
    """A stripe arrives: folded into the parity of its step chunk by chunk, each chunk
    hashed as it comes; the stripe that completes the parity checksums it."""
    m = msg.member
    fields = {"rank": m.rank, "step": msg.step, "unit": m.unit, "generation": generation}
    deadline = time.monotonic() + FILL_LIMIT_S
    while (got := ask("parity_slot", **fields, wait=True)) == FILLING:
        if time.monotonic() >= deadline or closed():
            got = ask("parity_slot", **fields)
            break
        time.sleep(FILL_POLL_S)
    if got is None:
        chan.send(p.Room(ok=False))
        return
    acc, buf = got
    done = {"rank": m.rank, "step": msg.step, "acc": acc, "member": m, "generation": generation}
    if m.nbytes > len(buf):  # a stripe longer than its unit said
        ask("parity_added", **done, ok=False, why=f"stripe of {m.nbytes} bytes over its slot")
        chan.send(p.Room(ok=False))
        return
    try:
        chan.send(p.Room(ok=True))
        digest = hasher()
        for start in range(0, m.nbytes, CHUNK):
            data = scratch(min(CHUNK, m.nbytes - start))
            chan.recv_raw_into(data, idle=BULK_IDLE_S)
            digest.update(data)
            acc.fold(buf, start, data)
    except BaseException:
        ask("parity_added", **done, ok=False, why=p.CUT_OFF)
        raise
    ok = digest.hexdigest() == msg.stripe_checksum
    complete = ask("parity_added", **done, ok=ok, why="" if ok else "checksum mismatch")
    if complete:
        ask("parity_checked", acc=acc, checksum=acc.finish(buf), generation=generation)
    chan.send(p.Accepted(ok=ok))


def serve(ask: Ask, chan: Channel, msg: p.FetchParity) -> None:
    """A rebuilding worker fetches a parity this node holds."""
    lease = ask("replica_lease", rank=msg.key, step=msg.step)
    if lease is None:
        chan.send(p.Missing(why=f"parity {msg.key} of step {msg.step} is not held here"))
        return
    try:
        buf = lease.read()[: lease.layout.nbytes]
        members = list(lease.tree.get("members", []))
        chan.send(p.ParityServing(nbytes=len(buf), checksum=lease.checksum, members=members))
        chan.send_raw(buf)
    finally:
        ask("replica_unlease", rank=msg.key, token=lease.token)


def serve_range(ask: Ask, chan: Channel, msg: p.FetchRange) -> None:
    """A rebuilding worker reads bytes of one of this node's tier-0 snapshots."""
    slot = ask("tier0_lease", rank=msg.rank, step=msg.step)
    if slot is None:
        chan.send(p.Missing(why=f"tier 0 no longer holds rank {msg.rank} step {msg.step}"))
        return
    try:
        buf = slot.segment.buf
        if msg.start < 0 or msg.nbytes < 0 or msg.start + msg.nbytes > len(buf):
            chan.send(p.Missing(why=f"bytes {msg.start}+{msg.nbytes} are past the snapshot"))
            return
        chan.send(p.Ranged(nbytes=msg.nbytes))
        chan.send_raw(buf[msg.start : msg.start + msg.nbytes])
    finally:
        ask("tier0_unlease", slot=slot)


# ---------------------------------------------------------------------------- rebuild


def rebuild(
    source: p.FromParity,
    secret: bytes,
    rank: int,
    step: int,
    tls: str = "off",
    timeline: dict[str, float] | None = None,
    room: Callable[[int], memoryview] = populated,
) -> tuple[Layout, dict[str, Any], memoryview]:
    """A worker rebuilds its snapshot of ``step`` from parity: each stripe is the parity
    its holder sends, XORed with the other members' stripes read from their nodes' tier
    0, the stripes on threads of their own (each from other peers). The result is checked
    against the rank's checksum (``CorruptPartError`` where anything is missing, cut off
    or wrong)."""
    t0 = time.monotonic()
    r = _Rebuild(source, secret, rank, step, tls)
    pool: ThreadPoolExecutor | None = None
    try:
        first = r.open(0)
        r.me = first[2]
        r.me.layout.check()
        r.out = room(r.me.layout.nbytes)
        later = []
        if len(source.keys) > 1:
            pool = ThreadPoolExecutor(len(source.keys) - 1, thread_name_prefix="tierswap-rebuild")
            later = [pool.submit(r.stripe, j) for j in range(1, len(source.keys))]
        r.stripe(0, first)
        for f in later:
            f.result()
    except (OSError, EOFError, TimeoutError, RuntimeError, ValueError) as e:
        raise CorruptPartError(r.where, f"{type(e).__name__}: {e}") from e
    finally:
        r.close()  # a stripe still waiting on a peer fails at once
        if pool is not None:
            pool.shutdown(wait=True)
    me, out = r.me, r.out
    t1 = time.monotonic()
    if checksum_chunks(me.layout.chunks(out)) != me.checksum:
        raise CorruptPartError(r.where, "checksum mismatch")
    if timeline is not None:
        timeline.update(fetch=t1 - t0, verify=time.monotonic() - t1)
    return me.layout, dict(me.tree), out


class _Rebuild:
    """One rank's rebuild: its stripes, each fetched on connections of its own."""

    def __init__(self, source: p.FromParity, secret: bytes, rank: int, step: int, tls: str):
        self.source, self.secret, self.rank, self.step, self.tls = source, secret, rank, step, tls
        self.where = f"rank {rank} step {step} rebuilt from tier-1 parity"
        self.me: Any = None
        self.out: Any = None
        self._chans: list[Channel] = []
        self._lock = threading.Lock()

    def _connect(self, address: Address) -> Channel:
        chan = Channel.connect(address, self.secret, p.AgentToAgent, tls=self.tls)
        with self._lock:
            self._chans.append(chan)
        return chan

    def open(self, j: int) -> tuple[Channel, p.ParityServing, p.ParityMember]:
        """Ask stripe ``j``'s holder for its parity: the channel, the answer, this rank's
        stripe in it."""
        key, holder = self.source.keys[j], self.source.holders[j]
        chan = self._connect(holder)
        reply = chan.call(p.FetchParity(key=key, step=self.step), (p.ParityServing, p.Missing))
        what = f"the parity of its stripe {j} at {holder[0]}:{holder[1]}"
        if isinstance(reply, p.Missing):
            raise CorruptPartError(self.where, f"{what}: {reply.why}")
        assert isinstance(reply, p.ParityServing)
        mine = next((m for m in reply.members if m.rank == self.rank), None)
        other = self.me is not None and mine is not None and mine.checksum != self.me.checksum
        if mine is None or mine.stripe != j or other:
            raise CorruptPartError(self.where, f"{what} holds no stripe {j} of this snapshot")
        return chan, reply, mine

    def stripe(
        self, j: int, opened: tuple[Channel, p.ParityServing, p.ParityMember] | None = None
    ) -> None:
        """Stripe ``j`` into its place: the parity, then each other member's stripe."""
        chan, reply, mine = opened or self.open(j)
        region = self.out[j * self.me.unit : j * self.me.unit + mine.nbytes]
        _receive_parity(chan, region, reply, self.where)
        chans: dict[Address, Channel] = {}
        for m in sorted(reply.members, key=lambda m: m.rank):
            n = min(m.nbytes, len(region))
            if m.rank == self.rank or n == 0:
                continue
            address = self.source.members.get(m.rank)
            if address is None:
                raise CorruptPartError(self.where, f"no address for rank {m.rank} of its set")
            if address not in chans:
                chans[address] = self._connect(address)
            _fold_range(chans[address], m.rank, self.step, m, region[:n], self.where)

    def close(self) -> None:
        with self._lock:
            for chan in self._chans:
                chan.close()


def _receive_parity(chan: Channel, region: memoryview, reply: p.ParityServing, where: str) -> None:
    """The parity's bytes: its first ``len(region)`` into ``region``, the rest read past;
    all of them hashed as they come and checked."""
    digest = hasher()
    for start in range(0, reply.nbytes, CHUNK):
        n = min(CHUNK, reply.nbytes - start)
        data = region[start : start + n] if start + n <= len(region) else scratch(n)
        chan.recv_raw_into(data)
        digest.update(data)
        if start < len(region) < start + n:  # the chunk that ends the region
            region[start:] = data[: len(region) - start]
    if digest.hexdigest() != reply.checksum:
        raise CorruptPartError(where, "parity checksum mismatch")


def _fold_range(
    chan: Channel, rank: int, step: int, m: p.ParityMember, region: memoryview, where: str
) -> None:
    """XOR into ``region`` the first ``len(region)`` bytes of ``m``'s stripe, read from the
    tier 0 of its node."""
    msg = p.FetchRange(rank=rank, step=step, start=m.stripe * m.unit, nbytes=len(region))
    reply = chan.call(msg, (p.Ranged, p.Missing))
    if isinstance(reply, p.Missing):
        raise CorruptPartError(where, f"rank {rank}'s stripe: {reply.why}")
    for start in range(0, len(region), CHUNK):
        data = scratch(min(CHUNK, len(region) - start))
        chan.recv_raw_into(data)
        xor_into(region[start : start + len(data)], data)

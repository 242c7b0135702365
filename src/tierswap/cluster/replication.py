"""The agent's sender of tier-1 replicas: bytes to peers on a pool of threads.

What to send and when is the agent's core's (``control/agent.py``: one transfer in flight
per rank, always the newest snapshot); this sends what it is told, each rank's snapshot
whole or (``--memory-tiers delta``) as a delta against its base, and posts the outcome
back as events: ``Replicated`` once per transfer, ``ReplicationFailed`` per peer missed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tierswap.control import protocol as p
from tierswap.control.agent_events import (
    ConfigureReplication,
    Replicate,
    Replicated,
    ReplicationFailed,
    Sent,
)
from tierswap.layout import Layout
from tierswap.tiers import durable, parity
from tierswap.tiers.delta_sender import BaseKeeper
from tierswap.tiers.deltas import Base
from tierswap.tiers.memory import Slot
from tierswap.tiers.peer import connect, push, push_delta
from tierswap.wire import Address, Channel

SEND_LIMIT_S = 30.0
"""A replica send to a peer that stopped acknowledging fails after this long (a host gone
without a reset): the transfer is reported failed and the rank's next one can go."""


class Replicator:
    """Sends each rank's newest snapshot to its peers; one transfer in flight per rank."""

    def __init__(
        self,
        secret: bytes,
        post: Callable[[Any], None],
        threads: int,
        keeper: BaseKeeper | None = None,
        base_root: str | None = None,
        world_size: int = 0,
        announce: Callable[[p.Replicating, int], None] | None = None,
        tls: str = "off",
        parity: bool = False,
    ) -> None:
        self.secret = secret
        self.tls = tls
        self.parity = parity
        """``--peer-parity``: each target gets one stripe of the snapshot (its index in
        the rank's targets), folded into the parity it holds."""
        self.keeper = keeper
        """Set for ``--memory-tiers delta``: each rank's base, and when to renew it."""
        self.base_root = base_root
        """Delta mode with ``--persist``: every base is also written to tier 2 here (in this
        thread, after it went to the peers), so a peer that loses it can read it back."""
        self.world_size = world_size
        self.persisted: dict[int, list[int]] = {}
        """rank -> base steps written under ``base_root``, oldest first (two are kept)."""
        self.post = post
        """Hands an event to the agent's loop."""
        self.targets: dict[int, tuple[int, ...]] = {}
        self.addresses: dict[int, Address] = {}
        self.announce_to = announce
        self.announce = False
        """Tell the coordinator as each transfer starts (fault injection cuts transfers in
        flight): the message goes from the sending thread, just before the bytes."""
        self.generation = -1
        self.delay = 0.0
        """Seconds each transfer is held before it goes (``--inject delay:...``, tests)."""
        self._chans: dict[tuple[int, int], tuple[Address, Channel]] = {}
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(
            max_workers=max(threads, 1), thread_name_prefix="tierswap-replicate"
        )

    def configure(self, cfg: ConfigureReplication) -> None:
        """A new generation that restarts from ``cfg.restart``: a base taken after it is of
        an abandoned timeline, and a transfer queued before now is not sent (peers would
        refuse it anyway); a transfer stuck on a node replaced or gone fails now."""
        self.targets, self.addresses = cfg.targets, dict(cfg.addresses)
        self.generation = cfg.generation
        self.world_size = cfg.world_size or self.world_size
        self.delay = cfg.delay
        self.announce = cfg.announce
        if self.keeper is not None:
            self.keeper.discard_after(cfg.restart)
        with self._lock:
            gone = [k for k, (a, _) in self._chans.items() if self.addresses.get(k[1]) != a]
            stale = [self._chans.pop(k)[1] for k in gone]
        for chan in stale:
            chan.close()

    def submit(self, job: Replicate) -> None:
        epoch = None if self.keeper is None else self.keeper.epoch
        self.pool.submit(
            self._send, job.rank, job.step, job.slot, job.layout, epoch, job.generation
        )

    def _send(
        self, rank: int, step: int, slot: Slot, layout: Layout, epoch: int | None, generation: int
    ) -> None:
        stats: dict[str, Any] = {}
        try:
            time.sleep(self.delay)
            if generation != self.generation:
                return  # queued before a restore went back: maybe of an abandoned timeline
            try:
                send, base = self._sender(rank, step, slot, layout, epoch, generation, stats)
            except Exception as e:  # the encode failed (memory, say): reported, not fatal
                stats.clear()
                for node in self.targets.get(rank, ()):
                    self.post(ReplicationFailed(rank, step, node, f"{e!r}", generation))
                return
            for j, node in enumerate(self.targets.get(rank, ())):
                try:
                    chan = self._channel(rank, node)
                    if self.announce and self.announce_to is not None:
                        self.announce_to(p.Replicating(rank=rank, step=step, peer=node), generation)
                    if not send(chan, j):
                        if self.parity:  # the step's parity cannot be made: no more stripes
                            break
                        continue  # refused: the peer reports why
                except Exception as e:  # any failure: a fresh connection next time, reported
                    self._drop(rank, node)
                    error = f"{type(e).__name__}: {e}"
                    self.post(ReplicationFailed(rank, step, node, error, generation, cut=True))
                    if self.parity:
                        break
            if base is not None and base.step == step and self.base_root is not None:
                self._persist_base(rank, base, generation)
        finally:  # always: the slot is unleased and the rank's next snapshot can go
            sent = Sent(**stats) if stats else None
            self.post(Replicated(rank, step, slot, generation, sent))

    def _sender(
        self,
        rank: int,
        step: int,
        slot: Slot,
        layout: Layout,
        epoch: int | None,
        generation: int,
        stats: dict[str, Any],
    ) -> tuple[Callable[[Channel, int], bool], Base | None]:
        """How ``step`` of ``rank`` goes to its ``j``-th peer: the full snapshot, one stripe
        of it (parity), or (delta mode) a delta against the rank's base, preceded by the
        base for a peer that lacks it. The delta is encoded once, here, in the agent;
        ``stats`` gets its size and time."""
        buf, g = slot.segment.buf, generation
        if self.parity:
            stripes = len(self.targets.get(rank, ()))
            unit = parity.stripe_unit(layout.nbytes, stripes)

            def send_stripe(chan: Channel, j: int) -> bool:
                start, stop = parity.stripe(layout.nbytes, stripes, j)
                member = p.ParityMember(
                    rank=rank, stripe=j, nbytes=stop - start, unit=unit, layout=layout,
                    tree=slot.tree, checksum=slot.checksum,
                )  # fmt: skip
                return parity.push(chan, step, member, buf[start:stop], g)

            return send_stripe, None
        if self.keeper is None:
            return (
                lambda chan, _j: push(chan, rank, step, layout, slot.tree, slot.checksum, buf, g)
            ), None
        base, new = self.keeper.base_for(rank, step, layout, buf, slot.checksum, slot.tree, epoch)
        if new:
            stats.update(full=layout.nbytes, kind="base", nbytes=layout.nbytes, encode_s=0.0)
            return (
                lambda chan, _j: push(chan, rank, step, layout, slot.tree, slot.checksum, buf, g)
            ), base
        t0 = time.perf_counter()
        data = self.keeper.encode(rank, base, buf)
        stats.update(
            full=layout.nbytes, kind="delta", nbytes=len(data), encode_s=time.perf_counter() - t0
        )

        def send(chan: Channel, _j: int) -> bool:
            ok = push_delta(chan, rank, step, base, data, slot.tree, slot.checksum, g)
            if ok is None:  # the peer lacks the base (new, or it dropped it): base first
                b = base
                assert b.buf is not None
                if not push(chan, rank, b.step, b.layout, b.tree, b.checksum, b.buf, g):
                    return False
                ok = push_delta(chan, rank, step, base, data, slot.tree, slot.checksum, g)
            return bool(ok)

        return send, base

    def _persist_base(self, rank: int, base: Base, generation: int) -> None:
        """Write a new base to tier 2 (``base_root``) and drop the one before the last."""
        assert self.base_root is not None and base.buf is not None
        try:
            durable.write_part(
                self.base_root, base.step, rank, self.world_size, base.layout, base.tree,
                base.buf, base.checksum,
            )  # fmt: skip
            base.durable = self.base_root
            steps = self.persisted.setdefault(rank, [])
            steps.append(base.step)
            while len(steps) > 2:  # peers may still hold steps on the previous one
                durable.remove_part(self.base_root, steps.pop(0), rank)
        except Exception as e:  # reported; the peers still hold the base in memory
            error = f"base to tier 2: {e!r}"
            self.post(ReplicationFailed(rank, base.step, None, error, generation))

    def _channel(self, rank: int, node: int) -> Channel:
        address = self.addresses[node]
        with self._lock:
            cached = self._chans.get((rank, node))
        if cached is not None and cached[0] == address:
            return cached[1]
        if cached is not None:
            cached[1].close()
        chan = connect(address, self.secret, self.tls)
        chan.give_up_after(SEND_LIMIT_S)
        with self._lock:
            self._chans[(rank, node)] = (address, chan)
        return chan

    def _drop(self, rank: int, node: int) -> None:
        with self._lock:
            cached = self._chans.pop((rank, node), None)
        if cached is not None:
            cached[1].close()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for _, chan in self._chans.values():
                chan.close()
            self._chans.clear()

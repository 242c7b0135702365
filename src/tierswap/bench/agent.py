"""The agent's side of the bench: tier 0 of one rank, served as ``cluster/agent.py``
serves it, in a process of its own.

``python -m tierswap.bench.agent SOCKET JOB_ID``, with the socket's secret (hex) in
``TIERSWAP_BENCH_SECRET``; it serves one connection and exits when that closes, its
slots unlinked.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from tierswap.bench.rig import (
    NSLOTS,
    SECRET_ENV,
    BenchHolding,
    BenchPersist,
    BenchRequest,
    BenchSync,
    Holding,
    Persisted,
)
from tierswap.checksum import checksum_chunks
from tierswap.control import protocol as p
from tierswap.state import Layout
from tierswap.tiers import durable
from tierswap.tiers.memory import RankRing, Slot
from tierswap.wire import Channel, Listener


class _Agent:
    """Tier 0 of one rank, served as ``cluster/agent.py`` serves it."""

    def __init__(self, chan: Channel, job_id: str) -> None:
        self.chan = chan
        self.ring = RankRing(job_id, 0, NSLOTS)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tierswap-check")
        self.checks: list[Future[None]] = []

    def serve(self) -> None:
        try:
            while (env := self.chan.recv()) is not None:
                self._on(env.msg)
        except EOFError:
            pass  # the benchmark closed its end: done
        finally:
            self.pool.shutdown(wait=True)
            self.ring.close()

    def _on(self, msg: p.Message) -> None:
        if isinstance(msg, p.Written):
            self._written(msg)  # no reply; an error here ends the process, and so the bench
            return
        try:
            reply = self._answer(msg)
        except (ValueError, KeyError, OSError) as e:
            self.chan.send(p.Error(message=f"{type(e).__name__}: {e}"))
            return
        self.chan.send(reply)

    def _answer(self, msg: p.Message) -> p.Message:
        match msg:
            case p.Alloc(layout=layout):
                layout.check()
                with self.lock:
                    alloc = self.ring.allocate(layout)
                return p.Allocated(
                    alloc=alloc.id, segments=[s.segment.path.name for s in alloc.slots]
                )
            case p.SlotRequest(step=step, alloc=alloc_id):
                with self.lock:
                    slot, _ = self.ring.begin_write(step, alloc_id)
                return p.SlotGranted(slot=slot)
            case BenchSync():
                self._sync()
                return p.Ack()
            case BenchHolding(step=step):
                return self._holding(step)
            case BenchPersist(root=root, step=step):
                return self._persist(root, step)
        raise ValueError(f"unexpected request {p.tag_of(msg)!r}")

    def _written(self, msg: p.Written) -> None:
        with self.lock:
            slot = self.ring.written(msg.slot, msg.step, msg.alloc, msg.tree)
            layout = self.ring.layout()
        self.checks.append(self.pool.submit(self._check, slot, layout, msg.step, msg.checksum))

    def _check(self, slot: Slot, layout: Layout, step: int, given: str) -> None:
        """As the agent does: the copy's own checksum, or one computed here."""
        digest = given or checksum_chunks(layout.chunks(slot.segment.buf))
        with self.lock:
            self.ring.checked(slot, digest)
            self.ring.set_committed(step)  # one rank: held by all ranks means committed

    def _sync(self) -> None:
        for check in self.checks:
            check.result()
        self.checks.clear()

    def _holding(self, step: int) -> Holding:
        """Which slot holds ``step`` and the checksum computed here of its bytes."""
        self._sync()
        with self.lock:
            slot = self.ring.held().get(step)
        if slot is None:
            raise ValueError(f"step {step} is not held")
        return Holding(slot=slot.index, checksum=slot.checksum)

    def _persist(self, root: str, step: int) -> Persisted:
        self._sync()
        with self.lock:
            slot, layout = self.ring.lease(step), self.ring.layout()
        if slot is None:
            raise ValueError(f"step {step} is not held")
        try:
            t0 = time.monotonic()
            info = durable.write_part(
                root, slot.step, 0, 1, layout, slot.tree, slot.segment.buf, slot.checksum
            )
            seconds = time.monotonic() - t0
        finally:
            with self.lock:
                self.ring.unlease(slot)
        return Persisted(seconds=seconds, nbytes=info.nbytes)


def main(argv: list[str]) -> None:
    """Serve the one connection made to ``SOCKET``; the secret comes from the env."""
    address, job_id = argv
    secret = bytes.fromhex(os.environ.pop(SECRET_ENV))
    with Listener(address, secret) as listener:
        chan = listener.handshake(listener.accept(), p.WorkerToAgent | BenchRequest)
    _Agent(chan, job_id).serve()


if __name__ == "__main__":
    main(sys.argv[1:])

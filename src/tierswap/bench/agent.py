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
from multiprocessing.connection import Listener
from typing import Any

from tierswap.bench.rig import NSLOTS, SECRET_ENV
from tierswap.checksum import checksum_chunks
from tierswap.state import Layout
from tierswap.tiers import durable
from tierswap.tiers.memory import RankRing, Slot
from tierswap.wire import Channel, Message


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
            while (msg := self.chan.recv()) is not None:
                self._on(msg)
        except EOFError:
            pass  # the benchmark closed its end: done
        finally:
            self.pool.shutdown(wait=True)
            self.ring.close()

    def _on(self, msg: Message) -> None:
        if msg["op"] == "held":
            self._held(msg)  # no reply; an error here ends the process, and so the bench
            return
        handler = getattr(self, f"_{msg['op']}", None)
        try:
            if handler is None:
                raise ValueError(f"unknown request {msg['op']!r}")
            reply = handler(msg)
        except (ValueError, KeyError, OSError) as e:
            self.chan.send("error", message=f"{type(e).__name__}: {e}")
            return
        self.chan.send("ok", **reply)

    def _alloc(self, msg: Message) -> dict[str, Any]:
        with self.lock:
            alloc = self.ring.allocate(Layout.from_json(msg["layout"]))
        return {"alloc": alloc.id, "segments": [s.segment.path.name for s in alloc.slots]}

    def _slot(self, msg: Message) -> dict[str, Any]:
        with self.lock:
            slot, _ = self.ring.begin_write(int(msg["step"]), int(msg["alloc"]))
        return {"slot": slot}

    def _held(self, msg: Message) -> None:
        step = int(msg["step"])
        with self.lock:
            slot = self.ring.written(int(msg["slot"]), step, int(msg["alloc"]), msg["tree"])
            layout = self.ring.layout()
        self.checks.append(self.pool.submit(self._check, slot, layout, step))

    def _check(self, slot: Slot, layout: Layout, step: int) -> None:
        digest = checksum_chunks(layout.chunks(slot.segment.buf))
        with self.lock:
            self.ring.checked(slot, digest)
            self.ring.set_committed(step)  # one rank: held by all ranks means committed

    def _sync(self, msg: Message) -> dict[str, Any]:
        for check in self.checks:
            check.result()
        self.checks.clear()
        return {}

    def _holding(self, msg: Message) -> dict[str, Any]:
        """Which slot holds ``step`` and the checksum computed here of its bytes."""
        self._sync(msg)
        with self.lock:
            slot = self.ring.held().get(int(msg["step"]))
        if slot is None:
            raise ValueError(f"step {msg['step']} is not held")
        return {"slot": slot.index, "checksum": slot.checksum}

    def _persist(self, msg: Message) -> dict[str, Any]:
        self._sync(msg)
        with self.lock:
            slot, layout = self.ring.lease(int(msg["step"])), self.ring.layout()
        if slot is None:
            raise ValueError(f"step {msg['step']} is not held")
        try:
            t0 = time.monotonic()
            info = durable.write_part(
                str(msg["root"]), slot.step, 0, 1, layout, slot.tree, slot.segment.buf,
                slot.checksum,
            )  # fmt: skip
            seconds = time.monotonic() - t0
        finally:
            with self.lock:
                self.ring.unlease(slot)
        return {"seconds": seconds, "nbytes": info.nbytes}


def main(argv: list[str]) -> None:
    """Serve the one connection made to ``SOCKET``; the secret comes from the env."""
    address, job_id = argv
    secret = bytes.fromhex(os.environ.pop(SECRET_ENV))
    with Listener(address, family="AF_UNIX", authkey=secret) as listener:
        conn = listener.accept()
    _Agent(Channel(conn), job_id).serve()


if __name__ == "__main__":
    main(sys.argv[1:])

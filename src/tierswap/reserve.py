"""Memory a parked worker faults in ahead for the restore it may be given.

A restore's bytes go into memory the process has never touched: the state it rebuilds
is new. Faulting that memory in (zeroing it, a page at a time or a huge page at a time
as the kernel grants them) cost as much as copying the bytes into it, and far more when
huge pages are slow to come: 0.1 to 1.3 s for 384 MiB on this machine, against 0.04 s
for the copy (``bench/restore_contention.py``). A parked worker, told by its agent how large a
rank's state on its node is (``p.Reserve``), makes that memory while it waits; the
restore reads the step into it and the restored state keeps it as its own
(``load(adopt=True)``), so the memory is taken once, not twice. Only a worker whose state
lives on the CPU holds one (a GPU's state is copied to the device, not adopted).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tierswap.affinity import helper_cpus, pin_thread
from tierswap.shm import populated

WAIT_S = 10.0
"""How long a restore waits for memory still being made before it makes its own."""
MEMINFO = Path("/proc/meminfo")


def made_gently(nbytes: int) -> memoryview:
    """Private memory faulted in a stride at a time (:func:`~tierswap.shm.populated`) at
    the lowest priority of its thread (``nice`` 19: the trainers and agents run first)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only
    return populated(nbytes)


def _free(buf: memoryview) -> None:
    owner = buf.obj
    buf.release()
    close = getattr(owner, "close", None)
    if close is not None:
        close()


def _trim(buf: memoryview, nbytes: int) -> None:
    """Give the pages of ``buf`` past its first ``nbytes`` back to the kernel: a block made
    for the node's largest rank, taken by a smaller one, holds no more than it needs."""
    owner = buf.obj
    start = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    if isinstance(owner, mmap.mmap) and start < len(buf):
        owner.madvise(mmap.MADV_DONTNEED, start, len(buf) - start)


def leaves_room(nbytes: int) -> bool:
    """Whether making ``nbytes`` more leaves a tenth of the machine's memory available
    (several simulated hosts, or a training process, share it: a block made ahead must
    never be what starts the out-of-memory killer). True where Linux does not say."""
    try:
        info = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines())
        avail = int(info["MemAvailable"].split()[0]) * 1024
        total = int(info["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return True
    return avail - nbytes >= total // 10


class Reserve:
    """At most one block of faulted-in private memory, made on a thread of its own and
    handed to one restore (:meth:`take`), after which the next :meth:`want` makes another."""

    def __init__(self, make: Callable[[int], memoryview] = made_gently) -> None:
        self._make = make
        self._cond = threading.Condition()
        self._want = 0
        self._buf: memoryview | None = None
        self._making = False

    def want(self, nbytes: int) -> None:
        """Hold ``nbytes`` ready from now on (0: none); a held block of another size is
        freed, and one is made in the background if none is held."""
        drop = None
        with self._cond:
            self._want = nbytes
            if self._buf is not None and len(self._buf) != nbytes:
                drop, self._buf = self._buf, None
            start = nbytes > 0 and self._buf is None and not self._making
            if start:
                self._making = True
        if drop is not None:
            _free(drop)
        if start:
            threading.Thread(target=self._run, name="tierswap-reserve", daemon=True).start()

    def _run(self) -> None:
        try:
            pin_thread(helper_cpus())  # --agent-cpus: not the trainer's work
            while True:
                with self._cond:
                    n = self._want
                    if n <= 0 or self._buf is not None:
                        return
                if not leaves_room(n):  # restores make their own, when they need it
                    return
                buf = self._make(n)
                with self._cond:
                    kept = self._want == n and self._buf is None
                    if kept:
                        self._buf = buf
                if not kept:  # wanted no longer (the size changed meanwhile)
                    _free(buf)
        except Exception as e:  # (no room, say) a restore without it makes its own
            print(f"[tierswap] memory for the next restore not made: {e}", file=sys.stderr)
        finally:
            with self._cond:
                self._making = False
                self._cond.notify_all()

    def take(self, nbytes: int, timeout: float = WAIT_S) -> memoryview | None:
        """The held memory when it holds at least ``nbytes`` (waiting up to ``timeout`` for
        one being made), the caller's from then on; else None."""
        with self._cond:
            self._cond.wait_for(lambda: not self._making, timeout)
            buf = self._buf
            if buf is None or len(buf) < nbytes:
                return None
            self._buf = None
        _trim(buf, nbytes)
        return buf

    def held(self) -> int:
        """Bytes held ready now."""
        with self._cond:
            return 0 if self._buf is None else len(self._buf)

    def close(self) -> None:
        self.want(0)

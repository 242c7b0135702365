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

Such a worker also maps the node's tier-0 slots ahead (``p.Reserve.slots``), read-only,
with their page tables filled: mapping a 384 MiB slot at the restore took 27 ms of its
73 ms read here (98,304 page-table entries, one a page), more than a third of the work.
Mapped while parked, a restore from a slot only copies and hashes. What that costs is
page tables, 8 bytes a 4 KiB page (0.2 % of the node's tier-0 memory), and the slots'
pages counted in the worker's resident memory (as in the agent's and the trainers'),
not memory of their own: the agent owns the slots, and a slot it no longer names is
unmapped at once. The one exception: from a restore's start to its first step the
mappings are kept (unmapping takes CPU the way back should not wait for), so a slot
the agent frees in that second stays alive until then. A slot made anew in the same
name is told apart by its inode.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from tierswap.affinity import helper_cpus, pin_thread
from tierswap.shm import SHM_DIR, STRIDE, ReadMap, populated

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


def map_gently(path: Path) -> ReadMap | None:
    """A tier-0 slot mapped ahead (:class:`~tierswap.shm.ReadMap`), a stride at a time, at
    the lowest priority of its thread; None where it is not there (any more)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only
    try:
        return ReadMap(path, stride=STRIDE)
    except (OSError, ValueError):
        return None


class Reserve:
    """At most one block of faulted-in private memory, made on a thread of its own and
    handed to one restore (:meth:`take`), after which the next :meth:`want` makes another;
    and the node's tier-0 slots, mapped on another (:meth:`take_map`)."""

    def __init__(
        self,
        make: Callable[[int], memoryview] = made_gently,
        map_slot: Callable[[Path], ReadMap | None] = map_gently,
    ) -> None:
        self._make = make
        self._map = map_slot
        self._cond = threading.Condition()
        self._want = 0
        self._buf: memoryview | None = None
        self._making = False
        self._slots: tuple[str, ...] = ()
        self._maps: dict[str, ReadMap] = {}
        self._unmapped: set[str] = set()
        """Slots named that could not be mapped (gone already): not tried again."""
        self._mapping = False
        self._spent: list[ReadMap] = []
        """Mappings a restore took or let go of, unmapped once it is over (:meth:`let_go`):
        unmapping takes CPU (13 ms a 384 MiB slot) the way back should not wait for."""

    def want(self, nbytes: int, slots: Iterable[str] = ()) -> None:
        """Hold ``nbytes`` ready from now on (0: none), and the tier-0 slots named
        ``slots`` mapped; a held block of another size is freed, and mappings of slots
        not named unmapped; what is missing is made in the background."""
        drop = None
        with self._cond:
            self._want, self._slots = nbytes, tuple(slots)
            if self._buf is not None and len(self._buf) != nbytes:
                drop, self._buf = self._buf, None
            start = nbytes > 0 and self._buf is None and not self._making
            if start:
                self._making = True
            gone = [self._maps.pop(n) for n in list(self._maps) if n not in self._slots]
            self._unmapped &= set(self._slots)
            todo = any(n not in self._maps and n not in self._unmapped for n in self._slots)
            mapping = todo and not self._mapping
            if mapping:
                self._mapping = True
        if drop is not None:
            _free(drop)
        if gone:
            self._close(gone)
        if start:
            threading.Thread(target=self._run, name="tierswap-reserve", daemon=True).start()
        if mapping:
            threading.Thread(target=self._map_all, name="tierswap-slot-maps", daemon=True).start()

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

    def _map_all(self) -> None:
        """Map each slot named and not mapped, one at a time, until none is left."""
        try:
            pin_thread(helper_cpus())
            while True:
                with self._cond:
                    done = self._maps.keys() | self._unmapped
                    todo = [n for n in self._slots if n not in done]
                    if not todo:
                        self._mapping = False
                        return
                name = todo[0]
                got = self._map(SHM_DIR / name)
                with self._cond:
                    if got is None:
                        self._unmapped.add(name)
                    elif name in self._slots and name not in self._maps:
                        self._maps[name], got = got, None
                if got is not None:  # no longer named meanwhile
                    got.close()
        except Exception as e:  # a restore maps its slot itself
            print(f"[tierswap] slots not mapped ahead: {e}", file=sys.stderr)
            with self._cond:
                self._mapping = False

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

    def take_map(self, name: str) -> ReadMap | None:
        """The tier-0 slot ``name`` mapped ahead, if it is (one being mapped is not waited
        for); it stays mapped until :meth:`let_go`, and is read only until then."""
        with self._cond:
            self._slots = ()  # a restore has begun: nothing more is mapped
            got = self._maps.pop(name, None)
            if got is not None:
                self._spent.append(got)
        return got

    def held(self) -> int:
        """Bytes held ready now."""
        with self._cond:
            return 0 if self._buf is None else len(self._buf)

    def mapped(self) -> list[str]:
        """The slots mapped ahead now."""
        with self._cond:
            return sorted(self._maps)

    def hold_off(self) -> None:
        """A restore is over with what it took: hold nothing more ready while the state
        trains (the agent asks again at the next park); the mappings are unmapped at
        :meth:`let_go`, not now (those of slots gone meanwhile now: they hold the slot's
        memory)."""
        with self._cond:
            maps, self._maps = list(self._maps.values()), {}
        gone = [m for m in maps if not m.current()]
        with self._cond:
            self._spent.extend(m for m in maps if m not in gone)
        if gone:
            self._close(gone)
        self.want(0)

    def let_go(self) -> None:
        """Unmap what restores took or let go of, on a thread: the way back is over."""
        with self._cond:
            spent, self._spent = self._spent, []
        if spent:
            self._close(spent)

    def _close(self, maps: list[ReadMap]) -> None:
        def close() -> None:
            with contextlib.suppress(OSError):
                pin_thread(helper_cpus())
            for m in maps:
                try:
                    m.close()
                except Exception as e:  # the others are still unmapped
                    print(f"[tierswap] unmapping {m.path}: {e}", file=sys.stderr)

        threading.Thread(target=close, name="tierswap-unmap", daemon=True).start()

    def close(self) -> None:
        self.want(0)
        self.let_go()

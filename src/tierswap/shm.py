"""Shared-memory segments: files in /dev/shm mapped by the agent and its workers.

The agent creates and owns them, so a snapshot outlives a worker crash; a node's death
takes them away (the launcher unlinks what a killed agent left). Pages are populated at
creation and at attach, so the first snapshot does not pay page faults on the hot path.
Where the launcher died too (a host's processes killed, the machine not: an OOM kill, a
scheduler's SIGKILL), the next agent on the machine unlinks them (:class:`Owner`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
PREFIX = "tierswap-"


class Segment:
    """One mapped segment. ``create`` makes and touches it; ``attach`` maps an existing one."""

    def __init__(self, path: Path, size: int, mm: mmap.mmap) -> None:
        self.path = path
        self.size = size
        self._mm: mmap.mmap | None = mm
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            # Reserve the pages now: on tmpfs a full /dev/shm would otherwise surface as
            # SIGBUS in a worker at its first snapshot, not as an error here.
            os.posix_fallocate(fd, 0, size)
            mm = _mapped(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(path, size, mm)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(f"shared memory {path} holds {actual} bytes, expected {size}")
            mm = _mapped(fd, size)
        finally:
            os.close(fd)
        return cls(path, size, mm)

    def close(self) -> None:
        """Unmap. Tensors made with ``torch.frombuffer`` do not pin the mapping: drop every
        view into ``buf`` before closing."""
        if self._mm is None:
            return
        self.buf.release()
        try:
            self._mm.close()
        except BufferError:  # a tensor still aliases it; the mapping goes with the process
            return
        self._mm = None

    def unlink(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


MADV_POPULATE_WRITE = 23
STRIDE = 16 << 20
"""Bytes faulted in per call. CPython holds the GIL through ``mmap.madvise`` and through
``mmap(MAP_POPULATE)``: faulting a whole slot in at once stopped every other thread of
the process for as long as the kernel took (0.45 s a GiB in 4 KiB pages here, 9 s a
GiB in huge pages on a fragmented day), an agent's heartbeat among them. A stride at a
time, the other threads run between calls."""


def fault_in(m: mmap.mmap, nbytes: int, stride: int = STRIDE, huge: bool = False) -> None:
    """Fault the first ``nbytes`` of ``m`` in, ``stride`` bytes per call, yielding between
    calls (OSError where the kernel has no ``MADV_POPULATE_WRITE``, before 5.14).

    With ``huge`` (private memory advised ``MADV_HUGEPAGE``): in transparent huge pages
    while they come faster than 4 KiB pages. They are usually three times faster to fault
    in, but where the host's memory is fragmented the kernel compacts memory to make each
    one (``defrag=madvise``), and they came twenty times slower here, the slowdown setting
    in part way through a call. So the second stride is made in 4 KiB pages, as a trial,
    and once a stride of huge pages takes longer than that one did, the rest is made in
    4 KiB pages."""
    stride = max(stride, mmap.PAGESIZE) // mmap.PAGESIZE * mmap.PAGESIZE
    watch = huge and nbytes >= 3 * stride
    huge_s = small_s = 0.0
    for i, start in enumerate(range(0, nbytes, stride)):
        n = min(stride, nbytes - start)
        if watch and i == 1:
            m.madvise(mmap.MADV_NOHUGEPAGE, start, n)  # the trial of 4 KiB pages
        t0 = time.perf_counter()
        m.madvise(MADV_POPULATE_WRITE, start, n)
        took = time.perf_counter() - t0
        if watch:
            if i == 1:
                small_s = took
            else:
                huge_s = took
            rest = nbytes - start - n
            if i >= 1 and huge_s > small_s and rest > 0:
                m.madvise(mmap.MADV_NOHUGEPAGE, start + n, rest)
                watch = False  # 4 KiB pages from here on
        time.sleep(0)


def _mapped(fd: int, size: int) -> mmap.mmap:
    """``fd`` mapped shared, its pages faulted in a stride at a time (all at once, holding
    the GIL, on a kernel without ``MADV_POPULATE_WRITE``)."""
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    try:
        fault_in(m, size)
    except OSError:
        m.close()
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    return m


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MADV_POPULATE_READ = 22
"""Fill a mapping's page tables from the pages there already (Linux 5.14)."""


def _madvise(mm: mmap.mmap, advice: int, stride: int = 0) -> int:
    """``madvise`` over all of ``mm``, ``stride`` bytes per call (0: one call), through
    libc by ctypes: the GIL is let go (Python's ``mmap.madvise`` holds it), and between
    calls the process's memory map too, which filling or emptying page tables holds (the
    other threads' allocations wait on it). 0, or the errno of the call that failed."""
    if len(mm) == 0:
        return 0
    view = np.frombuffer(mm, dtype=np.uint8)
    addr = int(view.ctypes.data)
    del view  # (an export of the mapping would keep it from closing)
    stride = max(stride, mmap.PAGESIZE) // mmap.PAGESIZE * mmap.PAGESIZE if stride else len(mm)
    for start in range(0, len(mm), stride):
        if _libc.madvise(addr + start, min(stride, len(mm) - start), advice) != 0:
            return ctypes.get_errno() or errno.EINVAL
    return 0


_populate_read = True
"""Whether the kernel fills page tables on ``MADV_POPULATE_READ`` (5.14 on); where it does
not, a :class:`ReadMap` is mapped with ``MAP_POPULATE`` instead (the GIL held)."""


class ReadMap:
    """A file mapped read-only and shared, its page tables filled at once, and unmapped
    with them emptied first, both through libc so that the GIL is let go: Python's
    ``mmap`` holds it through ``MAP_POPULATE`` and through unmapping, 27 ms and 13 ms for
    a 384 MiB slot here, every other thread of the process stopped meanwhile (a
    restore's model being built, say). It may be closed by one thread while another
    reads it: a view made before holds the mapping (emptied page tables fill again as it
    is read, from the same file), and :meth:`view` after says it is gone."""

    def __init__(self, path: Path, nbytes: int | None = None, stride: int = 0) -> None:
        """``path`` mapped, its first ``nbytes`` (all of it by default; ValueError where it
        holds fewer); OSError where it cannot be. ``stride``: bytes filled per call (0:
        all in one, the quickest; a stride lets other threads map memory meanwhile)."""
        global _populate_read
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            size = st.st_size if nbytes is None else nbytes
            if st.st_size < size:
                raise ValueError(f"{path} holds {st.st_size:,} bytes, not {size:,}")
            mm = None
            if size and _populate_read:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                if _madvise(mm, MADV_POPULATE_READ, stride) == errno.EINVAL:
                    _populate_read = False  # an older kernel
                    mm.close()
                    mm = None
            if size and mm is None:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.path, self.size, self.mm, self.stride = path, size, mm, stride
        self.ident = (st.st_dev, st.st_ino)
        """Which file it maps: one made anew in the same name is another (while this maps
        the old one, its inode is not free to be reused)."""

    def view(self) -> memoryview | None:
        """Its bytes (a view holds the mapping until released), or None once closed."""
        mm = self.mm
        if self.size == 0:
            return memoryview(b"")
        try:
            return None if mm is None else memoryview(mm)
        except ValueError:  # closed meanwhile
            return None

    def current(self) -> bool:
        """Whether its path is still the file mapped (not gone, not made anew)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def close(self) -> None:
        """Unmap (where a view of it is still held, once that is released)."""
        mm, self.mm = self.mm, None
        if mm is None:
            return
        try:
            _madvise(mm, mmap.MADV_DONTNEED, self.stride)  # page tables emptied, not the file
            mm.close()
        except BufferError:  # a view is still held: the mapping goes with it
            pass


def populated(nbytes: int, stride: int = STRIDE) -> memoryview:
    """Private memory with its pages faulted in up front, so reading or receiving a
    restore into it does not take a page fault every 4 KiB: in transparent huge pages
    where the kernel gives them fast (:func:`fault_in`), ``stride`` bytes per call."""
    if nbytes == 0:
        return memoryview(bytearray())
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        fault_in(m, nbytes, stride, huge=True)
    except (OSError, AttributeError):
        m.close()
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        m = mmap.mmap(-1, nbytes, flags=flags)
    return memoryview(m)


class SegmentPool:
    """Segments made ahead, on a thread of their own, for snapshots that will come: a
    parked spare host makes the slots and replica rings a node of the job holds, so that
    taking over a node allocates nothing (making 3 GiB of shared memory took 5 s on a
    loaded 2-core machine, all of it in the new node's first step).

    ``create`` is the factory the rings are given: a made segment of the size asked for
    is renamed and handed out, one still being made is waited for, and any other size is
    made at once, as without a pool. A segment is made ahead only if, with it and the rest
    still to be made, a tenth of the shared-memory folder stays free (several simulated
    hosts share one machine's): a spare never takes the last of it from the members, who
    make their segments when they need them; ``report`` hears why one was not made."""

    def __init__(self, job_id: str, report: Callable[[str], None] | None = None) -> None:
        self.job_id = job_id
        self.report = report
        self._want: Counter[int] = Counter()
        self._ready: dict[int, list[Segment]] = {}
        self._todo: list[int] = []
        """Sizes still to be made, in order."""
        self._making: int | None = None
        self._running = False
        """A thread is making segments (cleared by it, under the lock, as it ends)."""
        self._cond = threading.Condition()
        self._names = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def warm(self, sizes: list[int]) -> None:
        """Hold segments of exactly these sizes (a multiset): missing ones are made in
        the background, ones no longer wanted unlinked now (or, being made, once made)."""
        drop: list[Segment] = []
        with self._cond:
            self._want = Counter(sizes)
            have = Counter({n: len(segs) for n, segs in self._ready.items()})
            have.update(self._todo)
            if self._making is not None:
                have[self._making] += 1
            for size, extra in (have - self._want).items():
                for _ in range(extra):
                    if size in self._todo:
                        self._todo.remove(size)
                    elif self._ready.get(size):
                        drop.append(self._ready[size].pop())
            self._todo += list((self._want - have).elements())
            if self._todo and not self._running and not self._closed:
                self._running = True
                self._thread = threading.Thread(
                    target=self._make, name="tierswap-warm", daemon=True
                )
                self._thread.start()
        for seg in drop:
            seg.unlink()

    def wait(self, timeout: float) -> bool:
        """Until every segment asked for is made (or could not be); False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running, timeout)

    def held(self) -> int:
        """Bytes made and not handed out."""
        with self._cond:
            return sum(n * len(segs) for n, segs in self._ready.items())

    def create(self, name: str, size: int) -> Segment:
        with self._cond:
            while True:
                if segs := self._ready.get(size):
                    seg: Segment | None = segs.pop()
                    self._want[size] -= 1
                    break
                if self._making == size:  # being made: sooner than making another
                    self._cond.wait()
                    continue
                if size in self._todo:
                    self._todo.remove(size)  # not begun: made here, now
                    self._want[size] -= 1
                seg = None
                break
        if seg is None:
            return Segment.create(name, size)
        path = SHM_DIR / name
        os.rename(seg.path, path)
        seg.path = path
        return seg

    def _room(self, size: int) -> str | None:
        """Why a segment of ``size`` is not made now, or None."""
        st = os.statvfs(SHM_DIR)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        with self._cond:
            rest = sum(self._todo)
        if free - size - rest < total // 10:
            return (
                f"{SHM_DIR} has {free:,} of {total:,} bytes free; making {size + rest:,} "
                "more for a spare would leave less than a tenth of it for the job's members"
            )
        return None

    def _make(self) -> None:
        while True:
            with self._cond:
                if self._closed or not self._todo:
                    self._running = False
                    self._cond.notify_all()
                    return
                size = self._making = self._todo.pop(0)
            seg: Segment | None = None
            why = None
            try:
                why = self._room(size)
                if why is None:
                    name = f"{PREFIX}{self.job_id}-p{os.getpid()}-warm{next(self._names)}"
                    seg = Segment.create(name, size)
            except Exception as e:  # a full /dev/shm: the rings make the segment later
                why = f"{type(e).__name__}: {e}"
            finally:
                with self._cond:
                    self._making = None
                    keep = (
                        seg is not None
                        and not self._closed
                        and len(self._ready.get(size, [])) + self._todo.count(size)
                        < self._want[size]
                    )
                    if keep and seg is not None:
                        self._ready.setdefault(size, []).append(seg)
                    if why is not None:
                        self._todo.clear()  # the rest would not fit either
                    self._cond.notify_all()
            try:
                if seg is not None and not keep:
                    seg.unlink()  # no longer wanted while it was made, or the pool closed
                if why is not None and self.report is not None:
                    self.report(why)
            except Exception as e:  # the thread goes on: _running must be cleared by it
                print(f"[tierswap] making segments ahead: {e}", file=sys.stderr)

    def close(self) -> None:
        """Unlink every segment made and not handed out; stop making more."""
        with self._cond:
            self._closed = True
            self._todo.clear()
            segs = [seg for group in self._ready.values() for seg in group]
            self._ready.clear()
            self._cond.notify_all()
            thread = self._thread
        for seg in segs:
            seg.unlink()
        if thread is not None:
            thread.join(timeout=30)  # one being made is unlinked by the thread itself


def segment_name(job_id: str, rank: int, slot: int, alloc: int) -> str:
    """Unique per agent process, so a node started in a dead one's place never collides."""
    return f"{PREFIX}{job_id}-p{os.getpid()}-r{rank:05d}-s{slot}-a{alloc}"


OWNER = "owner"


class Owner:
    """This agent's claim on the segments named with its pid (:func:`segment_name`): a file
    of their prefix, ending in :data:`OWNER`, that it holds an ``flock`` on for its life.
    The kernel lets the lock go when the process dies, however it dies, so a later agent
    knows the segments for leftovers (:func:`sweep_dead`), even one in another PID
    namespace that shares this /dev/shm (where a pid could not be checked). No claim is
    made where the file cannot be (another user's file of that name): the segments are
    then only the launcher's to unlink, as before."""

    def __init__(self, job_id: str) -> None:
        self.path = SHM_DIR / f"{PREFIX}{job_id}-p{os.getpid()}-{OWNER}"
        self._fd: int | None = None
        new = self.path.with_name(self.path.name + ".new")
        with contextlib.suppress(OSError):
            fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # locked before any sweep can see the name
            try:
                os.link(new, self.path)  # (never over a claim of that name: EEXIST)
            except OSError:
                os.close(fd)
                return
            finally:
                new.unlink(missing_ok=True)
            self._fd = fd

    def close(self) -> None:
        """Let the claim go, with whatever of its segments is still there (the agent is
        done with them all: one whose shutdown failed midway left some)."""
        if self._fd is not None:
            for path in _claimed(self.path):
                path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def _claimed(owner: Path) -> list[Path]:
    """The files of an owner file's prefix, itself among them."""
    return list(SHM_DIR.glob(owner.name[: -len(OWNER)] + "*"))


def sweep_dead() -> int:
    """Unlink what tierswap agents that died on this machine left in /dev/shm: for each
    :class:`Owner` file of this user's that no process holds locked, every file of its
    prefix. Segments without an owner file are never touched. Returns how many went."""
    n = 0
    for owner in SHM_DIR.glob(f"{PREFIX}*-{OWNER}"):
        try:
            fd = os.open(owner, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: its agent lives
            for seg in _claimed(owner):
                if seg.name != owner.name:
                    with contextlib.suppress(OSError):  # (not ours to unlink after all)
                        seg.unlink()
                        n += 1
            with contextlib.suppress(OSError):
                if os.stat(owner).st_ino == st.st_ino:  # (not a new claim of that name)
                    owner.unlink()
        finally:
            os.close(fd)
    return n


def remove_job_segments(job_id: str, pid: int | None = None) -> int:
    """Unlink the segments of a job, or of one of its agents (what a SIGKILLed agent could
    not). Returns the count."""
    n = 0
    owner = "*" if pid is None else f"p{pid}"
    for p in SHM_DIR.glob(f"{PREFIX}{job_id}-{owner}-*"):
        p.unlink(missing_ok=True)
        n += 1
    return n

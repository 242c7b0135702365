"""Shared-memory segments: files in /dev/shm mapped by the agent and its workers.

The agent creates and owns them, so a snapshot outlives a worker crash; a node's death
takes them away (the launcher unlinks what a killed agent left). Pages are populated at
creation and at attach, so the first snapshot does not pay page faults on the hot path.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

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
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
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
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
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
"""Linux 5.14+: fault a range in, writable, in one call (not named by Python 3.11)."""


def populated(nbytes: int) -> memoryview:
    """Private memory with its pages faulted in up front, so reading or receiving a
    restore into it does not take a page fault every 4 KiB. Transparent huge pages where
    the kernel gives them: 256 MiB is ready in about a third of the time of 4 KiB pages
    (``MAP_POPULATE``, the fallback on older kernels)."""
    if nbytes == 0:
        return memoryview(bytearray())
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        m.madvise(MADV_POPULATE_WRITE)
    except (OSError, AttributeError):
        m.close()
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        m = mmap.mmap(-1, nbytes, flags=flags)
    return memoryview(m)


def segment_name(job_id: str, rank: int, slot: int, alloc: int) -> str:
    """Unique per agent process, so a node started in a dead one's place never collides."""
    return f"{PREFIX}{job_id}-p{os.getpid()}-r{rank:05d}-s{slot}-a{alloc}"


def remove_job_segments(job_id: str, pid: int | None = None) -> int:
    """Unlink the segments of a job, or of one of its agents (what a SIGKILLed agent could
    not). Returns the count."""
    n = 0
    owner = "*" if pid is None else f"p{pid}"
    for p in SHM_DIR.glob(f"{PREFIX}{job_id}-{owner}-*"):
        p.unlink(missing_ok=True)
        n += 1
    return n

"""A tier-2 store that fails on command, for tests that break tier 2 in-process.

fsspec is tier 2's storage interface (``tiers/files.py``: ``url_fs`` picks the filesystem
by URL scheme); this registers one more scheme, ``faulty://``, an in-memory fsspec
filesystem whose writes can be made to fail, to fill up (ENOSPC past a capacity), or to
stall, and whose reads can be made to fail, as a full disk, a dead NFS server or a
throttled bucket would. It lives in one process (fsspec's memory store), so it is for
in-process tests of the code above the store: the writer's temporary names, COMMIT
written last, retention, the coordinator's ``durability_failing``.
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

SCHEME = "faulty"


@dataclass(slots=True)
class Faults:
    """What the ``faulty://`` store does wrong; change it at any time."""

    capacity: int | None = None
    """Bytes the store holds before a write fails with ENOSPC (None: no limit)."""
    fail_writes: bool = False
    """Every write fails (EIO), as on a store that went away."""
    fail_reads: bool = False
    stall_s: float = 0.0
    """Seconds each write waits first (a slow or throttled store)."""
    fail_names: tuple[str, ...] = ()
    """A write whose path contains one of these fails (EIO): ``("COMMIT",)`` fails the
    commit record only."""

    def reset(self) -> None:
        self.capacity, self.fail_writes, self.fail_reads = None, False, False
        self.stall_s, self.fail_names = 0.0, ()


FAULTS = Faults()


class FaultyFileSystem(MemoryFileSystem):  # type: ignore[misc]
    protocol = SCHEME
    root_marker = "/"
    store: ClassVar[dict[str, Any]] = {}
    """Its own files, apart from ``memory://``'s."""
    pseudo_dirs: ClassVar[list[str]] = [""]

    def used(self) -> int:
        return sum(len(f.getbuffer()) for f in self.store.values())

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode and FAULTS.fail_reads:
            raise OSError(errno.EIO, f"faulty://{path}: read failed (injected)")
        if "w" in mode or "a" in mode:
            if FAULTS.stall_s:
                time.sleep(FAULTS.stall_s)
            if FAULTS.fail_writes or any(n in path for n in FAULTS.fail_names):
                raise OSError(errno.EIO, f"faulty://{path}: write failed (injected)")
            f = super()._open(path, mode, **kwargs)
            write, written = f.write, [0]

            def bounded(data: Any) -> int:
                need = self.used() + written[0] + len(data)
                if FAULTS.capacity is not None and need > FAULTS.capacity:
                    raise OSError(errno.ENOSPC, f"faulty://{path}: no space left (injected)")
                n: int = write(data)
                written[0] += n
                return n

            f.write = bounded
            return f
        return super()._open(path, mode, **kwargs)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if FAULTS.fail_reads:
            raise OSError(errno.EIO, f"faulty://{path}: read failed (injected)")
        return super().cat_file(path, *args, **kwargs)


def install() -> Faults:
    """Register ``faulty://`` with fsspec (idempotent) and return its fault switches."""
    fsspec.register_implementation(SCHEME, FaultyFileSystem, clobber=True)
    return FAULTS


def wipe() -> None:
    """Empty the store and clear every fault."""
    FaultyFileSystem.store.clear()
    FaultyFileSystem.pseudo_dirs[:] = [""]
    FAULTS.reset()

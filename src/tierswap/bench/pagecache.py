"""A file's pages in this kernel's page cache: drop them, and count how many are left.

A replacement node reads its tier-2 part with a cold cache; ``drop`` makes a file that
was just written look like that (its pages are clean after the fsync, so the kernel can
let them go), and ``resident`` says whether it did. Caches below the kernel (the disk's,
a hypervisor's) are not touched.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def drop(path: Path) -> None:
    """Write back and evict ``path``'s pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path: Path) -> float:
    """The fraction of ``path``'s pages in the page cache (``mincore`` of a mapping that
    is never touched, so it brings nothing in)."""
    size = path.stat().st_size
    if size == 0:
        return 0.0
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path}: {os.strerror(err)}")
        try:
            if _libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore of {path}: {os.strerror(err)}")
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec) / pages


def filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on (``ext4``, ``tmpfs``...), from /proc/mounts."""
    best, kind = "", "unknown"
    target = str(path.resolve())
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind

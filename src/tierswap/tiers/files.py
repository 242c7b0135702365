"""Low-level file I/O for the durable tier: atomic writes, syncs and exact reads.

Every write goes to a temporary name next to its target, is synced and renamed, so a crash
leaves either the old file or the new one, never half of one. Local paths get ``fsync`` of
the file and its folder; an object store's upload is written to its name directly (an
object appears whole or not at all); other fsspec backends get a write then a move.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import posixpath
import secrets
import stat
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tierswap.errors import CorruptPartError

log = logging.getLogger(__name__)

IO_CHUNK = 64 << 20
"""Bytes per read or write call."""
_SMALL = 1 << 20  # pieces smaller than this are coalesced before writing

Piece = bytes | bytearray | memoryview


class Reader(Protocol):
    """A binary file opened for reading (a local file or an fsspec one)."""

    def readinto(self, buffer: memoryview, /) -> int | None: ...


OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az"})
"""fsspec protocols of object stores: an object appears whole when its upload completes
(a multipart one included), and there is no rename (a move is a copy)."""


def url_fs(root: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``root`` and the path inside it (no trailing slash). An
    object store's listings are never cached: other processes of the job write the root
    (agents the parts, the coordinator COMMIT and the lease), and a cached listing would
    hide what they wrote."""
    protocol = fsspec.core.split_protocol(root)[0]
    options = {"use_listings_cache": False} if protocol in OBJECT_STORES else {}
    fs, path = fsspec.core.url_to_fs(root, **options)
    return fs, str(path).rstrip("/") or "/"


def is_local(fs: Any) -> bool:
    """True for the local filesystem, where files and folders can be fsynced."""
    return isinstance(fs, LocalFileSystem)


def is_object_store(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    return bool(OBJECT_STORES.intersection(protocols))


def fsync_dir(path: str) -> None:
    """Sync a local folder, so the names renamed into it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems cannot sync a directory; rename is all they have
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
        log.debug("cannot fsync directory %s: %s", path, e)
    finally:
        os.close(fd)


def _coalesce(pieces: Iterable[Piece]) -> Iterator[bytes | memoryview]:
    """Large pieces as they are, runs of small ones joined, so each write is large."""
    staging = bytearray()
    for p in pieces:
        mv = memoryview(p).cast("B")
        if len(mv) >= _SMALL:
            if staging:
                yield bytes(staging)
                staging.clear()
            yield mv
        else:
            staging += mv
            if len(staging) >= _SMALL:
                yield bytes(staging)
                staging.clear()
    if staging:
        yield bytes(staging)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv[:IO_CHUNK]) :]


def _tmp_name(name: str) -> str:
    return f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def write_local(path: str, pieces: Iterable[Piece]) -> None:
    """Write ``pieces`` to the local ``path``: temporary file, fsync, rename, fsync folder."""
    parent, name = os.path.split(path)
    tmp = os.path.join(parent, _tmp_name(name))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            for piece in _coalesce(pieces):
                _write_all(fd, piece)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(parent or ".")


def write_atomic(fs: Any, path: str, pieces: Iterable[Piece]) -> None:
    """Write ``pieces`` to ``path`` through a temporary name, so readers never see half."""
    if is_local(fs):
        write_local(path, pieces)
        return
    if is_object_store(fs):  # readers see the object once its upload completes, never half
        f = fs.open(path, "wb")
        try:
            for piece in _coalesce(pieces):
                f.write(piece)
        except BaseException:
            f.discard()  # the upload is aborted: nothing appears under the name
            f.closed = True  # (closing it now would complete the upload with what it has)
            raise
        f.close()
        return
    parent, name = posixpath.split(path)
    tmp = f"{parent}/{_tmp_name(name)}"
    try:
        with fs.open(tmp, "wb") as f:
            for piece in _coalesce(pieces):
                f.write(piece)
        fs.mv(tmp, path)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise


def regular_file(fs: Any, path: str, limit: int) -> int:
    """The size of ``path`` when it is a regular file inside its folder (no symbolic link,
    no FIFO or device, which a read could follow out of the root or block on) of at most
    ``limit`` bytes, checked before anything is read or allocated. Raises
    CorruptPartError naming the file and what is wrong with it."""
    try:
        if is_local(fs):
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                raise CorruptPartError(path, "is a symbolic link (tier 2 follows none)")
            if not stat.S_ISREG(st.st_mode):
                raise CorruptPartError(path, "is not a regular file")
            size = st.st_size
        else:
            info = fs.info(path)
            if info.get("type") != "file":
                raise CorruptPartError(path, "is not a file")
            size = int(info.get("size") or 0)
    except FileNotFoundError:
        raise CorruptPartError(path, "missing") from None
    except OSError as e:
        raise CorruptPartError(path, f"cannot read: {e}") from e
    if size > limit:
        raise CorruptPartError(path, f"is {size:,} bytes, more than the {limit:,} allowed")
    return int(size)


def is_folder(fs: Any, path: str) -> bool:
    """Whether ``path`` is a folder of its own (a symbolic link to one is not: tier 2
    never follows one out of its root)."""
    if is_local(fs):
        try:
            return stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:
            return False
    return bool(fs.isdir(path))


def read_small(fs: Any, path: str, limit: int = 64 << 20) -> bytes:
    """A whole small file of at most ``limit`` bytes; CorruptPartError naming ``path`` if
    it is missing, unreadable, too large or not a regular file."""
    regular_file(fs, path, limit)
    try:
        data = bytes(fs.cat_file(path))
    except FileNotFoundError:
        raise CorruptPartError(path, "missing") from None
    except OSError as e:
        raise CorruptPartError(path, f"cannot read: {e}") from e
    if len(data) > limit:  # it grew between the check and the read
        raise CorruptPartError(path, f"is more than the {limit:,} bytes allowed")
    return data


def parse_json(path: str, raw: bytes) -> Any:
    """``raw`` parsed; CorruptPartError for bytes that are not JSON or nest too deeply (a
    RecursionError would crash every reader)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise CorruptPartError(path, "JSON nested too deeply") from None
    except ValueError as e:
        raise CorruptPartError(path, f"not JSON: {e}") from e


def open_read(fs: Any, path: str) -> Any:
    """``path`` opened for reading; local files unbuffered (reads go straight to the target)."""
    return open(path, "rb", buffering=0) if is_local(fs) else fs.open(path, "rb")


def read_exact(f: Reader, out: memoryview) -> None:
    """Fill ``out`` from ``f``; EOFError if the file ends first."""
    while out:
        got = f.readinto(out[:IO_CHUNK])
        if not got:
            raise EOFError
        out = out[got:]


def stream(f: Reader, nbytes: int) -> Iterator[memoryview]:
    """Read ``nbytes`` through one reused buffer (each chunk is valid until the next)."""
    scratch = memoryview(bytearray(min(nbytes, IO_CHUNK)))
    while nbytes:
        view = scratch[: min(nbytes, len(scratch))]
        read_exact(f, view)
        nbytes -= len(view)
        yield view

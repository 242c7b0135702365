"""Copying a rank's state into a slot at the speed of a plain memcpy, checksummed on the way.

The snapshot's copy is one pass per byte: a CPU tensor is copied by libc's ``memmove`` in
chunks, and each chunk is hashed from the *source* just before it is copied, so that the
copy reads it from the core's cache and the checksum costs no second trip to memory.
Three things make that pass close to a memcpy of the whole tensor:

- libc's memmove, not torch's ``copy_``: one core here moves 384 MiB in 29-31 ms with
  the former and in 55 ms with the latter (torch's loop writes through the cache).
- Non-temporal stores for each chunk. glibc writes copies of at least
  ``x86_non_temporal_threshold`` bytes around the cache, so the destination's lines are
  not first read in to be overwritten; below it, every line written is read first (a
  third of the traffic more). The threshold's default is derived from the last-level
  cache, and how depends on glibc's version (a per-thread share of it up to 2.37, a
  quarter of all of it since 2.38): from about a MiB to tens of MiB on a GPU host, and
  240 MiB on this 2-core VM, whose glibc 2.36 reads a 320 MiB shared cache from CPUID
  (sysfs says 32 MiB of L3; ``ld.so --list-tunables`` shows both). :func:`tierswap.tunables.
  nt_tunables` sets it to :data:`CHUNK` in the environment a worker starts with (libc
  reads it only then); unset, the copy is correct and about a third slower.
- The hash first, the copy after. Hashed right after it was copied, a chunk cost 41 ms
  for 384 MiB here (1.66x a whole memmove's 25 ms); hashed right before, 28 ms (1.1x).
  In training jobs (``bench/hash-first-copy-ab-2026-12-06.json``, 4 alternated rounds)
  the copy's CPU per GiB fell from 1.45x to 1.19x a memcpy's, 1.57x to 1.18x pinned.

Measured here before that, one core, 384 MiB: a whole memmove 29-31 ms; chunks of 1 MiB
hashed after their copy 40-42 ms with the threshold at 1 MiB and 58-64 ms without it;
torch's chunked ``copy_`` hashed from the destination (the copy before 12-05) 72 ms.
Chunks of 256 KiB (fit in L2 twice over) were faster alone, 35 ms, but slower in a
training job (step overhead 18 % against 13 %,
``bench/chunk256-copy-ab-2026-12-06.json``): four times the calls, each giving up the
GIL and taking it back from the trainer. Chunks of 4 MiB (in L3, not L2) cost the same
alone, 29.7 ms against 29.8 ms, with a quarter of the calls, but gained nothing in jobs
either (``bench/chunk4m-copy-ab-2026-12-06.json``, 3 alternated rounds: the copy's CPU
per GiB 0.108 against 0.112 s at tier 0, 0.113 against 0.106 s with tiers 0+1 pinned;
the step overheads' spread, -14 to +97 %, hid any difference).

The checksum is of the bytes the hash read, which the copy reads next. A deferred
tensor is one only ``optimizer.step()`` changes, and that step waits for the copy
(``fence``); a loop that writes one anyway while it is copied (an in-place change of a
parameter outside the optimizer) leaves a slot whose bytes may not match its checksum,
and every reader of it (a peer's replica, a restore) rejects it as corrupt instead of
restoring a torn state.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from tierswap.tunables import COPY_CHUNK

CHUNK = COPY_CHUNK
"""Bytes hashed, then copied, at a time: small enough that they are still in the core's
cache when the copy reads them, large enough that the two calls per chunk cost little.
``xxhash`` before 4.1 ran xxh3's SSE2 code only (27 GiB/s here even from L2,
``bench/hash_floor.py``); 4.1 picks AVX2 or AVX-512 at run time (55 GiB/s here)."""

SMALL = 64 << 10
"""Below this many bytes a tensor is copied by torch and hashed from the slot: the ctypes
calls of the byte path cost more than the copy (9 µs against 1.2 µs a tensor of 256 B)."""


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _bytes_like(t: torch.Tensor) -> bool:
    """A plain strided CPU tensor (or Parameter) whose memory holds its values as they are:
    no lazy conjugate or negation, no wrapper subclass."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and not (t.is_conj() or t.is_neg())
        and t.is_contiguous()
    )


def tensor_bytes(t: torch.Tensor) -> memoryview | None:
    """The bytes of a plain, contiguous CPU tensor (:func:`_bytes_like`) as they are in
    its memory, without a copy; None for any other tensor."""
    return _raw(t) if _bytes_like(t) else None


def plain(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src`` can be copied into ``dst`` as bytes: both plain, contiguous CPU
    tensors of the same dtype and shape (:func:`_bytes_like`)."""
    return (
        src.dtype == dst.dtype and src.shape == dst.shape and _bytes_like(src) and _bytes_like(dst)
    )


def copy_hashing(dst: torch.Tensor, src: torch.Tensor, raw: memoryview, digest: Any) -> None:
    """``dst.copy_(src)``, with ``dst``'s new bytes hashed into ``digest`` (``raw`` is
    ``dst``'s memory): chunk by chunk, each hashed from ``src`` right before it is
    copied (the same bytes: the slot then holds what was hashed)."""
    if len(raw) < SMALL or not plain(dst, src):  # small, a view, a cast, a GPU tensor:
        dst.copy_(src)  # torch copies, then the hash reads the slot
        digest.update(raw)
        return
    copy_bytes_hashing(raw, _raw(src), digest)


def _address(buf: memoryview) -> int:
    """Where a contiguous buffer's bytes are (read-only ones too: a mapped tier-0 slot)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0


def copy_bytes_hashing(dst: memoryview, src: memoryview, digest: Any) -> None:
    """``dst[:] = src`` by libc's memmove, chunk by chunk, each chunk hashed into
    ``digest`` from ``src`` right before it is copied (the copy then reads it from
    cache)."""
    n = src.nbytes
    if dst.nbytes != n:
        raise ValueError(f"copy of {n} bytes into {dst.nbytes}")
    if dst.readonly:
        raise ValueError("copy into a read-only buffer")
    src, dst = src.cast("B"), dst.cast("B")
    s, d = _address(src), _address(dst)
    for start in range(0, n, CHUNK):
        size = min(CHUNK, n - start)
        digest.update(src[start : start + size])
        ctypes.memmove(d + start, s + start, size)


def memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A plain memcpy of ``src``'s bytes into ``dst`` (both contiguous CPU tensors of the
    same size in bytes): what the bench takes as the machine's copy speed."""
    n = src.numel() * src.element_size()
    if dst.numel() * dst.element_size() != n or not (_bytes_like(src) and _bytes_like(dst)):
        raise ValueError("memcpy wants two contiguous CPU tensors of the same size in bytes")
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)

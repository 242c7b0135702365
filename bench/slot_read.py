"""Where a restore's read of one tier-0 slot goes, and what a busy Python thread does to it.

A slot of ``--size-mib`` (two float32 tensors) is made in shared memory as an agent makes
one; then, ``--rounds`` times: mapping it read-only with its page tables filled
(``MAP_POPULATE``, as ``fetch.read_slot`` did before 12-06's ``shm.ReadMap``) against the
copy with its hash in 1 MiB pieces (``memcopy.copy_bytes_hashing``), a whole ``memmove``
and a whole hash after it (the floor's two passes); and ``read_slot`` itself alone and
beside a Python thread that spins for 50 ms and for 1 s (each piece's copy and hash give
up the GIL, and take it back from a busy thread only after a switch interval). Run by the
workers' environment (``GLIBC_TUNABLES`` with the non-temporal threshold,
``tunables.nt_tunables``)::

    GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000 \\
        .venv/bin/python bench/slot_read.py --out bench/slot-read.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import threading
import time
from typing import Any

import numpy as np
import torch

from tierswap.checksum import hasher
from tierswap.fetch import read_slot
from tierswap.memcopy import copy_bytes_hashing
from tierswap.shm import PREFIX, SHM_DIR, Segment, populated
from tierswap.state import flatten, make_layout


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def _address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = args.size_mib << 20
    flat = flatten({"w": {"a": torch.randn(n // 8), "b": torch.randn(n // 8)}}, with_rng=False)
    layout = make_layout(flat)
    name = f"{PREFIX}slot-read-{os.getpid()}"
    seg = Segment.create(name, layout.nbytes)
    times: dict[str, list[float]] = {}
    try:
        for e, t in zip(layout.entries, flat.tensors, strict=True):
            seg.buf[e.offset : e.offset + e.nbytes] = memoryview(t.numpy()).cast("B")
        dst = populated(layout.nbytes)
        dests = [dst[e.offset : e.offset + e.nbytes] for e in layout.entries]
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            fd = os.open(SHM_DIR / name, os.O_RDONLY)
            flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
            mm = mmap.mmap(fd, layout.nbytes, flags=flags, prot=mmap.PROT_READ)
            os.close(fd)
            t1 = time.perf_counter()
            slot = memoryview(mm)
            digest = hasher()
            for e, d in zip(layout.entries, dests, strict=True):
                copy_bytes_hashing(d, slot[e.offset : e.offset + e.nbytes], digest)
            t2 = time.perf_counter()
            for e, d in zip(layout.entries, dests, strict=True):
                ctypes.memmove(_address(d), _address(slot[e.offset :]), e.nbytes)
            t3 = time.perf_counter()
            digest = hasher()
            for d in dests:
                digest.update(d)
            t4 = time.perf_counter()
            slot.release()
            mm.close()
            for key, s in (("map_populate", t1 - t0), ("copy_hash_1mib", t2 - t1),
                           ("memmove_whole", t3 - t2), ("hash_whole", t4 - t3)):  # fmt: skip
                times.setdefault(key, []).append(s)
            for busy in (0.0, 0.05, 1.0):
                th = threading.Thread(target=_spin, args=(busy,)) if busy else None
                if th is not None:
                    th.start()
                t0 = time.perf_counter()
                read_slot(name, layout, dests)
                times.setdefault(f"read_slot_busy_{busy:g}s", []).append(time.perf_counter() - t0)
                if th is not None:
                    th.join()
    finally:
        seg.unlink()
    summary = {
        k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
        for k, v in times.items()
    }
    out: dict[str, Any] = {
        "size_mib": args.size_mib,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "seconds": summary,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for k, v in summary.items():
        ms = [v[q] * 1000 for q in ("median", "min", "max")]
        print(f"{k:>22}: {ms[0]:7.1f} ms ({ms[1]:.1f} - {ms[2]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

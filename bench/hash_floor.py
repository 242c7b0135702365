"""The floor of a copy that checksums every byte, on one core: what the snapshot's copy
(``tierswap.memcopy``: libc's memmove in chunks, each hashed from the source while it is
in cache) is held to, against a whole memmove of the same bytes.

    GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x40000 python bench/hash_floor.py

24 tensors of 16 MiB (384 MiB, the reference model's state per rank); each method's
thread CPU time, 11 interleaved rounds (order flipped every other one, the first two left
out), medians with their min-max. The hashes: xxh3-64 (``xxhash``, tierswap's) and, where
``isal`` is installed (``pip install isal``, not a dependency of tierswap), ISA-L's CRC-32,
the fastest checksum a Python package offered here; each also alone, over 256 KiB (in the
core's L2) and over 16 MiB (past it). Writes the figures as JSON to the path given, if any.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import xxhash

try:
    from isal import isal_zlib
except ImportError:  # only xxh3 then
    isal_zlib = None

N, SIZE = 24, 16 << 20


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview((ctypes.c_char * (t.numel() * 4)).from_address(t.data_ptr())).cast("B")


def main() -> None:
    srcs = [torch.randn(SIZE // 4) for _ in range(N)]
    dsts = [torch.ones(SIZE // 4) for _ in range(N)]
    pairs = [(s.data_ptr(), _raw(s), d.data_ptr()) for s, d in zip(srcs, dsts, strict=True)]

    def whole() -> None:
        for s, _, d in pairs:
            ctypes.memmove(d, s, SIZE)

    def chunked(chunk: int, update: Callable[[memoryview], None] | None) -> Callable[[], None]:
        def run() -> None:
            for s, raw, d in pairs:
                for o in range(0, SIZE, chunk):
                    ctypes.memmove(d + o, s + o, chunk)
                    if update is not None:
                        update(raw[o : o + chunk])

        return run

    def xxh(chunk: int) -> Callable[[], None]:
        h = xxhash.xxh3_64()
        return chunked(chunk, h.update)

    def crc(chunk: int) -> Callable[[], None]:
        state = [0]

        def update(b: memoryview) -> None:
            state[0] = isal_zlib.crc32(b, state[0])

        return chunked(chunk, update)

    methods: dict[str, Callable[[], Callable[[], None]]] = {
        "memmove, whole tensors": lambda: whole,
        "memmove, 1 MiB chunks": lambda: chunked(1 << 20, None),
        "+ xxh3, 1 MiB chunks": lambda: xxh(1 << 20),
        "+ xxh3, 256 KiB chunks": lambda: xxh(256 << 10),
    }
    if isal_zlib is not None:
        methods |= {"+ crc32 (isal), 1 MiB chunks": lambda: crc(1 << 20),
                    "+ crc32 (isal), 256 KiB chunks": lambda: crc(256 << 10)}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in methods}
    items = list(methods.items())
    for r in range(11):
        for name, make in items if r % 2 else items[::-1]:
            run = make()
            c0 = time.thread_time()
            run()
            times[name].append(time.thread_time() - c0)
    base = statistics.median(times["memmove, whole tensors"][2:])
    out: dict[str, object] = {"bytes": N * SIZE, "tunables": os.environ.get("GLIBC_TUNABLES"),
                              "xxhash": xxhash.VERSION}  # fmt: skip
    for name, ts in times.items():
        ts = ts[2:]
        mid = statistics.median(ts)
        out[name] = {"median_s": mid, "min_s": min(ts), "max_s": max(ts), "vs_whole": mid / base}
        print(f"{name:32s} {mid * 1e3:6.1f} ms ({min(ts) * 1e3:.1f} - {max(ts) * 1e3:.1f})"
              f"  {mid / base:.2f}x")  # fmt: skip
    small = bytearray(os.urandom(256 << 10))
    big = _raw(srcs[0])  # 16 MiB: past the L2
    alone = {"xxh3": lambda b: xxhash.xxh3_64(b).intdigest()}
    if isal_zlib is not None:
        alone["crc32 (isal)"] = isal_zlib.crc32
    for name, fn in alone.items():
        cached = min(_timed(lambda f=fn: [f(small) for _ in range(400)]) for _ in range(5))
        memory = min(_timed(lambda f=fn: f(big)) for _ in range(5))
        gib_c, gib_m = 400 * len(small) / cached / 2**30, len(big) / memory / 2**30
        out[f"{name} alone"] = {"l2_256k_gib_s": gib_c, "past_l2_16m_gib_s": gib_m}
        print(f"{name} alone: {gib_c:.1f} GiB/s over 256 KiB, {gib_m:.1f} GiB/s over 16 MiB")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()

"""Tier 1's receive alone: 384 MiB over one loopback TCP connection into a buffer, its
checksum (xxh3) taken in one pass after the whole receive ("after", as ``tiers/peer.py``
does) or piece by piece right after each piece's receive, while in cache ("fused");
alternated, the receiving thread's CPU and wall time per replica, medians of the rounds
after the first of each.

    .venv/bin/python bench/recv_hash_ab.py > bench/recv-hash-ab-$(date +%F).json
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable

import xxhash

N = 384 << 20
SEND = 16 << 20
ROUNDS = 8


def measure(piece: int) -> dict[str, dict[str, float]]:
    src = bytearray(os.urandom(1 << 20)) * (N >> 20)
    dst = memoryview(bytearray(N))
    ref = xxhash.xxh3_64(src).hexdigest()

    def after(sock: socket.socket) -> str:
        got = 0
        while got < N:
            got += sock.recv_into(dst[got:], min(N - got, piece), socket.MSG_WAITALL)
        return xxhash.xxh3_64(dst).hexdigest()

    def fused(sock: socket.socket) -> str:
        h, got = xxhash.xxh3_64(), 0
        while got < N:
            n = sock.recv_into(dst[got:], min(N - got, piece), socket.MSG_WAITALL)
            h.update(dst[got : got + n])
            got += n
        return h.hexdigest()

    def sender(sock: socket.socket) -> None:
        view = memoryview(src)
        for _ in range(2 * ROUNDS):
            for i in range(0, N, SEND):
                sock.sendall(view[i : i + SEND])
            sock.recv(1)

    with socket.create_server(("127.0.0.1", 0)) as server:
        out = socket.create_connection(server.getsockname())
        inc, _ = server.accept()
    thread = threading.Thread(target=sender, args=(out,))
    thread.start()
    ways: dict[str, Callable[[socket.socket], str]] = {"after": after, "fused": fused}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in ways}
    try:
        for i in range(2 * ROUNDS):
            name = "after" if i % 2 == 0 else "fused"
            cpu, wall = time.thread_time(), time.perf_counter()
            if ways[name](inc) != ref:
                raise RuntimeError(f"{name}: the checksum differs")
            times[name].append((time.thread_time() - cpu, time.perf_counter() - wall))
            inc.sendall(b"k")
    finally:
        thread.join()
        inc.close()
        out.close()
    return {
        name: {
            "cpu_s": statistics.median(c for c, _ in t[1:]),
            "wall_s": statistics.median(w for _, w in t[1:]),
            "rounds": len(t) - 1,
        }
        for name, t in times.items()
    }


def main() -> int:
    res = {f"{piece >> 20} MiB pieces": measure(piece) for piece in (16 << 20, 4 << 20)}
    json.dump({"bytes": N, **res}, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

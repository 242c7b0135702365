"""What this machine can move at most, measured in the run that compares against it: a
plain memcpy (libc's, the fastest plain copy: torch's ``copy_`` of the same bytes,
measured beside it, takes 1.8x as long here), an xxh3 pass (the checksum every tier
uses), one loopback TCP stream (and its CPU, both ends), and a sequential write with
fsync. Each a median over interleaved repetitions, in bytes per second; a phase's floor
is its bytes over the limit of the way they move."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierswap.bench.common import Sample, interleave, stats
from tierswap.checksum import checksum_bytes
from tierswap.memcopy import memcpy
from tierswap.shm import populated
from tierswap.wire import send_pieces

CHUNK = 1 << 24


def _copy_once(copy: Callable[[torch.Tensor, torch.Tensor], Any], dst: torch.Tensor,
               src: torch.Tensor) -> Sample:  # fmt: skip
    t0 = time.monotonic()
    copy(dst, src)
    return {"bps": src.numel() / (time.monotonic() - t0)}


def _hash_once(buf: memoryview) -> Sample:
    t0 = time.monotonic()
    checksum_bytes(buf)
    return {"bps": len(buf) / (time.monotonic() - t0)}


class _Sink:
    """A loopback TCP server that reads what it is sent and answers one byte per stream."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.server = socket.create_server(("127.0.0.1", 0))
        self.buf = populated(min(nbytes, CHUNK))
        self.cpu = 0.0
        """The sink thread's CPU seconds for the last stream it read."""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.sock = socket.create_connection(self.server.getsockname())

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            while True:
                left = self.nbytes
                cpu0 = time.thread_time()
                while left:
                    n = conn.recv_into(self.buf, min(left, len(self.buf)))
                    if n == 0:
                        return
                    left -= n
                self.cpu = time.thread_time() - cpu0  # read by once() after the answer
                conn.sendall(b"k")

    def once(self, data: memoryview) -> Sample:
        """Its speed, and the CPU seconds per GiB both ends spent: the sending thread's
        and the sink thread's own user and system time, counted as the agents' is (where
        the kernel charges loopback's softirq work elsewhere, to both alike)."""
        t0, cpu0 = time.monotonic(), time.thread_time()
        send_pieces(self.sock, data)  # as tier 1 sends its replicas
        if self.sock.recv(1) != b"k":
            raise EOFError("the bench's loopback sink closed")
        cpu = time.thread_time() - cpu0 + self.cpu
        return {"bps": len(data) / (time.monotonic() - t0), "cpu": cpu / (len(data) / 2**30)}

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=10)
        self.server.close()


def write_fsync_once(path: Path, data: memoryview) -> Sample:
    """Write ``data`` to a new file in 16 MiB writes, fsync it, and remove it."""
    t0 = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = data
        while left:
            left = left[os.write(fd, left[:CHUNK]) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.monotonic() - t0
    path.unlink()
    return {"bps": len(data) / seconds}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several :func:`measure` results (taken between a benchmark's rounds, say) as one:
    per limit the stats of all their samples; ``nbytes`` the first's."""
    names = [k for k, v in runs[0].items()
             if isinstance(v, dict) and all(k in r for r in runs)]  # fmt: skip
    out: dict[str, Any] = {"nbytes": runs[0]["nbytes"]}
    for name in names:
        out[name] = stats([x for r in runs for x in r[name]["samples"]])
    return out


def measure(nbytes: int, repeats: int, folder: Path) -> dict[str, Any]:
    """The four limits at ``nbytes``: ``{"memcpy": stats, "xxh3": ..., "tcp": ...,
    "write_fsync": ...}`` (the stats of bytes per second), each on one core, as the jobs
    compared against them run (one torch thread per worker); ``"tcp_cpu"``, the CPU
    seconds per GiB of the TCP stream, both ends (the floor of a replica's cost: sent
    once, received once); and ``"torch_copy"``, torch's ``copy_`` of the same bytes,
    beside the memcpy it is not."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(nbytes, repeats, folder)
    finally:
        torch.set_num_threads(threads)


def _measure(nbytes: int, repeats: int, folder: Path) -> dict[str, Any]:
    src, dst = populated(nbytes), populated(nbytes)
    a = torch.frombuffer(src, dtype=torch.uint8)
    b = torch.frombuffer(dst, dtype=torch.uint8)
    a.fill_(7)
    sink = _Sink(nbytes)
    try:
        methods: dict[str, Callable[[], Sample]] = {
            "memcpy": lambda: _copy_once(memcpy, b, a),
            "torch_copy": lambda: _copy_once(torch.Tensor.copy_, b, a),
            "xxh3": lambda: _hash_once(src),
            "tcp": lambda: sink.once(src),
            "write_fsync": lambda: write_fsync_once(folder / "limits.bin", src),
        }
        res = interleave(methods, repeats, lambda: None, alternate=True)
    finally:
        sink.close()
    return {"nbytes": nbytes, **{name: r["bps"] for name, r in res.items()},
            "tcp_cpu": res["tcp"]["cpu"]}  # fmt: skip

"""Ways to send one replica's bytes over loopback TCP, and what each costs both ends; why
tier 1 still sends with one blocking ``sendall`` of the whole buffer (12-06): alone, non-
blocking sends each after a ``poll`` cost less CPU and go faster; with a busy Python
thread in the process, they go at half the speed, as every return waits for the GIL.

    .venv/bin/python bench/tcp_send.py [--busy] [OUT.json]

384 MiB from one buffer to a receiver thread that takes it with ``recv_into`` in 16 MiB
``MSG_WAITALL`` reads into a reused buffer, as an agent receives; each sender's and the
receiver's thread CPU time (``time.thread_time``: the kernel's work for loopback is
charged to whichever thread runs it, so only their sum compares), 9 interleaved rounds
(order flipped every other one, the first left out), medians with their min-max. With
``--busy`` a thread of pure Python runs in the sending process throughout, as an agent's
event loop or a trainer's loop may: each return from a blocking call then waits for the
GIL, so a way of sending that returns often pays for it.
"""

from __future__ import annotations

import json
import os
import select
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable

N = 384 << 20
RECV = 1 << 24


def _polled(sock: socket.socket, data: memoryview) -> None:
    """Non-blocking sends (``MSG_DONTWAIT``), each after ``poll`` says the socket takes
    more; the socket's own mode stays blocking (tried for tier 1 on 12-06, reverted)."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    sent = 0
    while sent < len(data):
        try:
            sent += sock.send(data[sent:], socket.MSG_DONTWAIT)
        except BlockingIOError:
            poller.poll()


def _chunks(k: int) -> Callable[[socket.socket, memoryview], None]:
    def send(sock: socket.socket, data: memoryview) -> None:
        for at in range(0, len(data), k):
            sock.sendall(data[at : at + k])

    return send


SENDERS: dict[str, tuple[float | None, Callable[[socket.socket, memoryview], None]]] = {
    "one blocking sendall": (None, lambda s, d: s.sendall(d)),
    "sendall, socket with a timeout (Python polls)": (300.0, lambda s, d: s.sendall(d)),
    "MSG_DONTWAIT sends after poll": (None, _polled),
    "blocking sendall per 1 MiB": (None, _chunks(1 << 20)),
    "blocking sendall per 4 MiB": (None, _chunks(4 << 20)),
    "blocking sendall per 16 MiB": (None, _chunks(16 << 20)),
}


def _once(name: str, src: memoryview, dst: memoryview) -> dict[str, float]:
    timeout, send = SENDERS[name]
    listener = socket.create_server(("127.0.0.1", 0))
    out: dict[str, float] = {}

    def receive() -> None:
        conn, _ = listener.accept()
        with conn:
            cpu0, got = time.thread_time(), 0
            while got < N:
                n = conn.recv_into(dst[got:], min(N - got, RECV), socket.MSG_WAITALL)
                if n == 0:
                    raise EOFError(f"the sender closed after {got} of {N} bytes")
                got += n
            conn.sendall(b"k")
            out["recv"] = time.thread_time() - cpu0

    thread = threading.Thread(target=receive)
    thread.start()
    with socket.create_connection(listener.getsockname(), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cpu0, t0 = time.thread_time(), time.monotonic()
        send(sock, src)
        if sock.recv(1) != b"k":
            raise EOFError("the receiver closed")
        out["send"], out["wall"] = time.thread_time() - cpu0, time.monotonic() - t0
    thread.join()
    listener.close()
    return out


def _spin(stop: threading.Event) -> None:
    """Pure Python until told to stop: a thread that wants the GIL all the time."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x ^= i


def main() -> None:
    busy = "--busy" in sys.argv
    out_path = next((a for a in sys.argv[1:] if a != "--busy"), None)
    stop = threading.Event()
    if busy:
        threading.Thread(target=_spin, args=(stop,), daemon=True).start()
    src = memoryview(bytearray(os.urandom(1 << 20)) * (N >> 20))
    dst = memoryview(bytearray(N))
    dst[:] = src  # both faulted in
    names = list(SENDERS)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(9):
        for name in names if r % 2 else names[::-1]:
            runs[name].append(_once(name, src, dst))
    gib = N / 2**30
    stop.set()
    res: dict[str, object] = {"bytes": N, "rounds_kept": 8, "busy_thread": busy}
    for name, rs in runs.items():
        rs = rs[1:]
        both = [(x["send"] + x["recv"]) / gib for x in rs]
        speed = [gib / x["wall"] for x in rs]
        res[name] = {
            "cpu_s_per_gib": {
                "median": statistics.median(both),
                "min": min(both),
                "max": max(both),
            },
            "sender_cpu_s_per_gib": statistics.median(x["send"] / gib for x in rs),
            "receiver_cpu_s_per_gib": statistics.median(x["recv"] / gib for x in rs),
            "gib_s": {"median": statistics.median(speed), "min": min(speed), "max": max(speed)},
        }
        print(f"{name:46s} {statistics.median(both):.3f} CPU-s/GiB ({min(both):.3f} - "
              f"{max(both):.3f}), {statistics.median(speed):.2f} GiB/s")  # fmt: skip
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

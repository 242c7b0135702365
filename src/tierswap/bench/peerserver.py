"""The far side of ``tierswap bench replication``, in a process of its own that
:class:`PeerServer` starts and stops: a :class:`~tierswap.tiers.peer.ReplicaServer` over a
:class:`PeerStore`, served as the agent serves it, and a plain TCP sink to compare it with.

``python -m tierswap.bench.peerserver JOB_ID``, with the job's secret (hex) in
``TIERSWAP_BENCH_SECRET``. It prints its addresses as one JSON line on stdout, serves
until its stdin closes (the bench is done, or gone), then unlinks its segments and exits.
Each line ``cpu`` on its stdin is answered with a JSON line of the CPU seconds this
process has spent so far, all its threads together (the kernel's clock, to the
nanosecond: ``/proc``'s ticks are 10 ms, as much as a receiver spends on 64 MiB).

The sink reads frames of an 8-byte little-endian length and that many bytes, received
with ``recv_into`` into one buffer that is reused (touched by the first, warm-up frame),
and answers each with one byte.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from tierswap.control import protocol as p
from tierswap.shm import remove_job_segments
from tierswap.tiers.peer import ReplicaServer
from tierswap.tiers.replicas import PeerStore

log = logging.getLogger(__name__)

SECRET_ENV = "TIERSWAP_BENCH_SECRET"
NSLOTS = 2
"""Slots per rank: the newest replica and the one being received."""
_HEADER = struct.Struct("<Q")
_CHUNK = 1 << 24  # the most one recv_into asks for, as Channel.recv_raw_into does


class _Agent:
    """The agent's side of the server: the store's calls run one at a time, as on the
    agent's event loop; its reports are logged."""

    def __init__(self, job_id: str) -> None:
        self.store = PeerStore(job_id, NSLOTS, 0, self._report)
        self.lock = threading.Lock()
        self.handlers: dict[str, Any] = {
            "replica_slot": self.store.slot,
            "replica_received": self.store.received,
            "replica_written": self.store.written,
            "replica_lease": self.store.lease,
            "replica_unlease": self.store.unlease,
            "replica_served": lambda **_: None,  # the agent logs it; nothing to log here
        }

    def _report(self, msg: p.Message, gen: int) -> None:
        if isinstance(msg, p.ReplicaRejected):
            log.warning("bench peer server: %s", msg)

    def ask(self, op: str, **fields: Any) -> Any:
        with self.lock:
            return self.handlers[op](**fields)

    def close(self) -> None:
        with self.lock:
            self.store.close()


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:], min(len(buf) - got, _CHUNK))
        if n == 0:
            raise EOFError(f"sender closed after {got} of {len(buf)} bytes")
        got += n


def _sink_connection(sock: socket.socket) -> None:
    buf = bytearray()
    head = bytearray(_HEADER.size)
    with sock:
        try:
            while True:
                _recv_exact(sock, memoryview(head))
                (n,) = _HEADER.unpack(head)
                if n > len(buf):
                    buf = bytearray(n)
                _recv_exact(sock, memoryview(buf)[:n])
                sock.sendall(b"k")
        except (EOFError, OSError):
            return  # the bench closed its end


def _sink(listener: socket.socket) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:  # closed: shutting down
            return
        threading.Thread(
            target=_sink_connection, args=(sock,), daemon=True, name="tierswap-bench-sink"
        ).start()


class PeerServer:
    """This process, as the bench starts it: ``close`` ends it (its stdin closes) and
    unlinks any segment it left."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.secret = secrets.token_bytes(16)
        env = {**os.environ, SECRET_ENV: self.secret.hex()}
        cmd = [sys.executable, "-m", "tierswap.bench.peerserver", job_id]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        try:
            ready = self._ready_line(timeout=120)
        except BaseException:
            self.close()
            raise
        self.replica = (str(ready["replica"][0]), int(ready["replica"][1]))
        self.replica_tls = (str(ready["replica_tls"][0]), int(ready["replica_tls"][1]))
        """The same store, served over TLS (what ``--tls auto`` does off loopback)."""
        self.stream = (str(ready["stream"][0]), int(ready["stream"][1]))

    def _ready_line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise TimeoutError(f"bench peer server gave no address within {timeout:g} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench peer server exited with code {self.proc.wait(10)}")
        ready: dict[str, Any] = json.loads(line)
        return ready

    def cpu_s(self) -> float:
        """The CPU seconds this server has spent so far, all its threads together."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(b"cpu\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # gone: said below, with its exit code
            pass
        line = self.proc.stdout.readline()  # (its answer comes at once: no select)
        if not line:
            raise RuntimeError(f"bench peer server exited with code {self.proc.wait(10)}")
        return float(json.loads(line)["cpu_s"])

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        remove_job_segments(self.job_id)


def main(argv: list[str]) -> None:
    """Serve until stdin closes; the secret comes from the env."""
    (job_id,) = argv
    secret = bytes.fromhex(os.environ.pop(SECRET_ENV))
    agent = _Agent(job_id)
    server = ReplicaServer("127.0.0.1", secret, agent.ask)
    over_tls = ReplicaServer("127.0.0.1", secret, agent.ask, tls="on")  # the same store
    sink = socket.create_server(("127.0.0.1", 0))
    try:
        threading.Thread(
            target=_sink, args=(sink,), daemon=True, name="tierswap-bench-accept"
        ).start()
        ready = {
            "replica": server.address,
            "replica_tls": over_tls.address,
            "stream": sink.getsockname()[:2],
            "pid": os.getpid(),
        }
        print(json.dumps(ready), flush=True)
        for line in sys.stdin.buffer:  # until EOF: the bench is done, or gone
            if line.strip() == b"cpu":
                print(json.dumps({"cpu_s": time.process_time()}), flush=True)
    finally:
        sink.close()
        server.close()
        over_tls.close()
        agent.close()


if __name__ == "__main__":
    main(sys.argv[1:])

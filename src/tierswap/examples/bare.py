"""The overhead bench's controls: the barest ways to do what a snapshot every step does,
run by ``train_mlp.py --plain`` in place of tierswap's steps.

- :class:`BareCopy` (``--memcpy``): a memcpy of the state on a thread every step, the floor
  of tier 0.
- :class:`BareStream` (``--memcpy --stream``): and each copy sent to the next rank over
  one TCP connection, the floor of tiers 0+1.

Neither hashes, keeps a ring of slots or has an agent: what is left of a snapshot's cost
once everything but moving its bytes is gone.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Any

import torch

from tierswap import memcopy
from tierswap.affinity import helper_cpus, pin_thread
from tierswap.state import flatten, make_layout
from tierswap.wire import send_pieces

FRAME = struct.Struct("<Q")
"""A stream's frame: its length, then that many bytes; answered with one byte."""
RECV_CHUNK = 1 << 24
"""Bytes one receive asks for, as the agent's replica server asks (``recv_raw_into``)."""
LIMIT_S = 60.0
"""The longest any wait of the stream may take: for a copy to arrive (the gate), for the
next frame or its answer (each socket's timeout), for both threads to end (close). A step
of the reference model takes about a second; a bench job is killed after 180 s at the
least, so a peer that stopped answering fails its job's round before that."""


class BareCopy:
    """After each optimizer step, a thread memcpys every tensor of the state into one
    buffer of its own, laid out as a slot is (each tensor at an aligned offset), overlapped
    with the next forward and backward as the snapshot's copy is, on the cores the
    snapshot's copy runs on (``--agent-cpus``, pinned); the next optimizer step waits for
    it (:meth:`wait`). With a ``stream``, each finished copy is handed to it."""

    def __init__(self, state: dict[str, Any], stream: BareStream | None = None) -> None:
        self.state = state
        self.stream = stream
        self.buffer: torch.Tensor | None = None
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.thread: threading.Thread | None = None
        self.cpu = 0.0
        """The last copy's CPU seconds (its thread's own)."""
        self.stall = 0.0
        """The last wait for a copy, seconds."""
        self.error: BaseException | None = None

    def _allocate(self) -> None:
        flat = flatten(self.state, with_rng=False)
        layout = make_layout(flat)  # as a snapshot lays out its slot
        self.buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        views = [self.buffer[e.offset : e.offset + e.nbytes] for e in layout.entries]
        self.pairs = list(zip(views, flat.tensors, strict=True))

    def start(self) -> None:
        if self.buffer is None:  # after the first optimizer step: its state exists now
            self._allocate()
        self.thread = threading.Thread(target=self._copy, name="bare-copy", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        cpu0 = time.thread_time()
        try:
            pin_thread(helper_cpus())  # where the snapshot's copy thread runs (snapshot.py)
            for dst, src in self.pairs:
                memcopy.memcpy(dst, src)
        except BaseException as e:  # the trainer raises it: no round without its copy
            self.error = e
        self.cpu = time.thread_time() - cpu0
        if self.stream is not None and self.error is None and self.buffer is not None:
            self.stream.send(self.buffer)

    def wait(self) -> None:
        t0 = time.perf_counter()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.stall = time.perf_counter() - t0
        if self.error is not None:
            raise RuntimeError("the bare memcpy failed") from self.error


class BareStream:
    """Each copy :class:`BareCopy` finishes, sent whole to the next rank over one TCP
    connection on loopback (the nodes of ``tierswap run`` on one machine; Nagle off, as on
    tierswap's channels), while a thread receives the previous rank's copies into one
    buffer that is reused: each rank's state crosses the network once a step, as tier 1
    sends it to one peer (``--replicas 1``). The sending and receiving threads run where
    the copy does (``--agent-cpus``), as the agents that send and receive replicas would,
    but in the trainer's process, as the snapshot's copy thread is. :meth:`gate` is the wait
    for tier 1 that ``--max-redo 1`` makes: the optimizer step of a step waits until the
    copy of the step before has arrived, so the copy's buffer is free again when the next
    copy starts. No checksum, no ring of slots, no commit across ranks: less than tier 1
    does, so never more than it costs."""

    def __init__(self, out: socket.socket, incoming: socket.socket) -> None:
        self.out, self.incoming = out, incoming
        for sock in (out, incoming):
            # blocking, as the agent's are, so that a receive waits for all it asks
            # (MSG_WAITALL); the kernel bounds each read and write (wire.recv_raw_into)
            sock.settimeout(None)
            limit = struct.pack("ll", int(LIMIT_S), int(LIMIT_S % 1 * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.cond = threading.Condition()
        self.queued: list[torch.Tensor] = []
        self.handed = self.sent = 0
        self.closing = False
        self.cpu = 0.0
        """CPU seconds of the last frame, sent and received (both threads' own)."""
        self.send_cpu = self.recv_cpu = 0.0
        self.received: memoryview | None = None
        """The buffer the previous rank's copies arrive in (the last one whole)."""
        self.stall = 0.0
        """The last wait in :meth:`gate`, seconds."""
        self.error: BaseException | None = None
        self.threads = [
            threading.Thread(target=self._sender, name="bare-send", daemon=True),
            threading.Thread(target=self._receiver, name="bare-recv", daemon=True),
        ]
        for t in self.threads:
            t.start()

    @classmethod
    def connect(cls, rank: int, world_size: int) -> BareStream:
        """Each rank listens on loopback, learns the others' ports through the process
        group (integers in a tensor: nothing is pickled), connects to the next rank and
        accepts the previous one."""
        import torch.distributed as dist

        with socket.create_server(("127.0.0.1", 0)) as listener:
            port = torch.tensor([listener.getsockname()[1]], dtype=torch.int64)
            ports = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
            dist.all_gather(ports, port)
            out = socket.create_connection(
                ("127.0.0.1", int(ports[(rank + 1) % world_size])), timeout=LIMIT_S
            )
            listener.settimeout(LIMIT_S)
            incoming, _ = listener.accept()
        return cls(out, incoming)

    def send(self, buf: torch.Tensor) -> None:
        """Queue a finished copy (called by the copy's thread)."""
        with self.cond:
            self.queued.append(buf)
            self.handed += 1
            self.cond.notify_all()

    def gate(self) -> None:
        """Wait until every copy handed so far has arrived (at most :data:`LIMIT_S`)."""
        t0 = time.perf_counter()
        with self.cond:
            done = self.cond.wait_for(
                lambda: self.sent >= self.handed or self.error is not None, LIMIT_S
            )
        self.stall = time.perf_counter() - t0
        if self.error is not None:
            raise RuntimeError("the bare stream failed") from self.error
        if not done:
            self._fail(TimeoutError(f"a copy was not received within {LIMIT_S:g} s"))
            raise RuntimeError("the bare stream failed") from self.error

    def _fail(self, e: BaseException) -> None:
        """Record the first error and cut both connections, so that neither thread, nor
        the next rank's, waits on them any longer."""
        with self.cond:
            self.error = self.error or e
            self.cond.notify_all()
        for sock in (self.out, self.incoming):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _sender(self) -> None:
        try:
            pin_thread(helper_cpus())
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: bool(self.queued) or self.closing)
                    if not self.queued:
                        return
                    buf = self.queued.pop(0)
                cpu0 = time.thread_time()
                data = buf.numpy().data
                self.out.sendall(FRAME.pack(len(data)))
                send_pieces(self.out, data)  # as tier 1 sends its replicas
                if self.out.recv(1) != b"k":
                    raise EOFError("the next rank stopped receiving")
                self.send_cpu = time.thread_time() - cpu0
                with self.cond:
                    self.sent += 1
                    self.cpu = self.send_cpu + self.recv_cpu
                    self.cond.notify_all()
        except BlockingIOError:  # the kernel's limit (SO_SNDTIMEO, SO_RCVTIMEO) passed
            self._fail(
                TimeoutError(f"the next rank took no bytes or answered none for {LIMIT_S:g} s")
            )
        except BaseException as e:
            self._fail(e)

    def _receiver(self) -> None:
        buf: memoryview | None = None
        try:
            pin_thread(helper_cpus())
            while header := _recv_exact(self.incoming, FRAME.size):
                cpu0 = time.thread_time()
                (n,) = FRAME.unpack(header)
                if buf is None or len(buf) != n:
                    buf = memoryview(bytearray(n))
                got = 0
                while got < n:
                    k = self.incoming.recv_into(
                        buf[got:], min(n - got, RECV_CHUNK), socket.MSG_WAITALL
                    )
                    if k == 0:
                        raise EOFError(f"the previous rank closed after {got} of {n} bytes")
                    got += k
                self.received = buf
                self.incoming.sendall(b"k")
                self.recv_cpu = time.thread_time() - cpu0
        except BlockingIOError:  # the kernel's limit (SO_RCVTIMEO, SO_SNDTIMEO) passed
            self._fail(TimeoutError(f"the previous rank sent nothing for {LIMIT_S:g} s"))
        except BaseException as e:
            self._fail(e)

    def close(self) -> None:
        """Send what is queued, then close both connections and end both threads, all
        within :data:`LIMIT_S` (past it both connections are cut); an error of either
        thread is raised here."""
        deadline = time.monotonic() + LIMIT_S
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.threads[0].join(max(0.0, deadline - time.monotonic()))
        if self.threads[0].is_alive():
            self._fail(TimeoutError(f"the last copy was not sent within {LIMIT_S:g} s"))
        with contextlib.suppress(OSError):  # (a next rank that is gone has seen the end)
            self.out.shutdown(socket.SHUT_WR)  # the next rank's receiver sees the end
        self.threads[1].join(max(0.0, deadline - time.monotonic()))
        if self.threads[1].is_alive():
            self._fail(TimeoutError(f"the previous rank did not end within {LIMIT_S:g} s"))
        for t in self.threads:  # cut off: their calls return at once
            t.join(LIMIT_S)
        self.out.close()
        self.incoming.close()
        if self.error is not None:
            raise RuntimeError("the bare stream failed") from self.error


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, or b"" where the stream ended cleanly before the first."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            if data:
                raise EOFError(f"a frame header cut off after {len(data)} bytes")
            return b""
        data += chunk
    return data

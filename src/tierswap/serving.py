"""Servers of the job: accept loops, a server base class, and a channel's reader thread.

``serve`` accepts a listener's connections on a daemon thread and authenticates each on a
thread of its own, with at most ``MAX_UNAUTHENTICATED`` proving themselves at once: a
silent or flooding stranger cannot keep the job's own processes from connecting, and a
server out of descriptors goes on accepting once they free. ``Server`` is a TCP server of
the job built on it, one thread per connection, whose ``close`` cuts the connections
still open; ``reader`` reads one channel on a daemon thread.

They add the threads that serve ``wire.py``'s listeners and channels, which know nothing
of who serves them.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from tierswap.control.protocol import Envelope
from tierswap.wire import Channel, Listener, family

log = logging.getLogger(__name__)

MAX_UNAUTHENTICATED = 64
"""Connections a server lets prove themselves at once; the next wait to be accepted."""
ACCEPT_BACKOFF_MAX = 0.5
"""The longest wait before accepting again after accept failed (no descriptor left)."""


def serve(
    listener: Listener, on_channel: Callable[[Channel], None], name: str, incoming: Any
) -> Callable[[], None]:
    """Accept connections in a daemon thread, one ``on_channel`` call each (a channel that
    receives ``incoming``). Returns the function that stops it: closing a listener does
    not wake a thread blocked in accept."""
    stopped = threading.Event()

    pending = threading.BoundedSemaphore(MAX_UNAUTHENTICATED)
    """Connections still proving they know the secret. When that many are, accepting
    waits (the kernel's backlog holds the next ones): a flood of silent strangers costs
    a client at most a handshake timeout, never every descriptor and thread."""

    def handshake(sock: socket.socket) -> None:
        # on its own thread, with a deadline: one silent client must not block the others
        try:
            chan = listener.handshake(sock, incoming)
        except Exception:  # wrong secret, silence, a wake-up, no descriptor left: refused
            sock.close()
            return
        finally:
            pending.release()
        if stopped.is_set():
            chan.close()
            return
        on_channel(chan)

    def loop() -> None:
        backoff = 0.0
        while not stopped.is_set():
            if listener.closed:  # shutting down
                return
            if not pending.acquire(timeout=0.5):
                continue  # every handshake slot is taken: wait for one
            try:
                sock = listener.accept()
            except OSError as e:
                pending.release()
                if stopped.is_set() or listener.closed:
                    return  # closed while waiting
                # no descriptor left (EMFILE, ENFILE), a connection reset before it was
                # accepted, memory: this server goes on, after a short wait so that a flood
                # does not spin it
                backoff = min(ACCEPT_BACKOFF_MAX, max(0.01, backoff * 2))
                log.warning("%s: accept failed (%s); retrying in %.2f s", name, e, backoff)
                time.sleep(backoff)
                continue
            backoff = 0.0
            try:
                threading.Thread(
                    target=handshake, args=(sock,), daemon=True, name=f"{name}-handshake"
                ).start()
            except RuntimeError:  # no thread can be started: turned away as well
                pending.release()
                sock.close()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        address = listener.address
        try:
            with socket.socket(family(address), socket.SOCK_STREAM) as wake:
                wake.connect(address)
        except OSError:
            pass
        listener.close()
        thread.join(timeout=5)

    return stop


class Server:
    """A TCP server of the job on ``(bind, port 0)``: each authenticated connection is
    served by ``handle`` on a thread of its own, and closed when it returns or the peer
    goes (EOF, a reset, a message not of ``incoming``). ``close`` stops accepting and
    cuts the connections still open, so that their threads end with it."""

    incoming: Any
    """The union of messages its connections receive."""
    name = "tierswap-server"
    close_wait_s = 5.0
    """How long ``close`` waits for the threads of the connections it cut (one may be
    between two reads, in a call of its own, as a replica waits for room)."""

    def __init__(self, bind: str, secret: bytes, tls: str = "off") -> None:
        self._lock = threading.Lock()
        self._open: dict[Channel, threading.Thread] = {}
        self._closed = False
        self.listener = Listener((bind, 0), secret, tls=tls)
        self._stop = serve(self.listener, self._start, f"{self.name}-accept", self.incoming)

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.tcp_address

    @property
    def closed(self) -> bool:
        """``close`` was called: a handler waiting in a loop of its own gives up."""
        return self._closed

    def close(self) -> None:
        self._stop()
        with self._lock:
            self._closed = True
            cut = dict(self._open)
        for chan in cut:  # a client that keeps its connection open (or a relay that
            chan.close()  # never passes on its close) would hold a thread for ever
        deadline = time.monotonic() + self.close_wait_s
        for thread in cut.values():
            thread.join(max(0.0, deadline - time.monotonic()))

    def handle(self, chan: Channel) -> None:
        raise NotImplementedError

    def _start(self, chan: Channel) -> None:
        thread = threading.Thread(target=self._run, args=(chan,), daemon=True, name=self.name)
        with self._lock:
            if self._closed:
                chan.close()
                return
            self._open[chan] = thread
        thread.start()

    def _run(self, chan: Channel) -> None:
        try:
            self.handle(chan)
        except (EOFError, OSError, ValueError):  # ProtocolError is a ValueError
            pass
        finally:
            chan.close()
            with self._lock:
                self._open.pop(chan, None)


def reader(chan: Channel, deliver: Callable[[Envelope[Any] | None], None], name: str) -> None:
    """Read ``chan`` in a daemon thread; ``deliver(None)`` once when it closes, or when it
    sends something that is not a message of its channel (the peer is then cut off)."""

    def loop() -> None:
        try:
            while True:
                env = chan.recv()
                if env is not None:
                    deliver(env)
        except (EOFError, OSError, ValueError):  # ProtocolError is a ValueError
            deliver(None)

    threading.Thread(target=loop, name=name, daemon=True).start()

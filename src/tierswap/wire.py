"""Messages between workers, agents and the coordinator over authenticated sockets.

``multiprocessing.connection`` gives framing and an HMAC handshake with a per-job secret,
so a process outside the job cannot connect. Payloads are the typed messages of
``control/protocol.py`` (msgpack, never pickle); a channel decodes the messages of the
union it is made for, and anything else is a ``ProtocolError``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import (
    Client,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)
from typing import Any, TypeVar

from tierswap.control.protocol import Codec, Envelope, Error, Message, ProtocolError, tag_of

Address = str | tuple[str, int]
R = TypeVar("R", bound=Message)
log = logging.getLogger(__name__)


class Channel:
    """One connection; ``send`` is thread-safe, ``call`` is a request and its reply.

    ``incoming`` is the union of message classes this end receives; ``gen`` the
    generation stamped on what it sends unless a send names another."""

    def __init__(self, conn: Connection, incoming: Any) -> None:
        self.conn = conn
        self.codec = Codec(incoming)
        self.gen = -1
        self._send_lock = threading.Lock()
        self._call_lock = threading.Lock()
        self._sock: socket.socket | None = None
        sock = self._socket()
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # small requests go out at once (else Nagle + delayed ACK add ~40 ms)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def connect(cls, address: Address, secret: bytes, incoming: Any) -> Channel:
        return cls(Client(address, authkey=secret), incoming)

    def send(self, msg: Message, gen: int | None = None) -> None:
        self.send_encoded(Codec.encode(msg, self.gen if gen is None else gen))

    def send_encoded(self, data: bytes) -> None:
        """Send a message encoded once for many channels (``Codec.encode``)."""
        with self._send_lock:
            self.conn.send_bytes(data)

    def recv(self, timeout: float | None = None) -> Envelope[Any] | None:
        """The next message; None on timeout. Raises EOFError when the peer is gone and
        ProtocolError for bytes that are not a message of this channel."""
        if timeout is not None and not self.conn.poll(timeout):
            return None
        return self.codec.decode(self.conn.recv_bytes(MAX_FRAME))

    def call(self, msg: Message, reply: type[R] | tuple[type[R], ...], timeout: float = 60.0) -> R:
        """Send a request and wait for its reply (the peer answers calls in order); an
        Error reply raises RuntimeError, one of another kind ProtocolError."""
        with self._call_lock:
            self.send(msg)
            env = self.recv(timeout)
        what = tag_of(msg)
        if env is None:
            raise TimeoutError(f"no reply to {what!r} within {timeout:g} s")
        if isinstance(env.msg, Error):
            raise RuntimeError(f"{what!r} failed: {env.msg.message}")
        if not isinstance(env.msg, reply):
            raise ProtocolError(f"{what!r} was answered with {tag_of(env.msg)!r}")
        return env.msg

    def send_raw(self, data: memoryview) -> None:
        """Send bulk bytes after a message that announced their length: no framing, no
        copy, at the speed of the socket."""
        with self._send_lock:
            self._socket().sendall(data)

    def recv_raw_into(self, buf: memoryview) -> None:
        """Receive exactly ``len(buf)`` announced bulk bytes straight into ``buf``.

        The socket stays blocking (its flags are shared with the framed connection); a
        dead peer ends the wait with EOF or a reset."""
        sock = self._socket()
        got = 0
        while got < len(buf):
            n = sock.recv_into(buf[got:], min(len(buf) - got, 1 << 24))
            if n == 0:
                raise EOFError(f"peer closed after {got} of {len(buf)} bytes")
            got += n

    def give_up_after(self, seconds: float) -> None:
        """A send to a host that vanished (no reset, no FIN: a dead machine, a cut link)
        fails after ``seconds`` of unacknowledged data (``TCP_USER_TIMEOUT``), instead of
        TCP's default of about 15 minutes of retransmissions. Best effort: where the
        platform has no such option the channel keeps TCP's default."""
        option = getattr(socket, "TCP_USER_TIMEOUT", None)
        if option is None:
            return
        with contextlib.suppress(OSError):
            self._socket().setsockopt(socket.IPPROTO_TCP, option, int(seconds * 1000))

    def local_address(self) -> tuple[str, int]:
        """This end's address: the interface the connection leaves from."""
        host, port = self._socket().getsockname()[:2]
        return str(host), int(port)

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        return self._sock

    def close(self) -> None:
        """Close; a thread blocked reading this channel wakes up with EOF."""
        try:
            sock = self._socket()
            sock.shutdown(socket.SHUT_RDWR)  # a plain close does not wake a poll()
            sock.close()
        except OSError:
            pass
        self._sock = None
        self.conn.close()


def serve(
    listener: Listener, on_channel: Callable[[Channel], None], name: str, incoming: Any
) -> Callable[[], None]:
    """Accept connections in a daemon thread, one ``on_channel`` call each (a channel that
    receives ``incoming``). Returns the function that stops it: closing a listener does
    not wake a thread blocked in accept."""
    stopped = threading.Event()
    authkey = secret_of(listener)

    pending = threading.BoundedSemaphore(MAX_UNAUTHENTICATED)
    """Connections still proving they know the secret. When that many are, accepting
    waits (the kernel's backlog holds the next ones): a flood of silent strangers costs
    a client at most a handshake timeout, never every descriptor and thread."""

    def handshake(conn: Connection) -> None:
        # Listener.accept() would run this on the accept thread, where one silent client
        # blocks every later connection: here it runs on its own thread, with a deadline.
        try:
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.settimeout(None)
                _set_timeout(sock, HANDSHAKE_TIMEOUT)
                deliver_challenge(conn, authkey)
                answer_challenge(conn, authkey)
                _set_timeout(sock, 0.0)
        except Exception:  # wrong secret, silence, a wake-up, no descriptor left: refused
            conn.close()
            return
        finally:
            pending.release()
        if stopped.is_set():
            conn.close()
            return
        on_channel(Channel(conn, incoming))

    def loop() -> None:
        backoff = 0.0
        while not stopped.is_set():
            inner = listener._listener  # type: ignore[attr-defined]
            if inner is None:  # listener closed: shutting down
                return
            if not pending.acquire(timeout=0.5):
                continue  # every handshake slot is taken: wait for one
            try:
                conn = inner.accept()
            except OSError as e:
                pending.release()
                if stopped.is_set() or listener._listener is None:  # type: ignore[attr-defined]
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
                    target=handshake, args=(conn,), daemon=True, name=f"{name}-handshake"
                ).start()
            except RuntimeError:  # no thread can be started: turned away as well
                pending.release()
                conn.close()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        address = listener.address
        family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as wake:
                wake.connect(address)
        except OSError:
            pass
        listener.close()
        thread.join(timeout=5)

    return stop


HANDSHAKE_TIMEOUT = 10.0
"""Seconds a connecting process has to prove it knows the job's secret."""
MAX_UNAUTHENTICATED = 64
"""Connections a server lets prove themselves at once; the next wait to be accepted."""
BACKLOG = 1024
"""Connections the kernel queues for a listener (multiprocessing's default is 1, which
drops a burst of hosts connecting at a job's start)."""
ACCEPT_BACKOFF_MAX = 0.5
"""The longest wait before accepting again after accept failed (no descriptor left)."""
MAX_FRAME = 64 << 20
"""The largest message a channel reads (bytes); a longer one closes it unread (bulk bytes
go raw, outside messages)."""


def secret_of(listener: Listener) -> bytes:
    key = listener._authkey  # type: ignore[attr-defined]
    if not isinstance(key, bytes) or not key:
        raise ValueError("tierswap listeners must have an authkey (the job's secret)")
    return key


def _set_timeout(sock: socket.socket, seconds: float) -> None:
    """Receive/send timeout on the socket itself (SO_RCVTIMEO), which a blocking read of
    the connection's file descriptor obeys; 0 removes it."""
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


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

"""Messages between workers, agents and the coordinator over authenticated sockets.

A connection is opened by the handshake of ``handshake.py``, in which each end proves it
knows the job's secret and which gives each direction its own frame key. Every frame
after the handshake carries a MAC over its bytes and its sequence number in that
direction, so a frame that was injected, altered, replayed, reordered or reflected back
to its sender is refused and the connection dropped. Payloads are the typed messages of
``control/protocol.py`` (msgpack, never pickle); a channel decodes the messages of the
union it is made for, and anything else is a ``ProtocolError``.

Bulk bytes (``send_raw``) follow a message that announced their length and checksum; they
carry no MAC of their own (a MAC would cost a pass over every replica): an xxh3 checksum
finds corruption, not forgery, so bulk traffic between hosts is trusted only as far as
the network it crosses.

The threads that accept and serve connections (``serve``, ``Server``, ``reader``) are in
``serving.py``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import select
import socket
import ssl
import struct
import threading
from types import TracebackType
from typing import Any, TypeVar

from tierswap import handshake
from tierswap import tls as _tls
from tierswap.control.protocol import Codec, Envelope, Error, Message, ProtocolError, tag_of
from tierswap.handshake import NONCE, frame_keys, recv_exact
from tierswap.interrupt import own_call

Address = str | tuple[str, int]
R = TypeVar("R", bound=Message)

BULK_IDLE_S = 30.0
"""A replica server takes a sender that sends nothing for this long mid-transfer for gone:
the transfer is cut and the slot it was filling freed (the sender's side gives up after
as long, ``SEND_LIMIT_S``)."""
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a connecting process has to prove it knows the job's secret."""
BACKLOG = 1024
"""Connections the kernel queues for a listener (a burst of hosts connecting at a job's
start must not be dropped)."""
MAX_FRAME = 64 << 20
"""The largest frame a channel reads (bytes); a longer one closes it unread (bulk bytes
go raw, outside frames)."""

TAG = 16
"""Bytes of each frame's MAC."""
HEADER = 4
"""Bytes of each frame's length (big-endian), before its payload and MAC."""
_SEQ = struct.Struct(">Q")
"""A frame's sequence number in its MAC."""


class Direction:
    """One direction of a connection: its key and the sequence number of its next frame."""

    __slots__ = ("_keyed", "seq")

    def __init__(self, key: bytes) -> None:
        self._keyed = hashlib.blake2b(key=key, digest_size=TAG)
        """The hash with its key absorbed: each frame's MAC starts from a copy (a third
        cheaper than keying afresh)."""
        self.seq = 0

    def tag(self, payload: bytes | bytearray | memoryview) -> bytes:
        """The MAC of the next frame in this direction; each call moves to the next."""
        h = self._keyed.copy()
        h.update(_SEQ.pack(self.seq))
        h.update(payload)
        self.seq += 1
        return h.digest()

    def seal(self, payload: bytes) -> bytes:
        """The next frame: its length, the payload, its MAC."""
        return (len(payload) + TAG).to_bytes(HEADER, "big") + payload + self.tag(payload)


def _host(address: Address) -> str | None:
    return None if isinstance(address, str) else address[0]


def family(address: Address) -> socket.AddressFamily:
    """The socket family that reaches ``address``: Unix for a path, IPv6 for a host with a
    colon, IPv4 otherwise."""
    if isinstance(address, str):
        return socket.AF_UNIX
    return socket.AF_INET6 if ":" in address[0] else socket.AF_INET


class Listener:
    """A server socket of the job: TCP on ``(host, port)`` (port 0: one the OS picks), or
    a Unix socket at a path (removed again on close). ``tls`` (``tls.MODES``) says which
    connections are served over TLS, by where they come from."""

    def __init__(
        self, address: Address, secret: bytes, backlog: int | None = None, tls: str = "off"
    ) -> None:
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("tierswap listeners need the job's secret (non-empty bytes)")
        _tls.wanted(tls, None)  # a bad mode is refused here, not at the first connection
        self.secret = secret
        self.tls = tls
        if isinstance(address, str) and len(os.fsencode(address)) > 107:
            raise OSError(
                errno.ENAMETOOLONG,
                f"Unix socket path {address!r} is over the 107 bytes allowed: use a shorter "
                "folder (--run-dir)",
            )
        self._sock: socket.socket | None = socket.socket(family(address), socket.SOCK_STREAM)
        try:
            if not isinstance(address, str):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(address)
            self._sock.listen(BACKLOG if backlog is None else backlog)
        except OSError:
            self._sock.close()
            raise
        self._path = address if isinstance(address, str) else None
        name = self._sock.getsockname()
        self.address: Address = name if isinstance(name, str) else (str(name[0]), int(name[1]))

    def accept(self) -> socket.socket:
        """The next connection, not yet authenticated (``handshake`` does that)."""
        listening = self._sock
        if listening is None:
            raise OSError("listener is closed")
        sock, _ = listening.accept()
        return sock

    def handshake(self, sock: socket.socket, incoming: Any) -> Channel:
        """Authenticate an accepted connection within ``HANDSHAKE_TIMEOUT`` in all; its
        channel. Raises (AuthenticationError, OSError, EOFError) for a client that cannot,
        with the connection closed."""
        deadline = handshake.Deadline(sock, HANDSHAKE_TIMEOUT)
        try:
            peer = sock.getpeername()
            if _tls.wanted(self.tls, peer[0] if isinstance(peer, tuple) else None):
                sock = _tls.server_context(self.secret).wrap_socket(sock, server_side=True)
            keys = handshake.as_server(sock, self.secret)
            sock.settimeout(None)
        except BaseException:
            sock.close()  # the TLS socket, once wrapped: the plain one is detached then
            raise
        finally:
            deadline.end()
        return Channel(sock, incoming, keys)

    def fileno(self) -> int:
        if self._sock is None:
            raise OSError("listener is closed")
        return self._sock.fileno()

    def forget(self) -> None:
        """In a forked child: close this copy of the socket, leaving its path to the
        process that listens."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                os.close(sock.detach())

    @property
    def tcp_address(self) -> tuple[str, int]:
        """(host, port) of a TCP listener."""
        if isinstance(self.address, str):
            raise ValueError(f"listener at {self.address} is a Unix socket, not TCP")
        return self.address

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        sock.close()
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)

    def __enter__(self) -> Listener:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Channel:
    """One authenticated connection; ``send`` is thread-safe, ``call`` is a request and
    its reply.

    ``incoming`` is the union of message classes this end receives; ``keys`` this end's
    (send, receive) frame keys from the handshake; ``gen`` the generation stamped on what
    it sends unless a send names another. Over TLS a channel must not be read and written
    by two threads at once (OpenSSL's rule): tierswap's TLS channels (replica traffic) are
    request and reply on one thread."""

    def __init__(self, sock: socket.socket, incoming: Any, keys: tuple[bytes, bytes]) -> None:
        self.sock = sock
        self.codec = Codec(incoming)
        self.gen = -1
        self._out = Direction(keys[0])
        self._in = Direction(keys[1])
        self._refused = ""
        """Why this channel stopped reading (a frame failed its MAC): it stays stopped."""
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._call_lock = threading.Lock()
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # small requests go out at once (else Nagle + delayed ACK add ~40 ms)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def connect(cls, address: Address, secret: bytes, incoming: Any, tls: str = "off") -> Channel:
        """Connect to a server of the job and prove it (within ``HANDSHAKE_TIMEOUT``);
        over TLS where ``tls`` (``tls.MODES``) wants it for this address."""
        sock = socket.socket(family(address), socket.SOCK_STREAM)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
        deadline = handshake.Deadline(sock, HANDSHAKE_TIMEOUT)
        try:
            if _tls.wanted(tls, _host(address)):
                sock = handshake.start_tls(sock, secret, address)
            keys = handshake.as_client(sock, secret, address)
            sock.settimeout(None)
        except BaseException as e:
            sock.close()
            # an error the cut caused reads as the timeout; a signal's exit stays itself
            if deadline.expired and isinstance(e, Exception) and not isinstance(e, TimeoutError):
                raise TimeoutError(
                    f"the handshake with {address} took longer than {HANDSHAKE_TIMEOUT:g} s"
                ) from None
            raise
        finally:
            deadline.end()
        return cls(sock, incoming, keys)

    def send(self, msg: Message, gen: int | None = None) -> None:
        self.send_encoded(Codec.encode(msg, self.gen if gen is None else gen))

    def send_encoded(self, data: bytes) -> None:
        """Send a message encoded once for many channels (``Codec.encode``)."""
        if len(data) + TAG > MAX_FRAME:
            raise ValueError(f"a message of {len(data)} bytes is over the bound {MAX_FRAME}")
        with own_call(), self._send_lock:
            self.sock.sendall(self._out.seal(data))

    def poll(self, timeout: float) -> bool:
        """Whether a frame (or EOF) is there to read within ``timeout`` seconds."""
        if self.sock.fileno() < 0:
            raise EOFError("channel is closed")
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True  # decrypted already, waiting in the TLS layer
        poller = select.poll()  # one per call: two threads may wait on one channel
        poller.register(self.sock.fileno(), select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))

    def recv(self, timeout: float | None = None) -> Envelope[Any] | None:
        """The next message; None on timeout. Raises EOFError when the peer is gone and
        ProtocolError for a frame that fails its MAC or is not a message of this channel."""
        if timeout is not None and not self.poll(timeout):
            return None
        with own_call(), self._recv_lock:
            if self._refused:
                raise ProtocolError(self._refused)
            n = int.from_bytes(recv_exact(self.sock, HEADER), "big")
            if n > MAX_FRAME:
                self._refused = f"bad message length: a frame of {n} bytes, over the bound"
                raise OSError(self._refused)
            if n < TAG:
                self._refused = f"a frame of {n} bytes is shorter than its MAC"
                raise ProtocolError(self._refused)
            frame = recv_exact(self.sock, n)
            payload = memoryview(frame)[:-TAG]
            if not hmac.compare_digest(self._in.tag(payload), frame[-TAG:]):
                self._refused = (
                    f"frame {self._in.seq - 1} failed authentication (injected, altered, "
                    "replayed or out of order)"
                )
                raise ProtocolError(self._refused)
        return self.codec.decode(payload)

    def call(
        self, msg: Message, reply: type[R] | tuple[type[R], ...], timeout: float | None = 60.0
    ) -> R:
        """Send a request and wait for its reply (the peer answers calls in order; None
        waits for ever); an Error reply raises RuntimeError, one of another kind
        ProtocolError."""
        with own_call(), self._call_lock:  # a reply left unread would answer the next call
            self.send(msg)
            return self.expect(reply, repr(tag_of(msg)), timeout)

    def expect(
        self, kind: type[R] | tuple[type[R], ...], what: str, timeout: float | None = 60.0
    ) -> R:
        """The next message, which must be a ``kind`` (the answer to ``what``): an Error
        raises RuntimeError, another message ProtocolError, none in time TimeoutError (the
        channel is then out of step: a late answer would be read as the next one's)."""
        env = self.recv(timeout)
        if env is None:
            raise TimeoutError(f"no reply to {what} within {timeout} s")
        if isinstance(env.msg, Error):
            raise RuntimeError(f"{what} failed: {env.msg.message}")
        if not isinstance(env.msg, kind):
            raise ProtocolError(f"{what} was answered with {tag_of(env.msg)!r}")
        return env.msg

    def send_raw(self, data: memoryview) -> None:
        """Send bulk bytes after a message that announced their length: no framing, no
        copy, at the speed of the socket, in blocking sends of :data:`BULK_PIECE` bytes.
        One ``sendall`` of a whole replica cost more CPU here and went slower. With a busy
        thread in the process every way slows, as each return from the kernel waits for
        the GIL: 16 MiB pieces kept pace with one ``sendall``, where 1 MiB pieces or
        non-blocking sends after ``poll`` fell far behind (``bench/tcp_send.py``,
        docs/measurements.md)."""
        with self._send_lock:
            send_pieces(self.sock, data)

    def recv_raw_into(self, buf: memoryview, idle: float = 0.0) -> None:
        """Receive exactly ``len(buf)`` announced bulk bytes straight into ``buf``; a dead
        peer ends the wait with EOF or a reset, and (``idle`` > 0) one that sends nothing
        for ``idle`` seconds with an OSError: a host gone without a reset (a dead machine,
        a cut link) would otherwise hold the wait, and the slot it fills, until TCP's
        keepalive, hours."""
        got = 0
        # MSG_WAITALL: one call (and one wait for the GIL) per 16 MiB, not one per few
        # hundred KiB the kernel has at hand; the GIL convoy with a busy thread cost a
        # spare's restore fetch 0.3 to 0.6 s for 75 MiB while its model was being built.
        # (A TLS socket takes no flags: it reads record by record.) The idle limit on a
        # plain socket is the kernel's (SO_RCVTIMEO): a Python timeout would make it
        # non-blocking, and MSG_WAITALL would then return what is at hand. A TLS socket
        # takes a Python timeout: its reads retry a kernel timeout for ever.
        tls = isinstance(self.sock, ssl.SSLSocket)
        flags = 0 if tls else socket.MSG_WAITALL
        if idle > 0:
            self._idle_limit(idle, tls)
        try:
            while got < len(buf):
                n = self.sock.recv_into(buf[got:], min(len(buf) - got, BULK_PIECE), flags)
                if n == 0:
                    raise EOFError(f"peer closed after {got} of {len(buf)} bytes")
                got += n
        except (BlockingIOError, TimeoutError):
            raise TimeoutError(
                f"the peer sent nothing for {idle:g} s after {got} of {len(buf)} bytes"
            ) from None
        finally:
            if idle > 0:
                self._idle_limit(0.0, tls)

    def _idle_limit(self, seconds: float, tls: bool) -> None:
        """Reads give up after ``seconds`` without a byte (0: never)."""
        with contextlib.suppress(OSError):
            if tls:
                self.sock.settimeout(seconds or None)
                return
            whole = int(seconds)
            tv = struct.pack("ll", whole, int((seconds - whole) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)

    def give_up_after(self, seconds: float) -> None:
        """A send to a host that vanished (no reset, no FIN: a dead machine, a cut link)
        fails after ``seconds`` of unacknowledged data (``TCP_USER_TIMEOUT``), instead of
        TCP's default of about 15 minutes of retransmissions. Best effort: where the
        platform has no such option the channel keeps TCP's default."""
        option = getattr(socket, "TCP_USER_TIMEOUT", None)
        if option is None:
            return
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.IPPROTO_TCP, option, int(seconds * 1000))

    def local_address(self) -> tuple[str, int]:
        """This end's address: the interface the connection leaves from."""
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    def close(self) -> None:
        """Close; a thread blocked reading this channel wakes up with EOF."""
        with contextlib.suppress(OSError):
            # a plain close does not wake a poll(); the socket's own shutdown, not TLS's,
            # which would pull the TLS state from under a thread still using it
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        self.sock.close()


BULK_PIECE = 1 << 24
"""The bytes of one blocking send of bulk bytes, and of one read of them on a plain socket
(``recv_raw_into``): a replica costs each end a few dozen returns from the kernel (a TLS
socket reads record by record)."""


def send_pieces(sock: socket.socket, data: memoryview) -> None:
    """``sock.sendall(data)`` in blocking sends of :data:`BULK_PIECE` bytes (counted in
    bytes whatever the view's items): how tier 1 sends bulk bytes, and so how the bench's
    floors of it send theirs."""
    if data.nbytes == 0:
        return
    view = data if data.format == "B" and data.ndim == 1 else data.cast("B")
    for at in range(0, len(view), BULK_PIECE):
        sock.sendall(view[at : at + BULK_PIECE])


def pair(a_incoming: Any, b_incoming: Any) -> tuple[Channel, Channel]:
    """Two connected channels in this process (tests, benches), keyed as a handshake
    would key them."""
    x, y = socket.socketpair()
    server, client = frame_keys(
        secrets.token_bytes(32), secrets.token_bytes(NONCE), secrets.token_bytes(NONCE)
    )
    return Channel(x, a_incoming, server), Channel(y, b_incoming, client)

"""Messages between workers, agents and the coordinator over authenticated sockets.

A connection starts with a handshake in which each end proves it knows the job's secret
(HMAC-SHA256 over both ends' fresh nonces), so a process outside the job cannot connect.
The same nonces give each direction its own frame key: every frame after the handshake
carries a MAC over its bytes and its sequence number in that direction, so a frame that
was injected, altered, replayed, reordered or reflected back to its sender is refused and
the connection dropped. Payloads are the typed messages of ``control/protocol.py``
(msgpack, never pickle); a channel decodes the messages of the union it is made for, and
anything else is a ``ProtocolError``.

Bulk bytes (``send_raw``) follow a message that announced their length and checksum; they
carry no MAC of their own (a MAC would cost a pass over every replica): an xxh3 checksum
finds corruption, not forgery, so bulk traffic between hosts is trusted only as far as
the network it crosses.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import multiprocessing
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from tierswap import tls as _tls
from tierswap.control.protocol import Codec, Envelope, Error, Message, ProtocolError, tag_of
from tierswap.interrupt import own_call

Address = str | tuple[str, int]
R = TypeVar("R", bound=Message)

BULK_IDLE_S = 30.0
"""A replica server takes a sender that sends nothing for this long mid-transfer for gone:
the transfer is cut and the slot it was filling freed (the sender's side gives up after
as long, ``SEND_LIMIT_S``)."""
log = logging.getLogger(__name__)

MAGIC = b"tierswap wire 1\n"
"""What a server says first: the protocol and its version."""
NONCE = 32
TAG = 16
"""Bytes of each frame's MAC."""
HEADER = 4
"""Bytes of each frame's length (big-endian), before its payload and MAC."""
_SEQ = struct.Struct(">Q")
"""A frame's sequence number in its MAC."""


class AuthenticationError(multiprocessing.AuthenticationError):
    """The other end does not know the job's secret (or is not a tierswap endpoint)."""


class HandshakeCut(AuthenticationError, ConnectionError):
    """The other end closed (or reset) the connection before proving itself: a peer that
    died, or one that speaks another protocol or another ``--tls``. An ``OSError``, so
    that callers which fall back on a dead peer fall back on this one too."""


class _Deadline:
    """The whole handshake of one connection within ``seconds``: a peer that trickles a
    byte just inside each read's timeout is cut off all the same (a watchdog shuts the
    socket down; a blocked read then ends)."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.expired = False
        self._watch = socket.socket(fileno=os.dup(sock.fileno()))  # outlives a TLS wrap
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True
        sock.settimeout(seconds)  # and each read on its own, as a backstop
        self._timer.start()

    def _cut(self) -> None:
        self.expired = True
        with contextlib.suppress(OSError):
            self._watch.shutdown(socket.SHUT_RDWR)

    def end(self) -> None:
        self._timer.cancel()
        self._watch.close()


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


def frame_keys(
    secret: bytes, server_nonce: bytes, client_nonce: bytes
) -> tuple[tuple[bytes, bytes], tuple[bytes, bytes]]:
    """(server's (send, receive) keys, client's (send, receive) keys) of one connection."""
    base = hmac.digest(secret, b"tierswap frames" + server_nonce + client_nonce, "sha256")
    to_client = hmac.digest(base, b"server to client", "sha256")
    to_server = hmac.digest(base, b"client to server", "sha256")
    return (to_client, to_server), (to_server, to_client)


def _proof(secret: bytes, who: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(secret, b"tierswap " + who + server_nonce + client_nonce, "sha256")


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 24))
        if k == 0:
            raise EOFError(f"peer closed after {got} of {n} bytes")
        got += k
    return buf


def _server_handshake(sock: socket.socket, secret: bytes) -> tuple[bytes, bytes]:
    """Prove each other; the (send, receive) keys of the server's end. The client speaks
    first, so a server that expects something else (TLS, another protocol) closes at once
    instead of both ends waiting for the other."""
    hello = _recv_exact(sock, len(MAGIC) + NONCE)
    if not hello.startswith(MAGIC):
        raise AuthenticationError("a client that is not a tierswap endpoint of this version")
    nc, ns = bytes(hello[len(MAGIC) :]), secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + ns)
    proof = bytes(_recv_exact(sock, 32))
    if not hmac.compare_digest(proof, _proof(secret, b"client", ns, nc)):
        sock.sendall(b"\0" * 32)  # a refusal the client can name, never a valid proof
        raise AuthenticationError("a client's proof does not match the job's secret")
    sock.sendall(_proof(secret, b"server", ns, nc))
    return frame_keys(secret, ns, nc)[0]


def _client_handshake(sock: socket.socket, secret: bytes, address: Address) -> tuple[bytes, bytes]:
    nc = secrets.token_bytes(NONCE)
    try:
        sock.sendall(MAGIC + nc)
        hello = _recv_exact(sock, len(MAGIC) + NONCE)
    except (EOFError, ConnectionResetError, BrokenPipeError):
        raise HandshakeCut(
            f"{address} closed the connection in the handshake: it died, it is not a tierswap "
            "endpoint of this version, or it runs with another --tls"
        ) from None
    if not hello.startswith(MAGIC):
        raise AuthenticationError(
            f"{address} is not a tierswap endpoint of this version (it said {bytes(hello)[:24]!r})"
        )
    ns = bytes(hello[len(MAGIC) :])
    try:
        sock.sendall(_proof(secret, b"client", ns, nc))
        proof = bytes(_recv_exact(sock, 32))
    except (EOFError, ConnectionResetError, BrokenPipeError):
        raise HandshakeCut(f"{address} closed the connection before proving itself") from None
    if not hmac.compare_digest(proof, _proof(secret, b"server", ns, nc)):
        raise AuthenticationError(
            f"{address} refused this process, or does not know the job's secret: both ends "
            "must be given the same secret (TIERSWAP_SECRET or --secret-file)"
        )
    return frame_keys(secret, ns, nc)[1]


def _host(address: Address) -> str | None:
    return None if isinstance(address, str) else address[0]


def _family(address: Address) -> socket.AddressFamily:
    if isinstance(address, str):
        return socket.AF_UNIX
    return socket.AF_INET6 if ":" in address[0] else socket.AF_INET


def _start_tls(sock: socket.socket, secret: bytes, address: Address) -> ssl.SSLSocket:
    try:
        return _tls.client_context(secret).wrap_socket(sock)
    except ssl.SSLCertVerificationError as e:
        raise AuthenticationError(
            f"{address} presented a TLS certificate that is not this job's: it does not "
            f"know the job's secret ({e.verify_message})"
        ) from None
    except (ssl.SSLError, ConnectionResetError) as e:
        why = e.reason if isinstance(e, ssl.SSLError) else e.strerror
        raise HandshakeCut(
            f"TLS with {address} failed ({why or e}): both ends must run with the same "
            "--tls, and the server must be a tierswap endpoint"
        ) from None


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
        self._sock: socket.socket | None = socket.socket(_family(address), socket.SOCK_STREAM)
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
        deadline = _Deadline(sock, HANDSHAKE_TIMEOUT)
        try:
            peer = sock.getpeername()
            if _tls.wanted(self.tls, peer[0] if isinstance(peer, tuple) else None):
                sock = _tls.server_context(self.secret).wrap_socket(sock, server_side=True)
            keys = _server_handshake(sock, self.secret)
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
        sock = socket.socket(_family(address), socket.SOCK_STREAM)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
        deadline = _Deadline(sock, HANDSHAKE_TIMEOUT)
        try:
            if _tls.wanted(tls, _host(address)):
                sock = _start_tls(sock, secret, address)
            keys = _client_handshake(sock, secret, address)
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
            n = int.from_bytes(_recv_exact(self.sock, HEADER), "big")
            if n > MAX_FRAME:
                self._refused = f"bad message length: a frame of {n} bytes, over the bound"
                raise OSError(self._refused)
            if n < TAG:
                self._refused = f"a frame of {n} bytes is shorter than its MAC"
                raise ProtocolError(self._refused)
            frame = _recv_exact(self.sock, n)
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
        copy, at the speed of the socket."""
        with self._send_lock:
            self.sock.sendall(data)

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
                n = self.sock.recv_into(buf[got:], min(len(buf) - got, 1 << 24), flags)
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


def pair(a_incoming: Any, b_incoming: Any) -> tuple[Channel, Channel]:
    """Two connected channels in this process (tests, benches), keyed as a handshake
    would key them."""
    x, y = socket.socketpair()
    server, client = frame_keys(
        secrets.token_bytes(32), secrets.token_bytes(NONCE), secrets.token_bytes(NONCE)
    )
    return Channel(x, a_incoming, server), Channel(y, b_incoming, client)


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
            with socket.socket(_family(address), socket.SOCK_STREAM) as wake:
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
"""Connections the kernel queues for a listener (a burst of hosts connecting at a job's
start must not be dropped)."""
ACCEPT_BACKOFF_MAX = 0.5
"""The longest wait before accepting again after accept failed (no descriptor left)."""
MAX_FRAME = 64 << 20
"""The largest frame a channel reads (bytes); a longer one closes it unread (bulk bytes
go raw, outside frames)."""


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

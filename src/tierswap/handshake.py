"""The handshake that opens every connection of the job, and the frame keys it leaves.

A connection starts with a handshake in which each end proves it knows the job's secret
(HMAC-SHA256 over both ends' fresh nonces), so a process outside the job cannot connect.
The same nonces give each direction its own frame key (``frame_keys``), with which
``wire.py`` seals and checks every frame after the handshake. Where ``--tls`` wants it,
the handshake runs inside TLS (``tls.py``), and a server whose certificate is not the
job's is named as such. The whole handshake of a connection has a deadline
(``Deadline``), so that a peer that trickles its bytes cannot hold a server's slot.

Nothing here knows about messages or channels: ``wire.Listener`` and ``Channel.connect``
run these steps on a fresh socket and build a channel from the keys they return.
"""

from __future__ import annotations

import contextlib
import hmac
import multiprocessing
import os
import secrets
import socket
import ssl
import threading

from tierswap import tls as _tls

MAGIC = b"tierswap wire 1\n"
"""What a server says first: the protocol and its version."""
NONCE = 32
"""Bytes of each end's fresh nonce."""


class AuthenticationError(multiprocessing.AuthenticationError):
    """The other end does not know the job's secret (or is not a tierswap endpoint)."""


class HandshakeCut(AuthenticationError, ConnectionError):
    """The other end closed (or reset) the connection before proving itself: a peer that
    died, or one that speaks another protocol or another ``--tls``. An ``OSError``, so
    that callers which fall back on a dead peer fall back on this one too."""


class Deadline:
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
        """The handshake is over, done or failed: the watchdog stands down."""
        self._timer.cancel()
        self._watch.close()


def frame_keys(
    secret: bytes, server_nonce: bytes, client_nonce: bytes
) -> tuple[tuple[bytes, bytes], tuple[bytes, bytes]]:
    """(server's (send, receive) keys, client's (send, receive) keys) of one connection."""
    base = hmac.digest(secret, b"tierswap frames" + server_nonce + client_nonce, "sha256")
    to_client = hmac.digest(base, b"server to client", "sha256")
    to_server = hmac.digest(base, b"client to server", "sha256")
    return (to_client, to_server), (to_server, to_client)


def _proof(secret: bytes, who: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What ``who`` (client or server) sends to prove it knows the secret."""
    return hmac.digest(secret, b"tierswap " + who + server_nonce + client_nonce, "sha256")


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes from ``sock`` (the handshake's and every frame's reads); EOFError
    when the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 24))
        if k == 0:
            raise EOFError(f"peer closed after {got} of {n} bytes")
        got += k
    return buf


def as_server(sock: socket.socket, secret: bytes) -> tuple[bytes, bytes]:
    """Prove each other; the (send, receive) keys of the server's end. The client speaks
    first, so a server that expects something else (TLS, another protocol) closes at once
    instead of both ends waiting for the other."""
    hello = recv_exact(sock, len(MAGIC) + NONCE)
    if not hello.startswith(MAGIC):
        raise AuthenticationError("a client that is not a tierswap endpoint of this version")
    nc, ns = bytes(hello[len(MAGIC) :]), secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + ns)
    proof = bytes(recv_exact(sock, 32))
    if not hmac.compare_digest(proof, _proof(secret, b"client", ns, nc)):
        sock.sendall(b"\0" * 32)  # a refusal the client can name, never a valid proof
        raise AuthenticationError("a client's proof does not match the job's secret")
    sock.sendall(_proof(secret, b"server", ns, nc))
    return frame_keys(secret, ns, nc)[0]


def _where(address: object) -> str:
    """``host:port`` of a socket address (``[host]:port`` for IPv6), anything else as is."""
    if isinstance(address, tuple) and len(address) >= 2:
        host = str(address[0])
        return f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"
    return str(address)


def as_client(sock: socket.socket, secret: bytes, address: object) -> tuple[bytes, bytes]:
    """Prove each other; the (send, receive) keys of the client's end. ``address`` is the
    server's, named in errors: one that closes mid-way is a ``HandshakeCut``, one that
    cannot prove itself an ``AuthenticationError``."""
    where = _where(address)
    nc = secrets.token_bytes(NONCE)
    try:
        sock.sendall(MAGIC + nc)
        hello = recv_exact(sock, len(MAGIC) + NONCE)
    except (EOFError, ConnectionResetError, BrokenPipeError):
        raise HandshakeCut(
            f"{where} closed the connection in the handshake: it died, it is not a tierswap "
            "endpoint of this version, or it runs with another --tls"
        ) from None
    if not hello.startswith(MAGIC):
        raise AuthenticationError(
            f"{where} is not a tierswap endpoint of this version (it said {bytes(hello)[:24]!r})"
        )
    ns = bytes(hello[len(MAGIC) :])
    try:
        sock.sendall(_proof(secret, b"client", ns, nc))
        proof = bytes(recv_exact(sock, 32))
    except (EOFError, ConnectionResetError, BrokenPipeError):
        raise HandshakeCut(f"{where} closed the connection before proving itself") from None
    if not hmac.compare_digest(proof, _proof(secret, b"server", ns, nc)):
        raise AuthenticationError(
            f"{where} refused this process, or does not know the job's secret: both ends "
            "must be given the same secret (TIERSWAP_SECRET or --secret-file)"
        )
    return frame_keys(secret, ns, nc)[1]


def start_tls(sock: socket.socket, secret: bytes, address: object) -> ssl.SSLSocket:
    """``sock`` wrapped in TLS as the job's client of the server at ``address``: a server
    without the job's certificate is an ``AuthenticationError``, a TLS that fails (the
    other end runs with another ``--tls``) a ``HandshakeCut``."""
    where = _where(address)
    try:
        return _tls.client_context(secret).wrap_socket(sock)
    except ssl.SSLCertVerificationError as e:
        raise AuthenticationError(
            f"{where} presented a TLS certificate that is not this job's: it does not "
            f"know the job's secret ({e.verify_message})"
        ) from None
    except (ssl.SSLError, ConnectionResetError) as e:
        why = e.reason if isinstance(e, ssl.SSLError) else e.strerror
        raise HandshakeCut(
            f"TLS with {where} failed ({why or e}): both ends must run with the same "
            "--tls, and the server must be a tierswap endpoint"
        ) from None

"""Messages over authenticated sockets: typed messages in and out, strangers refused."""

from __future__ import annotations

import contextlib
import pickle
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError, Pipe
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

import pytest

from tierswap.control import protocol as p
from tierswap.wire import BACKLOG, Channel, reader, serve

pytestmark = pytest.mark.timeout(30)


class Ping(p.Message, frozen=True, kw_only=True, tag="test_ping"):
    n: int
    echo: Any = None


class Fail(p.Message, frozen=True, kw_only=True, tag="test_fail"):
    pass


class Hush(p.Message, frozen=True, kw_only=True, tag="test_hush"):
    pass


class Pong(p.Message, frozen=True, kw_only=True, tag="test_pong"):
    n: int
    echo: Any = None


Requests = Ping | Fail | Hush
Replies = Pong | p.Error


class EchoServer:
    """A loopback server that answers ``Ping`` with ``Pong``, ``Fail`` with an error, and
    keeps silent on ``Hush``; it records every message and every closed channel."""

    def __init__(self) -> None:
        self.secret = secrets.token_bytes(32)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.secret, backlog=BACKLOG)
        self.address: tuple[str, int] = self.listener.address
        self.got: list[p.Message] = []
        self.closed = threading.Event()
        serve(self.listener, self._on_channel, "test-accept", Requests)

    def _on_channel(self, chan: Channel) -> None:
        def deliver(env: p.Envelope[Any] | None) -> None:
            if env is None:
                self.closed.set()
                return
            self.got.append(env.msg)
            match env.msg:
                case Ping(n=n, echo=echo):
                    chan.send(Pong(n=n + 1, echo=echo), gen=env.gen)
                case Fail():
                    chan.send(p.Error(message="no such thing"))

        reader(chan, deliver, "test-reader")

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def server() -> Iterator[EchoServer]:
    srv = EchoServer()
    yield srv
    srv.close()


def _connect(server: EchoServer, secret: bytes | None = None) -> Channel:
    return Channel.connect(server.address, secret or server.secret, Replies)


def test_call_and_reply(server: EchoServer) -> None:
    chan = _connect(server)
    try:
        payload = {"α": [1, 2.5, None, True], "nested": {"k": "v"}}
        reply = chan.call(Ping(n=41, echo=payload), Pong, timeout=10)
        assert reply == Pong(n=42, echo=payload)
        assert chan.call(Ping(n=1), Pong, timeout=10).n == 2  # replies come in order
        assert server.got[0] == Ping(n=41, echo=payload)
    finally:
        chan.close()
    assert server.closed.wait(10)  # the server's reader sees the channel close


def test_error_reply_raises(server: EchoServer) -> None:
    chan = _connect(server)
    try:
        with pytest.raises(RuntimeError, match="'test_fail' failed: no such thing"):
            chan.call(Fail(), Pong, timeout=10)
    finally:
        chan.close()


def test_call_times_out_naming_the_request(server: EchoServer) -> None:
    chan = _connect(server)
    try:
        with pytest.raises(TimeoutError, match="no reply to 'test_hush' within"):
            chan.call(Hush(), Pong, timeout=0.2)
        assert chan.recv(timeout=0.05) is None
    finally:
        chan.close()


def test_wrong_secret_is_refused(server: EchoServer) -> None:
    # a process outside the job does not know the secret
    with pytest.raises(AuthenticationError):
        _connect(server, secrets.token_bytes(32))
    assert server.got == []
    # the server keeps serving the job after refusing a stranger
    chan = _connect(server)
    try:
        assert chan.call(Ping(n=0), Pong, timeout=10) == Pong(n=1)
    finally:
        chan.close()


class _Boom:
    """Unpickling this creates a marker file: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_pickle_from_a_peer_is_never_unpickled(server: EchoServer, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    conn = Client(server.address, authkey=server.secret)
    try:
        conn.send_bytes(pickle.dumps(_Boom(marker)))
        conn.send_bytes(p.Codec.encode(Ping(n=0), 0))  # not read: the channel is closed
    finally:
        conn.close()
    assert server.closed.wait(10)
    assert server.got == [] and not marker.exists()


@pytest.mark.parametrize(
    "raw",
    [
        b"[1, 2]",
        b'{"op": "test_ping", "n": 0}',  # JSON, not the codec's msgpack
        p.Codec.encode(Pong(n=1), 0),  # a message of another channel
        p.Codec.encode(p.Held(tier=0, step=1), 0),
        p.Codec.encode(Ping(n=1), 0)[:-1],  # truncated
    ],
)
def test_malformed_messages_are_rejected(raw: bytes) -> None:
    a, b = _pipe()
    try:
        a.conn.send_bytes(raw)
        with pytest.raises(p.ProtocolError, match="not a message of this channel"):
            b.recv(timeout=5)
    finally:
        a.close()
        b.close()


def test_recv_raises_eof_when_peer_is_gone() -> None:
    a, b = _pipe()
    a.close()
    try:
        with pytest.raises(EOFError):
            b.recv(timeout=5)
    finally:
        b.close()


def _pipe() -> tuple[Channel, Channel]:
    x, y = Pipe()
    return Channel(x, Replies), Channel(y, Requests)


def test_a_silent_client_does_not_block_the_job() -> None:
    """An outsider that connects and says nothing must not stop peers from connecting."""
    got: list[Channel] = []
    listener = Listener(("127.0.0.1", 0), authkey=b"job-secret")
    stop = serve(listener, got.append, "test-silent", Requests)
    try:
        with socket.create_connection(listener.address):  # connects, sends nothing
            chan = Channel.connect(listener.address, b"job-secret", Replies)
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)
            assert got, "the job's own client was not served while an outsider sat idle"
            chan.close()
    finally:
        stop()
        for c in got:
            c.close()


_FLOODED = """
import resource, sys, time
sys.path.insert(0, sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
import test_wire
srv = test_wire.EchoServer()
print(srv.address[1], srv.secret.hex(), flush=True)
time.sleep(60)
"""


def test_a_server_out_of_descriptors_keeps_accepting_once_they_free(tmp_path: Path) -> None:
    """Issue 14: a burst of connections up to the process's file limit stopped the
    servers from ever accepting again (the accept loop ended on any OSError)."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", _FLOODED, str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        port, secret = child.stdout.readline().split()
        flood = []
        for _ in range(60):
            with contextlib.suppress(OSError):
                flood.append(socket.create_connection(("127.0.0.1", int(port)), timeout=2))
        time.sleep(1.0)  # the server hits EMFILE accepting them
        for s in flood:
            s.close()
        deadline = time.monotonic() + 20
        while True:  # the handshakes of the closed sockets fail, their descriptors free
            try:
                chan = Channel.connect(("127.0.0.1", int(port)), bytes.fromhex(secret), Replies)
                assert chan.call(Ping(n=1), Pong, timeout=5) == Pong(n=2)
                chan.close()
                break
            except (OSError, EOFError, TimeoutError):
                assert time.monotonic() < deadline, "the server never accepted again"
                time.sleep(0.2)
    finally:
        child.kill()
        child.wait()


def test_a_frame_longer_than_the_bound_closes_the_channel_unread() -> None:
    from tierswap import wire

    a, b = _pipe()

    def send() -> None:  # the reader refuses it unread: the sender is left blocked
        with contextlib.suppress(OSError):
            a.conn.send_bytes(b"\0" * (wire.MAX_FRAME + 1))

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        with pytest.raises(OSError, match="bad message length"):
            b.recv(timeout=5)
    finally:
        b.close()
        a.close()

"""Messages over authenticated sockets: typed messages in and out, strangers refused."""

from __future__ import annotations

import contextlib
import pickle
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from pathlib import Path
from typing import Any

import pytest

from tierswap import handshake, wire
from tierswap.control import protocol as p
from tierswap.serving import Server, reader, serve
from tierswap.wire import Channel, Listener

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
        self.listener = Listener(("127.0.0.1", 0), self.secret)
        self.address = self.listener.tcp_address
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
    chan = _connect(server)  # a peer of the job, authenticated, that sends a pickle
    try:
        chan.send_encoded(pickle.dumps(_Boom(marker)))
        chan.send(Ping(n=0))  # not read: the channel is closed
    finally:
        chan.close()
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
        a.send_encoded(raw)  # sealed as a frame of the channel: the codec refuses it
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
    return wire.pair(Replies, Requests)


def test_a_silent_client_does_not_block_the_job() -> None:
    """An outsider that connects and says nothing must not stop peers from connecting."""
    got: list[Channel] = []
    listener = Listener(("127.0.0.1", 0), b"job-secret")
    stop = serve(listener, got.append, "test-silent", Requests)
    try:
        with socket.create_connection(listener.tcp_address):  # connects, sends nothing
            chan = Channel.connect(listener.tcp_address, b"job-secret", Replies)
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
            except (OSError, EOFError, TimeoutError, AuthenticationError):  # reset mid-way
                assert time.monotonic() < deadline, "the server never accepted again"
                time.sleep(0.2)
    finally:
        child.kill()
        child.wait()


def test_a_frame_longer_than_the_bound_closes_the_channel_unread() -> None:
    a, b = _pipe()

    def send() -> None:  # the reader refuses it unread: the sender is left blocked
        with contextlib.suppress(OSError):
            a.sock.sendall((wire.MAX_FRAME + 1).to_bytes(4, "big") + b"\0" * (1 << 20))

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        with pytest.raises(OSError, match="bad message length"):
            b.recv(timeout=5)
    finally:
        b.close()
        a.close()


# ------------------------------------------------------------------ frames under attack

Both = Requests | Replies
"""Both ends take every message, so that only the frame's MAC can refuse a frame."""


class _Tap:
    """Two channels with a man in the middle: what ``a`` sends arrives on ``wire_in``, raw,
    and what the test writes to ``wire_out`` is what ``b`` reads."""

    def __init__(self) -> None:
        server_keys, client_keys = handshake.frame_keys(
            secrets.token_bytes(32), secrets.token_bytes(32), secrets.token_bytes(32)
        )
        x, self.wire_in = socket.socketpair()
        y, self.wire_out = socket.socketpair()
        self.a = Channel(x, Both, client_keys)
        self.b = Channel(y, Both, server_keys)

    def frame_of(self, msg: p.Message) -> bytes:
        """What ``a`` puts on the wire when it sends ``msg``."""
        self.a.send(msg)
        n = int.from_bytes(_read(self.wire_in, 4), "big")
        return n.to_bytes(4, "big") + _read(self.wire_in, n)

    def close(self) -> None:
        for c in (self.a, self.b):
            c.close()
        self.wire_in.close()
        self.wire_out.close()


def _read(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        out += sock.recv(n - len(out))
    return out


@pytest.fixture
def tap() -> Iterator[_Tap]:
    t = _Tap()
    yield t
    t.close()


def test_frames_relayed_unchanged_are_read(tap: _Tap) -> None:
    f1, f2 = tap.frame_of(Ping(n=1)), tap.frame_of(Ping(n=2))
    tap.wire_out.sendall(f1 + f2)
    got = [tap.b.recv(timeout=5), tap.b.recv(timeout=5)]
    assert [e.msg for e in got if e is not None] == [Ping(n=1), Ping(n=2)]


def _refused(chan: Channel) -> None:
    with pytest.raises(p.ProtocolError, match="failed authentication"):
        chan.recv(timeout=5)


def test_a_replayed_frame_is_refused(tap: _Tap) -> None:
    f1 = tap.frame_of(Ping(n=1))
    tap.wire_out.sendall(f1 + f1)
    env = tap.b.recv(timeout=5)
    assert env is not None and env.msg == Ping(n=1)
    _refused(tap.b)


def test_frames_out_of_order_are_refused(tap: _Tap) -> None:
    f1, f2 = tap.frame_of(Ping(n=1)), tap.frame_of(Ping(n=2))
    tap.wire_out.sendall(f2 + f1)
    _refused(tap.b)


@pytest.mark.parametrize("where", [4, 8, -17, -1])  # payload start, middle, its end, the MAC
def test_a_flipped_bit_is_refused(tap: _Tap, where: int) -> None:
    frame = bytearray(tap.frame_of(Ping(n=1, echo="a payload of some length")))
    frame[where] ^= 0x01
    tap.wire_out.sendall(frame)
    _refused(tap.b)


def test_a_frame_reflected_to_its_sender_is_refused(tap: _Tap) -> None:
    # b's first frame has the sequence number b expects first: only the direction's own
    # key tells it from a frame of a
    tap.b.send(Ping(n=1))
    n = int.from_bytes(_read(tap.wire_out, 4), "big")
    tap.wire_out.sendall(n.to_bytes(4, "big") + _read(tap.wire_out, n))
    _refused(tap.b)


def test_an_injected_frame_and_everything_after_it_is_refused(tap: _Tap) -> None:
    forged = wire.Direction(secrets.token_bytes(32)).seal(p.Codec.encode(Ping(n=666), 0))
    good = tap.frame_of(Ping(n=1))
    tap.wire_out.sendall(forged + good)
    _refused(tap.b)
    with pytest.raises(p.ProtocolError, match="failed authentication"):  # it stays refused
        tap.b.recv(timeout=5)


def test_a_frame_shorter_than_its_mac_is_refused(tap: _Tap) -> None:
    tap.wire_out.sendall((3).to_bytes(4, "big") + b"abc")
    with pytest.raises(p.ProtocolError, match="shorter than its MAC"):
        tap.b.recv(timeout=5)


class _Proxy:
    """A host on the path between a client and a server: relays every byte both ways,
    and can put bytes of its own into the stream to the server."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.listen = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.listen.getsockname()[:2]
        self.upstream = upstream
        self.to_server: socket.socket | None = None
        self.seen = bytearray()
        """Every byte that passed, both ways."""
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listen.accept()
        server = socket.create_connection(self.upstream)
        self.to_server = server
        self.ready.set()
        for src, dst in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                self.seen += data
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listen.close()
        if self.to_server is not None:  # a shutdown wakes the pumps; a close would not
            with contextlib.suppress(OSError):
                self.to_server.shutdown(socket.SHUT_RDWR)
            self.to_server.close()


def test_a_host_on_the_path_cannot_inject_requests(server: EchoServer) -> None:
    """Issue 14: after the handshake, frames carried no MAC, so a host on the path could
    inject requests into an authenticated connection."""
    proxy = _Proxy(server.address)
    try:
        chan = Channel.connect(proxy.address, server.secret, Replies)  # relayed handshake
        assert chan.call(Ping(n=1), Pong, timeout=10) == Pong(n=2)  # the relay works
        assert proxy.ready.wait(5) and proxy.to_server is not None
        forged = wire.Direction(secrets.token_bytes(32)).seal(p.Codec.encode(Ping(n=666), 0))
        proxy.to_server.sendall(forged)
        assert server.closed.wait(10), "the server kept a connection that carried a forgery"
        assert server.got == [Ping(n=1)]
        chan.close()
    finally:
        proxy.close()


def test_a_stranger_that_is_not_a_tierswap_server_is_named() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        address = srv.getsockname()[:2]

        def answer() -> None:
            conn, _ = srv.accept()
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"\0" * 40)
                time.sleep(0.5)

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(AuthenticationError, match="is not a tierswap endpoint"):
            Channel.connect(address, b"job-secret", Replies)


def test_a_client_with_the_wrong_secret_is_told_why(server: EchoServer) -> None:
    with pytest.raises(AuthenticationError, match="same secret"):
        _connect(server, secrets.token_bytes(32))


def test_tls_is_wanted_off_loopback_unless_turned_off() -> None:
    from tierswap.tls import wanted

    assert not wanted("auto", "127.0.0.1") and not wanted("auto", "::1")
    assert not wanted("auto", "localhost") and not wanted("auto", None)  # None: Unix socket
    assert wanted("auto", "10.1.2.3") and wanted("auto", "node7.cluster")
    assert wanted("on", "127.0.0.1") and not wanted("on", None)
    assert not wanted("off", "10.1.2.3")
    with pytest.raises(ValueError, match="tls mode must be one of auto, on, off"):
        wanted("yes", "10.1.2.3")


def test_a_client_trickling_its_handshake_is_cut_off_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stranger that sends one byte just inside each read's timeout must not hold a
    handshake slot past the deadline of the whole handshake."""
    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT", 0.5)
    got: list[Channel] = []
    listener = Listener(("127.0.0.1", 0), b"job-secret")
    stop = serve(listener, got.append, "test-trickle", Requests)
    try:
        with socket.create_connection(listener.tcp_address) as s:
            t0 = time.monotonic()
            cut = False
            for byte in handshake.MAGIC * 4:
                try:
                    s.sendall(bytes([byte]))
                    time.sleep(0.3)  # under 0.5 s between bytes
                except OSError:
                    cut = True
                    break
            s.settimeout(3)
            with contextlib.suppress(OSError):
                cut = cut or s.recv(1) == b""  # the server closed it
            assert cut and time.monotonic() - t0 < 3, "the trickle held the handshake"
        assert got == []
    finally:
        stop()


class _Echo(Server):
    incoming = Requests
    name = "tierswap-test-echo"

    def handle(self, chan: Channel) -> None:
        while (env := chan.recv()) is not None:
            if isinstance(env.msg, Ping):
                chan.send(Pong(n=env.msg.n + 1))


def test_closing_a_server_cuts_the_connections_left_open_and_ends_their_threads() -> None:
    """A client (or a relay) that never closes its connection held a thread of the server
    for ever after ``close``: the CI found one left by a test, in the next test."""
    secret = secrets.token_bytes(32)
    srv = _Echo("127.0.0.1", secret)
    clients = [Channel.connect(srv.address, secret, Replies) for _ in range(3)]
    try:
        for chan in clients:
            assert chan.call(Ping(n=1), Pong, timeout=10) == Pong(n=2)
        serving = [t for t in threading.enumerate() if t.name == _Echo.name]
        assert len(serving) == 3
        t0 = time.monotonic()
        srv.close()
        assert time.monotonic() - t0 < 2
        assert not any(t.is_alive() for t in serving)
        for chan in clients:  # each client is told: its connection is gone
            with pytest.raises((EOFError, OSError)):
                chan.call(Ping(n=1), Pong, timeout=5)
        with pytest.raises(OSError):
            Channel.connect(srv.address, secret, Replies)
    finally:
        for chan in clients:
            chan.close()
        srv.close()  # twice is harmless


def _tls_pipe() -> tuple[Channel, Channel]:
    """Two channels over TLS on loopback, with the contexts a job derives from its secret."""
    from tierswap import tls

    secret = secrets.token_bytes(16)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    done: list[ssl.SSLSocket] = []
    t = threading.Thread(
        target=lambda: done.append(tls.server_context(secret).wrap_socket(server, True))
    )
    t.start()
    c = tls.client_context(secret).wrap_socket(client)
    t.join(10)
    keys = handshake.frame_keys(
        secrets.token_bytes(32), b"n" * handshake.NONCE, b"m" * handshake.NONCE
    )
    return Channel(c, Replies, keys[1]), Channel(done[0], Requests, keys[0])


@pytest.mark.parametrize("pipe", [_pipe, _tls_pipe], ids=["plain", "tls"])
def test_bulk_bytes_from_a_peer_that_goes_silent_give_up_after_the_idle_limit(pipe) -> None:
    """A sender gone without a reset (a dead machine) mid-transfer: the receiver stops
    waiting after ``idle`` seconds instead of TCP's keepalive (on TLS too, off loopback
    the default), and the channel reads on."""
    a, b = pipe()
    try:
        buf = memoryview(bytearray(1 << 20))
        a.send_raw(memoryview(b"x" * 1000))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"sent nothing for 0.3 s after 1000 of 1048576"):
            b.recv_raw_into(buf, idle=0.3)
        assert 0.25 < time.monotonic() - t0 < 5
        a.send_raw(memoryview(b"y" * 10))  # no limit left behind on the socket
        b.recv_raw_into(buf[:10])
        assert bytes(buf[:10]) == b"y" * 10
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit, ConnectionResetError])
def test_a_handshake_past_its_deadline_is_a_timeout_but_a_signals_exit_stays_itself(
    raised: type[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline's cut makes the handshake's read fail: that error reads as the
    timeout. A Ctrl-C or a SIGTERM's exit that lands then is not turned into one (a
    caller that retries on timeouts would swallow it)."""
    from tierswap import wire

    def slow(*args: object) -> None:
        time.sleep(0.3)  # past the deadline: it has cut the socket
        raise raised()

    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT", 0.1)
    monkeypatch.setattr(handshake, "as_client", slow)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        expected = TimeoutError if issubclass(raised, Exception) else raised
        with pytest.raises(expected):
            wire.Channel.connect(server.getsockname(), b"k" * 16, None)


class _Recorder:
    """A socket's ``sendall`` that keeps what each call was given."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def sendall(self, data: memoryview) -> None:
        self.pieces.append(bytes(data))


@pytest.mark.parametrize("pipe", [_pipe, _tls_pipe], ids=["plain", "tls"])
def test_bulk_bytes_go_in_pieces_of_bulk_piece_bytes_and_arrive_whole_from_any_format(
    pipe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bulk bytes go out in sends of at most ``BULK_PIECE`` bytes, counted in bytes even
    for a view of 4-byte items (as a tensor's is), and arrive whole, byte for byte."""
    import numpy as np

    monkeypatch.setattr(wire, "BULK_PIECE", 1001)
    values = np.arange(2600, dtype=np.float32)  # 10,400 bytes: 10 full pieces and a part
    a, b = pipe()
    try:
        real, rec = a.sock, _Recorder()
        a.sock = rec  # type: ignore[assignment]
        a.send_raw(memoryview(values))
        a.sock = real
        assert [len(p) for p in rec.pieces] == [1001] * 10 + [390]
        assert b"".join(rec.pieces) == values.tobytes()
        buf = memoryview(bytearray(values.nbytes))
        t = threading.Thread(target=b.recv_raw_into, args=(buf,))
        t.start()
        a.send_raw(memoryview(values))
        t.join(30)
        assert not t.is_alive()
        assert np.array_equal(np.frombuffer(buf, dtype=np.float32), values)
    finally:
        a.close()
        b.close()

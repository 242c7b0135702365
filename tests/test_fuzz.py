"""Every parser of an on-disk or on-wire format, fed generated garbage (issue 14): each
refuses it with its own error type (CorruptPartError for tier 2, ProtocolError for the
wire), never another exception, never a hang, never a whole root taken for empty."""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_durable import _write
from tierswap.control import protocol as p
from tierswap.errors import CorruptPartError
from tierswap.tiers import catalog, durable

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same inputs every run: CI is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)


def _mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, random JSON, and the valid file with bytes flipped, cut or padded."""
    flipped = st.tuples(st.integers(0, max(0, len(valid) - 1)), st.integers(1, 255)).map(
        lambda iv: valid[: iv[0]] + bytes([valid[iv[0]] ^ iv[1]]) + valid[iv[0] + 1 :]
    )
    cut = st.integers(0, len(valid)).map(lambda n: valid[:n])
    return st.one_of(
        st.binary(max_size=300),
        _json.map(lambda v: json.dumps(v).encode()),
        flipped,
        cut,
        st.binary(max_size=50).map(lambda b: valid + b),
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fuzz") / "root"
    _write(str(path), 1)
    _write(str(path), 2)
    return path


def _step(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def _restore(path: Path, data: bytes) -> None:
    path.write_bytes(data)


@FUZZ
@given(data=st.data())
def test_part_json_garbage_is_a_corrupt_part(root: Path, data: st.DataObject) -> None:
    path = _step(root, 2) / "rank-00000.json"
    valid = path.read_bytes()
    try:
        garbage = data.draw(_mutations(valid))
        path.write_bytes(garbage)
        try:
            durable.read_part(str(root), 2, 0)  # with no COMMIT to hold it against
        except CorruptPartError:
            pass
        _, parts = durable.read_commit(str(root), 2)
        if garbage != valid:  # held against COMMIT, any change is refused
            with pytest.raises(CorruptPartError):
                durable.read_part(str(root), 2, 0, parts[0])
    finally:
        _restore(path, valid)


@FUZZ
@given(data=st.data())
def test_commit_garbage_is_a_bad_step_and_hides_no_other(root: Path, data: st.DataObject) -> None:
    path = _step(root, 2) / "COMMIT"
    valid = path.read_bytes()
    try:
        path.write_bytes(data.draw(_mutations(valid)))
        steps = {s.step: s for s in catalog.list_steps(str(root))}
        assert steps[1].committed, "a bad COMMIT hid another step"
        if not steps[2].committed:
            assert steps[2].problem
            assert catalog.verify(str(root)), "verify passed a step it cannot read"
    finally:
        _restore(path, valid)


@FUZZ
@given(raw=st.binary(max_size=64) | st.integers().map(lambda n: f"{n}\n".encode()))
def test_latest_garbage_is_ignored(root: Path, raw: bytes) -> None:
    path = root / "LATEST"
    valid = path.read_bytes()
    try:
        path.write_bytes(raw)
        fs, base = durable.url_fs(str(root))
        got = durable._read_latest(fs, base)
        assert got is None or isinstance(got, int)
        assert [s.step for s in catalog.list_steps(str(root)) if s.committed] == [1, 2]
    finally:
        _restore(path, valid)


@FUZZ
@given(data=st.data())
def test_safetensors_header_garbage_is_a_corrupt_part(root: Path, data: st.DataObject) -> None:
    path = _step(root, 1) / "rank-00001.safetensors"
    valid = path.read_bytes()
    n = int.from_bytes(valid[:8], "little")
    head = valid[: 8 + n]
    try:
        new_head = data.draw(_mutations(head))
        path.write_bytes(new_head + valid[8 + n :])
        try:
            durable.read_part(str(root), 1, 1)
        except CorruptPartError:
            pass  # a header that still describes the layout and the bytes reads as before
    finally:
        _restore(path, valid)


@FUZZ
@given(raw=st.binary(max_size=400), gen=st.integers(-(2**40), 2**40))
def test_wire_garbage_is_a_protocol_error_on_every_channel(raw: bytes, gen: int) -> None:
    for union in p.CHANNELS.values():
        codec = p.Codec(union)
        for data in (raw, p.Codec.encode(p.Beat(), gen)[:-1] + raw[:5]):
            try:
                codec.decode(data)
            except p.ProtocolError:
                pass


@FUZZ
@given(
    raw=st.binary(max_size=200),
    length=st.none() | st.integers(0, 2**32 - 1),
)
def test_frame_garbage_on_an_authenticated_channel_is_refused(
    raw: bytes, length: int | None
) -> None:
    """Bytes a host on the path puts on an authenticated channel (a frame length of its
    choosing, then anything): never a message, only a refusal or the wait for more."""
    from tierswap import wire

    a, b = wire.pair(p.AgentToWorker, p.WorkerToAgent)
    try:
        n = len(raw) if length is None else length
        a.sock.sendall(n.to_bytes(4, "big") + raw)
        a.sock.shutdown(socket.SHUT_WR)  # no more: a short frame ends in EOF, not a wait
        with pytest.raises((p.ProtocolError, EOFError, OSError)):
            b.recv(timeout=5)
    finally:
        a.close()
        b.close()


def test_handshake_garbage_is_refused_and_the_server_goes_on() -> None:
    from test_wire import EchoServer, Ping, Pong, Replies
    from tierswap.wire import Channel

    srv = EchoServer()
    try:
        rng = secrets.SystemRandom()
        for _ in range(30):
            with socket.create_connection(srv.address, timeout=5) as s:
                s.sendall(rng.randbytes(rng.randint(0, 300)))
                s.settimeout(0.3)  # the server waits for a full hello: do not wait for it
                try:
                    s.recv(1024)
                except OSError:
                    pass
        done = threading.Event()

        def ping() -> None:
            chan = Channel.connect(srv.address, srv.secret, Replies)
            assert chan.call(Ping(n=1), Pong, timeout=10) == Pong(n=2)
            chan.close()
            done.set()

        t = threading.Thread(target=ping, daemon=True)
        t.start()
        t.join(30)
        assert done.is_set(), "the server stopped serving after the garbage"
        assert srv.got == [Ping(n=1)], "garbage was taken for a message"
    finally:
        srv.close()
        time.sleep(0.1)

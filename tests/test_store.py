"""The rendezvous store: torch's store semantics, on --bind only, behind the job's secret."""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing import AuthenticationError

import psutil
import pytest
import torch.distributed as dist

from tierswap.store import StoreClient, StoreServer

pytestmark = pytest.mark.timeout(60)
WAIT = timedelta(seconds=5)


@pytest.fixture
def server() -> Iterator[tuple[StoreServer, bytes]]:
    secret = secrets.token_bytes(32)
    srv = StoreServer("127.0.0.1", secret)
    yield srv, secret
    srv.close()


def test_every_operation_keeps_torchs_semantics(server: tuple[StoreServer, bytes]) -> None:
    srv, secret = server
    a, b = (StoreClient(srv.address, secret, WAIT) for _ in range(2))
    try:
        a.set("k", b"\x00\xffbinary")
        assert b.get("k") == b"\x00\xffbinary"
        a.set("s", "text")
        assert b.get("s") == b"text"
        assert a.add("n", 3) == 3 and b.add("n", 4) == 7 and a.add("n", 0) == 7
        assert a.compare_set("c", b"", b"first") == b"first"  # unset and expected empty
        assert b.compare_set("c", b"other", b"second") == b"first"  # no match: unchanged
        assert b.compare_set("c", b"first", b"second") == b"second"
        assert a.check(["k", "n"]) and not a.check(["k", "absent"])
        a.wait(["k", "c"])
        assert a.num_keys() == 4
        assert b.delete_key("k") and not b.delete_key("k")
        assert not a.check(["k"]) and a.num_keys() == 3
    finally:
        a.close()
        b.close()


def test_the_launchers_keys_follow_torchs_hash_store() -> None:
    """The server's keys without torch (the launcher never imports it), by HashStore's
    rules: counters as decimal strings, compare_set on an unset key, a wait of 0 for ever."""
    from tierswap.keystore import Keys, KeyTimeout

    k = Keys()
    assert k.add("n", -3) == -3 and k.add("n", 5) == 2
    k.set("e", b"")
    assert k.add("e", 1) == 1, "an empty value counts as 0"
    k.set("s", b"text")
    with pytest.raises(ValueError, match="not a counter"):
        k.add("s", 1)
    with pytest.raises(OverflowError, match="int64"):
        k.add("n", 2**63)
    assert k.get("n", 1.0) == b"2", "a failed add changed nothing"
    assert k.compare_set("c", b"x", b"y") == b"x" and not k.check(["c"])
    assert k.compare_set("c", b"", b"y") == b"y" and k.get("c", 1.0) == b"y"
    threading.Timer(0.2, lambda: k.set("late", b"1")).start()
    k.wait(["late", "c"], 0)  # 0: for ever, woken by the set
    t0 = time.monotonic()
    with pytest.raises(KeyTimeout, match="never"):
        k.wait(["never"], 0.2)
    assert 0.15 < time.monotonic() - t0 < 5
    assert k.delete_key("late") and not k.delete_key("late") and k.num_keys() == 4


def test_closing_the_store_ends_a_get_still_waiting_and_its_thread() -> None:
    """A worker blocked in a get held its server thread past the store's close."""
    secret = secrets.token_bytes(32)
    srv = StoreServer("127.0.0.1", secret)
    client = StoreClient(srv.address, secret, timedelta(seconds=60))
    failed: list[BaseException] = []

    def get() -> None:
        try:
            client.get("never")
        except Exception as e:
            failed.append(e)

    waiter = threading.Thread(target=get)
    try:
        waiter.start()
        deadline = time.monotonic() + 10
        while not [t for t in threading.enumerate() if t.name == StoreServer.name]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)  # the get is in the server's wait
        t0 = time.monotonic()
        srv.close()
        waiter.join(10)
        assert time.monotonic() - t0 < 3 and not waiter.is_alive()
        assert failed and isinstance(failed[0], dist.DistError), failed
        assert not [t for t in threading.enumerate() if t.name == StoreServer.name]
    finally:
        client.close()
        srv.close()


def test_a_get_waits_for_another_workers_set(server: tuple[StoreServer, bytes]) -> None:
    srv, secret = server
    a, b = (StoreClient(srv.address, secret, WAIT) for _ in range(2))
    try:
        threading.Timer(0.3, lambda: a.set("late", b"here")).start()
        t0 = time.monotonic()
        assert b.get("late") == b"here"
        assert time.monotonic() - t0 >= 0.25
    finally:
        a.close()
        b.close()


def test_a_wait_past_its_timeout_fails_naming_the_store(server: tuple[StoreServer, bytes]) -> None:
    srv, secret = server
    a = StoreClient(srv.address, secret, WAIT)
    try:
        with pytest.raises(dist.DistStoreError, match=r"store at .*'store_wait' failed"):
            a.wait(["never"], timedelta(seconds=0.2))
        a.set_timeout(timedelta(seconds=0.2))  # as torch's PrefixStore forwards it
        with pytest.raises(dist.DistStoreError, match="'store_get' failed"):
            a.get("never")
        assert a.add("after", 1) == 1  # the connection is still good
    finally:
        a.close()


def test_a_reply_that_comes_too_late_is_never_read_as_the_next_ones(
    server: tuple[StoreServer, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call the client gave up on (the server slower than the client waits) must not
    leave its reply to be read as the answer to the next call."""
    from tierswap import store

    srv, secret = server
    a = StoreClient(srv.address, secret, WAIT)
    try:
        monkeypatch.setattr(store, "SLACK_S", -0.2)  # the client waits 0.1 s of the 0.3
        with pytest.raises(dist.DistStoreError, match="TimeoutError"):
            a.wait(["never"], timedelta(seconds=0.3))
        monkeypatch.setattr(store, "SLACK_S", 30.0)
        time.sleep(0.4)  # the server's own timeout has sent its (late) error reply by now
        assert a.add("n", 5) == 5 and a.add("m", 1) == 1, "a late reply was misread"
    finally:
        a.close()


def test_a_store_that_cannot_be_reached_is_a_network_error_after_retrying() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = s.getsockname()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match="cannot be reached"):
        StoreClient(address, b"secret", timedelta(seconds=1))
    assert 0.8 <= time.monotonic() - t0 < 5, "it retried for its timeout, then gave up"


def test_a_process_without_the_secret_reaches_no_key(server: tuple[StoreServer, bytes]) -> None:
    """Issue 14: torch's TCPStore took reads and writes from anyone who connected."""
    srv, secret = server
    a = StoreClient(srv.address, secret, WAIT)
    try:
        a.set("nccl-id", b"secret bytes")
        with pytest.raises(AuthenticationError):
            StoreClient(srv.address, secrets.token_bytes(32), WAIT)
        with pytest.raises((RuntimeError, dist.DistError)):  # torch's client: no handshake
            dist.TCPStore(*srv.address, is_master=False, timeout=timedelta(seconds=0.5))
        assert a.num_keys() == 1 and a.get("nccl-id") == b"secret bytes"
    finally:
        a.close()


def test_the_store_listens_on_its_bind_address_only(server: tuple[StoreServer, bytes]) -> None:
    srv, _ = server
    port = srv.address[1]
    mine = [
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert mine == ["127.0.0.1"]


_WORKER = """
import sys, datetime, torch, torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore
from tierswap.store import StoreClient
host, port, secret = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
rank = int(sys.argv[4])
client = StoreClient((host, port), secret, datetime.timedelta(seconds=30))  # kept referenced
store = PrefixStore("gen0/", client)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
dist.barrier()
print(t.item(), flush=True)
dist.destroy_process_group()
"""


def test_two_workers_build_a_process_group_on_it(server: tuple[StoreServer, bytes]) -> None:
    srv, secret = server
    host, port = srv.address
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, host, str(port), secret.hex(), str(rank)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=50)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0]
    assert [float(o.split()[-1]) for o in outs] == [3.0, 3.0]


def test_rendezvous_is_one_decision_every_rank_follows(server: tuple[StoreServer, bytes]) -> None:
    """All ranks go, or all park: a rank that saw its generation end never parks while
    the others enter init_process_group (they would wait for it until their timeout)."""
    from concurrent.futures import ThreadPoolExecutor

    from torch._C._distributed_c10d import PrefixStore

    from tierswap.worker import _rendezvous

    srv, secret = server
    clients = [StoreClient(srv.address, secret, WAIT) for _ in range(3)]
    try:

        def arrive(gen: str, rank: int, ended: threading.Event) -> bool:
            store = PrefixStore(gen, clients[rank])
            return _rendezvous(store, 3, ended, timedelta(seconds=10))

        never = threading.Event()
        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(lambda r: arrive("g0/", r, never), range(3))) == [True] * 3

        ended = threading.Event()  # a member died while the others gathered
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(arrive, "g1/", r, ended) for r in range(2)]
            time.sleep(0.3)
            ended.set()
            assert [f.result(10) for f in waiting] == [False, False]
        assert arrive("g1/", 2, never) is False, "the last one in follows the decision made"

        late = threading.Event()  # the generation ends just after the last one arrived
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(arrive, "g2/", r, late) for r in range(2)]
            time.sleep(0.3)
            assert arrive("g2/", 2, never) is True
            late.set()
            assert [f.result(10) for f in waiting] == [True, True], "they follow the go"

        gone = threading.Event()  # the last one in already knows the generation ended
        gone.set()
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(arrive, "g3/", r, never) for r in range(2)]
            time.sleep(0.3)
            assert arrive("g3/", 2, gone) is False
            assert [f.result(10) for f in waiting] == [False, False]
    finally:
        for c in clients:
            c.close()


def test_a_worker_keeps_its_process_on_an_nccl_error_unless_the_user_chose_otherwise() -> None:
    """NCCL's watchdog ends the process on an error by default; a worker's groups abort
    their communicators instead, so that a survivor of a peer's death parks and stays."""
    from tierswap.worker import nccl_defaults

    env: dict[str, str] = {}
    nccl_defaults(env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    nccl_defaults(mine)
    assert mine == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}

"""Tier 1 in one process: where replicas go, and a real replica server that stores a
replica, serves it back bit for bit, and refuses strangers and corrupt bytes."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierswap.checksum import checksum_chunks
from tierswap.control import protocol as p
from tierswap.errors import CorruptPartError
from tierswap.shm import PREFIX, SHM_DIR
from tierswap.state import Layout, flatten, load, make_layout, tensor_view
from tierswap.tiers import peer
from tierswap.tiers.replicas import PeerStore
from tierswap.wire import Channel

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- placement


@st.composite
def _shapes(draw: st.DrawFn) -> tuple[int, int, int]:
    nodes = draw(st.integers(2, 12))
    nproc = draw(st.integers(1, 4))
    return nodes, nproc, draw(st.integers(0, nodes - 1))


def _survives(pl: dict[int, tuple[int, ...]], nproc: int, failed: set[int]) -> bool:
    """Every rank keeps a copy: its own node or one of its peers is still up."""
    return all(({r // nproc, *peers}) - failed for r, peers in pl.items())


@settings(max_examples=200, deadline=None)
@given(_shapes())
def test_placement_gives_every_rank_distinct_peers_off_its_node(
    shape: tuple[int, int, int],
) -> None:
    nodes, nproc, replicas = shape
    pl = peer.placement(nodes, nproc, replicas)
    assert sorted(pl) == list(range(nodes * nproc))
    for rank, peers in pl.items():
        assert rank // nproc not in peers, f"rank {rank} replicated onto its own node"
        assert len(set(peers)) == len(peers) == replicas
        assert all(0 <= p < nodes for p in peers)


@settings(max_examples=100, deadline=None)
@given(_shapes(), st.data())
def test_placement_survives_any_replicas_failed_nodes(
    shape: tuple[int, int, int], data: st.DataObject
) -> None:
    nodes, nproc, replicas = shape
    failed = data.draw(st.sets(st.integers(0, nodes - 1), min_size=replicas, max_size=replicas))
    assert _survives(peer.placement(nodes, nproc, replicas), nproc, failed)


@pytest.mark.parametrize("nodes", range(2, 8))
def test_placement_survives_every_set_of_replicas_failed_nodes(nodes: int) -> None:
    for nproc, replicas in itertools.product(range(1, 5), range(nodes)):
        pl = peer.placement(nodes, nproc, replicas)
        for failed in itertools.combinations(range(nodes), replicas):
            assert _survives(pl, nproc, set(failed)), (nodes, nproc, replicas, failed)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 12), st.data())
def test_ranks_of_one_node_restore_from_distinct_peers(nodes: int, data: st.DataObject) -> None:
    nproc = data.draw(st.integers(1, nodes - 1))
    pl = peer.placement(nodes, nproc, 1)
    for node in range(nodes):
        peers = [pl[node * nproc + i][0] for i in range(nproc)]
        assert len(set(peers)) == nproc, f"node {node}'s ranks share a peer: {peers}"


@given(st.integers(1, 12), st.integers(1, 4), st.integers(1, 5))
def test_more_replicas_than_other_nodes_is_refused(nodes: int, nproc: int, extra: int) -> None:
    with pytest.raises(ValueError, match="--replicas"):
        peer.placement(nodes, nproc, nodes - 1 + extra)


def test_negative_replicas_are_refused() -> None:
    with pytest.raises(ValueError, match="replicas"):
        peer.placement(3, 1, -1)


# ---------------------------------------------------------------- a real replica server


def _segments(job_id: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}{job_id}-*"))


class _Agent:
    """The agent's side of the server: a PeerStore whose calls run one at a time, as on
    the agent's event loop, and the reports it makes."""

    def __init__(self, job_id: str, mode: str = "full") -> None:
        self.reports: list[tuple[str, dict[str, Any]]] = []
        self.store = PeerStore(job_id, nslots=2, max_bytes=0, report=self._report, mode=mode)
        self.lock = threading.Lock()

    def _report(self, msg: p.Message, gen: int) -> None:
        self.reports.append((p.tag_of(msg), {**msgspec.structs.asdict(msg), "generation": gen}))

    def ask(self, op: str, **fields: Any) -> Any:
        handlers: dict[str, Any] = {
            "replica_slot": self.store.slot,
            "replica_received": self.store.received,
            "replica_written": self.store.written,
            "replica_lease": self.store.lease,
            "replica_unlease": self.store.unlease,
            "replica_base": self.store.base,
            "replica_delta_written": self.store.delta_written,
            "replica_served": lambda **f: self._report(p.ReplicaServed(**f), -1),
        }
        with self.lock:
            return handlers[op](**fields)

    def ops(self) -> list[str]:
        return [op for op, _ in self.reports]


class _Server:
    def __init__(
        self, agent: _Agent, server: peer.ReplicaServer, secret: bytes, tls: str = "off"
    ) -> None:
        self.agent, self.server, self.secret, self.tls = agent, server, secret, tls

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def push(
        self, rank: int, step: int, replica: _Replica, address: tuple[str, int] | None = None
    ) -> bool:
        chan = peer.connect(address or self.address, self.secret, self.tls)
        try:
            return peer.push(
                chan, rank, step, replica.layout, replica.tree, replica.checksum, replica.view
            )
        finally:
            chan.close()


@pytest.fixture
def server() -> Iterator[_Server]:
    """A replica server on loopback over a PeerStore of a job of its own; its segments
    are gone after the test."""
    yield from serve_store("full")


def serve_store(mode: str, tls: str = "off") -> Iterator[_Server]:
    job_id = f"test-{uuid.uuid4().hex[:12]}"
    agent = _Agent(job_id, mode)
    secret = secrets.token_bytes(16)
    srv = peer.ReplicaServer("127.0.0.1", secret, agent.ask, tls=tls)
    try:
        yield _Server(agent, srv, secret, tls)
    finally:
        srv.close()
        with agent.lock:
            agent.store.close()
        assert _segments(job_id) == []


class _Replica:
    """A rank's snapshot as a peer sends it: layout, tree, bytes, checksum."""

    def __init__(self, state: dict[str, Any]) -> None:
        flat = flatten(state, with_rng=False)
        self.tree = flat.tree
        self.layout = make_layout(flat)
        self.buf = bytearray(self.layout.nbytes)
        self.view = memoryview(self.buf)
        for e, t in zip(self.layout.entries, flat.tensors, strict=True):
            tensor_view(self.view, e).copy_(t)
        self.checksum = checksum_chunks(self.layout.chunks(self.view))


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 33, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "n": torch.randint(0, 1000, (5,), generator=g),
        "step": seed,
    }


def _loaded(layout: Layout, tree: dict[str, Any], buf: bytearray) -> dict[str, Any]:
    into: dict[str, Any] = {"w": torch.zeros(64, 33), "b": torch.zeros(7, dtype=torch.bfloat16)}
    into |= {"n": torch.zeros(5, dtype=torch.int64), "step": -1}
    views = [tensor_view(memoryview(buf), e) for e in layout.entries]
    load(into, tree, views, layout)
    return into


def test_pushed_replica_is_fetched_back_bit_identical(server: _Server) -> None:
    state = _state(3)
    replica = _Replica(state)

    assert server.push(rank=5, step=3, replica=replica)

    layout, tree, buf = peer.fetch(server.address, server.secret, rank=5, step=3)
    assert layout == replica.layout
    assert bytes(buf) == bytes(replica.buf)
    got = _loaded(layout, tree, buf)
    for key in ("w", "b", "n"):
        assert got[key].dtype == state[key].dtype
        assert torch.equal(got[key].view(torch.uint8), state[key].view(torch.uint8)), key
    assert got["step"] == 3
    assert server.agent.store.holdings()[5] == {3: replica.checksum}


def test_newer_replica_replaces_the_oldest_and_both_newest_are_served(server: _Server) -> None:
    replicas = {step: _Replica(_state(step)) for step in (1, 2, 3)}
    for step, replica in replicas.items():
        assert server.push(rank=0, step=step, replica=replica)

    for step in (2, 3):
        _, _, buf = peer.fetch(server.address, server.secret, rank=0, step=step)
        assert bytes(buf) == bytes(replicas[step].buf)
    with pytest.raises(CorruptPartError, match="no longer holds"):
        peer.fetch(server.address, server.secret, rank=0, step=1)


def test_wrong_secret_is_refused_and_the_server_keeps_serving(server: _Server) -> None:
    with pytest.raises(multiprocessing.AuthenticationError):
        Channel.connect(server.address, b"not the job's secret", p.AgentToAgent)
    with pytest.raises(multiprocessing.AuthenticationError):
        peer.fetch(server.address, b"not the job's secret", rank=0, step=1)

    replica = _Replica(_state(1))
    assert server.push(rank=0, step=1, replica=replica)
    _, _, buf = peer.fetch(server.address, server.secret, rank=0, step=1)
    assert bytes(buf) == bytes(replica.buf)


def test_replica_not_matching_its_checksum_is_rejected_and_not_served(server: _Server) -> None:
    replica = _Replica(_state(2))
    replica.buf[len(replica.buf) // 2] ^= 0x01  # after the checksum: corrupted in flight

    assert not server.push(rank=1, step=2, replica=replica)

    with pytest.raises(CorruptPartError, match="rank 1 step 2"):
        peer.fetch(server.address, server.secret, rank=1, step=2)
    rejected = [f for op, f in server.agent.reports if op == "replica_rejected"]
    assert rejected == [{"rank": 1, "step": 2, "why": "checksum mismatch", "generation": -1}]
    assert server.agent.store.holdings().get(1, {}) == {}


def test_transfer_cut_off_is_not_held_and_the_step_can_be_sent_again(server: _Server) -> None:
    replica = _Replica(_state(6))
    chan = peer.connect(server.address, server.secret)
    msg = p.Replica(
        rank=2, step=6, layout=replica.layout, tree=replica.tree, checksum=replica.checksum
    )
    assert chan.call(msg, p.Room).ok
    chan.send_raw(replica.view[: replica.layout.nbytes // 2])
    chan.close()  # the sender dies mid-transfer
    deadline = time.monotonic() + 10
    while "replica_rejected" not in server.agent.ops():
        assert time.monotonic() < deadline, f"no rejection reported: {server.agent.reports}"
        time.sleep(0.01)

    with pytest.raises(CorruptPartError, match="rank 2 step 6"):
        peer.fetch(server.address, server.secret, rank=2, step=6)
    assert server.push(rank=2, step=6, replica=replica)
    _, _, buf = peer.fetch(server.address, server.secret, rank=2, step=6)
    assert bytes(buf) == bytes(replica.buf)


def test_fetch_of_a_step_not_held_raises_corrupt_part(server: _Server) -> None:
    assert server.push(rank=0, step=4, replica=_Replica(_state(4)))

    with pytest.raises(CorruptPartError, match="step 5"):
        peer.fetch(server.address, server.secret, rank=0, step=5)
    with pytest.raises(CorruptPartError, match="rank 9"):
        peer.fetch(server.address, server.secret, rank=9, step=4)


# ---------------------------------------------------------------- the bench


def _bench_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{PREFIX}bench-*")}


@pytest.mark.timeout(60)
def test_bench_replication_measures_every_section_and_cleans_up(tmp_path: Path) -> None:
    from tierswap import bench
    from tierswap.bench import replication

    before, threads = _bench_segments(), set(threading.enumerate())
    out = tmp_path / "bench.json"
    args = argparse.Namespace(what="replication", size_mib=4, repeats=2, json=str(out))

    assert bench.main(args) == 0

    res = json.loads(out.read_text())
    for section in ("push", "stream"):
        stats = res["replication"][section]["bps"]
        assert len(stats["samples"]) == 2 and stats["min"] > 0, section
        # each end's CPU: the server's is its own clock, asked over its stdin, and moving
        # bytes costs both ends something
        for end in ("sender", "receiver"):
            cpu = res["replication"][section][f"{end}_cpu_s_per_gib"]
            assert len(cpu["samples"]) == 2 and cpu["max"] > 0, (section, end)
    assert res["replication"]["checksum"]["cpu_s_per_gib"]["max"] > 0
    for method in ("peer", "durable_cold", "durable_warm"):
        for key in ("total", "read", "load"):
            stats = res["restore"][method][key]
            assert len(stats["samples"]) == 2 and stats["min"] > 0, (method, key)
    assert res["replication"]["nbytes"] >= 4 << 20
    assert all(v > 0 and math.isfinite(v) for v in res["ratios"].values())
    assert set(res["ratios"]) >= set(replication.TARGETS)
    assert not list(SHM_DIR.glob(f"{PREFIX}{res['config']['job_id']}-*"))
    assert _bench_segments() <= before
    assert not Path(res["config"]["disk_dir"]).exists()
    assert not multiprocessing.active_children()
    assert set(threading.enumerate()) <= threads
    pid = res["config"]["server_pid"]
    assert not Path(f"/proc/{pid}").exists(), "the peer server process is still there"


@pytest.mark.parametrize("tls", ["off", "on"])
def test_replicas_over_tls_arrive_whole_and_cannot_be_read_on_the_way(tls: str) -> None:
    """Issue 14: replica bytes crossed the network in the clear. With TLS a host on the
    path sees none of them; without it (the control: the test can see them) it does."""
    from test_wire import _Proxy

    for srv in serve_store("full", tls):
        replica = _Replica(_state(7))
        proxy = _Proxy(srv.address)
        try:
            assert srv.push(rank=0, step=7, replica=replica, address=proxy.address)
        finally:
            proxy.close()
        _, _, buf = peer.fetch(srv.address, srv.secret, rank=0, step=7, tls=tls)
        assert bytes(buf) == bytes(replica.view)
        sample = bytes(replica.view[1024:1088])  # 64 bytes of the replica's tensors
        assert (sample in proxy.seen) == (tls == "off")
        with pytest.raises(multiprocessing.AuthenticationError, match=r"another --tls|same --tls"):
            peer.connect(srv.address, srv.secret, "off" if tls == "on" else "on").close()


def test_a_tls_server_without_the_secret_is_refused_by_its_certificate() -> None:
    for srv in serve_store("full", "on"):
        with pytest.raises(multiprocessing.AuthenticationError, match="not this job's"):
            peer.connect(srv.address, b"another job's secret", "on")


def test_a_peer_that_dies_as_a_worker_connects_is_a_corrupt_source_not_a_crash() -> None:
    """A peer that accepts and then closes (it died): the restore falls back on another
    tier (CorruptPartError), as for any unreachable peer."""
    import socket
    import threading

    with socket.create_server(("127.0.0.1", 0)) as srv:
        address = srv.getsockname()[:2]

        def die() -> None:
            conn, _ = srv.accept()
            conn.close()

        threading.Thread(target=die, daemon=True).start()
        with pytest.raises(CorruptPartError, match="peer unreachable"):
            peer.fetch(address, b"job-secret", rank=0, step=1)

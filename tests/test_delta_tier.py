"""Tier 1 in delta form: a peer holds a base and deltas against it, serves base + delta
back bit for bit, drops a corrupt delta or a corrupt base's deltas, and the planner then
falls back to an older complete pair or another tier, never to a mixed state."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from test_peer import _Replica, _Server, serve_store
from tierswap.checksum import checksum_chunks
from tierswap.control import protocol as p
from tierswap.control.restore import collect
from tierswap.errors import CorruptPartError
from tierswap.plan import Holdings, Source, Tier, plan_restore
from tierswap.shm import populated
from tierswap.state import Layout, make_layout
from tierswap.tiers import peer
from tierswap.tiers.delta_sender import BaseKeeper
from tierswap.tiers.deltas import Base, DeltaRing, Entry, itemsize_of
from tierswap.tiers.replicas import PeerStore

pytestmark = pytest.mark.timeout(60)


def _states(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` steps of a state where each step changes a few values of ``w`` a little."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(256, 129, generator=g)
    frozen = torch.randn(300, 17, generator=g).to(torch.bfloat16)
    out = []
    for step in range(n):
        w = w.clone()
        rows = torch.randint(0, 256, (8,), generator=g)
        w[rows] += 1e-3 * torch.randn(8, 129, generator=g)
        out.append({"w": w, "frozen": frozen, "n": torch.tensor([step]), "step": step})
    return out


def _replicas(n: int) -> list[_Replica]:
    return [_Replica(s) for s in _states(n)]


def _entries(replicas: list[_Replica], base_at: int = 0) -> tuple[Base, list[Entry]]:
    keeper = BaseKeeper(base_every=1000, threshold=1.0)
    b0 = replicas[base_at]
    base, new = keeper.base_for(0, base_at, b0.layout, b0.view, b0.checksum, b0.tree)
    assert new
    entries = [Entry(base_at, base, None, b0.tree, b0.checksum)]
    for step in range(base_at + 1, len(replicas)):
        r = replicas[step]
        entries.append(Entry(step, base, keeper.encode(0, base, r.view), r.tree, r.checksum))
    return base, entries


# ---------------------------------------------------------------- the ring


def test_every_step_rebuilds_bit_for_bit_from_base_and_one_delta() -> None:
    replicas = _replicas(6)
    base, entries = _entries(replicas)
    for e, r in zip(entries, replicas, strict=True):
        assert bytes(e.rebuild(0, "test")) == bytes(r.buf)
        assert e.data is None or e.nbytes < base.layout.nbytes / 4, "a small change is small"


def test_retention_keeps_committed_and_newest_and_the_base_deltas_need() -> None:
    replicas = _replicas(8)
    base, entries = _entries(replicas)
    ring = DeltaRing(rank=0, nslots=3)
    ring.put(entries[0])
    ring.put(entries[1])
    assert ring.propose(1)
    ring.set_committed(1)
    for e in entries[2:]:
        ring.put(e)
    assert sorted(ring.held()) == [1, 6, 7], "committed 1 and the newest two"
    assert ring.bases() == [base], "step 0 is gone, its base is not: the deltas need it"
    assert ring.nbytes() == base.layout.nbytes + sum(ring.entries[s].nbytes for s in (1, 6, 7))
    assert ring.kinds() == {1: "delta", 6: "delta", 7: "delta"}


def test_discard_after_drops_later_steps_and_a_base_of_the_abandoned_timeline() -> None:
    replicas = _replicas(6)
    _, entries = _entries(replicas)
    _, later = _entries(replicas, base_at=4)
    ring = DeltaRing(rank=0, nslots=8)
    for e in [*entries[:4], *later]:
        ring.put(e)
    assert sorted(ring.held()) == [0, 1, 2, 3, 4, 5]
    ring.discard_after(3)
    assert sorted(ring.held()) == [0, 1, 2, 3]
    assert ring.latest is None, "the newest base was of step 4, past the restart"
    assert [b.step for b in ring.bases()] == [0]


@pytest.mark.parametrize("what", ["delta", "base"])
def test_verify_drops_a_corrupt_delta_or_every_delta_of_a_corrupt_base(what: str) -> None:
    replicas = _replicas(5)
    base, entries = _entries(replicas)
    ring = DeltaRing(rank=0, nslots=8)
    for e in entries:
        ring.put(e)
    if what == "delta":
        data = entries[3].data
        assert isinstance(data, bytes)
        entries[3].data = bytearray(data)
        entries[3].data[len(data) // 2] ^= 0x01
        assert ring.verify() == [3]
        assert sorted(ring.held()) == [0, 1, 2, 4]
    else:
        base.buf[7] = base.buf[7] ^ 0x01
        assert ring.verify() == [0, 1, 2, 3, 4]
        assert ring.held() == {} and ring.bases() == []


def test_a_delta_against_another_base_is_refused_on_rebuild() -> None:
    replicas = _replicas(4)
    _, entries = _entries(replicas)
    other, _ = _entries(replicas, base_at=1)
    wrong = Entry(3, other, entries[3].data, entries[3].tree, entries[3].checksum)
    with pytest.raises(CorruptPartError, match="not the one the delta was made against"):
        wrong.rebuild(0, "rank 0 step 3")


# ---------------------------------------------------------------- the sender's base


def test_base_is_renewed_every_k_steps_and_after_a_large_delta() -> None:
    replicas = _replicas(8)
    keeper = BaseKeeper(base_every=3, threshold=0.5)

    def send(step: int) -> bool:
        r = replicas[step]
        b, new = keeper.base_for(0, step, r.layout, r.view, r.checksum, r.tree)
        if not new:
            keeper.encode(0, b, r.view)
        return new

    assert [send(s) for s in range(7)] == [True, False, False, True, False, False, True]
    keeper.threshold = 1e-6  # every delta is now "large": the next snapshot is a base
    assert [send(7), send(7)] == [False, True]


def test_discarded_timeline_drops_the_base_and_a_transfer_in_flight_keeps_none() -> None:
    replicas = _replicas(6)
    keeper = BaseKeeper(base_every=100, threshold=1.0)
    r = replicas[4]
    keeper.base_for(0, 4, r.layout, r.view, r.checksum, r.tree)
    epoch = keeper.epoch
    keeper.discard_after(2)
    assert keeper.bases == {}
    r5 = replicas[5]
    b, new = keeper.base_for(0, 5, r5.layout, r5.view, r5.checksum, r5.tree, epoch)
    assert new and b.step == 5 and keeper.bases == {}, "a stale transfer stores no base"


def test_itemsize_follows_the_bytes() -> None:
    flat_state = {"a": torch.zeros(10, dtype=torch.bfloat16), "b": torch.zeros(100)}
    from tierswap.state import flatten

    assert itemsize_of(make_layout(flatten(flat_state, with_rng=False))) == 4
    assert itemsize_of(Layout((), 0)) == 4


# ---------------------------------------------------------------- over the wire


@pytest.fixture
def dserver() -> Iterator[_Server]:
    yield from serve_store("delta")


def _push_delta(srv: _Server, rank: int, step: int, base: Base, e: Entry) -> bool | None:
    chan = peer.connect(srv.address, srv.secret)
    try:
        assert e.data is not None
        return peer.push_delta(chan, rank, step, base, bytes(e.data), e.tree, e.checksum)
    finally:
        chan.close()


def test_peer_asks_for_the_base_then_serves_base_plus_delta_bit_for_bit(dserver: _Server) -> None:
    replicas = _replicas(5)
    base, entries = _entries(replicas)
    assert _push_delta(dserver, 2, 3, base, entries[3]) is None, "no base yet: asked for"
    assert dserver.push(rank=2, step=0, replica=replicas[0])
    for step in (3, 4):
        assert _push_delta(dserver, 2, step, base, entries[step])
    # two slots: step 0 made room for 4, but its base stays, as the deltas need it
    for step in (3, 4):
        layout, _, buf = peer.fetch(dserver.address, dserver.secret, rank=2, step=step)
        assert layout == replicas[step].layout
        assert bytes(buf) == bytes(replicas[step].buf)
    deadline = time.monotonic() + 10  # the server reports after the bytes went out
    while len(served := [f for op, f in dserver.agent.reports if op == "replica_served"]) < 2:
        assert time.monotonic() < deadline, served
        time.sleep(0.01)
    assert [(f["step"], f["kind"], f["base_step"]) for f in served] == [
        (3, "delta", 0),
        (4, "delta", 0),
    ]
    store = dserver.agent.store
    with dserver.agent.lock:
        assert store.kinds() == {2: {3: "delta", 4: "delta"}}
        assert store.holdings()[2] == {s: replicas[s].checksum for s in (3, 4)}
        assert [b.step for b in store.drings[2].bases()] == [0]


def test_delta_corrupt_in_flight_is_rejected_and_not_held(dserver: _Server) -> None:
    replicas = _replicas(3)
    base, entries = _entries(replicas)
    assert dserver.push(rank=0, step=0, replica=replicas[0])
    data = entries[2].data
    assert data is not None
    bad = Entry(2, base, bytearray(data), entries[2].tree, entries[2].checksum)
    assert bad.data is not None
    bad.data[len(data) // 3] ^= 0x10
    assert _push_delta(dserver, 0, 2, base, bad) is False
    assert ("replica_rejected", 2) in [(op, f.get("step")) for op, f in dserver.agent.reports]
    with pytest.raises(CorruptPartError, match="no longer holds"):
        peer.fetch(dserver.address, dserver.secret, rank=0, step=2)


# ---------------------------------------------------------------- fallback in the planner


def _store_with(replicas: list[_Replica]) -> PeerStore:
    store = PeerStore("test-none", nslots=8, max_bytes=0, report=lambda *a, **k: None, mode="delta")
    base, entries = _entries(replicas)
    r0 = replicas[0]
    buf = populated(r0.layout.nbytes)
    buf[:] = r0.view
    store.written(1, buf, True, 0, r0.layout, r0.tree, r0.checksum)
    for e in entries[1:]:
        assert e.data is not None
        store.delta_written(
            1, e.step, store.drings[1].latest or base, bytearray(e.data), e.tree, e.checksum, True
        )
    return store


@pytest.mark.parametrize("what", ["newest delta", "base"])
def test_planner_falls_back_past_a_corrupt_delta_or_base(what: str) -> None:
    replicas = _replicas(5)
    store = _store_with(replicas)
    ring = store.drings[1]
    if what == "newest delta":
        data = ring.entries[4].data
        assert isinstance(data, bytearray)
        data[-20] ^= 0x01
    else:
        ring.bases()[0].buf[0] ^= 0x01
    # read at every stop, even one that names no rank (a worker's failure)
    assert store.verify([]) == ([(1, 4)] if what == "newest delta" else [(1, s) for s in range(5)])

    # rank 0 holds steps 3 and 4 in its own tier 0; rank 1 only in node 0's tier 1
    memory = {0: {0: {3: "c", 4: "c"}}}
    h = collect(2, memory, {0: store.holdings()}, frozenset({2}), set(), {0: store.kinds()})
    plan = plan_restore(h)
    if what == "newest delta":
        assert plan.step == 3, "the older complete pair"
        assert plan.sources == {0: Source(Tier.MEMORY, 0), 1: Source(Tier.PEER, 0)}
    else:
        assert plan.step == 2, "no pair left for rank 1: tier 2"
        assert plan.sources == {0: Source(Tier.DURABLE), 1: Source(Tier.DURABLE)}


def test_planner_prefers_a_full_replica_to_a_delta_that_must_be_decoded() -> None:
    h = Holdings(
        world_size=2,
        memory={0: frozenset({5})},
        memory_node={0: 0},
        peer={1: {1: frozenset({5}), 2: frozenset({5})}},
        peer_delta={1: {1: frozenset({5})}},
    )
    assert plan_restore(h).sources[1] == Source(Tier.PEER, 2)
    # the decode is cheaper than waiting behind two other transfers at the full holder
    busy = Holdings(
        world_size=4,
        peer={r: {2: frozenset({5})} for r in range(3)}
        | {3: {1: frozenset({5}), 2: frozenset({5})}},
        peer_delta={3: {1: frozenset({5})}},
    )
    assert plan_restore(busy).sources[3] == Source(Tier.PEER, 1)


def test_checksum_of_a_rebuilt_replica_is_the_snapshot_checksum() -> None:
    replicas = _replicas(3)
    _, entries = _entries(replicas)
    out = entries[2].rebuild(0, "x")
    assert checksum_chunks(replicas[2].layout.chunks(out)) == replicas[2].checksum


@pytest.mark.parametrize("mode", ["full", "delta"])
def test_a_replica_sent_in_an_ended_generation_is_refused(mode: str) -> None:
    """After a restore went back, a transfer queued before it may carry a step of the
    abandoned timeline: the peer, already in the next generation, never holds it."""
    reports: list[tuple[str, dict[str, Any]]] = []

    def report(msg: p.Message, gen: int) -> None:
        reports.append((p.tag_of(msg), {**msgspec.structs.asdict(msg), "generation": gen}))

    store = PeerStore("test-gen", nslots=3, max_bytes=0, report=report, mode=mode)
    store.generation = 2
    r = _replicas(1)[0]
    try:
        assert store.slot(0, 5, r.layout, generation=1) is None
        assert reports[-1][0] == "replica_rejected" and "generation 1" in reports[-1][1]["why"]
        # stamped with the transfer's generation: the coordinator, now in generation 2,
        # must not count step 5 of the old timeline as settled in the new one
        assert reports[-1][1]["generation"] == 1
        token, buf = store.slot(0, 5, r.layout, generation=2) or (None, None)
        assert buf is not None
        buf[: r.layout.nbytes] = r.view
        store.generation = 3  # a generation ended while it was in flight
        store.written(0, token, True, 5, r.layout, r.tree, r.checksum, generation=2)
        assert store.holdings().get(0, {}) == {}
        assert reports[-1][0] == "replica_rejected" and reports[-1][1]["generation"] == 2
        assert store.base(0, 5, r.checksum, generation=2) is None
    finally:
        store.close()


def test_bench_reads_peer_memory_per_node_from_the_event_log() -> None:
    from tierswap.bench.deltajobs import peer_memory

    full = [  # reserved rings, per rank held for others, per node
        {"event": "memory", "node": 0, "rank": 1, "tier": 1, "bytes": 400},
        {"event": "memory", "node": 0, "rank": 3, "tier": 1, "bytes": 400},
        {"event": "memory", "node": 1, "rank": 0, "tier": 1, "bytes": 500},
        {"event": "memory", "node": 1, "rank": 0, "tier": 0, "bytes": 9999},
    ]
    assert peer_memory(full) == 800
    delta = [  # peaks of what a node holds
        {"event": "memory", "node": 0, "rank": 1, "tier": 1, "bytes": 100, "scope": "node"},
        {"event": "memory", "node": 0, "rank": 1, "tier": 1, "bytes": 250, "scope": "node"},
        {"event": "memory", "node": 1, "rank": 0, "tier": 1, "bytes": 200, "scope": "node"},
    ]
    assert peer_memory(delta) == 250


def test_a_base_lost_from_memory_is_read_back_from_tier_2(tmp_path: Any) -> None:
    """Delta mode with --persist: the sender wrote the base to tier 2, so a peer whose copy
    went bad keeps its deltas and rebuilds them from the durable base, bit for bit."""
    from tierswap.tiers import durable

    replicas = _replicas(4)
    base, entries = _entries(replicas)
    root = str(tmp_path / "memory-bases")
    assert base.buf is not None
    durable.write_part(root, 0, 0, 1, base.layout, base.tree, base.buf, base.checksum)
    base.durable = root
    ring = DeltaRing(rank=0, nslots=8)
    for e in entries:
        ring.put(e)
    base.buf[3] ^= 0x20
    assert ring.verify() == [0], "only the base's own step (the base itself) is gone"
    assert ring.kinds() == {1: "delta+durable", 2: "delta+durable", 3: "delta+durable"}
    assert bytes(ring.entries[3].rebuild(0, "t")) == bytes(replicas[3].buf)
    durable.remove_part(root, 0, 0)
    with pytest.raises(CorruptPartError, match="base step 0 in tier 2"):
        ring.entries[3].rebuild(0, "t")


def test_planner_reads_tier_2_rather_than_a_delta_whose_base_is_there_too() -> None:
    peer_only = Holdings(
        world_size=2,
        memory={0: frozenset({5})},
        memory_node={0: 0},
        peer={1: {0: frozenset({5})}},
        peer_delta={1: {0: frozenset({5})}},
        peer_durable_base={1: {0: frozenset({5})}},
        durable=frozenset({3}),
    )
    assert plan_restore(peer_only).sources[1] == Source(Tier.PEER, 0), "tier 2 lacks step 5"
    both = dataclasses.replace(peer_only, durable=frozenset({5}))
    assert plan_restore(both).sources[1] == Source(Tier.DURABLE)


def test_a_replica_ring_of_3_lets_its_newest_give_way_and_reports_it() -> None:
    """Tier 1's rings keep their committed step and a step held for a commit; a newest that
    is neither gives way to a newer replica when no other slot is free, and is reported
    refused, so that the coordinator stops waiting for it in tier 1."""
    reports: list[p.Message] = []
    store = PeerStore("test-giveway", nslots=3, max_bytes=0, report=lambda m, g: reports.append(m))
    rs = _replicas(4)
    try:
        for step, r in enumerate(rs):
            got = store.slot(0, step, r.layout)
            assert got is not None and not isinstance(got, str), step
            token, buf = got
            buf[: r.layout.nbytes] = r.view
            store.written(0, token, True, step, r.layout, r.tree, r.checksum)
            if step == 0:
                store.committed(0)
            if step == 1:
                assert store.propose(1, ranks=[0])
        refused = [m for m in reports if isinstance(m, p.ReplicaRejected)]
        assert refused == [p.ReplicaRejected(rank=0, step=2, why="gave way to step 3")]
        assert sorted(store.holdings()[0]) == [0, 1, 3]
    finally:
        store.close()

"""Tier 1 as parity (``--peer-parity``): where stripes go, a parity made on real replica
servers from stripes sent over loopback, a lost rank rebuilt from it bit for bit, and
every kind of damage found before a wrong byte is loaded."""

from __future__ import annotations

import itertools
import secrets
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierswap.checksum import checksum_chunks
from tierswap.control import protocol as p
from tierswap.control.commits import newest_parity
from tierswap.errors import CorruptPartError
from tierswap.plan import Holdings, Source, Tier, plan_restore
from tierswap.shm import PREFIX, SHM_DIR
from tierswap.state import flatten, make_layout, tensor_view
from tierswap.tiers import parity, peer
from tierswap.tiers.replicas import PeerStore

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- placement


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 14), st.integers(1, 4), st.integers(2, 6))
def test_every_stripe_goes_to_another_node_of_its_group(nodes: int, nproc: int, size: int) -> None:
    pl = parity.placement(nodes, nproc, size)
    groups = parity.groups(nodes, size)
    assert sorted(n for g in groups for n in g) == list(range(nodes))
    assert all(len(g) >= min(size, nodes) for g in groups)
    group_of = {n: i for i, g in enumerate(groups) for n in g}
    assert sorted(pl.targets) == list(range(nodes * nproc))
    for rank, to in pl.targets.items():
        node = rank // nproc
        s = len(groups[group_of[node]])
        assert len(to) == len(set(to)) == s - 1, "one stripe to each other node of its group"
        assert node not in to and all(group_of[n] == group_of[node] for n in to)
        for j, (n, key) in enumerate(zip(to, pl.keys[rank], strict=True)):
            assert rank in pl.holds[n][key], f"stripe {j} of rank {rank} is not in its parity"


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 14), st.integers(1, 4), st.integers(2, 6))
def test_each_parity_holds_one_stripe_of_every_other_rank_of_its_set(
    nodes: int, nproc: int, size: int
) -> None:
    pl = parity.placement(nodes, nproc, size)
    for node, held in pl.holds.items():
        assert len(held) == nproc, "one parity per local rank"
        for key, ranks in held.items():
            own = -1 - key
            assert parity.key_of(own) == key and own // nproc == node
            assert own not in ranks and all(r % nproc == own % nproc for r in ranks)
            assert sorted(ranks) == sorted(pl.members[own]), "the holder's own set, less itself"


@pytest.mark.parametrize("nodes", range(2, 9))
def test_any_one_lost_node_per_group_leaves_every_lost_rank_rebuildable(nodes: int) -> None:
    for nproc, size in itertools.product((1, 2), (2, 3, 4)):
        pl = parity.placement(nodes, nproc, size)
        for lost in itertools.product(*parity.groups(nodes, size)):
            for rank in (r for n in lost for r in range(n * nproc, (n + 1) * nproc)):
                assert not set(pl.targets[rank]) & set(lost), "a parity of it was lost too"
                assert all(q // nproc not in lost for q in pl.members[rank])


def test_a_job_of_one_node_has_no_parity_and_too_small_a_group_is_refused() -> None:
    assert parity.placement(1, 4, 3).targets == {}
    with pytest.raises(ValueError, match="at least 2 nodes"):
        parity.groups(5, 1)
    assert parity.groups(7, 3) == [[0, 1, 2], [3, 4, 5, 6]]
    assert parity.groups(2, 3) == [[0, 1]]


@given(st.integers(0, 10**7), st.integers(1, 7))
def test_stripes_cut_a_snapshot_into_aligned_pieces_that_cover_it(nbytes: int, k: int) -> None:
    unit = parity.stripe_unit(nbytes, k)
    assert unit % parity.ALIGN == 0 and unit * k >= nbytes
    bounds = [parity.stripe(nbytes, k, j) for j in range(k)]
    assert bounds[0][0] == 0 and bounds[-1][1] == nbytes
    for (a, b), (c, _) in itertools.pairwise(bounds):
        assert a <= b == c
    assert all(b - a <= unit for a, b in bounds)


# ---------------------------------------------------------------- planning


def _holdings(lost: set[int], held: dict[int, frozenset[int]], **kw: Any) -> Holdings:
    """Three nodes of one rank in one parity group; ``held``: key -> steps at its holder."""
    pl = parity.placement(3, 1, 3)
    return Holdings(
        world_size=3,
        memory={r: frozenset({4, 5}) for r in range(3) if r not in lost},
        memory_node={r: r for r in range(3) if r not in lost},
        parity_keys=pl.keys,
        parity_members=pl.members,
        parity_held={
            k: {pl.holder_of(k): s} for k, s in held.items() if pl.holder_of(k) not in lost
        },
        **kw,
    )


def test_a_lost_rank_is_planned_from_parity_where_its_set_holds_the_step() -> None:
    all_held = {parity.key_of(r): frozenset({4, 5}) for r in range(3)}
    plan = plan_restore(_holdings({1}, all_held))
    assert plan.step == 5
    assert plan.sources[1] == Source(Tier.PEER, parity=(2, 0))
    assert plan.sources[0] == Source(Tier.MEMORY, 0) and plan.sources[2] == Source(Tier.MEMORY, 2)


def test_a_parity_short_of_the_newest_step_plans_the_older_one() -> None:
    held = {parity.key_of(0): frozenset({4}), parity.key_of(2): frozenset({4, 5})}
    plan = plan_restore(_holdings({1}, held))
    assert plan.step == 4 and plan.sources[1].parity == (2, 0)
    assert "no tier holds" in plan.skipped[0][1]


def test_a_bad_rebuild_or_a_second_loss_in_the_group_falls_back_to_tier_2() -> None:
    all_held = {parity.key_of(r): frozenset({4, 5}) for r in range(3)}
    bad = frozenset({(Tier.PEER, 5, 1), (Tier.PEER, 4, 1)})
    plan = plan_restore(_holdings({1}, all_held, durable=frozenset({3}), bad=bad))
    assert plan.step == 3 and plan.sources[1] == Source(Tier.DURABLE)
    plan = plan_restore(_holdings({0, 1}, all_held, durable=frozenset({3})))
    assert plan.step == 3 and plan.sources[0] == plan.sources[1] == Source(Tier.DURABLE)
    assert plan_restore(_holdings({0, 1}, all_held)).step is None


def test_tier_1_commits_at_a_start_only_what_every_parity_and_tier_0_hold() -> None:
    holds = {0: [-1], 1: [-2], 2: [-3]}
    held = {-1: {0: [3, 4, 5]}, -2: {1: [4, 5]}, -3: {2: [4, 5, 6]}}
    memory = {0: [4, 5, 6], 1: [4, 5, 6], 2: [4, 5, 6]}
    assert newest_parity(held, holds, {0, 1, 2}, 6, memory, 3) == 5
    assert newest_parity(held, holds, {0, 1, 2}, 4, memory, 3) == 4
    assert newest_parity(held, holds, {0, 2}, 6, memory, 3) == -1, "a holder is gone"
    memory[1] = [4, 6]  # rank 1's tier 0 gave step 5 up: a rebuild of 5 would need it
    assert newest_parity(held, holds, {0, 1, 2}, 6, memory, 3) == 4


# ---------------------------------------------------------------- real replica servers


@dataclass
class _Node:
    """One node: its parity store behind a real replica server, and its tier 0 (one
    rank's snapshot of one step), served for rebuilds as the agent's core does."""

    store: PeerStore
    server: peer.ReplicaServer
    tier0: dict[tuple[int, int], memoryview]
    lock: threading.Lock
    reports: list[tuple[str, dict[str, Any]]]

    def ask(self, op: str, **fields: Any) -> Any:
        handlers: dict[str, Any] = {
            "parity_slot": self.store.parity_slot,
            "parity_added": self.store.parity_added,
            "parity_checked": self.store.parity_checked,
            "replica_lease": self.store.lease,
            "replica_unlease": self.store.unlease,
            "tier0_lease": self._lease,
            "tier0_unlease": lambda slot: None,
        }
        with self.lock:
            return handlers[op](**fields)

    def _lease(self, rank: int, step: int) -> Any:
        buf = self.tier0.get((rank, step))
        return None if buf is None else SimpleNamespace(segment=SimpleNamespace(buf=buf))

    def rejected(self) -> list[dict[str, Any]]:
        return [f for op, f in self.reports if op == "replica_rejected"]


class _Snapshot:
    def __init__(self, seed: int, rows: int = 64) -> None:
        g = torch.Generator().manual_seed(seed)
        state = {"w": torch.randn(rows, 1000, generator=g), "b": torch.randn(7).bfloat16()}
        flat = flatten({**state, "seed": seed}, with_rng=False)
        self.layout, self.tree = make_layout(flat), flat.tree
        self.buf = bytearray(self.layout.nbytes)
        view = memoryview(self.buf)
        for e, t in zip(self.layout.entries, flat.tensors, strict=True):
            tensor_view(view, e).copy_(t)
        self.checksum = checksum_chunks(self.layout.chunks(view))


class _Group:
    """Three nodes of one rank each, their parities placed as a job's are."""

    def __init__(self, job_id: str, nodes: int = 3) -> None:
        self.secret = secrets.token_bytes(16)
        self.pl = parity.placement(nodes, 1, nodes)
        self.nodes: list[_Node] = []
        for n in range(nodes):
            node = _Node(None, None, {}, threading.Lock(), [])  # type: ignore[arg-type]
            report = lambda msg, gen, node=node: node.reports.append(  # noqa: E731
                (p.tag_of(msg), msgspec.structs.asdict(msg))
            )
            node.store = PeerStore(job_id, nslots=2, max_bytes=0, report=report)
            node.store.set_parity(self.pl.holds[n])
            node.store.protects = sorted(self.pl.holds[n])
            node.server = peer.ReplicaServer("127.0.0.1", self.secret, node.ask)
            self.nodes.append(node)

    def send(self, rank: int, step: int, snap: _Snapshot, tamper: int | None = None) -> list[bool]:
        """Every stripe of ``rank``'s snapshot to its parity's holder, as the agent's
        replicator sends them (``tamper``: that stripe is damaged after its checksum)."""
        self.nodes[rank].tier0[(rank, step)] = memoryview(snap.buf)
        to = self.pl.targets[rank]
        unit = parity.stripe_unit(snap.layout.nbytes, len(to))
        out = []
        for j, node in enumerate(to):
            a, b = parity.stripe(snap.layout.nbytes, len(to), j)
            member = p.ParityMember(
                rank=rank, stripe=j, nbytes=b - a, unit=unit, layout=snap.layout,
                tree=snap.tree, checksum=snap.checksum,
            )  # fmt: skip
            data = memoryview(bytearray(snap.buf[a:b]))
            chan = peer.connect(self.nodes[node].server.address, self.secret)
            try:
                msg = p.ParityPart(
                    member=member, step=step, stripe_checksum=checksum_chunks([data])
                )
                if tamper == j:
                    data[len(data) // 2] ^= 0x10
                chan.send(msg)
                room = chan.recv(10)
                assert room is not None and isinstance(room.msg, p.Room)
                if room.msg.ok:
                    chan.send_raw(data)
                    got = chan.recv(10)
                    assert got is not None and isinstance(got.msg, p.Accepted)
                out.append(room.msg.ok and got.msg.ok)
            finally:
                chan.close()
        return out

    def source(self, rank: int) -> p.FromParity:
        return p.FromParity(
            keys=list(self.pl.keys[rank]),
            holders=[self.nodes[n].server.address for n in self.pl.targets[rank]],
            members={q: self.nodes[q].server.address for q in self.pl.members[rank]},
        )

    def rebuild(self, rank: int, step: int) -> tuple[Any, dict[str, Any], memoryview]:
        return parity.rebuild(self.source(rank), self.secret, rank, step)


@pytest.fixture
def group() -> Iterator[_Group]:
    job_id = f"test-{uuid.uuid4().hex[:12]}"
    g = _Group(job_id)
    try:
        yield g
    finally:
        for node in g.nodes:
            node.server.close()
            with node.lock:
                node.store.close()
        assert sorted(SHM_DIR.glob(f"{PREFIX}{job_id}-*")) == []


def test_a_lost_rank_is_rebuilt_from_parity_bit_for_bit(group: _Group) -> None:
    snaps = {r: _Snapshot(seed=10 + r, rows=40 + 30 * r) for r in range(3)}  # three sizes
    for r, snap in snaps.items():  # a first step shows the sizes: slots made anew, larger
        group.send(r, 6, snap)
    assert any("larger" in r["why"] for node in group.nodes for r in node.rejected())
    for node in group.nodes:
        node.reports.clear()
    for r, snap in snaps.items():
        assert group.send(r, 7, snap) == [True, True]
    for n, node in enumerate(group.nodes):
        (key,) = group.pl.holds[n]
        held = node.store.holdings()[key]
        assert list(held) == [7], f"node {n}'s parity is complete"
        assert node.store.newest_complete() == 7 and not node.rejected()
    for rank, snap in snaps.items():
        lost = group.nodes[rank].tier0.pop((rank, 7))  # its node is gone
        layout, tree, buf = group.rebuild(rank, 7)
        assert layout == snap.layout and tree == snap.tree
        assert bytes(buf[: layout.nbytes]) == bytes(snap.buf)
        group.nodes[rank].tier0[(rank, 7)] = lost


def test_parity_memory_is_a_stripe_per_slot_not_a_snapshot(group: _Group) -> None:
    snaps = {r: _Snapshot(seed=r, rows=640) for r in range(3)}
    for r, snap in snaps.items():
        group.send(r, 1, snap)
    for node in group.nodes:
        unit = parity.stripe_unit(snaps[0].layout.nbytes, 2)
        assert node.store.nbytes() == 2 * unit < 2 * snaps[0].layout.nbytes * 0.51


def test_damage_anywhere_is_found_before_a_byte_is_loaded(group: _Group) -> None:
    snaps = {r: _Snapshot(seed=20 + r) for r in range(3)}
    for r, snap in snaps.items():
        group.send(r, 3, snap)
    # a parity bit flipped in the holder's memory
    key = group.pl.keys[1][0]
    holder = group.nodes[group.pl.targets[1][0]]
    slot = holder.store.rings[key].held()[3]
    slot.segment.buf[5] ^= 0x01
    with pytest.raises(CorruptPartError, match="parity checksum mismatch"):
        group.rebuild(1, 3)
    slot.segment.buf[5] ^= 0x01
    # another member's tier 0 changed under the rebuild, in the stripe the rebuild reads
    # (rank 0's first stripe is in node 1's parity, which rank 1's rebuild does not read)
    other, at = 0, parity.stripe(snaps[0].layout.nbytes, 2, 1)[0] + 100
    group.nodes[other].tier0[(other, 3)][at] ^= 0x01
    with pytest.raises(CorruptPartError, match="checksum mismatch"):
        group.rebuild(1, 3)
    group.nodes[other].tier0[(other, 3)][at] ^= 0x01
    assert bytes(group.rebuild(1, 3)[2][: snaps[1].layout.nbytes]) == bytes(snaps[1].buf)
    # a member's tier 0 gone, or a step no parity holds
    del group.nodes[other].tier0[(other, 3)]
    with pytest.raises(CorruptPartError, match="tier 0 no longer holds"):
        group.rebuild(1, 3)
    with pytest.raises(CorruptPartError, match="is not held here"):
        group.rebuild(1, 4)


def test_a_stripe_damaged_in_flight_or_sent_twice_leaves_no_parity(group: _Group) -> None:
    snaps = {r: _Snapshot(seed=30 + r) for r in range(3)}
    assert group.send(0, 2, snaps[0], tamper=1) == [True, False]
    damaged = group.nodes[group.pl.targets[0][1]]
    assert any("checksum mismatch" in r["why"] for r in damaged.rejected())
    for r in (1, 2):
        group.send(r, 2, snaps[r])
    assert damaged.store.newest_complete() == -1, "a parity with a damaged stripe is never held"
    assert any("was given up" in r["why"] for r in damaged.rejected()), "no parity begun anew"
    # a stripe sent twice is refused and the parity being made kept
    assert group.send(1, 3, snaps[1]) == [True, True]
    assert group.send(1, 3, snaps[1]) == [False, False]
    assert sum("came twice" in r["why"] for n in group.nodes for r in n.rejected()) == 2
    # the next step is made whole, over the dropped one
    for r in (0, 2):
        assert group.send(r, 3, snaps[r]) == [True, True]
    assert all(node.store.newest_complete() == 3 for node in group.nodes)
    layout, _, buf = group.rebuild(0, 3)
    assert bytes(buf[: layout.nbytes]) == bytes(snaps[0].buf)


def test_a_parity_that_never_completes_gives_its_slot_back(group: _Group) -> None:
    snaps = {r: _Snapshot(seed=40 + r) for r in range(3)}
    holder = group.nodes[0]  # its parity is of ranks 1 and 2
    group.send(1, 5, snaps[1])  # rank 2 skipped step 5 (rank 0 too): that parity waits
    group.send(1, 6, snaps[1])
    group.send(2, 6, snaps[2])
    assert holder.store.newest_complete() == 6
    assert any("parity not made" in r["why"] and r["step"] == 5 for r in holder.rejected())
    assert group.send(1, 7, snaps[1]) == [False, True], "node 2: two parities being made"
    for node in group.nodes:  # the coordinator: tier 1 will never have steps 5 and 6
        node.store.settled(6)
    for step in (8, 9, 10):  # two slots: a held step and one being made, every step
        for r in range(3):
            assert group.send(r, step, snaps[r]) == [True, True]
        for node in group.nodes:
            assert node.store.newest_complete() == step
            assert node.store.propose(step)
            node.store.committed(step)
    layout, _, buf = group.rebuild(2, 10)
    assert bytes(buf[: layout.nbytes]) == bytes(snaps[2].buf)

"""The parts that make recovery and snapshots fast at real sizes, each checked for what it
must keep: the bits, the checksums, and the memory it is given back."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from torch import nn

from tierswap.checksum import checksum_bytes, hasher
from tierswap.control import protocol as p
from tierswap.fetch import Prefetch
from tierswap.memcopy import CHUNK, copy_bytes_hashing, copy_hashing, memcpy, plain
from tierswap.shm import PREFIX, SHM_DIR, SegmentPool
from tierswap.state import flatten, load, make_layout, tensor_view
from tierswap.tunables import nt_tunables

# ---------------------------------------------------------------- segments made ahead


def _names(job: str) -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{PREFIX}{job}-*")}


def _unlink(job: str) -> None:
    """What a failed test left: segments the pool handed out are the test's to unlink."""
    for name in _names(job):
        (SHM_DIR / name).unlink(missing_ok=True)


def test_a_pool_hands_out_what_it_made_under_the_name_asked_for() -> None:
    job = "pool-test-a"
    pool = SegmentPool(job)
    try:
        pool.warm([4096, 4096, 8192])
        first = pool.create(f"{PREFIX}{job}-r0-s0", 4096)
        assert first.path.name == f"{PREFIX}{job}-r0-s0" and first.path.exists()
        first.buf[:4] = b"abcd"  # the mapping is the file under its new name
        assert first.path.read_bytes()[:4] == b"abcd"
        pool.create(f"{PREFIX}{job}-r0-s1", 4096).unlink()
        assert pool.wait(30) and pool.held() == 8192, "the third, of another size, is still held"
        other = pool.create(f"{PREFIX}{job}-r0-s2", 1000)  # no such size made: made now
        assert other.size == 1000 and other.path.exists()
        pool.warm([])  # freed: nothing the rings took
        assert pool.held() == 0
        assert _names(job) == {first.path.name, other.path.name}
        first.unlink()
        other.unlink()
    finally:
        pool.close()
        left = _names(job)
        _unlink(job)
    assert not left


def test_a_pool_waits_for_the_segment_it_is_making_and_frees_all_on_close() -> None:
    job = "pool-test-b"
    said: list[str] = []
    pool = SegmentPool(job, said.append)
    try:
        pool.warm([1 << 20] * 3)
        got = [pool.create(f"{PREFIX}{job}-x{i}", 1 << 20) for i in range(3)]
        assert {s.size for s in got} == {1 << 20}
        assert pool.wait(30) and pool.held() == 0 and not said
        pool.warm([1 << 20, 1 << 16])  # made again, in the background
        assert pool.wait(30) and pool.held() == (1 << 20) + (1 << 16)
        pool.warm([1 << 16])
        assert pool.held() == 1 << 16, "one no longer asked for is unlinked at once"
        pool.warm([1 << 20] * 2)
        pool.warm([])  # while the first may still be being made: none is kept
        assert pool.wait(30) and pool.held() == 0
        assert not [n for n in _names(job) if "-warm" in n], "made, then no longer wanted"
        for s in got:
            s.unlink()
    finally:
        pool.close()
        left = _names(job)
        _unlink(job)
    assert not left, "close unlinks what was made and not taken"


def test_a_pool_leaves_a_tenth_of_shared_memory_to_the_members(monkeypatch) -> None:
    import os as os_module

    class Fs:  # a 100 MiB folder with 20 MiB free
        f_frsize, f_blocks, f_bavail = 4096, 25600, 5120

    monkeypatch.setattr(os_module, "statvfs", lambda path: Fs())
    job = "pool-test-c"
    said: list[str] = []
    pool = SegmentPool(job, said.append)
    try:
        pool.warm([4 << 20, 4 << 20])  # 12 MiB would stay free: both made
        assert pool.wait(30) and pool.held() == 8 << 20 and not said
        pool.warm([4 << 20, 4 << 20, 6 << 20, 6 << 20])  # 8 MiB would stay: refused
        assert pool.wait(30) and pool.held() == 8 << 20
        assert said and "tenth" in said[0] and str(SHM_DIR) in said[0]
    finally:
        pool.close()
        _unlink(job)


# ---------------------------------------------------------------- one pass per byte


@pytest.mark.parametrize(
    "src",
    [
        torch.arange(3 * CHUNK // 4 + 5, dtype=torch.float32),  # chunks and a tail
        torch.arange(2 * CHUNK, dtype=torch.uint8),  # whole chunks, no tail
        torch.nn.Parameter(torch.randn(CHUNK // 2 + 3, dtype=torch.bfloat16)),
        torch.arange(CHUNK, dtype=torch.float32)[CHUNK // 2 :],  # an offset into a storage
        torch.randn(257, 513).t(),  # not contiguous: one copy, then one hash
        torch.randn(300, dtype=torch.complex64).conj(),  # lazy conjugate: torch resolves it
        torch.tensor([True, False, True]),
        torch.tensor(7, dtype=torch.int64),
        torch.zeros(0, 5),
    ],
    ids=[
        "chunks",
        "whole-chunks",
        "bf16-param",
        "offset",
        "strided",
        "conj",
        "bool",
        "scalar",
        "empty",
    ],
)
def test_the_copy_hashes_what_it_wrote_as_a_second_read_would(src: torch.Tensor) -> None:
    nbytes = src.numel() * src.element_size()
    buf = bytearray(nbytes)
    dst = torch.frombuffer(buf, dtype=src.dtype).reshape(src.shape) if nbytes else src.clone()
    digest = hasher()
    copy_hashing(dst, src, memoryview(buf), digest)
    assert torch.equal(dst, src.resolve_conj())
    assert digest.hexdigest() == checksum_bytes(bytes(buf))


def test_a_read_only_mapping_is_copied_and_hashed_as_a_second_read_would(tmp_path: Path) -> None:
    data = bytes(range(256)) * ((2 * CHUNK + 777) // 256)
    path = tmp_path / "slot"
    path.write_bytes(data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), len(data), prot=mmap.PROT_READ) as mm:
        src = memoryview(mm)
        out = bytearray(len(data))
        digest = hasher()
        copy_bytes_hashing(memoryview(out), src, digest)
        with pytest.raises(ValueError, match="read-only"):
            copy_bytes_hashing(src, memoryview(out), hasher())
        with pytest.raises(ValueError, match="into"):
            copy_bytes_hashing(memoryview(out)[1:], src, hasher())
        src.release()
    assert bytes(out) == data and digest.hexdigest() == checksum_bytes(data)


def test_only_plain_tensors_of_one_dtype_and_shape_are_copied_as_bytes() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert plain(a, b) and plain(nn.Parameter(a), b)
    assert not plain(torch.zeros(3, 2), b)  # the same size, another shape
    assert not plain(a.to(torch.int32), b)  # another dtype
    assert not plain(torch.zeros(3, 2).t(), b)  # not contiguous
    assert not plain(TwoTensor(a, a.clone()), b)  # a wrapper: its data_ptr is not its bytes
    assert not plain(a, TwoTensor(b, b.clone()))
    z = torch.zeros(6, dtype=torch.complex64)
    assert not plain(z.conj(), z) and not plain(z, z.conj()) and not plain(z._neg_view(), z)
    assert not plain(a.to_sparse(), b) and not plain(a, b.to_sparse())
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        memcpy(torch.zeros(3, 2).t(), b)


def test_workers_get_the_non_temporal_threshold_unless_the_user_set_one() -> None:
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        assert nt_tunables({}) == {}
        return
    mine = f"glibc.cpu.x86_non_temporal_threshold={CHUNK:#x}"
    assert nt_tunables({})["GLIBC_TUNABLES"] == mine
    assert nt_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == (
        "glibc.malloc.arena_max=2:" + mine
    )
    own = {"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x800000"}
    assert nt_tunables(own) == own


def test_worker_env_leaves_the_environment_it_is_given_as_it_was() -> None:
    """It returned the caller's own dict where the tunable was set already (or off
    x86-64), and then set the workers' other variables in it."""
    from tierswap.cluster.address import worker_env

    given = {"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x800000"}
    out = worker_env("127.0.0.1", given)
    assert given == {"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x800000"}
    assert out is not given and out["THP_MEM_ALLOC_ENABLE"] == "1"


# ---------------------------------------------------------------- loading


def _snap(state: dict[str, Any]) -> tuple[Any, Any, bytearray, list[torch.Tensor]]:
    flat = flatten(state, with_rng=False)
    layout = make_layout(flat)
    buf = bytearray(layout.nbytes)
    views = [tensor_view(memoryview(buf), e) for e in layout.entries]
    for v, t in zip(views, flat.tensors, strict=True):
        v.copy_(t)
    return flat.tree, layout, buf, views


def test_an_optimizer_given_loaded_state_keeps_no_view_into_the_snapshot(monkeypatch) -> None:
    """Fresh AdamW on the CPU takes its state as copies (no zero step first): the slot it
    came from is reused by later snapshots, so nothing may alias it."""
    import tierswap.state as state_module

    def no_zero_step(opt: Any) -> None:
        raise AssertionError("the zero step ran: the state was not taken as copies")

    monkeypatch.setattr(state_module, "init_optimizer_state", no_zero_step)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    tree, layout, buf, views = _snap({"model": model, "optim": opt})
    model2 = nn.Linear(8, 4)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    load({"model": model2, "optim": opt2}, tree, views, layout)
    want = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    buf[:] = bytes(len(buf))  # the slot is written again
    got = opt2.state[next(iter(model2.parameters()))]
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_optimizer_state_of_another_shape_is_refused_as_copies_too() -> None:
    from tierswap.errors import StateMismatchError

    opt = torch.optim.AdamW(nn.Linear(8, 4).parameters(), lr=1e-2)
    opt.step()  # no gradients: no state; give it some of the wrong shape by hand
    p0 = opt.param_groups[0]["params"][0]
    opt.state[p0] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq":
                     torch.zeros(3)}  # fmt: skip
    tree, layout, _, views = _snap({"optim": opt})
    fresh = torch.optim.AdamW(nn.Linear(8, 4).parameters(), lr=1e-2)
    with pytest.raises(StateMismatchError, match=r"parameter 0 'exp_avg'.*\[3\].*\[4, 8\]"):
        load({"optim": fresh}, tree, views, layout)


def test_an_optimizer_of_its_own_kind_still_gets_its_state_made_first(monkeypatch) -> None:
    import tierswap.state as state_module

    class Mine(torch.optim.SGD):
        pass

    made: list[Any] = []
    real = state_module.init_optimizer_state
    monkeypatch.setattr(state_module, "init_optimizer_state", lambda o: made.append(real(o)))
    model = nn.Linear(4, 2)
    opt = Mine(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    tree, layout, _, views = _snap({"optim": opt})
    load({"optim": Mine(nn.Linear(4, 2).parameters(), lr=0.1, momentum=0.9)}, tree, views,
         layout)  # fmt: skip
    assert made, "a subclass may keep state of other shapes: the zero step made it"


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 5))  # 720 KiB with AdamW's moments
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if seed:
        model(torch.randn(4, 300)).sum().backward()
        opt.step()
    return model, opt


@pytest.fixture
def tier0_slot() -> Iterator[tuple[nn.Module, torch.optim.Optimizer, Any, bytearray, Any]]:
    """A trained model's step in a tier-0 slot, as its agent holds it: (model, optimizer,
    the slot's segment, the step's bytes, the plan that restores it)."""
    from tierswap.checksum import checksum_chunks
    from tierswap.control import protocol as p
    from tierswap.shm import Segment

    model, opt = _trained(3)
    tree, layout, buf, _ = _snap({"model": model, "optim": opt})
    name = f"{PREFIX}fetchtest-{os.getpid()}"
    seg = Segment.create(name, layout.nbytes)
    try:
        seg.buf[:] = buf
        source = p.FromSlot(segment=name, layout=layout, tree=tree,
                            checksum=checksum_chunks(layout.chunks(memoryview(buf))))  # fmt: skip
        yield model, opt, seg, buf, p.PlanReply(step=7, source=source)
    finally:
        seg.unlink()


def _restored_equal(model: nn.Module, opt: torch.optim.Optimizer, got: Any) -> nn.Module:
    """Load ``got`` into a fresh model and optimizer and check every bit against the
    originals; the fresh model (whose tensors may be ``got``'s memory)."""
    model2, opt2 = _trained(0)
    load({"model": model2, "optim": opt2}, got.tree, got.views, got.layout,
         adopt=got.private)  # fmt: skip
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for pa, pb in zip(model.parameters(), model2.parameters(), strict=True):
        for k, v in opt.state[pa].items():
            assert torch.equal(v, opt2.state[pb][k]), k
    return model2


def test_a_tier0_fetch_loads_the_slot_bit_for_bit_and_refuses_a_corrupt_one(tier0_slot) -> None:
    """A worker restoring from its node's tier 0 maps the slot and copies from it: the same
    bits, the agent's slot never aliased (zeroing it after the load changes nothing), and
    a flipped byte refused before anything loads."""
    from tierswap.errors import CorruptPartError
    from tierswap.fetch import fetch

    model, opt, seg, buf, plan = tier0_slot
    timeline: dict[str, float] = {}
    got = fetch(plan, 0, b"", "", timeline)
    assert got.private is False and set(timeline) == {"fetch", "verify"}
    model2 = _restored_equal(model, opt, got)
    got.release()
    seg.buf[:] = bytes(len(buf))  # the agent reuses the slot
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    seg.buf[:] = buf
    seg.buf[plan.source.layout.entries[1].offset] ^= 0xFF
    with pytest.raises(CorruptPartError, match="tier-0 memory"):
        fetch(plan, 0, b"", "", {})


def test_a_tier0_fetch_into_reserved_memory_is_the_states_own_bit_for_bit(tier0_slot) -> None:
    """With memory a parked worker made ahead, a tier-0 restore reads the slot into it,
    hashing as it reads, and the state keeps that memory (adopted, no second copy): the
    same bits, the agent's slot never aliased, a flipped byte refused, a slot gone with its
    agent named as a lost part, and a reserve too small for the step left alone (the slot
    is mapped as without one)."""
    from tierswap.errors import CorruptPartError
    from tierswap.fetch import fetch
    from tierswap.reserve import Reserve

    model, opt, seg, buf, plan = tier0_slot
    nbytes = plan.source.layout.nbytes
    reserve = Reserve()
    try:
        reserve.want(nbytes + 4096)  # the largest rank of the node: this one or more
        timeline: dict[str, float] = {}
        got = fetch(plan, 0, b"", "", timeline, reserve)
        assert got.private and got.segment is None and set(timeline) == {"map", "fetch", "verify"}
        assert reserve.held() == 0, "taken: the state owns it now"
        model2 = _restored_equal(model, opt, got)
        reserved = {v.data_ptr() for v in got.views}
        got.release()
        assert {q.data_ptr() for q in model2.parameters()} <= reserved, "adopted, not copied"
        seg.buf[:] = bytes(len(buf))  # the agent reuses the slot
        for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        seg.buf[:] = buf
        seg.buf[plan.source.layout.entries[1].offset] ^= 0xFF
        reserve.want(nbytes)
        with pytest.raises(CorruptPartError, match="tier-0 memory"):
            fetch(plan, 0, b"", "", {}, reserve)
        assert reserve.held() == 0, "the read into the reserve found it"
        gone = msgspec.structs.replace(plan.source, segment="tierswap-no-such-slot")
        for r in (reserve, None):
            reserve.want(nbytes)
            with pytest.raises(CorruptPartError, match="tier-0 memory"):
                fetch(msgspec.structs.replace(plan, source=gone), 0, b"", "", {}, r)
        reserve.want(nbytes // 2)
        deadline = time.monotonic() + 10
        while reserve.held() != nbytes // 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        seg.buf[:] = buf
        small = fetch(plan, 0, b"", "", {}, reserve)
        assert not small.private and reserve.held() == nbytes // 2, "too small: kept"
        small.release()
    finally:
        reserve.close()


def test_a_parked_worker_maps_its_nodes_slots_ahead_and_a_restore_reads_through_them(
    tier0_slot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slots a parked worker is told of are mapped on a thread; a restore from one
    reads through that mapping (mapping nothing itself) and gets the step's bits; a slot
    no longer named is unmapped; a slot made anew in the same name is read from the new
    file, not the old mapping; a flipped byte is refused through it too; and what a
    restore took stays mapped until it lets go."""
    import tierswap.fetch as fetch_mod
    from tierswap.errors import CorruptPartError
    from tierswap.reserve import Reserve, map_gently
    from tierswap.shm import ReadMap, Segment

    model, opt, seg, buf, plan = tier0_slot
    name, nbytes = plan.source.segment, plan.source.layout.nbytes
    ahead: list[ReadMap] = []
    fresh: list[ReadMap] = []

    def map_slot(path: Path) -> ReadMap | None:
        got = map_gently(path)
        if got is not None:
            ahead.append(got)
        return got

    def mapped_here(*args: Any, **kwargs: Any) -> ReadMap:
        fresh.append(ReadMap(*args, **kwargs))
        return fresh[-1]

    def until(cond: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline, "not within 10 s"
            time.sleep(0.01)

    monkeypatch.setattr(fetch_mod, "ReadMap", mapped_here)
    reserve = Reserve(map_slot=map_slot)
    again = None
    try:
        reserve.want(nbytes, [name, f"{PREFIX}no-such-slot"])
        until(lambda: reserve.mapped() == [name])
        timeline: dict[str, float] = {}
        got = fetch_mod.fetch(plan, 0, b"", "", timeline, reserve)
        assert not fresh and reserve.mapped() == [], "read through the mapping made ahead"
        assert timeline["map"] == 0.0
        _restored_equal(model, opt, got)
        got.release()
        assert ahead[0].mm is not None, "kept mapped while the way back goes on"
        reserve.let_go()
        until(lambda: ahead[0].mm is None)

        reserve.want(nbytes, [name])
        until(lambda: reserve.mapped() == [name])
        reserve.want(nbytes, [])
        until(lambda: ahead[1].mm is None)  # no longer named: unmapped

        reserve.want(nbytes, [name])
        until(lambda: reserve.mapped() == [name])
        seg.buf[plan.source.layout.entries[1].offset] ^= 0xFF
        with pytest.raises(CorruptPartError, match="tier-0 memory"):
            fetch_mod.fetch(plan, 0, b"", "", {}, reserve)
        assert not fresh
        seg.buf[:] = buf

        reserve.want(nbytes, [name])
        until(lambda: reserve.mapped() == [name])
        seg.unlink()  # the agent makes it anew in the same name, with the step's bytes
        again = Segment.create(name, nbytes)
        again.buf[:] = buf
        got = fetch_mod.fetch(plan, 0, b"", "", {}, reserve)
        assert len(fresh) == 1 and fresh[0].mm is None, "the new file, mapped and unmapped"
        _restored_equal(model, opt, got)
        got.release()
    finally:
        reserve.close()
        if again is not None:
            again.unlink()
    until(lambda: all(m.mm is None for m in ahead))


def test_a_slot_mapped_ahead_reads_its_file_while_it_is_closed_and_on_old_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A view taken before a close (from another thread) still reads the file's bytes;
    after it, there is no view; a kernel without ``MADV_POPULATE_READ`` gets a mapping
    made with ``MAP_POPULATE`` instead, and the same bytes."""
    import errno

    from tierswap import shm

    path = tmp_path / "slot"
    data = os.urandom(3 * mmap.PAGESIZE + 5)
    path.write_bytes(data)
    m = shm.ReadMap(path)
    view = m.view()
    assert view is not None and m.current()
    m.close()  # page tables emptied, the mapping held by the view
    assert bytes(view) == data
    view.release()
    assert m.view() is None
    monkeypatch.setattr(shm, "_madvise", lambda mm, advice, stride=0: errno.EINVAL)
    monkeypatch.setattr(shm, "_populate_read", True)
    old = shm.ReadMap(path, len(data) - 5)
    got = old.view()
    assert got is not None and bytes(got) == data[:-5] and shm._populate_read is False
    got.release()
    path.unlink()  # made anew in the same name (while mapped its inode is not reused)
    path.write_bytes(data)
    assert not old.current()
    old.close()
    with pytest.raises(ValueError, match="holds"):
        shm.ReadMap(path, len(data) + 1)


def _flat_equal(state: dict[str, Any], layout: Any, buf: bytearray) -> None:
    """Every tensor of ``state`` holds the bits of its entry in ``buf`` (a slot)."""
    got = flatten(state, with_rng=False).tensors
    for e, t in zip(layout.entries, got, strict=True):
        assert torch.equal(t, tensor_view(memoryview(buf), e)), e.key


def test_a_survivors_own_state_is_the_step_or_the_memory_the_step_is_read_into(
    tier0_slot,
) -> None:
    """A survivor whose live state (the tensors its last snapshot was copied from) still
    holds the step it restores takes it as it is: one hash pass, the slot not read at all
    (named wrong, it is not missed), the restored model's parameters the old ones' memory.
    One optimizer step later it no longer holds the step: the slot is read into that same
    memory, and the restored state has the slot's bits, not the live ones. A flipped byte
    in the slot is refused; a plan that is not a tier-0 step is not taken."""
    from tierswap.errors import CorruptPartError
    from tierswap.fetch import from_live
    from tierswap.live import Live

    model, opt, seg, buf, plan = tier0_slot
    layout, checksum = plan.source.layout, plan.source.checksum

    def live() -> Live:
        flat = flatten({"model": model, "optim": opt}, with_rng=False)
        return Live(layout, flat.tensors, checksum)

    def restored(got: Any) -> nn.Module:
        model2, opt2 = _trained(0)
        load({"model": model2, "optim": opt2}, got.tree, got.views, got.layout,
             adopt=got.private)  # fmt: skip
        got.release()
        _flat_equal({"model": model2, "optim": opt2}, layout, buf)
        return model2

    old = {q.untyped_storage().data_ptr() for q in model.parameters()}
    gone = msgspec.structs.replace(plan.source, segment="tierswap-no-such-slot")
    timeline: dict[str, float] = {}
    got = from_live(msgspec.structs.replace(plan, source=gone), live(), timeline)
    assert got is not None and got.private and got.live and got.what == "live step 7"
    assert timeline["fetch"] == 0.0 and timeline["verify"] > 0
    model2 = restored(got)
    assert {q.untyped_storage().data_ptr() for q in model2.parameters()} == old, "adopted"

    model(torch.randn(4, 300)).sum().backward()
    opt.step()  # the live state moves on past the step
    got = from_live(plan, live(), timeline)
    assert got is not None and got.private and not got.live and got.what == "tier-0 step 7"
    model3 = restored(got)
    assert {q.untyped_storage().data_ptr() for q in model3.parameters()} == old, "read into"

    model(torch.randn(4, 300)).sum().backward()
    opt.step()  # (the read made the live state the step again)
    stale = Live(layout, live().tensors, "another snapshot's checksum")
    got = from_live(plan, stale, timeline)
    assert got is not None and not got.live, "a proof that cannot hold is not tried"
    restored(got)
    opt.step()
    seg.buf[layout.entries[1].offset] ^= 0xFF
    with pytest.raises(CorruptPartError, match="tier-0 memory"):
        from_live(plan, live(), {})
    durable = msgspec.structs.replace(plan, source=p.FromDurable(root="/x", part=0))
    assert from_live(durable, live(), {}) is None


def test_a_restore_takes_no_live_state_that_the_new_state_shares(tier0_slot) -> None:
    """``job.steps`` proves the step in the state the worker trained only where the new
    state shares none of its memory: a state that outlived ``train`` and is passed again
    reads the slot as any restore does, and the live state is let go either way."""
    from tierswap.job import Job
    from tierswap.live import Live

    model, opt, _seg, _buf, plan = tier0_slot
    layout, checksum = plan.source.layout, plan.source.checksum
    job = Job()

    def live() -> Live:
        flat = flatten({"model": model, "optim": opt}, with_rng=False)
        return Live(layout, flat.tensors, checksum)

    fresh = dict(zip(("model", "optim"), _trained(0), strict=True))
    mine = live()
    got = job._from_live(fresh, plan, mine)
    assert got.live and mine.tensors == []
    got.release()
    mine = live()
    got = job._from_live({"model": model, "optim": opt}, plan, mine)
    assert not got.live and got.segment is not None, "the slot, mapped and read as before"
    assert mine.tensors == []
    got.release()


def test_live_state_is_kept_and_taken_only_where_it_is_the_states_own_plain_memory() -> None:
    """A snapshot's tensors are kept only where they are plain contiguous CPU tensors of
    their entries' dtypes and shapes, mostly parameters and optimizer state (not a
    ``state_dict`` of copies); they are taken for a slot of the same keys, dtypes and
    shapes only, not where a new state shares their memory; one tensor under two entries
    (a tied weight) is handed back once as itself and once as a copy (adopting one memory
    twice would tie them)."""
    from tierswap.live import Live, keepable

    x = torch.arange(12.0).reshape(3, 4)
    y = x.clone()

    def layout_of(a: torch.Tensor, b: torch.Tensor) -> Any:
        return make_layout(flatten({"w": {"a": a.contiguous(), "b": b.contiguous()}},
                                   with_rng=False))  # fmt: skip

    model, opt = _trained(3)
    flat = flatten({"model": model, "optim": opt, "ema": {"w": x}}, with_rng=False)
    assert keepable(make_layout(flat), flat.tensors)
    big = torch.zeros(200_000)  # a copy as large as the model: not the state's own
    flat = flatten({"model": model, "optim": opt, "ema": {"w": big}}, with_rng=False)
    assert not keepable(make_layout(flat), flat.tensors)
    assert not keepable(layout_of(x, y), [x, y]), "plain values only: not parameters"

    layout = layout_of(x, y)
    live = Live(layout, [x, y], "")
    assert live.fits(layout) and live.shares_memory([y[0]]) and not live.shares_memory([y + 0])
    assert not Live(layout, [x, x.t().contiguous().t()], "").fits(layout), "not contiguous"
    assert not Live(layout, [x, y.double()], "").fits(layout), "another dtype"
    assert not live.fits(layout_of(x, x.reshape(4, 3)))
    got = live.adoptable()
    assert [t.data_ptr() for t in got] == [x.data_ptr(), y.data_ptr()]
    got = Live(layout, [x, x], "").adoptable()
    assert got[0].data_ptr() == x.data_ptr() != got[1].data_ptr() and torch.equal(got[1], x)


def test_a_reserve_is_made_once_handed_out_once_and_remade_at_a_new_size() -> None:
    from tierswap.reserve import Reserve

    made: list[int] = []

    def make(n: int) -> memoryview:
        made.append(n)
        return memoryview(bytearray(n))

    r = Reserve(make)
    r.want(1000)
    assert r.take(1000) is not None and made == [1000]
    assert r.take(1000) is None, "handed out once"
    r.want(1000)
    assert r.take(2000) is None and r.held() == 1000, "too small for this one: kept"
    r.want(500)  # the node's ranks shrank: the held block goes, a new one is made
    assert r.take(500) is not None and made == [1000, 1000, 500]
    r.want(0)
    assert r.take(1) is None and r.held() == 0


def test_a_reserve_taken_for_a_smaller_rank_gives_its_tail_back() -> None:
    import mmap

    from tierswap.reserve import Reserve
    from tierswap.shm import populated

    def make(n: int) -> memoryview:
        buf = populated(n)
        buf[:] = b"\x07" * n
        return buf

    r = Reserve(make)
    r.want(4 * mmap.PAGESIZE)
    buf = r.take(2 * mmap.PAGESIZE + 1)
    assert buf is not None and len(buf) == 4 * mmap.PAGESIZE
    assert set(buf[: 3 * mmap.PAGESIZE]) == {7}, "what the rank uses (to its page) is kept"
    assert set(buf[3 * mmap.PAGESIZE :]) == {0}, "the rest went back to the kernel"


def test_a_reserve_that_cannot_be_made_leaves_restores_to_make_their_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A block that would leave less than a tenth of the machine's memory is not made, a
    make that fails is not waited on, and either way the next want tries again."""
    from tierswap import reserve as rs

    def broken(n: int) -> memoryview:
        raise OSError("no room")

    r = rs.Reserve(broken)
    r.want(1000)
    t = time.monotonic()
    assert r.take(1000) is None and time.monotonic() - t < 5, "not waited on"
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1000 kB\nMemAvailable: 150 kB\n")
    monkeypatch.setattr(rs, "MEMINFO", meminfo)
    assert rs.leaves_room(40 * 1024) and not rs.leaves_room(60 * 1024)
    made: list[int] = []
    r = rs.Reserve(lambda n: made.append(n) or memoryview(bytearray(n)))
    r.want(60 * 1024)
    assert r.take(60 * 1024) is None and not made, "past the tenth kept free: not made"
    r.want(40 * 1024)
    assert r.take(40 * 1024) is not None and made == [40 * 1024]


def test_a_prefetch_hands_over_its_value_or_raises_its_error_in_the_caller() -> None:
    seen: list[str] = []
    ok = Prefetch(lambda: seen.append(threading.current_thread().name) or 5)
    assert ok.result() == 5 and seen == ["tierswap-prefetch"]

    def fail() -> int:
        raise ValueError("peer gone")

    with pytest.raises(ValueError, match="peer gone"):
        Prefetch(fail).result()


# ---------------------------------------------------------------- pinning


def test_cpu_lists_read_as_linux_writes_them_and_bad_ones_are_named() -> None:
    from tierswap.affinity import parse_cpus
    from tierswap.config import Config

    assert parse_cpus("0-3,8, 10-11") == {0, 1, 2, 3, 8, 10, 11}
    for bad in ("", "a", "3-1", "-2"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpus(bad)
    with pytest.raises(ValueError, match="agent_cpus: CPU list '1-x'"):
        Config(agent_cpus="1-x")


def test_a_launcher_checks_its_cpu_lists_against_its_machine_before_it_starts() -> None:
    import os

    from tierswap.affinity import check_cpus_here

    mine = sorted(os.sched_getaffinity(0))
    every = ",".join(map(str, mine))
    with pytest.raises(ValueError, match=f"^--agent-cpus {every}: that is every CPU"):
        check_cpus_here(every, None)
    with pytest.raises(ValueError, match="run on CPUs 5000-5003; pick CPUs among"):
        check_cpus_here(None, f"{mine[0]},5000-5003", "tierswap run --join")
    check_cpus_here(every, str(mine[0]))  # the workers' own list: fine
    if len(mine) > 1:
        check_cpus_here(str(mine[-1]), None)  # the others are the workers'


def test_a_thread_pinned_to_the_agents_cpus_runs_only_there() -> None:
    import os

    from tierswap.affinity import pin_thread

    mine = os.sched_getaffinity(0)
    one = frozenset({min(mine)})
    seen: list[set[int]] = []

    def helper() -> None:
        pin_thread(one)
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=helper)
    t.start()
    t.join()
    assert seen == [set(one)] and os.sched_getaffinity(0) == mine, "only that thread"

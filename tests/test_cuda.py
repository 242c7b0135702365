"""Snapshots of CUDA state through the real agent: the copy goes on a side stream into a
page-locked slot after the work queued before ``take``, the slot holds the GPU's bytes as
the agent checksummed them, and the next ``optimizer.step()`` waits for the copy instead
of racing it. A copy takes a millisecond here, so each order is checked with the GPU kept
busy for half a second ahead of it: a missing wait fails every run, not now and then."""

from __future__ import annotations

import functools
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tierswap.bench.rig import NSLOTS, BenchHolding, Holding, Rig
from tierswap.checksum import checksum_chunks
from tierswap.state import Layout, flatten

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(120),
]

WIDTH, DEPTH = 512, 4
"""1 M parameters, 12.6 MB a slot with AdamW: three slots fit a container's 64 MiB
/dev/shm."""
SLEEP_S = 0.5
"""How long the GPU is kept busy ahead of the copy a test checks the order of: the copy
itself takes a millisecond."""


@pytest.fixture
def rig() -> Iterator[Rig]:
    """A Snapshotter of rank 0 and the bench's agent process, both gone afterwards."""
    with tempfile.TemporaryDirectory(prefix="tierswap-cuda-") as tmp:  # short socket path
        r = Rig(f"cuda-{secrets.token_hex(4)}")
        try:
            r.start(Path(tmp))
            yield r
        finally:
            r.close()


def _grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p)


def _cuda_state(fused: bool = False) -> dict[str, Any]:
    """Linear layers on the GPU and an AdamW that has taken one step; a fused one keeps
    its ``step`` counts on the GPU too, so that the snapshot's every deferred tensor is
    copied by the GPU and none by the copy thread."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    _grads(model)
    opt.step()
    return {"model": model, "optim": opt}


def _cuda_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state's GPU tensors by their key in a snapshot's layout."""
    flat = flatten(state, with_rng=False)
    pairs = zip(flat.entries, flat.tensors, strict=True)
    return {e.key: t for e, t in pairs if t.is_cuda}


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _held(rig: Rig) -> tuple[Layout, memoryview, dict[str, torch.Tensor], str]:
    """The layout, buffer and tensors (by key) of the slot holding the last step, as this
    process maps it, and the checksum the agent computed of it."""
    reply = rig.call(BenchHolding(step=rig.step), Holding)  # waits for the agent's checksum
    alloc = rig.snapshotter._alloc
    assert alloc is not None
    slot = reply.slot
    views = alloc.slot_views(slot)
    tensors = {e.key: v for e, v in zip(alloc.layout.entries, views, strict=True)}
    return alloc.layout, alloc.segments[slot].buf, tensors, str(reply.checksum)


@functools.cache
def _cycles_per_s() -> float:
    """``torch.cuda._sleep``'s cycles in a second of this GPU, timed (after a first run
    that lets the clocks come up)."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def _busy(stream: torch.cuda.Stream, seconds: float = SLEEP_S) -> None:
    """Queue ``seconds`` of GPU work on ``stream``: what is queued behind it runs that
    much later, long after ``take`` has returned, so that a reader that does not wait
    for it reads stale bytes every time, not only when a copy happens to be slow."""
    cycles = int(seconds * _cycles_per_s())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


def _late_copies(rig: Rig) -> None:
    """Put a side stream of our own, busy, where the snapshot's copies will queue."""
    dev = torch.device("cuda", 0)
    rig.snapshotter._streams[dev] = stream = torch.cuda.Stream(dev)
    _busy(stream)


def _add_one(state: dict[str, Any]) -> None:
    """Add 1 to every GPU tensor of the state, on the compute stream."""
    with torch.no_grad():
        for t in _cuda_tensors(state).values():
            t.add_(1)


def _every_slot_pinned(rig: Rig, state: dict[str, Any]) -> None:
    """Snapshot until every slot of the ring is page-locked, then change the state:
    registering a slot may wait for the GPU to go idle, which would let a late copy land
    before anyone reads it; and a slot that still held the state's values could not tell
    a copy that landed from one that did not."""
    for _ in range(2 * NSLOTS):
        rig.take(state)
        rig.sync()
        alloc = rig.snapshotter._alloc
        assert alloc is not None
        if len(alloc.pinned) == len(alloc.names):
            break
    assert len(alloc.pinned) == len(alloc.names), "a slot was never granted"
    _add_one(state)


def test_take_copies_on_a_side_stream_into_a_page_locked_slot(rig: Rig) -> None:
    state = _cuda_state()
    snap = rig.snapshotter
    assert not snap._streams

    rig.take(state)

    assert list(snap._streams) == [torch.device("cuda", 0)]  # the tensors' own device
    alloc = snap._alloc
    assert alloc is not None and alloc.pinned
    deferred = [e for e in alloc.layout.entries if e.deferred]
    assert {e.key for e in deferred} >= set(_cuda_tensors(state))
    snap.drain()
    _, _, tensors, _ = _held(rig)
    assert all(tensors[e.key].is_pinned() for e in deferred)  # registered with CUDA


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw_fused"])
def test_slot_holds_the_gpu_bytes_as_the_agent_checksummed_them(rig: Rig, fused: bool) -> None:
    """The copy thread checksums the slot only once the GPU's copies are in; fused, with
    every deferred tensor on the GPU, it has nothing of its own to copy."""
    state = _cuda_state(fused)
    if fused:
        flat = flatten(state)
        assert all(t.is_cuda for e, t in zip(flat.entries, flat.tensors, strict=True) if e.deferred)
    _every_slot_pinned(rig, state)
    _late_copies(rig)
    rig.take(state)
    rig.snapshotter.drain()

    layout, buf, tensors, checksum = _held(rig)
    live = _cuda_tensors(state)
    assert live
    for key, t in live.items():
        assert _bytes(tensors[key]) == _bytes(t), key
    expected = bytearray(buf)  # the slot, with every GPU tensor's range from the GPU
    for e in layout.entries:
        if e.key in live:
            expected[e.offset : e.offset + e.nbytes] = _bytes(live[e.key])
    assert checksum_chunks(layout.chunks(memoryview(expected))) == checksum


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw_fused"])
def test_a_step_right_after_take_waits_for_the_copy(rig: Rig, fused: bool) -> None:
    state = _cuda_state(fused)
    _every_slot_pinned(rig, state)
    _grads(state["model"])  # ready before take, so the step follows it at once
    before = {k: _bytes(t) for k, t in _cuda_tensors(state).items()}

    _late_copies(rig)
    rig.take(state)
    state["optim"].step()  # its pre-hook fences: the copy is done before it changes a bit
    rig.snapshotter.drain()  # and, for the check below, checksummed and held

    after = {k: _bytes(t) for k, t in _cuda_tensors(state).items()}
    _, _, tensors, _ = _held(rig)
    assert [k for k in before if after[k] == before[k]] == []  # the step did work
    for key, b in before.items():
        assert _bytes(tensors[key]) == b, f"{key}: the slot holds post-step values"


def test_the_copy_waits_for_the_work_queued_before_take(rig: Rig) -> None:
    """The side stream waits for the compute stream: a change still queued there when
    ``take`` is called is in the snapshot."""
    state = _cuda_state()
    _every_slot_pinned(rig, state)
    before = {k: _bytes(t) for k, t in _cuda_tensors(state).items()}

    _busy(torch.cuda.current_stream())
    _add_one(state)  # lands half a second from now
    rig.take(state)
    rig.snapshotter.drain()

    _, _, tensors, _ = _held(rig)
    for key, t in _cuda_tensors(state).items():
        assert _bytes(t) != before[key], f"{key}: the +1 did not land"
        assert _bytes(tensors[key]) == _bytes(t), f"{key}: the slot misses the +1"


def test_nccl_communicator_aborted_and_rebuilt_in_the_same_process(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A generation's end on NCCL: the communicator is aborted (not waited on), which
    removes the default group, and the next generation's group works in the same process;
    under the watchdog setting a worker runs with (abort on an error, keep the process)."""
    import os

    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore, PrefixStore

    from tierswap.worker import NCCL_ERRORS, _abort_communicator

    monkeypatch.setenv(*NCCL_ERRORS)
    assert os.environ[NCCL_ERRORS[0]] == "2"
    store = HashStore()
    try:
        for generation in range(2):
            dist.init_process_group(
                "nccl",
                store=PrefixStore(f"gen{generation}/", store),
                rank=0,
                world_size=1,
                device_id=torch.device("cuda", 0),
            )
            t = torch.full((1024,), float(generation + 1), device="cuda")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            assert float(t.sum()) == 1024 * (generation + 1)
            _abort_communicator()
            assert "aborting the communicator failed" not in capfd.readouterr().err
            assert not dist.is_initialized(), "the abort left the default group in place"
    finally:  # (only after a failure above: the next test must not find a group)
        if dist.is_initialized():
            dist.destroy_process_group()

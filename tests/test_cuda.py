"""Snapshots of CUDA state through the real agent: the copy goes on a side stream into a
page-locked slot, the slot holds the GPU's bytes as the agent checksummed them, and the
next ``optimizer.step()`` waits for the copy instead of racing it."""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tierswap.bench.rig import BenchHolding, Holding, Rig
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


def _cuda_state() -> dict[str, Any]:
    """Linear layers on the GPU and an AdamW that has taken one step."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
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


def test_slot_holds_the_gpu_bytes_as_the_agent_checksummed_them(rig: Rig) -> None:
    state = _cuda_state()
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


def test_a_step_right_after_take_waits_for_the_copy(rig: Rig) -> None:
    state = _cuda_state()
    _grads(state["model"])  # ready before take, so the step follows it at once
    before = {k: t.cpu() for k, t in _cuda_tensors(state).items()}

    rig.take(state)
    state["optim"].step()  # its pre-hook fences: the copy is done before it changes a bit
    rig.snapshotter.drain()  # and, for the check below, checksummed and held

    after = {k: t.cpu() for k, t in _cuda_tensors(state).items()}
    _, _, tensors, _ = _held(rig)
    assert [k for k in before if torch.equal(after[k], before[k])] == []  # the step did work
    for key, t in before.items():
        assert torch.equal(tensors[key], t), f"{key}: the slot holds post-step values"


def test_nccl_communicator_aborted_and_rebuilt_in_the_same_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A generation's end on NCCL: the communicator is aborted (not waited on), the
    group destroyed, and the next generation's group works in the same process; under
    the watchdog setting a worker runs with (abort on an error, keep the process)."""
    import os

    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore, PrefixStore

    from tierswap.worker import NCCL_ERRORS, _abort_communicator

    monkeypatch.setenv(*NCCL_ERRORS)
    assert os.environ[NCCL_ERRORS[0]] == "2"
    store = HashStore()
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
        if dist.is_initialized():  # abort may already have removed the group
            dist.destroy_process_group()

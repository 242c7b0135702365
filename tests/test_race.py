"""No torn data: snapshots race restores and persistence; every read is checksummed.

The ring's bookkeeping runs under one lock (in the agent it runs on one event loop), while
the bytes are written, read back and persisted outside it, by other threads, as in the
agent and its workers. If the ring ever handed a leased or protected slot to the writer,
a reader would see a torn snapshot: a checksum mismatch or bytes of another step.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import pytest
import torch

from tierswap.checksum import checksum_chunks
from tierswap.shm import remove_job_segments
from tierswap.state import Flat, TensorEntry, make_layout, tensor_view
from tierswap.tiers import durable
from tierswap.tiers.memory import RankRing

pytestmark = pytest.mark.timeout(120)
N = 1 << 18  # float32 elements per tensor, 1 MiB


def _layout():
    entries = [TensorEntry(f"t{i}", "F32", (N,), 0, N * 4, deferred=True) for i in range(2)]
    return make_layout(Flat(tree={}, tensors=[], entries=entries))


def _content(step: int) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) + step * 1e6


def test_snapshots_race_restores_and_persistence(tmp_path: Path) -> None:
    job = secrets.token_hex(4)
    ring = RankRing(job, 0, 3)
    lock = threading.Lock()
    layout = _layout()
    alloc = ring.allocate(layout)
    stop = threading.Event()
    reads = {"memory": 0, "durable": 0}
    errors: list[str] = []

    def write() -> None:
        step = 0
        while not stop.is_set():
            with lock:
                slot_index, _ = ring.begin_write(step, alloc.id)
            if slot_index is not None:
                slot = alloc.slots[slot_index]
                for e in layout.entries:  # written outside the lock, like a worker's copy
                    tensor_view(slot.segment.buf, e).copy_(_content(step))
                with lock:
                    ring.written(slot_index, step, alloc.id, {"step": step})
                digest = checksum_chunks(layout.chunks(slot.segment.buf))
                with lock:
                    ring.checked(slot, digest)
                    if ring.propose(step):  # one rank: it commits what it holds
                        ring.set_committed(step)
            step += 1

    def check(step: int, buf: memoryview, lay, digest: str, where: str) -> None:
        if checksum_chunks(lay.chunks(buf)) != digest:
            errors.append(f"{where}: torn snapshot of step {step} (checksum)")
        for e in lay.entries:
            if not torch.equal(tensor_view(buf, e), _content(step)):
                errors.append(f"{where}: step {step} holds another step's bytes")

    def restore() -> None:
        while not stop.is_set():
            with lock:
                held = ring.held()
                slot = ring.lease(max(held)) if held else None
            if slot is None:
                continue
            check(slot.step, slot.segment.buf, layout, slot.checksum, "restore")
            reads["memory"] += 1
            with lock:
                ring.unlease(slot)

    def persist() -> None:
        while not stop.is_set():
            with lock:
                slot = ring.lease(ring.committed)
            if slot is None:
                continue
            step = slot.step
            info = durable.write_part(
                str(tmp_path), step, 0, 1, layout, slot.tree, slot.segment.buf, slot.checksum
            )
            with lock:
                ring.unlease(slot)
            got_layout, _, data = durable.read_part(str(tmp_path), step, 0, info)
            check(step, memoryview(data), got_layout, info.data, "persist")
            reads["durable"] += 1

    threads = [threading.Thread(target=f) for f in (write, restore, restore, persist)]
    try:
        for t in threads:
            t.start()
        time.sleep(4.0)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        ring.close()
        remove_job_segments(job)
    assert not errors, errors[:5]
    assert reads["memory"] > 20 and reads["durable"] > 3, reads
    assert ring.committed > 20

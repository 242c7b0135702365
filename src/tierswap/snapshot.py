"""Tier 0, the worker's side: copy a step's state into a slot of the agent's memory ring.

``Snapshotter.take(step, state)`` runs at the end of a step. Small buffers and non-tensor
state are copied at once; parameters and optimizer state (which only ``optimizer.step()``
changes) are copied by a background thread while the next forward and backward run. The
next ``optimizer.step()`` calls :func:`fence` through a global pre-hook and waits for that
copy; the wait is measured, and it is the only stall the training loop pays.

On CUDA the deferred copy is issued on a side stream into the slot, registered as pinned
host memory, and the background thread waits for the stream's event.

With tier 1 on, the same pre-hook also bounds how far training may run ahead of
replication (``--max-redo``): the optimizer step of step t waits until tier 1 is done
with step t - max_redo, as the agent tells it through a :class:`Watermark`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierswap.affinity import helper_cpus, pin_thread
from tierswap.checksum import hasher
from tierswap.control import protocol as p
from tierswap.errors import UsageError
from tierswap.interrupt import own_call
from tierswap.live import Live, keepable
from tierswap.memcopy import copy_hashing
from tierswap.shm import Segment
from tierswap.state import Flat, Layout, flatten, make_layout, tensor_view
from tierswap.tiers.memory import FILL_LIMIT_S, FILL_POLL_S
from tierswap.wire import Channel

_active: list[Snapshotter] = []
_hook_lock = threading.Lock()
_hook_handle: Any = None


def fence() -> None:
    """Wait until no snapshot copy is in flight (state may then be changed)."""
    for snap in _active:
        snap.fence()


def _optimizer_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    with own_call():  # tierswap's code, inside the loop's: never cut short
        fence()
        for snap in _active:
            snap.gate()


def _install_hook() -> None:
    global _hook_handle
    with _hook_lock:
        if _hook_handle is None:
            _hook_handle = register_optimizer_step_pre_hook(_optimizer_pre_hook)


GATE_LIMIT_S = 120.0
"""The longest an optimizer step waits for tier 1. Every way a step can fail to commit
there is reported and ends the wait at once; this only bounds a wait nobody ends (a bug),
which is then reported as ``tier1_wait_timeout``."""


class Watermark:
    """The newest step tier 1 is done with (committed, or given up) in one generation, as
    the agent reports it; closed when the generation ends, which releases every wait."""

    def __init__(self, step: int = -1) -> None:
        self.step = step
        self.closed = False
        self._cond = threading.Condition()

    def advance(self, step: int) -> None:
        with self._cond:
            if step > self.step:
                self.step = step
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def wait(self, step: int, timeout: float) -> bool:
        """Until tier 1 is done with ``step`` or the generation ended; False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.step >= step or self.closed, timeout)


@dataclass(slots=True)
class Stats:
    """What snapshots cost the training loop, in seconds."""

    taken: int = 0
    skipped: int = 0
    fence_waits: list[float] = field(default_factory=list)
    sync_copies: list[float] = field(default_factory=list)
    copy_times: list[float] = field(default_factory=list)
    copy_cpu: list[float] = field(default_factory=list)
    """CPU seconds of each background copy (with its checksum), on the copy thread."""
    tier1_waits: list[float] = field(default_factory=list)
    """Each optimizer step's wait for tier 1 (``--max-redo``), zeros included."""
    stalls: list[float] = field(default_factory=list)
    """Per step (from one ``take`` to the next): every wait for a copy or for tier 1, and
    the synchronous part of the ``take`` that ends it; zeros included."""
    gates: list[float] = field(default_factory=list)
    """Per step, as ``stalls``: the part of its stall that waited for tier 1."""
    waited: float = 0.0
    """Waits of the step under way, so far."""
    gated: float = 0.0
    """The part of ``waited`` that waited for tier 1."""

    LIMIT = 100_000
    """Samples kept per list: a long run must not grow without bound."""

    def record(self, samples: list[float], seconds: float) -> None:
        samples.append(seconds)
        if len(samples) > self.LIMIT:
            del samples[: self.LIMIT // 2]

    def last_stall(self) -> float:
        """The stall of the newest step whose snapshot was taken."""
        return self.stalls[-1] if self.stalls else 0.0

    def last_gate(self) -> float:
        """The part of :meth:`last_stall` that waited for tier 1 (``--max-redo``)."""
        return self.gates[-1] if self.gates else 0.0


@dataclass(slots=True)
class _Allocation:
    id: int
    layout: Layout
    names: list[str]
    """Every slot's segment, by index; the agent may still be making some (it grants
    only made ones), so each is mapped when it is first granted (``segment``)."""
    segments: dict[int, Segment] = field(default_factory=dict)
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    pinned: dict[int, int] = field(default_factory=dict)
    """slot -> address registered with cudaHostRegister."""

    def segment(self, slot: int) -> Segment:
        """Slot ``slot``'s segment, mapped on first use (by the training thread, in
        ``take``, before its copy is queued)."""
        seg = self.segments.get(slot)
        if seg is None:
            seg = self.segments[slot] = Segment.attach(self.names[slot], self.layout.nbytes)
        return seg

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        views = self.views.get(slot)
        if views is None:
            buf = self.segment(slot).buf
            views = self.views[slot] = [tensor_view(buf, e) for e in self.layout.entries]
        return views

    def close(self) -> None:
        self.views.clear()
        for ptr in self.pinned.values():  # unpin before unmapping, or a later map may alias
            torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]
        self.pinned.clear()
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()


@dataclass(slots=True)
class _Job:
    step: int
    slot: int
    flat: Flat
    alloc: _Allocation
    events: list[Any] = field(default_factory=list)
    """CUDA events, one per device whose tensors were copied on its side stream."""


class Snapshotter:
    """Snapshots of one rank into its agent's tier-0 ring."""

    def __init__(
        self, chan: Channel, rank: int, watermark: Watermark | None = None, max_redo: int = 0
    ) -> None:
        self.chan = chan
        self.rank = rank
        self.stats = Stats()
        self.watermark = watermark if max_redo > 0 else None
        """Tier 1's progress, when the optimizer step waits for it."""
        self.max_redo = max_redo
        self.last_taken = -1
        """The newest step snapshotted (its copy may still be in flight)."""
        self._gated = -1
        self._alloc: _Allocation | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._copied = threading.Event()
        """Set once the copy in flight has read every tensor of the state: what an
        optimizer step waits for (``fence``); ``_idle`` also waits for the checksum and
        the report to the agent."""
        self._copied.set()
        self._error: BaseException | None = None
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._streams: dict[torch.device, Any] = {}
        """Side stream of each CUDA device the deferred copies come from."""
        self.live: Live | None = None
        """The newest snapshot's tensors (aliases of the state's memory, not copies) and
        checksum, where they are worth keeping (``live.keepable``): what a survivor
        restores its next generation's step from, or into (``live.py``)."""
        self.midway: Callable[[int], None] | None = None
        """Called by the copy thread with the step when half of a snapshot's background
        copy is done (fault injection: a kill during the copy)."""
        self._thread = threading.Thread(target=self._run, name="tierswap-copy", daemon=True)
        self._thread.start()
        _install_hook()
        _active.append(self)

    # ---------------------------------------------------------------- training thread

    def take(self, step: int, state: Mapping[str, Any], *, wait: float = 0.0) -> bool:
        """Snapshot ``state`` as the end of ``step``; returns before the big copy is done.

        When every slot is in use the step is skipped (False), unless ``wait`` seconds are
        given to wait for one (the last step of a job must not be skipped).
        """
        self._wait(self._idle)  # the previous snapshot written and reported, not only copied
        self._raise_error()
        t0 = time.monotonic()
        flat = flatten(state)
        alloc = self._allocation(flat)
        deadline = t0 + wait
        # until the deadline a refusal is asked again, and is not reported as a skip
        while (slot := self._slot(step, alloc, time.monotonic() < deadline)) is None:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        if slot is None:
            self.stats.skipped += 1
            self._end_step(time.monotonic() - t0)
            return False
        views = alloc.slot_views(slot)
        with torch.no_grad():
            for entry, src, dst in zip(alloc.layout.entries, flat.tensors, views, strict=True):
                if not entry.deferred:
                    dst.copy_(src)
        job = _Job(step, slot, flat, alloc, self._launch_cuda_copies(alloc, slot, flat))
        sync = time.monotonic() - t0
        self.stats.record(self.stats.sync_copies, sync)
        self._end_step(sync)
        self.last_taken = step
        self._idle.clear()
        self._copied.clear()
        self._queue.put(job)
        return True

    def _end_step(self, sync: float) -> None:
        self.stats.record(self.stats.stalls, self.stats.waited + sync)
        self.stats.record(self.stats.gates, self.stats.gated)
        self.stats.waited = self.stats.gated = 0.0

    def _slot(self, step: int, alloc: _Allocation, retry: bool = False) -> int | None:
        """A slot for ``step``, or None to skip it; while the agent is still making the
        ring's slots (a job's first steps) it waits for one, up to ``FILL_LIMIT_S``."""
        msg = p.SlotRequest(rank=self.rank, step=step, alloc=alloc.id, retry=retry)
        deadline = time.monotonic() + FILL_LIMIT_S
        while True:
            if time.monotonic() >= deadline:  # asked once more without waiting: a skip
                msg = p.SlotRequest(rank=self.rank, step=step, alloc=alloc.id, retry=retry,
                                    wait=False)  # fmt: skip
            try:
                granted = self.chan.call(msg, p.SlotGranted)
            except RuntimeError as e:  # its ring could not be made: no restart helps
                if "UsageError: " in str(e):
                    raise UsageError(str(e).split("UsageError: ", 1)[1]) from e
                raise
            if granted.slot is not None or not granted.filling:
                return granted.slot
            time.sleep(FILL_POLL_S)

    def fence(self) -> None:
        """Block until the in-flight copy has read the state (its checksum and its report
        to the agent may still be under way); the wait is recorded."""
        self._wait(self._copied)
        self._raise_error()

    def drain(self) -> None:
        """Block until the snapshot in flight is copied, checksummed and reported."""
        self._wait(self._idle)
        self._raise_error()

    def _wait(self, done: threading.Event) -> None:
        if not done.is_set():
            t0 = time.monotonic()
            done.wait()
            waited = time.monotonic() - t0
            self.stats.record(self.stats.fence_waits, waited)
            self.stats.waited += waited

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"snapshot copy of rank {self.rank} failed: {error}") from error

    def gate(self) -> None:
        """Before the state changes: wait until tier 1 is done with the step ``max_redo``
        steps back, so a node failure never costs more than ``max_redo`` steps."""
        if self.watermark is None or self.last_taken < 0:
            return
        target = self.last_taken - (self.max_redo - 1)
        if target <= self._gated:
            return  # a second optimizer in the same step
        self._gated = target
        t0 = time.monotonic()
        done = self.watermark.wait(target, GATE_LIMIT_S)
        waited = time.monotonic() - t0
        self.stats.record(self.stats.tier1_waits, waited)
        self.stats.waited += waited
        self.stats.gated += waited
        if not done:
            self.chan.send(p.Lagging(rank=self.rank, step=target, seconds=waited))

    def close(self) -> None:
        """Finish the snapshot in flight, stop the thread, unmap the slots."""
        try:
            self.drain()
        finally:
            self._queue.put(None)
            self._thread.join(timeout=30)
            if self in _active:
                _active.remove(self)
            if self._alloc is not None:
                self._alloc.close()

    def _allocation(self, flat: Flat) -> _Allocation:
        """The slots for this state's layout; asks the agent for new ones when it changed."""
        current = self._alloc
        sig = tuple((e.key, e.dtype, e.shape) for e in flat.entries)
        if (
            current is not None
            and current.layout.signature() == sig
            and [e.deferred for e in flat.entries] == [e.deferred for e in current.layout.entries]
        ):
            return current
        layout = make_layout(flat)
        try:
            reply = self.chan.call(p.Alloc(rank=self.rank, layout=layout), p.Allocated, timeout=300)
        except RuntimeError as e:  # no memory for the slots: restarting would fail the same way
            raise UsageError(str(e)) from e
        if current is not None:
            current.close()
        self._alloc = _Allocation(reply.alloc, layout, list(reply.segments))
        return self._alloc

    @staticmethod
    def _pin(alloc: _Allocation, slot: int) -> None:
        """Page-lock the slot once, so that copies into it are asynchronous DMA. A failure
        is raised, not worked around: an unpinned slot would make every copy synchronous."""
        if slot in alloc.pinned:
            return
        buf = alloc.segment(slot).buf
        ptr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        # portable (1): page-locked for every device's context, not only the current one
        err = cudart.cudaHostRegister(ptr, len(buf), 1)
        if int(err) != 0:
            raise RuntimeError(
                f"cudaHostRegister of tier-0 slot {slot} ({len(buf)} bytes) failed: CUDA error "
                f"{int(err)}, {cudart.cudaGetErrorString(err)}. Page-locking needs a "
                "locked-memory limit above the slots' size (raise it with `ulimit -l "
                "unlimited`, or a container's memlock ulimit) and a runtime that allows it "
                "(some sandboxes, gVisor for one, do not)"
            )
        alloc.pinned[slot] = ptr

    def _side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    @staticmethod
    def _queue_copies(stream: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """The copies on ``stream``, after its device's current stream's work so far; the
        event that marks their end."""
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):  # (also makes the stream's device the current one)
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            # blocking: the copy thread's wait for it sleeps instead of spinning a core
            event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            event.record(stream)
        return event

    def _launch_cuda_copies(self, alloc: _Allocation, slot: int, flat: Flat) -> list[Any]:
        """Issue the deferred copies of GPU tensors, on a side stream of each tensor's own
        device (a rank's tensors need not be on the current device: gloo ranks on one
        node set none); one event per device, recorded after its copies. Should a launch
        fail midway, the copies already queued are waited for before the error goes up:
        the slot may be unpinned and unmapped next, and never under a running DMA."""
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        views = alloc.slot_views(slot)
        for e, src, dst in zip(alloc.layout.entries, flat.tensors, views, strict=True):
            if e.deferred and src.is_cuda:
                by_device.setdefault(src.device, []).append((src, dst))
        if not by_device:
            return []
        self._pin(alloc, slot)
        events: list[Any] = []
        used: list[Any] = []  # the side streams copies were queued on
        try:
            with torch.no_grad():
                for device, pairs in by_device.items():
                    used.append(self._side_stream(device))
                    events.append(self._queue_copies(used[-1], pairs))
        except BaseException:
            for stream in used:
                stream.synchronize()
            raise
        return events

    # ---------------------------------------------------------------- copy thread

    def _run(self) -> None:
        pin_thread(helper_cpus())  # --agent-cpus: the copy is tierswap's work, not training
        while (job := self._queue.get()) is not None:
            try:
                self._copy(job)
            except BaseException as e:
                self._error = e
            finally:
                self._copied.set()
                self._idle.set()

    def _copy(self, job: _Job) -> None:
        """Copy the deferred tensors into the slot, checksumming the slot's bytes in the
        same pass: each chunk is hashed right before it is copied, so that the copy reads
        it from cache (:func:`tierswap.memcopy.copy_hashing`).
        Bytes a GPU copied (by DMA, on the side stream) are hashed once they are in."""
        t0, cpu0 = time.monotonic(), time.thread_time()
        self.live = None  # (until this copy is done: its tensors may be changing)
        views = job.alloc.slot_views(job.slot)
        entries = job.alloc.layout.entries
        buf = job.alloc.segment(job.slot).buf
        here = [
            e.deferred and not t.is_cuda for e, t in zip(entries, job.flat.tensors, strict=True)
        ]
        half, copied = sum(here) // 2, 0
        if not any(here) and self.midway is not None:  # nothing is copied here: at once
            self.midway(job.step)
        for event in job.events:  # the GPUs' copies into the slot are in
            event.synchronize()
        last = max((i for i, m in enumerate(here) if m), default=-1)
        if last < 0:  # the GPU copied it all (or there was nothing to defer): state is free
            self._copied.set()
        digest = hasher()
        with torch.no_grad():
            for i, (entry, src, dst, mine) in enumerate(
                zip(entries, job.flat.tensors, views, here, strict=True)
            ):
                raw = buf[entry.offset : entry.offset + entry.nbytes]
                if not mine:  # copied in take(), or by the GPU
                    digest.update(raw)
                    continue
                if copied == half and self.midway is not None:
                    self.midway(job.step)
                copied += 1
                copy_hashing(dst, src, raw, digest)
                if i == last:  # the rest only reads the slot: the optimizer may go on
                    self._copied.set()
        self.stats.record(self.stats.copy_times, time.monotonic() - t0)
        self.stats.record(self.stats.copy_cpu, time.thread_time() - cpu0)
        self.stats.taken += 1
        checksum = digest.hexdigest()
        if keepable(job.alloc.layout, job.flat.tensors):
            tensors = [t.detach() for t in job.flat.tensors]  # (aliases: hold the memory)
            self.live = Live(job.alloc.layout, tensors, checksum)
        written = p.Written(
            rank=self.rank,
            step=job.step,
            slot=job.slot,
            alloc=job.alloc.id,
            tree=job.flat.tree,
            stall=self.stats.last_stall(),
            gate=self.stats.last_gate(),
            checksum=checksum,
        )
        self.chan.send(written)

"""A worker's restore, its first half: the bytes of the step it restores, fetched and
verified before the state they go into exists.

A worker asks for its plan and fetches as soon as it has joined its generation, on a
thread, while ``train(job)`` builds and wraps its model (the longest part of re-entering
a generation on a CPU); ``Job.steps`` then only loads what arrived. Views handed out point
into private memory, faulted in, that a tier-0 slot, a replica or a tier-2 part was read
into: that memory the restore keeps as the state's own (``load(adopt=True)``), with no
copy at all. For a tier-0 slot or a replica, a parked worker made that memory while it
waited (``reserve.py``); without it, a tier-0 slot is mapped instead (not copied: the
load copies from it), since memory made now costs the restore as much as a copy into
the state's own, and a replica is received into memory made now.

A survivor that kept the state it trained (``live.py``) fetches nothing here for a tier-0
step that state fits: ``Job.steps`` proves the step in it, or reads it into it, once the
new state exists (:func:`from_live`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from tierswap.affinity import helper_cpus, pin_thread
from tierswap.checksum import checksum_chunks, hasher
from tierswap.control import protocol as p
from tierswap.errors import CorruptPartError
from tierswap.layout import Layout
from tierswap.live import Live
from tierswap.memcopy import copy_bytes_hashing
from tierswap.reserve import Reserve
from tierswap.shm import SHM_DIR, ReadMap, Segment, populated
from tierswap.state import tensor_view
from tierswap.tiers import durable, parity, peer

T = TypeVar("T")


@dataclass(slots=True)
class Fetched:
    """A plan, and where it has a step, that step's bytes (``views``, one per entry)."""

    plan: p.PlanReply
    layout: Layout | None = None
    tree: dict[str, Any] = field(default_factory=dict)
    views: list[torch.Tensor] = field(default_factory=list)
    what: str = ""
    """The source, for errors: "tier-0 step 7", say."""
    segment: Segment | None = None
    """A tier-0 slot the views map: the agent's memory, copied from, never kept."""
    live: bool = False
    """The views are the state this worker trained, proven to hold the step: nothing was
    read (``from_live``)."""

    @property
    def private(self) -> bool:
        """Whether the views are this process's own memory (a tier-0 slot, a replica or a
        tier-2 part read into it), which the state may keep as its own
        (``load(adopt=True)``)."""
        return self.segment is None

    def release(self) -> None:
        """Drop the views, then unmap a tier-0 slot (views must go first); what a load
        adopted stays, held by the state."""
        self.views.clear()
        if self.segment is not None:
            self.segment.close()
            self.segment = None


def read_slot(
    name: str,
    layout: Layout,
    dests: list[memoryview],
    ahead: ReadMap | None = None,
    timeline: dict[str, float] | None = None,
) -> str:
    """Copy a tier-0 slot's tensors into ``dests`` (one buffer per entry), each chunk
    hashed from the slot right before it is copied, so that the copy reads it from cache
    (one pass over the bytes: :func:`tierswap.memcopy.copy_bytes_hashing`); their
    checksum. The slot is
    read through ``ahead``, a mapping of it a parked worker made (``reserve.py``; left
    to its owner), where that is still the file of that name; else it is mapped here,
    read-only with its page tables filled at once (a mapping faulted in 4 KiB at a time
    costs more than the copy), and unmapped after. A libc memmove copies it (384 MiB
    here: 46 ms mapped ahead, 73 ms with the mapping; ``preadv`` of the same chunks 86
    ms). A slot gone with its agent, or shorter than its layout, is a lost part
    (``CorruptPartError``); slots never shrink, so the mapping cannot lose pages under
    the copy. ``timeline`` gets the seconds of ``map`` (0 through ``ahead``)."""
    path = SHM_DIR / name
    digest = hasher()
    mapped = None
    t = time.monotonic()
    slot = None
    if ahead is not None and ahead.size >= layout.nbytes and ahead.current():
        slot = ahead.view()  # (None where it was closed meanwhile)
    if slot is None:
        try:
            mapped = ReadMap(path, layout.nbytes)
        except ValueError as e:
            raise CorruptPartError(
                str(path), f"tier-0 memory holds less than {layout.nbytes:,} bytes"
            ) from e
        except OSError as e:
            raise CorruptPartError(str(path), f"tier-0 memory: {e}") from e
        slot = mapped.view()
        assert slot is not None
    if timeline is not None:
        timeline["map"] = 0.0 if mapped is None else time.monotonic() - t
    try:
        for entry, dst in zip(layout.entries, dests, strict=True):
            if entry.nbytes:
                at, end = entry.offset, entry.offset + entry.nbytes
                copy_bytes_hashing(dst, slot[at:end], digest)
    finally:
        slot.release()
        if mapped is not None:
            mapped.close()
    return digest.hexdigest()


def from_live(plan: p.PlanReply, live: Live, timeline: dict[str, float]) -> Fetched | None:
    """``plan``'s tier-0 step in the tensors of ``live``, the state this worker trained
    (``live.py``): as they are where one hash pass proves them equal to the slot
    (``verify``; skipped where the checksum of the snapshot they were copied into is
    another), else with the slot read into their memory, hashed as it is read
    (``fetch``); None where the plan is not a tier-0 step they fit. A slot whose bytes do
    not match its checksum is a lost part (``CorruptPartError``)."""
    source = plan.source
    if not isinstance(source, p.FromSlot):
        return None
    source.layout.check()
    held = live.tensors  # the memory ``raws`` point into: alive while they are used
    raws = live.raws(source.layout)
    if raws is None:
        return None
    t = time.monotonic()
    proven = live.checksum == source.checksum == checksum_chunks(raws)
    t1 = time.monotonic()
    if not proven and read_slot(source.segment, source.layout, raws) != source.checksum:
        path = str(SHM_DIR / source.segment)
        raise CorruptPartError(path, "checksum mismatch in tier-0 memory")
    timeline.update(fetch=0.0 if proven else time.monotonic() - t1, verify=t1 - t)
    what = f"{'live' if proven else 'tier-0'} step {plan.step}"
    views = live.adoptable()
    del raws, held
    return Fetched(plan, source.layout, source.tree, views, what, live=proven)


def fetch(
    plan: p.PlanReply,
    rank: int,
    secret: bytes,
    tls: str,
    timeline: dict[str, float],
    reserve: Reserve | None = None,
) -> Fetched:
    """The bytes of ``plan``'s step for ``rank``, checked against their checksum;
    ``timeline`` gets the seconds of ``fetch`` and ``verify`` (with memory from
    ``reserve``, a tier-0 slot is read and hashed in one pass: all of it ``fetch``)."""
    out = Fetched(plan)
    step, source = plan.step, plan.source
    t = time.monotonic()

    def room(nbytes: int) -> memoryview:
        ready = None if reserve is None else reserve.take(nbytes)
        return ready if ready is not None else populated(nbytes)

    ready = None
    if isinstance(source, p.FromSlot) and reserve is not None:
        ready = reserve.take(source.layout.nbytes)
    match source:
        case p.FromSlot() if ready is not None:
            buf = ready
            layout = source.layout
            layout.check()
            into = [buf[e.offset : e.offset + e.nbytes] for e in layout.entries]
            ahead = reserve.take_map(source.segment) if reserve is not None else None
            if read_slot(source.segment, layout, into, ahead, timeline) != source.checksum:
                raise CorruptPartError(
                    str(SHM_DIR / source.segment), "checksum mismatch in tier-0 memory"
                )
            timeline.update(fetch=time.monotonic() - t, verify=0.0)
            out.layout, out.tree, out.what = layout, source.tree, f"tier-0 step {step}"
            out.views = [tensor_view(buf, e) for e in layout.entries]
        case p.FromSlot():
            layout = source.layout
            layout.check()
            try:
                seg = out.segment = Segment.attach(source.segment, layout.nbytes)
            except (OSError, ValueError) as e:  # gone with its agent, or not what was said
                raise CorruptPartError(str(SHM_DIR / source.segment), f"tier-0 memory: {e}") from e
            t1 = time.monotonic()
            if checksum_chunks(layout.chunks(seg.buf)) != source.checksum:
                out.release()
                raise CorruptPartError(str(seg.path), "checksum mismatch in tier-0 memory")
            timeline.update(fetch=t1 - t, verify=time.monotonic() - t1)
            out.layout, out.tree, out.what = layout, source.tree, f"tier-0 step {step}"
            out.views = [tensor_view(seg.buf, e) for e in layout.entries]
        case p.FromPeer():
            assert step is not None
            layout, tree, buf = peer.fetch(
                source.address, secret, rank, step, tls, timeline, room=room
            )
            out.layout, out.tree = layout, tree
            out.what = f"node {source.node}'s replica of step {step}"
            out.views = [tensor_view(memoryview(buf), e) for e in layout.entries]
        case p.FromParity():
            assert step is not None
            layout, tree, buf = parity.rebuild(source, secret, rank, step, tls, timeline, room=room)
            out.layout, out.tree = layout, tree
            out.what = f"tier-1 parity of step {step}"
            out.views = [tensor_view(memoryview(buf), e) for e in layout.entries]
        case p.FromDurable():
            assert step is not None
            layout, tree, buf = durable.read_part(source.root, step, rank, source.part)
            timeline["fetch"] = time.monotonic() - t  # read and verified as it is read
            out.layout, out.tree, out.what = layout, tree, f"{source.root} step {step}"
            out.views = [tensor_view(memoryview(buf), e) for e in layout.entries]
    return out


class Prefetch(Generic[T]):
    """``fn()`` on a thread of its own; ``result()`` waits for it, raising what it raised."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tierswap-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            pin_thread(helper_cpus())  # --agent-cpus: the fetch is not the trainer's work
            self._value = self._fn()
        except BaseException as e:
            self._error = e

    def done(self, timeout: float) -> bool:
        """Whether it has ended, waiting up to ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

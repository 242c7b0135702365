"""The worker's view of a job: ``Job.steps``, restore and snapshots."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from tierswap import snapshot
from tierswap.control import protocol as p
from tierswap.errors import GenerationEnded
from tierswap.faults import Injection
from tierswap.fetch import Fetched, Prefetch, fetch, from_live
from tierswap.interrupt import backward_points, in_own_call, own_call
from tierswap.live import Live
from tierswap.reserve import Reserve
from tierswap.state import flatten, load
from tierswap.wire import Channel

PREFETCH_GRACE_S = 5.0
"""How long leaving a generation waits for a restore fetch ``train(job)`` never used."""


class Job:
    """One worker's view of the job, handed to ``train(job)``."""

    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        local_world_size: int = 1,
        node: int = 0,
        generation: int = 0,
        chan: Channel | None = None,
        faults: list[Injection] | None = None,
        secret: bytes = b"",
        tls: str = "off",
        ended: threading.Event | None = None,
        tier1: snapshot.Watermark | None = None,
        max_redo: int = 0,
        interrupt_steps: bool = False,
        reserve: Reserve | None = None,
        live: Live | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        """This rank's index among the ranks on its machine: the GPU it drives."""
        self.local_world_size = local_world_size
        self.node = node
        """The node this rank serves (torchrun's ``GROUP_RANK``)."""
        self.generation = generation
        self._chan = chan
        self._secret = secret
        self._tls = tls
        self._faults = list(faults or ())
        """This rank's injected kills, freezes and slowness (``FaultPlan.of_rank``)."""
        self._ended = ended if ended is not None else threading.Event()
        self._snap: snapshot.Snapshotter | None = None
        self._prefetch: Prefetch[Fetched] | None = None
        self._tier1 = tier1
        self._max_redo = max_redo
        self._reserve = reserve
        """Memory the worker made ahead for a restore to read into (``reserve.py``)."""
        self._live = live
        """The state this worker trained in its last generation, which the restore takes
        as it is where it is provably the step restored (``live.py``)."""
        self._live_lock = threading.Lock()
        self._closed = False
        self._live_step: Live | None = None
        """``_live``, where the plan's tier-0 step fits it: proven or read there by
        ``steps``, on the training thread, once the new state exists (``from_live``)."""
        self._points: list[Any] = []
        """Hooks that let the end of the generation cut a CPU backward pass short
        (``interrupt.backward_points``), removed when the job closes."""
        self.kept: Live | None = None
        """Once closed: this generation's newest snapshot's own tensors, for the next."""
        self._interrupt_steps = interrupt_steps
        """``--interrupt-steps``: a generation's end may cut the loop's step short."""
        self.interruptible = False
        """True while the training loop runs its own code (between ``job.steps`` handing
        out a step and being asked for the next): the only time a generation's end may
        cut the step short (:meth:`interrupt`)."""
        self._plan: p.PlanReply | None = None
        self._planned = threading.Event()
        """Set once this rank's plan arrived, or asking for it failed."""
        self._plan_error: BaseException | None = None
        self.restored_step: int | None = None
        self.plan_step: int | None = None
        self.plan_tier: int | None = None
        self.last_step = -1
        self.step = -1
        """The step ``steps()`` last gave the loop (-1: none yet)."""
        self.joined_at: float | None = None
        """When this worker joined the generation's process group (``time.monotonic``)."""
        self.timeline: dict[str, float] = {}
        """Seconds this rank spent in each part of entering the generation, in order:
        ``enter`` (from joining the group to ``job.steps``: the script builds and wraps its
        model), ``plan``, ``fetch`` and ``verify`` (on a thread, during ``enter``),
        ``waited`` (in ``job.steps`` for what was still being fetched; a survivor holding
        the state it trained proves or reads its step after it, ``live.py``), ``load``, ``sync``
        (waiting for the other ranks), ``step`` (the first step) and ``snapshot`` (its
        snapshot, slots allocated if new); sent with ``Stepped``."""

    def steps(self, state: MutableMapping[str, Any], total: int) -> Iterator[int]:
        """Restore the newest committed ``state``, then yield the remaining steps up to
        ``total`` (0-based), snapshotting ``state`` after each one."""
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        if not isinstance(state, MutableMapping):
            raise TypeError(f"state must be a dict of Stateful objects and values, got {state!r}")
        self._check()
        t = time.monotonic()
        if self.joined_at is not None:
            self.timeline["enter"] = t - self.joined_at
        start = self._restore(state)
        if self._chan is not None:
            self._chan.send(p.Report(rank=self.rank, step=start - 1, total=total))
        t = time.monotonic()
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()  # nobody trains until every rank holds the same step
        self.timeline["sync"] = time.monotonic() - t
        if self._interrupt_steps:  # (a second steps() of the same job: its state's)
            self._remove_points()
            self._points = backward_points(state)
        if self._chan is not None and self._snap is None:
            self._snap = snapshot.Snapshotter(self._chan, self.rank, self._tier1, self._max_redo)
            if any(f.during == "snapshot" for f in self._faults):
                self._snap.midway = self._in_copy
        if self._snap is not None and 0 < start == total and self.plan_tier not in (None, 0):
            # restored at the last step from a peer or tier 2 (its node is new): this node's
            # tier 0 lacks the step, and the job finishes only once memory commits it
            self._snap.take(total - 1, state, wait=60.0)
        for step in range(start, total):
            self._check()
            t = time.monotonic()
            self.interruptible = self._interrupt_steps
            self.step = step
            try:
                yield step
            finally:
                self.interruptible = False
            self.last_step = step
            if step == start:
                self.timeline["step"] = time.monotonic() - t
            t = time.monotonic()
            if self._snap is not None:
                self._snap.take(step, state, wait=60.0 if step == total - 1 else 0.0)
            if step == start and self._chan is not None:
                self.timeline["snapshot"] = time.monotonic() - t
                self._chan.send(p.Stepped(rank=self.rank, step=step, phases=self.timeline))
                if self._reserve is not None:  # the way back is over: unmap what it read
                    self._reserve.let_go()
            self._maybe_inject(step)
        self.fence()

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors go: ``cuda:<local_rank>`` on a machine with CUDA,
        else the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def ended(self) -> bool:
        """True once this generation has ended (a failure elsewhere); the next step
        boundary raises GenerationEnded."""
        return self._ended.is_set()

    def _check(self) -> None:
        if self._ended.is_set():
            raise GenerationEnded(f"generation {self.generation} ended")

    def interrupt(self) -> None:
        """Called in the training loop's thread (a signal handler) once this generation
        has ended: raises GenerationEnded there and then if the loop is running its own
        code, so that a survivor leaves at once rather than after finishing a step whose
        work is thrown away (its first collective after a peer died fails only later, a
        forward and part of a backward later). Inside tierswap's own calls it does
        nothing: those raise at their end (``report``, ``fence``) or at the next step."""
        if self.interruptible and not in_own_call() and self._ended.is_set():
            self.interruptible = False
            raise GenerationEnded(f"generation {self.generation} ended (step cut short)")

    @contextmanager
    def _own_call(self) -> Iterator[None]:
        """A tierswap call made from the loop's code: not to be cut short halfway (a
        message half sent); an end that came meanwhile is raised once it is done."""
        with own_call():
            yield
        if self.interruptible:
            self._check()

    def fence(self) -> None:
        """Wait for the snapshot copy in flight; call before changing state outside
        ``optimizer.step()`` (an EMA update, say)."""
        if self._snap is not None:
            with self._own_call():
                self._snap.fence()

    @property
    def snapshot_stats(self) -> snapshot.Stats | None:
        """What this generation's snapshots cost so far (None before the first one)."""
        return self._snap.stats if self._snap is not None else None

    @property
    def stall(self) -> float:
        """Seconds the newest step whose snapshot was taken (read in a loop's body: the
        step before this one) waited for snapshots: for copies (its optimizer step's
        fence), for tier 1 (``--max-redo``), and the synchronous part of its snapshot."""
        return self._snap.stats.last_stall() if self._snap is not None else 0.0

    @property
    def tier1_wait(self) -> float:
        """The part of :attr:`stall` that waited for tier 1 (``--max-redo``): the wait a
        node failure's bound on lost work asks for, not a copy's."""
        return self._snap.stats.last_gate() if self._snap is not None else 0.0

    def report(self, step: int, **metrics: float) -> None:
        """Show metrics of a step on the launcher's console and in the event log."""
        clean = {k: float(v) for k, v in metrics.items()}
        if self._chan is not None:
            with self._own_call():
                msg = p.Report(rank=self.rank, step=step, metrics=clean, stall=self.stall)
                self._chan.send(msg)

    def _remove_points(self) -> None:
        points, self._points = self._points, []
        for handle in points:  # the user's parameters, which may outlive the job
            handle.remove()

    def close(self) -> None:
        self._remove_points()
        pending, self._prefetch = self._prefetch, None
        if pending is not None and not pending.done(PREFETCH_GRACE_S):
            # a fetch from a peer that stopped answering: left to its thread, which holds
            # only this process's memory; the worker parks and is given its next rank
            print(f"[tierswap] rank {self.rank}: a restore fetch still runs", file=sys.stderr)
        elif pending is not None:  # train(job) never reached steps(): drop what was fetched
            try:
                pending.result().release()
            except BaseException:
                pass  # a fetch that failed holds nothing
        if self._reserve is not None:  # (a fetch still reading keeps its view mapped)
            self._reserve.let_go()
        with self._live_lock:
            self._closed = True
            unused = self._live_step or self._live  # train(job) never reached steps()
            self._live = self._live_step = None
        if self._snap is not None:
            self._snap.close()
            self.kept = self._snap.live
            self._snap = None
        if self.kept is None and unused is not None and unused.tensors:
            self.kept = unused  # still the state trained last: for the generation after

    # ---------------------------------------------------------------- restore

    def prefetch(self) -> None:
        """Ask for this rank's plan and fetch its step now, on a thread, while
        ``train(job)`` builds and wraps its model; ``steps`` loads what arrived. The worker
        calls this once it has joined its generation."""
        if self._chan is not None and self._prefetch is None:
            self._prefetch = Prefetch(self._fetch)

    @property
    def restoring(self) -> bool:
        """Whether ``steps`` will load a saved step of this job into the state, every tensor
        of it, before the first step: then a script may build its model without
        initialising it (on the ``meta`` device, then ``to_empty``) and wrap it in DDP
        with ``init_sync=False``, a third of a second at 384 MiB a rank saved on every
        rank's way back. Waits for this rank's plan (it is asked for as the generation
        starts; its failure is raised). False on a fresh start, an ``--init-from`` load
        (which may leave tensors it lacks as they are) and outside ``tierswap run``. What
        the state does not hold is the script's to make: a non-persistent buffer (a
        rotary cache, a mask) and weight ties, which ``to_empty`` undoes."""
        if self._chan is None:
            return False
        if not self._planned.is_set():
            self.prefetch()  # (the worker has started it: this only waits)
            self._planned.wait()
        if self._plan_error is not None:  # every rank must agree: no guess on a failure
            raise self._plan_error
        plan = self._plan
        return plan is not None and plan.step is not None and plan.source is not None

    def _fetch(self) -> Fetched:
        assert self._chan is not None
        t0 = time.monotonic()
        try:
            plan = self._chan.call(p.PlanRequest(rank=self.rank), p.PlanReply)
            self._plan = plan
        except BaseException as e:
            self._plan_error = e
            raise
        finally:
            self._planned.set()
        self.timeline["plan"] = time.monotonic() - t0
        for fault in self._faults:
            if fault.during == "restore" and fault.gen == self.generation:
                self._fire(fault)
        try:
            if plan.step is None or plan.source is None:
                return Fetched(plan)
            self.plan_step, self.plan_tier = plan.step, plan.tier
            source = plan.source
            with self._live_lock:  # (close may be letting go of the job meanwhile)
                live, self._live = self._live, None
                if (
                    live is not None
                    and isinstance(source, p.FromSlot)
                    and live.fits(source.layout)
                    and not self._closed
                ):
                    self._live_step = live  # for job.steps, once the state exists
                    return Fetched(plan)
            if live is not None:
                live.release()
            return fetch(plan, self.rank, self._secret, self._tls, self.timeline, self._reserve)
        finally:
            self._live = None
            if self._reserve is not None:  # a restore that did not take it: not held on
                self._reserve.hold_off()  # while training (the agent asks again at a park)

    def _restore(self, state: MutableMapping[str, Any]) -> int:
        if self._chan is None:
            return 0
        t0 = time.monotonic()
        pending, self._prefetch = self._prefetch, None
        got = pending.result() if pending is not None else self._fetch()
        if pending is not None:
            self.timeline["waited"] = time.monotonic() - t0
        plan = got.plan
        live, self._live_step = self._live_step, None
        if live is not None:
            got = self._from_live(state, plan, live)
        step, tier = plan.step, plan.tier
        if (step is None or tier is None) and plan.init is not None:
            return self._init(state, plan.init, t0)
        if step is None or tier is None:
            return 0
        try:
            assert got.layout is not None
            t = time.monotonic()
            load(state, got.tree, got.views, got.layout, what=got.what, adopt=got.private)
            self._lap("load", t)
        finally:
            got.release()
        seconds = time.monotonic() - t0
        self.restored_step = step
        msg = p.Restored(rank=self.rank, step=step, tier=tier, seconds=seconds, live=got.live)
        self._chan.send(msg)
        return step + 1

    def _from_live(self, state: MutableMapping[str, Any], plan: p.PlanReply, live: Live) -> Fetched:
        """The plan's tier-0 step in ``live``, the state this worker trained (``live.py``):
        here, once ``train(job)`` has built the new state, so that nothing of the user's
        writes into it meanwhile; read as any restore reads it (into memory made now)
        where the new state shares memory with it (an object that outlived ``train``)."""
        got = None
        try:
            try:
                shared = live.shares_memory(flatten(state, with_rng=False).tensors)
            except Exception:  # (what cannot be snapshotted is named by the first take)
                shared = True
            if not shared:
                got = from_live(plan, live, self.timeline)
        finally:
            live.release()
        if got is None:
            got = fetch(plan, self.rank, self._secret, self._tls, self.timeline, self._reserve)
        return got

    def _init(self, state: MutableMapping[str, Any], init: p.InitFrom, t0: float) -> int:
        """Load the job's ``--init-from`` DCP checkpoint (every rank: ``dcp.load`` reshards
        collectively); the job goes on at the step after the one it holds."""
        from tierswap.dcp_init import init_from

        if init.world_size is not None:  # a corrupt part names the step it belongs to
            self.plan_step, self.plan_tier = init.step, 2
        got = init_from(state, init.path, init.step, tier2=init.world_size is not None)
        assert self._chan is not None
        seconds = time.monotonic() - t0
        self._chan.send(
            p.Initialized(rank=self.rank, step=got.step, missing=got.missing, seconds=seconds)
        )
        return got.step + 1

    def _lap(self, phase: str, since: float) -> float:
        """Record the seconds since ``since`` as ``phase`` of the timeline; returns now."""
        now = time.monotonic()
        self.timeline[phase] = now - since
        return now

    def _maybe_inject(self, step: int) -> None:
        for fault in self._faults:
            if fault.action == "slow":
                time.sleep(fault.seconds)  # every step: a slow node
            elif fault.step == step and not fault.during:
                if self._snap is not None:
                    self._snap.drain()  # the step's snapshot held by the agent, then the fault
                self._fire(fault)

    def _in_copy(self, step: int) -> None:
        """The copy thread is half way through ``step``'s snapshot."""
        for fault in self._faults:
            if fault.during == "snapshot" and step >= fault.step:  # a skipped step: the next
                self._fire(fault)

    def _fire(self, fault: Injection) -> None:
        """Report the fault (the coordinator logs it and drops it from the plan), then
        carry it out on this process."""
        if self._chan is None:
            return
        self._chan.call(p.InjectFired(rank=self.rank, spec=str(fault)), p.Ack)
        os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)

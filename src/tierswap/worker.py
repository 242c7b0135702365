"""A worker process: ``launch(train)`` and the loop that lets it outlive a generation.

Under ``tierswap run`` a worker starts parked: it imports the script, connects to its
agent and waits for an assignment (rank, world size, generation). It then joins that
generation's process group and runs ``train(job)``. When a failure elsewhere ends the
generation, ``train(job)`` is unwound by GenerationEnded or by the failed collective,
the worker destroys its process group and parks again; the next assignment enters
``train(job)`` again in the same process, with no re-import and no re-spawn.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, MutableMapping
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, Store

from tierswap.affinity import pin_worker
from tierswap.config import Config
from tierswap.control import protocol as p
from tierswap.errors import CorruptPartError, GenerationEnded, UsageError
from tierswap.faults import FaultPlan
from tierswap.interrupt import SIGNAL
from tierswap.job import Job
from tierswap.live import Live
from tierswap.reserve import Reserve
from tierswap.snapshot import Watermark
from tierswap.store import StoreClient
from tierswap.wire import Channel

EXIT_USAGE = 3
"""Exit code of a worker that stopped on a UsageError: the job stops, no restart."""


def _peer_failed(e: BaseException, ended: threading.Event, grace: float) -> bool:
    """Whether ``train(job)`` failed because another rank died or hung, not by its own
    fault. By type where torch gives one (``DistError``: NCCL's backend errors, network
    and store errors); a plain RuntimeError (what gloo raises when a peer's socket
    closes, or a collective times out) counts when the generation ends within ``grace``
    seconds: a failure elsewhere is detected and ends it within the lease, while an
    error of this rank's own (a bug in the script) ends nothing, and is reported as this
    worker's crash. No error message is read."""
    if isinstance(e, dist.DistError):
        return True
    return isinstance(e, RuntimeError) and ended.wait(grace)


def launch(train: Callable[[Job], Any]) -> None:
    """Run ``train(job)``: alone (world size 1) when started plainly, or as one worker of
    the job when started by ``tierswap run``."""
    if "TIERSWAP_AGENT" not in os.environ:
        _run_standalone(train)
    else:
        _run_worker(train, dict(os.environ))


def _run_standalone(train: Callable[[Job], Any]) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    job = Job()
    try:
        train(job)
    finally:
        job.close()
        dist.destroy_process_group()


class Control:
    """The worker's second connection to its agent: assignments and generation ends come
    in, heartbeats go out. A worker whose agent is gone exits: its node has failed."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        local: int,
        incarnation: int,
        heartbeat: float,
        interrupt: bool = False,
    ) -> None:
        self.chan = Channel.connect(address, secret, p.AgentToWorker)
        self.interrupt = interrupt
        """Signal the training loop's thread when a generation ends (``interrupt.py``)."""
        self.assignments: queue.SimpleQueue[tuple[int, p.Assign]] = queue.SimpleQueue()
        self.ended: dict[int, threading.Event] = {}
        self.tier1: dict[int, Watermark] = {}
        """generation -> how far tier 1 got (the optimizer step waits on it)."""
        self._lock = threading.Lock()
        self.reserve = None if torch.cuda.is_available() else Reserve()
        """Memory faulted in ahead for the next restore (a GPU's state is not adopted)."""
        self.live_held = False
        """Whether this parked worker holds the state it trained (``live.py``): the
        memory its next restore reads into, so none is made ahead (``reserve``)."""
        self.chan.send(p.Attach(local=local, incarnation=incarnation, pid=os.getpid()))
        threading.Thread(target=self._read, name="tierswap-control", daemon=True).start()
        threading.Thread(
            target=self._beat, args=(heartbeat,), name="tierswap-heartbeat", daemon=True
        ).start()

    def event(self, generation: int) -> threading.Event:
        with self._lock:
            return self.ended.setdefault(generation, threading.Event())

    def watermark(self, generation: int) -> Watermark:
        with self._lock:
            return self.tier1.setdefault(generation, Watermark())

    def _read(self) -> None:
        try:
            while True:
                env = self.chan.recv()
                assert env is not None
                match env.msg:
                    case p.Assign(settled=settled):
                        self.event(env.gen)
                        self.watermark(env.gen).advance(settled)
                        self.assignments.put((env.gen, env.msg))
                    case p.Settled(step=step):
                        self.watermark(env.gen).advance(step)
                    case p.Reserve(nbytes=nbytes, slots=slots) if self.reserve is not None:
                        if self.live_held:  # its next restore reads into what it holds
                            self.reserve.want(0)
                        else:
                            self.reserve.want(nbytes, slots)
                    case p.Abort():
                        self.event(env.gen).set()
                        self.watermark(env.gen).close()
                        _abort_communicator()  # first: the loop then leaves its step
                        if self.interrupt:  # now (job.interrupt), the group already aborted
                            signal.pthread_kill(threading.main_thread().ident or 0, SIGNAL)
                    case p.Exit():
                        os._exit(0)
        except (EOFError, OSError, ValueError):
            pass
        os._exit(1)  # the agent is gone: this node has failed, its workers go with it

    def _beat(self, interval: float) -> None:
        while True:
            time.sleep(interval)
            try:
                self.chan.send(p.Beat())
            except OSError:
                return


GROUP = threading.Lock()
"""Held to abort, destroy or take the default process group: the control thread aborts
it when the generation ends while the loop's thread, woken by that abort, leaves it."""


def _abort_communicator() -> None:
    """Release collectives blocked on a dead peer at once. NCCL has an abort; gloo's
    collectives fail by themselves when the peer's sockets close, or at their timeout."""
    with GROUP:
        _abort_nccl()


def _abort_nccl() -> None:
    """Abort the default group if it is NCCL's (with :data:`GROUP` held)."""
    try:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
    except Exception as e:  # the worker parks anyway, by its collective's error or timeout
        print(f"[tierswap] aborting the communicator failed: {e}", file=sys.stderr)


NCCL_ERRORS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
"""What NCCL's watchdog does on an error it sees first (a dead peer's connection, a
timed-out collective): abort the communicators and let the collectives fail (2), so
that the worker parks and stays for the next generation. torch's default (3) ends the
process, which would turn every survivor of a node loss into a replacement to start.
A value the user set is kept."""


def nccl_defaults(environ: MutableMapping[str, str]) -> None:
    """Set what a worker's NCCL groups need unless the user chose otherwise (torch reads
    it when a group is made)."""
    environ.setdefault(*NCCL_ERRORS)


def _run_worker(train: Callable[[Job], Any], env: dict[str, str]) -> None:
    nccl_defaults(os.environ)
    pinned = pin_worker()  # --worker-cpus (by default every CPU but --agent-cpus)
    secret = bytes.fromhex(env["TIERSWAP_KEY"])
    _warm_up()  # before attaching: a worker counts as parked once it is ready to run
    gc.collect()  # the imports' garbage first: what is frozen is never freed
    gc.freeze()  # what is loaded by now lives as long as the process: never scanned again
    chan = Channel.connect(env["TIERSWAP_AGENT"], secret, p.AgentToWorker)
    heartbeat = float(env.get("TIERSWAP_HEARTBEAT", "1.0"))
    local, incarnation = int(env["TIERSWAP_LOCAL"]), int(env.get("TIERSWAP_INCARNATION", "0"))
    interrupt = Config.from_env(env).interrupt_steps  # --no-interrupt-steps
    current: list[Job] = []  # the job of the generation this worker runs, if any
    if interrupt:
        signal.signal(SIGNAL, cut_short(current))
    control = Control(env["TIERSWAP_AGENT"], secret, local, incarnation, heartbeat, interrupt)
    threads = int(env.get("TIERSWAP_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    elif pinned:  # torch counted its threads from the agent's mask it was started with
        ranks_here = max(1, int(env.get("TIERSWAP_NPROC_PER_NODE", "1")))  # they share it
        torch.set_num_threads(max(1, len(pinned) // ranks_here))
    startup = timedelta(seconds=float(env.get("TIERSWAP_STARTUP_TIMEOUT", "120")))
    collective = timedelta(seconds=float(env.get("TIERSWAP_COLLECTIVE_TIMEOUT", "60")))
    # how long a failed collective waits for the generation to end before it counts as
    # this worker's own error: a failure elsewhere is found within a lease
    grace = float(env.get("TIERSWAP_LEASE", "10")) + heartbeat
    stores: dict[str, StoreClient] = {}
    live: Live | None = None  # the state trained in the last generation (``live.py``)
    while True:
        generation, a = control.assignments.get()
        rank = a.rank
        chan.gen = generation  # the agent drops messages of ended generations
        job = Job(
            rank=rank,
            world_size=a.world_size,
            local_rank=a.local_rank,
            local_world_size=a.local_world_size,
            node=a.node,
            generation=generation,
            chan=chan,
            faults=FaultPlan.parse(a.inject).of_rank(rank),
            secret=secret,
            tls=env.get("TIERSWAP_TLS", "auto"),
            ended=control.event(generation),
            tier1=control.watermark(generation),
            max_redo=a.max_redo,
            interrupt_steps=interrupt,
            reserve=control.reserve,
            live=live,  # (kept for the next one if this one ends before it starts)
        )
        os.environ.update(torchrun_env(a))
        t0 = time.monotonic()
        if a.store not in stores:
            host, port = a.store.rsplit(":", 1)
            stores[a.store] = StoreClient((host, int(port)), secret, startup)
        store = PrefixStore(f"gen{generation}/", stores[a.store])
        if not _rendezvous(store, job.world_size, control.event(generation), startup):
            parked = p.Parked(
                generation=generation, rank=rank, reason="ended", why="ended at start"
            )
            control.chan.send(parked)
            continue
        if a.backend == "nccl" and job.device.type == "cuda":
            torch.cuda.set_device(job.device)  # before the group: NCCL binds to this GPU
        dist.init_process_group(
            a.backend,
            store=store,
            rank=rank,
            world_size=job.world_size,
            timeout=collective,
        )
        chan.send(p.Joined(rank=rank, pid=os.getpid(), seconds=time.monotonic() - t0))
        job.joined_at = time.monotonic()
        job.prefetch()  # the restore's bytes arrive while train(job) builds its model
        live = None  # the job's now: its restore lets go of it once it has looked
        current[:] = [job]
        try:
            code = _train_once(train, job, chan, control, grace)
        finally:
            current.clear()
        if code is None:  # parked: the next assignment enters train(job) again
            live, job.kept = job.kept, None
            continue
        if code:
            os._exit(code)  # peers may be blocked in collectives: do not wait for them
        dist.destroy_process_group()
        chan.close()
        _exit_now_if_freeing(0)


def torchrun_env(a: p.Assign) -> dict[str, str]:
    """The variables torchrun gives its workers, for code that reads them (device
    selection, logging): set in the worker when it takes a rank, before ``train(job)``.
    ``MASTER_ADDR``/``MASTER_PORT`` name the job's store, which only the job's secret opens:
    tierswap makes the process group; ``init_process_group("env://")`` cannot."""
    host, port = a.store.rsplit(":", 1)
    return {
        "RANK": str(a.rank),
        "LOCAL_RANK": str(a.local_rank),
        "WORLD_SIZE": str(a.world_size),
        "LOCAL_WORLD_SIZE": str(a.local_world_size),
        "GROUP_RANK": str(a.node),
        "MASTER_ADDR": host,
        "MASTER_PORT": port,
    }


def _rendezvous(store: Store, world_size: int, ended: threading.Event, timeout: timedelta) -> bool:
    """Wait until every rank of the generation has arrived, or until it ended (a member
    died while the others were gathering): False then. torch's own rendezvous inside
    ``init_process_group`` cannot be interrupted, so it only starts once all are here.

    The outcome is one decision in the store, the first made: "go" by the last rank to
    arrive, "ended" by a rank that saw the generation end first. Every rank follows it,
    so no rank parks while the others enter ``init_process_group`` (where they would wait
    for it until their timeout)."""
    if store.add("arrived", 1) == world_size:
        return _decide(store, "ended" if ended.is_set() else "go")
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:  # the store wakes this wait the moment the decision is made
            store.wait(["decision"], RENDEZVOUS_POLL)
            return bytes(store.get("decision")) == b"go"
        except dist.DistError as e:
            if not isinstance(e, dist.DistStoreError) and not ended.is_set():
                raise  # the store cannot be reached, and the generation goes on
            # a DistStoreError: no decision yet
        if ended.is_set():
            return _decide(store, "ended")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {store.add('arrived', 0)} of {world_size} ranks arrived")


def _decide(store: Store, choice: str) -> bool:
    """Make ``choice`` the generation's decision unless one was made; True for "go"."""
    return bytes(store.compare_set("decision", "", choice)) == b"go"


RENDEZVOUS_POLL = timedelta(seconds=0.05)
"""How often a rank waiting for the others checks whether its generation ended."""


WARM_UP = ("torch._dynamo",)
"""Modules torch imports lazily on the first DDP or FSDP wrap (about 2 s on a CPU): a
parked worker imports them before it is needed, so a spare's first step is not slower
than a survivor's."""


def _warm_up() -> None:
    import importlib

    for name in WARM_UP:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _train_once(
    train: Callable[[Job], Any], job: Job, chan: Channel, control: Control, grace: float
) -> int | None:
    """Run one generation of ``train(job)``: an exit code, or None when it ended because of
    a failure elsewhere and the worker has parked for the next one."""
    rank = job.rank
    try:
        _enter(train, job)
        job.close()
        chan.call(p.Finished(rank=rank, step=job.last_step), p.Ack)
        return 0
    except UsageError as e:
        chan.call(p.Fatal(rank=rank, message=f"{type(e).__name__}: {e}"), p.Ack)
        return EXIT_USAGE
    except CorruptPartError as e:
        # the coordinator marks the part bad; this worker leaves the generation (which
        # ends it for all) and is given an older step or another tier in the next one
        corrupt = p.Corrupt(
            rank=rank, where=e.where, why=e.why, step=job.plan_step, tier=job.plan_tier
        )
        chan.call(corrupt, p.Ack)
        reason, why = "corrupt", f"{e.where}: {e.why}"
    except BaseException as e:
        ended = control.event(job.generation)
        if not (job.ended or isinstance(e, GenerationEnded) or _peer_failed(e, ended, grace)):
            return _raised(chan, job, e)
        reason, why = "collective", f"{type(e).__name__}: {str(e)[:200]}"
    _leave(job)
    control.live_held = job.kept is not None  # (before the agent hears of the park)
    control.chan.send(p.Parked(generation=job.generation, rank=rank, reason=reason, why=why))
    return None


def _raised(chan: Channel, job: Job, e: BaseException) -> int:
    """``train(job)`` raised ``e``, not because of a failure elsewhere: print it, tell the
    agent what it was and in which step (the same error in the same step twice stops the
    job), and exit with a ``SystemExit``'s own code, 1 for any other exception."""
    code = e.code & 0xFF if isinstance(e, SystemExit) and isinstance(e.code, int) else 0
    code = code or 1  # (0 would say the rank finished: it did not)
    if not isinstance(e, SystemExit):
        traceback.print_exc()
    elif e.code is not None and not isinstance(e.code, int):
        print(e.code, file=sys.stderr)  # what the interpreter prints of sys.exit("...")
    try:
        lines = str(e).strip().splitlines()
    except Exception:  # (a user's exception whose __str__ fails)
        lines = []
    error = f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__
    with contextlib.suppress(Exception):  # (an agent gone: the exit says enough)
        chan.call(p.Raised(rank=job.rank, step=job.step, error=error), p.Ack, timeout=10)
    return code


def _enter(train: Callable[[Job], Any], job: Job) -> None:
    """``train(job)``: while this frame is on the stack (and only then) the generation's
    end may cut the loop's step short (:func:`_inside_train`)."""
    try:
        train(job)
    finally:
        job.interruptible = False  # (a collective's error left the loop mid-step)
        # an end raised inside a ``finally`` of the loop's (torch's ``no_grad``, say) may
        # have skipped what it restores: the next train(job) starts with torch's default
        torch.set_grad_enabled(True)


def cut_short(current: list[Job]) -> Callable[[int, FrameType | None], None]:
    """The handler of :data:`~tierswap.interrupt.SIGNAL`: the job ``current`` holds, if
    any, cuts its step short (``Job.interrupt``) when the signal came inside ``train``."""

    def handler(_sig: int, frame: FrameType | None) -> None:
        if current and _inside_train(frame):  # not once train(job) has raised or returned
            current[0].interrupt()

    return handler


def _inside_train(frame: FrameType | None) -> bool:
    """Whether the code a signal interrupted runs inside ``_enter``: never the handling
    of an error that already left ``train(job)``, where a second exception would escape."""
    while frame is not None:
        if frame.f_code is _enter.__code__:
            return True
        frame = frame.f_back
    return False


def _leave(job: Job) -> None:
    """Let go of a generation: finish the snapshot copy in flight, unmap the slots and
    destroy the process group (its peers may be dead, so nothing here waits on them)."""
    try:
        job.close()  # the copy in flight may hold the step the next generation restores
    except BaseException as e:  # a copy that failed with its generation: nothing to keep
        print(f"[tierswap] rank {job.rank}: snapshot copy ended with {e}", file=sys.stderr)
    with GROUP:  # (not while the control thread aborts it)
        pg = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        try:
            if pg is not None and dist.get_backend() == "nccl":
                _abort_nccl()  # a graceful NCCL shutdown may wait on a dead peer
            elif pg is not None:  # (none once aborted: nothing is left to destroy)
                dist.destroy_process_group()
        except Exception as e:
            print(f"[tierswap] rank {job.rank}: destroying the process group: {e}", file=sys.stderr)
    # the ended generation's model and optimizer (DDP and FSDP hold them in reference
    # cycles) must be gone before train(job) builds new ones: on a GPU they hold memory
    # (quick: what the worker loaded before its first rank is frozen, out of the scan)
    gc.collect()
    if pg is not None:
        last = [pg]  # the last reference: cleared on the freeing thread only
        pg = None
        _free_elsewhere(last)


def _free_elsewhere(last: list[Any]) -> None:
    """Free an ended generation's process group on a thread of its own. Freeing a gloo
    group closes its connections (which wakes peers blocked on this rank), then joins its
    worker threads; gloo can leave one of those in a receive from a peer that has already
    closed the connection (seen: the socket in CLOSE-WAIT, the receive waiting for its
    timeout, ``--collective-timeout``, 60 s). Joined on this thread, that wait was the
    survivor's and the whole recovery's (seen in 3 of 17 recoveries at 4 nodes, ``tierswap
    bench recovery``). The join releases the GIL: the worker parks and trains on meanwhile."""
    thread = threading.Thread(target=last.clear, name="tierswap-free-group", daemon=True)
    thread.start()
    FREEING.append(thread)


FREEING: list[threading.Thread] = []
"""Threads freeing process groups: one still in gloo's destructor when the interpreter
shuts down aborts the process (exit code 134), so the worker then exits at once."""


def _exit_now_if_freeing(code: int) -> None:
    """Exit with ``code``; straight away (no interpreter shutdown) while a process group
    is still being freed."""
    if any(t.is_alive() for t in FREEING):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

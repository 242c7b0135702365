"""The worker's side of a job: ``launch(train)``, ``Job.steps``, restore and snapshots."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, MutableMapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, TCPStore

from tierswap import snapshot
from tierswap.checksum import checksum_chunks
from tierswap.config import Injection
from tierswap.errors import CorruptPartError, UsageError
from tierswap.shm import Segment
from tierswap.state import Layout, load, tensor_view
from tierswap.tiers import durable, peer
from tierswap.wire import Channel

EXIT_USAGE = 3
"""Exit code of a worker that stopped on a UsageError: the job stops, no restart."""
EXIT_CORRUPT = 4
"""Exit code of a worker whose restore source turned out corrupt: the job re-plans."""


class Job:
    """One worker's view of the job, handed to ``train(job)``."""

    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        generation: int = 0,
        chan: Channel | None = None,
        injections: tuple[Injection, ...] = (),
        secret: bytes = b"",
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.generation = generation
        self._chan = chan
        self._secret = secret
        self._injections = tuple(
            i for i in injections if i.action == "kill" and i.target == "rank" and i.index == rank
        )
        self._snap: snapshot.Snapshotter | None = None
        self.restored_step: int | None = None
        self.plan_step: int | None = None
        self.plan_tier: int | None = None
        self.last_step = -1

    def steps(self, state: MutableMapping[str, Any], total: int) -> Iterator[int]:
        """Restore the newest committed ``state``, then yield the remaining steps up to
        ``total`` (0-based), snapshotting ``state`` after each one."""
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        if not isinstance(state, MutableMapping):
            raise TypeError(f"state must be a dict of Stateful objects and values, got {state!r}")
        start = self._restore(state)
        if self._chan is not None:
            self._chan.send("report", rank=self.rank, step=start - 1, metrics={}, total=total)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()  # nobody trains until every rank holds the same step
        if self._chan is not None and self._snap is None:
            self._snap = snapshot.Snapshotter(self._chan, self.rank)
        for step in range(start, total):
            yield step
            self.last_step = step
            if self._snap is not None:
                self._snap.take(step, state, wait=60.0 if step == total - 1 else 0.0)
            self._maybe_inject(step)
        self.fence()

    def fence(self) -> None:
        """Wait for the snapshot copy in flight; call before changing state outside
        ``optimizer.step()`` (an EMA update, say)."""
        if self._snap is not None:
            self._snap.fence()

    def report(self, step: int, **metrics: float) -> None:
        """Show metrics of a step on the launcher's console and in the event log."""
        clean = {k: float(v) for k, v in metrics.items()}
        if self._chan is not None:
            stall = self._snap.stats.last_stall() if self._snap is not None else 0.0
            self._chan.send("report", rank=self.rank, step=step, metrics=clean, stall=stall)

    def close(self) -> None:
        if self._snap is not None:
            self._snap.close()
            self._snap = None

    # ---------------------------------------------------------------- restore

    def _restore(self, state: MutableMapping[str, Any]) -> int:
        if self._chan is None:
            return 0
        t0 = time.monotonic()
        plan = self._chan.call("plan", rank=self.rank)
        step = plan.get("step")
        if step is None:
            return 0
        source = plan["source"]
        self.plan_step, self.plan_tier = int(step), int(source["tier"])
        if source["tier"] == 0:
            self._load_memory(state, source)
        elif source["tier"] == 1:
            self._load_peer(state, source, step)
        else:
            self._load_durable(state, source, step)
        seconds = time.monotonic() - t0
        self.restored_step = int(step)
        self._chan.send("restored", rank=self.rank, step=step, tier=source["tier"], seconds=seconds)
        return int(step) + 1

    def _load_memory(self, state: MutableMapping[str, Any], source: dict[str, Any]) -> None:
        layout = Layout.from_json(source["layout"])
        seg = Segment.attach(source["segment"], layout.nbytes)
        try:
            got = checksum_chunks(layout.chunks(seg.buf))
            if got != source["checksum"]:
                raise CorruptPartError(str(seg.path), "checksum mismatch in tier-0 memory")
            views = [tensor_view(seg.buf, e) for e in layout.entries]
            load(state, source["tree"], views, layout, what=f"tier-0 step {source['step']}")
            del views
        finally:
            seg.close()

    def _load_peer(
        self, state: MutableMapping[str, Any], source: dict[str, Any], step: int
    ) -> None:
        host, port = source["address"]
        layout, tree, buf = peer.fetch((str(host), int(port)), self._secret, self.rank, step)
        views = [tensor_view(memoryview(buf), e) for e in layout.entries]
        load(state, tree, views, layout, what=f"node {source['node']}'s replica of step {step}")

    def _load_durable(
        self, state: MutableMapping[str, Any], source: dict[str, Any], step: int
    ) -> None:
        expected = durable.PartInfo.from_json(self.rank, source["part"])
        layout, tree, buf = durable.read_part(source["root"], step, self.rank, expected)
        views = [tensor_view(memoryview(buf), e) for e in layout.entries]
        load(state, tree, views, layout, what=f"{source['root']} step {step}")

    def _maybe_inject(self, step: int) -> None:
        for inj in self._injections:
            if inj.step == step and self._chan is not None:
                self.fence()
                self._chan.call("inject_fired", rank=self.rank, spec=str(inj))
                os.kill(os.getpid(), signal.SIGKILL)


def _peer_failed(e: RuntimeError) -> bool:
    """A collective that failed because another rank died: expected, and not this rank's
    fault, so it gets one line instead of a traceback."""
    text = str(e)
    return any(
        m in text
        for m in (
            "Connection closed by peer",
            "Connection reset by peer",
            "Broken pipe",
            "Socket closed",
        )
    )


def _worker_env() -> dict[str, str] | None:
    if "TIERSWAP_AGENT" not in os.environ:
        return None
    return dict(os.environ)


def launch(train: Callable[[Job], Any]) -> None:
    """Run ``train(job)``: alone (world size 1) when started plainly, or as one worker of
    the job when started by ``tierswap run``."""
    env = _worker_env()
    if env is None:
        _run_standalone(train)
    else:
        _run_worker(train, env)


def _run_standalone(train: Callable[[Job], Any]) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    job = Job()
    try:
        train(job)
    finally:
        job.close()
        dist.destroy_process_group()


def _run_worker(train: Callable[[Job], Any], env: dict[str, str]) -> None:
    rank = int(env["TIERSWAP_RANK"])
    chan = Channel.connect(env["TIERSWAP_AGENT"], bytes.fromhex(env["TIERSWAP_SECRET"]))
    chan.stamp = {"gen": int(env["TIERSWAP_GENERATION"])}  # the agent drops stale messages
    threads = int(env.get("TIERSWAP_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    generation = int(env["TIERSWAP_GENERATION"])
    world_size = int(env["TIERSWAP_WORLD_SIZE"])
    injections = tuple(Injection.parse(s) for s in env.get("TIERSWAP_INJECT", "").split(",") if s)
    job = Job(
        rank=rank,
        world_size=world_size,
        local_rank=int(env["TIERSWAP_LOCAL_RANK"]),
        generation=generation,
        chan=chan,
        injections=injections,
        secret=bytes.fromhex(env["TIERSWAP_SECRET"]),
    )
    host, port = env["TIERSWAP_STORE"].rsplit(":", 1)
    timeout = timedelta(seconds=float(env.get("TIERSWAP_STARTUP_TIMEOUT", "120")))
    store = TCPStore(host, int(port), is_master=False, timeout=timeout)
    dist.init_process_group(
        "gloo",
        store=PrefixStore(f"gen{generation}/", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    code = 0
    try:
        train(job)
        job.close()
        chan.call("finished", rank=rank, step=job.last_step)
    except UsageError as e:
        chan.call("fatal", rank=rank, message=f"{type(e).__name__}: {e}")
        code = EXIT_USAGE
    except CorruptPartError as e:
        chan.call(
            "corrupt", rank=rank, where=e.where, why=e.why, step=job.plan_step, tier=job.plan_tier
        )
        code = EXIT_CORRUPT
    except BaseException as e:
        if isinstance(e, RuntimeError) and _peer_failed(e):
            print(
                f"[tierswap] rank {rank}: a peer failed in a collective: {str(e)[:100]}",
                file=sys.stderr,
            )
        else:
            traceback.print_exc()
        code = 1
    finally:
        chan.close()
    if code:
        os._exit(code)  # peers may be blocked in collectives: do not wait for them
    dist.destroy_process_group()
    sys.exit(0)

"""``tierswap bench snapshot``: what a snapshot every step costs, against what users have.

One run, one state (Linear layers and an AdamW that has taken a step, ``--size-mib`` MiB):
1. blocking time per checkpoint of tierswap (``take`` + the wait at the next step's fence,
   after a stand-in forward and backward), ``torch.save`` + fsync, ``dcp.save`` and
   ``dcp.async_save`` (until it returns), interleaved per round (A B C D A B C D ...);
2. the snapshot's copy throughput against a plain ``copy_`` into a touched buffer;
3. ``durable.write_part`` of a held slot against a sequential write + fsync, same disk;
4. the step time of a small MLP with a snapshot every step and without, A B / B A blocks,
   on one torch thread (a core left to the copy and the agent) and on all.

The agent side is real: a ``RankRing`` in a process of its own serves ``alloc``, ``slot``
and ``held`` over an authenticated unix socket and checksums each held slot. The first
round of each measurement is warm-up (slot allocation, page touching, imports), left out.
Before each timed call the copy and the agent's checksums are waited for, untimed; within
section 4's blocks they overlap the steps, as in a real job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from tierswap.checksum import checksum_chunks
from tierswap.shm import remove_job_segments
from tierswap.snapshot import Snapshotter
from tierswap.state import Layout, flatten, make_layout, tensor_view
from tierswap.tiers import durable
from tierswap.tiers.memory import RankRing, Slot
from tierswap.wire import Channel, Message

log = logging.getLogger(__name__)

NSLOTS = 3  # tier-0 slots of the rank: Config.slots' default
WARMUP = 1  # rounds of each measurement run first and left out
COMPUTE_FACTOR = 2.0
"""Section 1's stand-in forward and backward lasts this many plain copies of the state,
far less than a real model holding that much state computes."""
STATE_DEPTH = 8
LOOP_MAX_MIB, LOOP_DEPTH, LOOP_BATCH = 64, 4, 512
"""Section 4's MLP: at most 64 MiB of state, 4 layers, 512 rows a step (6 x 512 FLOP per
parameter, a tiny fraction of a language model's step: little compute hides the copy)."""
LOOP_BLOCK = 5  # timed steps per block, after an untimed one that enters the block
TARGETS: dict[str, tuple[str, float]] = {
    "tierswap/torch_save": ("<=", 0.01),
    "snapshot/copy_": (">=", 0.8),
    "write_part/sequential": (">=", 0.8),
    "step_overhead/threads_1": ("<=", 0.02),
    "step_overhead/threads_all": ("<=", 0.02),
}
_SECRET_ENV = "TIERSWAP_BENCH_SECRET"
_CHUNK = 64 << 20

Sample = dict[str, float]
Stats = dict[str, Any]


def _stats(xs: Sequence[float]) -> Stats:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": list(xs)}


def _interleave(
    methods: Mapping[str, Callable[[], Sample]],
    repeats: int,
    between: Callable[[], None],
    *,
    alternate: bool = False,
) -> dict[str, dict[str, Stats]]:
    """``WARMUP + repeats`` rounds of the methods in turn (order reversed every other round
    with ``alternate``); the stats of every number they return, warm-up left out."""
    samples: dict[str, list[Sample]] = {name: [] for name in methods}
    for r in range(WARMUP + repeats):
        order = list(methods)[:: -1 if alternate and r % 2 else 1]
        for name in order:
            between()
            sample = methods[name]()
            if r >= WARMUP:
                samples[name].append(sample)
    return {n: {k: _stats([s[k] for s in ss]) for k in ss[0]} for n, ss in samples.items()}


def _width(size_mib: float, depth: int) -> int:
    """Width of ``depth`` square layers holding ``size_mib`` MiB with AdamW (12 B/param)."""
    return max(8, int(math.sqrt(size_mib * 2**20 / 12 / depth)))


# ---------------------------------------------------------------- the agent's side


class _Agent:
    """Tier 0 of one rank, served as ``cluster/agent.py`` serves it."""

    def __init__(self, chan: Channel, job_id: str) -> None:
        self.chan = chan
        self.ring = RankRing(job_id, 0, NSLOTS)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tierswap-check")
        self.checks: list[Future[None]] = []

    def serve(self) -> None:
        try:
            while (msg := self.chan.recv()) is not None:
                self._on(msg)
        except EOFError:
            pass  # the benchmark closed its end: done
        finally:
            self.pool.shutdown(wait=True)
            self.ring.close()

    def _on(self, msg: Message) -> None:
        if msg["op"] == "held":
            self._held(msg)  # no reply; an error here ends the process, and so the bench
            return
        handler = getattr(self, f"_{msg['op']}", None)
        try:
            if handler is None:
                raise ValueError(f"unknown request {msg['op']!r}")
            reply = handler(msg)
        except (ValueError, KeyError, OSError) as e:
            self.chan.send("error", message=f"{type(e).__name__}: {e}")
            return
        self.chan.send("ok", **reply)

    def _alloc(self, msg: Message) -> dict[str, Any]:
        with self.lock:
            alloc = self.ring.allocate(Layout.from_json(msg["layout"]))
        return {"alloc": alloc.id, "segments": [s.segment.path.name for s in alloc.slots]}

    def _slot(self, msg: Message) -> dict[str, Any]:
        with self.lock:
            slot, _ = self.ring.begin_write(int(msg["step"]), int(msg["alloc"]))
        return {"slot": slot}

    def _held(self, msg: Message) -> None:
        step = int(msg["step"])
        with self.lock:
            slot = self.ring.written(int(msg["slot"]), step, int(msg["alloc"]), msg["tree"])
            layout = self.ring.layout()
        self.checks.append(self.pool.submit(self._check, slot, layout, step))

    def _check(self, slot: Slot, layout: Layout, step: int) -> None:
        digest = checksum_chunks(layout.chunks(slot.segment.buf))
        with self.lock:
            self.ring.checked(slot, digest)
            self.ring.set_committed(step)  # one rank: held by all ranks means committed

    def _sync(self, msg: Message) -> dict[str, Any]:
        for check in self.checks:
            check.result()
        self.checks.clear()
        return {}

    def _persist(self, msg: Message) -> dict[str, Any]:
        self._sync(msg)
        with self.lock:
            slot, layout = self.ring.lease(int(msg["step"])), self.ring.layout()
        if slot is None:
            raise ValueError(f"step {msg['step']} is not held")
        try:
            t0 = time.monotonic()
            info = durable.write_part(
                str(msg["root"]), slot.step, 0, 1, layout, slot.tree, slot.segment.buf,
                slot.checksum,
            )  # fmt: skip
            seconds = time.monotonic() - t0
        finally:
            with self.lock:
                self.ring.unlease(slot)
        return {"seconds": seconds, "nbytes": info.nbytes}


def _agent_main(argv: list[str]) -> None:
    """The agent process: ``python -m tierswap.bench SOCKET JOB_ID``, secret in the env."""
    address, job_id = argv
    secret = bytes.fromhex(os.environ.pop(_SECRET_ENV))
    with Listener(address, family="AF_UNIX", authkey=secret) as listener:
        conn = listener.accept()
    _Agent(Channel(conn), job_id).serve()


# ---------------------------------------------------------------- the worker's side


class _Rig:
    """A Snapshotter of rank 0 and its agent in a process of its own."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.step = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.chan: Channel | None = None
        self.snap: Snapshotter | None = None

    def start(self, tmp: Path) -> None:
        secret = secrets.token_bytes(16)
        address = str(tmp / "agent.sock")
        env = {**os.environ, _SECRET_ENV: secret.hex()}
        cmd = [sys.executable, "-m", "tierswap.bench", address, self.job_id]
        self.proc = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + 120
        while self.chan is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                raise RuntimeError(f"bench agent: no listener at {address} (exit code {code})")
            with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
                self.chan = Channel.connect(address, secret)
            time.sleep(0.02)
        self.snap = Snapshotter(self.chan, rank=0)

    @property
    def snapshotter(self) -> Snapshotter:
        assert self.snap is not None
        return self.snap

    def take(self, state: Mapping[str, Any], *, required: bool = True) -> None:
        """Snapshot ``state`` as the next step; a skip (no free slot) is counted in the
        stats, and is an error where the measurement needs this snapshot."""
        self.step += 1
        if not self.snapshotter.take(self.step, state) and required:
            raise RuntimeError(f"tierswap skipped step {self.step}: no free slot")

    def call(self, op: str, **fields: Any) -> Message:
        assert self.chan is not None
        return self.chan.call(op, timeout=600, **fields)

    def sync(self) -> None:
        """Wait, untimed, for the copy in flight and the agent's checksums."""
        self.snapshotter.fence()
        self.call("sync")

    def close(self) -> None:
        """Stop the copy thread and the agent; remove any segment left behind."""
        try:
            if self.snap is not None:
                self.snap.close()
        finally:
            if self.chan is not None:
                self.chan.close()  # the agent sees EOF, unlinks its slots and exits
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=60 if self.chan is not None else 0)
                except subprocess.TimeoutExpired:
                    log.warning("bench agent %d did not exit; killing it", self.proc.pid)
                    self.proc.kill()
                    self.proc.wait(timeout=10)
            if left := remove_job_segments(self.job_id):
                log.warning("removed %d shared-memory segments the bench agent left", left)


# ---------------------------------------------------------------- state


def make_state(size_mib: float) -> dict[str, Any]:
    """Linear layers and an AdamW that has taken one step: ``size_mib`` MiB in all."""
    width = _width(size_mib, STATE_DEPTH)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(STATE_DEPTH)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)  # later steps of section 1 only run the fence
    return {"model": model, "optim": opt}


class _Plain:
    """The tensors a snapshot copies off the critical path, and a touched buffer laid out
    like a slot to ``copy_`` them into."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        flat = flatten(state, with_rng=False)
        layout = make_layout(flat)
        self.buf = bytearray(layout.nbytes)  # zero-filled, so touched
        views = [tensor_view(memoryview(self.buf), e) for e in layout.entries]
        pairs = zip(layout.entries, flat.tensors, views, strict=True)
        self.pairs = [(src, dst) for e, src, dst in pairs if e.deferred]
        self.nbytes = sum(e.nbytes for e in layout.entries if e.deferred)

    def copy(self) -> float:
        t0 = time.monotonic()
        for src, dst in self.pairs:
            dst.copy_(src)
        return time.monotonic() - t0


def _compute(seconds: float) -> None:
    """A stand-in for forward and backward: matmuls for ``seconds``."""
    a, b, out = torch.randn(256, 256), torch.randn(256, 256), torch.empty(256, 256)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        torch.mm(a, b, out=out)


# ---------------------------------------------------------------- 1. blocking time


def _tierswap_once(rig: _Rig, state: Mapping[str, Any], compute_s: float) -> Sample:
    stats = rig.snapshotter.stats
    t0 = time.monotonic()
    rig.take(state)
    take = time.monotonic() - t0
    waits = len(stats.fence_waits)
    _compute(compute_s)
    state["optim"].step()  # no gradients: only its pre-hook, the fence, does work
    fence = sum(stats.fence_waits[waits:])
    return {"blocking": take + fence, "take": take, "fence": fence, "copy": stats.copy_times[-1]}


def _torch_save_once(state: Mapping[str, Any], path: Path) -> Sample:
    t0 = time.monotonic()
    with open(path, "wb") as f:
        torch.save({name: obj.state_dict() for name, obj in state.items()}, f)
        f.flush()
        os.fsync(f.fileno())
    blocking = time.monotonic() - t0
    path.unlink()
    return {"blocking": blocking}


def _dcp_state(state: Mapping[str, Any]) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(state["model"], state["optim"])
    return {"model": model_sd, "optim": optim_sd}


def _dcp_save_once(state: Mapping[str, Any], path: Path) -> Sample:
    t0 = time.monotonic()
    save(_dcp_state(state), checkpoint_id=path)  # its FileSystemWriter fsyncs each file
    blocking = time.monotonic() - t0
    shutil.rmtree(path)
    return {"blocking": blocking}


def _async_save_once(state: Mapping[str, Any], path: Path) -> Sample:
    t0 = time.monotonic()
    res = async_save(_dcp_state(state), checkpoint_id=path)
    blocking = time.monotonic() - t0
    (res if isinstance(res, Future) else res.upload_completion).result(timeout=600)
    total = time.monotonic() - t0
    shutil.rmtree(path)
    return {"blocking": blocking, "total": total}


def _bench_blocking(
    rig: _Rig, state: Mapping[str, Any], tmp: Path, repeats: int, compute_s: float
) -> dict[str, Any]:
    methods: dict[str, Callable[[], Sample]] = {
        "tierswap": lambda: _tierswap_once(rig, state, compute_s),
        "torch_save": lambda: _torch_save_once(state, tmp / "torch-save.pt"),
        "dcp_save": lambda: _dcp_save_once(state, tmp / "dcp"),
        "dcp_async_save": lambda: _async_save_once(state, tmp / "dcp-async"),
    }
    return {"compute_s": compute_s, **_interleave(methods, repeats, rig.sync)}


# ---------------------------------------------------------------- 2. and 3. throughput


def _snapshot_copy_once(rig: _Rig, state: Mapping[str, Any], nbytes: int) -> Sample:
    rig.take(state)
    rig.snapshotter.fence()
    return {"bps": nbytes / rig.snapshotter.stats.copy_times[-1]}


def _write_part_once(rig: _Rig, root: Path) -> Sample:
    reply = rig.call("persist", root=str(root), step=rig.step)
    shutil.rmtree(root)
    return {"bps": int(reply["nbytes"]) / float(reply["seconds"])}


def _sequential_once(path: Path, buf: bytearray, nbytes: int) -> Sample:
    data = memoryview(buf)[:nbytes]
    t0 = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while data:
            data = data[os.write(fd, data[:_CHUNK]) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.monotonic() - t0
    path.unlink()
    return {"bps": nbytes / seconds}


def _bench_throughput(
    rig: _Rig, state: Mapping[str, Any], tmp: Path, repeats: int
) -> dict[str, Any]:
    """Sections 2 and 3; section 1's stand-in compute lasts COMPUTE_FACTOR plain copies."""
    plain = _Plain(state)
    n = plain.nbytes
    copy = _interleave(
        {"snapshot": lambda: _snapshot_copy_once(rig, state, n),
         "copy_": lambda: {"bps": n / plain.copy()}},
        repeats, rig.sync,
    )  # fmt: skip
    write = _interleave(
        {"write_part": lambda: _write_part_once(rig, tmp / "durable"),
         "sequential": lambda: _sequential_once(tmp / "sequential.bin", plain.buf, n)},
        repeats, rig.sync,
    )  # fmt: skip
    compute_s = COMPUTE_FACTOR * n / copy["copy_"]["bps"]["median"]
    return {"compute_s": compute_s, "copy": {"nbytes": n, **copy}, "write": {"nbytes": n, **write}}


# ---------------------------------------------------------------- 4. step time


@dataclass(slots=True)
class _Loop:
    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor

    @staticmethod
    def make(size_mib: int) -> _Loop:
        width = _width(min(size_mib, LOOP_MAX_MIB), LOOP_DEPTH)
        layers: list[nn.Module] = []
        for _ in range(LOOP_DEPTH):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return _Loop(model, opt, torch.randn(LOOP_BATCH, width), torch.randn(LOOP_BATCH, width))

    def step(self, rig: _Rig | None) -> float:
        t0 = time.monotonic()
        F.mse_loss(self.model(self.x), self.y).backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if rig is not None:
            rig.take({"model": self.model, "optim": self.opt}, required=False)
        return time.monotonic() - t0


def _block(loop: _Loop, rig: _Rig, snapshot: bool) -> Sample:
    """Mean step time over ``LOOP_BLOCK`` steps after an untimed one that enters the block;
    with snapshots also the stall (time in take and at fences) and the background copy."""
    who = rig if snapshot else None
    loop.step(who)
    stats = rig.snapshotter.stats
    takes, waits, copies = len(stats.sync_copies), len(stats.fence_waits), len(stats.copy_times)
    seconds = sum(loop.step(who) for _ in range(LOOP_BLOCK)) / LOOP_BLOCK
    if not snapshot:
        return {"step_s": seconds}
    stall = sum(stats.sync_copies[takes:]) + sum(stats.fence_waits[waits:])
    copy = sum(stats.copy_times[copies:])
    return {"step_s": seconds, "stall_s": stall / LOOP_BLOCK, "copy_s": copy / LOOP_BLOCK}


def _bench_steps(rig: _Rig, size_mib: int, repeats: int) -> dict[str, Any]:
    loop = _Loop.make(size_mib)
    params = sum(p.numel() for p in loop.model.parameters())
    out: dict[str, Any] = {"params": params, "batch": LOOP_BATCH, "state_bytes": 12 * params}
    skipped = rig.snapshotter.stats.skipped
    for key, threads in (("threads_1", 1), ("threads_all", os.cpu_count() or 1)):
        torch.set_num_threads(threads)
        methods: dict[str, Callable[[], Sample]] = {
            "with_snapshot": lambda: _block(loop, rig, True),
            "without": lambda: _block(loop, rig, False),
        }
        ab = _interleave(methods, repeats, rig.sync, alternate=True)
        w, wo = (ab[k]["step_s"]["samples"] for k in ("with_snapshot", "without"))
        pairs = zip(w, wo, strict=True)
        out[key] = {"threads": threads, **ab, "overhead": _stats([a / b - 1 for a, b in pairs])}
    out["skipped"] = rig.snapshotter.stats.skipped - skipped
    return out


# ---------------------------------------------------------------- the run


def _ratios(res: Mapping[str, Any]) -> dict[str, float]:
    def med(*path: str) -> float:
        node: Any = res
        for key in path:
            node = node[key]
        return float(node["median"])

    ts = med("blocking", "tierswap", "blocking")
    out = {f"tierswap/{k}": ts / med("blocking", k, "blocking") for k in _BASELINES}
    out["snapshot/copy_"] = med("copy", "snapshot", "bps") / med("copy", "copy_", "bps")
    write = med("write", "write_part", "bps") / med("write", "sequential", "bps")
    out["write_part/sequential"] = write
    for key in ("threads_1", "threads_all"):
        out[f"step_overhead/{key}"] = med("step", key, "overhead")
    return out


_BASELINES = ("torch_save", "dcp_save", "dcp_async_save")


def _process_group(stack: contextlib.ExitStack) -> None:
    """A one-rank gloo group for dcp, unless one exists; destroyed on the way out."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
        stack.callback(dist.destroy_process_group)


def _measure(rig: _Rig, tmp: Path, size_mib: int, repeats: int) -> dict[str, Any]:
    state = make_state(size_mib)
    res = _bench_throughput(rig, state, tmp, repeats)
    res["blocking"] = _bench_blocking(rig, state, tmp, repeats, res.pop("compute_s"))
    del state  # free the big state before the loop's
    res["step"] = _bench_steps(rig, size_mib, repeats)
    return res


def run(size_mib: int, repeats: int) -> dict[str, Any]:
    """Every measurement, then the ratios; temp files, segments, the agent process, threads
    and a process group made here are gone when it returns."""
    job_id = f"bench-{secrets.token_hex(4)}"
    machine = {"cpu_count": os.cpu_count(), "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
               "platform": platform.platform()}  # fmt: skip
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tierswap-bench-")))
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        _process_group(stack)
        rig = _Rig(job_id)
        stack.callback(rig.close)
        rig.start(tmp)
        res = _measure(rig, tmp, size_mib, repeats)
    config = {"size_mib": size_mib, "repeats": repeats, "warmup": WARMUP, "slots": NSLOTS,
              "compute_factor": COMPUTE_FACTOR, "job_id": job_id, "disk_dir": str(tmp)}  # fmt: skip
    return {"machine": machine, "config": config, **res, "ratios": _ratios(res)}


# ---------------------------------------------------------------- the report

_ROWS = (  # section, measure, path to its stats, unit
    ("blocking", "tierswap: take + fence", "blocking/tierswap/blocking", "ms"),
    ("", "  in take", "blocking/tierswap/take", "ms"),
    ("", "  at the fence", "blocking/tierswap/fence", "ms"),
    ("", "  (copy, overlapping compute)", "blocking/tierswap/copy", "ms"),
    ("", "torch.save + fsync", "blocking/torch_save/blocking", "ms"),
    ("", "dcp.save", "blocking/dcp_save/blocking", "ms"),
    ("", "dcp.async_save, until it returns", "blocking/dcp_async_save/blocking", "ms"),
    ("", "  (until its future is done)", "blocking/dcp_async_save/total", "ms"),
    ("copy", "snapshot copy", "copy/snapshot/bps", "GiB/s"),
    ("", "plain copy_", "copy/copy_/bps", "GiB/s"),
    ("write", "durable.write_part", "write/write_part/bps", "GiB/s"),
    ("", "sequential write + fsync", "write/sequential/bps", "GiB/s"),
    ("step", "{n} thread(s), snapshot every step", "step/{k}/with_snapshot/step_s", "ms"),
    ("", "  stall per step (take + fence)", "step/{k}/with_snapshot/stall_s", "ms"),
    ("", "  (its copy, in the background)", "step/{k}/with_snapshot/copy_s", "ms"),
    ("", "{n} thread(s), no snapshot", "step/{k}/without/step_s", "ms"),
)


def _cells(stats: Stats, unit: str) -> tuple[str, str]:
    scale = 1e3 if unit == "ms" else 1 / (1 << 30)
    lo, mid, hi = (scale * stats[k] for k in ("min", "median", "max"))
    digits = 1 if unit == "ms" else 2
    return f"{mid:.{digits}f} {unit}", f"{lo:.{digits}f} – {hi:.{digits}f}"


def _rows(res: Mapping[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for k in ("", "threads_1", "threads_all"):
        for section, measure, path, unit in _ROWS:
            if ("{k}" in path) != bool(k):
                continue
            node: Any = res
            for part in path.format(k=k).split("/"):
                node = node[part]
            n = res["step"][k]["threads"] if k else 0
            rows.append((section, measure.format(n=n), *_cells(node, unit)))
    return rows


def report(res: Mapping[str, Any]) -> None:
    """Print the measurements and the ratios as two tables."""
    from rich.console import Console
    from rich.table import Table

    m, c = res["machine"], res["config"]
    title = (f"tierswap bench snapshot: {res['copy']['nbytes'] / 2**20:.0f} MiB of state, "
             f"{c['repeats']} repeats (+{c['warmup']} warm-up), {m['cpu_count']} CPUs, "
             f"torch {m['torch']}")  # fmt: skip
    table = Table("section", "measure", "median", "min – max", title=title)
    for row in _rows(res):
        table.add_row(*row)
    ratios = Table("ratio", "median", "target", "met")
    for name, value in res["ratios"].items():
        op, goal = TARGETS.get(name, ("", 0.0))
        met = value <= goal if op == "<=" else value >= goal
        ratios.add_row(name, f"{100 * value:.2f} %", f"{op} {100 * goal:g} %" if op else "",
                       ("yes" if met else "NO") if op else "")  # fmt: skip
    Console().print(table, ratios)


def main(args: argparse.Namespace) -> int:
    """``tierswap bench snapshot [--size-mib M] [--repeats N] [--json PATH]``."""
    if args.what != "snapshot":
        raise ValueError(f"bench {args.what!r}: only 'snapshot' is measured")
    if args.size_mib < 1 or args.repeats < 1:
        raise ValueError(f"--size-mib {args.size_mib}, --repeats {args.repeats}: use >= 1 each")
    res = run(args.size_mib, args.repeats)
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    _agent_main(sys.argv[1:])

"""``tierswap bench snapshot``: what a snapshot every step costs, against what users have.

One run, one state: a module of large Linear layers and an AdamW optimizer that has taken a
step, about ``--size-mib`` MiB of parameters and optimizer state. Four measurements:

1. Blocking time per checkpoint, the time the training loop cannot go on. tierswap:
   ``Snapshotter.take`` plus the wait at the fence of the next ``optimizer.step()``, after
   a simulated forward and backward (matmuls for :data:`COMPUTE_FACTOR` times one plain
   copy of the state). ``torch.save`` to a file with fsync; ``dcp.save``;
   ``dcp.async_save`` until it returns (its future is awaited untimed). The methods are
   interleaved per repeat (A B C D A B C D ...).
2. Copy throughput: the snapshot's deferred copy against a plain ``copy_`` of the same
   tensors into a touched buffer laid out like a slot.
3. Tier-2 write throughput: ``durable.write_part`` of a held slot against a sequential
   write and fsync of as many bytes to the same disk.
4. Step time of a small MLP with a snapshot every step and without, on one torch thread
   (a core left to the copy thread and the agent) and on all of them.

The agent side is real: a :class:`~tierswap.tiers.memory.RankRing` in a spawned process
serves ``alloc``/``slot``/``held`` over a :class:`~tierswap.wire.Channel` (an anonymous
socket pair) and checksums each held slot, as the agent does. The first round of every
measurement is warm-up (slot allocation, page touching, lazy imports) and is not counted.
Before each timed call the agent's checksums are waited for, untimed, so that one
method's background work never lands in another's time.
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

NSLOTS = 3
"""Tier-0 slots of the benchmark's rank, as ``Config.slots`` defaults to."""
WARMUP = 1
"""Rounds of every measurement run first and not counted."""
COMPUTE_FACTOR = 2.0
"""Section 1's simulated forward and backward runs matmuls for this many times one plain
copy of the state: far less than a real model with that much state needs."""
STATE_DEPTH = 8
"""Linear layers of the benchmark state."""
LOOP_MAX_MIB = 64
"""Section 4's MLP holds min(--size-mib, this) MiB of parameters and optimizer state."""
LOOP_DEPTH = 4
LOOP_BATCH = 256
LOOP_BLOCK = 5
"""Timed steps per block of section 4, after one untimed step that enters the block."""
_CHUNK = 64 << 20
_SECRET_ENV = "TIERSWAP_BENCH_SECRET"
_GIB = float(1 << 30)

Sample = dict[str, float]


def _stats(xs: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": list(xs)}


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
                if msg["op"] == "held":
                    self._held(msg)
                else:
                    self._call(msg)
        except EOFError:
            pass  # the benchmark closed its end: done
        finally:
            self.pool.shutdown(wait=True)
            self.ring.close()

    def _call(self, msg: Message) -> None:
        handler: Callable[[Message], dict[str, Any]] | None = getattr(self, f"_{msg['op']}", None)
        if handler is None:
            self.chan.send("error", message=f"unknown request {msg['op']!r}")
            return
        try:
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
            self.ring.set_committed(step)  # one rank: held by every rank means committed

    def _sync(self, msg: Message) -> dict[str, Any]:
        for check in self.checks:
            check.result()
        self.checks.clear()
        return {}

    def _persist(self, msg: Message) -> dict[str, Any]:
        self._sync(msg)
        step = int(msg["step"])
        with self.lock:
            slot, layout = self.ring.lease(step), self.ring.layout()
        if slot is None:
            raise ValueError(f"step {step} is not held")
        try:
            t0 = time.monotonic()
            info = durable.write_part(
                str(msg["root"]), step, 0, 1, layout, slot.tree, slot.segment.buf, slot.checksum
            )
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
        self.chan = self._connect(self.proc, address, secret)
        self.snap = Snapshotter(self.chan, rank=0)

    @staticmethod
    def _connect(proc: subprocess.Popen[bytes], address: str, secret: bytes) -> Channel:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the bench agent exited with {proc.returncode}")
            with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
                return Channel.connect(address, secret)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the bench agent did not listen on {address} in 120 s")
            time.sleep(0.05)

    @property
    def snapshotter(self) -> Snapshotter:
        assert self.snap is not None
        return self.snap

    def take(self, state: Mapping[str, Any]) -> bool:
        self.step += 1
        return self.snapshotter.take(self.step, state)

    def call(self, op: str, **fields: Any) -> Message:
        assert self.chan is not None
        return self.chan.call(op, timeout=600, **fields)

    def sync(self) -> None:
        """Wait, untimed, for the agent's checksums of the snapshots sent so far."""
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
                self._stop(self.proc, wait=60 if self.chan is not None else 0)
            if left := remove_job_segments(self.job_id):
                log.warning("removed %d shared-memory segments the bench agent left", left)

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes], wait: float) -> None:
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            log.warning("bench agent %d did not exit in %.0f s; killing it", proc.pid, wait)
            proc.kill()
            proc.wait(timeout=10)


def _need(taken: bool) -> None:
    if not taken:
        raise RuntimeError("tierswap skipped a snapshot (no free slot): the timing is void")


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
    like a slot to copy them into with plain ``copy_``."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        flat = flatten(state, with_rng=False)
        layout = make_layout(flat)
        self.buf = bytearray(layout.nbytes)  # zero-filled, so touched
        views = [tensor_view(memoryview(self.buf), e) for e in layout.entries]
        self.pairs = [
            (src, dst)
            for e, src, dst in zip(layout.entries, flat.tensors, views, strict=True)
            if e.deferred
        ]
        self.nbytes = sum(e.nbytes for e in layout.entries if e.deferred)

    def copy(self) -> float:
        t0 = time.monotonic()
        for src, dst in self.pairs:
            dst.copy_(src)
        return time.monotonic() - t0


def _compute(seconds: float) -> None:
    """A stand-in for forward and backward: matmuls for ``seconds``."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    out = torch.empty(256, 256)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        torch.mm(a, b, out=out)


# ---------------------------------------------------------------- 1. blocking time


def _tierswap_once(rig: _Rig, state: Mapping[str, Any], compute_s: float) -> Sample:
    stats = rig.snapshotter.stats
    t0 = time.monotonic()
    _need(rig.take(state))
    take = time.monotonic() - t0
    waits = len(stats.fence_waits)
    _compute(compute_s)
    state["optim"].step()  # no gradients: only the pre-hook's fence does work
    fence = stats.fence_waits[-1] if len(stats.fence_waits) > waits else 0.0
    return {"blocking": take + fence, "take": take, "fence": fence, "copy": stats.copy_times[-1]}


def _torch_save_once(state: Mapping[str, Any], tmp: Path) -> Sample:
    path = tmp / "torch-save.pt"
    t0 = time.monotonic()
    sd = {name: obj.state_dict() for name, obj in state.items()}
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    blocking = time.monotonic() - t0
    path.unlink()
    return {"blocking": blocking}


def _dcp_state(state: Mapping[str, Any]) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(state["model"], state["optim"])
    return {"model": model_sd, "optim": optim_sd}


def _dcp_save_once(state: Mapping[str, Any], tmp: Path) -> Sample:
    path = tmp / "dcp"
    t0 = time.monotonic()
    save(_dcp_state(state), checkpoint_id=path)  # FileSystemWriter fsyncs its files
    blocking = time.monotonic() - t0
    shutil.rmtree(path)
    return {"blocking": blocking}


def _async_save_once(state: Mapping[str, Any], tmp: Path) -> Sample:
    path = tmp / "dcp-async"
    t0 = time.monotonic()
    res = async_save(_dcp_state(state), checkpoint_id=path)
    blocking = time.monotonic() - t0
    fut = res if isinstance(res, Future) else res.upload_completion
    fut.result(timeout=600)
    total = time.monotonic() - t0
    shutil.rmtree(path)
    return {"blocking": blocking, "total": total}


def _bench_blocking(
    rig: _Rig, state: Mapping[str, Any], tmp: Path, repeats: int, compute_s: float
) -> dict[str, Any]:
    methods: dict[str, Callable[[], Sample]] = {
        "tierswap": lambda: _tierswap_once(rig, state, compute_s),
        "torch_save": lambda: _torch_save_once(state, tmp),
        "dcp_save": lambda: _dcp_save_once(state, tmp),
        "dcp_async_save": lambda: _async_save_once(state, tmp),
    }
    samples: dict[str, list[Sample]] = {name: [] for name in methods}
    for r in range(WARMUP + repeats):
        for name, once in methods.items():
            rig.sync()
            sample = once()
            if r >= WARMUP:
                samples[name].append(sample)
    out: dict[str, Any] = {
        name: {key: _stats([s[key] for s in ss]) for key in ss[0]} for name, ss in samples.items()
    }
    out["compute_s"] = compute_s
    ts = out["tierswap"]["blocking"]["median"]
    out["ratios"] = {
        f"tierswap/{name}": ts / out[name]["blocking"]["median"]
        for name in ("torch_save", "dcp_save", "dcp_async_save")
    }
    return out


# ---------------------------------------------------------------- 2. and 3. throughput


def _bench_copy(rig: _Rig, state: Mapping[str, Any], plain: _Plain, repeats: int) -> dict[str, Any]:
    snap_bps: list[float] = []
    plain_bps: list[float] = []
    for r in range(WARMUP + repeats):
        rig.sync()
        _need(rig.take(state))
        rig.snapshotter.fence()
        snap_s = rig.snapshotter.stats.copy_times[-1]
        rig.sync()
        plain_s = plain.copy()
        if r >= WARMUP:
            snap_bps.append(plain.nbytes / snap_s)
            plain_bps.append(plain.nbytes / plain_s)
    snap, ref = _stats(snap_bps), _stats(plain_bps)
    ratio = snap["median"] / ref["median"]
    return {"nbytes": plain.nbytes, "snapshot_bps": snap, "copy_bps": ref, "ratio": ratio}


def _sequential_write(path: Path, buf: bytearray, nbytes: int) -> float:
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
    return seconds


def _bench_write(rig: _Rig, plain: _Plain, tmp: Path, repeats: int) -> dict[str, Any]:
    part_bps: list[float] = []
    seq_bps: list[float] = []
    root = tmp / "durable"
    for r in range(WARMUP + repeats):
        reply = rig.call("persist", root=str(root), step=rig.step)
        shutil.rmtree(root)
        nbytes = int(reply["nbytes"])
        seq_s = _sequential_write(tmp / "sequential.bin", plain.buf, nbytes)
        if r >= WARMUP:
            part_bps.append(nbytes / float(reply["seconds"]))
            seq_bps.append(nbytes / seq_s)
    part, seq = _stats(part_bps), _stats(seq_bps)
    ratio = part["median"] / seq["median"]
    return {"nbytes": nbytes, "write_part_bps": part, "sequential_bps": seq, "ratio": ratio}


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
        x, y = torch.randn(LOOP_BATCH, width), torch.randn(LOOP_BATCH, width)
        return _Loop(model, opt, x, y)

    def step(self, rig: _Rig | None) -> float:
        t0 = time.monotonic()
        loss = F.mse_loss(self.model(self.x), self.y)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if rig is not None:
            rig.take({"model": self.model, "optim": self.opt})
        return time.monotonic() - t0


def _block(loop: _Loop, rig: _Rig, snapshot: bool) -> float:
    """Mean step time over a block; its first step (which enters it) is not timed."""
    who = rig if snapshot else None
    loop.step(who)
    seconds = sum(loop.step(who) for _ in range(LOOP_BLOCK)) / LOOP_BLOCK
    rig.sync()
    return seconds


def _ab(loop: _Loop, rig: _Rig, repeats: int) -> dict[str, Any]:
    with_s: list[float] = []
    without_s: list[float] = []
    for r in range(WARMUP + repeats):
        order = (True, False) if r % 2 else (False, True)  # A B, then B A: drift cancels
        times = {snap: _block(loop, rig, snap) for snap in order}
        if r >= WARMUP:
            with_s.append(times[True])
            without_s.append(times[False])
    paired = [100 * (w / wo - 1) for w, wo in zip(with_s, without_s, strict=True)]
    return {
        "with_snapshot_s": _stats(with_s),
        "without_s": _stats(without_s),
        "overhead_pct": _stats(paired),
    }


def _bench_steps(rig: _Rig, size_mib: int, repeats: int) -> dict[str, Any]:
    loop = _Loop.make(size_mib)
    width = loop.x.shape[1]
    out: dict[str, Any] = {"width": width, "depth": LOOP_DEPTH, "batch": LOOP_BATCH}
    skipped = rig.snapshotter.stats.skipped
    for key, threads in (("threads_1", 1), ("threads_all", os.cpu_count() or 1)):
        torch.set_num_threads(threads)
        out[key] = {"threads": threads, **_ab(loop, rig, repeats)}
    out["skipped"] = rig.snapshotter.stats.skipped - skipped
    out["state_bytes"] = sum(3 * p.numel() * p.element_size() for p in loop.model.parameters())
    return out


# ---------------------------------------------------------------- the run


def _big_sections(rig: _Rig, tmp: Path, size_mib: int, repeats: int) -> dict[str, Any]:
    """Sections 1 to 3, on one state of ``size_mib`` MiB."""
    state = make_state(size_mib)
    plain = _Plain(state)
    compute_s = COMPUTE_FACTOR * min(plain.copy() for _ in range(WARMUP + 2))
    return {
        "state_bytes": plain.nbytes,
        "blocking": _bench_blocking(rig, state, tmp, repeats, compute_s),
        "copy": _bench_copy(rig, state, plain, repeats),
        "write": _bench_write(rig, plain, tmp, repeats),
    }


def _machine() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _process_group(stack: contextlib.ExitStack) -> None:
    """A one-rank gloo group for dcp, unless one exists; destroyed on the way out."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
        stack.callback(dist.destroy_process_group)


def run(size_mib: int, repeats: int) -> dict[str, Any]:
    """Every measurement; temp files, segments, threads and the group are gone after."""
    job_id = f"bench-{secrets.token_hex(4)}"
    results: dict[str, Any] = {"machine": _machine()}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tierswap-bench-")))
        results["config"] = {
            "size_mib": size_mib,
            "repeats": repeats,
            "warmup": WARMUP,
            "job_id": job_id,
            "disk_dir": str(tmp),
            "slots": NSLOTS,
        }
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        _process_group(stack)
        rig = _Rig(job_id)
        stack.callback(rig.close)
        rig.start(tmp)
        results.update(_big_sections(rig, tmp, size_mib, repeats))
        results["step"] = _bench_steps(rig, size_mib, repeats)
    return results


# ---------------------------------------------------------------- the report


def _ms(s: Mapping[str, Any]) -> tuple[str, str]:
    return f"{1e3 * s['median']:.1f} ms", f"{1e3 * s['min']:.1f} – {1e3 * s['max']:.1f}"


def _gibs(s: Mapping[str, Any]) -> tuple[str, str]:
    return f"{s['median'] / _GIB:.2f} GiB/s", f"{s['min'] / _GIB:.2f} – {s['max'] / _GIB:.2f}"


def _rows(res: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    b, c, w = res["blocking"], res["copy"], res["write"]
    rows = [("blocking", "tierswap (take + fence)", *_ms(b["tierswap"]["blocking"]))]
    rows += [("", f"  of which {k}", *_ms(b["tierswap"][k])) for k in ("take", "fence")]
    rows.append(("", "  copy, overlapped", *_ms(b["tierswap"]["copy"])))
    rows += [
        ("", n, *_ms(b[k]["blocking"]))
        for k, n in (
            ("torch_save", "torch.save + fsync"),
            ("dcp_save", "dcp.save"),
            ("dcp_async_save", "dcp.async_save (until it returns)"),
        )
    ]
    rows.append(("", "  async_save until done", *_ms(b["dcp_async_save"]["total"])))
    rows.append(("copy", "snapshot copy", *_gibs(c["snapshot_bps"])))
    rows.append(("", "plain copy_", *_gibs(c["copy_bps"])))
    rows.append(("write", "durable.write_part", *_gibs(w["write_part_bps"])))
    rows.append(("", "sequential write + fsync", *_gibs(w["sequential_bps"])))
    for key in ("threads_1", "threads_all"):
        s = res["step"][key]
        n = s["threads"]
        rows.append(("step", f"{n} thread(s), snapshot every step", *_ms(s["with_snapshot_s"])))
        rows.append(("", f"{n} thread(s), no snapshot", *_ms(s["without_s"])))
    return rows


def _ratios(res: Mapping[str, Any]) -> list[tuple[str, float, str, bool]]:
    r = res["blocking"]["ratios"]
    out = [
        (
            "tierswap / torch.save (blocking)",
            100 * r["tierswap/torch_save"],
            "<= 1 %",
            r["tierswap/torch_save"] <= 0.01,
        ),
        ("tierswap / dcp.save (blocking)", 100 * r["tierswap/dcp_save"], "", True),
        ("tierswap / dcp.async_save (blocking)", 100 * r["tierswap/dcp_async_save"], "", True),
        (
            "snapshot copy / plain copy_",
            100 * res["copy"]["ratio"],
            ">= 80 %",
            res["copy"]["ratio"] >= 0.8,
        ),
        (
            "write_part / sequential write",
            100 * res["write"]["ratio"],
            ">= 80 %",
            res["write"]["ratio"] >= 0.8,
        ),
    ]
    for key in ("threads_1", "threads_all"):
        s = res["step"][key]
        pct = s["overhead_pct"]["median"]
        out.append((f"step overhead, {s['threads']} thread(s)", pct, "<= 2 %", abs(pct) <= 2))
    return out


def report(res: Mapping[str, Any]) -> None:
    """Print the results as two tables."""
    from rich.console import Console
    from rich.table import Table

    size = res["state_bytes"] / 2**20
    title = (
        f"tierswap bench snapshot: {size:.0f} MiB state, {res['config']['repeats']} "
        f"repeats (+{WARMUP} warm-up), {res['machine']['cpu_count']} CPUs, "
        f"torch {res['machine']['torch']}"
    )
    table = Table("section", "measure", "median", "min – max", title=title)
    for row in _rows(res):
        table.add_row(*row)
    ratios = Table("ratio", "value", "target", "met")
    for name, pct, target, met in _ratios(res):
        ratios.add_row(name, f"{pct:.2f} %", target, ("yes" if met else "NO") if target else "")
    console = Console()
    console.print(table)
    console.print(ratios)


def main(args: argparse.Namespace) -> int:
    """``tierswap bench snapshot [--size-mib M] [--repeats N] [--json PATH]``."""
    if args.what != "snapshot":
        raise ValueError(f"bench {args.what!r}: only 'snapshot' is measured")
    if args.size_mib < 1 or args.repeats < 1:
        raise ValueError(
            f"--size-mib {args.size_mib} --repeats {args.repeats}: both must be at least 1"
        )
    res = run(args.size_mib, args.repeats)
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    _agent_main(sys.argv[1:])

"""Sections 1 to 3 of the bench and the run that makes every measurement.

1. blocking time per checkpoint: tierswap's ``take`` + fence against ``torch.save`` +
   fsync, ``dcp.save`` and ``dcp.async_save``;
2. the snapshot's copy throughput against a plain ``copy_``;
3. ``durable.write_part`` of a held slot against a sequential write + fsync.

Section 4, the step time, is in :mod:`tierswap.bench.steps`.

This process does a worker's copy: ``bench all`` runs it with the glibc settings workers
get (``GLIBC_TUNABLES``, :func:`tierswap.tunables.nt_tunables`); run by hand, export
``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000`` for the same.
"""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from tierswap.bench.common import WARMUP, Sample, interleave, width
from tierswap.bench.limits import write_fsync_once
from tierswap.bench.rig import NSLOTS, BenchPersist, Persisted, Rig
from tierswap.bench.steps import bench_steps
from tierswap.state import flatten, make_layout, tensor_view

COMPUTE_FACTOR = 2.0
"""Section 1's stand-in forward and backward lasts this many plain copies of the state,
far less than a real model holding that much state computes."""
STATE_DEPTH = 8
_BASELINES = ("torch_save", "dcp_save", "dcp_async_save")


# ---------------------------------------------------------------- state


def make_state(size_mib: float) -> dict[str, Any]:
    """Linear layers and an AdamW that has taken one step: ``size_mib`` MiB in all."""
    w = width(size_mib, STATE_DEPTH)
    model = nn.Sequential(*(nn.Linear(w, w) for _ in range(STATE_DEPTH)))
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


def _tierswap_once(rig: Rig, state: Mapping[str, Any], compute_s: float) -> Sample:
    stats = rig.snapshotter.stats
    t0 = time.monotonic()
    rig.take(state)
    take = time.monotonic() - t0
    waits = len(stats.fence_waits)
    _compute(compute_s)
    state["optim"].step()  # no gradients: only its pre-hook, the fence, does work
    fence = sum(stats.fence_waits[waits:])
    rig.snapshotter.drain()  # untimed: the copy's checksum and report, off the loop's path
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
    rig: Rig, state: Mapping[str, Any], tmp: Path, repeats: int, compute_s: float
) -> dict[str, Any]:
    methods: dict[str, Callable[[], Sample]] = {
        "tierswap": lambda: _tierswap_once(rig, state, compute_s),
        "torch_save": lambda: _torch_save_once(state, tmp / "torch-save.pt"),
        "dcp_save": lambda: _dcp_save_once(state, tmp / "dcp"),
        "dcp_async_save": lambda: _async_save_once(state, tmp / "dcp-async"),
    }
    return {"compute_s": compute_s, **interleave(methods, repeats, rig.sync)}


# ---------------------------------------------------------------- 2. and 3. throughput


def _snapshot_copy_once(rig: Rig, state: Mapping[str, Any], nbytes: int) -> Sample:
    rig.take(state)
    rig.snapshotter.drain()
    return {"bps": nbytes / rig.snapshotter.stats.copy_times[-1]}


def _write_part_once(rig: Rig, root: Path) -> Sample:
    reply = rig.call(BenchPersist(root=str(root), step=rig.step), Persisted)
    shutil.rmtree(root)
    return {"bps": reply.nbytes / reply.seconds}


def _sequential_once(path: Path, buf: bytearray, nbytes: int) -> Sample:
    return write_fsync_once(path, memoryview(buf)[:nbytes])


def _bench_throughput(
    rig: Rig, state: Mapping[str, Any], tmp: Path, repeats: int
) -> dict[str, Any]:
    """Sections 2 and 3; section 1's stand-in compute lasts COMPUTE_FACTOR plain copies."""
    plain = _Plain(state)
    n = plain.nbytes
    copy = interleave(
        {"snapshot": lambda: _snapshot_copy_once(rig, state, n),
         "copy_": lambda: {"bps": n / plain.copy()}},
        repeats, rig.sync,
    )  # fmt: skip
    write = interleave(
        {"write_part": lambda: _write_part_once(rig, tmp / "durable"),
         "sequential": lambda: _sequential_once(tmp / "sequential.bin", plain.buf, n)},
        repeats, rig.sync,
    )  # fmt: skip
    compute_s = COMPUTE_FACTOR * n / copy["copy_"]["bps"]["median"]
    return {"compute_s": compute_s, "copy": {"nbytes": n, **copy}, "write": {"nbytes": n, **write}}


# ---------------------------------------------------------------- the run


def ratios(res: Mapping[str, Any]) -> dict[str, float]:
    """tierswap's medians over the baselines' (and section 4's median overheads)."""

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


def _process_group(stack: contextlib.ExitStack) -> None:
    """A one-rank gloo group for dcp, unless one exists; destroyed on the way out."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
        stack.callback(dist.destroy_process_group)


def _measure(rig: Rig, tmp: Path, size_mib: int, repeats: int) -> dict[str, Any]:
    state = make_state(size_mib)
    res = _bench_throughput(rig, state, tmp, repeats)
    res["blocking"] = _bench_blocking(rig, state, tmp, repeats, res.pop("compute_s"))
    del state  # free the big state before the loop's
    res["step"] = bench_steps(rig, size_mib, repeats)
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
        rig = Rig(job_id)
        stack.callback(rig.close)
        rig.start(tmp)
        res = _measure(rig, tmp, size_mib, repeats)
    config = {"size_mib": size_mib, "repeats": repeats, "warmup": WARMUP, "slots": NSLOTS,
              "compute_factor": COMPUTE_FACTOR, "job_id": job_id, "disk_dir": str(tmp)}  # fmt: skip
    return {"machine": machine, "config": config, **res, "ratios": ratios(res)}

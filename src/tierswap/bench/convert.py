"""``tierswap bench dcp``: the bridges to DCP and Hugging Face, against tier 2's own speed.

1. Export (one process): a committed step of ``--size-mib`` MiB (Linear layers and an
   AdamW that has taken a step, written as a 2-rank data-parallel step) exported with
   ``--format dcp`` and ``--format hf``, interleaved with tier 2's own read of the same
   part (read and checksum) and a sequential write + fsync of as many bytes to the same
   disk (what an export cannot beat), each as bytes of output per second and as ratios.
2. Resharding restore (processes, gloo): the same state as an FSDP2 job of 2 ranks,
   written to tier 2 by those 2 ranks; then restored by 2 ranks from their own parts (what
   a same-size restart does: ``read_part`` and ``load``) and by 4 ranks through
   ``tierswap.dcp.init_from`` (what a restart at another world size does), interleaved
   per round, each in fresh processes (forked from a server that imported torch once),
   timed from a barrier to a barrier (process start and imports left out). The 4 ranks'
   state after the restore is checked against what was written.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from tierswap.bench.common import WARMUP, Stats, interleave, run_and_report, stats, width
from tierswap.bench.measure import make_state
from tierswap.state import flatten, init_optimizer_state, load, tensor_view
from tierswap.tiers import durable

DEPTH = 8
STEP = 3
GROUP_TIMEOUT_S = 600.0
"""A group of restore ranks that has not ended by then is killed (the run fails)."""


def _part(root: str, rank: int, world: int, state: dict[str, Any]) -> durable.PartInfo:
    return durable.write_flat(root, STEP, rank, world, flatten(state, with_rng=False))


# ---------------------------------------------------------------- 1. export


def _export(size_mib: int, repeats: int, work: Path) -> dict[str, Any]:
    from tierswap.dcp import export_dcp
    from tierswap.tiers.export import export_hf

    state = make_state(size_mib)
    root = str(work / "root")
    parts = {r: _part(root, r, 2, state) for r in range(2)}
    durable.write_commit(root, STEP, 2, parts)
    state_bytes = parts[0].nbytes
    weights = sum(p.numel() * p.element_size() for p in state["model"].parameters())
    outs = iter(range(1 << 30))

    def read() -> dict[str, float]:
        t0 = time.perf_counter()
        durable.read_part(root, STEP, 0, parts[0])
        return {"seconds": time.perf_counter() - t0}

    def timed(fn: Any, *args: Any) -> dict[str, float]:
        out = work / f"out-{next(outs)}"
        t0 = time.perf_counter()
        fn(root, STEP, str(out), *args)
        seconds = time.perf_counter() - t0
        shutil.rmtree(out)
        return {"seconds": seconds}

    block = memoryview(bytearray(os.urandom(1 << 20)) * 16)  # 16 MiB, written over and over

    def write() -> dict[str, float]:
        out = work / f"out-{next(outs)}"
        t0 = time.perf_counter()
        with open(out, "wb") as f:
            left = state_bytes
            while left > 0:
                left -= f.write(block[: min(left, len(block))])
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - t0
        out.unlink()
        return {"seconds": seconds}

    res = interleave(
        {
            "write_fsync": write,
            "tier2_read": read,
            "export_dcp": lambda: timed(export_dcp),
            "export_hf": lambda: timed(export_hf),
        },
        repeats,
        lambda: None,
        alternate=True,
    )
    sizes = {"write_fsync": state_bytes, "tier2_read": state_bytes, "export_dcp": state_bytes,
             "export_hf": weights}  # fmt: skip
    out: dict[str, Any] = {"state_bytes": state_bytes, "weights_bytes": weights}
    for name, got in res.items():
        out[name] = {"seconds": got["seconds"], "bps": stats(
            [sizes[name] / s for s in got["seconds"]["samples"]])}  # fmt: skip
    out["ratios"] = {f"{n}/{base}": out[n]["bps"]["median"] / out[base]["bps"]["median"]
                     for base in ("tier2_read", "write_fsync")
                     for n in ("export_dcp", "export_hf")}  # fmt: skip
    return out


# ---------------------------------------------------------------- 2. resharding restore


def _fsdp_state(size_mib: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    w = width(size_mib, DEPTH)
    model = nn.Sequential(*(nn.Linear(w, w) for _ in range(DEPTH)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    init_optimizer_state(opt)
    return {"model": model, "optim": opt}


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(state["model"], state["optim"], options=options)
    flat, _ = flatten_state_dict({"model": msd, "optim": {"state": osd.get("state", {})}})
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _worker(rank: int, world: int, port: int, task: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))  # fmt: skip
    try:
        _work(rank, world, task)
        dist.barrier()  # nobody leaves while rank 0 still writes (gloo aborts on it)
    finally:
        dist.destroy_process_group()


def _work(rank: int, world: int, task: dict[str, Any]) -> None:
    from safetensors.torch import load_file, save_file

    from tierswap.dcp_init import init_from

    work = Path(task["work"])
    root = str(work / "root")
    state = _fsdp_state(task["size_mib"])
    if task["mode"] == "write":
        with torch.no_grad():  # every value of its own, so that a misplaced chunk shows
            for i, p in enumerate(state["model"].parameters()):
                p.to_local().copy_(torch.randn_like(p.to_local()) + i)
        part = _part(root, rank, world, state)
        (work / f"part-{rank}.json").write_text(json.dumps(part.to_json()))
        full = _full(state)
        dist.barrier()
        if rank == 0:
            infos = {r: durable.PartInfo.from_json(r, json.loads(
                (work / f"part-{r}.json").read_text())) for r in range(world)}  # fmt: skip
            durable.write_commit(root, STEP, world, infos)
            save_file({k: v.contiguous().clone() for k, v in full.items()},
                      str(work / "written.safetensors"))  # fmt: skip
        return
    dist.barrier()
    t0 = time.perf_counter()
    if task["mode"] == "same":
        _, parts = durable.read_commit(root, STEP)
        layout, tree, buf = durable.read_part(root, STEP, rank, parts[rank])
        load(state, tree, [tensor_view(buf, e) for e in layout.entries], layout)
    else:
        init_from(state, root, STEP, tier2=True)
    dist.barrier()
    seconds = time.perf_counter() - t0
    full = _full(state)
    if rank == 0:
        written = load_file(str(work / "written.safetensors"))
        same = set(full) == set(written) and all(torch.equal(full[k], written[k]) for k in full)
        (work / "result.json").write_text(json.dumps({"seconds": seconds, "exact": same}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(world: int, task: dict[str, Any]) -> dict[str, Any]:
    result = Path(task["work"]) / "result.json"
    result.unlink(missing_ok=True)
    ctx = multiprocessing.get_context("forkserver")  # torch imported once, in the server
    ctx.set_forkserver_preload(["tierswap.bench.convert"])
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, task)) for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    left = list(procs)
    while left and time.monotonic() < deadline:  # one rank failing ends the group at once
        wait([proc.sentinel for proc in left], timeout=deadline - time.monotonic())
        left = [proc for proc in left if proc.exitcode is None]
        if any(proc.exitcode not in (None, 0) for proc in procs):
            break
    codes = [proc.exitcode for proc in procs]
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
        proc.join()
    if any(c != 0 for c in codes):
        raise RuntimeError(f"bench dcp: {task['mode']} workers exited with {codes}")
    return json.loads(result.read_text()) if task["mode"] != "write" else {}


def _reshard(size_mib: int, repeats: int, work: Path) -> dict[str, Any]:
    task = {"work": str(work), "size_mib": size_mib}
    _group(2, {**task, "mode": "write"})
    exact: dict[str, list[bool]] = {"same_2_to_2": [], "reshard_2_to_4": []}

    def one(world: int, mode: str, name: str) -> dict[str, float]:
        got = _group(world, {**task, "mode": mode})
        exact[name].append(bool(got["exact"]))
        return {"seconds": float(got["seconds"])}

    res = interleave(
        {
            "same_2_to_2": lambda: one(2, "same", "same_2_to_2"),
            "reshard_2_to_4": lambda: one(4, "reshard", "reshard_2_to_4"),
        },
        repeats,
        lambda: None,
        alternate=True,
    )
    out: dict[str, Any] = {n: {"seconds": r["seconds"], "exact": f"{sum(exact[n][WARMUP:])}/"
                               f"{len(exact[n][WARMUP:])}"} for n, r in res.items()}  # fmt: skip
    out["ratio"] = (
        out["reshard_2_to_4"]["seconds"]["median"] / out["same_2_to_2"]["seconds"]["median"]
    )
    return out


def run(size_mib: int, repeats: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tierswap-bench-dcp-"))
    try:
        (work / "export").mkdir()
        (work / "reshard").mkdir()
        return {
            "config": {"size_mib": size_mib, "repeats": repeats, "warmup": WARMUP},
            "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__},
            "export": _export(size_mib, repeats, work / "export"),
            "reshard": _reshard(size_mib, repeats, work / "reshard"),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
        _stop_forkserver()


def _stop_forkserver() -> None:
    """End the fork server the restore rounds started (it would outlive the run)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # the stdlib's own tests use it
    if stop is not None:
        stop()


def _line(name: str, s: Stats, unit: str = "s") -> str:
    if unit == "MB/s":
        return (f"  {name:<34} {s['median'] / 1e6:8.0f} MB/s  "
                f"(min {s['min'] / 1e6:.0f}, max {s['max'] / 1e6:.0f})")  # fmt: skip
    return f"  {name:<34} {s['median']:8.3f} s     (min {s['min']:.3f}, max {s['max']:.3f})"


def report(res: dict[str, Any]) -> None:
    e, r = res["export"], res["reshard"]
    n = res["config"]["repeats"]
    print(f"bench dcp: {res['config']['size_mib']} MiB of state, {n} interleaved rounds")
    mib = e["state_bytes"] / 2**20, e["weights_bytes"] / 2**20
    print(f"1. export ({mib[0]:.0f} MiB state, {mib[1]:.0f} MiB of weights), bytes per second")
    print(_line("tier 2 read + checksum (one part)", e["tier2_read"]["bps"], "MB/s"))
    print(_line("sequential write + fsync (floor)", e["write_fsync"]["bps"], "MB/s"))
    print(_line("export --format dcp", e["export_dcp"]["bps"], "MB/s"))
    print(_line("export --format hf (weights)", e["export_hf"]["bps"], "MB/s"))
    for k, v in e["ratios"].items():
        print(f"  {k:<34} {v:8.2f}x")
    print("2. restore from tier 2, FSDP2, barrier to barrier")
    print(_line(f"2 ranks, own parts ({r['same_2_to_2']['exact']} exact)",
                r["same_2_to_2"]["seconds"]))  # fmt: skip
    print(_line(f"4 ranks, resharded ({r['reshard_2_to_4']['exact']} exact)",
                r["reshard_2_to_4"]["seconds"]))  # fmt: skip
    print(f"  {'resharded / same size':<34} {r['ratio']:8.2f}x")


def main(args: argparse.Namespace) -> int:
    return run_and_report(args, 256, run, report)

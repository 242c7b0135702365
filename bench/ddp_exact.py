"""Cost of the exact DDP hook (tierswap.ddp.make_exact) against DDP's default allreduce.

Trains the example GPT (tierswap.examples.gpt, default config) on W gloo ranks, one
thread each, with two wrappers side by side, and times their steps interleaved
(default, exact, default, ...) so both see the same machine load. A step is
forward + backward + optimizer step, started after a barrier; its time is the
slowest rank's. Then times the gradient reduction alone (allreduce of a
gradient-sized tensor against all_gather plus the rank-ordered sum). Prints
medians over the measured steps.

    .venv/bin/python bench/ddp_exact.py [--ranks 2 3 4] [--steps 15] [--warmup 3]

Ranks beyond the number of cores share them, so those numbers include waiting
for a core.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tierswap.examples.gpt import GPTConfig, batch, build_model

MODES = ("ddp", "ddp-exact")


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, cfg: GPTConfig) -> float:
    x, y = batch(step, dist.get_rank(), dist.get_world_size(), cfg)
    dist.barrier()
    start = time.perf_counter()
    model(x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _collective(numel: int, exact: bool) -> float:
    """Seconds of one gradient-sized reduction alone: DDP's allreduce, or the exact hook's."""
    grad = torch.ones(numel)
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.barrier()
    start = time.perf_counter()
    if exact:
        dist.all_gather(parts, grad)
        for part in parts[1:]:
            parts[0].add_(part)
    else:
        dist.all_reduce(grad)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _worker(rank: int, world_size: int, port: int, steps: int, warmup: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        cfg = GPTConfig()
        models = {mode: build_model(cfg, mode) for mode in MODES}
        opts = {mode: torch.optim.AdamW(m.parameters(), lr=3e-4) for mode, m in models.items()}
        times: dict[str, list[float]] = {k: [] for m in MODES for k in (m, f"{m} comm")}
        for step in range(warmup + steps):
            for mode in MODES:
                elapsed = _step(models[mode], opts[mode], step, cfg)
                if step >= warmup:
                    times[mode].append(elapsed)
        numel = sum(p.numel() for p in models["ddp"].parameters())
        for step in range(warmup + steps):
            for mode in MODES:
                elapsed = _collective(numel, exact=mode == "ddp-exact")
                if step >= warmup:
                    times[f"{mode} comm"].append(elapsed)
        if rank == 0:
            out.put({key: statistics.median(ts) for key, ts in times.items()})
    finally:
        dist.destroy_process_group()


def measure(world_size: int, steps: int, warmup: int) -> dict[str, float]:
    """Median step time in seconds per mode on ``world_size`` spawned ranks."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    args = (world_size, store.port, steps, warmup, out)
    procs = [ctx.Process(target=_worker, args=(r, *args), daemon=True) for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        result: dict[str, float] = out.get(timeout=600)
        for p in procs:
            p.join(60)
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--steps", type=int, default=15, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per mode")
    args = parser.parse_args()
    grad_mib = sum(p.numel() for p in build_model(GPTConfig()).parameters()) * 4 / 2**20
    print(f"example GPT, {grad_mib:.1f} MiB of fp32 gradients, 1 thread per rank")
    print("median ms per step (whole step) and per gradient reduction alone (comm)")
    head = ("ranks", "ddp", "exact", "exact/ddp", "ddp comm", "exact comm")
    print("  ".join(f"{h:>10}" for h in head))
    for world_size in args.ranks:
        t = {k: v * 1e3 for k, v in measure(world_size, args.steps, args.warmup).items()}
        row = (t["ddp"], t["ddp-exact"], t["ddp-exact"] / t["ddp"])
        row += (t["ddp comm"], t["ddp-exact comm"])
        print(f"{world_size:>10}  " + "  ".join(f"{v:>10.2f}" for v in row))


if __name__ == "__main__":
    main()

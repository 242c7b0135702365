"""Train the benchmarks' reference model under tierswap: the model the peer comparisons
use, the same for every system measured.

    tierswap run --nodes 2 examples/train_mlp.py --size-mib 384 --steps 14

Four blocks of ``Linear(1024, H)``-GELU-``Linear(H, 1024)`` under DDP with AdamW; ``H``
(4096 at 384 MiB) is picked so that a rank's state (parameters and both AdamW moments,
fp32) is ``--size-mib``. The data is a function of ``(step, rank)`` only. ``--out DIR``
writes every rank's final state to ``DIR/rank-<r>.safetensors`` for bit comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

import tierswap
from tierswap.state import flatten

WIDTH, BLOCKS = 1024, 4
STATE_BYTES_PER_PARAM = 12
"""fp32 parameter, AdamW's exp_avg and exp_avg_sq (its step counters are scalars)."""


def hidden_for(size_mib: float) -> int:
    """The hidden width whose model holds about ``size_mib`` MiB of state per rank."""
    per_hidden = BLOCKS * 2 * WIDTH * STATE_BYTES_PER_PARAM  # bias terms aside
    return max(1, round(size_mib * 2**20 / per_hidden))


def build(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, hidden), nn.GELU(), nn.Linear(hidden, WIDTH)]
    return nn.Sequential(*layers)


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100_003 + rank)
    x = torch.randn(size, WIDTH, generator=g)
    return x, torch.randn(size, WIDTH, generator=g)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--size-mib", type=float, default=384.0, help="state per rank")
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds added to each step")
    p.add_argument("--out", default=None, help="write the final state here")
    p.add_argument(
        "--times", default=None, help="append each step's end time and stall here (JSON lines)"
    )
    p.add_argument(
        "--plain", action="store_true", help="train without job.steps: no restore, no snapshots"
    )
    return p.parse_args()


def train(job: tierswap.Job) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    args = parse()
    model: nn.Module = build(hidden_for(args.size_mib))
    if job.world_size > 1:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state: dict[str, Any] = {"model": model, "optim": opt}
    times = open(args.times, "a") if args.times else None  # noqa: SIM115 (closed below)
    steps = range(args.steps) if args.plain else job.steps(state, total=args.steps)
    for step in steps:
        x, y = batch(step, job.rank, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)
        job.report(step, loss=loss.item())
        if args.sleep:
            time.sleep(args.sleep)
        if times is not None:  # job.stall: the stall of the step before this one
            stats = job.snapshot_stats
            cpu = stats.copy_cpu[-1] if stats is not None and stats.copy_cpu else 0.0
            note = {"rank": job.rank, "step": step, "t": time.monotonic(), "stall": job.stall,
                    "copy_cpu": cpu}  # fmt: skip
            times.write(json.dumps(note) + "\n")
    if times is not None:
        times.close()
    if args.out:
        flat = flatten(state)
        tensors = {
            e.key: t.detach().contiguous().clone()
            for e, t in zip(flat.entries, flat.tensors, strict=True)
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        save_file(tensors, os.path.join(args.out, f"rank-{job.rank:05d}.safetensors"))


if __name__ == "__main__":
    tierswap.launch(train)

"""What a user has today, the baseline of ``tierswap bench recovery``: ``torchrun
--max-restarts`` restarts every worker after a failure, and each loads the newest
``torch.distributed.checkpoint``.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/torchrun_gpt.py \\
        --steps 20 --kill-step 10 --ckpt /tmp/ckpt --times /tmp/times.jsonl

The same model, data and optimizer as ``train_gpt.py``. To be generous to the baseline it
checkpoints every step (synchronously, so nothing is lost but the restart itself). In the
first attempt, rank 1 kills itself after step ``--kill-step`` is saved; every rank of the
restarted attempt appends the time its first step completed to ``--times``. Each
checkpoint holds ``model``, ``optim`` (``get_state_dict``'s names) and ``step``: what
``tierswap run --init-from`` takes in.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from tierswap.examples.gpt import GPTConfig, batch, build_model


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kill-step", type=int, default=10)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--times", default=os.devnull)
    return p.parse_args()


def note(path: str, **fields: float) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # a key prefix per attempt: the restarted workers must not read the addresses the
    # dead attempt's workers published in torchrun's store (gloo then fails to connect)
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group(
        "gloo",
        store=PrefixStore(f"attempt{attempt}/", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width)
    model = build_model(cfg, "ddp", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = Path(args.ckpt)
    start = 0
    latest = ckpt / "latest"
    if latest.exists():
        step = int(latest.read_text())
        msd, osd = get_state_dict(model, opt)
        load({"model": msd, "optim": osd}, checkpoint_id=str(ckpt / f"step-{step}"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        start = step + 1
    for step in range(start, args.steps):
        x, y = batch(step, rank, world, cfg)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.sleep:
            time.sleep(args.sleep)
        msd, osd = get_state_dict(model, opt)
        save({"model": msd, "optim": osd, "step": step}, checkpoint_id=str(ckpt / f"step-{step}"))
        dist.barrier()
        if rank == 0:
            tmp = ckpt / "latest.tmp"
            tmp.write_text(str(step))
            os.replace(tmp, latest)
        dist.barrier()
        if attempt > 0 and step == start:
            note(args.times, rank=rank, resumed=time.time(), step=step)
        if attempt == 0 and step == args.kill_step and rank == 1:
            note(args.times, rank=rank, killed=time.time(), step=step)
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()
    # Out at once, before this function's locals (DDP, the optimizer, the store) are
    # freed: a rank hung there for good (torch 2.13, gloo; its stack dump showed the
    # module's frame only, at the call of main(), which Python 3.11 shows while a
    # returning function's locals are freed) in about one test suite in four, and
    # torchrun waits for every rank. Everything is written by now: DCP's saves are
    # synchronous, notes are closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""Train the example GPT under tierswap: the script the demo and the end-to-end tests run.

    tierswap run --nodes 2 examples/train_gpt.py --steps 40 --mode ddp --out final/

With ``--out DIR`` every rank writes its final state (parameters, optimizer state and RNG
states) to ``DIR/rank-<r>.safetensors``, so two runs can be compared bit for bit;
``--out-start DIR`` the state it starts training from (restored, or as built).
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

import tierswap
from tierswap.examples.gpt import MODES, GPTConfig, batch, build_model
from tierswap.state import flatten


class Counter:
    """A user's own Stateful object: restored with the rest of the state."""

    def __init__(self) -> None:
        self.tokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self.tokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.tokens_seen = int(sd["tokens_seen"])


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--mode", choices=MODES, default="ddp")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128, help="the model's embedding width")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--out-start", default=None, help="also write the state as restored, before training"
    )
    p.add_argument("--sleep", type=float, default=0.0, help="seconds added to each step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the rank's GPU")
    p.add_argument(
        "--train-last", type=int, default=0, help="fine-tune: train only the last N blocks"
    )
    return p.parse_args()


def save_final(out: str, rank: int, state: dict[str, Any]) -> None:
    flat = flatten(state)
    tensors = {
        e.key: t.detach().cpu().contiguous().clone()
        for e, t in zip(flat.entries, flat.tensors, strict=True)
    }
    tensors["counter"] = torch.tensor(state["counter"].tokens_seen)
    Path(out).mkdir(parents=True, exist_ok=True)
    save_file(tensors, os.path.join(out, f"rank-{rank:05d}.safetensors"))


def train(job: tierswap.Job) -> None:
    args = parse()
    random.seed(0)  # every RNG the run touches starts from a seed, so runs can be compared
    np.random.seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width)
    device = job.device if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":  # runs compared bit for bit: deterministic kernels only
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.enable_flash_sdp(False)  # the math attention kernel: its
        torch.backends.cuda.enable_mem_efficient_sdp(False)  # backward is deterministic
        torch.use_deterministic_algorithms(True)
    model = build_model(cfg, args.mode, seed=0, train_last=args.train_last, device=device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    counter = Counter()
    state = {"model": model, "optim": opt, "counter": counter}
    first = True
    for step in job.steps(state, total=args.steps):
        if args.out_start and first:
            save_final(args.out_start, job.rank, state)
        first = False
        x, y = (t.to(device) for t in batch(step, job.rank, job.world_size, cfg))
        loss = model(x, y) + 0.0 * torch.rand(())  # draws from the RNG, which must be restored
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        counter.tokens_seen += x.numel()
        job.report(step, loss=loss.item())
        if args.sleep:
            import time

            time.sleep(args.sleep)
    if args.out:
        save_final(args.out, job.rank, state)


if __name__ == "__main__":
    tierswap.launch(train)

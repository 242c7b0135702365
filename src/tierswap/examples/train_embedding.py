"""A recommender-style job under tierswap: a large embedding table of which each step
touches a few rows (sparse gradients, SparseAdam), and a small dense head (Adam).

    tierswap run --nodes 2 examples/train_embedding.py --steps 20 --out final/

What a differential snapshot is for: each step changes about ``--touched`` of the table's
rows and their optimizer state, and nothing else of it. ``--out DIR`` writes each rank's
final state, as examples/train_gpt.py does.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import tierswap
from tierswap.examples.train_gpt import Counter, save_final


class Recommender(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, dim, sparse=True)
        self.head = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.table(ids)).squeeze(-1)
        return out


def train(job: tierswap.Job) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--touched", type=float, default=0.01, help="fraction of rows per step")
    p.add_argument("--mode", default="ddp", choices=["ddp"])
    p.add_argument("--out", default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Recommender(args.rows, args.dim))
    inner = model.module
    sparse = torch.optim.SparseAdam(list(inner.table.parameters()), lr=1e-2)
    dense = torch.optim.Adam(list(inner.head.parameters()), lr=1e-3)
    counter = Counter()
    state = {"model": model, "sparse": sparse, "dense": dense, "counter": counter}
    batch = max(1, int(args.rows * args.touched))
    for step in job.steps(state, total=args.steps):
        g = torch.Generator().manual_seed(step * 1000 + job.rank)
        ids = torch.randint(0, args.rows, (batch,), generator=g)
        target = torch.randn(batch, generator=g)
        loss = nn.functional.mse_loss(model(ids), target)
        loss.backward()  # type: ignore[no-untyped-call]
        sparse.step()  # type: ignore[no-untyped-call]
        dense.step()
        sparse.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        counter.tokens_seen += batch
        job.report(step, loss=loss.item())
        if args.sleep:
            time.sleep(args.sleep)
    if args.out:
        save_final(args.out, job.rank, state)


if __name__ == "__main__":
    tierswap.launch(train)

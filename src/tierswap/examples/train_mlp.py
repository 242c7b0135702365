"""Train the benchmarks' reference model under tierswap: the model the peer comparisons
use, the same for every system measured.

    tierswap run --nodes 2 examples/train_mlp.py --size-mib 384 --steps 14

The model (``mlp.py``) under DDP, a rank's state ``--size-mib`` MiB. ``--out DIR``
writes every rank's final state to ``DIR/rank-<r>.safetensors`` for bit comparison.
``--plain`` trains without tierswap's steps; ``--memcpy`` also copies the state every step
the barest way (:class:`BareCopy`): the floor the overhead bench holds the snapshot to.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

import tierswap
from tierswap import memcopy
from tierswap.affinity import helper_cpus, pin_thread
from tierswap.examples.mlp import batch, build, hidden_for, optimizer
from tierswap.state import flatten


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
    p.add_argument(
        "--memcpy", action="store_true",
        help="with --plain: memcpy the state on a thread every step, as a snapshot copies it",
    )  # fmt: skip
    args = p.parse_args()
    if args.memcpy and not args.plain:
        p.error("--memcpy is a control of --plain: give both")
    return args


class BareCopy:
    """The least a snapshot every step can cost: after each optimizer step, a thread
    memcpys every tensor of the state into a buffer of its own, overlapped with the next
    forward and backward as the snapshot's copy is, on the cores the snapshot's copy
    runs on (``--agent-cpus``, pinned), and the next optimizer step waits for it. No hash,
    no slot, no agent, no replica: what is left of a snapshot's cost once everything but
    moving its bytes is gone."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.thread: threading.Thread | None = None
        self.cpu = 0.0
        """The last copy's CPU seconds (its thread's own)."""
        self.stall = 0.0
        """The last wait for a copy, seconds."""
        self.error: BaseException | None = None

    def start(self) -> None:
        if not self.pairs:  # after the first optimizer step: its state exists now
            tensors = flatten(self.state, with_rng=False).tensors
            self.pairs = [(torch.empty_like(t), t) for t in tensors]
        self.thread = threading.Thread(target=self._copy, name="bare-copy", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        pin_thread(helper_cpus())  # where the snapshot's copy thread runs (snapshot.py)
        cpu0 = time.thread_time()
        try:
            for dst, src in self.pairs:
                memcopy.memcpy(dst, src)
        except BaseException as e:  # the trainer raises it: no round without its copy
            self.error = e
        self.cpu = time.thread_time() - cpu0

    def wait(self) -> None:
        t0 = time.perf_counter()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.stall = time.perf_counter() - t0
        if self.error is not None:
            raise RuntimeError("the bare memcpy failed") from self.error


def train(job: tierswap.Job) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    args = parse()
    # every RNG the final state holds starts from a seed, so that two runs compare in full
    random.seed(0)
    np.random.seed(0)
    # a restored step overwrites every weight on every rank: no init, no broadcast
    restoring = job.restoring and not args.plain
    model: nn.Module = build(hidden_for(args.size_mib), init=not restoring)
    if job.world_size > 1:
        model = DDP(model, init_sync=not restoring)
    opt = optimizer(model)
    state: dict[str, Any] = {"model": model, "optim": opt}
    times = open(args.times, "a", buffering=1) if args.times else None  # noqa: SIM115 (closed below)
    bare = BareCopy(state) if args.memcpy else None
    steps = range(args.steps) if args.plain else job.steps(state, total=args.steps)
    for step in steps:
        x, y = batch(step, job.rank, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        if bare is not None:
            bare.wait()
        opt.step()
        if bare is not None:
            bare.start()
        opt.zero_grad(set_to_none=True)
        job.report(step, loss=loss.item())
        if args.sleep:
            time.sleep(args.sleep)
        if times is not None:  # job.stall: the stall of the step before this one
            stats = job.snapshot_stats
            cpu = stats.copy_cpu[-1] if stats is not None and stats.copy_cpu else 0.0
            stall, gate = job.stall, job.tier1_wait  # gate: the part that waited for tier 1
            if bare is not None:  # the copy before this step's: as the snapshot's figures
                cpu, stall, gate = bare.cpu, bare.stall, 0.0
            note = {"rank": job.rank, "step": step, "t": time.monotonic(), "stall": stall,
                    "gate": gate, "copy_cpu": cpu}  # fmt: skip
            times.write(json.dumps(note) + "\n")
    if bare is not None:
        bare.wait()
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

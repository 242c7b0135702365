"""Train the benchmarks' reference model under tierswap: the model the peer comparisons
use, the same for every system measured.

    tierswap run --nodes 2 examples/train_mlp.py --size-mib 384 --steps 14

The model (``mlp.py``) under DDP, a rank's state ``--size-mib`` MiB. ``--out DIR``
writes every rank's final state to ``DIR/rank-<r>.safetensors`` for bit comparison.
``--plain`` trains without tierswap's steps; ``--memcpy`` also copies the state every step
the barest way, and ``--stream`` sends each copy to the next rank over TCP
(:mod:`tierswap.examples.bare`): the floors the overhead bench holds tiers 0 and 0+1 to.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import save_file
from torch import nn

import tierswap
from tierswap.examples.bare import BareCopy, BareStream
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
    p.add_argument(
        "--stream", action="store_true",
        help="with --memcpy: send each copy to the next rank over TCP on loopback",
    )  # fmt: skip
    args = p.parse_args()
    if args.memcpy and not args.plain:
        p.error("--memcpy is a control of --plain: give both")
    if args.stream and not args.memcpy:
        p.error("--stream sends the bare copy of --memcpy: give --plain --memcpy --stream")
    return args


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
    stream = BareStream.connect(job.rank, job.world_size) if args.stream else None
    bare = BareCopy(state, stream) if args.memcpy else None
    steps = range(args.steps) if args.plain else job.steps(state, total=args.steps)
    try:
        for step in steps:
            x, y = batch(step, job.rank, args.batch)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            if bare is not None:
                bare.wait()
            if stream is not None:
                stream.gate()
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
                if stream is not None:  # its wait is counted as tier 1's is: apart, and in stall
                    gate = stream.stall
                    stall += gate
                note = {"rank": job.rank, "step": step, "t": time.monotonic(), "stall": stall,
                        "gate": gate, "copy_cpu": cpu}  # fmt: skip
                if stream is not None:
                    note["net_cpu"] = stream.cpu
                times.write(json.dumps(note) + "\n")
        if bare is not None:
            bare.wait()
    except BaseException:  # the loop's error is the one raised; the stream still ends
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()
        raise
    if stream is not None:
        stream.close()  # (its own error raised)
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

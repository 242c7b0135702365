"""Section 4: the step time of a small MLP with a snapshot every step and without, in
A B / B A blocks, on one torch thread (a core left to the copy and the agent) and on all."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tierswap.bench.common import Sample, interleave, stats, width
from tierswap.bench.rig import Rig

LOOP_MAX_MIB, LOOP_DEPTH, LOOP_BATCH = 64, 4, 512
"""The MLP: at most 64 MiB of state, 4 layers, 512 rows a step (6 x 512 FLOP per
parameter, a tiny fraction of a language model's step: little compute hides the copy)."""
LOOP_BLOCK = 5  # timed steps per block, after an untimed one that enters the block
STEP_PAIRS_PER_REPEAT = 4
"""Section 4 runs 4 A/B pairs per ``--repeats``: its blocks last about a second, and on a
shared VM their step time moves by +-15 % from one block to the next, so a median of a
5 % effect needs tens of pairs (20 by default)."""


class Loop(Protocol):
    def step(self, rig: Rig | None) -> float:
        """One training step, snapshotted through ``rig`` unless it is None; its seconds."""
        ...


@dataclass(slots=True)
class _Loop:
    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor

    @staticmethod
    def make(size_mib: int) -> _Loop:
        w = width(min(size_mib, LOOP_MAX_MIB), LOOP_DEPTH)
        layers: list[nn.Module] = []
        for _ in range(LOOP_DEPTH):
            layers += [nn.Linear(w, w), nn.ReLU()]
        model = nn.Sequential(*layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return _Loop(model, opt, torch.randn(LOOP_BATCH, w), torch.randn(LOOP_BATCH, w))

    def step(self, rig: Rig | None) -> float:
        t0 = time.monotonic()
        F.mse_loss(self.model(self.x), self.y).backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if rig is not None:
            rig.take({"model": self.model, "optim": self.opt}, required=False)
        return time.monotonic() - t0


def _block(loop: Loop, rig: Rig, snapshot: bool) -> Sample:
    """Mean step time over ``LOOP_BLOCK`` steps after an untimed one that enters the block;
    with snapshots also the stall (time in take and at fences) and the background copy."""
    who = rig if snapshot else None
    loop.step(who)
    st = rig.snapshotter.stats
    takes, waits, copies = len(st.sync_copies), len(st.fence_waits), len(st.copy_times)
    seconds = sum(loop.step(who) for _ in range(LOOP_BLOCK)) / LOOP_BLOCK
    if not snapshot:
        return {"step_s": seconds}
    stall = sum(st.sync_copies[takes:]) + sum(st.fence_waits[waits:])
    copy = sum(st.copy_times[copies:])
    return {"step_s": seconds, "stall_s": stall / LOOP_BLOCK, "copy_s": copy / LOOP_BLOCK}


def step_overhead(loop: Loop, rig: Rig, pairs: int) -> dict[str, Any]:
    """``pairs`` A/B blocks (with a snapshot every step, without), order alternating: the
    stats of each, and of the overhead of each pair."""
    methods: dict[str, Callable[[], Sample]] = {
        "with_snapshot": lambda: _block(loop, rig, True),
        "without": lambda: _block(loop, rig, False),
    }
    ab = interleave(methods, pairs, rig.sync, alternate=True)
    w, wo = (ab[k]["step_s"]["samples"] for k in ("with_snapshot", "without"))
    return {**ab, "overhead": stats([a / b - 1 for a, b in zip(w, wo, strict=True)])}


def bench_steps(rig: Rig, size_mib: int, repeats: int) -> dict[str, Any]:
    """Section 4 on one torch thread, then on all; the caller restores the thread count."""
    loop = _Loop.make(size_mib)
    params = sum(p.numel() for p in loop.model.parameters())
    out: dict[str, Any] = {"params": params, "batch": LOOP_BATCH, "state_bytes": 12 * params,
                           "pairs": STEP_PAIRS_PER_REPEAT * repeats}  # fmt: skip
    skipped = rig.snapshotter.stats.skipped
    for key, threads in (("threads_1", 1), ("threads_all", os.cpu_count() or 1)):
        torch.set_num_threads(threads)
        pairs = STEP_PAIRS_PER_REPEAT * repeats
        out[key] = {"threads": threads, **step_overhead(loop, rig, pairs)}
    out["skipped"] = rig.snapshotter.stats.skipped - skipped
    return out

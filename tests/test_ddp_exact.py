"""A DDP wrapper made anew mid-run keeps the bits only with the exact hook.

Each case runs, in one set of gloo ranks on loopback, two runs of the same
training from the same start:

- run A: one DDP wrapper for all ``2 * HALF`` steps;
- run B: one wrapper for ``HALF`` steps, then the state is saved (in memory), a
  new model, DDP wrapper and optimizer are made and loaded, ``HALF`` more steps.

What a user of hot-swap needs: run B ends with the bits of run A.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tierswap.ddp import make_exact

HALF = 3
JOIN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Case:
    world_size: int
    exact: bool
    bucket_cap_mb: float | None = None


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 8)
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(16, 32, generator=gen)
    return x, x[:, :8].sin()


def _wrap(module: nn.Module, case: Case) -> DDP:
    ddp = DDP(module, bucket_cap_mb=case.bucket_cap_mb)
    return make_exact(ddp) if case.exact else ddp


def _train(ddp: DDP, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = _batch(step, dist.get_rank())
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _run(case: Case, restart: bool) -> dict[str, Any]:
    """Train 2 * HALF steps; with ``restart``, rebuild model, DDP and optimizer halfway."""
    ddp = _wrap(_model(seed=0), case)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    _train(ddp, opt, range(HALF))
    if restart:
        saved = copy.deepcopy({"model": ddp.module.state_dict(), "optim": opt.state_dict()})
        ddp = _wrap(_model(seed=1), case)  # another init: the load must set every bit
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        ddp.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    _train(ddp, opt, range(HALF, 2 * HALF))
    return {"model": ddp.module.state_dict(), "optim": opt.state_dict()}


def _to_numpy(tree: Any) -> Any:
    """Tensors to numpy arrays, so results cross the process boundary by value."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().numpy().copy()
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_to_numpy(v) for v in tree)
    return tree


def _worker(rank: int, port: int, cases: list[Case], results: Any) -> None:
    torch.set_num_threads(1)
    world_size = cases[0].world_size
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30)
    )
    try:
        out = [(_run(case, restart=False), _run(case, restart=True)) for case in cases]
        if rank == 0:
            results.put(_to_numpy(out))
        dist.barrier()  # nobody closes its sockets while another rank still works
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.close()
        results.join_thread()  # the result is in the pipe before the process goes
    # Skip the interpreter's teardown: gloo's threads, destroyed there, once aborted a rank
    # ("terminate called without an active exception", exit -6) after its work was done.
    os._exit(0)


def _wait_for_result(results: Any, procs: list[Any]) -> Any:
    """Rank 0's result; fail at once if a rank exits with an error, or after the timeout."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.2)
        except queue.Empty:
            codes = [p.exitcode for p in procs]
            if any(code not in (None, 0) for code in codes):
                raise AssertionError(f"a rank failed; exit codes {codes}") from None
    raise AssertionError(f"no result from rank 0 in {JOIN_TIMEOUT_S} s")


def run_cases(cases: list[Case]) -> list[tuple[Any, Any]]:
    """Run every case on ``world_size`` spawned gloo ranks; rank 0's (run A, run B) per case."""
    world_size = cases[0].world_size
    assert all(c.world_size == world_size for c in cases)
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, store.port, cases, results), daemon=True)
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        out: list[tuple[Any, Any]] = _wait_for_result(results, procs)
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
        assert [p.exitcode for p in procs] == [0] * world_size
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def _flat(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    if isinstance(tree, np.ndarray):
        return {prefix: tree}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list | tuple):
        items = enumerate(tree)
    else:
        return {prefix: np.asarray(tree)}
    return {k: v for key, sub in items for k, v in _flat(sub, f"{prefix}/{key}").items()}


def differing(a: Any, b: Any) -> list[str]:
    """Keys of the two state trees whose values are not bit-identical."""
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    return [k for k in fa if fa[k].tobytes() != fb[k].tobytes()]


@pytest.mark.timeout(120)
def test_exact_hook_keeps_bits_across_a_new_wrapper_on_3_ranks() -> None:
    (plain_a, plain_b), (exact_a, exact_b) = run_cases(
        [Case(world_size=3, exact=False), Case(world_size=3, exact=True)]
    )
    # The trap: the default hook sums in an order that depends on the bucket layout.
    assert differing(plain_a["model"], plain_b["model"]), "default DDP kept the bits"
    assert differing(exact_a, exact_b) == []
    # ... and it still averages the gradients: same training as the default hook, up to rounding.
    for key, value in _flat(plain_a["model"]).items():
        np.testing.assert_allclose(_flat(exact_a["model"])[key], value, rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(120)
def test_plain_ddp_keeps_bits_on_2_ranks() -> None:
    [(plain_a, plain_b)] = run_cases([Case(world_size=2, exact=False)])
    assert differing(plain_a, plain_b) == []

"""The benchmarks' reference model (``tierswap.examples.mlp``) trained the way a user of
each peer would train it, for ``tierswap bench peers``:

- ``torchrun``: plain DDP under ``torchrun``, no checkpoint;
- ``torch-save``: rank 0 ``torch.save``s model and optimizer every step to a temporary
  file, fsyncs it and renames it over the last one;
- ``dcp-async``: ``torch.distributed.checkpoint.async_save`` every step, waiting for the
  previous save first (as the DCP tutorial does), the two newest kept;
- ``torchrun-dcp``: ``dcp.save`` every step and a ``latest`` marker; under ``torchrun
  --max-restarts`` the restarted attempt loads the newest;
- ``dlrover``: DLRover's flash checkpoint (``DdpCheckpointer.save_checkpoint(...,
  storage_type=StorageType.MEMORY)``) every step under ``dlrover-run``; a restarted
  worker loads it from the agent's shared memory;
- ``torchft``: one replica group of one rank under ``torchrun``, its Manager, DDP and
  optimizer wrappers on gloo; a restarted replica heals from the live one.

Each appends ``{rank, step, t, stall, copy_cpu}`` per completed step to ``--times``
(``t`` is ``time.monotonic()``, ``stall`` the seconds the step spent in checkpoint calls)
and writes ``--out/rank-<r>.safetensors`` (``mlp.final_tensors``) at the end. With
``--kill-step K``, rank 1 of the first attempt notes step K and SIGKILLs itself.

Run only by the peers' Python: it imports torch, the peers and ``tierswap.examples.mlp``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from tierswap.examples.mlp import batch, build, final_tensors, hidden_for, optimizer

SYSTEMS = ("torchrun", "torch-save", "dcp-async", "torchrun-dcp", "dlrover", "torchft")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--size-mib", type=float, default=384.0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--kill-step", type=int, default=-1, help="rank 1 SIGKILLs itself after it")
    p.add_argument("--ckpt", default=None, help="checkpoint folder (torch-save, dcp-*)")
    p.add_argument("--times", required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--groups", type=int, default=2, help="torchft: replica groups")
    return p.parse_args()


class Times:
    """The step notes, appended line by line (a restarted process appends to the same file)."""

    def __init__(self, path: str, rank: int, kill_step: int) -> None:
        self.file = open(path, "a")  # noqa: SIM115 (closed in close)
        self.rank = rank
        self.kill = kill_step if rank == 1 and _attempt() == 0 else -1

    def note(self, step: int, stall: float) -> None:
        line = {
            "rank": self.rank,
            "step": step,
            "t": time.monotonic(),
            "stall": stall,
            "copy_cpu": 0.0,
        }
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        if step == self.kill:
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        self.file.close()


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _init_pg() -> tuple[int, int]:
    """The process group from the launcher's environment; a key prefix per attempt so that
    a restarted attempt never reads the dead attempt's addresses in the launcher's store."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=120),
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"peers-attempt{_attempt()}/", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=60),
    )
    return dist.get_rank(), dist.get_world_size()


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, rows: int) -> None:
    x, y = batch(step, rank, rows)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad(set_to_none=True)


def _leave() -> None:
    """A torchrun job's rank leaves at once, before its function's locals (DDP, the
    optimizer, the store) are freed: the torchrun + DCP reference run hung for good in
    ``make test`` on 12-07 (killed after 182 s, nothing in its output), as
    ``examples/torchrun_gpt.py`` did where that freeing was found to hang (torch 2.13,
    gloo), and torchrun waits for every rank. Everything is written by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _save_final(out: str | None, rank: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file(final_tensors(model, opt), os.path.join(out, f"rank-{rank:05d}.safetensors"))


def ddp_loop(args: argparse.Namespace, checkpoint: Callable[..., Any] | None) -> None:
    """torchrun, torch-save, dcp-async: DDP, ``checkpoint(step, model, opt, rank)`` after
    every step, its time the step's stall."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, _ = _init_pg()
    model = DDP(build(hidden_for(args.size_mib)))
    opt = optimizer(model)
    times = Times(args.times, rank, args.kill_step)
    finish: Callable[[], None] | None = None
    for step in range(args.steps):
        _step(model, opt, step, rank, args.batch)
        t0 = time.monotonic()
        if checkpoint is not None:
            finish = checkpoint(step, model, opt, rank)
        times.note(step, time.monotonic() - t0)
    if finish is not None:
        finish()
    times.close()
    _save_final(args.out, rank, model, opt)
    dist.destroy_process_group()
    _leave()


def torch_save(folder: Path) -> Callable[..., None]:
    """Rank 0 writes the whole state, fsyncs it and renames it over the previous one."""
    folder.mkdir(parents=True, exist_ok=True)

    def save(step: int, model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
        if rank != 0:
            return
        tmp = folder / "ckpt.pt.tmp"
        with open(tmp, "wb") as f:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / "ckpt.pt")

    return save


def dcp_async(folder: Path) -> Callable[..., Callable[[], None]]:
    """``dcp.async_save`` every step; the previous save is waited for first, and the one
    before it deleted (rank 0). Its collectives run on a gloo group of their own, as the
    DCP docs advise: the save's thread would otherwise interleave its collectives with
    DDP's on the default group and both hang."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    pending: list[Any] = []
    group: list[Any] = []  # made on first use, once the default group exists

    def wait() -> None:
        while pending:
            pending.pop().result()

    def save(
        step: int, model: nn.Module, opt: torch.optim.Optimizer, rank: int
    ) -> Callable[[], None]:
        wait()
        if rank == 0 and step >= 2:
            shutil.rmtree(folder / f"step-{step - 2}", ignore_errors=True)
        if not group:  # the save's collectives run in a thread: never on DDP's group
            group.append(dist.new_group(backend="gloo"))
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        pending.append(
            dcp.async_save(
                state, checkpoint_id=str(folder / f"step-{step}"), process_group=group[0]
            )
        )
        return wait

    return save


def torchrun_dcp(args: argparse.Namespace) -> None:
    """``dcp.save`` every step; the restarted attempt loads the newest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, _ = _init_pg()
    folder = Path(args.ckpt)
    latest = folder / "latest"
    restoring = latest.exists()  # then the load overwrites every weight: no init, no broadcast
    model = DDP(build(hidden_for(args.size_mib), init=not restoring), init_sync=not restoring)
    opt = optimizer(model)
    start = 0
    if restoring:
        step = int(latest.read_text())
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(folder / f"step-{step}"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        start = step + 1
    times = Times(args.times, rank, args.kill_step)
    for step in range(start, args.steps):
        _step(model, opt, step, rank, args.batch)
        t0 = time.monotonic()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder / f"step-{step}"))
        dist.barrier()
        if rank == 0:
            (folder / "latest.tmp").write_text(str(step))
            os.replace(folder / "latest.tmp", latest)
            shutil.rmtree(folder / f"step-{step - 2}", ignore_errors=True)
        dist.barrier()
        times.note(step, time.monotonic() - t0)
    times.close()
    _save_final(args.out, rank, model, opt)
    dist.destroy_process_group()
    _leave()


def _cloned(value: Any) -> Any:
    """A copy of a state dict whose tensors own their memory."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cloned(v) for v in value)
    return value


def _dlrover_why(ckpt: Any) -> str:
    """Why DLRover's memory held nothing to load, as its own record of its one shared-memory
    buffer says: a buffer still flagged as being written (``writing_shm``) is one the kill
    interrupted, which ``load_state_dict`` refuses. Read through DLRover's internals, so
    ``""`` where they are not as in the version the harness was written against."""
    try:
        from dlrover.python.elastic_agent.torch.ckpt_saver import CheckpointConfig

        conf = ckpt._engine._shm_handler.get_checkpoint_config(CheckpointConfig())
    except Exception as e:  # another DLRover: say so, and nothing more
        return f" (its buffer's state could not be read: {e!r})"
    if conf.writing_shm:
        return (f": its one shared-memory buffer is flagged as being written, at step "
                f"{conf.step}; the kill came during that save, and with saves to memory "
                "only a real job would start over")  # fmt: skip
    return f" (its buffer records step {conf.step}, not being written)"


def dlrover(args: argparse.Namespace) -> None:
    """Flash checkpoint to memory every step; on a restart, load it from memory.

    What ``load_checkpoint`` returns are views of the agent's shared memory, and
    ``Optimizer.load_state_dict`` keeps a state tensor as it is when its dtype and device
    already match: without the clone, AdamW's moments and step counters would be that
    shared memory, the same pages in both ranks (only local rank 0 saves a DDP state),
    each rank updating them in place every step."""
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # as DLRover's examples do
    rank = dist.get_rank()
    # a restarted attempt loads the step in memory over every weight: no init, no broadcast
    restoring = _attempt() > 0
    model = DDP(build(hidden_for(args.size_mib), init=not restoring), init_sync=not restoring)
    opt = optimizer(model)
    ckpt = DdpCheckpointer(args.ckpt)
    start = 0
    loaded = ckpt.load_checkpoint()
    if restoring and not loaded:
        raise RuntimeError(f"attempt {_attempt()}: no flash checkpoint to load in {args.ckpt}"
                           f"{_dlrover_why(ckpt)}")  # fmt: skip
    if loaded:
        loaded = _cloned(loaded)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optim"])
        start = int(loaded["step"]) + 1
    times = Times(args.times, rank, args.kill_step)
    for step in range(start, args.steps):
        _step(model, opt, step, rank, args.batch)
        t0 = time.monotonic()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        ckpt.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
        times.note(step, time.monotonic() - t0)
    times.close()
    _save_final(args.out, rank, model, opt)
    dist.destroy_process_group()


def torchft(args: argparse.Namespace) -> None:
    """One replica group of one rank; torchft's Manager decides each step's quorum.

    The replica groups start their first step together (a file barrier in the folder of
    ``--times``: else the first to import trains alone until the other joins). A replica
    trains until ``--steps`` are committed and the last of them had every group in its
    quorum: a survivor keeps training while a replica restarts, and stopping before the
    replica is back would leave it nothing to heal from."""
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    replica = int(os.environ["REPLICA_GROUP_ID"])
    model = build(hidden_for(args.size_mib))
    inner = optimizer(model)

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"peers_{replica}",
        timeout=timedelta(seconds=30),
    )
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    if _attempt() == 0:
        _file_barrier(Path(args.times).parent / "torchft-ready", replica, args.groups)
    times = Times(args.times, replica, args.kill_step)
    cap = args.steps * 50
    while manager.current_step() < cap:
        opt.zero_grad()  # starts the quorum
        x, y = batch(manager.current_step(), replica, args.batch)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        before = manager.current_step()
        opt.step()
        if manager.current_step() > before:  # committed
            step = manager.current_step() - 1
            times.note(step, 0.0)
            if step + 1 >= args.steps and manager.num_participants() == args.groups:
                break
    times.close()
    _save_final(args.out, replica, model, inner)
    manager.shutdown()


def _file_barrier(folder: Path, me: int, n: int, timeout: float = 120.0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(me)).touch()
    deadline = time.monotonic() + timeout
    while len(list(folder.iterdir())) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{folder}: {n} replica groups did not start in {timeout} s")
        time.sleep(0.05)


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    if args.system in ("torchrun", "torch-save", "dcp-async"):
        folder = Path(args.ckpt) if args.ckpt else None
        make = {"torch-save": torch_save, "dcp-async": dcp_async}.get(args.system)
        ddp_loop(args, None if make is None or folder is None else make(folder))
    elif args.system == "torchrun-dcp":
        torchrun_dcp(args)
    elif args.system == "dlrover":
        dlrover(args)
    else:
        torchft(args)


if __name__ == "__main__":
    main()

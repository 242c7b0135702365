"""A DDP comm hook whose gradient sum does not depend on DDP's bucket layout.

Why it is needed: a recovery makes a new ``DistributedDataParallel`` wrapper in
the middle of a run, and a new wrapper does not lay out its gradient buckets as
the long-lived one did. Unless ``find_unused_parameters`` is set, DDP (torch
2.13) puts every parameter into one bucket for the first iteration, whatever
``bucket_cap_mb`` says, then rebuilds its buckets in the order the gradients
became ready (1 MiB for the first bucket, ``bucket_cap_mb`` after that). A
wrapper made at step 0 rebuilt its buckets after step 1; a wrapper made after a
restore at step *s* runs step *s+1* with the initial layout. An element of a
gradient then sits at another offset of another bucket, even when every bucket
holds a single parameter.

The offset matters: gloo's ring allreduce cuts a bucket into chunks and starts
the reduction of each chunk at a different rank, so the order in which the
ranks' values of one element are added depends on where the element sits in
its bucket. Floating-point addition is not associative, so with three ranks or
more ``(a + b) + c`` and ``(b + c) + a`` differ in the last bits, and the run
after a restore leaves the bits of the run without one. With two ranks each
element is ``a + b`` or ``b + a``, which are equal, so two ranks never show it.

:func:`ordered_allreduce_hook` gathers every rank's bucket and adds them in rank
order (rank 0 + rank 1 + ... + rank W-1, from the left) on every rank, so each
element's sum is the same whatever bucket and offset it lands in. It moves
``W`` buckets per rank instead of the ring's ~2, which is the price of exact
restores; :func:`make_exact` installs it on a wrapper.
"""

import torch
import torch.distributed as dist

# torch.distributed.GradBucket is this class, re-exported in a way mypy does not count as
# public. No `from __future__ import annotations` here: DDP reads the hook's annotations
# at runtime and insists on exactly GradBucket and Future[Tensor].
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel

__all__ = ["make_exact", "ordered_allreduce_hook"]


def ordered_allreduce_hook(state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket over all ranks, summing in rank order.

    ``state`` is the process group to reduce over, or ``None`` for the default
    group (what ``register_comm_hook(None, ...)`` passes). Like DDP's default
    hook, each rank divides its bucket by the world size before the sum.
    """
    group = state if isinstance(state, dist.ProcessGroup) else None
    world_size = dist.get_world_size(group)
    local = bucket.buffer().div_(world_size)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    work = dist.all_gather(gathered, local, group=group, async_op=True)
    assert work is not None, "all_gather with async_op=True returns a Work"

    def add_in_rank_order(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        fut.wait()  # re-raises a failed all_gather
        total = gathered[0]
        for part in gathered[1:]:
            total.add_(part)
        return total

    gathered_fut: torch.futures.Future[list[torch.Tensor]] = work.get_future()
    return gathered_fut.then(add_in_rank_order)


def make_exact(ddp_model: DistributedDataParallel) -> DistributedDataParallel:
    """Register :func:`ordered_allreduce_hook` on ``ddp_model`` and return it.

    Call it before the first backward, on every wrapper of the run (the first
    one and every one made after a restore), so that all of them sum alike.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"make_exact needs a DistributedDataParallel wrapper, got {type(ddp_model).__name__}"
        )
    ddp_model.register_comm_hook(None, ordered_allreduce_hook)
    return ddp_model

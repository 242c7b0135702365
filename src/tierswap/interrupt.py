"""Where a survivor's step may be cut short once its generation has ended.

A worker whose generation ends (a failure elsewhere) leaves it at once: the agent's
``Abort`` makes the control thread signal the training loop's thread
(:data:`SIGNAL`), whose handler raises ``GenerationEnded`` there, unless that thread is
inside one of tierswap's own calls (:func:`own_call`): a message half sent or a reply left
unread would corrupt the channel it uses. Those calls run to their end and the next step
boundary raises instead. Off with ``--no-interrupt-steps``.

Python runs a signal's handler only between two steps of Python code on that thread. A
forward pass is Python (each module's ``forward``), but on a CPU the backward pass runs on
the loop's thread in C++ (but for Python autograd functions and hooks in it): a survivor
would compute the rest of the gradients of a step it then throws away (0.16 and 0.46 s
from the abort to leaving in a traced 2-core worker kill at 384 MiB). :func:`backward_points`
gives it places to stop: a hook that does nothing, called after each parameter's gradient
is accumulated.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

SIGNAL = signal.SIGRTMIN + 2
"""A real-time signal: the usual ones (SIGUSR1 and 2, SIGTERM) belong to schedulers and
training frameworks."""

_local = threading.local()


@contextmanager
def own_call() -> Iterator[None]:
    """Mark the calling thread as inside tierswap's code: not to be cut short."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def in_own_call() -> bool:
    """Whether the calling thread is inside tierswap's code (:func:`own_call`)."""
    return getattr(_local, "depth", 0) > 0


def backward_points(state: Mapping[str, Any]) -> list[Any]:
    """Places where a CPU backward pass of the modules and optimizers ``state`` holds as
    its values may be cut short (:func:`_point` after each trained parameter's gradient
    is accumulated); their handles, to remove. Plain CPU parameters only: a GPU's
    backward runs on threads of torch's own (no handler runs there; its kernels are
    queued, not waited for), and a sharded one's (DTensor) runs hooks of FSDP's already."""
    import torch

    params: dict[int, torch.Tensor] = {}
    for value in state.values():
        if isinstance(value, torch.optim.Optimizer):
            found = [q for group in value.param_groups for q in group["params"]]
        elif isinstance(value, torch.nn.Module):
            found = list(value.parameters())
        else:
            continue
        for q in found:
            plain = type(q) in (torch.Tensor, torch.nn.Parameter) and q.device.type == "cpu"
            if plain and q.is_leaf and q.requires_grad:
                params[id(q)] = q
    hook = torch.Tensor.register_post_accumulate_grad_hook
    return [hook(q, _point) for q in params.values()]  # type: ignore[no-untyped-call]


def _point(_param: Any) -> None:
    """Nothing: Python code the backward pass runs on the loop's thread, where a pending
    signal's handler runs first (:data:`SIGNAL`, to cut the step short)."""

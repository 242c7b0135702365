"""tierswap: every-step tiered checkpoints and in-place recovery for PyTorch training.

The names below are loaded when first used: ``import tierswap.cluster.agent`` (an agent,
a replica server) then never imports torch, which takes seconds and hundreds of MB. So is
the ``dcp`` module (``tierswap.dcp.StorageReader`` after a plain ``import tierswap``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tierswap.config import Config
from tierswap.errors import (
    CorruptPartError,
    GenerationEnded,
    JobFailedError,
    NotSerializableError,
    StateMismatchError,
    TierswapError,
    UsageError,
)

if TYPE_CHECKING:
    from tierswap import dcp
    from tierswap.ddp import make_exact, ordered_allreduce_hook
    from tierswap.job import Job
    from tierswap.worker import launch

_LAZY = {
    "Job": "tierswap.job",
    "launch": "tierswap.worker",
    "make_exact": "tierswap.ddp",
    "ordered_allreduce_hook": "tierswap.ddp",
}


_MODULES = frozenset({"dcp"})
"""Modules of the public API reached as attributes of the package."""


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"tierswap.{name}")  # (which sets the attribute)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierswap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Config",
    "CorruptPartError",
    "GenerationEnded",
    "Job",
    "JobFailedError",
    "NotSerializableError",
    "StateMismatchError",
    "TierswapError",
    "UsageError",
    "dcp",
    "launch",
    "make_exact",
    "ordered_allreduce_hook",
]

"""tierswap: every-step tiered checkpoints and in-place recovery for PyTorch training."""

from tierswap.config import Config
from tierswap.ddp import make_exact, ordered_allreduce_hook
from tierswap.errors import (
    CorruptPartError,
    JobFailedError,
    NotSerializableError,
    StateMismatchError,
    TierswapError,
    UsageError,
    WorldSizeMismatchError,
)
from tierswap.job import Job, launch

__all__ = [
    "Config",
    "CorruptPartError",
    "Job",
    "JobFailedError",
    "NotSerializableError",
    "StateMismatchError",
    "TierswapError",
    "UsageError",
    "WorldSizeMismatchError",
    "launch",
    "make_exact",
    "ordered_allreduce_hook",
]

"""tierswap: every-step tiered checkpoints and in-place recovery for PyTorch training."""

from tierswap.config import Config
from tierswap.ddp import make_exact, ordered_allreduce_hook
from tierswap.errors import (
    CorruptPartError,
    GenerationEnded,
    JobFailedError,
    NotSerializableError,
    StateMismatchError,
    TierswapError,
    UsageError,
)
from tierswap.job import Job
from tierswap.worker import launch

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
    "launch",
    "make_exact",
    "ordered_allreduce_hook",
]

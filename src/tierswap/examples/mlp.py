"""The benchmarks' reference model, torch only, so that every system measured trains the
same thing: ``train_mlp.py`` under tierswap and the peer scripts in ``bench/peers`` under
torchrun, DLRover and torchft.

Four blocks of ``Linear(1024, H)``-GELU-``Linear(H, 1024)`` with AdamW; ``H`` (4096 at
384 MiB) is picked so that a rank's state (parameters and both AdamW moments, fp32) is
the size asked for. The data is a function of ``(step, rank)`` only.
"""

from __future__ import annotations

import torch
from torch import nn

WIDTH, BLOCKS = 1024, 4
STATE_BYTES_PER_PARAM = 12
"""fp32 parameter, AdamW's exp_avg and exp_avg_sq (its step counters are scalars)."""
LR = 1e-4


def hidden_for(size_mib: float) -> int:
    """The hidden width whose model holds about ``size_mib`` MiB of state per rank."""
    per_hidden = BLOCKS * 2 * WIDTH * STATE_BYTES_PER_PARAM  # bias terms aside
    return max(1, round(size_mib * 2**20 / per_hidden))


def build(hidden: int, init: bool = True) -> nn.Sequential:
    """The model, its weights the same on every rank and in every run; with
    ``init=False`` its memory is allocated and left as it is (built on the ``meta`` device,
    then ``to_empty``), for a process that loads a checkpoint over every weight next."""
    torch.manual_seed(0)
    with torch.device("cpu" if init else "meta"):
        layers: list[nn.Module] = []
        for _ in range(BLOCKS):
            layers += [nn.Linear(WIDTH, hidden), nn.GELU(), nn.Linear(hidden, WIDTH)]
        model = nn.Sequential(*layers)
    return model if init else model.to_empty(device="cpu")


def optimizer(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs and targets at ``step``."""
    g = torch.Generator().manual_seed(step * 100_003 + rank)
    x = torch.randn(size, WIDTH, generator=g)
    return x, torch.randn(size, WIDTH, generator=g)


def final_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's parameters and the optimizer's state, by name, for bit comparison
    between runs of the same system (``model.`` keys as ``state_dict`` names them, a DDP
    wrapper's ``module.`` left out; ``optim.<param index>.<key>``)."""
    out = {
        "model." + k.removeprefix("module."): v.detach().contiguous().clone()
        for k, v in model.state_dict().items()
    }
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        for key, value in opt.state.get(p, {}).items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"optim.{i}.{key}"] = t.detach().contiguous().clone()
    return out

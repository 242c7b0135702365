"""The names ``torch.distributed.checkpoint`` gives a module's and an optimizer's state.

A module's ``state_dict()`` keys carry its wrappers: ``module.`` for DDP, ``_orig_mod.``
for ``torch.compile``, ``_fsdp_wrapped_module.`` and ``_checkpoint_wrapped_module.`` for
FSDP1 and activation checkpointing. An optimizer's ``state_dict()`` numbers the
parameters. DCP's ``get_state_dict`` names both by the *fully qualified name* (FQN) of
the unwrapped module instead, and so do Hugging Face checkpoints.

A snapshot records those names next to the state (:func:`module_names`,
:func:`optimizer_names`), so that tier 2 can be exported to DCP or Hugging Face, and
read by ``dcp.load``, with no model at hand. They are worked out once per module and
optimizer and kept while the keys and parameters stay the same.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

_WRAPPED = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""Attribute names of wrappers that DCP drops wherever they appear."""

_modules: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[str, ...], dict[str, str]]] = (
    weakref.WeakKeyDictionary()
)
_optims: weakref.WeakKeyDictionary[
    torch.optim.Optimizer, tuple[nn.Module, tuple[int, ...], list[str]]
] = weakref.WeakKeyDictionary()


def _wrapper_attr(obj: object) -> str | None:
    """The attribute through which a DDP or ``torch.compile`` wrapper holds its module."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(obj, DistributedDataParallel):
        return "module"
    if type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod"):
        return "_orig_mod"
    return None


def fqn(model: nn.Module, key: str) -> str:
    """The FQN of ``model.state_dict()`` key ``key``: its wrappers' names left out."""
    out: list[str] = []
    obj: Any = model
    for part in key.split("."):
        skip = part in _WRAPPED or part == _wrapper_attr(obj)
        if not skip:
            out.append(part)
        obj = getattr(obj, part, None) if isinstance(obj, nn.Module) else None
    return ".".join(out)


def module_names(model: nn.Module, keys: Iterable[str]) -> dict[str, str]:
    """``{state_dict key: FQN}`` for the keys whose FQN differs (none for a plain module)."""
    keys = tuple(keys)
    cached = _modules.get(model)
    if cached is not None and cached[0] == keys:
        return cached[1]
    names = {k: f for k in keys if (f := fqn(model, k)) != k}
    _modules[model] = (keys, names)
    return names


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def optimizer_names(
    opt: torch.optim.Optimizer, modules: Mapping[str, nn.Module]
) -> tuple[str, list[str]] | None:
    """The state key of the module in ``modules`` that owns ``opt``'s parameters, and the
    FQN of each parameter in the order ``opt.state_dict()`` numbers them; None when no one
    module owns them all (the optimizer is then exported with numbered parameters)."""
    params = _params(opt)
    ids = tuple(id(p) for p in params)
    cached = _optims.get(opt)
    if cached is not None and cached[1] == ids:
        for key, m in modules.items():
            if m is cached[0]:
                return key, cached[2]
    for key, m in modules.items():
        # named_parameters() names a tied parameter once, by its first name: as DCP does
        by_id = {id(p): fqn(m, name) for name, p in m.named_parameters()}
        if all(i in by_id for i in ids):
            names = [by_id[i] for i in ids]
            _optims[opt] = (m, ids, names)
            return key, names
    return None

"""Load a checkpoint into a job's live objects before its first step, through ``dcp.load``.

Two sources (``Job`` calls :func:`init_from` when the plan carries an ``InitFrom``): a
DCP folder (``tierswap run --init-from DIR``: trusted input, its ``.metadata`` is a
pickle that only DCP's own ``FileSystemReader`` opens), or the job's own tier-2 step
written at another world size, read through :class:`tierswap.dcp.StorageReader` (a
resume at another size). Every rank plans its own reads (``no_dist``): DCP reshards to
this job's world size and its DDP or FSDP2 wrapping, and no plan is pickled between
ranks.
"""

from __future__ import annotations

import socket
import time
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.storage import StorageReader as _StorageReader

from tierswap import names
from tierswap.dcp import StorageReader
from tierswap.errors import CorruptPartError, StateMismatchError, UsageError, listed
from tierswap.state import init_optimizer_state


@dataclass(frozen=True, slots=True)
class Initialized:
    step: int
    """The step the checkpoint holds: the job's first step is the next one."""
    missing: list[str]
    """Flat keys of the live state that the checkpoint does not hold (left as built)."""
    seconds: float


def _targets(state: Mapping[str, Any], stored: Mapping[str, Any]) -> dict[str, Any]:
    """The user's state as DCP state dicts (``get_model_state_dict`` and friends); an
    optimizer of which ``stored`` holds nothing is left out (and so left as built)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    out: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            out[key] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            if not any(k.startswith(f"{key}.") for k in stored):
                continue
            owner = names.optimizer_names(obj, modules)
            if owner is None:
                raise StateMismatchError(
                    f"state[{key!r}]: no one module in the state owns all of this "
                    "optimizer's parameters, so its state cannot be named as DCP names it; "
                    "put one module that holds them all (their common parent) in the state"
                )
            init_optimizer_state(obj)  # its moments exist to be loaded into
            out[key] = get_optimizer_state_dict(modules[owner[0]], obj)
        elif callable(getattr(obj, "state_dict", None)):
            out[key] = obj.state_dict()
        else:
            out[key] = obj
    return out


def _apply(state: MutableMapping[str, Any], loaded: Mapping[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    for key, obj in state.items():
        if key not in loaded:
            continue
        if isinstance(obj, nn.Module):
            set_model_state_dict(obj, loaded[key])
        elif isinstance(obj, torch.optim.Optimizer):
            owner = names.optimizer_names(obj, modules)
            assert owner is not None
            set_optimizer_state_dict(modules[owner[0]], obj, loaded[key])
        elif callable(getattr(obj, "load_state_dict", None)):
            obj.load_state_dict(loaded[key])
        else:
            state[key] = loaded[key]


def _metadata(path: str, step: int | None, tier2: bool) -> tuple[_StorageReader, Metadata]:
    if tier2:
        if step is None:
            raise ValueError("a resume from tier 2 names its step")
        tier2_reader = StorageReader(path, step)
        return tier2_reader, tier2_reader.read_metadata()
    reader = FileSystemReader(path)
    try:
        return reader, reader.read_metadata()  # a pickle: DCP's own reader, trusted input
    except FileNotFoundError:
        raise UsageError(
            f"--init-from {path}: no DCP checkpoint there on host {socket.gethostname()} "
            "(no .metadata file); give a folder that every host reads at this path"
        ) from None


def init_from(
    state: MutableMapping[str, Any], path: str, step: int | None = None, *, tier2: bool = False
) -> Initialized:
    """Load a checkpoint into ``state``'s live objects through ``dcp.load``: every rank
    plans and reads its own chunks (no plans exchanged), resharded to this job's world
    size and its DDP or FSDP2 wrapping.

    ``path`` is a DCP folder (``--init-from``: the step it holds is ``step``, else a
    ``step`` value saved in it; keys of the state it lacks are left as built and
    returned), or with ``tier2`` a tierswap root whose committed ``step`` was written at
    another world size (it must hold every key of the state).
    """
    t0 = time.monotonic()
    reader, meta = _metadata(path, step, tier2)
    stored = meta.state_dict_metadata
    source = f"{path} step {step}" if tier2 else f"--init-from {path}"
    target = _targets(state, stored)
    saved_step = stored.get("step")
    if step is None and saved_step is None:
        raise StateMismatchError(
            f"{source}: the checkpoint holds no 'step' value; give the step it was saved at "
            "with --init-step S (the job's first step is then S + 1)"
        )
    if step is None and "step" not in state:
        if isinstance(saved_step, TensorStorageMetadata):
            target["step"] = torch.zeros(saved_step.size, dtype=saved_step.properties.dtype)
        else:
            target["step"] = None
    flat, _ = flatten_state_dict(target)
    missing = sorted(k for k in flat if k not in stored)
    missing += sorted(k for k in state if k not in target)  # an optimizer it has nothing of
    if tier2 and missing:
        raise StateMismatchError(
            f"{source} lacks {listed(missing)} of this job's state (a step written before tierswap "
            "recorded DCP's names, or by other code): resume it at the world size that "
            "wrote it, or with the code that wrote it"
        )
    try:
        with warnings.catch_warnings():  # no_dist is meant: each rank plans its own reads
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp_load(
                target,
                storage_reader=reader,
                planner=DefaultLoadPlanner(allow_partial_load=True),
                no_dist=True,
            )
    except CheckpointException as e:
        errors = [err for err, _ in e.failures.values()]
        corrupt = next((err for err in errors if isinstance(err, CorruptPartError)), None)
        if corrupt is not None:
            raise corrupt from e
        why = f"{type(errors[0]).__name__}: {errors[0]}" if errors else str(e)
        raise StateMismatchError(
            f"{source} does not load into this job's state ({why}); start it with the code "
            "and sizes that wrote it"
        ) from e
    if step is None:
        got = target["step"] if "step" in state else target.pop("step")
        try:
            step = int(got.item() if isinstance(got, torch.Tensor) else got)
        except (TypeError, ValueError, RuntimeError):
            step = -1
        if step < 0:
            raise StateMismatchError(
                f"{source}: its 'step' value {got!r} is not a step number; give --init-step S"
            )
    _apply(state, target)
    return Initialized(step=step, missing=missing, seconds=time.monotonic() - t0)

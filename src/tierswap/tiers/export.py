"""Export a committed durable step: ``merged``, ``hf`` or ``dcp`` (``tierswap export``).

``merged``: one plain safetensors file plus its JSON state. DTensor shards of the same
key are put back together along their placements; tensors that every rank holds with the
same bits are written once; anything else stays per rank under ``rank<R>/<name>``. The
result loads with ``safetensors.torch.load_file``, no tierswap needed.

``hf``: the model's weights as full tensors under their plain names, in Hugging Face's
layout (``model.safetensors``, or numbered shards and ``model.safetensors.index.json``).

``dcp``: a ``torch.distributed.checkpoint`` folder (:mod:`tierswap.dcp`).

Every file of an export gets the same permissions (``0666`` less the umask), and a
folder is written under a temporary name and renamed when complete: an existing one is
never overwritten.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tierswap.errors import UsageError
from tierswap.state import Layout, TensorEntry, tensor_view
from tierswap.tiers import durable
from tierswap.tiers.files import fsync_dir, write_local

log = logging.getLogger(__name__)

EXPORT_FORMAT = "tierswap-export-1"
_SHARD_RE = re.compile(r"(?:Shard\(dim=|S\()(\d+)\)")
_REPLICATE = ("Replicate()", "R")

_Piece = tuple[int, TensorEntry, torch.Tensor]
_Part = tuple[Layout, dict[str, Any], memoryview]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _assemble(
    pieces: Mapping[tuple[int, ...], torch.Tensor], placements: tuple[str, ...], level: int
) -> torch.Tensor:
    """The tensor that the shards in ``pieces`` (by mesh coordinate) are cut from."""
    if level == len(placements):
        return next(iter(pieces.values()))
    groups: dict[int, dict[tuple[int, ...], torch.Tensor]] = {}
    for coord, t in pieces.items():
        groups.setdefault(coord[level], {})[coord] = t
    subs = [_assemble(groups[c], placements, level + 1) for c in sorted(groups)]
    if placements[level] in _REPLICATE:
        return subs[0]
    m = _SHARD_RE.fullmatch(placements[level])
    if m is None:
        raise ValueError(f"cannot merge shards placed as {placements[level]}")
    return torch.cat(subs, dim=int(m.group(1)))


def _merge_one(group: list[_Piece]) -> torch.Tensor | None:
    """One tensor for all ranks' pieces of a key, or None if they must stay per rank."""
    entries = [e for _, e, _ in group]
    first = group[0][2]
    if all(e.global_shape is None for e in entries):
        same = all(
            t.dtype == first.dtype and t.shape == first.shape and torch.equal(_raw(t), _raw(first))
            for _, _, t in group
        )
        return first if same else None
    e0 = entries[0]
    if any((e.global_shape, e.placements) != (e0.global_shape, e0.placements) for e in entries):
        return None
    placements = e0.placements or ()
    if any(len(e.mesh_coord or ()) != len(placements) for e in entries):
        return None
    try:
        merged = _assemble({e.mesh_coord or (): t for _, e, t in group}, placements, 0)
    except (ValueError, RuntimeError) as err:
        log.warning("export keeps %s per rank: %s", e0.key, err)
        return None
    if tuple(merged.shape) != e0.global_shape:
        log.warning(
            "export keeps %s per rank: shards make %s, not %s",
            e0.key,
            tuple(merged.shape),
            e0.global_shape,
        )
        return None
    return merged


def _merge(ranks: list[_Part]) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """Exported tensors, and each rank's exported names in layout order."""
    groups: dict[str, list[_Piece]] = {}
    for r, (layout, _, buf) in enumerate(ranks):
        for name, e in zip(durable.tensor_names(layout), layout.entries, strict=True):
            groups.setdefault(name, []).append((r, e, tensor_view(memoryview(buf), e)))
    out: dict[str, torch.Tensor] = {}
    where: dict[tuple[int, str], str] = {}
    for name, group in groups.items():
        one = _merge_one(group)
        for r, _, t in group:
            where[r, name] = name if one is not None else f"rank{r}/{name}"
            out[where[r, name]] = t if one is None else one
    names = [
        [where[r, n] for n in durable.tensor_names(layout)]
        for r, (layout, _, _) in enumerate(ranks)
    ]
    return out, names


def _save_atomic(tensors: dict[str, torch.Tensor], out: Path, meta: dict[str, str]) -> None:
    """``save_file`` to a temporary name, synced and renamed, so ``out`` is never half."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp), metadata=meta)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(str(out.parent))


def export(root: str, step: int, out_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Write committed ``step`` as one safetensors file at ``out_path`` (a local path), DTensor
    shards merged, and its JSON state (each rank's tree) next to it with suffix ``.json``."""
    out = Path(out_path)
    if out.suffix == ".json":
        raise ValueError(f"export to {out}: the JSON state goes to {out}, name it .safetensors")
    world_size, parts = durable.read_commit(root, step)
    ranks = [durable.read_part(root, step, r, parts[r]) for r in range(world_size)]
    tensors, names = _merge(ranks)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": EXPORT_FORMAT, "step": str(step), "world_size": str(world_size)}
    _save_atomic(tensors, out, meta)
    trees = {str(r): {"tree": rank[1], "tensors": names[r]} for r, rank in enumerate(ranks)}
    state = {**meta, "step": step, "world_size": world_size, "ranks": trees}
    write_local(str(out.with_suffix(".json")), [json.dumps(state).encode()])
    for path in (out, out.with_suffix(".json")):
        os.chmod(path, _file_mode())
    return {
        "step": step,
        "world_size": world_size,
        "tensors": len(tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "per_rank": len(set(tensors) - {n for r in ranks for n in durable.tensor_names(r[0])}),
        "path": str(out),
        "json": str(out.with_suffix(".json")),
    }


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _file_mode() -> int:
    return 0o666 & ~_umask()


def check_new(out: str | os.PathLike[str]) -> None:
    """Refuse an ``out`` that exists: an export never overwrites one. Checked before the
    step is read (and again as the folder is made)."""
    if os.path.lexists(out):
        raise UsageError(f"{out} exists: remove it or export to a new folder")


@contextlib.contextmanager
def new_folder(out: str | os.PathLike[str]) -> Iterator[str]:
    """A temporary folder next to ``out``, renamed to ``out`` when the block succeeds
    (removed when it fails); its files then all get the same permissions."""
    dest = Path(out)
    check_new(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield str(tmp)
        mode = _file_mode()
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                os.chmod(f, mode)
        tmp.chmod(0o777 & ~_umask())
        fsync_dir(str(tmp))
        os.replace(tmp, dest)
        fsync_dir(str(dest.parent))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count: Hugging Face's shard-size notation."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*((?:[KMGT]i?)?)B?\s*", text, re.IGNORECASE)
    if m is None:
        raise UsageError(f"--max-shard-size {text!r}: give bytes, or a size such as 5GB or 500MB")
    unit = m.group(2).upper()
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]  # fmt: skip
    size = int(float(m.group(1)) * scale)
    if size < 1:
        raise UsageError(f"--max-shard-size {text!r}: must be at least one byte")
    return size


HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


def _not_a_model(
    root: str, step: int, model: str, kinds: Mapping[str, str], modules: list[str]
) -> UsageError:
    """``--model`` names no weights of the step (names -> tensors): what it names, and what
    it may name."""
    kind = kinds.get(model)
    what = {"optimizer": "an optimizer's state", "value": "a plain value"}.get(
        str(kind), "an object's state_dict()"
    )
    held = (
        f"holds no state key {model!r}"
        if kind is None
        else f"holds {what} under {model!r}, not a model's weights (names -> tensors)"
    )
    keys = ", ".join(f"{k} ({v})" for k, v in kinds.items()) or "none"
    return UsageError(
        f"--model {model}: {root} step {step} {held}; --model names the state key of the "
        f"model (its modules: {', '.join(modules) or 'none recorded'}; its state keys: {keys})"
    )


def export_hf(
    root: str, step: int, out: str, max_shard_size: int = 5 * 10**9, model: str | None = None
) -> dict[str, Any]:
    """Write the model of committed ``step`` as Hugging Face safetensors in the new folder
    ``out``: full tensors under their FQNs, one file or shards of at most ``max_shard_size``
    bytes (a tensor larger than that gets a shard of its own) plus the index."""
    from tierswap.dcp import View, load_full

    check_new(out)  # before the step is read, which may take long
    view = View(root, step)
    modules = view.modules
    if model is None:
        if len(modules) != 1:
            raise UsageError(
                f"{root} step {step} holds {len(modules)} modules ({', '.join(modules) or 'none'}"
                "; a step written before tierswap recorded what each state value is shows "
                "none): name the model's state key with --model KEY"
            )
        model = modules[0]
    if view.kinds.get(model) in (None, "optimizer"):
        raise _not_a_model(root, step, model, view.kinds, modules)
    keys = [k for k in view.tensors if k.startswith(f"{model}.")]
    if not keys:
        raise UsageError(f"{root} step {step} holds no tensors under state key {model!r}")
    _, sd = load_full(root, step, keys)
    held = sd[model]
    if not (isinstance(held, dict) and all(isinstance(v, torch.Tensor) for v in held.values())):
        raise _not_a_model(root, step, model, view.kinds, modules)  # not a flat name -> tensor
    weights: dict[str, torch.Tensor] = dict(held)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    files = (
        [HF_WEIGHTS]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    total = sum(t.numel() * t.element_size() for t in weights.values())
    with new_folder(out) as tmp:
        for name, shard in zip(files, shards, strict=True):
            save_file({k: t.contiguous() for k, t in shard.items()}, os.path.join(tmp, name),
                      metadata={"format": "pt"})  # fmt: skip
        if len(files) > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {k: f for f, shard in zip(files, shards, strict=True) for k in shard},
            }
            with open(os.path.join(tmp, HF_INDEX), "w") as fh:
                json.dump(index, fh, indent=2)
    return {
        "step": step,
        "world_size": view.world_size,
        "format": "hf",
        "model": model,
        "tensors": len(weights),
        "bytes": total,
        "files": len(files),
        "path": out,
    }

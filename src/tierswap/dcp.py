"""Bridges between tier 2 and ``torch.distributed.checkpoint`` (DCP).

- :class:`StorageReader`: ``dcp.load(sd, storage_reader=tierswap.dcp.StorageReader(root))``
  reads a committed step of a tierswap root straight into any state dict, at any world
  size, resharded by DCP's own planner; every part is checked against its checksums as
  it is read.
- :func:`export_dcp`: a committed step written out as a DCP checkpoint (full tensors),
  which ``dcp.load`` with its default reader takes in one process or in a job of any size.
- ``tierswap.dcp_init.init_from``: a DCP checkpoint, or a tier-2 step of another world
  size, loaded into a job's live objects before its first step (``--init-from DIR``).

Names are DCP's: a module's values by the fully qualified names of
``get_model_state_dict`` and an optimizer's state by parameter name, as
``get_optimizer_state_dict`` gives them, each under the user's state key (``model.…``,
``optim.state.…``); other values under their own keys. A snapshot records those names
(:mod:`tierswap.names`); steps written before it did keep their ``state_dict()`` keys.

A tier-2 step holds one part per rank. DTensor shards are DCP chunks at the offsets their
placements give; every other value (a DDP parameter, an optimizer's hyperparameters, a
data cursor) is read from rank 0, as DCP itself keeps one copy of a value every rank
saves. The RNG streams, which differ per rank, are left out.

A DCP directory is trusted input: its ``.metadata`` file is a pickle, which only DCP's
own reader opens (``--init-from``). Tier 2 itself is never unpickled: the
``StorageReader`` hands DCP's planner non-tensor values it encoded itself from JSON.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader as _StorageReader
from torch.futures import Future

from tierswap.errors import StateMismatchError, TierswapError
from tierswap.state import (
    FQNS,
    KIND,
    PARAMS,
    RNG_KEY,
    Layout,
    TensorEntry,
    _Loader,
    tensor_view,
    torch_dtype,
)
from tierswap.tiers import catalog, durable

log = logging.getLogger(__name__)

__all__ = ["StorageReader", "View", "export_dcp"]

_REPLICATE = ("Replicate()", "R")


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored chunk of a tensor: rank ``rank``'s entry ``index``, at ``offsets``."""

    rank: int
    index: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stored:
    """A tensor of the step as DCP sees it: its whole shape and the chunks that make it."""

    dtype: torch.dtype
    size: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * self.dtype.itemsize


class _Placeholders(_Loader):
    """Decode a part's tree with every tensor a meta tensor standing for its entry."""

    def __init__(self, rank: int, layout: Layout) -> None:
        super().__init__([], layout.entries)
        self.rank = rank
        self.refs: dict[int, tuple[int, int]] = {}
        """id of a placeholder -> (rank, entry index)."""
        self.keep: list[torch.Tensor] = []

    def tensor(self, path: str, index: Any, template: Any) -> torch.Tensor:
        if not isinstance(index, int) or not 0 <= index < len(self.entries):
            raise StateMismatchError(f"{path}: tensor reference {index!r} is out of range")
        e = self.entries[index]
        t = torch.empty(e.shape, dtype=torch_dtype(e.dtype), device="meta")
        self.refs[id(t)] = (self.rank, index)
        self.keep.append(t)
        return t


def _renamed_optimizer(value: Any, params: Any, where: str) -> Any:
    """An optimizer's ``state_dict()`` with parameter numbers replaced by their names."""
    if not isinstance(value, dict) or not isinstance(params, list):
        raise StateMismatchError(f"{where}: optimizer state is not a dict with parameter names")

    def name(pid: Any) -> str:
        if not isinstance(pid, int) or not 0 <= pid < len(params):
            raise StateMismatchError(f"{where}: parameter {pid!r} has no recorded name")
        return str(params[pid])

    state = value.get("state", {})
    groups = value.get("param_groups", [])
    return {
        **value,
        "state": {name(pid): s for pid, s in state.items()},
        "param_groups": [{**g, "params": [name(i) for i in g.get("params", [])]} for g in groups],
    }


def _nested(tree: Mapping[str, Any], dec: _Placeholders, where: str) -> dict[str, Any]:
    """A part's state with DCP's names (placeholders for tensors); RNG streams left out."""
    out: dict[str, Any] = {}
    for key, v in tree.items():
        if key == RNG_KEY:
            continue
        if not (isinstance(v, dict) and "__stateful__" in v):
            out[key] = dec.value(key, v)
            continue
        value = dec.value(key, v["__stateful__"])
        if v.get(KIND) == "module" and isinstance(value, dict):
            fqns = v.get(FQNS) or {}
            value = {str(fqns.get(k, k)): x for k, x in value.items()}
        elif v.get(KIND) == "optimizer" and PARAMS in v:
            value = _renamed_optimizer(value, v[PARAMS], f"{where} state[{key!r}]")
        out[key] = value
    return out


def _shard_dims(key: str, placements: tuple[str, ...]) -> dict[int, int]:
    """tensor dim -> the mesh dim that shards it."""
    from tierswap.tiers.export import _SHARD_RE

    dims: dict[int, int] = {}
    for md, pl in enumerate(placements):
        if pl in _REPLICATE:
            continue
        m = _SHARD_RE.fullmatch(pl)
        if m is None:
            raise StateMismatchError(
                f"{key}: a DTensor placed as {pl} cannot be read back as chunks (only Shard "
                "and Replicate can); export this step with --format merged"
            )
        d = int(m.group(1))
        if d in dims:
            raise StateMismatchError(
                f"{key}: tensor dim {d} is sharded over two mesh dims, which DCP chunks "
                "cannot describe here; export this step with --format merged"
            )
        dims[d] = md
    return dims


def _pieces(key: str, entries: Mapping[int, tuple[int, TensorEntry]]) -> Stored:
    """The chunks of a DTensor from each rank's shard of it."""
    (r0, (_, e0)), *_ = sorted(entries.items())
    assert e0.global_shape is not None and e0.placements is not None
    size = e0.global_shape
    for r, (_, e) in entries.items():
        if (e.global_shape, e.placements, e.dtype) != (size, e0.placements, e0.dtype):
            raise StateMismatchError(f"{key}: rank {r}'s shard differs from rank {r0}'s in kind")
    dims = _shard_dims(key, e0.placements)
    extent: dict[tuple[int, int], int] = {}
    for _, e in entries.values():
        for d, md in dims.items():
            extent[d, (e.mesh_coord or ())[md]] = e.shape[d]
    pieces: dict[tuple[int, ...], Piece] = {}
    for r, (index, e) in sorted(entries.items()):
        offsets = [0] * len(size)
        for d, md in dims.items():
            c = (e.mesh_coord or ())[md]
            try:
                offsets[d] = sum(extent[d, k] for k in range(c))
            except KeyError:
                raise StateMismatchError(f"{key}: the shards do not cover the tensor") from None
        pieces.setdefault(tuple(offsets), Piece(r, index, tuple(offsets), e.shape))
    covered = sum(math.prod(p.shape) for p in pieces.values())
    inside = all(
        o + n <= s
        for p in pieces.values()
        for o, n, s in zip(p.offsets, p.shape, size, strict=True)
    )
    if covered != math.prod(size) or not inside:
        raise StateMismatchError(f"{key}: the shards do not make a tensor of shape {list(size)}")
    return Stored(torch_dtype(e0.dtype), size, tuple(pieces.values()))


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, list | tuple):
        return any(_holds_tensor(x) for x in v)
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    return False


class View:
    """A committed tier-2 step as DCP sees it: flat keys, tensor chunks and values.

    Reads COMMIT and the parts' JSON (rank 0's, every rank's where there are DTensor
    shards), never their tensor bytes: :meth:`read` does that, checked.
    """

    def __init__(self, root: str, step: int | None = None) -> None:
        self.root = root
        if step is None:
            steps = catalog.restorable_steps(root)
            if not steps:
                raise FileNotFoundError(
                    f"{root} holds no committed step (`tierswap ls {root}` lists its steps)"
                )
            step = steps[-1]
        self.step = step
        self.world_size, self.parts = durable.read_commit(root, step)
        metas = {0: durable.read_meta(root, step, 0, self.parts[0])}
        if any(e.global_shape is not None for e in metas[0][0].entries):
            for r in range(1, self.world_size):
                metas[r] = durable.read_meta(root, step, r, self.parts[r])
        flats: dict[int, dict[str, Any]] = {}
        refs: dict[int, tuple[int, int]] = {}
        keep = []
        for r, (layout, tree) in metas.items():
            dec = _Placeholders(r, layout)
            nested = _nested(tree, dec, f"{root} step {step} rank {r}")
            flat, mapping = flatten_state_dict(nested)
            flats[r] = flat
            refs.update(dec.refs)
            keep.append(dec.keep)
            if r == 0:
                self.mapping = mapping
                self.kinds = {
                    k: str(v.get(KIND, "stateful")) if isinstance(v, dict) and "__stateful__" in v
                    else "value"
                    for k, v in tree.items() if k != RNG_KEY
                }  # fmt: skip
        self.layouts = {r: m[0] for r, m in metas.items()}
        self.tensors: dict[str, Stored] = {}
        self.values: dict[str, Any] = {}
        for key, v in flats[0].items():
            ref = refs.get(id(v)) if isinstance(v, torch.Tensor) else None
            if ref is None:
                if _holds_tensor(v):
                    raise StateMismatchError(
                        f"{root} step {step}: {key} holds a tensor inside a tuple, which DCP "
                        "keeps as one pickled value: keep tensors in the state's dicts and "
                        "lists, or export this step with --format merged"
                    )
                self.values[key] = v
                continue
            e = self.layouts[0].entries[ref[1]]
            if e.global_shape is None:
                piece = Piece(0, ref[1], (0,) * len(e.shape), e.shape)
                self.tensors[key] = Stored(torch_dtype(e.dtype), e.shape, (piece,))
                continue
            shards: dict[int, tuple[int, TensorEntry]] = {}
            for r, flat in flats.items():
                got = refs.get(id(flat.get(key)))
                if got is None:
                    raise StateMismatchError(f"{key}: rank {r} holds no shard of it")
                shards[r] = (got[1], self.layouts[r].entries[got[1]])
            self.tensors[key] = _pieces(key, shards)

    @property
    def modules(self) -> list[str]:
        """State keys that hold a module's values."""
        return [k for k, kind in self.kinds.items() if kind == "module"]

    def metadata(self) -> Metadata:
        md: dict[str, Any] = {}
        where: dict[MetadataIndex, tuple[int, int]] = {}
        for key, t in self.tensors.items():
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.shape))
                for p in t.pieces
            ]
            md[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=t.dtype), size=torch.Size(t.size), chunks=chunks
            )
            for p in t.pieces:
                where[MetadataIndex(key, torch.Size(p.offsets))] = (p.rank, p.index)
        for key in self.values:
            md[key] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md, storage_data=where)

    def empty(self, keys: list[str] | None = None) -> dict[str, Any]:
        """A nested state dict of full, uninitialised tensors (and the values), for ``keys``
        (flat keys; all when None): what ``dcp.load`` fills."""
        flat: dict[str, Any] = {
            k: torch.empty(t.size, dtype=t.dtype)
            for k, t in self.tensors.items()
            if keys is None or k in keys
        }
        flat.update({k: v for k, v in self.values.items() if keys is None or k in keys})
        return unflatten_state_dict(flat, {k: self.mapping[k] for k in flat})


def _narrow(t: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        t = t.narrow(d, o, n)
    return t


class StorageReader(_StorageReader):
    """Read a committed step of a tierswap durable root with ``dcp.load``.

    ``url`` is the root (a path or any fsspec URL), ``step`` one of its committed steps
    (the newest restorable one when None). Each rank reads the parts that hold the chunks
    it needs, each checked against its checksums and COMMIT before any byte is used.
    """

    def __init__(self, url: str | os.PathLike[str], step: int | None = None) -> None:
        super().__init__()
        self.url = str(url)
        self.step = step
        self.view: View | None = None
        self._where: dict[MetadataIndex, tuple[int, int]] = {}
        self.bytes_read = 0
        """Bytes of tier-2 parts read (and checked) so far."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.url:
            self.url, self.view = str(checkpoint_id), None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.view is None or self.view.root != self.url:
            self.view = View(self.url, self.step)
        return self.view.metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:  # fmt: skip
        if self.view is None:
            self.read_metadata()
        assert self.view is not None
        self._where = self.view.metadata().storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        view = self.view
        assert view is not None, "read_metadata comes first"
        by_rank: dict[int, list[Any]] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(view.values[item.storage_index.fqn], buf)  # a value of our JSON
                buf.seek(0)
                planner.load_bytes(item, buf)
            else:
                by_rank.setdefault(self._where[item.storage_index][0], []).append(item)
        for rank, items in sorted(by_rank.items()):
            layout, _, data = durable.read_part(self.url, view.step, rank, view.parts[rank])
            self.bytes_read += layout.nbytes
            for item in items:
                entry = layout.entries[self._where[item.storage_index][1]]
                src = _narrow(tensor_view(data, entry), item.storage_offsets, item.lengths)
                dst = planner.resolve_tensor(item).detach()
                if dst.shape != src.shape:
                    raise StateMismatchError(
                        f"{item.storage_index.fqn}: DCP asked for {list(dst.shape)}, the "
                        f"stored chunk gives {list(src.shape)}"
                    )
                dst.copy_(src)
                planner.commit_tensor(item, dst)
            del data
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return bool(catalog.committed_steps(str(checkpoint_id)))
        except (OSError, ValueError, ImportError):
            return False


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """Around a ``dcp.load`` or ``dcp.save`` with ``no_dist``: in one process on purpose,
    so torch's warning that it assumes so ("torch.distributed is disabled, ...") is left
    out, and only it. A failure of ours on the way (a corrupt part, a mismatch), which DCP
    wraps in a ``CheckpointException`` of every rank's traceback, is raised as itself: the
    command line then reports it in one line, as it does the ``merged`` export's."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            yield
    except CheckpointException as e:
        ours = [err for err, _ in e.failures.values() if isinstance(err, TierswapError)]
        if not ours:
            raise
        raise ours[0] from e


def load_full(root: str, step: int | None, keys: list[str] | None = None) -> tuple[View, Any]:
    """The step's values as full tensors (nested, DCP's names), through ``dcp.load``."""
    reader = StorageReader(root, step)
    reader.read_metadata()
    assert reader.view is not None
    sd = reader.view.empty(keys)
    with _one_process():
        dcp_load(sd, storage_reader=reader, no_dist=True)
    return reader.view, sd


STEP_KEY = "step"
"""The top-level value of a DCP checkpoint that ``--init-from`` takes as the step it holds
(``tierswap.dcp_init``): an export writes the step there, unless the state has a value of
that name itself."""


def _is_step(value: Any, step: int) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.item() == step
    return isinstance(value, int) and value == step


def export_dcp(root: str, step: int, out: str) -> dict[str, Any]:
    """Write committed ``step`` as a DCP checkpoint in the new folder ``out``, with the step
    number under ``step`` (``tierswap run --init-from OUT`` goes on at the next step)."""
    from tierswap.tiers.export import check_new, new_folder

    check_new(out)  # before the step is read, which may take long
    view, sd = load_full(root, step)
    added = STEP_KEY not in sd
    if added:
        sd[STEP_KEY] = step
    elif not _is_step(sd[STEP_KEY], step):  # the state's own value, kept
        log.warning(
            "%s step %d holds a value %r under %r, which `tierswap run --init-from` takes as "
            "the step the export holds: give --init-step %d there to go on after step %d",
            root, step, sd[STEP_KEY], STEP_KEY, step, step,
        )  # fmt: skip
    with new_folder(out) as tmp, _one_process():
        dcp_save(sd, storage_writer=FileSystemWriter(tmp), no_dist=True)
    return {
        "step": step,
        "world_size": view.world_size,
        "format": "dcp",
        "tensors": len(view.tensors),
        "values": len(view.values) + added,
        "bytes": sum(t.nbytes for t in view.tensors.values()),
        "path": out,
    }

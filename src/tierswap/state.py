"""Flatten training state into a layout of tensors plus a JSON tree, and load it back.

A snapshot of one rank is two things:

- a :class:`Layout`: every tensor's key, dtype, shape and byte range in a flat buffer
  (a tier-0 slot, or the data section of a safetensors file);
- a *tree*: the state's structure as JSON, where each tensor is a reference
  ``{"__t__": index}`` into the layout and every other value is stored as JSON.

Nothing is pickled, so loading a snapshot can never run code.
"""

from __future__ import annotations

import base64
import math
import random
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from tierswap import names
from tierswap.errors import NotSerializableError, StateMismatchError
from tierswap.layout import ALIGN, Layout, TensorEntry

__all__ = ["ALIGN", "Flat", "Layout", "TensorEntry", "flatten", "load", "make_layout"]

RNG_KEY = "__rng__"
KIND = "__kind__"
"""Beside a Stateful's ``__stateful__`` value in the tree: "module" or "optimizer"."""
FQNS = "__fqns__"
"""A module's ``{state_dict key: FQN}`` where they differ (:func:`names.module_names`)."""
OWNER = "__module__"
"""An optimizer's module: its key in the state."""
PARAMS = "__params__"
"""An optimizer's parameter FQNs, in the order its ``state_dict()`` numbers them."""

# safetensors' dtype names: the durable format uses them, so the layout does too.
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise NotSerializableError(
            f"tensors of dtype {dtype} cannot be snapshotted; supported: "
            f"{', '.join(str(d) for d in _DTYPES)}"
        ) from None


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    try:
        return _TORCH_DTYPES[code]
    except KeyError:
        raise StateMismatchError(f"unknown tensor dtype {code!r} in a snapshot") from None


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def tensor_view(buf: memoryview, entry: TensorEntry) -> torch.Tensor:
    """A tensor aliasing ``entry``'s bytes in ``buf`` (no copy)."""
    dtype = torch_dtype(entry.dtype)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
    return raw.view(dtype).view(entry.shape)


@dataclass(slots=True)
class Flat:
    """The state of one rank at one step, not yet copied anywhere."""

    tree: dict[str, Any]
    tensors: list[torch.Tensor]
    """Local tensors (a DTensor's own shard), in layout order."""
    entries: list[TensorEntry] = field(default_factory=list)
    """Entries without offsets; :func:`make_layout` places them."""


def make_layout(flat: Flat) -> Layout:
    """Place ``flat``'s tensors in a buffer, each aligned to 64 bytes."""
    placed = []
    offset = 0
    for e in flat.entries:
        offset = -(-offset // ALIGN) * ALIGN
        placed.append(_replace_offset(e, offset))
        offset += e.nbytes
    return Layout(entries=tuple(placed), nbytes=max(offset, 1))


def _replace_offset(e: TensorEntry, offset: int) -> TensorEntry:
    return TensorEntry(
        e.key,
        e.dtype,
        e.shape,
        offset,
        e.nbytes,
        e.deferred,
        e.global_shape,
        e.placements,
        e.mesh_coord,
    )


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


def _deferred_ptrs(obj: object) -> set[int]:
    """Storage pointers of tensors that only ``optimizer.step()`` changes."""
    if isinstance(obj, torch.nn.Module):
        return {_local(p).data_ptr() for p in obj.parameters()}
    if isinstance(obj, torch.optim.Optimizer):
        return {
            _local(v).data_ptr()
            for st in obj.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        }
    return set()


class _Flattener:
    def __init__(self) -> None:
        self.flat = Flat(tree={}, tensors=[])
        self.deferred: set[int] = set()

    def tensor(self, path: str, t: torch.Tensor) -> dict[str, Any]:
        # Runs for every tensor at every step: plain tensors skip the DTensor look-up.
        local = t if type(t) in _PLAIN else _local(t).detach()
        code = _DTYPES.get(local.dtype)
        if code is None or local.device.type not in ("cpu", "cuda"):
            raise NotSerializableError(
                f"state value at {path!r} is a {local.dtype} tensor on {local.device}, which "
                f"cannot be snapshotted; supported dtypes: {', '.join(map(str, _DTYPES))}"
            )
        nbytes = local.numel() * local.element_size()
        entry = TensorEntry(
            path,
            code,
            tuple(local.shape),
            0,
            nbytes,
            nbytes > 0 and local.data_ptr() in self.deferred,
        )
        if local is not t and hasattr(t, "device_mesh"):
            mesh = t.device_mesh
            entry = TensorEntry(
                entry.key,
                entry.dtype,
                entry.shape,
                0,
                entry.nbytes,
                entry.deferred,
                global_shape=tuple(t.shape),
                placements=tuple(str(p) for p in getattr(t, "placements", ())),
                mesh_coord=tuple(mesh.get_coordinate() or ()),
            )
        self.flat.entries.append(entry)
        self.flat.tensors.append(local)
        return {"__t__": len(self.flat.tensors) - 1}

    def value(self, path: str, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return self.tensor(path, v)
        if v is None or isinstance(v, bool | int | str):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"__float__": repr(v)}
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in v):
                return {k: self.value(f"{path}/{k}", x) for k, x in v.items()}
            return {
                "__dict__": [
                    [self.value(path, k), self.value(f"{path}/{k}", x)] for k, x in v.items()
                ]
            }
        if isinstance(v, list):
            return [self.value(f"{path}/{i}", x) for i, x in enumerate(v)]
        if isinstance(v, tuple):  # torch.Size is a tuple too
            return {"__tuple__": [self.value(f"{path}/{i}", x) for i, x in enumerate(v)]}
        if isinstance(v, bytes):
            return {"__bytes__": base64.b64encode(v).decode()}
        if isinstance(v, torch.dtype):
            return {"__dtype__": str(v).removeprefix("torch.")}
        if isinstance(v, np.ndarray):
            raw = base64.b64encode(np.ascontiguousarray(v).tobytes()).decode()
            return {"__ndarray__": [v.dtype.str, list(v.shape), raw]}
        if isinstance(v, np.generic):
            return self.value(path, v.item())
        raise NotSerializableError(
            f"state value at {path!r} has type {type(v).__qualname__}, which tierswap cannot "
            "store without pickle. Keep tensors, numbers, strings, bytes, lists, tuples and "
            "dicts in the state, or wrap the object in something with state_dict() and "
            "load_state_dict() that returns those."
        )


def _python_rng() -> dict[str, Any]:
    """``random.getstate()`` with its 625 words as one tensor, not 625 JSON numbers."""
    version, words, gauss = random.getstate()
    return {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss}


def capture_rng() -> dict[str, Any]:
    """The RNG states of torch (CPU and CUDA), numpy and Python's ``random``."""
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(legacy=True),
        "python": _python_rng(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def flatten(state: Mapping[str, Any], *, with_rng: bool = True) -> Flat:
    """Flatten a user's state dict (Stateful objects and plain values) plus RNG states."""
    fl = _Flattener()
    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    for name, obj in state.items():
        if not isinstance(name, str) or name.startswith("__"):
            raise ValueError(
                f"state key {name!r}: keys must be strings that do not start with '__'"
            )
        if _is_stateful(obj):
            fl.deferred = _deferred_ptrs(obj)
            sd = obj.state_dict()
            fl.flat.tree[name] = {"__stateful__": fl.value(name, sd), **_names(obj, sd, modules)}
            fl.deferred = set()
        else:
            fl.flat.tree[name] = fl.value(name, obj)
    if with_rng:
        fl.flat.tree[RNG_KEY] = fl.value(RNG_KEY, capture_rng())
    return fl.flat


def _names(obj: object, sd: Mapping[str, Any], modules: Mapping[str, Any]) -> dict[str, Any]:
    """What a Stateful is, and the names DCP gives its values (:mod:`tierswap.names`),
    recorded beside its state so that tier 2 can be exported without the model."""
    if isinstance(obj, torch.nn.Module):
        fqns = names.module_names(obj, sd)
        return {KIND: "module", **({FQNS: fqns} if fqns else {})}
    if isinstance(obj, torch.optim.Optimizer):
        owner = names.optimizer_names(obj, modules)
        if owner is None:
            return {KIND: "optimizer"}
        return {KIND: "optimizer", OWNER: owner[0], PARAMS: owner[1]}
    return {}


# ---------------------------------------------------------------- loading back


class _Loader:
    """Rebuild values from a tree; tensors come from ``tensors`` (CPU, read-only views)."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        entries: tuple[TensorEntry, ...],
        adopt: bool = False,
        shared: frozenset[int] = frozenset(),
    ) -> None:
        self.tensors = tensors
        self.entries = entries
        self.in_place = True
        """Copy into the live tensors (modules, optimizers); else a changed shape is taken
        as it was saved (a data loader's permutation, say)."""
        self.adopt = adopt
        """``tensors`` are this process's own memory, there to stay: a live CPU tensor of a
        module or optimizer that owns its storage is pointed at its saved bytes
        (``.data``), and a value without a live counterpart is taken as it is, instead of
        either being copied."""
        self.shared = shared
        """Storages (by address) more than one live tensor uses: copied into, never
        adopted, so that tied tensors stay tied."""

    def value(self, path: str, v: Any, template: Any = None) -> Any:
        if isinstance(v, list):
            tl = template if isinstance(template, list) else []
            return [self.value(f"{path}/{i}", x, _at(tl, i)) for i, x in enumerate(v)]
        if not isinstance(v, dict):
            return v
        if "__t__" in v:
            return self.tensor(path, v["__t__"], template)
        if "__tuple__" in v:
            tt = template if isinstance(template, tuple) else ()
            return tuple(
                self.value(f"{path}/{i}", x, _at(tt, i)) for i, x in enumerate(v["__tuple__"])
            )
        if "__dict__" in v:
            td = template if isinstance(template, dict) else {}
            out = {}
            for k, x in v["__dict__"]:
                key = self.value(path, k)
                out[key] = self.value(f"{path}/{key}", x, td.get(key))
            return out
        if "__float__" in v:
            return float(v["__float__"])
        if "__bytes__" in v:
            return base64.b64decode(v["__bytes__"])
        if "__dtype__" in v:
            dt = getattr(torch, str(v["__dtype__"]), None)
            if not isinstance(dt, torch.dtype):
                raise StateMismatchError(f"{path}: unknown dtype {v['__dtype__']!r}")
            return dt
        if "__ndarray__" in v:
            dtype, shape, data = v["__ndarray__"]
            dt = np.dtype(dtype)
            if dt.hasobject:
                raise StateMismatchError(f"{path}: object arrays are not loaded")
            return np.frombuffer(base64.b64decode(data), dtype=dt).reshape(shape).copy()
        td = template if isinstance(template, dict) else {}
        return {k: self.value(f"{path}/{k}", x, td.get(k)) for k, x in v.items()}

    def tensor(self, path: str, index: Any, template: Any) -> torch.Tensor:
        if not isinstance(index, int) or not 0 <= index < len(self.tensors):
            raise StateMismatchError(f"{path}: tensor reference {index!r} is out of range")
        src = self.tensors[index]
        entry = self.entries[index]
        if not isinstance(template, torch.Tensor):
            return src if self.adopt else src.clone()
        dst = _local(template)
        if (
            self.adopt
            and self.in_place
            and dst is template
            and _adoptable(dst, src)
            and dst.untyped_storage().data_ptr() not in self.shared
        ):
            with torch.no_grad():
                dst.data = src  # (a Parameter stays the object DDP and the optimizer hold)
            return template
        misfit = tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype
        if misfit and not self.in_place and dst is template:
            return src.clone()
        if misfit:
            raise StateMismatchError(
                f"state value {path!r}: the snapshot has {entry.dtype}{list(src.shape)}, the "
                f"live state has {dtype_code(dst.dtype)}{list(dst.shape)}. The state changed "
                "since the snapshot was taken: restore with the code that wrote it, or start "
                "the job with a new run directory and --persist URL."
            )
        with torch.no_grad():
            dst.copy_(src)
        return template


def _templates(obj: Any, adopt: bool) -> Any:
    """What a Stateful's values are loaded into: when adopting, a module's own Parameters
    and buffers (``keep_vars``), so that pointing them at the fetched bytes changes the
    module."""
    if adopt and isinstance(obj, torch.nn.Module):
        try:
            return obj.state_dict(keep_vars=True)
        except TypeError:  # a state_dict() of the user's own without the argument
            pass
    return obj.state_dict()


def _live_tensors(state: Mapping[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors a load may adopt into: modules' parameters and buffers, optimizers'
    parameters and state."""
    for obj in state.values():
        if isinstance(obj, torch.nn.Module):
            yield from obj.parameters()
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            for g in obj.param_groups:
                yield from g["params"]
            for st in obj.state.values():
                yield from (v for v in st.values() if isinstance(v, torch.Tensor))


def _all_on_cpu(state: Mapping[str, Any]) -> bool:
    """Whether a load may adopt at all: every live tensor a plain CPU tensor. Else (a
    GPU or sharded model) one small CPU tensor adopted (an optimizer's step counter) would
    keep the whole fetched buffer alive beside the state."""
    return all(
        type(t.data) is torch.Tensor and t.device.type == "cpu" for t in _live_tensors(state)
    )


def _shared_storages(state: Mapping[str, Any]) -> frozenset[int]:
    """Storages that more than one distinct live tensor uses (tied weights, views)."""
    seen: dict[int, set[int]] = {}
    for t in _live_tensors(state):
        if t.device.type == "cpu" and t.numel():
            seen.setdefault(t.untyped_storage().data_ptr(), set()).add(id(t))
    return frozenset(ptr for ptr, ids in seen.items() if len(ids) > 1)


def _adoptable(live: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether ``live`` can take ``saved``'s memory for its own (both on the CPU, as
    :func:`_all_on_cpu` found): the same dtype and shape, and ``live`` the only tensor in
    its storage (a parameter that is a view into a flat buffer must keep aliasing it, so it
    is copied into instead)."""
    return (
        live.dtype == saved.dtype
        and live.shape == saved.shape
        and live.is_contiguous()
        and live.storage_offset() == 0
        and live.untyped_storage().nbytes() == live.nbytes
    )


def _at(seq: list[Any] | tuple[Any, ...], i: int) -> Any:
    return seq[i] if i < len(seq) else None


_PARAM_SHAPED = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
)
"""torch's optimizers whose state is, per parameter, tensors of its shape and scalars."""


def _takes_copies(opt: torch.optim.Optimizer) -> bool:
    """Whether an optimizer can be given its loaded state as copies instead of having it
    made first by a step with zero gradients (0.4 s for AdamW over 33 M parameters on a
    CPU): one of torch's own whose state is shaped like its parameters (which the load then
    checks), over plain CPU tensors, where ``load_state_dict`` keeps the tensors it is
    handed. Sharded (DTensor) or GPU parameters, or any other optimizer, get the step."""
    if type(opt) not in _PARAM_SHAPED:
        return False
    params = [p for g in opt.param_groups for p in g["params"]]
    return all(type(p.data) is torch.Tensor and p.device.type == "cpu" for p in params)


def _check_shapes(opt: torch.optim.Optimizer, name: str, what: str) -> None:
    """Every loaded state tensor of a parameter is a scalar or has the parameter's shape."""
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        for key, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != p.shape:
                raise StateMismatchError(
                    f"state[{name!r}] parameter {i} {key!r}: {what} has {list(v.shape)}, the "
                    f"live parameter {list(p.shape)}. The state changed since the snapshot "
                    "was taken: restore with the code that wrote it, or start the job with "
                    "a new run directory and --persist URL."
                )


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily made state without changing any parameter.

    A fresh optimizer has no ``exp_avg`` and friends until its first step, so a saved
    state has nothing to be loaded into. One step with zero gradients and learning rate 0
    makes them; parameters keep their bits (``p - 0 * x == p``). Loading then overwrites
    the state it made.
    """
    params = [p for g in opt.param_groups for p in g["params"]]
    if not params or all(p in opt.state and opt.state[p] for p in params):
        return
    saved_lrs = [g["lr"] for g in opt.param_groups]
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    try:
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, saved_lrs, strict=True):
            g["lr"] = lr
        for p, grad in zip(params, saved_grads, strict=True):
            p.grad = grad


def restore_rng(rng: Mapping[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    np_state = rng["numpy"]
    np.random.set_state(tuple(np_state))
    py = rng["python"]
    random.setstate((py["version"], tuple(py["words"].tolist()), py["gauss"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(rng["cuda"]))


def load(
    state: MutableMapping[str, Any],
    tree: Mapping[str, Any],
    tensors: list[torch.Tensor],
    layout: Layout,
    *,
    what: str = "the snapshot",
    adopt: bool = False,
) -> None:
    """Load a flattened snapshot into ``state``: Stateful objects in place, plain values
    replaced in the dict, RNG states restored. Raises StateMismatchError on any misfit.

    ``adopt``: ``tensors`` are views of private memory this process keeps (a fetched
    step); the module's and optimizer's CPU tensors become those views instead of copies
    of them (a parameter keeps its identity: only its ``.data`` changes)."""
    missing = [k for k in state if k not in tree]
    if missing:
        raise StateMismatchError(
            f"state keys {missing} are not in {what} (it has {sorted(k for k in tree)}); "
            "pass the same state to job.steps() as the run that saved it"
        )
    adopt = adopt and _all_on_cpu(state)
    shared = _shared_storages(state) if adopt else frozenset()
    loader = _Loader(tensors, layout.entries, adopt, shared)
    for name, obj in state.items():
        saved = tree[name]
        if _is_stateful(obj):
            if not isinstance(saved, dict) or "__stateful__" not in saved:
                raise StateMismatchError(f"state[{name!r}] was a plain value in {what}")
            copies = isinstance(obj, torch.optim.Optimizer) and _takes_copies(obj)
            if (
                isinstance(obj, torch.optim.Optimizer)
                and saved["__stateful__"].get("state")
                and not copies
            ):
                init_optimizer_state(obj)
            loader.in_place = isinstance(obj, torch.nn.Module | torch.optim.Optimizer)
            value = loader.value(name, saved["__stateful__"], _templates(obj, adopt))
            try:
                obj.load_state_dict(value)
            except (RuntimeError, KeyError, ValueError) as e:
                raise StateMismatchError(f"state[{name!r}] does not load from {what}: {e}") from e
            if copies:
                _check_shapes(obj, name, what)
        else:
            state[name] = loader.value(name, saved, obj)
    if RNG_KEY in tree:
        restore_rng(loader.value(RNG_KEY, tree[RNG_KEY]))

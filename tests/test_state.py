"""Flattening training state into a layout plus a JSON tree, and loading it back bit for bit."""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import random
import struct
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tierswap.errors import NotSerializableError, StateMismatchError
from tierswap.state import Layout, flatten, load, make_layout, tensor_view

pytestmark = pytest.mark.timeout(60)

Snapshot = tuple[dict[str, Any], Layout, bytearray]


class Progress:
    """A user-defined Stateful: a data loader's position, with a tensor and int keys."""

    def __init__(self, n: int = 10) -> None:
        self.epoch = 0
        self.order = torch.arange(n)
        self.per_shard: dict[int, int] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "order": self.order, "per_shard": dict(self.per_shard)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch = sd["epoch"]
        self.order = sd["order"].clone()
        self.per_shard = dict(sd["per_shard"])


def _snapshot(state: MutableMapping[str, Any], *, with_rng: bool = True) -> Snapshot:
    """What a tier holds: the tree as stored JSON, the layout as stored JSON, the bytes."""
    flat = flatten(state, with_rng=with_rng)
    layout = make_layout(flat)
    buf = bytearray(layout.nbytes)
    for t, e in zip(flat.tensors, layout.entries, strict=True):
        tensor_view(memoryview(buf), e).copy_(t)
    tree = json.loads(json.dumps(flat.tree, allow_nan=False))
    return tree, Layout.from_json(json.loads(json.dumps(layout.to_json()))), buf


def _restore(state: MutableMapping[str, Any], snap: Snapshot) -> None:
    tree, layout, buf = snap
    load(state, tree, [tensor_view(memoryview(buf), e) for e in layout.entries], layout)


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    """Equal values of equal types, tensors and floats compared by their bits."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert torch.equal(a, b), path
        assert _raw(a) == _raw(b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a} != {b}"
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert a.tobytes() == b.tobytes(), path
    else:
        assert a == b, path


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _plain() -> dict[str, Any]:
    return {
        "count": 7,
        "best": float("inf"),
        "worst": float("-inf"),
        "undefined": float("nan"),
        "neg_zero": -0.0,
        "name": "run-α",
        "blob": b"\x00\xff\x80pickle",
        "pair": (1, "a", (2.5, None)),
        "by_id": {1: "one", 2: (3.5,), -7: [True, False]},
        "by_pair": {(1, 2): "x"},
        "escaped": {"__t__": 0, "__bytes__": "AA==", "plain": 1},
        "table": np.arange(6, dtype=np.float32).reshape(2, 3) / 3,
        "ids": np.array([[1, -2]], dtype=np.int16),
        "big": 2**70,
    }


def test_round_trip_is_bit_identical_into_fresh_objects() -> None:
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    progress = Progress()
    progress.epoch, progress.order, progress.per_shard = 3, torch.randperm(10), {0: 5, 3: 9}
    state: dict[str, Any] = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "progress": progress,
        **_plain(),
    }
    snap = _snapshot(state)

    model2 = _model(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)  # no state yet
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    assert not opt2.state
    fresh: dict[str, Any] = {
        "model": model2,
        "optim": opt2,
        "sched": sched2,
        "progress": Progress(),
        **{k: None for k in _plain()},
    }
    _restore(fresh, snap)

    _assert_same(model.state_dict(), model2.state_dict(), "model")
    _assert_same(opt.state_dict(), opt2.state_dict(), "optim")
    _assert_same(sched.state_dict(), sched2.state_dict(), "sched")
    _assert_same(progress.state_dict(), fresh["progress"].state_dict(), "progress")
    for k, v in _plain().items():
        _assert_same(v, fresh[k], k)
    assert math.isnan(fresh["undefined"]) and fresh["by_id"][-7] == [True, False]


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer, Snapshot, torch.Tensor]:
    """A model and optimizer one step in, its snapshot, then a second step on ``x2``."""
    x1, x2 = torch.randn(8, 4), torch.randn(8, 4)
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, x1)
    snap = _snapshot({"model": model, "optim": opt})
    _train_step(model, opt, x2)
    return model, opt, snap, x2


def test_training_continues_identically_after_restore() -> None:
    model, opt, snap, x2 = _trained()
    step = _train_step
    model2 = _model(5)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    _restore({"model": model2, "optim": opt2}, snap)
    step(model2, opt2, x2)
    _assert_same(model.state_dict(), model2.state_dict())
    _assert_same(opt.state_dict(), opt2.state_dict())


def _adopting(state: MutableMapping[str, Any], snap: Snapshot) -> memoryview:
    """Load ``snap`` as a fetched step is loaded: from this process's own memory, kept."""
    tree, layout, buf = snap
    mem = memoryview(bytearray(buf))
    load(state, tree, [tensor_view(mem, e) for e in layout.entries], layout, adopt=True)
    return mem


def _inside(t: torch.Tensor, mem: memoryview) -> bool:
    start = torch.frombuffer(mem, dtype=torch.uint8).data_ptr()
    return start <= t.data_ptr() < start + len(mem)


def test_an_adopting_load_points_the_live_tensors_at_the_fetched_bytes() -> None:
    model, opt, snap, x2 = _trained()
    with torch.device("meta"):  # built without values: the load gives every one
        model2 = _model(5)
    model2 = model2.to_empty(device="cpu")
    params = list(model2.parameters())
    opt2 = torch.optim.AdamW(params, lr=1e-2)
    mem = _adopting({"model": model2, "optim": opt2}, snap)
    assert [id(p) for p in model2.parameters()] == [id(p) for p in params], "same Parameters"
    assert all(_inside(p, mem) for p in params), "no copy: the fetched bytes are the weights"
    moments = [v for st in opt2.state.values() for v in st.values() if v.dim() > 0]
    assert moments and all(_inside(v, mem) for v in moments)
    _train_step(model2, opt2, x2)
    _assert_same(model.state_dict(), model2.state_dict())
    _assert_same(opt.state_dict(), opt2.state_dict())


def test_an_adopting_load_copies_into_a_parameter_that_views_a_flat_buffer() -> None:
    model = _model(0)
    snap = _snapshot({"model": model})
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    model2 = _model(5)
    at = 0
    for p in model2.parameters():  # every parameter a view into one buffer (as apex does)
        p.data = flat[at : at + p.numel()].view_as(p)
        at += p.numel()
    mem = _adopting({"model": model2}, snap)
    assert not any(_inside(p, mem) for p in model2.parameters())
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    _assert_same(model.state_dict(), model2.state_dict())


def test_an_adopting_load_keeps_tied_tensors_tied() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    snap = _snapshot({"model": model})
    model2 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model2[1].weight = nn.Parameter(model2[0].weight.data)  # two Parameters, one storage
    _adopting({"model": model2}, snap)
    assert model2[0].weight.data_ptr() == model2[1].weight.data_ptr(), "still one storage"
    assert torch.equal(model2[1].weight, model[1].weight)


def _draws() -> tuple[list[float], list[float], float]:
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), random.random()


def test_rng_states_are_restored() -> None:
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    _draws()
    snap = _snapshot({})
    expected = _draws()
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    assert _draws() != expected
    _restore({}, snap)
    assert _draws() == expected


def test_changed_shape_names_key_and_both_shapes() -> None:
    snap = _snapshot({"model": nn.Linear(4, 8)}, with_rng=False)
    with pytest.raises(StateMismatchError, match=r"'model/weight'.*F32\[8, 4\].*F32\[9, 4\]"):
        _restore({"model": nn.Linear(4, 9)}, snap)


def test_changed_dtype_names_both_dtypes() -> None:
    snap = _snapshot({"model": nn.Linear(2, 2)}, with_rng=False)
    with pytest.raises(StateMismatchError, match=r"'model/weight'.*F32\[2, 2\].*F64\[2, 2\]"):
        _restore({"model": nn.Linear(2, 2).double()}, snap)


def test_missing_state_key_is_named() -> None:
    snap = _snapshot({"model": nn.Linear(2, 2)}, with_rng=False)
    with pytest.raises(StateMismatchError, match=r"\['ema'\] are not in"):
        _restore({"model": nn.Linear(2, 2), "ema": nn.Linear(2, 2)}, snap)


def test_stateful_saved_as_plain_value_is_a_mismatch() -> None:
    snap = _snapshot({"model": 3}, with_rng=False)
    with pytest.raises(StateMismatchError, match="state\\['model'\\] was a plain value"):
        _restore({"model": nn.Linear(2, 2)}, snap)


class _Holder:
    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"inner": [1, self.value]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["inner"][1]


@pytest.fixture
def open_file() -> Iterator[Any]:
    with open(os.devnull) as f:
        yield f


@pytest.mark.parametrize(
    ("make", "path", "kind"),
    [
        (lambda f: {"cfg": {"hook": lambda x: x}}, "cfg/hook", "function"),
        (lambda f: {"log": f}, "log", "TextIOWrapper"),
        (lambda f: {"user": _Holder(f)}, "user/inner/1", "TextIOWrapper"),
        (lambda f: {"buf": bytearray(b"x")}, "buf", "bytearray"),
        pytest.param(
            lambda f: {"opt": {"z": torch.zeros(2, dtype=torch.complex64)}},
            "opt/z",
            "complex64",
        ),
    ],
)
def test_not_serializable_names_the_path(make: Any, path: str, kind: str, open_file: Any) -> None:
    with pytest.raises(NotSerializableError, match=kind) as info:
        flatten(make(open_file))
    assert f"'{path}'" in str(info.value)
    assert isinstance(info.value, TypeError)


class _Boom:
    """Unpickling this creates a marker file: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_pickle_payloads_load_as_plain_data(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Boom(marker))
    tree = {
        "note": payload.decode("latin-1"),
        "blob": {"__bytes__": base64.b64encode(payload).decode()},
        "nested": {"__reduce__": payload.decode("latin-1")},
    }
    state: dict[str, Any] = {"note": None, "blob": None, "nested": None}
    load(state, json.loads(json.dumps(tree)), [], Layout(entries=(), nbytes=1))
    assert state["note"] == payload.decode("latin-1")
    assert state["blob"] == payload
    assert state["nested"] == {"__reduce__": payload.decode("latin-1")}
    assert not marker.exists()
    pickle.loads(payload)  # the payload is live: unpickling it would have run code
    assert marker.exists()


def _entry(**over: Any) -> dict[str, Any]:
    return {"key": "w", "dtype": "F32", "shape": [4], "offset": 0, "nbytes": 16, **over}


@pytest.mark.parametrize(
    "entry",
    [
        _entry(offset=8),  # runs past the end of the 16-byte buffer
        _entry(shape=[8], nbytes=32),  # larger than the buffer
        _entry(nbytes=8),  # nbytes does not match the shape
        _entry(offset=-4),
        _entry(shape=[2**62, 4], nbytes=0),  # overflowing element count
    ],
)
def test_layout_from_json_rejects_entries_that_do_not_fit(entry: dict[str, Any]) -> None:
    with pytest.raises(StateMismatchError, match="'w' does not fit its buffer"):
        Layout.from_json({"nbytes": 16, "entries": [entry]})


@pytest.mark.parametrize("entry", [_entry(shape=[-1], nbytes=-4), _entry(shape=[-2, -2])])
def test_layout_from_json_rejects_negative_dimensions(entry: dict[str, Any]) -> None:
    with pytest.raises(StateMismatchError):
        Layout.from_json({"nbytes": 16, "entries": [entry]})


def test_layout_from_json_rejects_unknown_dtype() -> None:
    with pytest.raises(StateMismatchError, match="unknown tensor dtype 'C64'"):
        Layout.from_json({"nbytes": 16, "entries": [_entry(dtype="C64")]})


def test_layout_is_aligned_and_views_alias_the_buffer() -> None:
    snap = _snapshot({"a": torch.ones(3), "b": torch.arange(5), "e": torch.zeros(0)})
    _, layout, buf = snap
    assert all(e.offset % 64 == 0 for e in layout.entries)
    view = tensor_view(memoryview(buf), layout.entries[0])
    view.fill_(2.0)
    assert bytes(buf[:12]) == struct.pack("<3f", 2.0, 2.0, 2.0)


def test_stateful_tensor_of_another_shape_loads_into_fresh_object() -> None:
    # a data loader's shuffled order: a fresh loader does not know the saved length yet
    saved = Progress(10)
    saved.order = torch.randperm(10)
    snap = _snapshot({"progress": saved}, with_rng=False)
    fresh = Progress(0)
    _restore({"progress": fresh}, snap)
    _assert_same(saved.order, fresh.order)


def test_numpy_array_with_nan_is_strict_json() -> None:
    snap = _snapshot({"a": np.array([np.nan, np.inf, 1.0])}, with_rng=False)
    state: dict[str, Any] = {"a": None}
    _restore(state, snap)
    _assert_same(np.array([np.nan, np.inf, 1.0]), state["a"])


def test_the_layouts_item_sizes_are_torchs() -> None:
    from tierswap import layout, state

    assert {code: d.itemsize for d, code in state._DTYPES.items()} == layout.ITEMSIZE

"""Tier 2: durable parts, commits, verification, retention and export."""

from __future__ import annotations

import json
import os
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import safetensors
import torch
from safetensors.torch import load_file

from tierswap.checksum import checksum_chunks
from tierswap.errors import CorruptPartError
from tierswap.state import Flat, Layout, TensorEntry, dtype_code, make_layout, tensor_view
from tierswap.tiers import catalog, durable
from tierswap.tiers.durable import PartInfo
from tierswap.tiers.export import export

pytestmark = pytest.mark.timeout(60)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model/w": torch.randn(3, 5, generator=g),
        "model/half": torch.randn(7, generator=g).to(torch.bfloat16),
        "opt/step": torch.arange(3, dtype=torch.int64),
        "opt/mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }


def _slot(
    tensors: dict[str, torch.Tensor], dist: dict[str, tuple[Any, ...]] | None = None
) -> tuple[Layout, dict[str, Any], memoryview]:
    """A tier-0-like slot: tensors at 64-byte aligned offsets (with gaps) in one buffer.

    ``dist`` maps a key to (global_shape, placements, mesh_coord) for a DTensor shard."""
    entries = []
    for key, t in tensors.items():
        gs, pl, mc = (dist or {}).get(key, (None, None, None))
        entries.append(
            TensorEntry(
                key,
                dtype_code(t.dtype),
                tuple(t.shape),
                0,
                t.numel() * t.element_size(),
                global_shape=gs,
                placements=pl,
                mesh_coord=mc,
            )
        )
    tree = {"tensors": {k: {"__t__": i} for i, k in enumerate(tensors)}, "epoch": 3}
    layout = make_layout(Flat(tree=tree, tensors=list(tensors.values()), entries=entries))
    buf = memoryview(bytearray(layout.nbytes))
    for e, t in zip(layout.entries, tensors.values(), strict=True):
        tensor_view(buf, e).copy_(t)
    return layout, tree, buf


def _write(
    root: str,
    step: int,
    world: int = 2,
    commit: bool = True,
    tensors: dict[str, torch.Tensor] | None = None,
) -> dict[int, PartInfo]:
    parts = {}
    for rank in range(world):
        layout, tree, buf = _slot(_tensors() if tensors is None else tensors)
        cs = checksum_chunks(layout.chunks(buf))
        parts[rank] = durable.write_part(root, step, rank, world, layout, tree, buf, cs)
    if commit:
        durable.write_commit(root, step, world, parts)
    return parts


def _assert_same(layout: Layout, buf: bytearray, want: dict[str, torch.Tensor]) -> None:
    assert [e.key for e in layout.entries] == list(want)
    for e in layout.entries:
        got = tensor_view(memoryview(buf), e)
        assert got.dtype == want[e.key].dtype and got.shape == want[e.key].shape
        assert torch.equal(got, want[e.key])


@pytest.fixture(params=["file", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "file":
        yield str(tmp_path / "ckpt")
        return
    url = f"memory://tierswap-test-{uuid.uuid4().hex}"
    yield url
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_round_trip_same_bytes(root: str) -> None:
    parts = _write(root, 100)
    world, committed = durable.read_commit(root, 100)
    assert world == 2 and committed == parts
    for rank in range(2):
        layout, tree, buf = durable.read_part(root, 100, rank, expected=committed[rank])
        _assert_same(layout, buf, _tensors())
        assert tree["epoch"] == 3 and len(buf) == layout.data_nbytes == parts[rank].nbytes
    assert catalog.verify(root) == []
    fs, path = fsspec.core.url_to_fs(root)
    assert fs.cat_file(f"{path}/LATEST").decode().strip() == "100"


def test_safetensors_library_reads_a_part(tmp_path: Path) -> None:
    root = str(tmp_path)
    _write(root, 7, world=1)
    path = tmp_path / "step-000000007" / "rank-00000.safetensors"
    loaded = load_file(str(path))
    assert loaded.keys() == _tensors().keys()
    for key, t in _tensors().items():
        assert torch.equal(loaded[key], t)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "tierswap-1", "step": "7", "rank": "0"}


def test_truncated_and_flipped_parts_are_named(tmp_path: Path) -> None:
    root = str(tmp_path)
    _write(root, 1)
    part1 = tmp_path / "step-000000001" / "rank-00001.safetensors"
    part1.write_bytes(part1.read_bytes()[:-5])
    with pytest.raises(CorruptPartError) as err:
        durable.read_part(root, 1, 1)
    assert err.value.where.endswith("rank-00001.safetensors")
    problems = catalog.verify(root)
    assert len(problems) == 1 and "rank-00001.safetensors" in problems[0]

    _write(root, 2)
    part0 = tmp_path / "step-000000002" / "rank-00000.safetensors"
    raw = bytearray(part0.read_bytes())
    raw[-3] ^= 0x01
    part0.write_bytes(bytes(raw))
    with pytest.raises(CorruptPartError, match="data checksum mismatch"):
        durable.read_part(root, 2, 0)
    problems = catalog.verify(root, 2)
    assert len(problems) == 1 and "step-000000002/rank-00000.safetensors" in problems[0]


def test_missing_and_mismatched_parts(tmp_path: Path) -> None:
    root = str(tmp_path)
    parts = _write(root, 3)
    (tmp_path / "step-000000003" / "rank-00000.json").unlink()
    with pytest.raises(CorruptPartError, match="missing"):
        durable.read_part(root, 3, 0)
    other = PartInfo(1, "0" * 16, parts[1].json, parts[1].nbytes)
    with pytest.raises(CorruptPartError, match="COMMIT"):
        durable.read_part(root, 3, 1, expected=other)
    assert any("rank-00000.json: missing" in p for p in catalog.verify(root))


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_pickle_payloads_never_run(tmp_path: Path) -> None:
    root = str(tmp_path)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Evil(marker))
    _write(root, 5, world=1)
    folder = tmp_path / "step-000000005"
    # A tree holding a pickle payload as a string is read back as that string.
    meta = json.loads((folder / "rank-00000.json").read_text())
    meta["tree"]["evil"] = payload.decode("latin-1")
    (folder / "rank-00000.json").write_text(json.dumps(meta))
    _, tree, _ = durable.read_part(root, 5, 0)
    assert tree["evil"].encode("latin-1") == payload
    # A tensor file that is a pickle is rejected.
    (folder / "rank-00000.safetensors").write_bytes(payload)
    with pytest.raises(CorruptPartError):
        durable.read_part(root, 5, 0)
    assert catalog.verify(root) and not marker.exists()


def test_list_steps_shows_uncommitted(root: str) -> None:
    assert catalog.list_steps(root + "/nowhere") == []
    _write(root, 10)
    _write(root, 20, commit=False)
    steps = catalog.list_steps(root)
    assert [(s.step, s.committed, s.present_ranks) for s in steps] == [
        (10, True, [0, 1]),
        (20, False, [0, 1]),
    ]
    assert steps[0].world_size == 2 and steps[0].nbytes > 0 and not steps[1].parts
    assert catalog.committed_steps(root) == [10]
    assert catalog.verify(root, 20) and catalog.verify(root) == []


def test_retain_keeps_newest_committed(root: str) -> None:
    for step in (1, 2, 3, 5, 6):
        _write(root, step, world=1)
    _write(root, 4, world=1, commit=False)
    _write(root, 7, world=1, commit=False)
    with pytest.raises(ValueError, match="keep"):
        catalog.retain(root, 0)
    assert catalog.retain(root, 2) == [1, 2, 3, 4]
    assert [s.step for s in catalog.list_steps(root)] == [5, 6, 7]
    assert catalog.retain(root, 1) == [5]
    assert catalog.committed_steps(root) == [6]
    assert catalog.retain(root, 1) == []


def test_write_commit_refuses_missing_ranks(tmp_path: Path) -> None:
    parts = _write(str(tmp_path), 1, world=2, commit=False)
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        durable.write_commit(str(tmp_path), 1, 2, {0: parts[0]})
    assert catalog.committed_steps(str(tmp_path)) == []


def test_export_merges_shards_and_dedups(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    full = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    cols = torch.arange(12, dtype=torch.int64).reshape(2, 6)
    shared = torch.ones(3, dtype=torch.bfloat16)
    pieces = [(full[:3], cols[:, :3]), (full[3:], cols[:, 3:])]  # uneven, like torch.chunk
    parts = {}
    for rank, (rows, colp) in enumerate(pieces):
        dist = {
            "w": ((5, 4), ("S(0)",), (rank,)),
            "c": ((2, 6), ("Shard(dim=1)",), (rank,)),
            "r": ((3,), ("Replicate()",), (rank,)),
        }
        ts = {"w": rows, "c": colp, "r": shared, "b": shared, "seed": torch.tensor([rank])}
        layout, tree, buf = _slot(ts, dist)
        cs = checksum_chunks(layout.chunks(buf))
        parts[rank] = durable.write_part(root, 9, rank, 2, layout, tree, buf, cs)
    durable.write_commit(root, 9, 2, parts)
    out = tmp_path / "export" / "model.safetensors"
    summary = export(root, 9, out)
    got = load_file(str(out))
    assert set(got) == {"w", "c", "r", "b", "rank0/seed", "rank1/seed"}
    assert torch.equal(got["w"], full) and torch.equal(got["c"], cols)
    assert torch.equal(got["r"], shared) and torch.equal(got["b"], shared)
    assert got["rank1/seed"].tolist() == [1]
    assert summary["tensors"] == 6 and summary["per_rank"] == 2
    state = json.loads(out.with_suffix(".json").read_text())
    assert state["world_size"] == 2 and state["step"] == 9
    assert state["ranks"]["1"]["tensors"] == ["w", "c", "r", "b", "rank1/seed"]
    assert state["ranks"]["0"]["tree"]["epoch"] == 3


def test_probe_writable(tmp_path: Path) -> None:
    assert catalog.probe_writable(str(tmp_path / "new" / "dir")) is None
    assert os.listdir(tmp_path / "new" / "dir") == []
    (tmp_path / "file").write_text("x")
    assert catalog.probe_writable(str(tmp_path / "file" / "sub")) is not None
    assert catalog.probe_writable(f"memory://probe-{uuid.uuid4().hex}") is None


# ---------------------------------------------------------------- incremental tier 2


def _changed(step: int) -> dict[str, torch.Tensor]:
    """``_tensors()`` after ``step`` small updates of one value."""
    t = {k: v.clone() for k, v in _tensors().items()}
    t["model/w"][0, 0] += 0.01 * step
    return t


def _write_delta(root: str, step: int, base_step: int, world: int = 2) -> dict[int, PartInfo]:
    """Delta parts of ``_changed(step)`` against ``_tensors()`` written at ``base_step``."""
    from tierswap import delta
    from tierswap.tiers.durable_deltas import contiguous

    parts = {}
    for rank in range(world):
        blayout, _, bbuf = _slot(_tensors())
        layout, tree, buf = _slot(_changed(step))
        d = delta.encode(contiguous(blayout, bbuf), contiguous(layout, buf))
        cs = checksum_chunks(layout.chunks(buf))
        base_cs = checksum_chunks(blayout.chunks(bbuf))
        parts[rank] = durable.write_delta_part(
            root, step, rank, world, layout, tree, cs, base_step, d.to_bytes(), base_cs
        )
    durable.write_commit(root, step, world, parts)
    return parts


def test_delta_parts_rebuild_bit_for_bit_and_are_listed_with_their_base(root: str) -> None:
    _write(root, 10)
    parts = _write_delta(root, 12, base_step=10)
    assert {p.base for p in parts.values()} == {10}
    for rank in range(2):
        layout, tree, buf = durable.read_part(root, 12, rank, expected=parts[rank])
        _assert_same(layout, buf, _changed(12))
        assert tree["epoch"] == 3
    assert catalog.verify(root) == []
    (s10, s12) = catalog.list_steps(root)
    assert s10.restorable and s12.restorable and s12.bases == {10} and s12.present_ranks == [0, 1]
    assert catalog.restorable_steps(root) == [10, 12]


def test_a_delta_whose_base_is_gone_is_never_restorable(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    _write(root, 10)
    _write_delta(root, 12, base_step=10)
    (tmp_path / "ckpt" / "step-000000010" / "COMMIT").unlink()
    (_, s12) = catalog.list_steps(root)
    assert s12.committed and not s12.restorable and s12.missing_bases == (10,)
    assert catalog.restorable_steps(root) == []
    from tierswap.control.ports import DurableRoot

    assert DurableRoot(root).restorable_steps(2) == frozenset(), "the planner never sees it"
    problems = catalog.verify(root, 12)
    assert problems and all("its base, step 10, is gone" in p for p in problems)
    with pytest.raises(CorruptPartError, match="is gone"):
        durable.read_part(root, 12, 0)


def test_a_corrupt_delta_part_is_named(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    _write(root, 10)
    _write_delta(root, 12, base_step=10)
    path = tmp_path / "ckpt" / "step-000000012" / "rank-00001.delta"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    (problem,) = catalog.verify(root, 12)
    assert "rank-00001.delta" in problem and "delta checksum mismatch" in problem


def test_retain_keeps_the_bases_kept_deltas_need(root: str) -> None:
    _write(root, 10)
    _write_delta(root, 12, base_step=10)
    _write_delta(root, 14, base_step=10)
    _write(root, 16, commit=False)
    assert catalog.retain(root, keep=1) == [12]
    assert [s.step for s in catalog.list_steps(root)] == [10, 14, 16]
    assert catalog.restorable_steps(root) == [10, 14]


def test_export_of_a_delta_step_equals_the_full_one(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write(a, 10)
    _write_delta(a, 12, base_step=10)
    _write(b, 12, tensors=_changed(12))
    export(a, 12, tmp_path / "a.safetensors")
    export(b, 12, tmp_path / "b.safetensors")
    ta, tb = load_file(str(tmp_path / "a.safetensors")), load_file(str(tmp_path / "b.safetensors"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_durable_bases_write_full_then_deltas_and_renew(tmp_path: Path) -> None:
    from tierswap.tiers.durable_deltas import DurableBases, Part
    from tierswap.tiers.memory import Slot

    root = str(tmp_path / "ckpt")
    writer = DurableBases(base_every=4, threshold=0.5)

    def write(
        step: int, committed: dict[int, dict[int, str]], tensors: dict[str, torch.Tensor]
    ) -> PartInfo:
        layout, tree, buf = _slot(tensors)
        slot = Slot(0, None, step=step, checksum=checksum_chunks(layout.chunks(buf)), tree=tree)  # type: ignore[arg-type]
        slot.segment = type("Seg", (), {"buf": buf})()  # type: ignore[assignment]
        return writer.write(Part(root, step, 0, 1, layout, slot, 0), committed)

    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(1))

    def state(step: int) -> dict[str, torch.Tensor]:
        changed = w.clone()
        changed[0, :step] += 0.01
        return {"w": changed, "n": torch.tensor([step])}

    assert write(1, {}, state(1)).base is None, "no base yet: full"
    two = write(2, {}, state(2))
    assert two.base is None, "its base not committed: full again"
    durable.write_commit(root, 2, 1, {0: two})
    three = write(3, {2: {0: "another checksum"}}, state(3))
    assert three.base is None, "step 2 in tier 2 is not these bytes: full"
    durable.write_commit(root, 3, 1, {0: three})
    assert write(4, {3: {0: three.data}}, state(4)).base == 3
    seven = write(7, {3: {0: three.data}}, state(7))
    assert seven.base is None, "base_every steps later: a new base"
    durable.write_commit(root, 7, 1, {0: seven})
    noise = {"w": w + torch.rand(w.shape), "n": torch.tensor([8])}
    assert write(8, {7: {0: seven.data}}, noise).base is None, "past the threshold: full"
    layout, _, buf = durable.read_part(root, 4, 0)
    assert torch.equal(tensor_view(buf, layout.entries[0]), state(4)["w"])


def test_ls_names_each_delta_steps_base_and_one_that_is_gone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tierswap import cli

    root = str(tmp_path / "ckpt")
    _write(root, 10)
    _write_delta(root, 12, base_step=10)
    with pytest.raises(SystemExit) as done:
        cli.main(["ls", root])
    assert done.value.code == 0
    assert "deltas of step 10" in capsys.readouterr().out
    (tmp_path / "ckpt" / "step-000000010" / "COMMIT").unlink()
    with pytest.raises(SystemExit):
        cli.main(["ls", root])
    out = capsys.readouterr().out
    assert "NOT restorable" in out and "base 10 is gone" in out


def test_a_delta_on_a_rewritten_base_step_is_refused(tmp_path: Path) -> None:
    """Step 10 written again by another timeline: a delta made on the old bytes is bad."""
    root = str(tmp_path / "ckpt")
    _write(root, 10)
    _write_delta(root, 12, base_step=10)
    _write(root, 10, tensors=_changed(5))
    with pytest.raises(CorruptPartError, match="was rewritten"):
        durable.read_part(root, 12, 0)

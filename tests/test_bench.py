"""`tierswap bench snapshot`: every section measured, every resource given back."""

from __future__ import annotations

import argparse
import json
import math
import secrets
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tierswap import bench
from tierswap.bench.rig import BenchHolding, Holding, Rig
from tierswap.checksum import checksum_chunks
from tierswap.shm import PREFIX, SHM_DIR
from tierswap.state import flatten


def _bench_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{PREFIX}bench-*")}


@pytest.mark.timeout(240)
def test_bench_snapshot_writes_every_section_and_cleans_up(tmp_path: Path) -> None:
    before = _bench_segments()
    threads = torch.get_num_threads()
    out = tmp_path / "bench.json"
    args = argparse.Namespace(what="snapshot", size_mib=8, repeats=2, json=str(out))

    assert bench.main(args) == 0

    res = json.loads(out.read_text())
    assert res["machine"]["cpu_count"] >= 1 and res["machine"]["torch"]
    blocking = res["blocking"]
    timed = [blocking[m]["blocking"] for m in ("tierswap", "torch_save", "dcp_save")]
    timed += [blocking["dcp_async_save"]["blocking"], blocking["tierswap"]["take"]]
    timed += [blocking["tierswap"]["copy"], blocking["dcp_async_save"]["total"]]
    timed += [res["copy"][m]["bps"] for m in ("snapshot", "copy_")]
    timed += [res["write"][m]["bps"] for m in ("write_part", "sequential")]
    stepped = []
    for key in ("threads_1", "threads_all"):
        step = res["step"][key]
        stepped += [step["with_snapshot"]["step_s"], step["with_snapshot"]["stall_s"]]
        stepped += [step["without"]["step_s"]]
        assert math.isfinite(step["overhead"]["median"])
    assert res["step"]["pairs"] == 4 * 2  # section 4 runs 4 A/B pairs per repeat
    for stats in timed + stepped:
        assert len(stats["samples"]) == (8 if any(stats is x for x in stepped) else 2)
        assert stats["q1"] <= stats["median"] <= stats["q3"], stats
        assert stats["min"] > 0 and stats["median"] > 0, stats
    assert blocking["tierswap"]["fence"]["min"] >= 0
    ratios = res["ratios"]
    assert set(ratios) >= set(bench.TARGETS) | {"tierswap/dcp_async_save"}
    assert all(v > 0 for k, v in ratios.items() if not k.startswith("step_overhead"))
    assert not list(SHM_DIR.glob(f"{PREFIX}{res['config']['job_id']}-*"))
    assert _bench_segments() <= before
    assert not Path(res["config"]["disk_dir"]).exists()
    assert not dist.is_initialized()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tierswap-")]
    assert torch.get_num_threads() == threads


@pytest.mark.timeout(60)
def test_rig_slot_holds_the_state_as_the_agent_checksummed_it() -> None:
    state = bench.make_state(1)
    with tempfile.TemporaryDirectory(prefix="tierswap-rig-") as tmp:
        rig = Rig(f"rig-{secrets.token_hex(4)}")
        try:
            rig.start(Path(tmp))
            rig.take(state)
            rig.snapshotter.fence()
            reply = rig.call(BenchHolding(step=rig.step), Holding)
            alloc = rig.snapshotter._alloc
            assert alloc is not None
            slot = reply.slot
            buf = alloc.segments[slot].buf
            assert checksum_chunks(alloc.layout.chunks(buf)) == reply.checksum
            flat = flatten(state, with_rng=False)
            pairs = zip(alloc.layout.entries, alloc.slot_views(slot), strict=True)
            views = {e.key: v for e, v in pairs}
            for entry, t in zip(flat.entries, flat.tensors, strict=True):
                assert torch.equal(views[entry.key], t), entry.key
        finally:
            rig.close()


@pytest.mark.timeout(240)
def test_bench_dcp_measures_exports_and_a_resharding_restore(tmp_path: Path) -> None:
    out = tmp_path / "dcp.json"
    args = argparse.Namespace(what="dcp", size_mib=1, repeats=1, json=str(out))
    assert bench.main(args) == 0
    res = json.loads(out.read_text())
    export = res["export"]
    for name in ("write_fsync", "tier2_read", "export_dcp", "export_hf"):
        assert export[name]["bps"]["median"] > 0 and len(export[name]["seconds"]["samples"]) == 1
    assert set(export["ratios"]) == {f"{n}/{b}" for n in ("export_dcp", "export_hf")
                                     for b in ("tier2_read", "write_fsync")}  # fmt: skip
    reshard = res["reshard"]
    assert reshard["same_2_to_2"]["exact"] == reshard["reshard_2_to_4"]["exact"] == "1/1"
    assert reshard["ratio"] > 0
    assert not list(Path(tempfile.gettempdir()).glob("tierswap-bench-dcp-*"))

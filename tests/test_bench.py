"""`tierswap bench snapshot`: every section measured, every resource given back."""

from __future__ import annotations

import argparse
import json
import math
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tierswap import bench
from tierswap.shm import PREFIX, SHM_DIR


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
    for key in ("threads_1", "threads_all"):
        step = res["step"][key]
        timed += [step["with_snapshot"]["step_s"], step["with_snapshot"]["stall_s"]]
        timed += [step["without"]["step_s"]]
        assert math.isfinite(step["overhead"]["median"])
    for stats in timed:
        assert len(stats["samples"]) == 2
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

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
            rig.snapshotter.drain()
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


# ---------------------------------------------------------------- make gpu-check, its CPU side


def test_gpu_check_sizes_its_model_to_dev_shm_and_reads_pytests_summary() -> None:
    from tierswap.bench import gpu

    layers, width = gpu.model_size(64 * 2**30, slots=4)
    assert (layers, width) == (23, 1024), "about 300 M parameters where /dev/shm holds them"
    layers, width = gpu.model_size(64 * 2**20, slots=4)  # a container's default 64 MiB
    assert 12 * gpu.gpt_params(layers, width) * 4 <= 64 * 2**20, (layers, width)
    assert gpu.summary_counts("..s\n3 passed, 1 skipped in 2.10s\n") == {"passed": 3, "skipped": 1}
    assert gpu.summary_counts("== 1 failed, 2 passed, 1 error in 9s ==") == {
        "failed": 1, "passed": 2, "error": 1,
    }  # fmt: skip


def test_gpu_check_table_names_every_section_and_every_verdict() -> None:
    from tierswap.bench import gpu

    ab = {
        "with_snapshot": {"step_s": {"median": 0.105}, "stall_s": {"median": 0.0004}},
        "without": {"step_s": {"median": 0.100}},
        "overhead": {"median": 0.05},
    }
    res = {
        "env": {"torch": "2.11.0", "cuda": "13.0", "dev_shm": {"free": 2**36},
                "device": {"name": "NVIDIA H200"}},
        "cuda_tests": {"code": 0, "counts": {"passed": 4}},
        "snapshot": {"params": 302_000_000, "state_bytes": 12 * 302_000_000, "pairs": 6,
                     "ab": ab, "copy_gbps": 20.0, "pinned_copy": {"gbps": 25.0}},
        "jobs": {"gloo_worker_kill": {"bit_exact": True, "forked": True}, "section_s": 80.0,
                 "gloo_node_kill": {"bit_exact": True, "forked": False},
                 "nccl_worker_kill": {"error": "RuntimeError: exited with code 1"},
                 "gloo_node_kill_spare": {"bit_exact": False, "differing": ["rank-1: x"]}},
    }  # fmt: skip
    text = gpu.table(res)
    assert "NVIDIA H200, torch 2.11.0, CUDA 13.0" in text and "4 passed" in text
    assert "100.0 ms without, 105.0 ms with (+5.0%, median of 6 A/B pairs)" in text
    assert "0.40 ms a step (0.40% of it)" in text and "(0.80x)" in text
    lines = dict(line.split(None, 1) for line in text.splitlines())
    assert lines["gloo_worker_kill"].strip() == "bit for bit, workers forked"
    assert lines["gloo_node_kill"].strip() == "bit for bit, workers started alone"
    assert "exited with code 1" in lines["nccl_worker_kill"]
    assert "DIFFERS" in lines["gloo_node_kill_spare"] and "section_s" not in lines
    assert "OSError: no room" in gpu.table({"env": {}, "snapshot": {"error": "OSError: no room"}})


def test_gpu_check_without_a_gpu_says_so_and_fails() -> None:
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: make gpu-check runs for real")
    done = subprocess.run(
        [sys.executable, "-m", "tierswap.cli", "bench", "gpu-check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr


def test_gpu_check_snapshot_section_runs_tiny_on_the_cpu() -> None:
    """The section's code path (model, A/B blocks through the real agent, the figures the
    table reads), on the CPU at 1 M parameters so that it cannot rot where no GPU is."""
    from tierswap.bench import gpu

    before = _bench_segments()
    res = gpu.snapshot(2**30, pairs=1, device="cpu", want_params=1_000_000, batch=1)
    assert res["params"] < 2_000_000 and res["skipped"] == 0
    assert res["ab"]["with_snapshot"]["stall_s"]["median"] >= 0 and res["copy_gbps"] > 0
    assert "trainer stall" in gpu.table({"env": {}, "snapshot": res})
    assert _bench_segments() == before


def test_gpu_check_fails_on_any_section_that_did_not_pass() -> None:
    from tierswap.bench import gpu

    good = {
        "env": {}, "cuda_tests": {"code": 0, "collected": 4, "counts": {"passed": 4}},
        "snapshot": {"skipped": 0}, "jobs": {"a": {"bit_exact": True}, "section_s": 1.0},
    }  # fmt: skip
    assert gpu.failures(good) == []
    for broken in (
        {"cuda_tests": {"error": "pytest ran past its 150 s deadline"}},
        {"cuda_tests": {"skipped": "tests/test_cuda.py is not here"}},
        {"cuda_tests": {"code": 1, "collected": 4, "counts": {"failed": 1, "passed": 3}}},
        # pytest's exit code is 0 where every test was skipped (no CUDA seen by them)
        {"cuda_tests": {"code": 0, "collected": 4, "counts": {"skipped": 4}}},
        {"cuda_tests": {"code": 0, "collected": 4, "counts": {"passed": 3, "skipped": 1}}},
        {"cuda_tests": {"code": 0, "collected": 4, "counts": {"passed": 3}}},
        {"cuda_tests": {"code": 5, "collected": 0, "counts": {}}},
        {"cuda_tests": {"code": 0, "collected": None, "counts": {"passed": 4}}},
        {"snapshot": {"error": "OSError: no room"}},
        {"snapshot": {"skipped": 3}},
        {"snapshot": {"skipped": 0, "copy_skipped": 1}},
        {"jobs": {"error": "RuntimeError: boom"}},
        {"jobs": {"a": {"bit_exact": False, "differing": ["rank-0: x"]}}},
        {"jobs": {"a": {"error": "exited with code 1"}}},
    ):
        assert gpu.failures({**good, **broken}), broken


def test_gpu_check_keeps_what_a_hung_pytest_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its deadline the CUDA tests' pytest is killed; which test hung is kept."""
    from tierswap.bench import gpu

    hung = tmp_path / "test_hangs.py"
    hung.write_text("import time\n\ndef test_hangs():\n    time.sleep(60)\n")
    monkeypatch.setattr(gpu, "TESTS", hung)
    res = gpu.cuda_tests(deadline_s=8)
    assert res["error"] == "pytest ran past its 8 s deadline", res
    assert res["collected"] == 1 and "test_hangs.py" in res["tail"], res
    assert gpu.failures({"cuda_tests": res})


def test_gpu_check_section_keeps_its_figures_past_an_error_or_its_deadline() -> None:
    from tierswap.bench import gpu

    def fails_late(out: dict[str, object]) -> None:
        out["ab"] = {"overhead": 0.01}
        raise OSError("no room")

    res = gpu._within(5, fails_late)
    assert res["ab"] == {"overhead": 0.01} and res["error"] == "OSError: no room"
    assert "fails_late" in res["trace"]
    release = threading.Event()

    def hangs(out: dict[str, object]) -> None:
        out["ab"] = {"overhead": 0.01}
        release.wait(60)

    try:
        res = gpu._within(0.5, hangs)
    finally:
        release.set()
    assert res["ab"] == {"overhead": 0.01}
    assert res["error"] == "still running at its 0.5 s deadline" and "release.wait" in res["trace"]
    assert res["hung"]


def test_a_hung_gpu_snapshot_section_leaves_no_agent_or_slot_to_the_jobs_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os
    import subprocess
    import sys
    from types import SimpleNamespace

    from tierswap.bench import gpu

    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rig = SimpleNamespace(proc=agent, job_id=f"gpuhang{os.getpid()}")
    slot = SHM_DIR / f"{PREFIX}{rig.job_id}-p1-r00000-s0-a1"
    slot.write_bytes(b"x")
    release = threading.Event()

    def hangs(out: dict[str, object], *args: object) -> None:
        rigs = args[-1]
        assert isinstance(rigs, list)
        rigs.append(rig)
        release.wait(60)

    monkeypatch.setattr(gpu, "_snapshot", hangs)
    try:
        res = gpu.snapshot(1 << 30, 1, device="cpu", deadline_s=0.5)
        left = slot.exists()
        code = agent.poll()
    finally:
        release.set()
        if agent.poll() is None:
            agent.kill()
        agent.wait()
        slot.unlink(missing_ok=True)
    assert res["hung"] and code == -9, "the section killed its agent"
    assert not left, "and unlinked its slots"


# ---------------------------------------------------------------- bench memory


def test_host_memory_per_node_counts_both_tiers_against_the_nodes_own_state() -> None:
    from tierswap.bench.hostmem import node_memory

    mib = 2**20
    evs = [  # 2 nodes, a rank each, 4 slots of 1 MiB; node 1's ring was made anew, bigger
        {"event": "memory", "node": 0, "rank": 0, "tier": 0, "bytes": 4 * mib, "slots": 4},
        {"event": "memory", "node": 1, "rank": 1, "tier": 0, "bytes": 4 * mib, "slots": 4},
        {"event": "memory", "node": 0, "rank": 1, "tier": 1, "bytes": 4 * mib},
        {"event": "memory", "node": 1, "rank": 0, "tier": 1, "bytes": 2 * mib},
        {"event": "memory", "node": 1, "rank": 0, "tier": 1, "bytes": 4 * mib},
        {"event": "report", "step": 0},
    ]
    out = node_memory(evs)
    assert {n: v["total_x"] for n, v in out.items()} == {"0": 8.0, "1": 8.0}
    delta = [*evs[:2], {"event": "memory", "node": 0, "rank": 1, "tier": 1, "bytes": 3 * mib,
                        "scope": "node"}]  # fmt: skip
    assert node_memory(delta)["0"]["tier1_x"] == 3.0
    three = [{**evs[0], "bytes": 3 * mib, "slots": 3}, *evs[1:]]  # a ring of 3 slots
    assert node_memory(three)["0"]["state"] == mib, "the state is the ring over its slots"
    with pytest.raises(ValueError, match="without its ring's slots"):
        node_memory([{k: v for k, v in evs[0].items() if k != "slots"}])


def test_bench_memory_runs_tiny() -> None:
    from tierswap.bench import hostmem

    res = hostmem.run(nodes=2, steps=6, modes={"default": []})
    (r,) = res.values()
    assert r["nodes"]["0"]["total_x"] == 4.0, r  # 2 tier-0 slots + a ring of 2 replicas
    assert 3.0 <= r["shm_x"] <= 4.5, "what /dev/shm held agrees with what was allocated"
    assert "4.00x" in hostmem.report(res)


# ---------------------------------------------------------------- recovery and overhead, tiny


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_recovery_size_curve_runs_tiny_with_each_ranks_parts_and_floors(
    tmp_path: Path,
) -> None:
    from tierswap.bench import recovery

    curve = recovery.size_curve(tmp_path, (1,), 1)
    entry = curve["1"]
    assert entry["limits"]["memcpy"]["median"] > 0 and entry["limits"]["tcp"]["median"] > 0
    for kind in ("worker", "node"):
        s = entry[kind]
        assert s["seconds"]["median"] > 0 and s["redone"] <= 1
        assert set(s["lost"]) == set(recovery.PARTS) and s["lost"]["step"] > 0
        assert s["floors"]["restore"] > 0 and s["restore_vs_floor"] > 0
    assert entry["node"]["lost_tiers"] == [1], "the spare's rank came from a peer's memory"
    assert entry["worker"]["lost_tiers"] == [0], "the new worker's from its node's memory"
    # the survivor's next step never had the dead worker's gradients: its own state is the
    # step restored, proven by the slot's checksum, and it read nothing
    assert entry["worker"]["kept_live"] == 1.0
    table = recovery._sizes_table(curve)
    assert table.row_count == 2


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_overhead_runs_tiny_plain_and_pinned_in_the_peers_rounds() -> None:
    """Eight of its ten jobs, through ``bench peers``' rounds (tier 0 is tier 0+1 without
    replicas): tier01, the bare memcpy and the bare stream, unpinned and pinned, each
    against the plain job of its pinning, the snapshot's copy against the bare one's, the
    agents against the bare stream's threads."""
    from tierswap.bench import overhead

    modes = ("plain", "memcpy", "stream", "tier01")
    res = overhead.run(1, 1, steps=7, modes=modes)
    keys = {m + pin for m in modes for pin in ("", "_pinned")}
    assert set(res) >= keys
    assert "tier0" not in res
    for key in keys:
        assert res[key]["step_s"]["median"] > 0, key
        assert res[key]["failed"] == 0, key
    for key in ("tier01", "tier01_pinned"):
        assert res[key]["agents_sampled"]["median"] == 2, "both nodes' agents sampled"
        assert res[key]["copy_cpu_s_per_gib"]["median"] > 0
        assert res[key]["copy_vs_bare"]["median"] > 0
        # replication's CPU against TCP's: present; at 1 MiB the agents' CPU, read from
        # /proc in clock ticks, may round to 0
        assert res[key]["agents_vs_tcp"] >= 0 and res["tcp_cpu_s_per_gib"] > 0
        assert res[key]["agents_vs_bare_stream"]["median"] >= 0
    for key in ("tier01_pinned", "stream_pinned"):  # (at 1 MiB it may round to 0 ticks)
        assert res[key]["agent_core_s"]["median"] >= 0, "the agents' core, per step"
    assert all(res[key]["steal_s"]["median"] >= 0 for key in keys), "the host's steal, per step"
    assert "agent_core_s" not in res["tier01"], "unpinned: no core of their own"
    for key in ("stream", "stream_pinned"):
        assert res[key]["net_cpu_s_per_gib"]["median"] > 0, "the bare stream ran, timed"
        assert res[key]["copy_cpu_s_per_gib"]["median"] > 0
    assert "net_cpu_s_per_gib" not in res["memcpy"]
    for key in ("memcpy", "memcpy_pinned"):
        assert res[key]["copy_cpu_s_per_gib"]["median"] > 0, "the bare copy ran, timed"
        assert res[key]["agents_cpu_s_per_gib"]["median"] == 0, "no snapshot: no GiB"
        assert "copy_vs_bare" not in res[key]
    assert res["plain"]["copy_cpu_s_per_gib"]["median"] == 0
    with pytest.raises(ValueError, match="baseline"):
        overhead.run(1, 1, modes=("tier0",))
    assert res["memcpy_cpu_s_per_gib"] > 0
    overhead.report(res)


def test_a_core_s_busy_time_is_its_share_between_the_samples_around_the_window(
    tmp_path,
) -> None:
    from tierswap.bench import overhead

    sampler = overhead.Sampler(tmp_path)
    sampler.cores = [(0.0, {0: 10.0, 1: 5.0}), (1.0, {0: 10.5, 1: 5.9}), (2.0, {0: 11.0, 1: 6.3})]
    assert sampler.busy(frozenset({1}), 0.5, 1.5) == pytest.approx(1.3 / 2), "its rate, 1 s"
    assert sampler.busy(frozenset({0, 1}), 0.0, 2.0) == pytest.approx(2.3)
    assert sampler.busy(frozenset({1}), 0.5, 2.5) is None, "no sample after the window"
    sampler.stolen = [(0.0, 1.0), (1.0, 1.0), (2.0, 1.4)]
    assert sampler.steal(0.5, 1.5) == pytest.approx(0.2) and sampler.steal(0.0, 2.5) is None


def test_a_cores_busy_time_leaves_out_what_the_hypervisor_took(monkeypatch) -> None:
    from tierswap.bench import overhead

    stat = "cpu  9 0 9 9 9 0 0 9 0 0\ncpu0 100 0 50 400 10 5 5 30 0 0\nintr 1\n"
    monkeypatch.setattr(overhead.Path, "read_text", lambda self: stat)
    clk = overhead.CLK
    assert overhead.cpu_times() == {0: (160 / clk, 30 / clk)}, "user+system+irq+softirq; steal"


def test_the_agents_cpu_is_read_at_the_window_s_ends_not_at_the_samples_outside(
    tmp_path,
) -> None:
    from tierswap.bench import overhead

    sampler = overhead.Sampler(tmp_path)
    sampler.samples = {7: [(0.0, 0.0), (1.0, 1.0), (2.0, 1.1)], 8: [(1.0, 3.0), (2.0, 3.0)]}
    # agent 7 at 0.5 s: 0.5, at 1.5 s: 1.05; the samples outside would give 1.1
    assert sampler.between(0.5, 1.5) == pytest.approx(0.55)
    assert sampler.between(1.0, 2.0) == pytest.approx(0.1), "agent 8 idle; both sampled"
    # agent 8 started after 0.5 s: not sampled on both sides, so it counts nothing
    assert sampler.between(0.5, 2.0) == pytest.approx(0.6)


def test_overhead_pairs_each_run_with_the_plain_run_of_its_pinning_and_round() -> None:
    from tierswap.bench import overhead

    def job(step: float, agents: float = 0.0, copy: float = 0.2) -> dict[str, float]:
        return {"step_s": step, "stall_s": 0.01, "gate_s": 0.0, "copy_cpu_s_per_gib": copy,
                "agents_cpu_s": agents, "agents_sampled": 2.0,
                "agents_cpu_s_per_gib": agents, "steal_s": 0.0}  # fmt: skip

    runs = {
        "plain": [job(1.0), job(2.0), job(1.0)],
        "tier0": [job(1.1, 0.1), None, job(1.3, 0.1)],
        "plain_pinned": [job(4.0), None, job(4.0)],
        "tier0_pinned": [job(4.4, 0.2), job(4.0, 0.2), job(4.0, 0.2)],
        "memcpy": [job(1.05, copy=0.1), job(2.0, copy=0.16), job(1.2, copy=0.25)],
        "tier01": [job(1.4, 1.0), job(2.8, 1.2), job(1.4, 0.8)],
        "stream": [
            job(1.2) | {"net_cpu_s_per_gib": 0.5},
            None,
            job(1.3) | {"net_cpu_s_per_gib": 0.4},
        ],
        "tier01_pinned": [
            job(4.8, 0.6) | {"agent_core_s": 0.9},
            job(4.4, 0.6) | {"agent_core_s": 0.8},
            None,
        ],
        "stream_pinned": [job(4.2) | {"net_cpu_s_per_gib": 0.3, "agent_core_s": 0.6}, None, None],
    }
    res = overhead.summarize(runs, memcpy_bps=2**30 / 0.1, size_mib=1, steps=14, tcp_cpu=0.5)
    assert res["tier01"]["agents_vs_tcp"] == pytest.approx(2.0), "its agents' median, 1.0"
    assert res["tier01"]["agents_vs_bare_stream"]["samples"] == pytest.approx([2.0, 2.0]), (
        "each round's agents against that round's bare stream; its round 2 failed"
    )
    assert res["stream"]["overhead"]["samples"] == pytest.approx([0.2, 0.3])
    assert res["tier01"]["step_vs_stream"]["samples"] == pytest.approx([1.4 / 1.2, 1.4 / 1.3])
    assert res["tier01_pinned"]["step_vs_stream"]["samples"] == pytest.approx([4.8 / 4.2])
    assert res["tier01_pinned"]["agents_vs_bare_stream"]["samples"] == pytest.approx([2.0]), (
        "against the pinned stream, not the unpinned one"
    )
    assert res["tier01_pinned"]["agent_core_vs_stream"]["samples"] == pytest.approx([1.5]), (
        "the agents' core against the pinned stream's, in the one round both ran"
    )
    assert "agent_core_vs_stream" not in res["tier01"], "unpinned: no core of their own"
    assert "step_vs_stream" not in res["tier0"], "tier 0's floor is the memcpy"
    assert "agents_vs_bare_stream" not in res["tier0"], "tier 0 sends nothing"
    assert "agents_vs_tcp" not in res["tier0"], "tier 0 sends nothing"
    assert res["memcpy"]["overhead"]["samples"] == pytest.approx([0.05, 0.0, 0.2])
    assert res["tier0"]["copy_vs_bare"]["samples"] == pytest.approx([2.0, 0.8]), (
        "each round's copy against that round's bare memcpy; round 2 failed"
    )
    assert "copy_vs_bare" not in res["tier0_pinned"], "no pinned bare memcpy ran"
    assert res["memcpy_cpu_s_per_gib"] == pytest.approx(0.1)
    assert res["tier0"]["overhead"]["samples"] == pytest.approx([0.1, 0.3]), "round 2 failed"
    assert res["tier0"]["failed"] == 1
    assert res["tier0_pinned"]["overhead"]["samples"] == pytest.approx([0.1, 0.0]), (
        "against plain_pinned, not plain; its failed round left out"
    )
    assert res["tier0_pinned"]["agents_vs_memcpy"] == pytest.approx(2.0)
    assert res["tier0"]["copy_vs_memcpy"] == pytest.approx(2.0)
    assert res["plain"]["overhead"]["median"] == 0
    runs["plain_pinned"] = [None, None, None]
    res = overhead.summarize(runs, memcpy_bps=2**30 / 0.1, size_mib=1, steps=14)
    assert res["tier0_pinned"] == {"failed": 0, "unpaired": 3}, "kept, as without a baseline"
    overhead.report(res)


def test_limits_measured_round_by_round_pool_into_one_set_of_stats(tmp_path: Path) -> None:
    """bench peers measures the machine's limits once a round, between its jobs: the
    floors use the stats of every sample from every round, not the last round's."""
    from tierswap.bench import limits

    one = limits.measure(1 << 20, 1, tmp_path)
    two = limits.measure(1 << 20, 2, tmp_path)
    pooled = limits.pooled([one, two])
    assert pooled["nbytes"] == 1 << 20
    for name in ("memcpy", "xxh3", "tcp", "write_fsync", "tcp_cpu"):
        samples = one[name]["samples"] + two[name]["samples"]
        assert pooled[name]["samples"] == samples and len(samples) == 3
        assert pooled[name]["median"] == sorted(samples)[1]


def test_the_bare_stream_delivers_each_copy_whole_before_its_gate_opens() -> None:
    """The floor of tiers 0+1 moves every byte: the gate opens only once the copy handed
    to it was received in full (here by its own receiver: one rank in a ring of one)."""
    import socket

    import torch

    from tierswap.examples.bare import BareStream

    a, b = socket.socketpair()
    stream = BareStream(a, b)
    try:
        first = None
        for k, n in enumerate((1000, 1000, 1500)):  # reused, and made anew where it grew
            buf = torch.randint(0, 256, (n,), dtype=torch.uint8)
            stream.send(buf)
            stream.gate()
            assert stream.sent == stream.handed == k + 1
            assert stream.received is not None and bytes(stream.received) == bytes(buf.numpy())
            first = first or stream.received
            assert (stream.received is first) == (n == 1000)
        assert stream.cpu > 0
    finally:
        stream.close()
    assert not any(t.is_alive() for t in stream.threads)


def test_a_bare_stream_whose_peer_is_gone_fails_its_gate_instead_of_waiting() -> None:
    import socket

    import torch

    from tierswap.examples.bare import BareStream

    a, b = socket.socketpair()
    far, near = socket.socketpair()
    far.close()  # the previous rank is gone: the receiver sees a clean end
    stream = BareStream(a, near)
    b.close()  # and so is the next: the frame cannot be sent
    stream.send(torch.zeros(1 << 20, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="bare stream failed"):
        stream.gate()
    with pytest.raises(RuntimeError, match="bare stream failed"):
        stream.close()
    assert not any(t.is_alive() for t in stream.threads)


def test_two_ranks_bare_streams_over_tcp_carry_each_copy_and_close_together() -> None:
    """A ring of two on loopback TCP, as ``BareStream.connect`` makes it, Nagle off: each
    rank's copies arrive at the other whole, and both close at once without a deadlock
    (each waits for the other's end); with BareCopy, what arrives is the state's bytes,
    laid out as a slot."""
    import socket
    import threading

    import torch

    from tierswap.examples.bare import BareCopy, BareStream

    def pair() -> tuple[socket.socket, socket.socket]:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            out = socket.create_connection(listener.getsockname())
            return out, listener.accept()[0]

    a_out, b_in = pair()
    b_out, a_in = pair()
    streams = [BareStream(a_out, a_in), BareStream(b_out, b_in)]
    assert all(st.out.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for st in streams)
    states = [{"w": torch.full((3, 5), float(r)), "b": torch.arange(7.0) + r} for r in (0, 1)]
    copies = [BareCopy(s, st) for s, st in zip(states, streams, strict=True)]
    for _ in range(2):
        for c, st in zip(copies, streams, strict=True):
            c.wait()
            st.gate()
            for t in c.state.values():
                t.add_(1)  # the optimizer step: the copy before it is safe
            c.start()
    for c, st in zip(copies, streams, strict=True):
        c.wait()
        st.gate()
    for r, st in enumerate(streams):
        other = states[1 - r]
        got = bytes(st.received or b"")
        w, b = bytes(other["w"].numpy()), bytes(other["b"].numpy())
        assert got[: len(w)] == w and got[64 : 64 + len(b)] == b, "each at its aligned offset"
    closers = [threading.Thread(target=st.close) for st in streams]
    for t in closers:
        t.start()
    for t in closers:
        t.join(30)
    assert not any(t.is_alive() for t in closers), "both closed: no deadlock"
    assert not any(t.is_alive() for st in streams for t in st.threads)


def test_a_bare_stream_whose_next_rank_hangs_fails_within_its_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A next rank that is alive but never answers: the gate gives up after LIMIT_S with a
    TimeoutError, and close ends both threads within the limit too."""
    import socket
    import time

    import torch

    from tierswap.examples import bare

    monkeypatch.setattr(bare, "LIMIT_S", 0.5)
    a, hung = socket.socketpair()  # hung: the next rank's end, never read, never answered
    prev, near = socket.socketpair()  # the previous rank: alive, silent
    stream = bare.BareStream(a, near)
    try:
        stream.send(torch.zeros(1 << 10, dtype=torch.uint8))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="bare stream failed") as raised:
            stream.gate()
        assert isinstance(raised.value.__cause__, TimeoutError)
        with pytest.raises(RuntimeError, match="bare stream failed"):
            stream.close()
        assert time.monotonic() - t0 < 5
        assert not any(t.is_alive() for t in stream.threads)
    finally:
        hung.close()
        prev.close()

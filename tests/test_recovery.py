"""The central oracle: a run with failures ends with the same bits as one without them.

Real jobs: ``tierswap run`` with simulated nodes (agent processes with their workers),
faults injected with SIGKILL, final states compared byte for byte.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from e2e import assert_same_bits, events, final_state, kill_job, leaked_segments, run_job
from tierswap.examples import job_command
from tierswap.tiers import catalog

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(autouse=True)
def _no_leaked_memory(tmp_path: Path):
    yield
    assert not leaked_segments(tmp_path), "a job left shared-memory segments behind"


def test_ddp_worker_killed_restores_from_memory_bit_exact(tmp_path: Path, baseline) -> None:
    base = baseline(nodes=2, mode="ddp")
    code, run_dir, out = run_job(
        tmp_path,
        "kill",
        steps=12,
        extra=("--spare-workers", "1", "--inject", "kill:rank=1:step=9"),
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "kill"))
    (failure,) = events(run_dir, "failure_detected")
    assert failure["ranks"] == [1] and failure["what"] == "worker"
    (restored,) = events(run_dir, "restored")
    assert set(restored["tiers"].values()) == {0}, "a worker crash restores from tier 0"
    # the survivor trained no further than the step restored (the next one's gradients
    # never came from rank 1): it keeps its own state, proven equal, and reads nothing
    assert restored["live"] == ([0] if restored["step"] == 9 else []), restored
    assert events(run_dir, "job_finished")[0]["step"] == 11
    # rank 1's new process is node 1's spare worker, parked since the start; rank 0's is
    # the same process as before
    started = {e["host"]: set(e["workers"]) for e in events(run_dir, "node_joined")}
    first, second = (e["pids"] for e in events(run_dir, "rebuilt"))
    assert second["0"] == first["0"]
    assert second["1"] != first["1"] and second["1"] in started[1]


def test_fsdp2_node_killed_restores_from_durable_bit_exact(tmp_path: Path, baseline) -> None:
    """Tier 2 incremental (``--persist-deltas``, every delta kept: threshold 1): the lost
    rank's shard comes back as its full part of an older step plus a delta."""
    persist = tmp_path / "ckpt"
    base = baseline(nodes=2, mode="fsdp")
    code, run_dir, out = run_job(
        tmp_path,
        "kill",
        steps=12,
        mode="fsdp",
        extra=(
            "--replicas",
            "0",
            "--persist",
            str(persist),
            "--persist-every",
            "2",
            "--inject",
            "kill:node=1:step=10",
            "--persist-deltas",
            "--delta-threshold",
            "1.0",
        ),
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "kill"))
    (failure,) = events(run_dir, "failure_detected")
    assert failure["what"] == "node" and failure["node"] == 1
    (restored,) = events(run_dir, "restored")
    assert restored["tiers"]["1"] == 2, "the lost node's rank comes from tier 2"
    (written,) = [
        e
        for e in events(run_dir, "snapshot_committed")
        if e["tier"] == 2 and e["step"] == restored["step"]
    ]
    assert written.get("delta_parts") == 2, "restored through base + delta"
    assert catalog.verify(str(persist)) == []
    assert restored["tiers"]["0"] in (0, 2), "a survivor takes its fastest tier holding the step"


def test_fsdp2_worker_killed_restores_from_memory_bit_exact(tmp_path: Path, baseline) -> None:
    base = baseline(nodes=2, mode="fsdp")
    code, run_dir, out = run_job(
        tmp_path, "kill", steps=12, mode="fsdp", extra=("--inject", "kill:rank=0:step=7")
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "kill"))
    assert set(events(run_dir, "restored")[0]["tiers"].values()) == {0}


def test_whole_job_killed_resumes_from_durable_bit_exact(tmp_path: Path, baseline) -> None:
    persist = tmp_path / "ckpt"
    base = baseline(nodes=2, mode="ddp")
    run_dir = tmp_path / "first"
    proc = _start(tmp_path, run_dir, persist, steps=12)
    try:
        _wait_for(
            lambda: any(
                e["tier"] == 2 and e["step"] >= 4
                for e in _safe_events(run_dir, "snapshot_committed")
            ),
            120,
        )
    finally:
        kill_job(proc.pid, run_dir)
        proc.wait()
    code, run_dir2, out = run_job(
        tmp_path, "second", steps=12, extra=("--persist", str(persist), "--persist-every", "2")
    )
    assert code == 0, out
    (restored,) = events(run_dir2, "restored")
    assert 4 <= restored["step"] < 11 and set(restored["tiers"].values()) == {2}
    assert not events(run_dir, "job_finished"), "the first run was killed before its end"
    assert_same_bits(base, final_state(tmp_path, "second"))


def test_exact_ddp_three_ranks_worker_killed_bit_exact(tmp_path: Path, baseline) -> None:
    base = baseline(nodes=3, mode="ddp-exact")
    code, _, out = run_job(
        tmp_path,
        "kill",
        nodes=3,
        steps=12,
        mode="ddp-exact",
        extra=("--inject", "kill:rank=2:step=6"),
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "kill"))


def test_a_replacement_worker_attaching_during_a_stop_waits_for_the_next_generation(
    tmp_path: Path, baseline
) -> None:
    """Rank 1's worker crashes; its replacement is still importing when generation 1
    starts and node 2 is lost at once. The replacement must not be handed the generation
    that ended (it used to, and then generation 2 had no worker for rank 1 until the
    rendezvous timed out, a third failure)."""
    base = baseline(nodes=3, mode="ddp-exact")
    code, run_dir, out = run_job(
        tmp_path,
        "late",
        nodes=3,
        steps=12,
        mode="ddp-exact",
        extra=("--inject", "kill:rank=1:step=4", "--inject", "kill:node=2:gen=1"),
        timeout=150,
    )
    assert code == 0, out
    assert [e["what"] for e in events(run_dir, "failure_detected")] == ["worker", "node"]
    assert_same_bits(base, final_state(tmp_path, "late"))


def test_node_lost_without_persist_stops_with_a_clear_message(tmp_path: Path) -> None:
    code, run_dir, out = run_job(
        tmp_path, "lost", steps=40, extra=("--replicas", "0", "--inject", "kill:node=1:step=5")
    )
    assert code == 1
    assert "--persist" in out and "no step can be restored" in out
    assert events(run_dir, "job_failed")


# ---------------------------------------------------------------- helpers


def _start(tmp: Path, run_dir: Path, persist: Path, steps: int) -> subprocess.Popen[bytes]:
    cmd = job_command(
        run_dir,
        ["--nodes", "2", "--persist", str(persist), "--persist-every", "2"],
        ["--steps", str(steps), "--sleep", "0.2"],
    )
    log = (tmp / "first.log").open("w")
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True
    )


def _safe_events(run_dir: Path, kind: str) -> list[dict]:
    try:
        return events(run_dir, kind)
    except (FileNotFoundError, ValueError):
        return []


def _wait_for(cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the job"
        time.sleep(0.2)


def test_a_survivor_leaves_its_step_at_once_when_a_peer_dies(tmp_path: Path, baseline) -> None:
    """Ranks without collectives between them (mode single) and long steps: the survivor
    would only notice the end of its generation after its step, 1.5 s of the loop's own
    work (decide took 1.51 s with ``--no-interrupt-steps``, 0.01 s without, measured);
    cut short by the control thread's signal, it leaves at once, and the run still ends
    with the bits of an uninterrupted one."""
    slow = ("--sleep", "1.5")
    base = baseline(nodes=2, mode="single", steps=3, train_args=slow)
    code, run_dir, out = run_job(
        tmp_path,
        "kill",
        steps=3,
        mode="single",
        train_args=slow,
        extra=("--spare-workers", "1", "--inject", "kill:rank=1:step=0"),
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "kill"))
    (resumed,) = events(run_dir, "resumed")
    assert resumed["kept"] == [0], "the survivor kept its process"
    assert resumed["phases"]["decide"] < 0.75, f"the survivor finished its step: {resumed}"

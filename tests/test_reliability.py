"""Reliability: the job survives what happens to the launcher itself (issue 14)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from e2e import assert_same_bits, events, final_state, kill_job, leaked_segments
from tierswap.control.protocol import CUT_OFF
from tierswap.examples import job_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _wait_for(run_dir: Path, kind: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "events.jsonl").exists() and events(run_dir, kind):
            return
        time.sleep(0.05)
    raise TimeoutError(f"no {kind} event within {timeout} s")


def _listening(launcher: int) -> list[str]:
    """The addresses the launcher (coordinator, store) and its agents listen on. Issue 14:
    torch's TCPStore listened on every interface although --bind was 127.0.0.1."""
    import psutil

    top = psutil.Process(launcher)
    out = []
    for proc in [top, *top.children()]:  # the agents; their workers are a level below
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:  # a node that just ended
            continue
        out += [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def test_a_launcher_stopped_past_its_lease_fences_nobody(tmp_path: Path, baseline) -> None:
    """SIGSTOP of the launcher for twice the lease: when it runs again the hosts'
    silence is its own, their leases are renewed, and the job finishes with no failure."""
    base = baseline(nodes=2, mode="ddp")
    run_dir, log = tmp_path / "paused", tmp_path / "paused.log"
    job = _start(tmp_path, "paused", ["--heartbeat", "0.5", "--lease", "3"], 12, sleep=0.1)
    try:
        _wait_for(run_dir, "snapshot_committed", 120)
        assert _listening(job.pid) and set(_listening(job.pid)) == {"127.0.0.1"}, (
            "the launcher or an agent listens beyond --bind (127.0.0.1)"
        )
        os.kill(job.pid, signal.SIGSTOP)  # the launcher only: agents and workers run on
        time.sleep(6)
        os.kill(job.pid, signal.SIGCONT)
        code = job.wait(120)
    finally:
        if job.poll() is None:
            kill_job(job.pid, run_dir)
            job.wait()
    assert code == 0, log.read_text()
    assert events(run_dir, "coordinator_paused")[0]["seconds"] >= 5
    assert not events(run_dir, "failure_detected"), "a host was fenced for the launcher's pause"
    assert len(events(run_dir, "generation_started")) == 1
    assert_same_bits(base, final_state(tmp_path, "paused"))
    assert not leaked_segments(tmp_path)


def test_a_second_job_on_a_root_in_use_is_refused_and_the_first_goes_on(
    tmp_path: Path, baseline
) -> None:
    """Two jobs on one durable root at once both ran, and one resumed the other's steps."""
    base = baseline(nodes=2, mode="ddp")
    persist = tmp_path / "ckpt"
    run_dir = tmp_path / "first"
    launcher = ["--persist", str(persist), "--persist-every", "2"]
    job = _start(tmp_path, "first", launcher, 12, sleep=0.1)
    try:
        _wait_for(run_dir, "snapshot_committed", 120)
        second = subprocess.run(
            job_command(
                tmp_path / "second",
                ["--nodes", "2", "--persist", str(persist)],
                ["--steps", "12", "--mode", "ddp", "--out", str(tmp_path / "second-final")],
            ),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        code = job.wait(120)
    finally:
        if job.poll() is None:
            kill_job(job.pid, run_dir)
            job.wait()
    assert second.returncode == 2, second.stderr
    assert "is in use by job" in second.stderr and f"pid {job.pid}" in second.stderr
    assert not (tmp_path / "second" / "events.jsonl").exists() or not events(
        tmp_path / "second", "generation_started"
    )
    assert code == 0, (tmp_path / "first.log").read_text()
    assert_same_bits(base, final_state(tmp_path, "first"))
    assert not (persist / "LOCK").exists(), "the first job let its lease go"


def test_soak_ten_random_failures_end_bit_exact_with_nothing_lost_or_left(
    tmp_path: Path, baseline
) -> None:
    """Issue 14's soak, CI variant: ``--chaos`` kills nodes and workers at ten random
    moments; the job ends bit for bit equal to an uninterrupted run, tier 2 verifies, and
    no process or shared-memory segment is left."""
    import psutil

    base = baseline(nodes=2, mode="ddp", steps=200)
    persist, run_dir = tmp_path / "ckpt", tmp_path / "soak"
    cmd = job_command(
        run_dir,
        ["--nodes", "2", "--spares", "1", "--spare-workers", "1", "--chaos", "11:90:10",
         "--max-restarts", "40", "--persist", str(persist), "--persist-every", "5"],
        ["--steps", "200", "--mode", "ddp", "--sleep", "0.05",
         "--out", str(tmp_path / "soak-final")],
    )  # fmt: skip
    with (tmp_path / "soak.log").open("w") as out:
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                               start_new_session=True)  # fmt: skip
        try:
            code = job.wait(280)
        finally:
            if job.poll() is None:
                kill_job(job.pid, run_dir)
                job.wait()
    assert code == 0, (tmp_path / "soak.log").read_text()[-3000:]
    strikes = [e["spec"] for e in events(run_dir, "fault_injected")]
    assert len(strikes) == 10 and len(events(run_dir, "failure_detected")) >= 10, strikes
    assert not (longer := _unexplained_redos(events(run_dir))), (longer, _trail(run_dir))
    assert_same_bits(base, final_state(tmp_path, "soak"))
    verify = subprocess.run(
        [sys.executable, "-m", "tierswap.cli", "verify", str(persist)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout
    agents = [e["pid"] for e in events(run_dir, "node_joined")]
    alive = [p for p in agents if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, f"agents left running: {alive}"
    assert not leaked_segments(tmp_path)


TRAIL = {
    "fault_injected", "failure_detected", "generation_started", "restored", "resumed",
    "snapshot_skipped", "replica_rejected", "replicate_failed", "tier1_given_up",
    "tier1_wait_timeout",
}  # fmt: skip


def _gave_up(e: dict[str, Any]) -> bool:
    """Tier 1 gave the event's step up then (a transfer cut off is given up a heartbeat
    later, as ``tier1_given_up``, and not when a failure comes first)."""
    match e["event"]:
        case "snapshot_skipped" | "tier1_given_up":
            return True
        case "replica_rejected":
            return not e["why"].endswith(CUT_OFF)
        case "replicate_failed":
            return e["peer"] is not None and not e.get("cut")
    return False


def _unexplained_redos(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recoveries that redid more than ``--max-redo 1`` allows. One step more is the
    design's where it says so (docs/architecture.md, "Bounded loss"): where tier 1 gave
    a step up (a skipped snapshot, a refused or failed replica) between the restored
    step and the failure, or where the generation the failure ended had not yet
    committed a step of its own in tier 1 (its first step waits on nothing)."""
    longer: list[dict[str, Any]] = []
    start, tier1, gave_up, seen = -1, -1, set[int](), None
    for e in evs:
        match e["event"]:
            case "generation_started":
                start = -1 if e["step"] is None else e["step"]
                tier1, gave_up = start, set()
            case "snapshot_committed" if e["tier"] == 1:
                tier1 = max(tier1, e["step"])
            case _ if _gave_up(e):
                gave_up.add(e["step"])
            case "failure_detected" if seen is None:  # a second one folds into the first
                seen = (start, tier1, set(gave_up))
            case "resumed":
                begun, committed, given = seen or (start, tier1, gave_up)
                seen = None
                redone, restored = e["redone"], e["step"]
                steps = range(restored + 1, restored + redone + 1)
                loosened = committed <= begun or any(s in given for s in steps)
                if redone > 1 + loosened:
                    longer.append(e)
    return longer


def _trail(run_dir: Path) -> str:
    """The failures and what tier 1 gave up around them: why a recovery redid more."""
    keep = ("spec", "what", "node", "rank", "step", "peer", "why", "tiers", "redone")
    picked = [(e, {k: e[k] for k in keep if k in e}) for e in events(run_dir)]
    return "\n".join(
        f"{e['time'] % 1000:8.3f} {e['event']} {f}" for e, f in picked if e["event"] in TRAIL
    )


def _verify(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierswap.cli", "verify", str(root)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _start(
    tmp_path: Path, name: str, launcher: list[str], steps: int, sleep: float = 0.05
) -> subprocess.Popen[bytes]:
    cmd = job_command(
        tmp_path / name,
        ["--nodes", "2", *launcher],
        ["--steps", str(steps), "--mode", "ddp", "--sleep", str(sleep),
         "--out", str(tmp_path / f"{name}-final")],
    )  # fmt: skip
    with (tmp_path / f"{name}.log").open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                start_new_session=True)  # fmt: skip


def _finish(job: subprocess.Popen[bytes], run_dir: Path, timeout: float) -> int:
    try:
        return job.wait(timeout)
    finally:
        if job.poll() is None:
            kill_job(job.pid, run_dir)
            job.wait()


def test_a_kill_at_each_named_fault_point_ends_bit_exact(tmp_path: Path, baseline) -> None:
    """Issue 14's named fault points in one job: a worker killed half way through its
    snapshot copy, a node killed between writing its tier-2 parts and their COMMIT, a
    worker killed while it restores, a node killed as it starts writing tier 2, a slow
    worker and slow storage throughout. Every one fires, and the job ends with the bits of
    a run without them."""
    base = baseline(nodes=2, mode="ddp", steps=30)
    persist, run_dir = tmp_path / "ckpt", tmp_path / "points"
    specs = ["kill:rank=0:step=4:during=snapshot", "kill:node=1:step=10:during=commit",
             "kill:rank=1:gen=2:during=restore", "kill:node=0:step=20:during=persist",
             "slow:rank=1:seconds=0.02", "slow:persist:seconds=0.3"]  # fmt: skip
    launcher = ["--persist", str(persist), "--persist-every", "3"]
    for spec in specs:
        launcher += ["--inject", spec]
    code = _finish(_start(tmp_path, "points", launcher, 30), run_dir, 240)
    log = (tmp_path / "points.log").read_text()
    assert code == 0, log[-3000:]
    fired = [e["spec"] for e in events(run_dir, "fault_injected")]
    assert sorted(fired) == sorted(specs[:4]), fired
    assert len(events(run_dir, "generation_started")) == 5
    assert_same_bits(base, final_state(tmp_path, "points"))
    assert _verify(persist).returncode == 0
    steps = sorted(p.name for p in persist.glob("step-*"))
    assert all((persist / s / "COMMIT").exists() for s in steps), f"orphan parts: {steps}"
    assert not leaked_segments(tmp_path)


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 26 MiB tmpfs: two steps of the example GPT's tier 2 fit, a third does not."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=26m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_durable_root_that_fills_up_moves_on_and_leaves_no_half_step(
    tmp_path: Path, baseline, small_tmpfs: Path
) -> None:
    """Issue 14: a full durable root left its half-written step behind and tier 2 stayed
    at the last step that fit. On a real full filesystem, the half step goes, an older
    step makes room, and tier 2 keeps committing newer steps."""
    base = baseline(nodes=2, mode="ddp", steps=30)
    root, run_dir = small_tmpfs / "ckpt", tmp_path / "full"
    launcher = ["--persist", str(root), "--persist-every", "3", "--keep", "2"]
    code = _finish(_start(tmp_path, "full", launcher, 30), run_dir, 180)
    assert code == 0, (tmp_path / "full.log").read_text()[-3000:]
    full = events(run_dir, "durable_root_full")
    assert full and all(e["discarded"] for e in full), full
    committed = [e["step"] for e in events(run_dir, "snapshot_committed") if e["tier"] == 2]
    assert max(committed) >= 24, f"tier 2 stopped at step {max(committed)}: {committed}"
    assert len(committed) >= 4
    assert_same_bits(base, final_state(tmp_path, "full"))
    steps = sorted(p.name for p in root.glob("step-*"))
    assert all((root / s / "COMMIT").exists() for s in steps), f"a half step is left: {steps}"
    assert _verify(root).returncode == 0


def _remount(mount: Path, mode: str) -> None:
    """Remount read-only or writable; a file open for writing makes it busy for a moment."""
    for _ in range(100):
        if subprocess.run(["mount", "-o", f"remount,{mode}", str(mount)]).returncode == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"could not remount {mount} {mode}")


def test_a_durable_root_that_turns_read_only_and_back_loses_nothing(
    tmp_path: Path, baseline, small_tmpfs: Path
) -> None:
    """The root is remounted read-only mid-run: training goes on in memory, durability is
    reported failing; remounted writable, tier 2 commits again; the run ends bit exact."""
    base = baseline(nodes=2, mode="ddp", steps=200)
    root, run_dir = small_tmpfs / "ckpt", tmp_path / "ro"
    launcher = ["--persist", str(root), "--persist-every", "3", "--keep", "1"]
    job = _start(tmp_path, "ro", launcher, 200, sleep=0.1)  # 20 s and more
    try:
        _wait_for(run_dir, "snapshot_committed", 120)
        deadline = time.monotonic() + 60
        while not [e for e in events(run_dir, "snapshot_committed") if e["tier"] == 2]:
            assert time.monotonic() < deadline, "no tier-2 commit"
            time.sleep(0.05)
        _remount(small_tmpfs, "ro")  # held past a lease renewal (every 10 s)
        _wait_for(run_dir, "durability_failing", 60)
        time.sleep(11)
        _remount(small_tmpfs, "rw")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=False)
        code = _finish(job, run_dir, 180)
    assert code == 0, (tmp_path / "ro.log").read_text()[-3000:]
    failing = events(run_dir, "durability_failing")
    assert any("Read-only file system" in str(e["reason"]) for e in failing), failing
    committed = [e["step"] for e in events(run_dir, "snapshot_committed") if e["tier"] == 2]
    assert committed and max(committed) == 199, f"tier 2 never wrote again: {committed}"
    assert events(run_dir, "lease_not_renewed"), "the lease was not tried while read-only"
    assert events(run_dir, "lease_renewed"), "the lease was not taken up again"
    assert_same_bits(base, final_state(tmp_path, "ro"))
    assert _verify(root).returncode == 0


@pytest.mark.parametrize(
    "sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]
)
def test_a_stop_by_signal_writes_the_newest_step_first_and_a_rerun_resumes_from_it(
    tmp_path: Path, baseline, sig: signal.Signals, code: int
) -> None:
    """A preemption's SIGTERM, Ctrl-C, a closed terminal's SIGHUP: the newest step in
    memory goes to tier 2 before the job stops (tier 2's own last step is 40 steps older
    here), the event and the message name it, nothing is left running, and the same
    command resumes from it and ends bit for bit. (Issue 14: Ctrl-C printed a
    traceback; SIGHUP, by its default, left the root's lease behind.)"""
    import psutil

    from tierswap.tiers.ownership import LOCK_FILE

    persist, run_dir = tmp_path / "ckpt", tmp_path / "int"
    launcher = ["--persist", str(persist), "--persist-every", "40"]
    job = _start(tmp_path, "int", launcher, 40, sleep=0.1)
    try:
        deadline = time.monotonic() + 120
        while not [e for e in _events_or_none(run_dir) if e["event"] == "snapshot_committed"
                   and e["tier"] == 0 and e["step"] >= 6]:  # fmt: skip
            assert time.monotonic() < deadline and job.poll() is None, "no tier-0 commit"
            time.sleep(0.05)
        os.kill(job.pid, sig)
        exited = job.wait(60)
    finally:
        if job.poll() is None:
            kill_job(job.pid, run_dir)
            job.wait()
    out = (tmp_path / "int.log").read_text()
    assert exited == code, out[-2000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-2000:]
    (drain,) = events(run_dir, "draining")
    assert drain["signal"] == sig.name and drain["step"] >= 6
    (stop,) = events(run_dir, "job_interrupted")
    durable = [e["step"] for e in events(run_dir, "snapshot_committed") if e["tier"] == 2]
    assert durable == [0, drain["step"]], "step 0 (the first due), then the drained step"
    assert stop["signal"] == sig.name and stop["durable_step"] == drain["step"]
    assert not (persist / LOCK_FILE).exists(), "the root's lease let go"
    assert f"newest durable step {drain['step']} in {persist}" in out
    agents = [e["pid"] for e in events(run_dir, "node_joined")]
    time.sleep(0.5)
    alive = [p for p in agents if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, f"agents left running: {alive}"
    assert not leaked_segments(tmp_path)
    again = _start(tmp_path, "again", launcher, 40, sleep=0.0)
    assert _finish(again, tmp_path / "again", 180) == 0, (tmp_path / "again.log").read_text()
    (resumed,) = events(tmp_path / "again", "restored")
    assert resumed["step"] == drain["step"], "the rerun resumed from the drained step"
    assert_same_bits(baseline(nodes=2, mode="ddp", steps=40), final_state(tmp_path, "again"))


def _events_or_none(run_dir: Path) -> list[dict[str, object]]:
    return events(run_dir) if (run_dir / "events.jsonl").exists() else []


def test_a_run_dir_too_long_for_unix_sockets_is_refused_with_the_fix(tmp_path: Path) -> None:
    """Issue 14: a long --run-dir killed the agent with "AF_UNIX path too long"."""
    long_dir = tmp_path / ("d" * 120)
    cmd = job_command(long_dir, ["--nodes", "1"], ["--steps", "1", "--mode", "ddp",
                      "--out", str(tmp_path / "never")])  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode != 0
    assert "too long for the agents' Unix sockets" in done.stderr, done.stderr
    assert "give a shorter folder" in done.stderr and "Traceback" not in done.stderr

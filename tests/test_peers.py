"""`tierswap bench peers`: recovery times read from the step notes the way the issue
defines them, exactness and ratios summarized, bad arguments refused, and one tiny run of
the torch-only peers end to end that leaves nothing behind."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tierswap.bench import peerjobs, peeroutput, peers, peersummary


def note(rank: int, step: int, t: float, stall: float = 0.0) -> dict[str, Any]:
    return {"rank": rank, "step": step, "t": t, "stall": stall, "gate": 0.0, "copy_cpu": 0.0}


def test_recovery_runs_from_the_victims_step_8_to_the_last_ranks_next_step() -> None:
    notes = [note(0, 7, 1.0), note(1, 7, 1.1), note(1, 8, 2.0), note(0, 8, 2.05)]
    # the restarted attempt appends: rank 1 first, rank 0's next step later
    notes += [note(1, 9, 9.0), note(0, 9, 9.5), note(0, 10, 10.0), note(1, 10, 10.1)]
    assert peeroutput.recovery_seconds(notes) == pytest.approx(7.5)


def test_recovery_takes_a_rank_whose_pre_kill_step_8_ends_after_the_kill() -> None:
    # rank 0 finishes step 8 just after rank 1 died: its recovery is its step 9, not 8
    notes = [note(1, 8, 2.0), note(0, 8, 2.01), note(1, 9, 5.0), note(0, 9, 5.2)]
    assert peeroutput.recovery_seconds(notes) == pytest.approx(3.2)


def test_recovery_redone_steps_count_as_the_first_step_after_the_kill() -> None:
    # a restart from step 7's checkpoint redoes step 8 on every rank
    notes = [note(0, 8, 2.0), note(1, 8, 2.0), note(0, 8, 6.0), note(1, 8, 6.1)]
    assert peeroutput.recovery_seconds(notes) == pytest.approx(4.1)


def test_recovery_with_a_kill_time_when_the_victims_notes_died_with_it() -> None:
    # a buffered times file: the victim's notes are gone, its replacement redoes step 8
    notes = [note(0, 7, 1.0), note(0, 8, 2.0), note(1, 8, 3.0), note(1, 9, 3.5)]
    notes += [note(0, 8, 3.1), note(0, 9, 3.6)]
    assert peeroutput.recovery_seconds(notes, kill_t=2.5) == pytest.approx(0.6)


def test_recovery_names_what_is_missing() -> None:
    with pytest.raises(ValueError, match="rank 1 wrote no step-8 entry"):
        peeroutput.recovery_seconds([note(0, 8, 1.0), note(1, 7, 1.0)])
    with pytest.raises(ValueError, match=r"ranks \[0\] completed no step after the kill"):
        peeroutput.recovery_seconds([note(0, 8, 1.0), note(1, 8, 1.0), note(1, 9, 3.0)])


def test_checkpoint_costs_take_rank_0s_steps_and_the_longest_stall_of_each_step() -> None:
    notes = []
    for s in range(14):
        notes += [note(0, s, 0.5 * s, stall=0.1), note(1, s, 0.5 * s, stall=0.2 if s > 3 else 9)]
    costs = peeroutput.checkpoint_costs(notes)
    assert costs["step_s"] == pytest.approx(0.5)
    assert costs["stall_s"] == pytest.approx(0.2)  # steps 0-3 left out


def test_summaries_give_exactness_and_per_round_ratios_with_a_failed_round() -> None:
    runs: dict[str, list[dict[str, Any] | None]] = {
        peersummary.BASE_RECOVERY: [_rec(0.5, True), _rec(1.0, True), _rec(0.5, True)],
        "torchft-heal": [_rec(5.0, False), None, _rec(10.0, False)],
    }
    s = peersummary.summarize_recovery(runs)
    ft = s["torchft-heal"]
    assert peersummary.exactness(ft["exact"]) == "0/2"
    assert ft["failed"] == 1
    assert ft[f"vs_{peersummary.BASE_RECOVERY}"]["samples"] == [10.0, 20.0]  # round 2 left out
    assert peersummary.exactness(s[peersummary.BASE_RECOVERY]["exact"]) == "3/3"


def _rec(seconds: float, exact: bool) -> dict[str, Any]:
    return {"seconds": seconds, "exact": exact, "differing": [] if exact else ["rank-0/x"],
            "rng_differing": [], "kill_from": "victim's times"}  # fmt: skip


def test_checkpoint_overhead_is_against_the_plain_run_of_the_same_round() -> None:
    runs: dict[str, list[dict[str, float] | None]] = {
        "plain": [{"step_s": 1.0, "stall_s": 0.0}, {"step_s": 2.0, "stall_s": 0.0}],
        "tier0": [{"step_s": 1.1, "stall_s": 0.01}, {"step_s": 2.2, "stall_s": 0.01}],
        "torch-save": [{"step_s": 1.5, "stall_s": 0.5}, {"step_s": 3.0, "stall_s": 0.5}],
    }
    s = peersummary.summarize_checkpoint(runs)
    assert s["torch-save"]["overhead"]["samples"] == pytest.approx([0.5, 0.5])
    assert s["torch-save"]["stall_vs_tier0"]["median"] == pytest.approx(50.0)
    assert "overhead" not in s["plain"]


def _args(**kw: Any) -> argparse.Namespace:
    base = {"size_mib": None, "repeats": 1, "json": None, "peers_python": None, "only": None}
    return argparse.Namespace(**(base | kw))


def test_bad_arguments_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="takes one size"):
        peers.config_from(_args(size_mib=[1, 2]))
    with pytest.raises(ValueError, match="use >= 1"):
        peers.config_from(_args(size_mib=[0]))
    with pytest.raises(ValueError, match="not a system of bench peers"):
        peers.config_from(_args(only=["megatron"]))
    with pytest.raises(ValueError, match="make bench-peers"):
        peers.config_from(_args(peers_python=str(tmp_path / "nope" / "python")))


def test_a_relative_peers_python_still_runs_from_the_jobs_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `make bench-peers` passes .venv-peers/bin/python; the jobs run in folders of their
    # own, where that relative path names nothing
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    monkeypatch.chdir(tmp_path)
    cfg = peers.config_from(_args(peers_python="venv/bin/python"))
    assert cfg.peers_python == venv / "python"  # absolute, the venv's link itself kept
    monkeypatch.chdir(venv)
    assert cfg.peers_python is not None and cfg.peers_python.exists()


def test_peers_a_python_lacks_are_not_run_and_say_how_to_get_them() -> None:
    cfg = peers.Config(size_mib=1, repeats=1, peers_python=None, only=frozenset({"torch-save"}))
    have = {"python": "/usr/bin/python3", "torch": "2.13.0", "dlrover": None, "torchft": None}
    ckpt, rec, not_run = peers.plan(cfg, have)
    assert ckpt == ["plain", "torch-save"] and rec == []
    assert set(not_run) == {"dlrover-memory", "dlrover-restart", "torchft-heal"}
    assert all("make bench-peers" in why for why in not_run.values())


def test_overhead_jobs_run_only_beside_a_snapshotting_system_and_twins_need_2_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = peers.Config(size_mib=1, repeats=1, peers_python=None)
    not_run: dict[str, str] = {}
    assert peers.overhead_plan(cfg, ["plain", "torch-save"], not_run) == ([], [])
    sampled, twins = peers.overhead_plan(cfg, ["plain", "tier0", "tier012"], not_run)
    assert twins == ["plain-pinned", "tier0-pinned"]
    assert sampled == ["plain", "tier0", *twins] and not not_run
    monkeypatch.setattr(peers.os, "sched_getaffinity", lambda pid: {0})
    sampled, twins = peers.overhead_plan(cfg, ["plain", "tier0"], not_run)
    assert sampled == ["plain", "tier0"] and twins == []
    assert set(not_run) == {"plain-pinned", "tier0-pinned"}
    assert "2 CPUs" in not_run["tier0-pinned"]


def test_a_missing_peer_scripts_folder_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "site" / "pkgs" / "tierswap" / "__init__.py"
    monkeypatch.setattr(peerjobs.tierswap, "__file__", str(fake))
    with pytest.raises(FileNotFoundError, match="installed wheel has no bench/"):
        peerjobs.peers_folder()


def _ours_alive(prefix: str) -> list[str]:
    """Processes whose command line names one of the benchmark's temporary folders."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if prefix in cmd:
            found.append(f"{proc.name}: {cmd[:200]}")
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_dcp_and_hot_swap_recoveries_end_to_end_are_exact_and_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch-only restart baseline and tierswap's two hot swaps (a spare worker
    restoring from tier 0, a spare host from a peer's replica, both into a model built
    without initialising it: ``job.restoring``), measured and compared bit for bit with
    uninterrupted runs (about 60 s on 2 cores); the peers this Python lacks are named."""
    # its own temporary folder, by name: another test running beside it (bench overhead,
    # bench all) makes tierswap-bench-peers-* folders in /tmp too
    made: list[str] = []
    real = tempfile.TemporaryDirectory

    def recorded(*args: Any, **kwargs: Any) -> Any:
        folder = real(*args, **kwargs)
        made.append(folder.name)
        return folder

    monkeypatch.setattr(peers.tempfile, "TemporaryDirectory", recorded)
    out = tmp_path / "peers.json"
    swaps = ["tierswap-worker-spare", "tierswap-node-spare"]
    args = _args(
        size_mib=[1], json=str(out), peers_python=sys.executable, only=["torchrun-dcp", *swaps]
    )
    have_peers = all(peerjobs.probe(None).get(lib) for lib in peerjobs.PEER_LIBS)
    assert peers.main(args) == 0
    res = json.loads(out.read_text())
    assert res["failures"] == []
    assert res["checkpoint"] == {}
    rec = res["recovery"]["torchrun-dcp"]
    assert rec["exact"] == [True]  # a restart from the newest DCP, of step 8, loses nothing
    assert rec["kill_from"] == ["victim's times"]
    assert 0 < rec["seconds"]["median"] < 120
    for swap in swaps:  # no weight left as to_empty made it: every byte came from the step
        assert res["recovery"][swap]["exact"] == [True], swap
    # the same two jobs give bench recovery's account at this size, floors measured after
    (entry,) = res["recovery_curve"].values()
    assert entry["limits"]["memcpy"]["median"] > 0
    for kind in ("worker", "node"):
        s = entry[kind]
        assert 0 < s["seconds"]["median"] < 60 and s["redone"] <= 1, kind
        assert s["lost"]["step"] > 0 and s["floors"]["load"] > 0 and s["restore_vs_floor"] > 0
    assert entry["node"]["floors"]["fetch"] > 0 == entry["worker"]["floors"]["fetch"]
    if not have_peers:
        assert "torchft-heal" in res["not_run"] and "dlrover-restart" in res["not_run"]
    assert len(made) == 1 and not Path(made[0]).exists()
    assert _ours_alive(made[0]) == []


def test_round_ones_tier01_job_is_tierswaps_reference_and_twins_are_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tierswap's uninterrupted reference is a tier01 job that also writes its state; a
    pinned twin is its system with tierswap's own work on a core of its own."""
    cfg = peers.Config(size_mib=1, repeats=1, peers_python=None, only=frozenset({"tier01"}))
    bench = peers.Bench(cfg, tmp_path, sys.executable, tmp_path)
    assert "--out" in bench.commands.tierswap_cmd("tier01", tmp_path / "a", out=True)
    assert "--out" not in bench.commands.tierswap_cmd("tier01", tmp_path / "b")
    # DLRover's reference is round one's dlrover-memory job, which then writes its state
    assert peerjobs.OWN_REFERENCE["dlrover"] == "dlrover-memory"
    assert peerjobs.REFERENCE["dlrover-restart"] == "dlrover"
    memory = bench.commands.peer_cmd("dlrover-memory", tmp_path / "d", "checkpoint", out=True)
    restart = bench.commands.peer_cmd("dlrover", tmp_path / "d", "reference")
    assert "--out" in memory and memory == restart, "the same command as its own reference"
    assert "--out" not in bench.commands.peer_cmd("dlrover-memory", tmp_path / "d", "checkpoint")
    twin = bench.commands.tierswap_cmd("tier0-pinned", tmp_path / "c")
    assert "--agent-cpus" in twin and "--worker-cpus" in twin and "--replicas" in twin
    assert "--plain" in bench.commands.tierswap_cmd("plain-pinned", tmp_path / "d")
    bare = bench.commands.tierswap_cmd("memcpy-pinned", tmp_path / "e")
    assert "--plain" in bare and "--memcpy" in bare and "--agent-cpus" in bare
    assert "--memcpy" not in bench.commands.tierswap_cmd("plain", tmp_path / "f")
    stream = bench.commands.tierswap_cmd("stream", tmp_path / "g")
    assert {"--plain", "--memcpy", "--stream"} <= set(stream) and "--replicas" in stream
    assert "--stream" not in bare
    assert peerjobs.tierswap_side("plain-pinned") and not peerjobs.tierswap_side("torch-save")
    folder = tmp_path / "job"
    folder.mkdir()
    notes = [{"rank": 0, "step": s, "t": 0.5 * s, "stall": 0.01, "gate": 0.004, "copy_cpu": 0.0}
             for s in range(peerjobs.STEPS)]  # fmt: skip
    (folder / "times.jsonl").write_text("\n".join(map(json.dumps, notes)))
    entered: list[Path] = []

    def job(self: Any, system: str, kind: str, out: bool = False, watch: Any = None) -> Path:
        if watch is not None:
            with watch(folder / "run"):
                entered.append(folder / "run")
        return folder

    monkeypatch.setattr(peers.Bench, "job", job)
    costs, figures = bench.checkpoint("tier0", sample=True)
    assert costs is not None and costs["step_s"] == pytest.approx(0.5)
    assert figures is not None and figures["step_s"] == pytest.approx(0.5), "sampled"
    # the trainer's own stall is kept apart from its wait for tier 1
    assert figures["stall_s"] == pytest.approx(0.006) and figures["gate_s"] == pytest.approx(0.004)
    assert entered == [folder / "run"] and "tierswap" not in bench.references
    assert bench.checkpoint("torch-save")[1] is None and len(entered) == 1, "not sampled"
    bench.checkpoint("tier01", reference="tierswap")
    assert bench.references["tierswap"] == folder
    (folder / "times.jsonl").write_text(json.dumps(notes[0]))  # too short to time
    bench.references.clear()
    assert bench.checkpoint("tier01", reference="tierswap", sample=True) == (None, None)
    assert "tierswap" not in bench.references, "a failed job is no reference"
    assert [f.split(":")[0] for f in bench.failures] == ["tier01 (checkpoint)", "tier01 (overhead)"]
    with pytest.raises(ValueError, match="use at least 11"):
        peers.Config(size_mib=1, repeats=1, peers_python=None, steps=7)


def test_round_ones_dlrover_memory_job_is_dlrovers_reference_else_it_gets_one_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DLRover's uninterrupted run is round one's dlrover-memory job (the same command,
    its final state written): no reference job of its own, and the restart is compared
    with that job's folder; where that job fails, the first recovery runs one."""
    have = {"dlrover": "0.6.1", "torchft": None, "torch": "2.13.0", "python": sys.executable}
    monkeypatch.setattr(peerjobs, "probe", lambda python: have)
    compared: list[Path] = []

    def same_bits(ref: Path, run: Path) -> tuple[list[str], list[str]]:
        compared.append(ref.parent)
        return [], []

    monkeypatch.setattr(peeroutput, "same_bits", same_bits)
    notes = [{"rank": r, "step": s, "t": 0.5 * s + 0.01 * r, "stall": 0.01}
             for s in range(peerjobs.STEPS) for r in (0, 1)]  # fmt: skip
    calls: list[tuple[str, str, bool, Path | None]] = []
    failing: set[tuple[str, str]] = set()

    def job(self: Any, system: str, kind: str, out: bool = False, watch: Any = None) -> Any:
        folder = self.work / f"{len(calls):03d}-{system}-{kind}"
        ok = (system, kind) not in failing or any(c[:2] == (system, kind) for c in calls)
        calls.append((system, kind, out, folder if ok else None))
        if not ok:  # fails once: its first run
            return None
        folder.mkdir()
        (folder / "times.jsonl").write_text("\n".join(map(json.dumps, notes)))
        return folder

    monkeypatch.setattr(peers.Bench, "job", job)
    only = frozenset({"dlrover-memory", "dlrover-restart"})
    cfg = peers.Config(size_mib=1, repeats=2, peers_python=None, only=only, pinned=False)
    res = peers.run(cfg)
    assert [c[:3] for c in calls if c[0] == "dlrover-memory"] == [
        ("dlrover-memory", "checkpoint", True),
        ("dlrover-memory", "checkpoint", False),
    ]
    assert not [c for c in calls if c[1] == "reference"], "no job of its own"
    first = next(c[3] for c in calls if c[0] == "dlrover-memory")
    assert compared == [first, first] and res["recovery"]["dlrover-restart"]["exact"] == [True] * 2
    assert res["checkpoint"]["dlrover-memory"]["failed"] == 0

    calls.clear()
    compared.clear()
    failing.add(("dlrover-memory", "checkpoint"))
    res = peers.run(cfg)
    refs = [c for c in calls if c[1] == "reference"]
    assert [c[:3] for c in refs] == [("dlrover", "reference", False)], "one of its own"
    assert calls.index(refs[0]) > next(
        i for i, c in enumerate(calls) if c[0] == "dlrover-memory"
    ), "after the job that failed"
    assert compared == [refs[0][3], refs[0][3]]
    assert res["checkpoint"]["dlrover-memory"]["failed"] == 1


def test_a_recovery_whose_events_cannot_be_read_still_counts_its_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The account of the way back is read off tierswap's events; a job whose events lack
    a part of it (no ``restored`` here) keeps its recovery seconds, and says why it gave
    no account instead of ending the benchmark."""
    notes = [{"rank": r, "step": s, "t": 0.5 * s + 0.01 * r, "stall": 0.0}
             for s in range(peerjobs.STEPS) for r in (0, 1)]  # fmt: skip

    def job(self: Any, system: str, kind: str, out: bool = False, watch: Any = None) -> Path:
        folder = tmp_path / f"{system}-{kind}"
        (folder / "run").mkdir(parents=True)
        (folder / "times.jsonl").write_text("\n".join(map(json.dumps, notes)))
        resumed = {"event": "resumed", "seconds": 0.5, "phases": {}, "redone": 1,
                   "ranks": {}, "replaced": [1], "time": 1.0}  # fmt: skip
        (folder / "run" / "events.jsonl").write_text(json.dumps(resumed) + "\n")
        return folder

    monkeypatch.setattr(peers.Bench, "job", job)
    monkeypatch.setattr(peeroutput, "same_bits", lambda ref, run: ([], []))
    cfg = peers.Config(size_mib=1, repeats=1, peers_python=None)
    bench = peers.Bench(cfg, tmp_path, sys.executable, tmp_path)
    got = bench.recovery("tierswap-worker-spare")
    assert got is not None and got["seconds"] == pytest.approx(0.5) and got["exact"]
    assert bench.accounts == {}
    (failure,) = bench.failures
    assert failure.startswith("tierswap-worker-spare (its account of the way back): IndexError")


def test_a_failed_jobs_text_keeps_the_childs_traceback_above_the_launchers_summary() -> None:
    child = "Traceback (most recent call last):\n  File x\nRuntimeError: attempt 1: no flash\n"
    summary = "launcher noise\n" * 200 + "ChildFailedError: rank 1 exitcode 1 (no traceback)\n"
    text = peeroutput.failure_text("starting\n" + child + "\n" + summary)
    assert text.startswith("RuntimeError: attempt 1: no flash\n"), "the error first"
    assert child in text and text.endswith(summary[-200:])
    short = "Traceback (most recent call last):\n[rank1]: ValueError: bad\n"
    assert peeroutput.failure_text(short) == "ValueError: bad\n" + short, "the rest at the end"
    assert peeroutput.failure_text("no traceback at all") == "no traceback at all"


def test_a_jobs_leftovers_go_and_what_was_there_before_stays(tmp_path: Path) -> None:
    """DLRover leaves shared memory, sockets and logs in fixed places, making its folders
    when they are missing: what a job adds goes, folders included; what was there before
    (another program's shared memory among it) stays."""
    shm, sock, logs = (tmp_path / n for n in ("shm", "ckpt_sock", "dlrover"))
    dirs = (shm, sock, logs)
    shm.mkdir()
    sock.mkdir()
    (shm / "someone_elses").write_bytes(b"x")
    (sock / "old.sock").write_bytes(b"")
    before = peerjobs.leftovers(dirs)
    (shm / "x_ckpt_shm_0").write_bytes(b"s")
    (shm / "another_programs_new").write_bytes(b"y")
    (sock / "new.sock").write_bytes(b"")
    (logs / "events").mkdir(parents=True)
    (logs / "events" / "log").write_text("e")
    peerjobs.clean(before, None, dirs)
    assert sorted(p.name for p in shm.iterdir()) == ["another_programs_new", "someone_elses"]
    assert [p.name for p in sock.iterdir()] == ["old.sock"]
    assert not logs.exists(), "a folder the job made goes with it"


def test_a_round_that_would_end_past_the_budget_is_not_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """12-04: on a slow day bench peers ran past bench all's 30 minutes and was killed with
    all its rounds; with a budget it stops between rounds, at the pace of those done."""
    monkeypatch.setattr(peers.time, "monotonic", lambda: 1000.0)
    # started at 0, rounds from 100: 900 s for 2 rounds done, the next ~450 s more
    assert peers._round_fits(1450.0, 0.0, 100.0, 2)
    assert not peers._round_fits(1449.0, 0.0, 100.0, 2)
    assert peers._round_fits(10.0, 0.0, 100.0, 0), "the first round always runs"
    assert peers._round_fits(10.0, 0.0, 100.0, 1), "so does the second, past the budget"
    assert not peers._round_fits(10.0, 0.0, 100.0, 1, deadline_s=1899.0), "nor the deadline"
    assert peers._round_fits(10.0, 0.0, 100.0, 1, deadline_s=1900.0)
    assert peers._round_fits(0.0, 0.0, 100.0, 5), "no budget"


def test_bench_all_gives_bench_peers_its_deadline_less_a_margin_as_a_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierswap.bench import suite

    ran: list[list[str]] = []
    monkeypatch.setattr(suite, "run_bounded", lambda cmd, *a, **k: ran.append(cmd) or 0)
    suite.run_one(suite.Bench("peers", "peers", (), ("--repeats", "3"), 30, 16), tmp_path, False)
    suite.run_one(suite.Bench("dcp", "dcp", (), ("--repeats", "3"), 8, 0.5), tmp_path, False)
    peers_cmd, dcp_cmd = ran
    budget = float(peers_cmd[peers_cmd.index("--budget-s") + 1])
    assert budget == 30 * 60 - suite.BUDGET_MARGIN_S
    assert "--budget-s" not in dcp_cmd
    hard = float(peers_cmd[peers_cmd.index("--deadline-s") + 1])
    assert hard == budget, "its deadline is the same here; below, the budget is less"
    args = argparse.Namespace(size_mib=[8], repeats=2, peers_python=None, budget_s=budget,
                              deadline_s=hard)  # fmt: skip
    cfg = peers.config_from(args)
    assert (cfg.budget_s, cfg.deadline_s) == (budget, hard)
    ran.clear()  # what is left of the run's budget, when less, is what it gets
    peers_bench = suite.Bench("peers", "peers", (), (), 30, 16)
    suite.run_one(peers_bench, tmp_path, False, left_s=1000.0)
    assert float(ran[0][ran[0].index("--budget-s") + 1]) == 1000 - suite.RUN_MARGIN_S
    assert float(ran[0][ran[0].index("--deadline-s") + 1]) == 30 * 60 - suite.BUDGET_MARGIN_S


def test_bench_all_gives_bench_peers_what_is_left_less_what_the_rest_typically_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole run keeps to its budget: the two benchmarks before ``peers`` took 600 s
    where they typically take 300 (pace 2), so of the 2,280 s budget ``peers`` may plan its
    rounds in what is left after them and after twice the typical 5 minutes of the one
    after it, less the run's margin; a deadline sooner than that still wins."""
    from tierswap.bench import limits, suite

    clock = [0.0]
    ran: list[list[str]] = []

    def fake(cmd: list[str], *a: Any, **k: Any) -> int:
        ran.append(cmd)
        clock[0] += 300.0
        return 0

    monkeypatch.setattr(suite, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(suite, "run_bounded", fake)
    monkeypatch.setattr(limits, "measure", lambda *a: {})
    monkeypatch.setattr(suite, "machine", lambda: {"cpus": 2})  # no git or psutil calls
    monkeypatch.setattr(suite, "PLAN", (
        suite.Bench("snapshot", "snapshot", (), (), 10, 2.0),
        suite.Bench("recovery", "recovery", (), (), 10, 3.0),
        suite.Bench("peers", "peers", (), (), 30, 16.0),
        suite.Bench("dcp", "dcp", (), (), 10, 5.0),
    ))  # fmt: skip
    index = suite.run_all(tmp_path / "a", False, ["snapshot", "recovery", "peers", "dcp"])
    got = float(ran[2][ran[2].index("--budget-s") + 1])
    assert got == suite.RUN_BUDGET_S[1] - 600 - 2 * 300 - suite.RUN_MARGIN_S
    assert index["budget_s"] == suite.RUN_BUDGET_S[1] and index["benches"]["peers"]["budget_s"]
    clock[0], ran[:] = 0.0, []
    suite.run_all(tmp_path / "b", False, ["peers"], budget_s=10_000.0)
    assert float(ran[0][ran[0].index("--budget-s") + 1]) == 30 * 60 - suite.BUDGET_MARGIN_S
    clock[0], ran[:] = 0.0, []  # a quick pace counts, within its bounds
    monkeypatch.setattr(suite, "run_bounded", lambda cmd, *a, **k: ran.append(cmd) or 0)
    suite.run_all(tmp_path / "c", False, ["snapshot", "recovery", "peers", "dcp"], 1500.0)
    got = float(ran[2][ran[2].index("--budget-s") + 1])
    assert got == 1500 - suite.PACE_RANGE[0] * 300 - suite.RUN_MARGIN_S
    bad = argparse.Namespace(what="all", results=str(tmp_path / "d"), quick=False, only=None,
                             budget_s=0.0)  # fmt: skip
    with pytest.raises(SystemExit, match="--budget-s 0: the run's seconds must be more"):
        suite.main(bad)

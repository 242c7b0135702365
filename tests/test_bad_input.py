"""Bad input gets a clear error that names the thing and the fix; nothing saved is lost."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from e2e import assert_same_bits, events, final_state, leaked_segments, run_job
from tierswap.tiers import catalog

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PERSIST = ("--persist-every", "4")


@pytest.fixture(autouse=True)
def _no_leaked_memory(tmp_path: Path):
    yield
    assert not leaked_segments(tmp_path), "a job left shared-memory segments behind"


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_corrupt_durable_part_is_skipped_for_an_older_step(tmp_path: Path, baseline) -> None:
    persist = tmp_path / "ckpt"
    base = baseline(nodes=2, mode="ddp")
    code, _, out = run_job(tmp_path, "first", steps=12, extra=("--persist", str(persist), *PERSIST))
    assert code == 0, out
    newest = catalog.committed_steps(str(persist))[-1]
    part = persist / f"step-{newest:09d}" / "rank-00001.safetensors"
    data = bytearray(part.read_bytes())
    data[-5] ^= 0xFF
    part.write_bytes(bytes(data))

    verify = subprocess.run(
        [sys.executable, "-m", "tierswap.cli", "verify", str(persist)],
        capture_output=True,
        text=True,
    )
    assert verify.returncode != 0 and "rank-00001.safetensors" in verify.stdout

    code, run_dir, out = run_job(
        tmp_path, "second", steps=12, extra=("--persist", str(persist), *PERSIST)
    )
    assert code == 0, out
    (corrupt,) = events(run_dir, "corrupt_part")
    assert corrupt["rank"] == 1 and corrupt["step"] == newest
    restored = events(run_dir, "restored")[-1]
    assert restored["step"] < newest
    assert_same_bits(base, final_state(tmp_path, "second"))


def test_step_of_another_world_size_that_does_not_fit_stops_the_job_untouched(
    tmp_path: Path,
) -> None:
    """A resume at another world size reshards (tests/test_dcp.py); one whose shapes
    changed stops naming the tensor, and tier 2 is left as it was."""
    persist = tmp_path / "ckpt"
    code, _, _ = run_job(tmp_path, "two", steps=6, extra=("--persist", str(persist), *PERSIST))
    assert code == 0
    before = _listing(persist)
    code, run_dir, out = run_job(
        tmp_path, "one", nodes=1, steps=6, train_args=("--width", "64"),
        extra=("--persist", str(persist), *PERSIST),
    )  # fmt: skip
    assert code == 1
    assert "does not load into this job's state" in out and "model.wte.weight" in out
    assert len(events(run_dir, "failure_detected")) == 0, "a usage error is not retried"
    assert _listing(persist) == before


def test_changed_shape_stops_the_job_naming_the_tensor(tmp_path: Path) -> None:
    persist = tmp_path / "ckpt"
    assert run_job(tmp_path, "a", steps=6, extra=("--persist", str(persist), *PERSIST))[0] == 0
    before = _listing(persist)
    code, run_dir, out = run_job(
        tmp_path,
        "b",
        steps=8,
        train_args=("--width", "64"),
        extra=("--persist", str(persist), *PERSIST),
    )
    assert code == 1
    assert "StateMismatchError" in out and "[256, 128]" in out and "[256, 64]" in out
    assert len(events(run_dir, "failure_detected")) == 0, "a usage error is not retried"
    assert _listing(persist) == before


def test_unwritable_persist_url_keeps_training_and_says_so(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, run_dir, out = run_job(
        tmp_path, "job", steps=8, extra=("--persist", str(blocker / "ckpt"), *PERSIST)
    )
    assert code == 0, out
    assert "durability failing" in out
    assert events(run_dir, "durability_failing")
    assert events(run_dir, "job_finished")


SCRIPT = """
import argparse, threading, torch, tierswap

def train(job):
    model = torch.nn.Linear(4, 4)
    state = {"model": model, "lock": threading.Lock()}
    for step in job.steps(state, total=4):
        pass

if __name__ == "__main__":
    tierswap.launch(train)
"""


def test_non_serializable_value_names_its_path(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text(SCRIPT)
    code, run_dir, out = run_job(tmp_path, "bad", nodes=1, steps=4, script=script)
    assert code == 1
    assert "NotSerializableError" in out and "'lock'" in out and "state_dict()" in out
    assert not events(run_dir, "failure_detected")


CRASH_AT_EXIT = """
import atexit, os, time, torch, tierswap

def train(job):
    state = {"model": torch.nn.Linear(4, 4)}
    for step in job.steps(state, total=4):
        pass
    if job.rank == 1:
        atexit.register(os.abort)  # after train(job) returned and the step is saved
    else:
        time.sleep(3)  # still finishing while rank 1 is gone

if __name__ == "__main__":
    tierswap.launch(train)
"""


def test_a_worker_crashing_after_it_finished_is_reported_not_recovered(tmp_path: Path) -> None:
    script = tmp_path / "crash_at_exit.py"
    script.write_text(CRASH_AT_EXIT)
    code, run_dir, out = run_job(tmp_path, "crash", nodes=2, steps=4, script=script)
    assert code == 0, out
    (crash,) = events(run_dir, "worker_exited_after_finish")
    assert crash["rank"] == 1 and crash["code"] == -signal.SIGABRT
    assert not events(run_dir, "failure_detected")
    assert events(run_dir, "job_finished")[0]["step"] == 3


CRASH_BEFORE_FINISH = """
import os, sys, time, torch, tierswap

def train(job):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "opt": opt}
    for step in job.steps(state, total=4):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().sum().backward()
        opt.step()
    out = sys.argv[sys.argv.index("--out") + 1]
    os.makedirs(out, exist_ok=True)
    torch.save(model.state_dict(), f"{out}/rank{job.rank}-gen{job.generation}.pt")
    if job.generation > 0:
        return
    with open(f"{out}/rank{job.rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(f"{out}/rank{job.rank}.tmp", f"{out}/rank{job.rank}.pid")
    if "--stop-first" in sys.argv:  # rank 0 returns only once the job is stopping
        if job.rank == 0:
            gone(f"{out}/rank1.pid")
            time.sleep(2)  # its agent is told to stop meanwhile
        else:
            appears(f"{out}/rank0.pid")  # rank 0 is done with its steps (and snapshots)
            os._exit(3)
    if job.rank == 1:
        gone(f"{out}/rank0.pid")  # rank 0 has finished and exited
        os._exit(3)  # a crash in the user's own code after the steps, before finishing

def appears(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)

def gone(pid_file):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(pid_file):
            try:
                os.kill(int(open(pid_file).read()), 0)
            except ProcessLookupError:
                return
        time.sleep(0.05)

if __name__ == "__main__":
    tierswap.launch(train)
"""


@pytest.mark.parametrize("order", ["finish-first", "stop-first"])
def test_a_rank_failing_after_another_finished_gets_that_rank_a_new_worker(
    tmp_path: Path, order: str
) -> None:
    """Rank 1 fails after its steps, before it finishes, while rank 0 finishes: either
    before (it has exited) or after its agent was told to stop (its "finished" arrives
    while it is leaving). The next generation needs a worker for rank 0 again, and it
    restores the state rank 0 finished with."""
    import torch

    script = tmp_path / "crash_before_finish.py"
    script.write_text(CRASH_BEFORE_FINISH)
    code, run_dir, out = run_job(
        tmp_path, "late", nodes=2, steps=4, script=script, timeout=90, train_args=(f"--{order}",)
    )
    assert code == 0, out
    (failure,) = events(run_dir, "failure_detected")
    assert failure["ranks"] == [1]
    assert events(run_dir, "job_finished")[0]["step"] == 3
    # rank 0 ran in a fresh worker; no host was counted twice (none turned spare)
    first, second = (e["pids"]["0"] for e in events(run_dir, "rebuilt"))
    assert first != second
    assert [e["role"] for e in events(run_dir, "node_joined")] == ["member", "member"]
    final = tmp_path / "late-final"
    for rank in (0, 1):
        before = torch.load(final / f"rank{rank}-gen0.pt")
        after = torch.load(final / f"rank{rank}-gen1.pt")
        assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("memory://ckpt", "lives inside one process"),  # issue 13: accepted, kept nothing
        ("s3://bucket/ckpt", "tierswap[s3]"),  # without s3fs: a 30-line traceback
    ],
)
def test_a_durable_root_the_job_cannot_use_is_refused_naming_the_fix(
    tmp_path: Path, url: str, says: str
) -> None:
    from tierswap.examples import EXAMPLE

    # the CLI as on a machine without s3fs (the dev extra installs it here): its import fails
    no_s3fs = "import sys; sys.modules['s3fs'] = None; from tierswap.cli import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", no_s3fs, "run", "--nodes", "1", "--persist", url,
         "--run-dir", str(tmp_path / "run"), str(EXAMPLE), "--steps", "1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists(), "nothing was started"


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``tierswap ARGS`` in this process: its exit code, stdout and stderr."""
    from tierswap import cli

    with pytest.raises(SystemExit) as done:
        cli.main(args)
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def _step(root: Path, step: int) -> None:
    """A committed step of one rank: a module, its optimizer and a plain value."""
    import torch

    from tierswap.state import flatten
    from tierswap.tiers import durable

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    flat = flatten({"model": model, "optim": opt, "epoch": 1})
    durable.write_commit(str(root), step, 1, {0: durable.write_flat(str(root), step, 0, 1, flat)})


def test_export_errors_are_one_line_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    for step in (3, 5):
        _step(root, step)
    code, _, err = _cli(["export", str(root), "--step", "999", str(tmp_path / "x")], capsys)
    assert code == 2 and "no committed step 999" in err and "newest first: 5, 3" in err, err
    code, _, err = _cli(["export", str(root), "--format", "hf", "--model", "optim",
                         str(tmp_path / "hf")], capsys)  # fmt: skip
    assert code == 2 and "--model optim" in err and "an optimizer's state" in err, err
    assert "model (module)" in err and not (tmp_path / "hf").exists(), err
    code, _, err = _cli(["ls", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "nothing does not exist" in err, err
    # a corrupt step: each format says so in one line, as the merged export always did
    part = root / "step-000000005" / "rank-00000.safetensors"
    data = bytearray(part.read_bytes())
    data[-5] ^= 0xFF
    part.write_bytes(bytes(data))
    for fmt in ("merged", "dcp", "hf"):
        out = tmp_path / f"out-{fmt}"
        code, _, err = _cli(["export", str(root), "--format", fmt, str(out)], capsys)
        assert code == 2, err
        assert err.count("\n") == 1 and f"{part}: data checksum mismatch" in err, err
        assert not out.exists()
    # an OUT that exists is refused before the step is read (its corruption never seen)
    (tmp_path / "taken").mkdir()
    code, _, err = _cli(["export", str(root), "--format", "dcp", str(tmp_path / "taken")], capsys)
    assert code == 2 and "taken exists" in err and "checksum" not in err, err
    assert part.read_bytes() == bytes(data), "nothing saved was changed"


BAD_RUN_DIRS = [
    ("file/run", "Not a directory"),  # under a regular file
    ("file", "a file of that name is there"),
    *([("/proc/tierswap-nope", "No such file or directory")] if Path("/proc/self").is_dir()
      else []),
]  # fmt: skip


@pytest.mark.parametrize(("run_dir", "says"), BAD_RUN_DIRS)
def test_a_run_dir_that_cannot_be_made_is_refused_before_anything_starts(
    tmp_path: Path, run_dir: str, says: str
) -> None:
    from tierswap.examples import EXAMPLE

    (tmp_path / "file").write_text("a file, not a folder")
    done = subprocess.run(
        [sys.executable, "-m", "tierswap.cli", "run", "--nodes", "1", "--run-dir", run_dir,
         str(EXAMPLE), "--steps", "1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"tierswap run: --run-dir {run_dir!r}: "), done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"], "nothing was started"

"""A hostile durable root (issue 14): nothing outside the root is read, written or deleted,
every bad entry is reported as that entry being bad (never the whole root taken for
empty), and nothing is read or allocated past what the file itself holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_durable import _write
from tierswap.errors import CorruptPartError
from tierswap.tiers import catalog, durable

pytestmark = pytest.mark.timeout(60)


def _step(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def test_a_symlinked_step_folder_is_never_read_written_or_cleaned(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    for s in (1, 2, 3):
        _write(str(root), s)
    _write(str(outside), 0)  # a step of another root: its COMMIT must survive
    os.symlink(_step(outside, 0), _step(root, 0))
    steps = {s.step: s for s in catalog.list_steps(str(root))}
    assert not steps[0].committed and "symbolic link" in str(steps[0].problem)
    assert [s for s in steps if steps[s].committed] == [1, 2, 3]
    assert catalog.retain(str(root), keep=1) == [1, 2]
    assert (_step(outside, 0) / "COMMIT").is_file(), "retention deleted a file outside the root"
    assert os.path.islink(_step(root, 0))
    before = sorted(p.name for p in _step(outside, 0).iterdir())
    with pytest.raises(OSError, match="writes only inside its root"):
        _write(str(root), 0)
    assert sorted(p.name for p in _step(outside, 0).iterdir()) == before, "wrote outside"
    assert any("symbolic link" in p for p in catalog.verify(str(root)))


def test_a_dangling_link_among_the_steps_hides_no_committed_step(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for s in (6, 7):
        _write(str(root), s)
    os.symlink(tmp_path / "nowhere", _step(root, 8))
    steps = catalog.list_steps(str(root))
    assert [s.step for s in steps if s.committed] == [6, 7], "committed progress ignored"
    (bad,) = [s for s in steps if s.problem]
    assert bad.step == 8


def test_a_part_json_claiming_a_huge_size_is_corrupt_before_anything_is_allocated(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    parts = _write(str(root), 4)
    meta_path = _step(root, 4) / "rank-00001.json"
    meta = json.loads(meta_path.read_text())
    last = meta["layout"]["entries"][-1]  # a consistent layout whose last tensor is 4 TiB
    last["shape"], last["dtype"] = [2**40], "F32"
    last["nbytes"] = 4 * 2**40
    meta["nbytes"] = meta["layout"]["nbytes"] = last["offset"] + last["nbytes"]
    meta_path.write_text(json.dumps(meta))
    t0 = time.monotonic()
    with pytest.raises(CorruptPartError, match="less than"):
        durable.read_part(str(root), 4, 1)
    assert time.monotonic() - t0 < 5
    with pytest.raises(CorruptPartError):  # the json no longer matches COMMIT either
        durable.read_part(str(root), 4, 1, parts[1])


@pytest.mark.parametrize("kind", ["dev-zero", "sparse", "fifo", "nested", "garbage"])
def test_a_hostile_commit_is_a_bad_step_not_a_crash_or_a_hang(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "root"
    _write(str(root), 3)
    _write(str(root), 5)
    commit = _step(root, 5) / "COMMIT"
    commit.unlink()
    if kind == "dev-zero":
        os.symlink("/dev/zero", commit)
    elif kind == "sparse":
        with commit.open("wb") as f:
            f.truncate(16 << 30)  # 16 GiB of holes: nothing on disk, everything on read
    elif kind == "fifo":
        os.mkfifo(commit)
    elif kind == "nested":
        commit.write_text("[" * 100_000 + "]" * 100_000)
    else:
        commit.write_text("{not json")
    t0 = time.monotonic()
    steps = {s.step: s for s in catalog.list_steps(str(root))}
    assert steps[3].committed and not steps[5].committed
    assert steps[5].problem and "COMMIT" in steps[5].problem
    problems = catalog.verify(str(root))
    assert problems and all("step-000000005" in p for p in problems), problems
    assert time.monotonic() - t0 < 10, "a reader blocked or read the whole thing"


def test_deeply_nested_part_json_is_a_corrupt_part(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _write(str(root), 2)
    (_step(root, 2) / "rank-00000.json").write_text("{" * 50_000)
    with pytest.raises(CorruptPartError, match=r"nested too deeply|not JSON"):
        durable.read_part(str(root), 2, 0)


def test_ls_and_verify_name_the_bad_entries(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _write(str(root), 1)
    _step(root, 2).mkdir()
    os.mkfifo(_step(root, 2) / "COMMIT")
    cli = [sys.executable, "-m", "tierswap.cli"]
    ls = subprocess.run([*cli, "ls", str(root)], capture_output=True, text=True, timeout=30)
    assert ls.returncode == 0 and "BAD" in ls.stdout and "committed" in ls.stdout
    verify = subprocess.run([*cli, "verify", str(root)], capture_output=True, text=True, timeout=30)
    assert verify.returncode == 1 and "step-000000002" in verify.stdout


# ---------------------------------------------------------------- one job per root


def test_a_second_job_on_a_root_in_use_is_refused_naming_the_first(tmp_path: Path) -> None:
    from tierswap.tiers.ownership import RootClaim, RootInUseError

    root = str(tmp_path / "root")
    first = RootClaim(root, None)
    first.acquire()
    second = RootClaim(root, None)
    assert second.job == first.job, "a job started on the root resumes it under its name"
    with pytest.raises(RootInUseError, match=f"in use by job '{first.job}' .*pid {os.getpid()}"):
        second.acquire()
    assert first.renew() is None
    first.release()
    second.acquire()
    second.release()


def test_a_lease_whose_holder_died_on_this_host_is_taken_at_once(tmp_path: Path) -> None:
    """A job killed and started again at once on the same host must not wait out the
    lease of the one that died."""
    from tierswap.tiers.ownership import RootClaim

    root = str(tmp_path / "root")
    code = (
        "import sys; from tierswap.tiers.ownership import RootClaim; "
        "RootClaim(sys.argv[1], None).acquire()"
    )
    subprocess.run([sys.executable, "-c", code, root], check=True, timeout=60)
    assert (tmp_path / "root" / "LOCK").is_file(), "the dead job's lease is still there"
    RootClaim(root, None).acquire()


def test_taking_over_a_live_root_on_purpose_tells_the_old_holder(tmp_path: Path) -> None:
    from tierswap.tiers.ownership import RootClaim

    root = str(tmp_path / "root")
    old = RootClaim(root, "train-7b")
    old.acquire()
    new = RootClaim(root, "train-7b", take_over=True)
    new.acquire()
    lost = old.renew()
    assert lost is not None and "taken over by job 'train-7b'" in lost


def test_another_job_name_than_the_roots_is_refused(tmp_path: Path) -> None:
    from tierswap.tiers.ownership import RootClaim, RootInUseError

    root = str(tmp_path / "root")
    RootClaim(root, "alpha").acquire()
    with pytest.raises(RootInUseError, match="holds the steps of job 'alpha', not 'beta'"):
        RootClaim(root, "beta")


def test_a_step_committed_by_another_job_is_never_restored(tmp_path: Path) -> None:
    """A complete step folder of another job, same world size, copied into the root: it
    was restored without a word."""
    import shutil

    from tierswap.control.ports import DurableRoot
    from tierswap.tiers.ownership import RootClaim

    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    for root, name, step in ((mine, "mine", 3), (theirs, "theirs", 9)):
        claim = RootClaim(root, name)
        claim.acquire()
        parts = _write(root, step, commit=False)
        durable.write_commit(root, step, 2, parts, job=name)
        claim.release()
    shutil.copytree(_step(Path(theirs), 9), _step(Path(mine), 9))
    steps = {s.step: s for s in catalog.list_steps(mine)}
    assert steps[3].committed and not steps[9].committed
    assert "committed by job 'theirs'" in str(steps[9].problem)
    assert DurableRoot(mine, "mine").restorable_steps(2) == frozenset({3})


def test_a_lease_that_cannot_be_read_or_written_just_now_is_not_a_takeover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read or write error on the root (EIO, a full or read-only root) must not count
    as another job holding it: renew raises OSError, and the launcher tries again."""
    import errno

    from tierswap.tiers import ownership
    from tierswap.tiers.ownership import RootClaim

    root = tmp_path / "ckpt"
    claim = RootClaim(str(root), None)
    claim.acquire()
    assert claim.renew() is None

    def unreadable(fs: object, path: str, limit: int) -> bytes:
        raise ownership.CorruptPartError(path, "cannot read: EIO") from OSError(
            errno.EIO, "I/O error"
        )

    monkeypatch.setattr(ownership, "read_small", unreadable)
    with pytest.raises(OSError, match="I/O error"):
        claim.renew()
    monkeypatch.undo()

    def unwritable() -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(claim, "_write", unwritable)
    with pytest.raises(OSError, match="Read-only"):
        claim.renew()
    monkeypatch.undo()
    assert claim.renew() is None, "once writable, the lease is this job's again"
    claim.release()

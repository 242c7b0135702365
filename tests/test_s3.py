"""Tier 2 on object storage: a real S3-protocol server (moto's server mode, on loopback,
started here) behind ``--persist s3://bucket/prefix``, through s3fs as users run it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from e2e import assert_same_bits, events, final_state, kill_job, leaked_segments, run_job
from tierswap.examples import job_command
from tierswap.state import flatten
from tierswap.tiers import catalog, durable
from tierswap.tiers.files import url_fs

pytest.importorskip("s3fs", reason="tier 2 on S3 needs s3fs: pip install 'tierswap[s3]'")
pytest.importorskip("moto.server", reason="the S3 server of these tests is moto's (dev extra)")

SLOW = ("--sleep", "0.2")
"""Steps slow enough that the first run is still training when tier 2 has step 4."""
CHUNK = 5 << 20
"""s3fs's block size here: S3's least multipart part, so a 12 MiB part takes 3."""


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """moto's S3 server on a loopback port; this process and the jobs it starts reach it
    through the standard AWS variables (``AWS_ENDPOINT_URL_S3``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        with pytest.MonkeyPatch.context() as mp:
            for name, value in {
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT_URL_S3": endpoint,
                "FSSPEC_S3": json.dumps({"default_block_size": CHUNK}),
            }.items():
                mp.setenv(name, value)
            import fsspec.config

            mp.setitem(fsspec.config.conf, "s3", {"default_block_size": CHUNK})
            yield endpoint
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.fixture
def bucket(s3: str) -> str:
    name = f"tierswap-{uuid.uuid4().hex[:12]}"
    fs, _ = url_fs(f"s3://{name}")
    fs.mkdir(name)
    return name


def _write_part(root: str, step: int, rank: int, world: int, seed: int) -> durable.PartInfo:
    """A rank's part of 12 MiB of float32 (more than one multipart chunk) and a counter."""
    g = torch.Generator().manual_seed(seed)
    flat = flatten({"w": torch.randn(3 << 20, generator=g), "n": torch.tensor(step)})
    return durable.write_flat(root, step, rank, world, flat)


def _commits(run_dir: Path) -> list[dict[str, object]]:
    return events(run_dir, "snapshot_committed") if (run_dir / "events.jsonl").exists() else []


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tierswap.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_parts_over_several_chunks_commit_written_last_and_read_back(
    bucket: str, tmp_path: Path
) -> None:
    root = f"s3://{bucket}/run"
    parts = {rank: _write_part(root, 4, rank, 2, seed=rank) for rank in range(2)}
    fs, base = url_fs(root)
    names = fs.find(base)
    data = [n for n in names if n.endswith(".safetensors")]
    assert len(data) == 2, names
    for name in data:
        etag = fs.info(name)["ETag"].strip('"')
        assert "-" in etag, f"{name} was not a multipart upload ({etag})"
        assert fs.info(name)["size"] > 2 * CHUNK
    assert not any(n.endswith("/COMMIT") for n in names), "COMMIT before the step's commit"
    (listed,) = catalog.list_steps(root)
    assert listed.step == 4 and not listed.committed
    durable.write_commit(root, 4, 2, parts)
    (listed,) = catalog.list_steps(root)
    assert listed.committed and listed.world_size == 2
    assert durable.read_commit(root, 4) == (2, parts)  # COMMIT read back as written
    assert catalog.verify(root) == []

    ls = _cli("ls", root)
    assert ls.returncode == 0 and "committed" in ls.stdout, ls.stdout + ls.stderr
    ok = _cli("verify", root)
    assert ok.returncode == 0 and "every checksum matches" in ok.stdout, ok.stderr
    out = tmp_path / "merged.safetensors"
    exported = _cli("export", root, "--step", "4", str(out))
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file

    merged = load_file(str(out))
    want = torch.randn(3 << 20, generator=torch.Generator().manual_seed(0))
    assert any(torch.equal(t, want) for t in merged.values())

    # a part overwritten with other bytes (an object store's objects can be) is named
    (victim,) = [n for n in data if "00001" in n.rsplit("/", 1)[-1]]
    raw = bytearray(fs.cat_file(victim))
    raw[-1] ^= 0xFF
    fs.pipe_file(victim, bytes(raw))
    bad = _cli("verify", root)
    assert bad.returncode == 1 and "BAD" in bad.stdout, bad.stdout
    assert victim.rsplit("/", 1)[-1] in bad.stdout, bad.stdout


def test_a_failed_upload_leaves_nothing_under_its_name(bucket: str) -> None:
    from tierswap.tiers.files import write_atomic

    fs, base = url_fs(f"s3://{bucket}/run")

    def pieces() -> Iterator[bytes]:
        yield b"x" * (2 * CHUNK)  # uploaded as a part already
        raise OSError("the writer's disk went away")

    with pytest.raises(OSError, match="went away"):
        write_atomic(fs, f"{base}/half", pieces())
    assert not fs.exists(f"{base}/half")


def test_a_job_persists_to_s3_and_a_new_one_resumes_from_it(
    bucket: str, tmp_path: Path, baseline
) -> None:
    """The first run is killed once tier 2 (S3) holds step 4 or later; the second, with
    S3 writing slower than the steps come (``slow:persist``), resumes from S3, says each
    step it defers or skips, and ends bit for bit as an uninterrupted run."""
    root = f"s3://{bucket}/job"
    base = baseline(nodes=2, mode="ddp")
    run_dir = tmp_path / "first"
    cmd = job_command(
        run_dir,
        ["--nodes", "2", "--persist", root, "--persist-every", "2"],
        ["--steps", "12", "--mode", "ddp", "--out", str(tmp_path / "first-final"), *SLOW],
    )
    with (tmp_path / "first.log").open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 120
            while not any(e["tier"] == 2 and e["step"] >= 4 for e in _commits(run_dir)):
                assert time.monotonic() < deadline, (tmp_path / "first.log").read_text()
                assert proc.poll() is None, (tmp_path / "first.log").read_text()
                time.sleep(0.2)
        finally:
            kill_job(proc.pid, run_dir)
            proc.wait()
    assert not events(run_dir, "job_finished")
    code, run_dir2, out = run_job(
        tmp_path,
        "second",
        steps=12,
        extra=(
            "--persist",
            root,
            "--persist-every",
            "2",
            "--inject",
            "slow:persist:seconds=1.5",
        ),
        train_args=("--sleep", "0.1"),
    )
    assert code == 0, out
    (restored,) = events(run_dir2, "restored")
    assert restored["step"] >= 4 and set(restored["tiers"].values()) == {2}
    assert_same_bits(base, final_state(tmp_path, "second"))
    deferred = events(run_dir2, "durable_step_deferred")
    assert deferred, "a slow tier 2 deferred no step"
    assert "tier 2 is behind" in out, out
    # every step that came due is in tier 2, or was said to be deferred
    durable_steps = {e["step"] for e in events(run_dir2, "snapshot_committed") if e["tier"] == 2}
    said = {e["step"] for e in deferred}
    for due in range(restored["step"] + 1, 12):
        if due % 2 == 0:
            assert due in durable_steps or due in said, (due, durable_steps, said)
    listed = catalog.list_steps(root)
    assert listed and all(s.committed for s in listed), listed
    assert not leaked_segments(tmp_path)


def test_a_root_whose_server_does_not_answer_is_said_in_a_line(tmp_path: Path) -> None:
    """A closed endpoint (a typo, the store down): one line naming the root, no traceback,
    for the commands that read a root and for a job that persists to one."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{port}",
               AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_MAX_ATTEMPTS="1",
               AWS_RETRY_MODE="standard")  # fmt: skip
    from tierswap.examples import EXAMPLE

    for args in (["ls", "s3://nowhere/root"],
                 ["run", "--nodes", "1", "--persist", "s3://nowhere/root", "--run-dir",
                  str(tmp_path / "run"), str(EXAMPLE), "--steps", "1"]):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "tierswap.cli", *args], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2, done.stderr[-2000:]
        assert "Traceback" not in done.stderr, done.stderr[-2000:]
        assert f"tierswap {args[0]}: s3://nowhere/root cannot be reached" in done.stderr

"""Helpers to run real jobs with ``tierswap run`` and compare their final states."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import torch

from tierswap.cluster.workers import STARTS_ALONE
from tierswap.examples import EXAMPLE, differing, job_command, load_final
from tierswap.shm import remove_job_segments

TRAIN = EXAMPLE


def run_job(
    tmp: Path,
    name: str,
    *,
    nodes: int = 2,
    nproc: int = 1,
    steps: int = 16,
    mode: str = "ddp",
    extra: tuple[str, ...] = (),
    train_args: tuple[str, ...] = (),
    script: Path = TRAIN,
    timeout: float = 180,
) -> tuple[int, Path, str]:
    """Run one job to its end. Returns (exit code, run dir, console output)."""
    run_dir = tmp / name
    cmd = job_command(
        run_dir,
        ["--nodes", str(nodes), "--nproc-per-node", str(nproc), *extra],
        ["--steps", str(steps), "--mode", mode, "--out", str(tmp / f"{name}-final"), *train_args],
        script,
    )
    log = tmp / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True
        )
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_job(proc.pid, run_dir)
            raise
    text = log.read_text()
    assert STARTS_ALONE not in text, f"the worker template was not used:\n{text[-3000:]}"
    return code, run_dir, text


def kill_job(launcher_pid: int, run_dir: Path) -> None:
    """SIGKILL the launcher's group and every agent's group (each agent is a session)."""
    pids = [launcher_pid]
    if (run_dir / "events.jsonl").exists():
        pids += [e["pid"] for e in events(run_dir) if e["event"] == "node_joined"]
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # a killed job leaves its tier-0 memory (no agent survived to unlink it)
    for started in events(run_dir, "job_started") if (run_dir / "events.jsonl").exists() else []:
        remove_job_segments(started["job_id"])


def events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    evs = [json.loads(line) for line in lines if line.strip()]
    return [e for e in evs if kind is None or e["event"] == kind]


def final_state(tmp: Path, name: str) -> dict[str, dict[str, torch.Tensor]]:
    return load_final(tmp / f"{name}-final")


def assert_same_bits(
    a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]
) -> None:
    assert a, "no final state was written"
    diff = differing(a, b)
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[:3]}"


def leaked_segments(tmp: Path) -> list[str]:
    """Shared-memory segments still there of the jobs run under ``tmp``."""
    ids = [
        e["job_id"]
        for ev in tmp.rglob("events.jsonl")
        for e in events(ev.parent)
        if e["event"] == "job_started"
    ]
    return [p.name for i in ids for p in Path("/dev/shm").glob(f"tierswap-{i}-*")]


def assert_hot_swapped(run_dir: Path, survivors: list[int], replaced: list[int]) -> None:
    """Every recovery kept the survivors' processes and redid at most one step."""
    resumed = events(run_dir, "resumed")
    assert resumed, "no recovery completed"
    for r in resumed:
        assert r["redone"] <= 1, r
        assert set(r["phases"]) == {"detect", "decide", "rebuild", "restore", "resume"}
        for rank in r["replaced"]:  # its own account of the way back, part by part
            parts = r["ranks"][str(rank)]
            assert {"enter", "plan", "load", "sync", "step", "snapshot"} <= set(parts), parts
            assert all(v >= 0 for v in parts.values()), parts
    pids = [{int(k): v for k, v in g["pids"].items()} for g in events(run_dir, "rebuilt")]
    for rank in survivors:
        assert len({p[rank] for p in pids}) == 1, f"rank {rank} was restarted: {pids}"
    for rank in replaced:
        assert len({p[rank] for p in pids}) > 1, f"rank {rank} kept a dead process: {pids}"

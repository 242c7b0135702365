"""The worker's side of the bench: a Snapshotter of rank 0 driving a real agent.

The agent (:mod:`tierswap.bench.agent`) runs in a process of its own, started here as
``python -m tierswap.bench.agent SOCKET JOB_ID`` with the socket's secret in the env.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from tierswap.control import protocol as p
from tierswap.shm import remove_job_segments
from tierswap.snapshot import Snapshotter
from tierswap.wire import Channel

log = logging.getLogger(__name__)
R = TypeVar("R", bound=p.Message)

NSLOTS = 3  # tier-0 slots of the rank: a job's with --persist (Config.tier0_slots)
SECRET_ENV = "TIERSWAP_BENCH_SECRET"


class BenchSync(p.Message, frozen=True, kw_only=True, tag="bench_sync"):
    """Wait for the agent's checksums in flight."""

    scoped = False


class BenchHolding(p.Message, frozen=True, kw_only=True, tag="bench_holding"):
    """Which slot holds ``step``, with the checksum the agent computed."""

    scoped = False
    step: int


class BenchPersist(p.Message, frozen=True, kw_only=True, tag="bench_persist"):
    """Write ``step`` to ``root`` as tier 2 would, timed."""

    scoped = False
    root: str
    step: int


class Holding(p.Message, frozen=True, kw_only=True, tag="bench_held"):
    scoped = False
    slot: int
    checksum: str


class Persisted(p.Message, frozen=True, kw_only=True, tag="bench_persisted"):
    scoped = False
    seconds: float
    nbytes: int


BenchRequest = BenchSync | BenchHolding | BenchPersist
"""The bench's own requests to its agent, beside the worker's."""


class Rig:
    """A Snapshotter of rank 0 and its agent in a process of its own."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.step = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.chan: Channel | None = None
        self.snap: Snapshotter | None = None

    def start(self, tmp: Path) -> None:
        secret = secrets.token_bytes(16)
        address = str(tmp / "agent.sock")
        env = {**os.environ, SECRET_ENV: secret.hex()}
        cmd = [sys.executable, "-m", "tierswap.bench.agent", address, self.job_id]
        self.proc = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + 120
        while self.chan is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                raise RuntimeError(f"bench agent: no listener at {address} (exit code {code})")
            with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
                self.chan = Channel.connect(address, secret, p.AgentToWorker | Holding | Persisted)
            time.sleep(0.02)
        self.snap = Snapshotter(self.chan, rank=0)

    @property
    def snapshotter(self) -> Snapshotter:
        assert self.snap is not None
        return self.snap

    def take(self, state: Mapping[str, Any], *, required: bool = True) -> None:
        """Snapshot ``state`` as the next step; a skip (no free slot) is counted in the
        stats, and is an error where the measurement needs this snapshot."""
        self.step += 1
        if not self.snapshotter.take(self.step, state) and required:
            raise RuntimeError(f"tierswap skipped step {self.step}: no free slot")

    def call(self, msg: p.Message, reply: type[R]) -> R:
        assert self.chan is not None
        return self.chan.call(msg, reply, timeout=600)

    def sync(self) -> None:
        """Wait, untimed, for the snapshot in flight to be reported and checked."""
        self.snapshotter.drain()
        self.call(BenchSync(), p.Ack)

    def close(self) -> None:
        """Stop the copy thread and the agent; remove any segment left behind."""
        try:
            if self.snap is not None:
                self.snap.close()
        finally:
            if self.chan is not None:
                self.chan.close()  # the agent sees EOF, unlinks its slots and exits
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=60 if self.chan is not None else 0)
                except subprocess.TimeoutExpired:
                    log.warning("bench agent %d did not exit; killing it", self.proc.pid)
                    self.proc.kill()
                    self.proc.wait(timeout=10)
            if left := remove_job_segments(self.job_id):
                log.warning("removed %d shared-memory segments the bench agent left", left)

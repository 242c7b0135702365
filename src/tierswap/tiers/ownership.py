"""One job per durable root: the root's name (``JOB``) and the running job's lease on it
(``LOCK``).

- ``ROOT/JOB`` names the job whose steps the root holds. The first job to persist there
  writes it; a job started on the root later resumes it under that name (the habit: run
  the job again with the same ``--persist``), or, given another ``--job-name``, is
  refused. Every COMMIT carries the name, and a step committed under another name (a step
  folder copied in from another job's root) is never restored.
- ``ROOT/LOCK`` is the lease of the job running on the root: its launch, host and pid,
  and when the lease ends (``LEASE_S`` after its last renewal; the coordinator renews it
  every ``LEASE_S / 3``). A second job finding a live lease is refused, naming the holder.
  A lease is taken over when it has ended, when its holder's process on this host is gone
  (a job killed and started again at once), or on purpose with ``--take-over-root``, for an
  operator who knows the holder is dead.

On object storage there is no atomic create: two jobs started in the same second could
both write LOCK; each reads it back after writing and the one that finds the other's name
stops. It is a lease between cooperating launchers, not a security boundary: who can write
the root can remove it (RELIABILITY.md says what protects a root).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import psutil

from tierswap.errors import CorruptPartError, UsageError
from tierswap.tiers.catalog import JOB_FILE, root_job
from tierswap.tiers.files import parse_json, read_small, url_fs, write_atomic

LOCK_FILE = "LOCK"
LEASE_S = 30.0
"""How long a job's claim on its root lasts without a renewal."""


class RootInUseError(UsageError):
    """The durable root is held by another running job, or belongs to another job."""


@dataclass(frozen=True, slots=True)
class Lease:
    holder: str
    """The launch that holds it (a fresh id per ``tierswap run``)."""
    job: str
    host: str
    pid: int
    started: float
    """The holder process's start time (psutil), so a reused pid is not taken for it."""
    expires: float
    """Wall-clock time the lease ends unless renewed."""

    def live(self, now: float) -> bool:
        if now >= self.expires:
            return False
        if self.host == socket.gethostname():  # a holder on this host must still run
            try:
                return abs(psutil.Process(self.pid).create_time() - self.started) < 1.0
            except psutil.Error:
                return False
        return True

    def describe(self) -> str:
        left = max(0.0, self.expires - time.time())
        return (
            f"job {self.job!r} (pid {self.pid} on host {self.host}, its lease ends in "
            f"{left:.0f} s unless renewed)"
        )


def _read_lease(fs: Any, base: str) -> Lease | None:
    path = f"{base}/{LOCK_FILE}"
    try:
        body = parse_json(path, read_small(fs, path, 1 << 16))
        return Lease(
            holder=str(body["holder"]), job=str(body["job"]), host=str(body["host"]),
            pid=int(body["pid"]), started=float(body["started"]),
            expires=float(body["expires"]),
        )  # fmt: skip
    except CorruptPartError as e:
        if e.why == "missing":
            return None
        if isinstance(e.__cause__, OSError):  # the root cannot be read just now
            raise e.__cause__ from None
        raise RootInUseError(f"{path}: {e.why}; remove it if no job runs on the root") from e
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RootInUseError(f"{path} is not a lease ({e}); remove it if no job runs") from e


class RootClaim:
    """This launch's claim on a durable root: taken at the start, renewed, let go."""

    def __init__(
        self, root: str, job: str | None, take_over: bool = False, holder: str | None = None
    ) -> None:
        """``holder``: the claim of a coordinator this one takes the job over from (the
        same job's lease, renewed by its new leader)."""
        self.root = root
        self.fs, self.base = url_fs(root)
        self.holder = holder or uuid.uuid4().hex
        self.take_over = take_over
        self.job = self._name(job)

    def _name(self, wanted: str | None) -> str:
        owner = root_job(self.fs, self.base)
        if owner is not None and wanted is not None and wanted != owner:
            raise RootInUseError(
                f"{self.root} holds the steps of job {owner!r}, not {wanted!r}: run with "
                f"--job-name {owner} to resume it, or give another --persist; nothing was "
                "changed in it"
            )
        return owner or wanted or f"job-{uuid.uuid4().hex[:12]}"

    def acquire(self) -> None:
        """Take the root, or raise RootInUseError naming the job that holds it."""
        held = _read_lease(self.fs, self.base)
        live = held is not None and held.holder != self.holder and held.live(time.time())
        if live and held is not None and not self.take_over:
            raise RootInUseError(
                f"{self.root} is in use by {held.describe()}: stop that job, or wait for its "
                "lease to end; if its host is gone for good, run with --take-over-root"
            )
        self.fs.makedirs(self.base, exist_ok=True)
        if root_job(self.fs, self.base) is None:
            body = {"format": 1, "job": self.job, "created": time.time()}
            write_atomic(self.fs, f"{self.base}/{JOB_FILE}", [json.dumps(body).encode()])
        self._write()
        time.sleep(0.05)  # a job that wrote at the same moment is seen by one of the two
        now = _read_lease(self.fs, self.base)
        if now is None or now.holder != self.holder:
            other = "another job" if now is None else now.describe()
            raise RootInUseError(f"{self.root} was claimed at the same moment by {other}")

    def renew(self) -> str | None:
        """Extend the lease; a reason if the root was taken over meanwhile (then this job
        must not write tier 2 any more). Raises OSError when the root cannot be read or
        written just now (full, read-only, unreachable): the lease is still this job's,
        and the next renewal tries again."""
        try:
            held = _read_lease(self.fs, self.base)
        except RootInUseError as e:
            return str(e)
        if held is not None and held.holder != self.holder:
            return f"{self.root} was taken over by {held.describe()}"
        self._write()
        return None

    def release(self) -> None:
        try:
            held = _read_lease(self.fs, self.base)
            if held is not None and held.holder == self.holder:
                self.fs.rm(f"{self.base}/{LOCK_FILE}")
        except (OSError, RootInUseError):
            pass  # the lease ends by itself

    def _write(self) -> None:
        proc = psutil.Process(os.getpid())
        body = {
            "holder": self.holder,
            "job": self.job,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": proc.create_time(),
            "expires": time.time() + LEASE_S,
        }
        write_atomic(self.fs, f"{self.base}/{LOCK_FILE}", [json.dumps(body).encode()])

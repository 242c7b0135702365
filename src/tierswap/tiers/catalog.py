"""What a tier-2 root holds as a whole: its step folders listed and judged (committed,
restorable, another job's, unreadable), the job it belongs to, every checksum verified,
and retention (old steps deleted, a half-written one discarded, never a base a kept
step's deltas need).

One step's files, their format and COMMIT are :mod:`tierswap.tiers.durable`'s; this
module only reads them through it, and deletes whole step folders (COMMIT first, so a
half-deleted step never reads as committed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import secrets
from dataclasses import dataclass
from typing import Any

from tierswap.errors import CorruptPartError
from tierswap.tiers import durable
from tierswap.tiers.durable import PartInfo
from tierswap.tiers.files import is_folder, parse_json, read_small, url_fs, write_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepInfo:
    """What one step folder holds."""

    step: int
    committed: bool
    world_size: int | None
    """From COMMIT; None if the step is not committed."""
    parts: dict[int, PartInfo]
    """From COMMIT; empty if the step is not committed."""
    present_ranks: list[int]
    """Ranks whose .json and data file (.safetensors, or .delta) are both in the folder."""
    nbytes: int
    """Bytes of all files in the folder."""
    restorable: bool = False
    """Committed, and every delta part's base is a committed step with a full part."""
    missing_bases: tuple[int, ...] = ()
    """Base steps its delta parts need that are not committed any more."""
    problem: str | None = None
    """Why the entry is not a step one can read (a symbolic link, a file, a folder that
    cannot be listed, a COMMIT that cannot be read, another job's); None for a sound one."""
    job: str | None = None
    """The job that committed it (COMMIT's ``job``; None for one that names none)."""

    @property
    def bases(self) -> set[int]:
        return {p.base for p in self.parts.values() if p.base is not None}


def _step_info(fs: Any, base: str, step: int) -> StepInfo:
    folder = durable.step_dir(base, step)
    if not is_folder(fs, folder):
        why = "is a symbolic link or a file, not a folder of the root: never read or deleted"
        return StepInfo(step, False, None, {}, [], 0, problem=why)
    try:
        files = fs.ls(folder, detail=True)
    except OSError as e:
        return StepInfo(step, False, None, {}, [], 0, problem=f"cannot be listed: {e}")
    regular = [f for f in files if f.get("type") == "file" and not f.get("islink")]
    sizes = {posixpath.basename(f["name"].rstrip("/")): int(f.get("size") or 0) for f in regular}
    present = sorted(
        {
            int(m.group(1))
            for name in sizes
            if (m := durable.PART_RE.fullmatch(name)) and f"rank-{m.group(1)}.json" in sizes
        }
    )
    world_size: int | None = None
    parts: dict[int, PartInfo] = {}
    problem, job = None, None
    if any(posixpath.basename(f["name"].rstrip("/")) == "COMMIT" for f in files):
        try:
            world_size, parts, job = durable.read_commit_job(fs, base, step)
        except CorruptPartError as e:
            log.warning("step %d is not committed: %s", step, e)
            problem = f"its COMMIT cannot be read: {e.why}"
    return StepInfo(
        step, world_size is not None, world_size, parts, present, sum(sizes.values()),
        problem=problem, job=job,
    )  # fmt: skip


def list_steps(root: str) -> list[StepInfo]:
    """Every step folder under ``root``, oldest first ([] if ``root`` does not exist)."""
    fs, base = url_fs(root)
    try:
        names = fs.ls(base, detail=False)
    except FileNotFoundError:
        return []
    owner = root_job(fs, base)
    steps = []
    for name in names:  # each entry is judged alone: a bad one never hides the others
        m = durable.STEP_RE.fullmatch(posixpath.basename(str(name).rstrip("/")))
        if m:
            steps.append(_step_info(fs, base, int(m.group(1))))
    for i, s in enumerate(steps):  # a step another job committed is not this root's
        if owner is not None and s.committed and s.job is not None and s.job != owner:
            why = f"committed by job {s.job!r}, and this root is job {owner!r}'s: never restored"
            steps[i] = dataclasses.replace(s, committed=False, world_size=None, parts={},
                                           problem=why)  # fmt: skip
    full = {s.step: {r for r, p in s.parts.items() if p.base is None} for s in steps}
    out = []
    for s in sorted(steps, key=lambda s: s.step):
        missing = sorted(
            {
                p.base
                for r, p in s.parts.items()
                if p.base is not None and r not in full.get(p.base, ())
            }
        )
        out.append(
            dataclasses.replace(
                s, restorable=s.committed and not missing, missing_bases=tuple(missing)
            )
        )
    return out


JOB_FILE = "JOB"
"""At the root: the name of the job whose steps it holds (``ownership.py``)."""


def root_job(fs: Any, base: str) -> str | None:
    """The job the root at ``base`` belongs to, from its JOB file (None without one)."""
    path = f"{base}/{JOB_FILE}"
    try:
        body = parse_json(path, read_small(fs, path, 1 << 16))
    except CorruptPartError as e:
        if e.why != "missing":
            log.warning("ignoring %s: %s", path, e.why)
        return None
    name = body.get("job") if isinstance(body, dict) else None
    return name if isinstance(name, str) else None


def committed_steps(root: str) -> list[int]:
    """Steps with a readable COMMIT, oldest first."""
    return [s.step for s in list_steps(root) if s.committed]


def restorable_steps(root: str) -> list[int]:
    """Committed steps whose delta parts' bases are there too, oldest first."""
    return [s.step for s in list_steps(root) if s.restorable]


def verify(root: str, step: int | None = None) -> list[str]:
    """Check every part of every committed step (or of ``step``): [] if all are sound.

    Each problem names the file and what is wrong with it.
    """
    fs, base = url_fs(root)
    listed = list_steps(root)
    problems = [
        f"{durable.step_dir(base, s.step)}: {s.problem}"
        for s in listed
        if s.problem is not None and step in (None, s.step)
    ]
    steps = [step] if step is not None else [s.step for s in listed if s.committed]
    if not steps:
        return problems or [f"{root}: no committed step"]
    for s in steps:
        try:
            world_size, parts, _ = durable.read_commit_job(fs, base, s)
        except CorruptPartError as e:
            problems.append(str(e))
            continue
        for rank in range(world_size):
            try:
                durable.check_part(fs, base, s, rank, parts[rank])
            except CorruptPartError as e:
                problems.append(str(e))
    return problems


def retain(root: str, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` restorable steps (and the newest committed one),
    keeping every base step their delta parts need, and uncommitted folders older than the
    newest committed step. Returns the deleted steps."""
    if keep < 1:
        raise ValueError(f"retain(keep={keep}): keep at least 1 (the newest committed step)")
    steps = list_steps(root)
    committed = [s.step for s in steps if s.committed]
    if not committed:
        return []
    restorable = [s for s in steps if s.restorable]
    kept = {committed[-1], *(s.step for s in restorable[-keep:])}
    kept |= {b for s in steps if s.step in kept for b in s.bases}  # never a needed base
    doomed = [s.step for s in steps if s.step not in kept and s.step < committed[-1]]
    fs, base = url_fs(root)
    for s in list(doomed):
        folder = durable.step_dir(base, s)
        if not is_folder(fs, folder):  # a symbolic link or a file: never followed, left
            doomed.remove(s)
            continue
        if fs.exists(f"{folder}/COMMIT"):
            fs.rm(f"{folder}/COMMIT")  # first, so a half-deleted step is never "committed"
        fs.rm(folder, recursive=True)
    return doomed


def discard(root: str, step: int) -> bool:
    """Delete what was written of ``step`` if it has no COMMIT (a step that failed half
    way: its parts would take room for nothing). A committed step, or a folder that is a
    link or a file, is left. True when something was deleted."""
    fs, base = url_fs(root)
    folder = durable.step_dir(base, step)
    if not is_folder(fs, folder) or fs.exists(f"{folder}/COMMIT"):
        return False
    fs.rm(folder, recursive=True)
    return True


def probe_writable(root: str) -> str | None:
    """None if a small file can be written to (and removed from) ``root``, else why not."""
    try:
        fs, base = url_fs(root)
        fs.makedirs(base, exist_ok=True)
        path = f"{base}/.probe-{os.getpid()}-{secrets.token_hex(4)}"
        write_atomic(fs, path, [b"tierswap write probe\n"])
        fs.rm(path)
    except Exception as e:  # any backend's error means "not writable": the caller reports it
        return f"{root} is not writable: {type(e).__name__}: {e}"
    return None

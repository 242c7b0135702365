"""``tierswap bench peers``: the tools a user would pick instead of tierswap, on the same
model in the same run, interleaved with tierswap's own runs.

The model is the reference MLP (``tierswap.examples.mlp``: 384 MiB of state per rank by
default, DDP on 2 ranks, 1 torch thread each, batch 32); tierswap trains it with
``examples/train_mlp.py``, the peers with ``bench/peers/train_peer.py`` in the peers' own
Python (``--peers-python``, made by ``make bench-peers``). Every job runs with torch's
allocator on transparent huge pages (:func:`same_env`, tierswap's default for its
workers). Rounds interleave every system, the order flipped every other round.

A) a checkpoint every step, 14 steps: the median step (steps 4 to 12, rank 0's step ends),
the stall per checkpoint (per step the longest any rank spent in the checkpoint call,
median over those steps) and the step overhead against the plain run of the same round:
``plain`` (tierswap's script with ``--plain``), ``memcpy`` (the same with a bare memcpy
of the state on a thread every step: the floor of any copy, ``train_mlp.BareCopy``),
tierswap tier 0, tiers 0+1 and 0+1+2 (``--persist`` to a local folder every step),
DLRover's flash checkpoint to memory, ``dcp.async_save`` and ``torch.save`` (rank 0,
fsynced, renamed over the last).

B) recovery from rank 1 killed right after step 8: from the victim's own end of step 8
(its ``--times`` entry, written before it dies) to the moment every rank completed a
step after its own step-8 entry; and whether the run ends bit for bit equal to an
uninterrupted run of the same system (``--out``, ``tierswap.examples.differing``).
tierswap's uninterrupted run is the first round's ``tier01`` job, DLRover's its
``dlrover-memory`` job (each is one, with ``--out``) where that runs. tierswap's worker
and node kills with a spare also give ``bench recovery``'s account of the way back at this
size (``recovery_curve``: each part beside its floor, the machine's limits measured once
in every round, after its jobs), so ``bench all`` does not run those jobs twice.

C) ``bench overhead``'s figures (:mod:`tierswap.bench.overhead`), from the same rounds:
tierswap's ``plain``, ``memcpy``, ``tier0`` and ``tier01`` jobs, and their pinned twins
(tierswap's own work on a core of its own) interleaved with them, with the agents' CPU
sampled. Its stall
is the median over every rank's steps, the checkpoint table's the longest rank's per step.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tierswap
from tierswap.bench import limits, overhead, recovery
from tierswap.bench.common import Stats, run_bounded, stats
from tierswap.cluster.address import HUGE_PAGES_ENV
from tierswap.config import Config as TierswapConfig
from tierswap.examples import FOLDER, differing, job_command, load_final
from tierswap.shm import remove_job_segments
from tierswap.tunables import TUNABLES_ENV, nt_tunables

MLP = FOLDER / "train_mlp.py"
STEPS, KILL, VICTIM = 14, 8, 1
FIRST = 4
"""Steps before this one are left out of step times and stalls: first saves allocate."""
PEER_LIBS = {"dlrover": "dlrover.trainer.torch.flash_checkpoint.ddp", "torchft": "torchft"}
"""What a system needs in the peers' Python, by the name ``not_run`` gives."""

CHECKPOINT = ("plain", "memcpy", "tier0", "tier01", "tier012", "dlrover-memory", "dcp-async",
              "torch-save")  # fmt: skip
CONTROLS = ("plain", "memcpy")
"""The checkpoint systems that are the others' yardsticks, not tools a user would pick."""
RECOVERY = ("tierswap-worker-spare", "tierswap-node-spare", "tierswap-restart",
            "dlrover-restart", "torchft-heal", "torchrun-dcp")  # fmt: skip
TIERSWAP_RUN = {
    "plain": ("--replicas", "0"),
    "memcpy": ("--replicas", "0"),
    "tier0": ("--replicas", "0"),
    "tier01": (),
    "tier012": ("--persist-every", "1"),  # and --persist <folder>
    "tierswap-worker-spare":
        ("--spare-workers", "1", "--inject", f"kill:rank={VICTIM}:step={KILL}"),
    "tierswap-node-spare": ("--spares", "1", "--inject", f"kill:node={VICTIM}:step={KILL}"),
    "tierswap-restart": ("--inject", f"kill:rank={VICTIM}:step={KILL}"),
}  # fmt: skip
"""``tierswap run`` options of each tierswap system (2 nodes of 1 rank each)."""
PEER_SYSTEM = {
    "dlrover-memory": "dlrover",
    "dlrover-restart": "dlrover",
    "torchft-heal": "torchft",
    "torchrun-dcp": "torchrun-dcp",
    "dcp-async": "dcp-async",
    "torch-save": "torch-save",
}
"""``train_peer.py --system`` of each peer system."""
REFERENCE = {s: "tierswap" for s in RECOVERY if s.startswith("tierswap")} | {
    "dlrover-restart": "dlrover",
    "torchft-heal": "torchft",
    "torchrun-dcp": "torchrun-dcp",
}
"""The uninterrupted run each recovery is compared with, bit for bit."""
OWN_REFERENCE = {"tierswap": "tier01", "dlrover": "dlrover-memory"}
"""The checkpoint system whose first-round job is also that system's uninterrupted run
for the recoveries (the same command with no kill; its final state written too), so the
reference costs no job of its own where it runs."""
ACCOUNTED = {"tierswap-worker-spare": "worker", "tierswap-node-spare": "node"}
"""The recoveries whose events also give ``bench recovery``'s account of the way back
(:func:`tierswap.bench.recovery.account`) at this size, by its kill's name there."""
BASE_CKPT, BASE_RECOVERY = "tier0", "tierswap-worker-spare"
"""The tierswap systems the peers' ratios are taken against."""
PINNED = "-pinned"
"""The suffix of a tierswap system's pinned twin (``tier0-pinned``: ``overhead.pin_args``)."""
OVERHEAD = {s + pin: s + pin.replace("-", "_") for s in ("plain", "memcpy", "tier0", "tier01")
            for pin in ("", PINNED)}  # fmt: skip
"""The systems whose jobs also give ``bench overhead``'s figures, by their keys there."""


def tierswap_side(system: str) -> bool:
    """Whether ``system`` is trained by ``tierswap run`` (not a peer's launcher)."""
    base = system.removesuffix(PINNED)
    return base.startswith("tier") or base in (*CONTROLS, "tierswap")


def peers_folder() -> Path:
    """``bench/peers`` of the checkout tierswap runs from."""
    folder = Path(tierswap.__file__).resolve().parents[2] / "bench" / "peers"
    if not (folder / "train_peer.py").is_file():
        raise FileNotFoundError(
            f"{folder / 'train_peer.py'}: the peer scripts are missing. `tierswap bench peers` "
            "runs from a checkout of the repository (an installed wheel has no bench/)"
        )
    return folder


def recovery_seconds(
    notes: Sequence[dict[str, Any]],
    kill_t: float | None = None,
    victim: int = VICTIM,
    kill: int = KILL,
) -> float:
    """Seconds from the kill to the last rank's first step completed after it.

    The kill is the victim's own end of step ``kill`` (its entry, written just before it
    dies); per rank, the first entry after its own step-``kill`` entry, in file order (a
    restarted process appends to the same file). Where the victim's entries died with it
    (a script that buffers its times file), ``kill_t`` gives the moment from elsewhere;
    then per rank the first entry later than it."""
    if kill_t is None:
        own = next((n for n in notes if n["rank"] == victim and n["step"] == kill), None)
        if own is None:
            raise ValueError(f"rank {victim} wrote no step-{kill} entry and no kill time is given")
        kill_t = float(own["t"])
        seen: set[int] = set()
        after: dict[int, float] = {}
        for n in notes:
            rank = int(n["rank"])
            if rank in seen and rank not in after:
                after[rank] = float(n["t"])
            elif n["step"] == kill:
                seen.add(rank)
        ranks = seen
    else:
        after = {}
        for n in notes:
            if float(n["t"]) > kill_t:
                after.setdefault(int(n["rank"]), float(n["t"]))
        ranks = {int(n["rank"]) for n in notes}
    if missing := sorted(ranks - set(after)):
        raise ValueError(f"ranks {missing} completed no step after the kill")
    return max(after.values()) - kill_t


def injected_kill(run_dir: Path) -> float | None:
    """The ``time.monotonic()`` at which tierswap's injected kill fired (its
    ``fault_injected`` event, wall clock, taken to the monotonic clock), or None."""
    events = run_dir / "events.jsonl"
    if not events.exists():
        return None
    offset = time.time() - time.monotonic()
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "fault_injected" and str(e.get("spec", "")).startswith("kill:"):
            return float(e["time"]) - offset
    return None


def same_bits(ref: Path, run: Path) -> tuple[list[str], list[str]]:
    """The model and optimizer tensors that differ between two ``--out`` folders, and
    apart from them the RNG states that do (tierswap's script saves those too)."""
    diff = differing(load_final(ref), load_final(run))
    rng = [d for d in diff if "__rng__" in d]
    return [d for d in diff if "__rng__" not in d], rng


def checkpoint_costs(notes: Sequence[dict[str, Any]], steps: int = STEPS) -> dict[str, float]:
    """The median step (rank 0's step ends) and the median stall per checkpoint (per step
    the longest any rank spent in it), over steps ``FIRST`` to the second last."""
    import statistics

    window = range(FIRST, steps - 1)
    ends = {n["step"]: float(n["t"]) for n in notes if n["rank"] == 0}
    step_s = [ends[s] - ends[s - 1] for s in window if s in ends and s - 1 in ends]
    stall: dict[int, float] = {}
    for n in notes:
        if n["step"] in window:
            stall[n["step"]] = max(stall.get(n["step"], 0.0), float(n["stall"]))
    if not step_s:
        raise ValueError(f"no step ends of rank 0 in steps {FIRST} to {steps - 2}")
    return {"step_s": statistics.median(step_s), "stall_s": statistics.median(stall.values())}


def exactness(flags: Sequence[bool]) -> str:
    """``k/n`` of the runs that ended bit for bit equal to the uninterrupted one."""
    return f"{sum(flags)}/{len(flags)}"


def ratios(ours: Sequence[float], theirs: Sequence[float]) -> Stats | None:
    """Stats of ``theirs / ours`` round by round; ours is taken as at least a microsecond
    (a stall that rounds to 0 is not left out, which would keep only our worst rounds)."""
    rs = [t / max(o, 1e-6) for o, t in zip(ours, theirs, strict=False)]
    return stats(rs) if rs else None


@dataclass(kw_only=True, slots=True)
class Config:
    """What one ``tierswap bench peers`` measures, and with which Pythons."""

    size_mib: int
    """MiB of state per rank."""
    repeats: int
    """Rounds of every system (each system once a round)."""
    peers_python: Path | None
    """The Python with DLRover and torchft; None: torch-only peers run with this one."""
    only: frozenset[str] | None = None
    """Run only these systems (plus the plain run, the pinned twins and the references
    they need)."""
    timeout_s: float = 0.0
    """Seconds one job may take before it is killed; 0 picks one from the size."""
    steps: int = STEPS
    """Steps of every job (the recoveries need the default: their kill is at step 8)."""
    pinned: bool = True
    """Also run the pinned twins of tierswap's plain, tier0 and tier01 jobs (``OVERHEAD``)."""
    budget_s: float = 0.0
    """Seconds the whole run may take (``bench all`` gives its deadline less a margin):
    a round that would end past it, at the pace of the rounds before, is not started, and
    the report says how many ran. 0: no budget."""

    def __post_init__(self) -> None:
        if self.size_mib < 1 or self.repeats < 1:
            raise ValueError(f"--size-mib {self.size_mib}, --repeats {self.repeats}: use >= 1 each")
        if self.only is not None and (unknown := sorted(self.only - set(CHECKPOINT + RECOVERY))):
            raise ValueError(
                f"--only {' '.join(unknown)}: not a system of bench peers; "
                f"the systems: {' '.join(CHECKPOINT + RECOVERY)}"
            )
        recovering = set(RECOVERY) if self.only is None else self.only & set(RECOVERY)
        if self.steps < FIRST + 2 or (recovering and self.steps < KILL + 3):
            raise ValueError(
                f"steps {self.steps}: the step times start at step {FIRST}, a recovery's kill "
                f"is after step {KILL}; use at least {KILL + 3 if recovering else FIRST + 2}"
            )
        if self.peers_python is not None:
            # absolute, not resolved: the jobs run in folders of their own, and a venv's
            # python is a link that must stay inside its venv to find its packages
            self.peers_python = self.peers_python.absolute()
        if self.peers_python is not None and not self.peers_python.exists():
            raise ValueError(
                f"--peers-python {self.peers_python}: no such file; "
                "run `make bench-peers` to make .venv-peers"
            )
        if not self.timeout_s:
            self.timeout_s = 180.0 + 1.5 * self.size_mib


def default_peers_python() -> Path | None:
    path = Path(tierswap.__file__).resolve().parents[2] / ".venv-peers" / "bin" / "python"
    return path if path.exists() else None


def _probe(python: Path | None) -> dict[str, Any]:
    """Versions of torch and the peers in ``python`` (None where a peer is missing)."""
    code = (
        "import importlib, importlib.metadata as m, json\n"
        "out = {}\n"
        f"for name, mod in {dict(PEER_LIBS, torch='torch')!r}.items():\n"
        "    try:\n"
        "        importlib.import_module(mod)\n"
        "        out[name] = m.version(name)\n"
        "    except Exception as e:\n"
        "        out[name] = None\n"
        "        out[name + '_error'] = repr(e)[:300]\n"
        "print(json.dumps(out))\n"
    )
    exe = str(python) if python is not None else sys.executable
    res = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"{exe} could not report its packages:\n{res.stderr[-2000:]}")
    found: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    found["python"] = exe
    return found


@dataclass(slots=True)
class Bench:
    """One run of the benchmark: its folder, Pythons, and what it collected."""

    cfg: Config
    work: Path
    python: str
    """The Python the peer scripts run with."""
    scripts: Path
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    references: dict[str, Path] = field(default_factory=dict)
    accounts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """The :data:`ACCOUNTED` recoveries' own accounts, by kill."""
    count: int = 0

    def state_bytes(self) -> int:
        """A rank's state as its tierswap jobs read it off their rings, else the size asked
        for: the bytes per pass of the machine's limits the floors are taken at."""
        found = [a[0]["rank_state_bytes"] for a in self.accounts.values() if a]
        return int(found[0]) if found else self.cfg.size_mib * 2**20

    # --- commands -------------------------------------------------------------------
    def _script_args(self, folder: Path, out: bool) -> list[str]:
        args = [
            "--steps",
            str(self.cfg.steps),
            "--size-mib",
            str(self.cfg.size_mib),
            "--times",
            str(folder / "times.jsonl"),
        ]
        return [*args, "--out", str(folder / "out")] if out else args

    def tierswap_cmd(self, system: str, folder: Path, out: bool = False) -> list[str]:
        base = system.removesuffix(PINNED)
        run_args = ["--nodes", "2", *TIERSWAP_RUN.get(base, ())]
        if base == "tier012":
            run_args += ["--persist", str(folder / "persist")]
        if system.endswith(PINNED):
            run_args += overhead.pin_args()
        out = out or system in RECOVERY or system == "tierswap"
        script = self._script_args(folder, out=out)
        control = {"plain": ["--plain"], "memcpy": ["--plain", "--memcpy"]}.get(base, [])
        return job_command(folder / "run", run_args, [*script, *control], script=MLP)

    def peer_cmd(self, system: str, folder: Path, kind: str, out: bool = False) -> list[str]:
        peer = PEER_SYSTEM.get(system, system)
        script = str(self.scripts / "train_peer.py")
        kill = kind == "recovery"
        args = [*self._script_args(folder, out=out or kind != "checkpoint"), "--ckpt",
                str(folder / "ckpt"), *(["--kill-step", str(KILL)] if kill else [])]  # fmt: skip
        if peer == "torchft":
            pair = str(self.scripts / "torchft_pair.py")
            return [self.python, pair, "--groups", "2", "--", *args]
        if peer == "dlrover":
            launch = [self.python, str(self.scripts / "dlrover_standalone.py"), "--standalone",
                      "--nproc_per_node", "2", "--max_restarts", "1"]  # fmt: skip
        else:
            launch = [self.python, "-m", "torch.distributed.run", "--standalone",
                      "--nproc-per-node", "2", "--max-restarts", "1",
                      "--monitor-interval", "0.1"]  # fmt: skip
        return [*launch, script, "--system", peer, *args]

    # --- one job --------------------------------------------------------------------
    def job(
        self,
        system: str,
        kind: str,
        out: bool = False,
        watch: Callable[[Path], AbstractContextManager[Any]] | None = None,
    ) -> Path | None:
        """Run one job of ``system`` (``kind``: checkpoint, recovery or reference; ``out``:
        a checkpoint job writes its final state too; ``watch``: entered with the job's run
        folder while it runs); its folder, or None when it failed (then the failure is
        recorded)."""
        self.count += 1
        folder = self.work / f"{self.count:03d}-{system}-{kind}"
        folder.mkdir()
        ours = tierswap_side(system)
        if ours:
            cmd = self.tierswap_cmd(system, folder, out)
        else:
            cmd = self.peer_cmd(system, folder, kind, out)
        before = _leftovers()
        env_tmp = folder / "tmp"
        env_tmp.mkdir()
        run_dir = folder / "run" if ours else None
        t0 = time.monotonic()
        with watch(folder / "run") if watch is not None else contextlib.nullcontext():
            code = _bounded(cmd, folder, self.cfg.timeout_s, env_tmp, run_dir)
        took = time.monotonic() - t0
        _clean(before, run_dir)
        shutil.rmtree(folder / "ckpt", ignore_errors=True)
        shutil.rmtree(folder / "persist", ignore_errors=True)
        shutil.rmtree(env_tmp, ignore_errors=True)
        print(f"  {system} ({kind}): exit {code} in {took:.1f} s", flush=True)
        if code != 0:
            log = (folder / "output.log").read_text(errors="replace")
            self.failures.append(f"{system} ({kind}), exit {code} after {took:.0f} s: "
                                 f"{failure_text(log)}")  # fmt: skip
            return None
        return folder

    def checkpoint(
        self, system: str, reference: str | None = None, sample: bool = False
    ) -> tuple[dict[str, float] | None, dict[str, float] | None]:
        """One checkpoint job's costs, and (``sample``: its agents' CPU sampled while it
        runs) its ``bench overhead`` figures; each None where it could not be had (the
        failure recorded). ``reference``: the job is also the uninterrupted run of that
        system (:data:`OWN_REFERENCE`); if it fails, the recoveries run one of their own."""
        sampler: overhead.Sampler | None = None

        def watch(run_dir: Path) -> overhead.Sampler:
            nonlocal sampler
            sampler = overhead.Sampler(run_dir)
            return sampler

        folder = self.job(system, "checkpoint", reference is not None, watch if sample else None)
        if folder is None:
            return None, None
        notes = _notes(folder)
        costs = figures = None
        try:
            costs = checkpoint_costs(notes, self.cfg.steps)
        except ValueError as e:
            self.failures.append(f"{system} (checkpoint): {e}")
        if reference is not None and costs is not None:
            self.references[reference] = folder
        if sample:
            try:
                if sampler is None:
                    raise ValueError("its agents' CPU was not sampled")
                snapshots = system.removesuffix(PINNED) not in CONTROLS
                figures = overhead.job_costs(
                    notes, sampler, snapshots, self.cfg.size_mib, self.cfg.steps
                )
            except ValueError as e:
                self.failures.append(f"{system} (overhead): {e}")
        return costs, figures

    def recovery(self, system: str) -> dict[str, Any] | None:
        ref = self.reference(REFERENCE[system])
        folder = self.job(system, "recovery")
        if folder is None:
            return None
        notes = _notes(folder)
        fired = injected_kill(folder / "run")
        first = next((n for n in notes if n["rank"] == VICTIM and n["step"] == KILL), None)
        # the victim's own entry, unless it died in a buffer: then the first step-8 entry
        # of its rank is a redo by its replacement, later than the injection
        own = first is not None and (fired is None or float(first["t"]) <= fired)
        kill_t = None if own else fired
        if system in ACCOUNTED:  # its own events, whatever its times file says
            try:
                acc = recovery.account(folder / "run", TierswapConfig().tier0_slots)
                self.accounts.setdefault(ACCOUNTED[system], []).append(acc)
            except (KeyError, ValueError, IndexError, TypeError, OSError) as e:
                self.failures.append(f"{system} (its account of the way back): {e!r}")
        try:
            seconds = recovery_seconds(notes, kill_t)
        except ValueError as e:
            self.failures.append(f"{system} (recovery): {e}")
            return None
        diff, rng = ([], []) if ref is None else same_bits(ref / "out", folder / "out")
        shutil.rmtree(folder / "out", ignore_errors=True)
        return {
            "seconds": seconds,
            "exact": None if ref is None else not diff and not rng,
            "differing": diff[:5],
            "rng_differing": rng[:5],
            "kill_from": "victim's times" if own else "fault_injected event",
        }

    def reference(self, system: str) -> Path | None:
        """The uninterrupted run of ``system``, run once."""
        if system not in self.references:
            folder = self.job(system, "reference")
            if folder is None:
                return None
            self.references[system] = folder
        return self.references[system]


def failure_text(log: str, chars: int = 1500) -> str:
    """What a failed job's output says of why: its first Python traceback where the end
    of the output does not hold it (a launcher's summary of a failed child, after the
    child's own traceback), then the end of the output."""
    tail = log[-chars:]
    first = log.find("Traceback (most recent call last)")
    if first < 0 or first >= len(log) - chars:
        return tail
    end = log.find("\n\n", first)
    block = log[first : end if end > 0 else first + chars][:chars]
    return f"first traceback:\n{block}\n[...]\nend of its output:\n{tail}"


def same_env() -> dict[str, str]:
    """Given to every system's jobs: what tierswap's agent gives its workers by default
    (``worker_env``), so that no system's step or restore runs under other settings than
    another's: torch's CPU allocator on transparent huge pages (no 4 KiB page faults) and
    glibc's non-temporal threshold at 1 MiB (large copies around the cache). A value
    already set (``THP_MEM_ALLOC_ENABLE=0``, to compare without) is kept, for every system
    alike."""
    out = {HUGE_PAGES_ENV: os.environ.get(HUGE_PAGES_ENV, "1")}
    tunables = nt_tunables(dict(os.environ)).get(TUNABLES_ENV)
    return out if tunables is None else {**out, TUNABLES_ENV: tunables}


def _bounded(cmd: list[str], folder: Path, timeout: float, tmp: Path, run_dir: Path | None) -> int:
    """``run_bounded`` with the peers' temporary files (torchrun's logs) in ``tmp`` and
    :func:`same_env` set."""
    changed = {"TMPDIR": str(tmp), **same_env()}
    old = {k: os.environ.get(k) for k in changed}
    os.environ.update(changed)
    try:
        return run_bounded(cmd, folder / "output.log", folder, timeout, run_dir)
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


LEFTOVER_DIRS = (Path("/dev/shm"), Path("/tmp/ckpt_sock"), Path("/tmp/dlrover"))
"""Where DLRover leaves its shared memory, sockets and event logs, whatever TMPDIR says."""


def _leftovers(dirs: tuple[Path, ...] = LEFTOVER_DIRS) -> set[Path]:
    """What is in those folders now, and the folders themselves."""
    return {x for d in dirs if d.is_dir() for x in (d, *d.iterdir())}


def _clean(before: set[Path], run_dir: Path | None, dirs: tuple[Path, ...] = LEFTOVER_DIRS) -> None:
    """Remove what the job left in the shared places: DLRover's files that were not there
    before it (and its folders, when it made them), and a tierswap job's shared memory
    (its ids from its event log). Of /dev/shm, only DLRover's own segments."""
    for x in _leftovers(dirs) - before:
        if x.parent == dirs[0] and "_ckpt_shm_" not in x.name:
            continue  # another program's shared memory
        if x.is_dir():
            shutil.rmtree(x, ignore_errors=True)
        else:
            x.unlink(missing_ok=True)
    events = None if run_dir is None else run_dir / "events.jsonl"
    if events is not None and events.exists():
        for line in events.read_text().splitlines():
            if '"job_started"' in line:
                remove_job_segments(str(json.loads(line)["job_id"]))


def _notes(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (folder / "times.jsonl").read_text().splitlines() if x.strip()]


def plan(cfg: Config, have: dict[str, Any]) -> tuple[list[str], list[str], dict[str, str]]:
    """The checkpoint and recovery systems to run, and those that cannot (with why)."""
    not_run: dict[str, str] = {}
    for system in CHECKPOINT + RECOVERY:
        lib = next((lib for lib in PEER_LIBS if system.startswith(lib)), None)
        if lib is not None and not have.get(lib):
            why = have.get(f"{lib}_error", "not installed")
            not_run[system] = (
                f"{have['python']} has no {lib} ({why}): "
                "run `make bench-peers`, or give --peers-python"
            )
    wanted = set(CHECKPOINT + RECOVERY) if cfg.only is None else set(cfg.only)
    ckpt = [s for s in CHECKPOINT if s in wanted and s not in not_run]
    if ckpt and "plain" not in ckpt:
        ckpt.insert(0, "plain")  # the overheads' baseline
    rec = [s for s in RECOVERY if s in wanted and s not in not_run]
    return ckpt, rec, not_run


def run(cfg: Config) -> dict[str, Any]:
    scripts = peers_folder()
    have = _probe(cfg.peers_python)
    ckpt, rec, not_run = plan(cfg, have)
    out: dict[str, Any] = {
        "config": {
            "size_mib": cfg.size_mib,
            "repeats": cfg.repeats,
            "steps": cfg.steps,
            "pinned_twins": cfg.pinned,
            "kill_step": KILL,
            "victim_rank": VICTIM,
            "ranks": 2,
            "threads": 1,
            "batch": 32,
            "cpus": len(os.sched_getaffinity(0)),
            "peers": have,
            "tierswap_python": sys.executable,
            "settings": SETTINGS,
            "env": same_env(),
        },
        "not_run": not_run,
    }
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tierswap-bench-peers-") as tmp:
        bench = Bench(cfg, Path(tmp), have["python"], scripts)
        sampled, twins = overhead_plan(cfg, ckpt, not_run)
        ck: dict[str, list[dict[str, float] | None]] = {s: [] for s in ckpt}
        ov: dict[str, list[dict[str, float] | None]] = {OVERHEAD[s]: [] for s in sampled}
        rc: dict[str, list[dict[str, Any] | None]] = {s: [] for s in rec}
        lims: list[dict[str, Any]] = []
        # a reference is round 1's job of OWN_REFERENCE (run before any recovery) if it runs
        needed = {REFERENCE[s] for s in rec}
        own = {s: ref for ref, s in OWN_REFERENCE.items() if ref in needed and s in ckpt}
        for name in sorted(needed - set(own.values())):  # first: also warms the page cache
            bench.reference(name)
        rounds_start = time.monotonic()
        for r in range(cfg.repeats):
            if not _round_fits(cfg.budget_s, t_start, rounds_start, r):
                print(f"round {r + 1} of {cfg.repeats} not run: the budget", flush=True)
                out["config"]["rounds_run"] = r
                out["config"]["stopped"] = (
                    f"{r} of {cfg.repeats} rounds: another would end past the run's budget "
                    f"of {cfg.budget_s:.0f} s at the pace of those before"
                )
                break
            print(f"round {r + 1} of {cfg.repeats}", flush=True)
            for system in _order(ckpt + twins, r):
                ref = own.get(system)
                ref = None if ref in bench.references else ref
                costs, figures = bench.checkpoint(system, reference=ref, sample=system in sampled)
                if system in ck:
                    ck[system].append(costs)
                if system in sampled:
                    ov[OVERHEAD[system]].append(figures)
            for system in _order(rec, r):
                rc[system].append(bench.recovery(system))
            if ov or bench.accounts:  # the limits between the jobs, as the machine is now
                lims.append(limits.measure(bench.state_bytes(), 1, Path(tmp)))
        if len(lims) < 3 and (ov or bench.accounts):  # 3 samples at least, for a median
            lims.append(limits.measure(bench.state_bytes(), 3 - len(lims), Path(tmp)))
        lim = limits.pooled(lims) if lims else {}
        kinds: list[str] = [k for k in ("worker", "node") if k in bench.accounts]
        if ov:
            memcpy, tcp_cpu = lim["memcpy"]["median"], lim["tcp_cpu"]["median"]
            out["overhead"] = overhead.summarize(ov, memcpy, cfg.size_mib, cfg.steps, tcp_cpu)
        if bench.accounts:  # bench recovery's figures at this size, from the same jobs
            runs: dict[str, list[dict[str, Any]]] = {k: bench.accounts[k] for k in kinds}
            out["recovery_curve"] = {str(cfg.size_mib): recovery.size_entry(runs, lim)}
    out["checkpoint"] = summarize_checkpoint(ck)
    out["recovery"] = summarize_recovery(rc)
    out["failures"] = bench.failures
    out["config"]["seconds"] = time.monotonic() - t_start
    return out


def _round_fits(budget_s: float, t_start: float, rounds_start: float, done: int) -> bool:
    """Whether round ``done + 1`` ends within ``budget_s`` of ``t_start``, at the pace of
    the rounds done (each as long as their mean); the first always runs."""
    if not budget_s or not done:
        return True
    now = time.monotonic()
    return now + (now - rounds_start) / done <= t_start + budget_s


def overhead_plan(
    cfg: Config, ckpt: list[str], not_run: dict[str, str]
) -> tuple[list[str], list[str]]:
    """The checkpoint systems whose jobs also give ``bench overhead``'s figures (none
    unless a snapshotting one runs), and the pinned twins to run beside them (a reason
    in ``not_run`` where they cannot)."""
    if not {"tier0", "tier01"} & set(ckpt):
        return [], []
    sampled = [s for s in ckpt if s in OVERHEAD]
    if not cfg.pinned:
        return sampled, []
    twins = [s + PINNED for s in sampled]
    try:
        overhead.pin_args()
    except ValueError as e:
        for twin in twins:
            not_run[twin] = str(e)
        return sampled, []
    return sampled + twins, twins


def _order(systems: list[str], r: int) -> list[str]:
    return systems[:: -1 if r % 2 else 1]


def summarize_checkpoint(runs: dict[str, list[dict[str, float] | None]]) -> dict[str, Any]:
    """Per system the stats of its step and stall, its overhead against the plain run of
    the same round, and its ratios to tierswap's ``BASE_CKPT`` round by round."""
    out: dict[str, Any] = {}
    plain = runs.get("plain", [])
    base = runs.get(BASE_CKPT, [])
    for system, rs in runs.items():
        ok = [r for r in rs if r is not None]
        if not ok:
            out[system] = {"failed": len(rs)}
            continue
        entry: dict[str, Any] = {k: stats([r[k] for r in ok]) for k in ("step_s", "stall_s")}
        pairs = [(r, p) for r, p in zip(rs, plain, strict=False) if r is not None and p is not None]
        if pairs and system != "plain":
            entry["overhead"] = stats([r["step_s"] / p["step_s"] - 1 for r, p in pairs])
        both = [(b, r) for b, r in zip(base, rs, strict=False) if b is not None and r is not None]
        if both and system not in ("plain", BASE_CKPT):  # memcpy too: the floor's stall
            entry[f"step_vs_{BASE_CKPT}"] = ratios(*_cols(both, "step_s"))
            entry[f"stall_vs_{BASE_CKPT}"] = ratios(*_cols(both, "stall_s"))
        entry["failed"] = len(rs) - len(ok)
        out[system] = entry
    return out


def _cols(
    pairs: Iterable[tuple[dict[str, Any], dict[str, Any]]], key: str
) -> tuple[list[float], list[float]]:
    a, b = zip(*((x[key], y[key]) for x, y in pairs), strict=True)
    return list(a), list(b)


def summarize_recovery(runs: dict[str, list[dict[str, Any] | None]]) -> dict[str, Any]:
    """Per system the stats of its recovery seconds, its bit-exactness per run, and the
    ratio of its seconds to tierswap's ``BASE_RECOVERY`` round by round."""
    out: dict[str, Any] = {}
    base = runs.get(BASE_RECOVERY, [])
    for system, rs in runs.items():
        ok = [r for r in rs if r is not None]
        if not ok:
            out[system] = {"failed": len(rs)}
            continue
        entry: dict[str, Any] = {
            "seconds": stats([r["seconds"] for r in ok]),
            "exact": [r["exact"] for r in ok],
            "differing": next((r["differing"] for r in ok if r["differing"]), []),
            "rng_differing": next((r["rng_differing"] for r in ok if r["rng_differing"]), []),
            "kill_from": sorted({r["kill_from"] for r in ok}),
            "failed": len(rs) - len(ok),
        }
        both = [(b, r) for b, r in zip(base, rs, strict=False) if b is not None and r is not None]
        if both and system != BASE_RECOVERY:
            entry[f"vs_{BASE_RECOVERY}"] = ratios(*_cols(both, "seconds"))
        out[system] = entry
    return out


_D = TierswapConfig()
SETTINGS = {
    "tierswap": f"tierswap run --nodes 2 --threads 1 (defaults: {_D.tier0_slots} slots, "
    f"{TierswapConfig(persist='x').tier0_slots} with --persist, {_D.peer_slots} peer slots, 1 full "
    "replica: parity needs 3 nodes); tier0: --replicas 0; tier012: --persist <local dir> "
    "--persist-every 1",
    "dlrover": "dlrover-run --standalone --nproc_per_node 2 --max_restarts 1 (its local master "
    "started by bench/peers/dlrover_standalone.py); DdpCheckpointer.save_checkpoint(step, "
    "{model, optim, step}, storage_type=MEMORY) every step; the loaded state cloned",
    "torchft": "torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms "
    "10000 (README); 2 replica groups of 1 rank, each under torchrun --max-restarts 1; "
    "Manager(min_replica_size=1, ProcessGroupGloo(timeout=5 s), timeout=30 s, default "
    "HTTP checkpoint transport); trains until 14 steps are committed and the last had both "
    "groups",
    "torchrun-dcp": "torchrun --max-restarts 1 --monitor-interval 0.1; dcp.save every step "
    "and a latest marker, the restarted attempt loads the newest",
    "dcp-async": "dcp.async_save every step on a gloo group of its own, the previous save "
    "waited for first (stall includes that wait)",
    "torch-save": "rank 0 torch.save to a temporary file, flush + os.fsync, os.replace",
}


def _fmt_s(s: Stats | None, scale: float = 1.0, unit: str = "") -> str:
    if s is None:
        return ""
    m, lo, hi = (_num(s[k] * scale) for k in ("median", "min", "max"))
    return f"{m}{unit} ({lo}–{hi})"


def _num(x: float) -> str:
    """Three significant digits, without an exponent below a million."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = res["config"]
    console = Console(width=200)
    t = Table(
        title=f"a checkpoint every step, {cfg['size_mib']} MiB per rank, 2 ranks, "
        f"{cfg['repeats']} rounds: median (min–max)"
    )
    for col in (
        "system",
        "step",
        "overhead vs plain",
        "stall / checkpoint",
        f"step vs {BASE_CKPT}",
        f"stall vs {BASE_CKPT}",
        "failed",
    ):
        t.add_column(col)
    for system, e in res["checkpoint"].items():
        if "step_s" not in e:
            t.add_row(system, "failed", "", "", "", "", str(e["failed"]))
            continue
        o = e.get("overhead")
        t.add_row(
            system,
            _fmt_s(e["step_s"], 1e3, " ms"),
            "" if o is None else _fmt_s(o, 100, " %"),
            _fmt_s(e["stall_s"], 1e3, " ms"),
            _fmt_s(e.get(f"step_vs_{BASE_CKPT}"), 1, "x"),
            _fmt_s(e.get(f"stall_vs_{BASE_CKPT}"), 1, "x"),
            str(e["failed"]),
        )
    console.print(t)
    t = Table(
        title=f"recovery: rank {cfg['victim_rank']} killed after step {cfg['kill_step']}, "
        "to every rank's next step (s)"
    )
    for col in ("system", "recovery", "bit-exact", f"vs {BASE_RECOVERY}", "failed"):
        t.add_column(col)
    for system, e in res["recovery"].items():
        if "seconds" not in e:
            t.add_row(system, "failed", "", "", str(e["failed"]))
            continue
        exact = [x for x in e["exact"] if x is not None]
        t.add_row(
            system,
            _fmt_s(e["seconds"]),
            exactness(exact) if exact else "no reference",
            _fmt_s(e.get(f"vs_{BASE_RECOVERY}"), 1, "x"),
            str(e["failed"]),
        )
    console.print(t)
    if "overhead" in res:
        overhead.report(res["overhead"])
    for system, why in res["not_run"].items():
        console.print(f"not run: {system}: {why}")
    for f in res["failures"]:
        console.print(f"failed: {f[:400]}")
    console.print(f"took {cfg['seconds']:.0f} s")


def config_from(args: Any) -> Config:
    """The benchmark's Config from the ``tierswap bench`` arguments."""
    given = args.size_mib
    sizes = [384] if given is None else [given] if isinstance(given, int) else list(given)
    if len(sizes) != 1:
        raise ValueError(f"--size-mib {' '.join(map(str, sizes))}: bench peers takes one size")
    python = Path(args.peers_python) if args.peers_python else default_peers_python()
    only = getattr(args, "only", None)
    return Config(
        size_mib=int(sizes[0]),
        repeats=args.repeats,
        peers_python=python,
        only=None if only is None else frozenset(only),
        budget_s=float(getattr(args, "budget_s", None) or 0.0),
    )


def main(args: Any, runner: Callable[[Config], dict[str, Any]] = run) -> int:
    """``tierswap bench peers [--size-mib N] [--repeats N] [--json PATH] [--peers-python
    PATH] [--only SYSTEM ...]``."""
    res = runner(config_from(args))
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0

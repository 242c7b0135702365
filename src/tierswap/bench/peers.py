"""``tierswap bench peers``: the tools a user would pick instead of tierswap, on the same
model in the same run, interleaved with tierswap's own runs.

The model is the reference MLP (``tierswap.examples.mlp``: 384 MiB of state per rank by
default, DDP on 2 ranks, 1 torch thread each, batch 32); tierswap trains it with
``examples/train_mlp.py``, the peers with ``bench/peers/train_peer.py`` in the peers' own
Python (``--peers-python``, made by ``make bench-peers``). Every job runs with torch's
allocator on transparent huge pages (``peerjobs.same_env``, tierswap's default for its
workers). Rounds interleave every system, the order flipped every other round.

A) a checkpoint every step, 14 steps: the median step (steps 4 to 12, rank 0's step ends),
the stall per checkpoint (per step the longest any rank spent in the checkpoint call,
median over those steps) and the step overhead against the plain run of the same round:
``plain`` (tierswap's script with ``--plain``), ``memcpy`` (the same with a bare memcpy
of the state on a thread every step: the floor of any copy, ``bare.BareCopy``), ``stream``
(and each copy sent to the other rank over TCP: the floor of tiers 0+1,
``bare.BareStream``), tierswap tier 0, tiers 0+1 and 0+1+2 (``--persist`` to a local
folder every step), DLRover's flash checkpoint to memory, ``dcp.async_save`` and
``torch.save`` (rank 0, fsynced, renamed over the last).

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
tierswap's ``plain``, ``memcpy``, ``stream``, ``tier0`` and ``tier01`` jobs, and their
pinned twins (tierswap's own work on a core of its own) interleaved with them, with the
agents' CPU sampled. Its stall is the median over every rank's steps, the checkpoint
table's the longest rank's per step.

Modules: this one (the run's configuration, its rounds and one job's run), ``peerjobs``
(the systems, their command lines and environment, the shared places a job is cleaned
of), ``peeroutput`` (reading a job's times, kill and final state) and ``peersummary``
(the summaries over the rounds and their tables).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierswap.bench import limits, overhead, peerjobs, peeroutput, peersummary, recovery
from tierswap.bench.peerjobs import (
    ACCOUNTED,
    CHECKPOINT,
    CONTROLS,
    FIRST,
    KILL,
    OVERHEAD,
    OWN_REFERENCE,
    PEER_LIBS,
    PINNED,
    RECOVERY,
    REFERENCE,
    STEPS,
    VICTIM,
)


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
    """Seconds the whole run may take (``bench all`` gives the lesser of its deadline and
    what is left of its own budget, less a margin): a round that would end past it, at the
    pace of the rounds before, is not started, and the report says how many ran; the first
    two always run, within :attr:`deadline_s`. 0: no budget."""
    deadline_s: float = 0.0
    """Seconds past which no round may end, the first two included: where ``bench all``
    kills the run, less a margin (a run killed there loses every round). 0: none."""

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


@dataclass(slots=True)
class Bench:
    """One run of the benchmark: its folder, Pythons, and what it collected."""

    cfg: Config
    work: Path
    python: str
    """The Python the peer scripts run with."""
    scripts: Path
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

    @property
    def commands(self) -> peerjobs.Commands:
        """The command lines of this run's jobs, from its configuration and Pythons."""
        return peerjobs.Commands(
            steps=self.cfg.steps,
            size_mib=self.cfg.size_mib,
            python=self.python,
            scripts=self.scripts,
        )

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
        ours = peerjobs.tierswap_side(system)
        if ours:
            cmd = self.commands.tierswap_cmd(system, folder, out)
        else:
            cmd = self.commands.peer_cmd(system, folder, kind, out)
        before = peerjobs.leftovers()
        env_tmp = folder / "tmp"
        env_tmp.mkdir()
        run_dir = folder / "run" if ours else None
        t0 = time.monotonic()
        with watch(folder / "run") if watch is not None else contextlib.nullcontext():
            code = peerjobs.bounded(cmd, folder, self.cfg.timeout_s, env_tmp, run_dir)
        took = time.monotonic() - t0
        peerjobs.clean(before, run_dir)
        shutil.rmtree(folder / "ckpt", ignore_errors=True)
        shutil.rmtree(folder / "persist", ignore_errors=True)
        shutil.rmtree(env_tmp, ignore_errors=True)
        print(f"  {system} ({kind}): exit {code} in {took:.1f} s", flush=True)
        if code != 0:
            log = (folder / "output.log").read_text(errors="replace")
            self.failures.append(f"{system} ({kind}), exit {code} after {took:.0f} s: "
                                 f"{peeroutput.failure_text(log)}")  # fmt: skip
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
        notes = peeroutput.read_notes(folder)
        costs = figures = None
        try:
            costs = peeroutput.checkpoint_costs(notes, self.cfg.steps)
        except ValueError as e:
            self.failures.append(f"{system} (checkpoint): {e}")
        if reference is not None and costs is not None:
            self.references[reference] = folder
        if sample:
            try:
                if sampler is None:
                    raise ValueError("its agents' CPU was not sampled")
                snapshots = system.removesuffix(PINNED) not in CONTROLS
                pinned = overhead.agent_cpus() if system.endswith(PINNED) else None
                figures = overhead.job_costs(
                    notes, sampler, snapshots, self.cfg.size_mib, self.cfg.steps, pinned
                )
            except ValueError as e:
                self.failures.append(f"{system} (overhead): {e}")
        return costs, figures

    def recovery(self, system: str) -> dict[str, Any] | None:
        ref = self.reference(REFERENCE[system])
        folder = self.job(system, "recovery")
        if folder is None:
            return None
        notes = peeroutput.read_notes(folder)
        fired = peeroutput.injected_kill(folder / "run")
        first = next((n for n in notes if n["rank"] == VICTIM and n["step"] == KILL), None)
        # the victim's own entry, unless it died in a buffer: then the first step-8 entry
        # of its rank is a redo by its replacement, later than the injection
        own = first is not None and (fired is None or float(first["t"]) <= fired)
        kill_t = None if own else fired
        if system in ACCOUNTED:  # its own events, whatever its times file says
            try:
                acc = recovery.account(folder / "run")
                self.accounts.setdefault(ACCOUNTED[system], []).append(acc)
            except (KeyError, ValueError, IndexError, TypeError, OSError) as e:
                self.failures.append(f"{system} (its account of the way back): {e!r}")
        try:
            seconds = peeroutput.recovery_seconds(notes, kill_t)
        except ValueError as e:
            self.failures.append(f"{system} (recovery): {e}")
            return None
        diff, rng = ([], []) if ref is None else peeroutput.same_bits(ref / "out", folder / "out")
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
    scripts = peerjobs.peers_folder()
    have = peerjobs.probe(cfg.peers_python)
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
            "settings": peerjobs.SETTINGS,
            "env": peerjobs.same_env(),
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
            if not _round_fits(cfg.budget_s, t_start, rounds_start, r, cfg.deadline_s):
                print(f"round {r + 1} of {cfg.repeats} not run: the budget", flush=True)
                out["config"]["rounds_run"] = r
                out["config"]["stopped"] = (
                    f"{r} of {cfg.repeats} rounds: another would end past the run's budget "
                    f"of {cfg.budget_s:.0f} s (its deadline {cfg.deadline_s:.0f} s) at the "
                    "pace of those before"
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
    out["checkpoint"] = peersummary.summarize_checkpoint(ck)
    out["recovery"] = peersummary.summarize_recovery(rc)
    out["failures"] = bench.failures
    out["config"]["seconds"] = time.monotonic() - t_start
    return out


MIN_ROUNDS = 2
"""Rounds run whatever the budget: a median with a spread needs two; the budget cuts the
rounds past them (a third took 5 to 8 minutes at 384 MiB, 12-05 and 12-06)."""


def _round_fits(
    budget_s: float, t_start: float, rounds_start: float, done: int, deadline_s: float = 0.0
) -> bool:
    """Whether round ``done + 1`` ends within ``budget_s`` of ``t_start``, at the pace of
    the rounds done (each as long as their mean); the first :data:`MIN_ROUNDS` run
    whatever the budget, but none that would end past ``deadline_s``; the first always."""
    if not done:
        return True
    now = time.monotonic()
    ends = now + (now - rounds_start) / done
    if deadline_s and ends > t_start + deadline_s:
        return False
    return not budget_s or done < MIN_ROUNDS or ends <= t_start + budget_s


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


def config_from(args: Any) -> Config:
    """The benchmark's Config from the ``tierswap bench`` arguments."""
    given = args.size_mib
    sizes = [384] if given is None else [given] if isinstance(given, int) else list(given)
    if len(sizes) != 1:
        raise ValueError(f"--size-mib {' '.join(map(str, sizes))}: bench peers takes one size")
    python = Path(args.peers_python) if args.peers_python else peerjobs.default_peers_python()
    only = getattr(args, "only", None)
    return Config(
        size_mib=int(sizes[0]),
        repeats=args.repeats,
        peers_python=python,
        only=None if only is None else frozenset(only),
        budget_s=float(getattr(args, "budget_s", None) or 0.0),
        deadline_s=float(getattr(args, "deadline_s", None) or 0.0),
    )


def main(args: Any, runner: Callable[[Config], dict[str, Any]] = run) -> int:
    """``tierswap bench peers [--size-mib N] [--repeats N] [--json PATH] [--peers-python
    PATH] [--only SYSTEM ...]``."""
    res = runner(config_from(args))
    peersummary.report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0

"""``tierswap bench overhead``: what a snapshot every step costs the reference model's
training, as a whole job, the plain way and pinned the way a GPU host is built.

Runs of ``tierswap run --nodes 2 --threads 1 examples/train_mlp.py`` (384 MiB of state per
rank by default), interleaved, order flipped every round:

- ``plain``: the same job, trained without ``job.steps`` (no restore, no snapshot): the
  baseline;
- ``memcpy``: ``plain`` with a bare memcpy of the state on a thread every step, overlapped
  and waited for as the snapshot's copy is (``examples/train_mlp.py --memcpy``): the floor
  of any snapshot, its copy's CPU the yardstick of the snapshot's under the same load;
- ``stream``: ``memcpy`` with each copy also sent to the other rank over one loopback TCP
  connection and received there into a reused buffer, by threads where the copy runs, the
  next optimizer step waiting for it as ``--max-redo 1`` waits for tier 1
  (``--stream``, :class:`tierswap.examples.bare.BareStream`): the floor of tiers 0+1, its
  threads' CPU the yardstick of the agents' under the same load;
- ``tier0``: a snapshot every step into the node's memory (``--replicas 0``);
- ``tier01``: and replicated into the other node's memory (the default).

each unpinned, and pinned: the trainers on their cores and tierswap's own work (agents,
launcher, the workers' copy threads) on a core of its own (``--agent-cpus`` /
``--worker-cpus``; on a 2-core machine both trainers share core 0, the rest core 1, so
its step times are not the unpinned ones: only ratios against the same pinning count).

The jobs are ``tierswap bench peers``' own: its rounds run these ten beside the peers
(``bench all`` takes the figures from there); this command runs only them.

Per run, from the trainers' own step times (``--times``): the median step (steps 4 to
the second last: the first snapshot allocates its slots), the trainer's stall per step
(its fence wait and the synchronous part), apart from its wait for tier 1 (``--max-redo``
1: step t's optimizer step waits for tier 1 to commit step t - 1), the copy threads' CPU
seconds per GiB, and the agents' CPU seconds per GiB snapshotted in that window, sampled
from ``/proc``; beside them the
CPU seconds per GiB of a plain memcpy on this machine, alone (``bench/limits.py``), and
of the ``memcpy`` run's copy thread, under the same training load; and tier 1's agents'
against the ``stream`` run's sending and receiving threads, round by round. In a pinned
run, also how long the core of tierswap's own work was busy per step (whatever ran on it,
kernel included, from ``/proc/stat``), tiers 0+1's against the stream's round by round:
tier 1 must be done with a step within the next step's forward and backward, so once that
core has more to do per step than that, the step waits for it. And in every run, the time
the hypervisor took from the machine's CPUs per step (steal): on a VM whose host is busy
a job runs slower with nothing of its own changed, and this says when.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tierswap.bench.common import stats

MODES = ("plain", "memcpy", "stream", "tier0", "tier01")
FIRST = 4
"""Steps before this one are left out: the first snapshots allocate their slots."""
CLK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float | None:
    """User + system CPU seconds of a process so far, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK


def cpu_times() -> dict[int, tuple[float, float]]:
    """Per CPU of this machine, the seconds it has spent busy so far and the seconds the
    hypervisor has taken from it (``/proc/stat``: busy is all but idle, I/O wait and
    steal; steal is time a virtual CPU had work and was not run), or nothing where that
    cannot be read."""
    out: dict[int, tuple[float, float]] = {}
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            busy = sum(ticks) - ticks[3] - ticks[4] - ticks[7]
            out[int(name[3:])] = (busy / CLK, ticks[7] / CLK)
    return out


class Sampler:
    """Samples the CPU time of a job's agents (their pids from its event log), and how busy
    each CPU of the machine is, while the ``with`` block runs."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.samples: dict[int, list[tuple[float, float]]] = {}
        self.cores: list[tuple[float, dict[int, float]]] = []
        self.stolen: list[tuple[float, float]] = []
        """The hypervisor's steal, all CPUs together, at each sample."""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def _pids(self) -> list[int]:
        try:
            lines = (self.run_dir / "events.jsonl").read_text().splitlines()
        except OSError:
            return []
        evs = [json.loads(x) for x in lines if '"node_joined"' in x]
        return [int(e["pid"]) for e in evs]

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            now = time.monotonic()
            times = cpu_times()
            self.cores.append((now, {cpu: busy for cpu, (busy, _) in times.items()}))
            self.stolen.append((now, sum(steal for _, steal in times.values())))
            for pid in self._pids():
                if (cpu := _cpu(pid)) is not None:
                    self.samples.setdefault(pid, []).append((now, cpu))

    def between(self, t0: float, t1: float) -> float:
        """CPU seconds all agents spent from ``t0`` to ``t1``, each agent's sampled total
        read at both ends between the samples around them (an agent not sampled on both
        sides of the window counts 0)."""
        total = 0.0
        for series in self.samples.values():
            a, b = _at(series, t0), _at(series, t1)
            if a is not None and b is not None:
                total += b - a
        return total

    def busy(self, cpus: frozenset[int], t0: float, t1: float) -> float | None:
        """Seconds ``cpus`` spent busy from ``t0`` to ``t1`` (whatever ran there), their
        sampled busy time read at both ends between the samples around them, or None
        without samples on both sides."""
        series = [(t, sum(c.get(cpu, 0.0) for cpu in cpus)) for t, c in self.cores]
        a, b = _at(series, t0), _at(series, t1)
        return None if a is None or b is None else b - a

    def steal(self, t0: float, t1: float) -> float | None:
        """Seconds the hypervisor took from this machine's CPUs (all together) from ``t0``
        to ``t1``, read as :meth:`busy` is, or None without samples on both sides."""
        a, b = _at(self.stolen, t0), _at(self.stolen, t1)
        return None if a is None or b is None else b - a


def _at(series: Sequence[tuple[float, float]], t: float) -> float | None:
    """A running total sampled as ``(time, total)`` pairs, at ``t``: linear between the
    samples on either side, as a steady rate between them would make it; None where no
    sample lies on one side of ``t``."""
    for (ta, a), (tb, b) in itertools.pairwise(series):
        if ta <= t <= tb:
            return a if tb == ta else a + (b - a) * (t - ta) / (tb - ta)
    return None


def agent_cpus() -> frozenset[int]:
    """Where a pinned run puts tierswap's own work: the last CPU this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError("a pinned run needs 2 CPUs or more: one for the agents, one for work")
    return frozenset(cpus[-1:])


def pin_args() -> tuple[str, ...]:
    """``tierswap run`` options of a pinned run: tierswap's own work on the last CPU
    (:func:`agent_cpus`), the trainers on the others."""
    mine = agent_cpus()
    rest = sorted(set(os.sched_getaffinity(0)) - mine)
    return ("--agent-cpus", ",".join(map(str, sorted(mine))),
            "--worker-cpus", ",".join(map(str, rest)))  # fmt: skip


def job_costs(
    notes: Sequence[dict[str, Any]], sampler: Sampler, snapshots: bool, size_mib: int,
    steps: int, pinned: frozenset[int] | None = None,
) -> dict[str, float]:  # fmt: skip
    """One job's figures from its trainers' ``--times`` entries and its agents' CPU
    (``snapshots``: the job snapshots, so its agents' CPU is per GiB snapshotted); for a
    run ``pinned`` with tierswap's own work on those CPUs, how long they were busy per step
    (``agent_core_s``): with ``--max-redo 1`` the next optimizer step waits for tier 1, so
    a core that must do more than the trainers' forward and backward last shows in the
    step, as tier 1's wait."""
    ends = {n["step"]: float(n["t"]) for n in notes if n["rank"] == 0}
    window = range(FIRST, steps - 1)
    step_s = [ends[s] - ends[s - 1] for s in window if s in ends and s - 1 in ends]
    if not step_s or FIRST - 1 not in ends or steps - 2 not in ends:
        raise ValueError(f"no step ends of rank 0 in steps {FIRST - 1} to {steps - 2}")
    # the trainer's own stall (fence wait and the synchronous part) apart from its wait
    # for tier 1 (--max-redo), which bounds the work a node failure loses, not a copy's
    mine = [n for n in notes if n["step"] in window]
    gate = [float(n["gate"]) for n in mine]
    stall = [float(n["stall"]) - g for n, g in zip(mine, gate, strict=True)]
    copy_cpu = [float(n["copy_cpu"]) for n in notes if n["step"] in window]
    # the bare stream's threads, both ends of one rank's state (the stream control only)
    net_cpu = [float(n["net_cpu"]) for n in notes if n["step"] in window and "net_cpu" in n]
    state = size_mib * 2**20
    snapshotted = 2 * state * (steps - 1 - FIRST) if snapshots else 0  # both ranks
    agents = sampler.between(ends[FIRST - 1], ends[steps - 2])
    out = {
        "step_s": statistics.median(step_s),
        "stall_s": statistics.median(stall),
        "gate_s": statistics.median(gate),
        "copy_cpu_s_per_gib": statistics.median(copy_cpu) / (state / 2**30),  # plain's: 0
        "agents_cpu_s": agents,
        "agents_sampled": float(len(sampler.samples)),
        "agents_cpu_s_per_gib": agents / (snapshotted / 2**30) if snapshotted else 0.0,
    }
    if net_cpu:
        out["net_cpu_s_per_gib"] = statistics.median(net_cpu) / (state / 2**30)
    stolen = sampler.steal(ends[FIRST - 1], ends[steps - 2])
    if stolen is not None:  # (a job too short for two samples has none)
        out["steal_s"] = stolen / (steps - 1 - FIRST)  # a slow job on a busy host says so
    if pinned:
        busy = sampler.busy(pinned, ends[FIRST - 1], ends[steps - 2])
        if busy is None:
            raise ValueError("the agents' core was not sampled over the job's steps")
        out["agent_core_s"] = busy / (steps - 1 - FIRST)
    return out


def summarize(
    runs: Mapping[str, Sequence[dict[str, float] | None]], memcpy_bps: float, size_mib: int,
    steps: int, tcp_cpu: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Per run key (``tier0``, ``tier01_pinned``, ...) the stats of its figures, its
    overhead against the plain run of the same pinning in the same round (a round where
    either failed is left out), its CPU per GiB against a one-core memcpy alone, and its
    copy's CPU against the ``memcpy`` run's of the same pinning, round by round; with
    ``tcp_cpu`` (one loopback TCP stream's CPU seconds per GiB, both ends) tier 1's
    agents' CPU against it: each GiB snapshotted is sent once and received once."""
    memcpy_cpu = 2**30 / memcpy_bps  # one core: CPU seconds per GiB
    out: dict[str, Any] = {"size_mib": size_mib, "steps": steps,
                           "cpus": len(os.sched_getaffinity(0)),
                           "memcpy_cpu_s_per_gib": memcpy_cpu}  # fmt: skip
    if tcp_cpu:
        out["tcp_cpu_s_per_gib"] = tcp_cpu
    for key, rs in runs.items():
        pin = "_pinned" if key.endswith("_pinned") else ""
        base = runs.get("plain" + pin, [])
        ok = [r for r in rs if r is not None]
        pairs = [(r, b) for r, b in zip(rs, base, strict=False) if r is not None and b is not None]
        if not pairs:  # every round failed, or its baseline did
            out[key] = {"failed": len(rs) - len(ok), "unpaired": len(ok)}
            continue
        names = dict.fromkeys(k for r in ok for k in r)  # (steal: only where sampled)
        entry: dict[str, Any] = {k: stats([r[k] for r in ok if k in r]) for k in names}
        entry["overhead"] = stats([r["step_s"] / b["step_s"] - 1 for r, b in pairs])
        entry["stall_of_step"] = entry["stall_s"]["median"] / entry["step_s"]["median"]
        entry["gate_of_step"] = entry["gate_s"]["median"] / entry["step_s"]["median"]
        if "steal_s" in entry:
            entry["steal_of_step"] = entry["steal_s"]["median"] / entry["step_s"]["median"]
        entry["agents_vs_memcpy"] = entry["agents_cpu_s_per_gib"]["median"] / memcpy_cpu
        entry["copy_vs_memcpy"] = entry["copy_cpu_s_per_gib"]["median"] / memcpy_cpu
        if tcp_cpu and key.startswith("tier01"):
            entry["agents_vs_tcp"] = entry["agents_cpu_s_per_gib"]["median"] / tcp_cpu
        bare = runs.get("memcpy" + pin, [])
        same = _by_round(rs, bare, "copy_cpu_s_per_gib", "copy_cpu_s_per_gib")
        if same and key.startswith("tier"):
            entry["copy_vs_bare"] = stats(same)
        stream = runs.get("stream" + pin, [])
        sent = _by_round(rs, stream, "agents_cpu_s_per_gib", "net_cpu_s_per_gib")
        if sent and key.startswith("tier01"):  # each GiB sent once and received once in both
            entry["agents_vs_bare_stream"] = stats(sent)
        counted = [r if b is not None else None for r, b in zip(rs, base, strict=False)]
        floor = _by_round(counted, stream, "step_s", "step_s")  # the rounds its overhead has
        if floor and key.startswith("tier01"):  # its step against its floor's, round by round
            entry["step_vs_stream"] = stats(floor)
        core = _by_round(rs, stream, "agent_core_s", "agent_core_s") if pin else []
        if core and key.startswith("tier01"):  # the agents' core's work against the floor's
            entry["agent_core_vs_stream"] = stats(core)
        entry["failed"] = len(rs) - len(ok)
        out[key] = entry
    return out


def _by_round(
    rs: Sequence[dict[str, float] | None], others: Sequence[dict[str, float] | None],
    mine: str, theirs: str,
) -> list[float]:  # fmt: skip
    """``mine`` of each run over ``theirs`` of the other job's run in the same round, for
    the rounds where both ran and the other's figure is not 0."""
    return [r[mine] / o[theirs] for r, o in zip(rs, others, strict=False)
            if r is not None and o is not None and mine in r and o.get(theirs)]  # fmt: skip


def run(
    size_mib: int, repeats: int, steps: int = 14, modes: tuple[str, ...] = MODES,
    pinned: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Every mode in ``modes`` (``plain`` among them: the baseline), unpinned and (with
    ``pinned``) pinned, interleaved, ``repeats`` times: ``bench peers`` with only these."""
    from tierswap.bench import peers

    if unknown := sorted(set(modes) - set(MODES)):
        raise ValueError(f"modes {unknown} are not among {list(MODES)}")
    if "plain" not in modes:
        raise ValueError(f"modes {modes} leave out 'plain', the baseline of the others")
    cfg = peers.Config(size_mib=size_mib, repeats=repeats, peers_python=None,
                       only=frozenset(modes), steps=steps, pinned=pinned)  # fmt: skip
    res = peers.run(cfg)
    if res["failures"]:
        raise RuntimeError("bench overhead: jobs failed:\n" + "\n".join(res["failures"]))
    out: dict[str, Any] = res["overhead"]
    return out


TARGETS = {"tier0": 0.05, "tier01": 0.10, "tier0_pinned": 0.02, "tier01_pinned": 0.03}
"""Step overhead targets (the "fast at real sizes" issue)."""


def report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"snapshot every step, {res['size_mib']} MiB per rank, 2 ranks: step-time overhead "
        f"against the same job without snapshots ({res['cpus']} CPUs)"
    )
    table = Table(title=title)
    for col in ("run", "step", "overhead (min–max)", "target", "stall / step",
                "tier-1 wait / step", "copy CPU-s/GiB", "vs bare memcpy's", "agents CPU-s/GiB",
                "vs memcpy (agents)", "vs TCP (agents)", "vs bare stream (agents)",
                "step / the stream's", "agents' core busy / step",
                "stolen / step"):  # fmt: skip
        table.add_column(col)
    for key in (m + pin for pin in ("", "_pinned") for m in MODES):
        if key not in res:
            continue
        e = res[key]
        if "step_s" not in e:
            failed = f"failed: {e['failed']}, without a baseline: {e['unpaired']}"
            table.add_row(key.replace("_", ", "), failed, *[""] * (len(table.columns) - 2))
            continue
        o = e["overhead"]
        table.add_row(
            key.replace("_", ", "),
            f"{e['step_s']['median'] * 1e3:.0f} ms",
            ""
            if key.startswith("plain")
            else f"{o['median'] * 100:+.1f} % ({o['min'] * 100:+.1f} – {o['max'] * 100:+.1f})",
            f"<= {TARGETS[key] * 100:.0f} %" if key in TARGETS else "",
            f"{e['stall_of_step'] * 100:.2f} %",
            f"{e['gate_of_step'] * 100:.2f} %" if key.startswith(("tier01", "stream")) else "",
            f"{e['copy_cpu_s_per_gib']['median']:.3f}",
            _ratio(e.get("copy_vs_bare")),
            f"{e['net_cpu_s_per_gib']['median']:.3f} (its threads)"
            if "net_cpu_s_per_gib" in e
            else f"{e['agents_cpu_s_per_gib']['median']:.3f}",
            f"{e['agents_vs_memcpy']:.2f}x" if key.startswith("tier") else "",
            f"{e['agents_vs_tcp']:.2f}x" if "agents_vs_tcp" in e else "",
            _ratio(e.get("agents_vs_bare_stream")),
            _ratio(e.get("step_vs_stream")),
            f"{e['agent_core_s']['median'] * 1e3:.0f} ms" if "agent_core_s" in e else "",
            f"{e['steal_of_step'] * 100:.1f} %" if "steal_of_step" in e else "",
        )
    Console(width=180).print(table)
    print(f"a plain memcpy here: {res['memcpy_cpu_s_per_gib']:.3f} CPU-s/GiB", end="")
    tcp = res.get("tcp_cpu_s_per_gib")
    print(f"; one loopback TCP stream, both ends: {tcp:.3f} CPU-s/GiB" if tcp else "")


def _ratio(s: dict[str, Any] | None) -> str:
    return "" if s is None else f"{s['median']:.2f}x ({s['min']:.2f} – {s['max']:.2f})"


def main(args: Any) -> int:
    from tierswap.bench.common import run_and_report

    return run_and_report(args, 384, lambda size, rep: run(size, rep), report)

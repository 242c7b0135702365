"""CPU affinity, the way a GPU host is built: the trainers keep their cores, and
tierswap's own work (agents, the launcher, the workers' snapshot copy and restore fetch
threads) runs on cores of its own (``--agent-cpus``, ``--worker-cpus``)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

AGENT_ENV = "TIERSWAP_AGENT_CPUS"
WORKER_ENV = "TIERSWAP_WORKER_CPUS"
MACHINE_ENV = "TIERSWAP_MACHINE_CPUS"
"""The CPUs the launcher could use before it pinned itself: what the agents it starts
(which inherit its pinned mask) take the workers' default from."""


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as Linux writes one (``0-3,8,10-11``); ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(
                f"CPU list {text!r}: {part!r} is not a CPU number or a range like 0-3"
            ) from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a range of CPU numbers")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def _set(tid: int, cpus: frozenset[int], option: str) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError as e:
        have = sorted(os.sched_getaffinity(0))
        raise ValueError(
            f"{option} {_text(cpus)}: this machine lets this process run on CPUs "
            f"{_text(frozenset(have))} ({e}); pick CPUs among those"
        ) from e


def _text(cpus: frozenset[int]) -> str:
    """``cpus`` as Linux writes a CPU list: runs as ranges (``0-3,8``)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def pin_process(cpus: frozenset[int], option: str) -> None:
    """Every thread of this process (and those it starts later) onto ``cpus``."""
    for task in Path("/proc/self/task").iterdir():
        try:
            _set(int(task.name), cpus, option)
        except ValueError:
            if (Path("/proc/self/task") / task.name).exists():
                raise  # a thread that ended meanwhile cannot be pinned, nor needs to be


def pin_thread(cpus: frozenset[int] | None) -> None:
    """The calling thread onto ``cpus`` (nothing for None). A helper thread that cannot be
    pinned says so and runs where it is: its work must not fail for it."""
    if not cpus:
        return
    try:
        _set(threading.get_native_id(), cpus, "--agent-cpus")
    except ValueError as e:
        print(f"[tierswap] {threading.current_thread().name} not pinned: {e}", file=sys.stderr)


def machine_cpus() -> frozenset[int]:
    """The CPUs this machine lets the job use (as found before any pinning)."""
    text = os.environ.get(MACHINE_ENV)
    return parse_cpus(text) if text else frozenset(os.sched_getaffinity(0))


def worker_cpus(agent_cpus: str | None, worker_cpus: str | None) -> str | None:
    """The workers' CPU list on this machine: ``worker_cpus`` as given, else (with
    ``agent_cpus``) every CPU of ``machine_cpus`` but the agents'."""
    if worker_cpus or not agent_cpus:
        return worker_cpus
    rest = machine_cpus() - parse_cpus(agent_cpus)
    if not rest:
        raise ValueError(
            f"--agent-cpus {agent_cpus}: that is every CPU this machine lets the job use; "
            "leave some to the workers, or give --worker-cpus"
        )
    return _text(rest)


def check_cpus_here(agents: str | None, workers: str | None, what: str = "") -> None:
    """ValueError naming the option and the fix where a CPU list names CPUs this machine
    does not let the job use, or ``agents`` leaves the workers none: said by the
    launcher on its own host, before it joins a job, not by its agent or workers after.
    Whether a CPU may be used is asked of the kernel (a thread pinned to it, for a moment):
    a launcher started on fewer CPUs than its cgroup allows (``taskset``, ``srun
    --cpu-bind``) may still pin its agents and workers to the others, as they will."""
    for option, text in (("--agent-cpus", agents), ("--worker-cpus", workers)):
        try:
            cpus = parse_cpus(text) if text else frozenset()
        except ValueError as e:
            raise ValueError(f"{what} {option}: {e}".lstrip()) from None
        if missing := _unusable(cpus):
            raise ValueError(
                f"{what} {option} {text}: this machine does not let the job run on CPUs "
                f"{_text(missing)}; pick CPUs among {_text(machine_cpus())}".lstrip()
            )
    try:
        worker_cpus(agents, workers)
    except ValueError as e:
        raise ValueError(f"{what} {e}".lstrip()) from None


def _unusable(cpus: frozenset[int]) -> frozenset[int]:
    """The CPUs of ``cpus`` that a thread may not be pinned to, each tried alone (the
    kernel takes a mask with some CPU it allows, ignoring the others) by a thread made for
    the question, then gone."""
    bad: set[int] = set()

    def probe() -> None:
        for cpu in sorted(cpus):
            try:
                os.sched_setaffinity(0, {cpu})  # this thread's own (Linux: per thread)
            except (OSError, OverflowError, ValueError):
                bad.add(cpu)

    t = threading.Thread(target=probe, name="tierswap-cpu-probe")
    t.start()
    t.join()
    return frozenset(bad)


def helper_cpus() -> frozenset[int] | None:
    """Where a worker's snapshot copy and restore fetch threads run: ``--agent-cpus``."""
    text = os.environ.get(AGENT_ENV)
    return parse_cpus(text) if text else None


def pin_worker() -> frozenset[int] | None:
    """A worker's own threads onto ``--worker-cpus`` (set by the launcher or the agent
    that computed it); the CPUs, or None without pinning."""
    text = os.environ.get(WORKER_ENV)
    if not text:
        return None
    cpus = parse_cpus(text)
    pin_process(cpus, "--worker-cpus")
    return cpus

"""CPU affinity, the way a GPU host is built: the trainers keep their cores, and
tierswap's own work (agents, the launcher, the workers' snapshot copy and restore fetch
threads) runs on cores of its own (``--agent-cpus``, ``--worker-cpus``)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

AGENT_ENV = "TIERSWAP_AGENT_CPUS"
WORKER_ENV = "TIERSWAP_WORKER_CPUS"


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
    return ",".join(map(str, sorted(cpus)))


def pin_process(cpus: frozenset[int], option: str) -> None:
    """Every thread of this process (and those it starts later) onto ``cpus``."""
    for task in Path("/proc/self/task").iterdir():
        try:
            _set(int(task.name), cpus, option)
        except ValueError:
            if (Path("/proc/self/task") / task.name).exists():
                raise  # a thread that ended meanwhile cannot be pinned, nor needs to be


def pin_thread(cpus: frozenset[int] | None) -> None:
    """The calling thread onto ``cpus`` (nothing for None)."""
    if cpus:
        _set(threading.get_native_id(), cpus, "--agent-cpus")


def helper_cpus() -> frozenset[int] | None:
    """Where a worker's snapshot copy and restore fetch threads run: ``--agent-cpus``."""
    text = os.environ.get(AGENT_ENV)
    return parse_cpus(text) if text else None


def pin_worker() -> None:
    """A worker's own threads onto ``--worker-cpus`` (by default, with ``--agent-cpus``
    given, every CPU of the machine but those)."""
    text, agents = os.environ.get(WORKER_ENV), helper_cpus()
    if text:
        pin_process(parse_cpus(text), "--worker-cpus")
    elif agents:
        rest = frozenset(range(os.cpu_count() or 1)) - agents
        if rest:
            pin_process(rest, "--worker-cpus")

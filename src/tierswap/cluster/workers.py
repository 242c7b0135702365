"""An agent's worker processes: started, watched, killed. Which worker runs which rank,
and when, is the agent's core's (``control/workers.py``); this only holds the processes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from tierswap.affinity import WORKER_ENV, parse_cpus
from tierswap.control.agent_events import WorkerExited


class Processes:
    def __init__(
        self, script: list[str], env: Mapping[str, str], post: Callable[[Any], None]
    ) -> None:
        self.script = script
        self.env = dict(env)
        """The environment of every worker (TIERSWAP_* of the job and of this agent)."""
        self.post = post
        self.procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
        """(local index, incarnation) -> its process."""

    def spawn(self, local: int, incarnation: int) -> None:
        """Start a worker: it imports the script, attaches and waits for a rank."""
        env = dict(self.env, TIERSWAP_LOCAL=str(local), TIERSWAP_INCARNATION=str(incarnation))
        proc = subprocess.Popen([sys.executable, *self.script], env=env)
        if cpus := env.get(WORKER_ENV):  # at once, before it imports torch (it pins again)
            with contextlib.suppress(OSError, ValueError):
                os.sched_setaffinity(proc.pid, parse_cpus(cpus))
        self.procs[(local, incarnation)] = proc

        def watch() -> None:
            code = proc.wait()
            self.post(WorkerExited(local, incarnation, code))

        threading.Thread(target=watch, name=f"tierswap-watch-{local}", daemon=True).start()

    def kill(self, local: int, incarnation: int) -> None:
        proc = self.procs.get((local, incarnation))
        if proc is not None and proc.poll() is None:
            proc.kill()  # its watcher reports the exit

    def reap(self) -> None:
        """Forget processes that have exited."""
        self.procs = {k: p for k, p in self.procs.items() if p.poll() is None}

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()
        self.procs.clear()

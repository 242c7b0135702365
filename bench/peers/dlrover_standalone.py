"""``dlrover-run --standalone`` with its local master started here first.

DLRover 0.6.1's standalone mode starts its master through torch's ``SubprocessHandler``
with the arguments of torch < 2.13 (``numa_options`` is missing), and fails before any
worker starts. This starts the same master the same way (``dlrover.python.master.main
--platform local --node_num 1``), points ``DLROVER_MASTER_ADDR`` at it (then
``dlrover-run`` uses it instead of starting its own) and runs ``dlrover-run`` with the
arguments given; the master is stopped when it ends.

    python dlrover_standalone.py --standalone --nproc_per_node 2 --max_restarts 1 script.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from launchers import exit_on_sigterm, free_port, stop, wait_listening


def main() -> int:
    exit_on_sigterm()
    port = free_port()
    job = f"peers-{os.getpid()}"
    master = subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "dlrover.python.master.main",
            "--port",
            str(port),
            "--node_num",
            "1",
            "--job_name",
            job,
            "--platform",
            "local",
        ]
    )
    try:
        wait_listening(port, master, "DLRover's master", timeout=60.0)
        env = {**os.environ, "DLROVER_MASTER_ADDR": f"127.0.0.1:{port}"}
        run = Path(sys.executable).parent / "dlrover-run"
        launcher = subprocess.Popen([str(run), *sys.argv[1:]], env=env)
        try:
            return launcher.wait()
        finally:  # an exception or a signal here: the launcher takes its ranks with it
            stop(launcher)
    finally:
        stop(master, grace=10.0)


if __name__ == "__main__":
    sys.exit(main())

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
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, master: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if master.poll() is not None:
            raise RuntimeError(f"DLRover's master exited with {master.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"DLRover's master did not listen on 127.0.0.1:{port} in {timeout} s")


def main() -> int:
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
        wait_listening(port, master)
        env = {**os.environ, "DLROVER_MASTER_ADDR": f"127.0.0.1:{port}"}
        run = Path(sys.executable).parent / "dlrover-run"
        return subprocess.call([str(run), *sys.argv[1:]], env=env)
    finally:
        master.terminate()
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()


if __name__ == "__main__":
    sys.exit(main())

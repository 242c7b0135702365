"""An etcd server for tests and ``tierswap bench hosts``: one member, a data folder of its
own, on loopback or on a network namespace's address; ended by its pid."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ETCD = shutil.which("etcd")
"""Debian's etcd-server (``make test`` installs it where it is missing)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Etcd:
    """One etcd member with a data folder of its own, on ``address``; killed by its pid."""

    def __init__(self, address: str, prefix: list[str] | None = None) -> None:
        self.data = tempfile.mkdtemp(prefix="tierswap-etcd-")
        self.port = 2379 if prefix else _free_port()
        peer = 2380 if prefix else _free_port()
        client, peers = f"http://{address}:{self.port}", f"http://{address}:{peer}"
        if ETCD is None:
            raise RuntimeError("no etcd server here: apt-get install etcd-server")
        cmd = [*(prefix or []), ETCD, "--data-dir", self.data, "--name", "t",
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peers, "--initial-advertise-peer-urls", peers,
               "--initial-cluster", f"t={peers}"]  # fmt: skip
        self.log = open(Path(self.data) / "log", "w")  # noqa: SIM115 (closed in close)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.endpoint = (address, self.port)

    def wait(self, prefix: list[str] | None = None) -> None:
        probe = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)"
        deadline = time.monotonic() + 30
        while True:
            done = subprocess.run(
                [*(prefix or []), "python3", "-c", probe, self.endpoint[0], str(self.port)],
                capture_output=True,
            )
            if done.returncode == 0:
                return
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"etcd did not start: {Path(self.data, 'log').read_text()}")
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.data, ignore_errors=True)

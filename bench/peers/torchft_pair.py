"""torchft the way its README runs it, on one machine: a lighthouse, and each replica
group under its own ``torchrun`` (here 2 groups of 1 rank, ``--max-restarts 1`` so that a
killed replica comes back and heals from the live one).

    python torchft_pair.py --groups 2 -- --size-mib 384 --times T --out O --kill-step 8

Everything after ``--`` goes to ``train_peer.py --system torchft``. The lighthouse runs
with the README's settings (``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms
10000``) on a free loopback port; this exits with the first non-zero exit of a group.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from launchers import exit_on_sigterm, free_port, stop, wait_listening

SCRIPT = Path(__file__).resolve().parent / "train_peer.py"


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    bin_dir = Path(sys.executable).parent
    port = free_port()
    lighthouse = subprocess.Popen(
        [
            str(bin_dir / "torchft_lighthouse"),
            "--min_replicas",
            "1",
            "--quorum_tick_ms",
            "100",
            "--join_timeout_ms",
            "10000",
            "--bind",
            f"127.0.0.1:{port}",
        ]
    )
    groups: list[subprocess.Popen[bytes]] = []
    try:
        wait_listening(port, lighthouse, "torchft's lighthouse")
        for g in range(args.groups):
            env = {
                **os.environ,
                "REPLICA_GROUP_ID": str(g),
                "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
            }
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "1",
                "--max-restarts",
                "1",
                "--monitor-interval",
                "0.1",
                str(SCRIPT),
                "--system",
                "torchft",
                "--groups",
                str(args.groups),
                *rest,
            ]
            groups.append(subprocess.Popen(cmd, env=env))
        codes = [g.wait() for g in groups]
        return next((c for c in codes if c != 0), 0)
    finally:
        for proc in (*groups, lighthouse):
            stop(proc)


if __name__ == "__main__":
    sys.exit(main())

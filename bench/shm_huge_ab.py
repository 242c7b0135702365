"""The step overhead of snapshots with the slots in 4 KiB pages (``/dev/shm`` as it is here,
``huge=never``) against the same slots in 2 MiB transparent huge pages (``/dev/shm``
remounted ``huge=always`` for that arm): the "4 KiB shm pages" suspect of the pinned tiers
0+1 gap. ``bench overhead``'s jobs (plain, tier0 and tier01, unpinned and pinned), each
round's two arms back to back, the order flipped every round. Needs root, to remount
``/dev/shm``; its own mount option is put back at the end, however the run ends.

What each arm's slots were made of is read from ``/proc/meminfo`` while a tier01 job runs
(``ShmemPmdMapped``: shared memory mapped in huge pages), so an arm whose slots did not
get huge pages shows as such.

    .venv/bin/python bench/shm_huge_ab.py --rounds 3 > bench/shm-huge-ab-$(date +%F).json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tierswap.bench import overhead

ARMS = {"4 KiB pages": "never", "2 MiB pages": "always"}
SHM = "/dev/shm"
MODES = ("plain", "tier0", "tier01")


def huge_option() -> str:
    """``/dev/shm``'s ``huge=`` mount option now (``never`` where none is shown), of the
    mount on top where several are stacked there (the last listed)."""
    found = None
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, where, kind, opts, *_ = line.split()
        if where == SHM and kind == "tmpfs":
            found = next((o.split("=", 1)[1] for o in opts.split(",")
                          if o.startswith("huge=")), "never")  # fmt: skip
    if found is None:
        raise RuntimeError(f"{SHM} is not a tmpfs mount here")
    return found


def remount(option: str) -> None:
    subprocess.run(["mount", "-o", f"remount,huge={option}", SHM], check=True)
    if (now := huge_option()) != option:
        raise RuntimeError(f"{SHM} still has huge={now} after a remount with huge={option}")


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) << 10
    return 0


class Peak:
    """The largest ``ShmemPmdMapped`` seen, polled every 0.2 s while in use."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, meminfo("ShmemPmdMapped"))

    def __enter__(self) -> Peak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=384)
    args = ap.parse_args()
    before = huge_option()
    try:
        return measure(args)
    finally:
        remount(before)


def measure(args: argparse.Namespace) -> int:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ARMS}
    fields = ("step_s", "stall_s", "gate_s", "overhead", "agent_core_s",
              "agents_cpu_s_per_gib", "steal_of_step")  # fmt: skip
    keys = [m + pin for m in MODES for pin in ("", "_pinned")]
    for r in range(args.rounds):
        order = list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]
        for name in order:
            remount(ARMS[name])
            with Peak() as peak, contextlib.redirect_stdout(sys.stderr):
                res = overhead.run(args.size_mib, 1, modes=MODES, pinned=True)
            keep: dict[str, Any] = {k: {f: res[k].get(f) for f in fields if f in res[k]}
                                    for k in keys if k in res}  # fmt: skip
            keep["shmem_pmd_mapped_peak"] = peak.peak
            runs[name].append(keep)
            print(name, r, json.dumps(keep), file=sys.stderr, flush=True)
    json.dump({"size_mib": args.size_mib, "arms": ARMS, "runs": runs}, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
